"""studies/gpu_check.py's dry mode on CPU: every part's code path at toy sizes on the tiny models (the CUDA tests
skip here), each part's result in the JSON-lines file in order; then a part killed at its cap and one skipped for
time, decided by caps and estimates, not by how fast this machine is."""

import json
import subprocess
import sys

from helpers import ROOT


def check(tmp_path, name: str, *flags: str) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, "studies/gpu_check.py", "--dry-run", "--out", str(out), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_dry_run_writes_every_part_in_order(tiny_model_dir, tiny_agent_dir, tmp_path):
    lines = check(tmp_path, "dry", "--model", tiny_model_dir, "--agent", tiny_agent_dir)
    assert [x["kind"] for x in lines] == ["start", "part", "part", "part", "part", "end"]
    parts = {x["name"]: x for x in lines if x["kind"] == "part"}
    assert list(parts) == ["cuda_tests", "packed_forward", "weight_spread", "training"]
    assert all(x["status"] == "ok" for x in parts.values()), {k: x.get("log_tail") for k, x in parts.items()}
    tests = parts["cuda_tests"]["result"]["tests"]
    assert len(tests) == 3 and all(t["outcome"] == "skipped" for t in tests.values())  # no CUDA here
    (model,) = parts["packed_forward"]["result"]["models"]
    assert list(model["arms"]) == ["padded", "packed_dense", "packed"] and model["attention"] == "sdpa"
    assert model["packed_tokens"] < model["real_tokens"] and model["packed/padded"] > 0
    cells = parts["weight_spread"]["result"]["cells"]
    assert [(c["length"], c["dtype"]) for c in cells] == [(4, "bfloat16"), (4, "float16"), (8, "bfloat16"),
                                                          (8, "float16")]  # shortest first, both precisions
    assert all(lo <= c["seq_below_0.5"] <= hi for c in cells for lo, hi in [c["seq_below_0.5_ci"]])
    (step,) = parts["training"]["result"]["bf16"]
    # on-policy the reference is the policy: what is left is bf16's rounding between two forwards of one model, which
    # depends on the CPU's kernels (3.7e-6 on an AVX512-BF16 EPYC, 0 elsewhere). k3 of a logprob gap d is about d^2 / 2,
    # and a bf16 logit carries 8 bits (d up to ~1e-2): at most ~5e-5
    assert step["step"] == 1 and 0 <= step["kl"] < 1e-4


def test_a_part_past_its_cap_is_killed_and_one_that_does_not_fit_is_skipped(tiny_model_dir, tmp_path):
    """weight_spread gets 0.5 s (it imports torch and transformers, then loads a model), training an estimate
    above the whole budget: neither finishes, and both say why."""
    lines = check(tmp_path, "cut", "--model", tiny_model_dir, "--agent", tiny_model_dir, "--parts", "weight_spread",
                  "training", "--budget", "100", "--cap", "weight_spread=0.5", "--estimate", "training=1000")
    parts = [x for x in lines if x["kind"] == "part"]
    assert [(x["name"], x["status"]) for x in parts] == [("weight_spread", "timeout"), ("training", "skipped")]
    assert parts[0]["result"] == {"cells": []}
    assert parts[1]["reason"].startswith("skipped: needs about 1000 s")
    assert lines[-1]["kind"] == "end"
