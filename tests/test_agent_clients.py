"""Agent programs written as each client's users write them (tests/agent_programs/) train 2 steps through the
endpoint (mt_grpo/agents/) on the tiny model, unmodified: the OpenAI Agents SDK over /v1/responses (Runner.run and
Runner.run_streamed, in a process of its own through `agent_command`, its base URL and key from the environment),
LangGraph's prebuilt ReAct agent over ChatOpenAI, smolagents' ToolCallingAgent over OpenAIServerModel, and a verifiers
v1 environment scored by its own rubric. A scripted policy writes each call's reply, so that the agents' tools really
run; every record is checked token by token: each model turn's ids are the scripted reply's and its logprobs the
sampler's (-0.5 a token), every other token (the agent's prompt, its tool outputs) has mask 0."""

import json
import os
import subprocess
import sys

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from helpers import ROOT, rollout_records
from scripted_policy import ScriptedTransformersBackend

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # LangGraph 1.x marks create_react_agent deprecated
              pytest.mark.filterwarnings("ignore:create_react_agent has been moved")]

PROGRAMS = os.path.join(ROOT, "tests", "agent_programs")
QUESTION = "What is the capital of Veltria?"
CALL = '<tool>{"name": "capital", "args": {"country": "Veltria"}}</tool>'  # the tiny model's format: xml (ChatML)
ROWS = [{"question": QUESTION, "answer": "Morvane"}, {"question": QUESTION.replace("Veltria", "Ostrand"),
                                                      "answer": "Kelsby"}]


def script_for(final: str) -> dict:
    """Each question's two calls: the capital tool, then `final` (the answer's text, or smolagents' final_answer)."""
    return {row["question"]: [CALL.replace("Veltria", row["question"].split()[-1][:-1]),
                              final.replace("ANSWER", row["answer"])] for row in ROWS}


def train(tmp_path, model_dir: str, script: dict, budget: int = 192, function=None,
          **agent) -> tuple[list[dict], list[dict]]:
    """Two steps of the agent (the recipe's `agent=` or `agent_command=`, or the trainer's `agent` keyword: `function`)
    with the scripted policy: (records of both steps, logs). `budget`: max_completion_length."""
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    args = MTGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=2,
                        per_device_train_batch_size=4, max_completion_length=budget, max_tokens_per_turn=64,
                        learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                        save_strategy="no", save_rollouts_steps=1, generation_backend="transformers",
                        disable_tqdm=True, agent_timeout=120, **agent)
    trainer = MTGRPOEnvTrainer(model_dir, args=args, train_dataset=Dataset.from_list(ROWS * 4), agent=function,
                               backend=lambda env: ScriptedTransformersBackend(env.tokenizer, script))
    trainer.train()
    records = [r for step in (1, 2) for r in rollout_records(args.output_dir, f"step-{step:06d}.jsonl")]
    return records, [log for log in trainer.state.log_history if "loss" in log]


def check_tokens(records: list[dict], tokenizer, script: dict) -> None:
    """Each model turn is the scripted reply (`script[question]`: the texts sampled), its ids and logprobs (-0.5) as
    sampled; every other token has mask 0."""
    assert len(records) == 8
    for r in records:
        tokens, turns = r["tokens"], r["turns"]
        model = [t for t in turns if t["role"] == "model"]
        assert [t["text"] for t in model] == script[r["question"]]
        mask = [0] * len(tokens["ids"])
        for turn, text in zip(model, script[r["question"]]):
            span = slice(turn["start"], turn["end"])
            assert tokens["ids"][span] == tokenizer.encode(text, add_special_tokens=False)
            assert tokens["sampler_logprob"][span] == [-0.5] * (turn["end"] - turn["start"])
            mask[span] = [1] * (turn["end"] - turn["start"])
        assert tokens["model_mask"] == mask  # the agent's messages and its tools' outputs: mask 0
        env_text = "".join(t["text"] for t in turns if t["role"] == "env")
        assert r["answer"] in env_text  # the agent's tool ran, and its output reached the episode as env tokens
        assert r["rewards"]["outcome"]["agent_reward"] == 1.0  # what the agent returned


@pytest.mark.parametrize("how", ["run", "run_streamed", "in_process"])
def test_openai_agents_sdk_over_responses(tmp_path, tiny_model_dir, how):
    script = script_for("The capital is ANSWER.")
    command = f"{sys.executable} {os.path.join(PROGRAMS, 'openai_agents_sdk.py')}" + (" --stream" if how ==
                                                                                        "run_streamed" else "")
    agent = dict(agent="agent_programs.openai_agents_sdk:run") if how == "in_process" else dict(agent_command=command)
    records, logs = train(tmp_path, tiny_model_dir, script, **agent)
    check_tokens(records, AutoTokenizer.from_pretrained(tiny_model_dir), script)
    # the SDK sends back our output items: each second call extends the first, one sample an episode
    assert all(log["agent/new_samples/rewrite"] == 0 and log["agent/calls_per_episode"] == 2 for log in logs)
    assert all(r["tool_calls"][0]["ok"] for r in records)


