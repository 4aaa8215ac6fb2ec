"""How the sampler-correction importance weights spread with episode length, by precision and IS mode.

    .venv/bin/python studies/is_weight_spread.py                       # a GPU: the full grid (issue 60)
    .venv/bin/python studies/is_weight_spread.py --lengths 96 256 --episodes 8 --csv out.csv   # a CPU

The gap between a sampler and a trainer that hold the same weights in the same precision but compute
differently (vLLM's kernels against the trainer's forward): the in-process backend samples with `generate`
(KV cache, one token a step) in `--dtypes` (bfloat16, float16), and one forward of the same weights in the
same dtype scores the samples as the trainer does (`sampler_logprobs`, the drawn token kept), as issue 60's
GPU measurement did. Per length (episodes forced to it: no stop token) and dtype, the log-ratio
log pi_trainer - log pi_sampler of every sampled token, and:

- sequence IS (`sequence_*` modes: the product over the episode's tokens): the share of episodes whose weight
  is below 0.5 or above 2 (`sequence_mask` with clip 0.5-2 zeroes them), and the std of the summed log-ratio;
- token IS (`token_*`): the share of tokens whose weight is outside [0.5, 2], and the std of the log-ratio.

Each share comes with a 95% interval: Wilson's for the episodes' shares, a bootstrap over episodes for the tokens'
share (the tokens of one episode are not independent). Cells run shortest length first, every dtype at a length
before the next length, and each is printed (and appended to `--jsonl`) as it finishes, so a run cut short keeps
the short lengths of every dtype (studies/gpu_check.py caps it so).

The sampler is the Qwen3 recipe's (T 0.7, top_p 0.8, top_k 20; `--plain`: T 0.7 alone). Results and the
runs made so far: docs/results.md, "Importance weights: spread with episode length".
"""

import argparse
import json
import math
import time

import torch
from accelerate import Accelerator
from common import print_table, smollm2_dir, write_rows_csv
from transformers import AutoModelForCausalLM, AutoTokenizer

from mt_grpo.engine.sampling import SamplingParams, TransformersBackend, sampler_logprobs

QUESTIONS = ["Tell me about the history of the bicycle.", "Explain how a city manages its water.",
             "Write a story about a lighthouse keeper.", "Describe how bread is made, step by step.",
             "What should a traveller know before visiting the mountains?", "Explain how computers store data.",
             "Write a letter to a friend about a new hobby.", "Describe the life cycle of a butterfly."]
LOG2 = float(torch.log(torch.tensor(2.0)))


def log_ratios(model, tokenizer, params: SamplingParams, length: int, episodes: int, seed: int,
               rows_per_forward: int) -> list[torch.Tensor]:
    """Per episode, (length,) log pi_trainer - log pi_sampler of its tokens: `episodes` sampled by the in-process
    backend from `model` (4 per question), then scored by forwards of the same model."""
    backend = TransformersBackend(tokenizer=tokenizer, params=params, eos_token_ids=[], stop_strings=[])
    backend.sync_weights(model, Accelerator(cpu=model.device.type == "cpu"))
    per = 4
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in (QUESTIONS * episodes)[: max(1, episodes // per)]]
    torch.manual_seed(seed)
    samples = backend.generate(prompts, [length] * len(prompts), n=per)[:episodes]
    out = []
    for start in range(0, len(samples), rows_per_forward):
        chunk = list(enumerate(samples))[start : start + rows_per_forward]
        rows = [(prompts[i // per], s) for i, s in chunk]
        P, C = max(len(p) for p, _ in rows), max(len(s.token_ids) for _, s in rows)
        ids = torch.zeros(len(rows), P + C, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for r, (p, s) in enumerate(rows):  # prompts left-padded, completions right-padded
            ids[r, P - len(p) : P], ids[r, P : P + len(s.token_ids)] = torch.tensor(p), torch.tensor(s.token_ids)
            attention[r, P - len(p) : P + len(s.token_ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(model.device), attention_mask=attention.to(model.device),
                           logits_to_keep=C + 1).logits[:, :-1]
        for r, (_, s) in enumerate(rows):
            n, drawn = len(s.token_ids), torch.tensor(s.token_ids, device=model.device)
            trainer = sampler_logprobs(logits[r, :n].float(), params, keep=drawn).gather(1, drawn[:, None])[:, 0]
            out.append((trainer - torch.tensor(s.logprobs, device=model.device)).cpu())
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a share k / n."""
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def token_share_interval(ratios: list[torch.Tensor], draws: int = 1000) -> tuple[float, float]:
    """95% bootstrap interval of the share of tokens outside [0.5, 2], resampling whole episodes."""
    outside = torch.tensor([float((r.abs() > LOG2).sum()) for r in ratios])
    counts = torch.tensor([float(len(r)) for r in ratios])
    pick = torch.randint(len(ratios), (draws, len(ratios)), generator=torch.Generator().manual_seed(0))
    shares = (outside[pick].sum(1) / counts[pick].sum(1)).sort().values
    return float(shares[int(0.025 * draws)]), float(shares[int(0.975 * draws) - 1])


def spread(ratios: list[torch.Tensor]) -> dict:
    sequence = torch.stack([r.sum() for r in ratios])
    tokens = torch.cat(ratios)
    below, above, n = int((sequence < -LOG2).sum()), int((sequence > LOG2).sum()), len(ratios)
    return {"seq_below_0.5": below / n, "seq_below_0.5_ci": wilson(below, n),
            "seq_above_2": above / n, "seq_above_2_ci": wilson(above, n),
            "seq_logratio_std": float(sequence.std()),
            "tok_outside_0.5_2": float((tokens.abs() > LOG2).float().mean()),
            "tok_outside_0.5_2_ci": token_share_interval(ratios),
            "tok_logratio_std": float(tokens.std()),
            "tok_max_abs": float(tokens.abs().max())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct, models/)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[96, 256, 512, 1024, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per length and dtype (4 per question)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows_per_forward", type=int, default=4, help="rows per scoring forward (memory)")
    parser.add_argument("--plain", action="store_true", help="temperature 0.7 alone, no top_p / top_k")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--jsonl", default=None, help="append each cell to this file as it finishes")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = SamplingParams(temperature=0.7) if args.plain else SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
    folder = args.model or smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    results = []
    models = {dtype: AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
              for dtype in args.dtypes}
    for length in args.lengths:  # shortest first, every dtype: a cut run keeps both precisions' short cells
        for dtype, model in models.items():
            t0 = time.perf_counter()
            ratios = [r for seed in range(args.seeds)
                      for r in log_ratios(model, tokenizer, params, length, args.episodes, seed, args.rows_per_forward)]
            results.append({"device": device, "dtype": dtype, "length": length, "episodes": len(ratios),
                            **spread(ratios), "seconds": time.perf_counter() - t0})
            print(results[-1], flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(results[-1]) + "\n")
    header = [k for k in results[0] if not k.endswith("_ci")]
    print_table(f"IS weight spread ({'T 0.7' if args.plain else 'T 0.7, top_p 0.8, top_k 20'}, {device})", header,
                [[row[k] for k in header] for row in results])
    if args.csv:
        write_rows_csv(results, args.csv)


if __name__ == "__main__":
    main()
