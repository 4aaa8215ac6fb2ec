"""A generation backend that plays a fixed script: a real implementation of the backend interface
(prompt ids in; sampled ids, logprobs and finish reason out; another_round, sync_weights) whose
"model" writes given texts."""

import torch

from mt_grpo.base.completions import Sample
from mt_grpo.engine.sampling import SamplerProcessing, SamplingParams, TransformersBackend, sampler_logprobs


class ScriptedPolicy:
    """`script[question]` is the list of model turns for that question, or a list of such lists (one
    variant per sample of a group: sample j of the first turn plays variant j; later turns continue
    the variant whose first turn the conversation holds). The turn to play is the number of assistant
    turns already taken after the question. Each token gets logprob -0.5."""

    external = False
    can_submit = False

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.script = script
        self.calls = []  # (number of prompts, n) per generate call: tests check batching
        self.rounds = 0

    def turn_text(self, ids: list[int], sample: int = 0) -> str:
        text = self.tokenizer.decode(ids)
        question = max((q for q in self.script if q in text), key=lambda q: text.rindex(q))
        conversation = text[text.rindex(question):]
        k = conversation.count("<|im_start|>assistant") - 1  # the last one is the generation prompt
        variants = self.script[question]
        if isinstance(variants[0], str):
            variants = [variants]
        if k == 0 or len(variants) == 1:  # one variant: whatever the history's layout (a template may rewrite it)
            turns = variants[sample % len(variants)]
        else:
            turns = next(v for v in variants if v[0] in conversation)
        return turns[k] if k < len(turns) else ""

    def another_round(self, has_work: bool) -> bool:
        self.rounds += has_work
        return has_work

    def sync_weights(self, model, accelerator) -> dict:
        return {}

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1, params=None,
                 images=None) -> list[Sample]:  # a script is written whatever it is shown: images too
        self.calls.append((len(prompts), n))
        out = []
        for ids, limit in zip(prompts, max_tokens):
            for j in range(n):
                token_ids = self.tokenizer.encode(self.turn_text(ids, j), add_special_tokens=False)
                finish = "stop" if len(token_ids) <= limit else "length"
                out.append(Sample(token_ids[:limit], [-0.5] * min(limit, len(token_ids)), finish))
        return out


class ScriptedTransformersBackend(TransformersBackend):
    """The in-process backend's round logic (lock-step across processes, sync_weights), with the
    scripted policy in place of model.generate. `rounds` counts the rounds this rank ran."""

    def __init__(self, tokenizer, script: dict):
        super().__init__(tokenizer=tokenizer, params=SamplingParams(), eos_token_ids=[tokenizer.eos_token_id],
                         stop_strings=[])
        self.policy = ScriptedPolicy(tokenizer, script)
        self.rounds = 0

    def another_round(self, has_work: bool) -> bool:
        go = super().another_round(has_work)
        self.rounds += go
        return go

    def generate(self, prompts, max_tokens, n=1, params=None, images=None):
        return self.policy.generate(prompts, max_tokens, n, params) if prompts else []


class ScriptedServer(ScriptedPolicy):
    """The scripted policy behind the per-episode interface of a server client (submit one request,
    get a Future): each request returns after a random short delay, so requests finish out of order."""

    can_submit = True

    def __init__(self, tokenizer, script: dict, max_concurrent_requests: int = 3, prompts_per_request: int = 2,
                 seed: int = 0):
        import concurrent.futures
        import random

        super().__init__(tokenizer, script)
        self.max_concurrent_requests = max_concurrent_requests
        self.prompts_per_request = prompts_per_request
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrent_requests)
        self.rng = random.Random(seed)
        self.in_flight = 0
        self.most_in_flight = 0

    def submit(self, prompts, max_tokens, n=1, params=None, images=None):
        import time

        delay = self.rng.uniform(0.0, 0.05)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

        def answer():
            time.sleep(delay)
            samples = self.generate(prompts, [max_tokens] * len(prompts), n, params)
            self.in_flight -= 1
            return samples

        return self.pool.submit(answer)


class ScriptedSampler(ScriptedPolicy):
    """The scripted policy as an external sampler (a server's capabilities, without its HTTP): the trainer corrects
    for the mismatch with importance weights, and with truncating `params` (top-p, top-k) scores the samples with
    policy_sampler_logprobs. No lock-step: each rank runs its own rounds, as against a server. `policy`: an unsharded
    copy of the starting policy, whose own log-probs under `params` the sampler reports, as a server holding the
    policy's weights does (the first step's importance weights are then 1 up to float summation order); None: -0.5
    a token (weights far from 1)."""

    external = True
    aborted_requests = 0

    def __init__(self, tokenizer, script: dict, params, policy=None):
        super().__init__(tokenizer, script)
        self.params = params
        self.policy = policy

    def generate(self, prompts, max_tokens, n=1, params=None, images=None):
        if images and self.policy is not None:  # its policy scores the ids alone: it would report another sampler's
            raise ValueError("ScriptedSampler scores text prompts only; give it no policy for a run with images")
        samples = super().generate(prompts, max_tokens, n, params)
        if self.policy is None:
            return samples
        for ids, sample in zip((ids for ids in prompts for _ in range(n)), samples):
            if sample.token_ids:  # the policy's logits at each sampled token, under the sampler's processing
                row = torch.tensor([ids + sample.token_ids])
                with torch.no_grad():
                    logits = self.policy(input_ids=row).logits[0, len(ids) - 1 : -1].float()
                drawn = row[0, len(ids):]
                sample.logprobs[:] = sampler_logprobs(logits, params or self.params, keep=drawn).gather(
                    1, drawn[:, None]).squeeze(1).tolist()
        return samples


class ScriptedProcessing(SamplerProcessing):
    """The in-process backend's sampling with the scripted policy's turns forced over it: `model.generate` runs for
    real (its decoding steps, its collectives), but each row writes its scripted turn and then the end-of-sequence
    token; the logprob recorded for each token is still the policy's own (SamplerProcessing). Row r plays sample r
    of ScriptedPolicy. tests/run_trainer.py `inprocess` puts it in sampling.py's place, with `policy` set."""

    policy: ScriptedPolicy

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        super().__call__(input_ids, scores)
        P, tok = self.prompt_mask.shape[1], self.policy.tokenizer
        if not hasattr(self, "turns"):  # (R,) token lists: the prompt is the same at every step
            prompts = [input_ids[r, :P][self.prompt_mask[r]].tolist() for r in range(len(input_ids))]
            self.turns = [(tok.encode(self.policy.turn_text(ids, r), add_special_tokens=False)
                           if any(q in tok.decode(ids) for q in self.policy.script) else [])  # [] : a dummy row
                          + [tok.eos_token_id] for r, ids in enumerate(prompts)]
        forced = torch.full_like(scores, float("-inf"))
        for r, turn in enumerate(self.turns):
            forced[r, turn[min(input_ids.shape[1] - P, len(turn) - 1)]] = 0.0
        return forced
