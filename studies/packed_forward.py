"""Padded against packed (packing.py) forward + backward on a synthetic GRPO batch, any model size, CPU or GPU:

    python studies/packed_forward.py --models smollm2-135m qwen2.5-7b --groups 4     # bf16 on a GPU
    python studies/packed_forward.py --models smollm2-135m --groups 1 --prompt 408   # fp32 on CPU
    python studies/packed_forward.py --models qwen2.5-7b --groups 2 --dense --json out.json   # + the dense mask

The batch is `--groups` GRPO groups of `--generations` episodes of one `--prompt`-token prompt, with completion
lengths drawn uniformly from [`--min-completion`, `--max-completion`] (every completion token attended and
scored: model and environment tokens alike). Models are built from their published configs with random weights:
the time of a forward and backward does not depend on the weights. Activation checkpointing is on, as in the
trainer. Each group is one micro-batch, in both arms:
  - padded: `num_generations` rows padded to the batch's longest episode, a 2D attention mask (what TRL's
    GRPOTrainer forwards);
  - packed: the group folded into a prefix trie (TRL's TreeRow, packing.py's layout and mask): the prompt
    once, no padding; on a GPU flex_attention over a BlockMask of the trie, on CPU SDPA with a dense mask, as the
    trainer chooses (packing.packed_attention, which names its choice in the log);
  - packed_dense (`--dense`): the same tries under SDPA with the dense boolean mask, whatever the device (on a
    GPU, what the packed arm ran before flex_attention).
Both score the completion positions through the same LM head (chunks of 4,096 positions, log-softmax, the
label's log-prob), so the two arms differ only in what the backbone forwards. Per model and arm it prints the
seconds per micro-batch (mean of `--repeats` after a warm-up), real tokens per second, the model FLOPs
utilisation against the device's peak (6 x parameters x real tokens per second; attention FLOPs left out, so a
lower bound) and the peak memory, then `packed/padded <model>: <ratio>`, and how many graphs torch.compile made
(transformers compiles flex_attention; each new row length can recompile). `--json` writes the same figures. The
trainer's own numbers on CPU come from studies/step_anatomy.py.

It needs torch and transformers only: where TRL is not installed (the project's GPU machine), TreeRow is loaded
from TRL's wheel in --trl-wheel, since importing `trl` itself pulls in datasets and accelerate (packing.py imports
nothing else of TRL at import time; tests/test_packed_attention.py runs this file with `trl` unimportable).
"""

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
import types
import zipfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Published configs (Hugging Face model cards), built with random weights; "tiny" is for smoke runs
MODELS = {
    "tiny": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=1000, max_position_embeddings=4096)),
    "smollm2-135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                         max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000)),
    "qwen2.5-7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                       max_position_embeddings=32768, tie_word_embeddings=False)),
    "qwen2.5-14b": ("Qwen2Config", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                        max_position_embeddings=32768, tie_word_embeddings=False)),
}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16, SXM


