"""Defects of the agent endpoint found after it was built (mt_grpo/agents/), each with its test: a step in which no
agent calls the model, a call the openai client retries after its sample was drawn, `agent/*` metrics gathered across
processes, and calls past `max_env_steps`."""

import concurrent.futures
import math
import os
import threading

import httpx
import pytest

from helpers import make_env, rollout_records, xml_answer, xml_call
from scripted_policy import ScriptedPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = "What is the capital of Veltria?"


def _silent(row, client):
    return 0.0  # no model call at all


def _silent_for_quorvath(row, client):
    if "Quorvath" in row["prompt"][-1]["content"]:
        return 1.0
    client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=8)
    return 0.0


@pytest.mark.parametrize("agent", [_silent, _silent_for_quorvath], ids=["no_agent_calls", "some_agents_call"])
def test_a_step_where_no_agent_or_only_some_call_the_model_trains(tiny_agent_dir, tmp_path, agent):
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in (Q, "Who founded Quorvath?")])
    args = MTGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2,
                        per_device_train_batch_size=4, max_completion_length=32, max_tokens_per_turn=8,
                        learning_rate=1e-3, bf16=False, use_cpu=True, report_to="none", logging_steps=1,
                        save_strategy="no", disable_tqdm=True, agent_batch_wait=1.0, tokenization_check="off",
                        save_rollouts_steps=1, padding_free=agent is _silent)  # the packed forward too
    trainer = MTGRPOEnvTrainer(model=tiny_agent_dir, args=args, train_dataset=dataset, agent=agent)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)
    want = 1.0 if agent is _silent else 0.5
    assert [s["agent/no_call_ratio"] for s in steps] == [want, want]
    records = rollout_records(args.output_dir, "step-000002.jsonl")
    silent = [r for r in records if r["stop_reason"] == "no_call"]
    assert len(silent) == 4 * want and all(not any(r["tokens"]["model_mask"]) for r in silent)


def _agent_env(tokenizer, agent, **overrides):
    from mt_grpo.agents.runner import AgentEnv

    return AgentEnv(make_env(tokenizer, [], **overrides), agent=agent, batch_wait=600.0)


class SlowUntilRetried(ScriptedPolicy):
    """A server backend whose samples come only once the endpoint has seen a retry of the call (a sample slower than
    the client's timeout, held by the endpoint's own count, not by a sleep)."""

    can_submit, max_concurrent_requests, prompts_per_request = True, 4, 1

    def __init__(self, tokenizer, script, sessions):
        super().__init__(tokenizer, script)
        self.sessions = sessions

    def submit(self, prompts, max_tokens, n=1, params=None):
        future = concurrent.futures.Future()

        def answer():
            for _ in range(6000):
                if any(s.stats["retries"] for s in list(self.sessions.values())):
                    break
                threading.Event().wait(0.01)
            future.set_result(self.generate(prompts, [max_tokens] * len(prompts), n, params))

        threading.Thread(target=answer, daemon=True).start()
        return future


def test_the_openai_clients_retry_of_a_slow_call_gets_its_sample_once(smollm2_tokenizer):
    """The openai client's own retry (a short timeout, max_retries) of a call whose sample is slower than it: the
    retry waits for the one sample of the call in flight (it is not refused 409, and no second sample is drawn), and
    the agent gets the reply recorded; the episode is one sample, the retry counted."""
    import openai

    got = []

    def agent(row, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=0.5, max_retries=5)
        messages = [{"role": "user", "content": Q}]
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
            got.append(reply.content)
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Once more."}]

    env = _agent_env(smollm2_tokenizer, agent)
    backend = SlowUntilRetried(smollm2_tokenizer, {Q: [xml_answer("Morvane"), xml_answer("Morvane, yes")]},
                               env.endpoint.sessions)
    (ep,) = env.rollout(None, backend, rows=[{"question": Q}])
    model = [smollm2_tokenizer.decode(ep.completion_ids[s.start:s.end]) for s in ep.spans if s.role == "model"]
    assert model == got == [xml_answer("Morvane"), xml_answer("Morvane, yes")]
    assert ep.agent_stats["calls"] == 2 and ep.agent_stats["retries"] >= 1 and ep.sample_starts == []
    assert not any(k.startswith("new_samples/") and v for k, v in ep.agent_stats.items())


