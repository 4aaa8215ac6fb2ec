"""TRL's fused LM head on CPU at several vocabulary tile widths: seconds and peak memory of its forward +
backward, side by side in one run, on SmolLM2-135M's head shape (49,152 x 576) and the completion tokens of a
demo step (about 1,200):

    .venv/bin/python studies/lm_head_tiles.py                       # 1,200 tokens; tiles 32768 4096 2048
    .venv/bin/python studies/lm_head_tiles.py --tokens 2048 --tiles 32768 8192 4096

TRL's width is 32,768 (`trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`), suited to its GPU kernel; on CPU its
torch fallback holds several tile-sized float32 temporaries at once, and the trainer narrows the tiles to
`packing.CPU_LM_HEAD_TILE`. Each width runs in its own process (a heap that an earlier width grew would hide the
next one's peak), twice (the first is a warm-up; the second is reported), with the peak RSS above the process's
size before the call sampled every 2 ms; the log-probs and the weight gradient of every width are checked
equal to the first's. The last line reads `tile <last>/<first>: time <ratio>, peak <ratio>`."""

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from common import print_table, rss
from trl.kernels import ChunkedLogProbFunction

MiB = 2**20


def run(hidden, weight, targets, tile: int) -> tuple[float, float, tuple]:
    """Seconds and peak MiB above the start of one forward + backward, and (log-probs, weight grad)."""
    gc.collect()
    start, peak, done = rss(), [0], [False]

    def sample():
        while not done[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    log_probs, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, tile, None, 1.0,
                                                          ("log_probs", "entropy"))
    (log_probs.sum() + entropy.sum()).backward()
    seconds = time.perf_counter() - t0
    done[0] = True
    sampler.join()
    values = (log_probs.detach(), weight.grad.clone())
    weight.grad = hidden.grad = None
    return seconds, (max(peak[0], rss()) - start) / MiB, values


def one(args, tile: int, out: str) -> None:
    """This process: the width `tile`; its seconds, peak and values saved to `out`."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).requires_grad_()
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    run(hidden, weight, targets, tile)  # warm-up
    torch.save(run(hidden, weight, targets, tile), out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1200, help="scored tokens (a demo step's completion tokens)")
    ap.add_argument("--tiles", type=int, nargs="+", default=[32768, 4096, 2048], help="vocabulary columns per tile")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one width in this process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args, args.one, args.out)
    rows, first = [], None
    for tile in args.tiles:
        out = os.path.join(tempfile.mkdtemp(), "tile.pt")
        subprocess.run([sys.executable, __file__, "--one", str(tile), "--out", out, "--tokens", str(args.tokens),
                        "--vocab", str(args.vocab), "--hidden", str(args.hidden)], check=True)
        seconds, peak, values = torch.load(out)
        first = first or (seconds, peak, values)
        torch.testing.assert_close(values[0], first[2][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(values[1], first[2][1], atol=1e-4, rtol=1e-4)
        rows.append([tile, seconds, peak, seconds / first[0], peak / first[1]])
    print_table(f"fused LM head forward + backward on CPU: {args.tokens} tokens, vocabulary {args.vocab}, hidden "
                f"{args.hidden}, float32, {torch.get_num_threads()} threads, each width in its own process "
                "(values equal across widths)",
                ["tile (vocab columns)", "s", "peak MiB above start", "time / first", "peak / first"], rows)
    print(f"tile {args.tiles[-1]}/{args.tiles[0]}: time {rows[-1][3]:.2f}, peak {rows[-1][4]:.2f}")


if __name__ == "__main__":
    main()
