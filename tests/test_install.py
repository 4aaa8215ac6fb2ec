"""Installing and importing the trainer (issues 59 and 76): `pip install -e .` and `pip install .` put two top-level
names on the path, `mt_grpo_trainer` and `mt_grpo`, with the judge's prompt templates and the framework copies
(mt_grpo/compat) as package data; nothing a user names beside them shadows the trainer: a user's folder with its own
`tools.py`, `rewards.py`, ... and another distribution's `tools/`, `rewards/`, ... packages imported first both
train, and the trainer imports none of them."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib

from helpers import RECIPE, ROOT, final_metrics

# The top-level names the repository had before mt_grpo/ (mt_grpo.base.registry.MOVED): none is installed
OLD_NAMES = ["rewards", "tools", "tasks", "adapters", "protocol", "fields", "registry", "builders", "sampling"]
STEP_FLAGS = ["--max_steps", "1", "--max_samples", "8", "--save_strategy", "no", "--eval_strategy", "no"]


def clean_env(**extra) -> dict:
    """This process's environment without its PYTHONPATH (the tests' own folders), offline, one torch thread."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **extra}


def fresh_venv(tmp_path) -> tuple[str, str]:
    """A fresh environment that sees this one's packages (torch, TRL, ...) but not the repository: (python, its
    site-packages)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # this environment's packages, not its path entries
    return python, site


def pip_install(python: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
                           "--no-build-isolation", *args], env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def probe(python: str, code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)


def clone_files() -> list[str]:
    """The files a clone of the checkout holds (tracked, and untracked ones git does not ignore), relative to the
    root."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    return [name for name in files if name and os.path.isfile(os.path.join(ROOT, name))]  # not a deleted one


def checkout_copy(dest) -> str:
    """The clone's files copied to `dest`: `pip install .` builds there, leaving no build/ or egg-info in the
    checkout."""
    for name in clone_files():
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))
    return str(dest)


def package_files() -> set[str]:
    """Every file of the clone's mt_grpo/ (its modules, the judge's templates, the framework copies with their
    licenses)."""
    return {name for name in clone_files() if name.startswith("mt_grpo/")}