class LosesTheFirstReply(httpx.HTTPTransport):
    """A transport whose first reply is lost after the endpoint answered it (a dropped connection, or a client that
    timed out just as the sample came): the openai client sees a timeout, and retries."""

    def __init__(self):
        super().__init__()
        self.lost = 0

    def handle_request(self, request):
        response = super().handle_request(request)
        if not self.lost:
            response.read()
            self.lost += 1
            raise httpx.ReadTimeout("the reply was lost", request=request)
        return response


def test_a_reply_the_agent_never_received_is_not_trained_and_asking_again_is_a_new_sample(smollm2_tokenizer):
    """The endpoint sampled and answered a call, but the reply was lost; the openai client retries it (max_retries):
    the retry gets the reply recorded, so no sample the agent never saw is trained (before, the retry was recorded
    as a history rewrite: a second sample). The same request sent again as a new call (the SDK's retry count 0) is
    the agent asking again: a sample of its own, which it receives."""
    import openai

    got, transport = [], LosesTheFirstReply()

    def agent(row, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2,
                               http_client=httpx.Client(transport=transport))
        messages = [{"role": "user", "content": Q}]
        for _ in range(2):  # the same request twice: the agent samples again
            got.append(client.chat.completions.create(model="policy", messages=messages).choices[0].message.content)

    env = _agent_env(smollm2_tokenizer, agent)
    (ep,) = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, {Q: [xml_answer("Morvane")]}), rows=[{"question": Q}])
    model = [smollm2_tokenizer.decode(ep.completion_ids[s.start:s.end]) for s in ep.spans if s.role == "model"]
    assert model == got == [xml_answer("Morvane")] * 2 and transport.lost == 1
    assert ep.agent_stats["retries"] == 1 and ep.agent_stats["calls"] == 2
    assert ep.agent_stats["new_samples/rewrite"] == 1  # the second request, asked on purpose


def test_agent_metrics_are_means_over_every_processs_episodes(smollm2_tokenizer):
    """reporting.py hands agent_metrics accelerate's gather: the metrics are means over the episodes of every process
    (here a gather that adds a second process's rows, as accelerate's concatenates them), not this process's."""
    import torch

    from mt_grpo.agents import AGENT_COUNTS, agent_metrics
    from mt_grpo.rollout.episodes import Episode

    mine = Episode([1, 2], stop_reason="answer")
    mine.agent_stats = {"calls": 3, "retries": 1, "new_samples/rewrite": 1}
    silent = Episode([], stop_reason="no_call")
    silent.agent_stats = {}
    other = torch.zeros(2, len(AGENT_COUNTS) + 1)  # the other process: two episodes of 1 call each, one silent
    other[:, AGENT_COUNTS.index("calls")] = torch.tensor([1.0, 0.0])
    other[1, -1] = 1.0
    seen = []

    def gather(rows):
        seen.append(rows.shape)
        return torch.cat([rows, other])

    metrics = agent_metrics([mine, silent], gather)
    assert seen == [(2, len(AGENT_COUNTS) + 1)]
    assert metrics["agent/calls_per_episode"] == 1.0 and metrics["agent/retries_per_episode"] == 0.25
    assert metrics["agent/new_samples/rewrite"] == 0.25 and metrics["agent/no_call_ratio"] == 0.5
    assert agent_metrics([Episode([1])], gather) == {} and len(seen) == 1  # no agent: nothing gathered


