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


# The package's floors, lowest first (mt_grpo/__init__.py, README's layout): a sub-package imports only itself and the
# ones before it, and nothing in the package imports the trainer above it.
FLOORS = ["compat", "base", "engine", "rewards", "tasks", "tools", "rollout", "adapters", "agents", "run"]


def test_each_sub_package_imports_only_the_floors_below_it():
    import ast

    package = os.path.join(ROOT, "mt_grpo")
    assert sorted(FLOORS) == sorted(d for d in os.listdir(package) if os.path.isdir(os.path.join(package, d))
                                    and not d.startswith("__"))
    wrong = []
    for floor in FLOORS:
        top = os.path.join(package, floor)
        for folder, dirs, files in os.walk(top):
            if floor == "compat" and folder != top:  # the vendored copies: the frameworks' own code
                break
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                    for module in modules:
                        parts = module.split(".")
                        if parts[0] == "mt_grpo_trainer" or (parts[0] == "mt_grpo" and len(parts) > 1 and
                                                             FLOORS.index(parts[1]) > FLOORS.index(floor)):
                            wrong.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {module}")
    assert wrong == []
