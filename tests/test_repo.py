"""A fresh clone must work: no tracked file may be a symbolic link that points outside the repository
(tracked .venv links into /tmp once broke every clone), and no environment or model is tracked."""

import os
import subprocess

from helpers import ROOT


def tracked() -> list[tuple[str, str]]:
    """(mode, path) of every tracked file."""
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [(line.split()[0], line.split("\t", 1)[1]) for line in out.splitlines()]


def test_no_tracked_link_points_outside_the_repository():
    bad = []
    for mode, path in tracked():
        if mode == "120000":  # a symbolic link
            target = os.readlink(os.path.join(ROOT, path))
            resolved = os.path.realpath(os.path.join(ROOT, os.path.dirname(path), target))
            if os.path.isabs(target) or not resolved.startswith(ROOT + os.sep):
                bad.append(f"{path} -> {target}")
    assert not bad, f"tracked links that leave the repository (a fresh clone breaks on them): {bad}"


def test_no_environment_or_model_is_tracked():
    paths = [p for _, p in tracked()]
    assert not [p for p in paths if p.split("/")[0].startswith((".venv", "models", "outputs"))]
    assert not [p for p in paths if p.endswith((".safetensors", ".gguf", ".bin"))]
