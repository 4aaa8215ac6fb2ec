"""`pip install -e .` puts the trainer and its modules on the path (issue 59): a script in another folder imports
them, and pyproject.toml lists every module and package of the repository's root, so none is left behind."""

import glob
import os
import subprocess
import sys
import sysconfig
import tomllib

from helpers import ROOT


def test_pip_install_e_makes_the_trainer_importable_from_another_folder(tmp_path):
    """A fresh environment that sees this one's packages (torch, TRL, ...) but not the repository, then
    `pip install -e` of the repository, then imports from a folder outside it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # this environment's packages, not its path entries
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = "import mt_grpo_trainer, builders, rewards.judge, tasks, tools; print(mt_grpo_trainer.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    before = subprocess.run([python, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert before.returncode != 0 and "No module named 'mt_grpo_trainer'" in before.stderr
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "-e", ROOT], check=True, env=env, capture_output=True, timeout=600)
    after = subprocess.run([python, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert after.returncode == 0, after.stderr[-3000:]
    assert after.stdout.strip() == os.path.join(ROOT, "mt_grpo_trainer.py")
    # the judge's prompt templates are package data: found through the installed package
    templates = subprocess.run([python, "-c", "import mt_grpo.rewards.judge as j, os; print(sorted(os.listdir(os.path.join("
                                "os.path.dirname(j.__file__), 'judge_prompts'))))"],
                               cwd=elsewhere, env=env, capture_output=True, text=True)
    assert "outcome.txt" in templates.stdout, templates.stderr[-2000:]


def test_pyproject_lists_every_module_and_package_of_the_root():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    modules = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))
    packages = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "*", "__init__.py")))
    assert sorted(setup["py-modules"]) == modules
    assert sorted(p for p in setup["packages"] if "." not in p) == packages