def test_langgraph_react_agent(tmp_path, tiny_model_dir):
    script = script_for("The capital is ANSWER.")
    records, logs = train(tmp_path, tiny_model_dir, script, agent="agent_programs.langgraph_react:run")
    check_tokens(records, AutoTokenizer.from_pretrained(tiny_model_dir), script)
    assert all(log["agent/new_samples/rewrite"] == 0 and log["agent/calls_per_episode"] == 2 for log in logs)


def test_smolagents_tool_calling_agent(tmp_path, tiny_model_dir):
    """smolagents sends stop strings and tool_choice required on every call, and writes its history back as text
    ('Calling tools: [...]', 'Observation: ...'): each call after the first is a sample of its own, counted, whose
    prompt (the history re-rendered, about 150 tokens here) counts against the episode's budget. The policy's first
    reply runs on into an observation of its own: the sample ends at its stop string 'Observation:' (the tokens
    after it are never trained) and the agent gets the call before it, which runs."""
    script = script_for('<tool>{"name": "final_answer", "args": {"answer": "ANSWER"}}</tool>')
    sampled = {q: [turns[0] + "\nObservation:", turns[1]] for q, turns in script.items()}
    script = {q: [turns[0] + "\nObservation: Paris is the capital.", turns[1]] for q, turns in script.items()}
    records, logs = train(tmp_path, tiny_model_dir, script, budget=512,
                          agent="agent_programs.smolagents_tool_calling:run")
    check_tokens(records, AutoTokenizer.from_pretrained(tiny_model_dir), sampled)
    assert all(log["agent/new_samples/rewrite"] == 1 and log["agent/tool_choice_unenforced_per_episode"] == 2
               for log in logs)


def test_the_openai_sdks_responses_api_with_a_hand_written_tool_loop(tmp_path, tiny_model_dir):
    """`client.responses.create` as the openai SDK's users write a tool loop with it (the output items sent back with
    the function's output), on the client the trainer gives: one sample an episode; a request the endpoint cannot
    honour is the SDK's BadRequestError naming the field."""
    import openai

    refused = []
    capital = {"type": "function", "name": "capital", "description": "Look up the capital city of a country.",
               "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}

    def run(row, client: openai.OpenAI):
        for bad in ({"previous_response_id": "resp_1"}, {"tools": [{"type": "web_search"}]}):
            try:
                client.responses.create(model="policy", input=row["question"], **bad)
            except openai.BadRequestError as e:
                refused.append(e.body["param"])
        items = [{"role": "user", "content": row["question"]}]
        while True:
            response = client.responses.create(model="policy", input=items, tools=[capital])
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return 1.0 if row["answer"] in response.output_text else 0.0
            items += [{"type": "function_call_output", "call_id": call.call_id,
                       "output": {"Veltria": "Morvane", "Ostrand": "Kelsby"}[json.loads(call.arguments)["country"]]}
                      for call in calls]

    script = script_for("The capital is ANSWER.")
    records, logs = train(tmp_path, tiny_model_dir, script, function=run)
    check_tokens(records, AutoTokenizer.from_pretrained(tiny_model_dir), script)
    assert all(log["agent/new_samples/rewrite"] == 0 and log["agent/refused_per_episode"] == 2 and
               log["agent/calls_per_episode"] == 4 for log in logs)
    assert sorted(refused) == ["previous_response_id"] * 8 + ["tools[0].type"] * 8  # 4 episodes a step, 2 steps


def package_index_reachable() -> bool:
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not package_index_reachable(), reason="verifiers v1 prepares its harness program with `uv sync "
                    "--script` from the package index at run time")
def test_verifiers_v1_environment_scored_by_its_rubric(tmp_path, tmp_path_factory, tiny_model_dir):
    """A verifiers v1 taskset played by its default harness (`bash`, verifiers' chat program with bash and edit tools,
    in a local subprocess runtime, through verifiers' interception server), its reward the task's `@vf.reward`. In a
    process of its own: the adapters' tests put the classic verifiers copy (mt_grpo/compat) in `verifiers`' place. The
    harness installs uv and its program's dependencies at run time: into a HOME of the session's own."""
    home = tmp_path_factory.getbasetemp() / "verifiers-home"
    home.mkdir(exist_ok=True)
    script = script_for("The capital is ANSWER.")
    script = {q: ['<tool>{"name": "bash", "args": {"command": "echo ' + row["answer"] + '"}}</tool>', turns[1]]
              for (q, turns), row in zip(script.items(), ROWS)}
    code = (f"import json, pathlib, sys; sys.path[:0] = {[ROOT, os.path.join(ROOT, 'tests'), PROGRAMS]!r}\n"
            "from test_agent_clients import train\n"
            f"records, logs = train(pathlib.Path({str(tmp_path)!r}), {tiny_model_dir!r}, {script!r}, "
            "agent='agent_programs.verifiers_v1_env:run')\n"
            "print('LOGS ' + json.dumps(logs))")
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    logs = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("LOGS "))[len("LOGS "):])
    records = [r for step in (1, 2) for r in rollout_records(str(tmp_path / "run"), f"step-{step:06d}.jsonl")]
    check_tokens(records, AutoTokenizer.from_pretrained(tiny_model_dir), script)
    assert all(log["agent/calls_per_episode"] == 2 and log["agent/new_samples/rewrite"] == 0 for log in logs), logs