def load_tree_row(wheel: str | None) -> None:
    """Make `from trl.experimental.async_grpo.packing import TreeRow` work without installing TRL: load that one
    module (it needs torch and transformers only) from TRL's wheel."""
    try:
        import trl  # noqa: F401
        return
    except ImportError:
        if not wheel or not os.path.isfile(wheel):
            raise SystemExit("TRL is not installed: pass --trl-wheel path/to/trl-1.16.0-py3-none-any.whl") from None
    name = "trl.experimental.async_grpo.packing"
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "trl_packing.py")
    with zipfile.ZipFile(wheel) as z, open(path, "wb") as f:
        f.write(z.read(name.replace(".", "/") + ".py"))
    for parent in ("trl", "trl.experimental", "trl.experimental.async_grpo"):  # empty parents: not TRL's own
        if sys.modules.get(parent) is None:
            sys.modules[parent] = types.ModuleType(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


def make_model(name: str, device, dtype):
    import transformers

    cls, kwargs = MODELS[name]
    config = getattr(transformers, cls)(**kwargs)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    kwargs = {"use_reentrant": False}  # the trainer's default; transformers renamed the method and its argument
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    return model.train()


def make_group(vocab: int, prompt_len: int, lengths: list[int], g: torch.Generator):
    """One group: a left-padded shared prompt (all rows the same length here) and right-padded completions."""
    prompt = torch.randint(5, vocab, (prompt_len,), generator=g)
    T = max(lengths)
    ids = torch.zeros(len(lengths), prompt_len + T, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :prompt_len], att[i, :prompt_len + n] = prompt, 1
        ids[i, prompt_len:prompt_len + n] = torch.randint(5, vocab, (n,), generator=g)
    return ids, att, T


def head_logps(model, hidden: torch.Tensor, labels: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """log p(label) from hidden states (M, H), through the LM head in chunks; fp32 log-softmax."""
    out = []
    for i in range(0, len(labels), chunk):
        logits = model.lm_head(hidden[i:i + chunk]).float()
        out.append(logits.log_softmax(-1).gather(1, labels[i:i + chunk, None]).squeeze(1))
    return torch.cat(out)


def padded_step(model, ids, att, T) -> None:
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state[:, -T - 1:-1]
    scored = att[:, -T:].bool()
    head_logps(model, hidden[scored], ids[:, -T:][scored]).sum().backward()


def packed_step(model, ids, att, T) -> int:
    from mt_grpo.engine.packing import packed_inputs

    unique = 0
    for row, mask, tokens in packed_inputs(model, ids, att, T):  # the trainer's tries, layout and mask
        hidden = model.model(input_ids=row.input_ids, position_ids=row.position_ids,
                             attention_mask=mask).last_hidden_state[0]
        labels = row.shift_labels[0, row.token_index]
        head_logps(model, hidden[row.token_index], labels).sum().backward()
        unique += tokens
    return unique


def packed_dense_step(model, ids, att, T) -> int:
    """packed_step under SDPA with the dense boolean mask of the trie (packing's choice on CPU), on any device."""
    from mt_grpo.engine import packing

    chosen = packing.packed_attention
    packing.packed_attention = lambda model, device: "sdpa"  # a dense mask goes to SDPA under PACKED_FLEX too
    try:
        return packed_step(model, ids, att, T)
    finally:
        packing.packed_attention = chosen


def compile_counts() -> dict:
    """torch.compile's counters so far: graphs made, frames compiled (a recompile counts again)."""
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["stats"].items()}


def measure(fn, repeats: int, cuda: bool) -> tuple[float, float]:
    """Seconds per call (mean of `repeats` after one warm-up) and peak GPU memory in GiB (0 on CPU)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats, (torch.cuda.max_memory_allocated() / 1024**3 if cuda else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"], choices=sorted(MODELS))
    ap.add_argument("--groups", type=int, default=1, help="groups (micro-batches) timed per repeat")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--min-completion", type=int, default=128)
    ap.add_argument("--max-completion", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trl-wheel", help="TRL's wheel, where TRL is not installed")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: by device name)")
    ap.add_argument("--dense", action="store_true", help="also the packed_dense arm (the trie's dense mask, SDPA)")
    ap.add_argument("--json", help="write the figures to this file (one object per model)")
    args = ap.parse_args()
    load_tree_row(args.trl_wheel)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # packing names the attention it chose

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    g = torch.Generator().manual_seed(0)
    print(f"device: {name}, {dtype}; {args.groups} group(s) of {args.generations} episodes, prompt {args.prompt} "
          f"tokens, completions {args.min_completion}-{args.max_completion}; peak {peak} TFLOPS")
    report = {"device": name, "dtype": str(dtype), "peak_tflops": peak, "models": []}
    for model_name in args.models:
        model = make_model(model_name, device, dtype)
        params = sum(p.numel() for p in model.parameters())
        groups = []
        for _ in range(args.groups):
            lengths = torch.randint(args.min_completion, args.max_completion + 1, (args.generations,),
                                    generator=g).tolist()
            ids, att, T = make_group(model.config.vocab_size, args.prompt, lengths, g)
            groups.append((ids.to(device), att.to(device), T))
        real = sum(int(att.sum()) for _, att, _ in groups)
        padded_tokens = sum(ids.numel() for ids, _, _ in groups)
        unique = []
        results, compiled = {}, {}
        arms = [("padded", padded_step)] + [("packed_dense", packed_dense_step)] * args.dense + [("packed", packed_step)]
        for arm, step in arms:
            def run():
                model.zero_grad(set_to_none=True)
                for ids, att, T in groups:
                    out = step(model, ids, att, T)
                    if arm == "packed" and len(unique) < len(groups):
                        unique.append(out)
            before = compile_counts()
            results[arm] = measure(run, args.repeats, cuda)
            compiled[arm] = {k: v - before.get(k, 0) for k, v in compile_counts().items()}
        print(f"\n{model_name}: {params / 1e9:.2f} B parameters; {real} real tokens, {padded_tokens} padded, "
              f"{sum(unique)} packed (packing ratio {real / sum(unique):.2f})")
        entry = {"model": model_name, "parameters": params, "real_tokens": real, "padded_tokens": padded_tokens,
                 "packed_tokens": sum(unique), "attention": getattr(model, "_packed_attention", None), "arms": {}}
        for arm, (seconds, memory) in results.items():
            tps = real / seconds
            mfu = 6 * params * tps / (peak * 1e12) if peak else None
            entry["arms"][arm] = {"seconds": seconds, "real_tokens_per_s": tps, "mfu": mfu, "peak_gib": memory,
                                  "compiled": compiled[arm]}
            print(f"  {arm:12s} {seconds:8.3f} s  {tps:10.0f} real tokens/s  MFU {f'{mfu:.1%}' if mfu else '-':>6s}  "
                  f"peak {memory:6.1f} GiB  compiled {compiled[arm]}")
        for arm in results:
            if arm != "padded":
                entry[f"{arm}/padded"] = results[arm][0] / results["padded"][0]
                print(f"{arm}/padded {model_name}: {entry[f'{arm}/padded']:.2f}")
        report["models"].append(entry)
        if args.json:  # after each model: a run cut later keeps it
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        del model
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
