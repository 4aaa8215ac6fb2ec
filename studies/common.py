"""Shared by the benchmark scripts: paths, the demo model, table printing, CSV writing."""

import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")


def smollm2_dir() -> str:
    from prepare_models import convert_smollm2

    return convert_smollm2(SMOLLM2)


def rss() -> int:
    """This process's resident memory now, in bytes (from /proc: ru_maxrss gives only the peak so far)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for k, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def write_rows_csv(rows: list[dict], path: str) -> None:
    """One CSV row per dict, the columns of the first; floats to 4 decimals."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})
