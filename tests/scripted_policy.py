"""A generation backend that plays a fixed script: a real implementation of the backend interface
(prompt ids in; sampled ids, logprobs and finish reason out) whose "model" writes given texts."""

from mt_grpo_trainer import Sample


class ScriptedPolicy:
    """`script[question]` is the list of model turns for that question. The turn to play is the
    number of env replies (`<result>\\n`) already in the conversation. Each token gets logprob -0.5."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer, self.script = tokenizer, script
        self.calls = []  # (number of prompts, n) per generate call: tests check batching

    def turn_text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        conversation = text.split("<|im_start|>user", 1)[1]  # skip the system prompt's examples
        question = next(q for q in self.script if q in conversation)
        turns = self.script[question]
        k = text.count("<result>\n")
        return turns[k] if k < len(turns) else ""

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1) -> list[Sample]:
        self.calls.append((len(prompts), n))
        out = []
        for ids, limit in zip(prompts, max_tokens):
            token_ids = self.tokenizer.encode(self.turn_text(ids), add_special_tokens=False)
            finish = "stop" if len(token_ids) <= limit else "length"
            token_ids = token_ids[:limit]
            out += [Sample(list(token_ids), [-0.5] * len(token_ids), finish) for _ in range(n)]
        return out
