"""Does truncation (top-p / top-k) still move the sequence importance weights under a numerics gap? (issue 60)

    .venv/bin/python studies/kept_set_shares.py                          # 3 seeds x 64 episodes, bf16 scorer
    .venv/bin/python studies/kept_set_shares.py --seeds 1 --episodes 16 --scorer rounded

A float32 sampler (the in-process backend, which lists its kept sets as a vLLM server does: completions.py) and a
scorer with other numerics: `bfloat16` (a bf16 copy of the weights, bf16 forward) or `rounded` (the weights
rounded to bf16, a float32 forward: the same kind of gap, and fast on a CPU without bf16 instructions). Per
seed, `--episodes` episodes of up to `--tokens` tokens (4 per held-out question) are sampled twice:

- under the Qwen3 sampler (T 0.7, top_p 0.8, top_k 20), and scored the trainer's way
  (`policy_sampler_logprobs`): relative to the sampler's kept sets (`kept`, what the trainer does now), and
  relative to the scorer's own kept set plus the drawn token (`own`, what it did before);
- at T 0.7 alone (`untruncated`), where there is no kept set.

For each, the share of episodes whose sequence weight exp(sum of log-ratios) is below 0.5, with a Wilson 95%
interval, and the differences that matter with 95% intervals: kept - untruncated (independent samples: Newcombe's
hybrid score interval) and own - kept (the same episodes: a paired bootstrap). Results: docs/results.md,
"Importance weights under truncation".
"""

import argparse
import math
import time

import torch
from accelerate import Accelerator
from common import print_table, smollm2_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from mt_grpo.engine.sampling import SamplingParams, TransformersBackend, policy_sampler_logprobs, sampler_logprobs

# held out: no test or other benchmark samples these
QUESTIONS = ["How do tides work?", "What makes a good friend?", "Explain how vaccines train the immune system.",
             "Describe a busy market in the morning.", "Why do leaves change colour in autumn?",
             "What is the difference between weather and climate?", "Write a short story about a lost key.",
             "How does a refrigerator keep food cold?", "Give advice to someone learning to cook.",
             "What happens when a volcano erupts?", "Explain what money is for.", "Describe your ideal holiday.",
             "How do birds know where to migrate?", "Why is sleep important?", "Explain how a bill becomes law.",
             "What can we learn from history?"]
QWEN3 = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
PLAIN = SamplingParams(temperature=0.7)
LOG_HALF = math.log(0.5)


