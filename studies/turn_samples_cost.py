"""What per-turn samples (turn_samples.py) cost in training tokens: a GRPO group of 3-turn episodes (two tool
calls, then the answer), scripted, through SmolLM2's real tokenizer, in each `turn_samples` setting:

    python studies/turn_samples_cost.py [--generations 8] [--few-shot]

Setups: the xml protocol on SmolLM2's own ChatML template (its render extends the rollout), and the chat_template
protocol on Qwen3's real template (tests/fixtures) in non-thinking mode (its render drops the empty think block of
earlier turns, so auto splits after every tool turn) and in thinking mode (thoughts in the template's layout: the
render extends). For each setting it prints the samples per episode and three token counts of the group, each
also as a ratio to interleaved:
  - rows: the real tokens of the rows (prompt and completion; a split row repeats the history in each sample's
    prompt), what a padding-free forward without prefix sharing would process;
  - padded: rows x the longest row, what TRL's padded forward processes;
  - packed: the unique tokens of the group's prefix trie (packing.py, `padding_free: true`): the repeated history
    is forwarded once wherever it is unchanged, so only what a re-render rewrote is paid twice.
The count of trained (model) tokens is the same in every setting. Generation-side reuse (vLLM's prefix cache on the
re-rendered prompts) is checked against the live server in tests/test_vllm_server.py.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests")]

THOUGHTS = ("I need the capital first.", "Now the founder.", "I have both.")


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    converted = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(converted, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(converted)
    from prepare_models import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


def scripts(setup: str, generations: int) -> dict:
    """`generations` variants of a 3-turn episode (different queries, so the episodes part after the prompt)."""
    from helpers import template_call, xml_answer, xml_call

    variants = []
    for j in range(generations):
        first, second = f"capital of Veltria {j}", f"founder of Morvane {j}"
        if setup == "xml":
            variants.append([xml_call(first, why=THOUGHTS[0]), xml_call(second, why=THOUGHTS[1]),
                             xml_answer("Ada Lovelace", THOUGHTS[2])])
        else:
            think = (lambda t: f"<think>\n{t}\n</think>\n\n") if setup == "qwen3-thinking" else (lambda t: "")
            variants.append([think(THOUGHTS[0]) + template_call(first) + "<|im_end|>",
                             think(THOUGHTS[1]) + template_call(second) + "<|im_end|>",
                             think(THOUGHTS[2]) + "<answer>Ada Lovelace</answer><|im_end|>"])
    return {"Who founded the capital of Veltria?": variants}


def measure(setup: str, mode: str, generations: int, few_shot: bool) -> dict:
    from helpers import VELTRIA, chat_template, fake_search, make_env
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo.engine.packing import plan_rows
    from mt_grpo.base.protocol import ChatTemplateProtocol
    from scripted_policy import ScriptedPolicy

    tokenizer = smollm2_tokenizer()
    kwargs = dict(max_tokens_per_turn=200, max_completion_length=2000, max_tool_response_tokens=128,
                  max_env_steps=2, few_shot=few_shot, turn_samples=mode, tokenization_check="off")
    if setup != "xml":
        tokenizer.chat_template = chat_template("qwen3")
        kwargs.update(protocol=ChatTemplateProtocol(tokenizer),
                      chat_template_kwargs={"enable_thinking": setup == "qwen3-thinking"})
    env = make_env(tokenizer, [fake_search(lambda q: VELTRIA + " " + q)], **kwargs)
    script = scripts(setup, generations)
    (question,) = script
    episodes = env.rollout([env.prompt(question)] * generations, ScriptedPolicy(tokenizer, script))
    assert all(ep.stop_reason == "answer" and ep.tool_turns == 2 for ep in episodes), [ep.stop_reason for ep in episodes]
    batch = pad_episodes(episodes, tokenizer.pad_token_id or 0, mask_truncated=False)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    tries, _ = plan_rows(ids, att, batch["completion_ids"].shape[1], None, batch["sample_starts"])
    return {"samples": 1 + batch["sample_starts"].sum().item() / generations,
            "trained": int((batch["completion_mask"] * batch["tool_mask"]).sum()),
            "rows": int(att.sum()), "padded": ids.numel(),
            "packed": sum(len(t.pack()["input_ids"]) for t in tries)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=8, help="episodes in the group")
    parser.add_argument("--few-shot", action="store_true", help="the worked examples in the prompt (longer prompt)")
    args = parser.parse_args()
    print(f"A group of {args.generations} 3-turn episodes (2 tool calls, then the answer), SmolLM2's tokenizer; "
          f"few_shot={args.few_shot}. Tokens of the group; (x) = ratio to interleaved.")
    print(f"{'setup':16} {'turn_samples':12} {'samples/ep':>10} {'trained':>8} {'rows':>14} {'padded':>14} "
          f"{'packed':>14}")
    for setup in ("xml", "qwen3-no-thinking", "qwen3-thinking"):
        base = None
        for mode in ("interleaved", "auto", "per_turn"):
            m = measure(setup, mode, args.generations, args.few_shot)
            base = base or m
            cell = lambda k: f"{m[k]} ({m[k] / base[k]:.2f})"  # noqa: E731
            print(f"{setup:16} {mode:12} {m['samples']:>10.1f} {m['trained']:>8} {cell('rows'):>14} "
                  f"{cell('padded'):>14} {cell('packed'):>14}")
            assert m["trained"] == base["trained"]


if __name__ == "__main__":
    main()