def test_pip_install_e_makes_the_trainer_importable_from_another_folder(tmp_path):
    """`pip install -e` of the repository, then imports from a folder outside it: the checkout's trainer and
    package, and none of the old top-level names."""
    python, _ = fresh_venv(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    imports = ("import mt_grpo_trainer, mt_grpo.run.builders, mt_grpo.rewards.judge, mt_grpo.tasks, mt_grpo.tools; "
               "print(mt_grpo_trainer.__file__)")
    before = probe(python, imports, elsewhere)
    assert before.returncode != 0 and "No module named 'mt_grpo_trainer'" in before.stderr
    pip_install(python, "-e", ROOT)
    after = probe(python, imports, elsewhere)
    assert after.returncode == 0, after.stderr[-3000:]
    assert after.stdout.strip() == os.path.join(ROOT, "mt_grpo_trainer.py")
    # the judge's prompt templates are package data: found through the installed package
    templates = probe(python, "import mt_grpo.rewards.judge as j, os; print(sorted(os.listdir(os.path.join("
                              "os.path.dirname(j.__file__), 'judge_prompts'))))", elsewhere)
    assert "outcome.txt" in templates.stdout, templates.stderr[-2000:]
    old = probe(python, "import importlib.util; print([n for n in %r if importlib.util.find_spec(n)])" % OLD_NAMES,
                elsewhere)
    assert old.returncode == 0 and old.stdout.strip() == "[]", old.stdout + old.stderr[-2000:]


def test_pip_install_puts_two_names_and_the_package_data_in_site_packages(tmp_path):
    """`pip install .` (not editable) of a copy of the checkout: the distribution's files are mt_grpo_trainer.py and
    mt_grpo/ alone, every file of mt_grpo/ among them (the judge's templates, the framework copies and their
    licenses); from another folder, with the copy gone, the installed trainer is the one imported, and a verl scorer
    a recipe names resolves to the installed copy of verl."""
    python, site = fresh_venv(tmp_path)
    source = checkout_copy(tmp_path / "source")
    pip_install(python, source)
    shutil.rmtree(source)  # what imports below comes from site-packages
    (dist_info,) = glob.glob(os.path.join(site, "mt_grpo-*.dist-info"))
    with open(os.path.join(dist_info, "RECORD")) as f:
        record = {line.rsplit(",", 2)[0] for line in f if line.strip()}
    # pip's byte-compiled copies (__pycache__/ beside each module) aside
    installed = {path for path in record if not path.startswith(os.path.basename(dist_info) + "/")
                 and "__pycache__" not in path.split("/")}
    assert {path.split("/")[0] for path in installed} == {"mt_grpo", "mt_grpo_trainer.py"}, sorted(installed)
    top_level = os.path.join(dist_info, "top_level.txt")
    if os.path.exists(top_level):  # setuptools writes it
        with open(top_level) as f:
            assert set(f.read().split()) == {"mt_grpo", "mt_grpo_trainer"}
    missing = package_files() - installed
    assert not missing, f"not installed: {sorted(missing)}"
    assert {"mt_grpo/rewards/judge_prompts/outcome.txt", "mt_grpo/compat/verl/verl/tools/base_tool.py",
            "mt_grpo/compat/verl/LICENSE"} <= installed
    assert installed - package_files() == {"mt_grpo_trainer.py"}

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = textwrap.dedent("""
        import importlib.util, json, os, sys
        import mt_grpo_trainer, mt_grpo.rewards.judge as judge
        from mt_grpo.base.registry import resolve
        installed_verl = importlib.util.find_spec("verl") is not None  # then used instead of the copy
        score = resolve("verl.utils.reward_score.gsm8k:compute_score", {}, "reward function")
        print(json.dumps({"trainer": mt_grpo_trainer.__file__, "judge": judge.__file__,
                          "verl": sys.modules["verl"].__file__, "installed_verl": installed_verl,
                          "score": score("#### 4", "4"),
                          "old": [n for n in %r if importlib.util.find_spec(n)],
                          "templates": sorted(os.listdir(os.path.join(os.path.dirname(judge.__file__),
                                                                      "judge_prompts")))}))
    """ % OLD_NAMES)
    proc = probe(python, code, elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["trainer"] == os.path.join(site, "mt_grpo_trainer.py")
    assert out["judge"] == os.path.join(site, "mt_grpo", "rewards", "judge.py")
    assert out["templates"] == ["group.txt", "outcome.txt", "turn.txt"]
    if not out["installed_verl"]:
        assert out["verl"] == os.path.join(site, "mt_grpo", "compat", "verl", "verl", "__init__.py")
    assert out["score"] == 1.0 and out["old"] == []


def test_pyproject_installs_the_trainer_and_its_package_alone():
    """The root's one module and one package, and every package of mt_grpo/ (each folder with an __init__.py)
    beside the framework copies, which are data."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    modules = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))
    packages = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "*", "__init__.py")))
    assert setup["py-modules"] == modules == ["mt_grpo_trainer"]
    assert packages == ["mt_grpo"]
    assert setup["packages"]["find"]["include"] == ["mt_grpo", "mt_grpo.*"]
    from setuptools import find_namespace_packages

    found = find_namespace_packages(ROOT, **{k: v for k, v in setup["packages"]["find"].items()
                                             if k in ("include", "exclude")})
    folders = {os.path.relpath(os.path.dirname(p), ROOT).replace(os.sep, ".")
               for p in glob.glob(os.path.join(ROOT, "mt_grpo", "**", "__init__.py"), recursive=True)}
    assert {p for p in folders if not p.startswith("mt_grpo.compat.")} <= set(found), sorted(folders - set(found))
    assert not [p for p in found if p.startswith("mt_grpo.compat.")]


# -- nothing a user names shadows the trainer ---------------------------------------------------------------------
# Each module records that it was imported (a file named after it in the folder the run starts in): the trainer
# imports the user's `rewards` because the recipe names `rewards:turns`, and none of the others.
USER_MODULE = """
import os
open("imported-" + __name__, "w").close()


def f():
    pass
"""
USER_REWARDS = USER_MODULE + """

def turns(prompts, completions, **kwargs):
    \"\"\"The episode's message count: a reward of the user's own, named `rewards:turns` in the recipe.\"\"\"
    return [float(len(c)) for c in completions]
"""
USER_NAMES = ["tools", "rewards", "tasks", "fields", "protocol", "registry"]


def trained_step(out) -> dict:
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 1, steps
    step = steps[0]
    assert step["step"] == 1 and math.isfinite(step["loss"]) and step["grad_norm"] > 0, step
    return step


def test_a_folder_with_its_own_tools_rewards_tasks_and_registry_trains(tiny_agent_dir, tmp_path):
    """`python -m mt_grpo_trainer --config RECIPE` from the user's folder, which is first on sys.path (`-m` puts
    the working folder there; the repository comes from PYTHONPATH) and holds tools.py, rewards.py, tasks.py,
    fields.py, protocol.py and registry.py: the recipe's registry names (`search`, `exact_match_reward_func`) are
    the trainer's, `rewards:turns` is the user's, and no other module of the user's is imported."""
    user = tmp_path / "user"
    user.mkdir()
    for name in USER_NAMES:
        (user / f"{name}.py").write_text(USER_REWARDS if name == "rewards" else USER_MODULE)
    out = str(tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "mt_grpo_trainer", "--config", RECIPE, "--model_name_or_path",
                           tiny_agent_dir, "--output_dir", out, *STEP_FLAGS, "--outcome_reward_funcs",
                           "exact_match_reward_func", "format_reward_func", "rewards:turns"],
                          cwd=user, env=clean_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    step = trained_step(out)
    assert step["rewards/outcome/turns"] >= 1.0  # a message at least in each episode: the user's function scored it
    assert "rewards/outcome/exact_match_reward_func" in step and "rewards/turn/tool_execution_reward_func" in step
    assert sorted(p.name for p in user.glob("imported-*")) == ["imported-rewards"]
    assert "is now `mt_grpo." not in proc.stderr  # no old path was taken for one of ours


OTHER_DISTRIBUTION = {
    "tools/__init__.py": "TOOLS = {'search': 'someone_else:search'}\ndef build_tools(*a, **k):\n    raise AssertionError('tools')\n",
    "tasks/__init__.py": "TASKS = {}\ndef load_task(*a, **k):\n    raise AssertionError('tasks')\n",
    "rewards/__init__.py": "REWARD_FUNCS = {}\ndef get_reward_func(*a, **k):\n    raise AssertionError('rewards')\n",
    "adapters/__init__.py": "def f():\n    pass\n",
    "registry.py": "def resolve(*a, **k):\n    raise AssertionError('registry')\n",
}
OTHER_SCRIPT = """
import json, sys
import adapters, registry, rewards, tasks, tools  # another distribution's, imported first
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

args = MTGRPOConfig(output_dir=sys.argv[2], dataset_name="fictional_kb", max_samples=8, tools=["search"],
                    turn_reward_funcs=["tool_execution_reward_func"],
                    outcome_reward_funcs=["exact_match_reward_func", "format_reward_func"], max_env_steps=2,
                    few_shot=False, max_prompt_length=1024, max_completion_length=128, max_tokens_per_turn=32,
                    max_tool_response_tokens=32, generation_backend="transformers", num_generations=4,
                    per_device_train_batch_size=8, max_steps=1, learning_rate=1e-3, loss_type="dapo", use_cpu=True,
                    bf16=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
trainer = MTGRPOEnvTrainer(sys.argv[1], args=args)
trainer.train()
trainer.save_state()
print("RESULT " + json.dumps({name: sys.modules[name].__file__ for name in
                              ("adapters", "registry", "rewards", "tasks", "tools")}))
"""


def test_a_script_that_imported_another_distributions_tools_and_rewards_first_trains(tiny_agent_dir, tmp_path):
    """A site folder on PYTHONPATH holds packages `tools/`, `tasks/`, `rewards/`, `adapters/` and a `registry.py`
    (whose functions would fail if the trainer called them); a script imports them all, then the trainer, and
    trains a step through the Python API; they stay the other distribution's."""
    other = tmp_path / "site"
    for path, text in OTHER_DISTRIBUTION.items():
        (other / path).parent.mkdir(parents=True, exist_ok=True)
        (other / path).write_text(text)
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(OTHER_SCRIPT)
    out = str(tmp_path / "out")
    proc = subprocess.run([sys.executable, "train.py", tiny_agent_dir, out], cwd=project,
                          env=clean_env(PYTHONPATH=os.pathsep.join([str(other), ROOT])), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    modules = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert all(path.startswith(str(other) + os.sep) for path in modules.values()), modules
    step = trained_step(out)
    assert {"rewards/turn/tool_execution_reward_func", "rewards/outcome/exact_match_reward_func"} <= set(step)