def test_a_call_past_max_env_steps_gets_an_openai_error_and_the_episode_stops_there(smollm2_tokenizer):
    """max_env_steps 1: the built-in loop runs one tool turn and stops at the next turn with calls, whose calls are not
    run. Through the endpoint, the call that brings the second turn's tool results is refused: 400 with code
    max_env_steps (the openai SDK's BadRequestError), not sampled; the episode ends `max_env_steps`."""
    import openai

    errors = []

    def agent(row, client):
        messages = [{"role": "user", "content": Q}]
        for _ in range(4):
            try:
                m = client.chat.completions.create(model="policy", messages=messages).choices[0].message
            except openai.BadRequestError as e:
                errors.append((e.status_code, e.code, e.param))
                return 0.0
            messages += [m.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "Unknown."} for c in m.tool_calls]

    env = _agent_env(smollm2_tokenizer, agent, max_env_steps=1)
    script = {Q: [xml_call("capital of Veltria"), xml_call("Veltria capital"), xml_answer("Morvane")]}
    (ep,) = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, script), rows=[{"question": Q}])
    assert errors == [(400, "max_env_steps", "max_env_steps")]
    assert ep.stop_reason == "max_env_steps" and [s.role for s in ep.spans] == ["model", "env", "model"]
    assert ep.agent_stats["past_max_env_steps"] == 1 and ep.agent_stats["calls"] == 3


def test_an_agents_failed_tool_calls_count_in_either_form_at_their_turn(smollm2_tokenizer):
    """An agent runs its own tools: a tool message in our failure form (`Error: ...`) or TRL's (`{'error': ...}`, what
    TRL's tool loop writes for a call that raised) is a failed call, any other reply one that ran; each call belongs
    to the environment turn its message opened."""
    replies = iter(["{'error': 'division by zero'}", "Error: no such page", "Morvane is the capital."])

    def agent(row, client):
        messages = [{"role": "user", "content": Q}]
        for _ in range(4):
            m = client.chat.completions.create(model="policy", messages=messages).choices[0].message
            messages += [m.model_dump(exclude_none=True)]
            if not m.tool_calls:
                return 1.0
            messages += [{"role": "tool", "tool_call_id": c.id, "content": next(replies)} for c in m.tool_calls]

    env = _agent_env(smollm2_tokenizer, agent, max_env_steps=4)
    script = {Q: [xml_call("capital of Veltria"), xml_call("Veltria capital"), xml_call("Veltria"),
                  xml_answer("Morvane")]}
    (ep,) = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, script), rows=[{"question": Q}])
    assert [(c.turn, c.ok) for c in ep.calls] == [(0, False), (1, False), (2, True)]
    assert ep.tool_failures == 2 and ep.tool_turns == 3


TWO_PROCESS_AGENT_RUN = """
import sys
sys.path.insert(0, "tests")
from datasets import Dataset
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
from test_agent_fixes import Q, _silent_for_quorvath

dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in (Q, "Who founded Quorvath?")])
args = MTGRPOConfig(output_dir=sys.argv[2], max_steps=1, num_generations=2, per_device_train_batch_size=2,
                    max_completion_length=32, bf16=False, use_cpu=True, report_to="none", save_strategy="no")
trainer = MTGRPOEnvTrainer(model=sys.argv[1], args=args, train_dataset=dataset, agent=_silent_for_quorvath)
print("built")
"""


def test_an_agent_run_on_two_processes_with_in_process_generation_is_refused_at_start(tiny_agent_dir, tmp_path):
    """In-process generation on several processes runs in lock-step rounds, which agents' calls do not keep: the
    trainer refuses it when it is built, naming the fix, before any rollout."""
    import subprocess

    from helpers import ROOT, launch

    script = tmp_path / "agent_run.py"
    script.write_text(TWO_PROCESS_AGENT_RUN)
    proc = subprocess.run([*launch(2), str(script), tiny_agent_dir, str(tmp_path / "out")], cwd=ROOT, timeout=300,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and "built" not in proc.stdout
    assert "An agent run on several processes needs `generation_backend: vllm_server`" in proc.stderr