def load(folder: str, scorer: str):
    """(float32 sampler, scorer, tokenizer) of the model in `folder`."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if scorer == "bfloat16":
        other = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    else:  # the weights rounded to bf16, computed in float32
        other = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in other.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    return model, other, tokenizer


def sample(model, tokenizer, params: SamplingParams, episodes: int, tokens: int, seed: int):
    """(prompts, samples): `episodes` samples, 4 per question, from the float32 in-process backend."""
    backend = TransformersBackend(tokenizer=tokenizer, params=params, eos_token_ids=[tokenizer.eos_token_id],
                                  stop_strings=[], list_kept_sets=True)
    backend.sync_weights(model, Accelerator(cpu=True))
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS[: max(1, episodes // 4)]]
    torch.manual_seed(seed)
    return prompts, backend.generate(prompts, [tokens] * len(prompts), n=4)


def sequence_log_ratios(scorer, prompts, samples, params: SamplingParams) -> dict[str, torch.Tensor]:
    """Per episode, the summed log-ratio log pi_scorer - log pi_sampler of its tokens: scored by the trainer's
    function (policy_sampler_logprobs) relative to the sampler's kept sets (`kept`); relative to the scorer's
    own sets, from the same forward's logits (`own`, under a truncating sampler only); per episode, its drawn tokens
    outside the scorer's own kept set (`outside`), which `own` scores by the drawn-token rule (process_logits)."""
    out = {"kept": [], "own": [], "outside": []}  # outside: drawn tokens outside the scorer's own kept set
    logits = []
    hook = scorer.register_forward_hook(lambda module, args, output: logits.append(output.logits[0]))
    try:
        for i, s in enumerate(samples):
            prompt, ids = torch.tensor(prompts[i // 4]), torch.tensor(s.token_ids)
            kept = None if s.kept is None else s.kept[None]
            ones = lambda t: torch.ones_like(t)[None]  # noqa: E731
            with torch.no_grad():
                theirs = policy_sampler_logprobs(scorer, prompt[None], ones(prompt), ids[None], ones(ids), params,
                                                 None, kept)[0]
            sampled = torch.tensor(s.logprobs)
            out["kept"].append(float((theirs - sampled).sum()))
            if params.truncates:
                scores = logits[-1][len(prompt) - 1 : -1].float()
                own = sampler_logprobs(scores, params, keep=ids)
                out["own"].append(float((own.gather(1, ids[:, None])[:, 0] - sampled).sum()))
                out["outside"].append(int(torch.isinf(sampler_logprobs(scores, params)[range(len(ids)), ids]).sum()))
    finally:
        hook.remove()
    return {k: torch.tensor(v) for k, v in out.items() if v}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return centre - half, centre + half


def newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """p1 - p2 of two independent shares and its 95% interval (Newcombe 1998, method 10)."""
    p1, p2 = k1 / n1, k2 / n2
    (l1, u1), (l2, u2) = wilson(k1, n1), wilson(k2, n2)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def paired_bootstrap(a: torch.Tensor, b: torch.Tensor, draws: int = 4000) -> tuple[float, float, float]:
    """mean(a - b) of paired 0/1 outcomes and its 95% percentile bootstrap interval (seeded)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(a), (draws, len(a)), generator=g)
    d = (a.float() - b.float())[idx].mean(1).sort().values
    return float((a.float() - b.float()).mean()), float(d[int(0.025 * draws)]), float(d[int(0.975 * draws) - 1])


def measure(model, scorer, tokenizer, seeds: int, episodes: int, tokens: int, log=print) -> dict:
    """Per setting, the (seeds * episodes,) summed log-ratios of the episodes."""
    ratios = {"kept": [], "own": [], "untruncated": [], "outside": []}
    for seed in range(seeds):
        t0 = time.perf_counter()
        seed_ratios = sequence_log_ratios(scorer, *sample(model, tokenizer, QWEN3, episodes, tokens, seed), QWEN3)
        seed_ratios["untruncated"] = sequence_log_ratios(scorer, *sample(model, tokenizer, PLAIN, episodes, tokens,
                                                                         seed), PLAIN)["kept"]
        for k in ratios:
            ratios[k].append(seed_ratios[k])
        log(f"seed {seed}: below 0.5 " + ", ".join(f"{k} {int((ratios[k][-1] < LOG_HALF).sum())}/{episodes}"
                                                  for k in ("kept", "own", "untruncated"))
            + f"; drawn tokens outside the scorer's own set {int(ratios['outside'][-1].sum())}"
            + f" ({time.perf_counter() - t0:.0f} s)")
    return {k: torch.cat(v) for k, v in ratios.items()}


def summary(ratios: dict, threshold: float = 0.5) -> dict:
    """The shares of episodes whose sequence weight is below `threshold`, the two differences with their
    intervals, and the std of the summed log-ratio."""
    ratios = {name: ratios[name] for name in ("kept", "own", "untruncated")}
    below = {name: v < math.log(threshold) for name, v in ratios.items()}
    n, k = len(below["kept"]), {name: int(v.sum()) for name, v in below.items()}
    return {"episodes": n, **{f"share_{name}": k[name] / n for name in k},
            **{f"std_{name}": float(v.std()) for name, v in ratios.items()},
            "kept_minus_untruncated": newcombe(k["kept"], n, k["untruncated"], len(below["untruncated"])),
            "own_minus_kept": paired_bootstrap(below["own"], below["kept"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct, models/)")
    parser.add_argument("--scorer", choices=["bfloat16", "rounded"], default="bfloat16")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=64, help="per seed and setting (4 per question, <= 64)")
    parser.add_argument("--tokens", type=int, default=96, help="the most tokens an episode samples")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, scorer, tokenizer = load(args.model or smollm2_dir(), args.scorer)
    ratios = measure(model, scorer, tokenizer, args.seeds, args.episodes, args.tokens)
    for threshold in (0.5, 0.9):
        s = summary(ratios, threshold)
        rows = [[name, s[f"share_{name}"], s[f"std_{name}"]] for name in ("kept", "own", "untruncated")]
        print_table(f"episodes with sequence weight < {threshold} ({s['episodes']} each; float32 sampler, "
                    f"{args.scorer} scorer, up to {args.tokens} tokens)", ["scored", "share", "log-ratio std"], rows)
        for name in ("kept_minus_untruncated", "own_minus_kept"):
            d, lo, hi = s[name]
            print(f"{name}: {d:+.3f}, 95% interval [{lo:+.3f}, {hi:+.3f}]")


if __name__ == "__main__":
    main()
