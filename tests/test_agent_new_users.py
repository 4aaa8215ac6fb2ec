"""Agents written from README.md and docs/guide.md alone, in each client's own style, on a task of their own (length
conversion: tests/agent_programs/units*.py), each trained through the endpoint: (a) the openai SDK's
chat.completions tool loop with parallel tool calls, the SDK's message objects appended as its docs do; (b) a
LangGraph StateGraph built by hand (a model node with bind_tools, a ToolNode), returning a bool; (c) smolagents'
ToolCallingAgent with a typed @tool; (d) the OpenAI Agents SDK with two tools and Runner.run_sync; (e) an
agent_command in another process. A scripted policy writes each call's reply so
that the agents' tools run; the recorded model turns are the script's, every other token mask 0."""

import os
import sys

import pytest
from datasets import Dataset

from helpers import ROOT, rollout_records
from scripted_policy import ScriptedPolicy, ScriptedTransformersBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

sys.path.insert(0, os.path.join(ROOT, "tests"))
from agent_programs.units import ROWS  # noqa: E402


def xml_convert(row) -> str:
    value, a, b = row["args"]
    return f'<tool>{{"name": "convert", "args": {{"value": {value}, "from_unit": "{a}", "to_unit": "{b}"}}}}</tool>'


SCRIPT = {row["question"]: [xml_convert(row), f"It is {row['answer']}."] for row in ROWS}


def train(tmp_path, model_dir: str, script: dict = SCRIPT, budget: int = 192,
          **agent) -> tuple[list[dict], list[dict]]:
    """Two steps of the agent with the scripted policy on the tiny model: (records of both steps, logs)."""
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    args = MTGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=2,
                        per_device_train_batch_size=4, max_completion_length=budget, max_tokens_per_turn=64,
                        learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                        save_strategy="no", save_rollouts_steps=1, generation_backend="transformers",
                        disable_tqdm=True, agent_timeout=120, **agent)
    rows = [{k: v for k, v in r.items() if k != "args"} for r in ROWS]
    trainer = MTGRPOEnvTrainer(model_dir, args=args, train_dataset=Dataset.from_list(rows * 4),
                               backend=lambda env: ScriptedTransformersBackend(env.tokenizer, script))
    trainer.train()
    records = [r for step in (1, 2) for r in rollout_records(args.output_dir, f"step-{step:06d}.jsonl")]
    return records, [log for log in trainer.state.log_history if "loss" in log]


def check(records: list[dict], logs: list[dict]) -> None:
    assert len(records) == 8 and len(logs) == 2
    for r in records:
        model = [t["text"] for t in r["turns"] if t["role"] == "model"]
        assert model == SCRIPT[r["question"]]
        assert r["answer"] in "".join(t["text"] for t in r["turns"] if t["role"] == "env")  # the tool ran
        assert r["rewards"]["outcome"]["agent_reward"] == 1.0
    assert all(log["agent/calls_per_episode"] == 2 and log["agent/new_samples/rewrite"] == 0 for log in logs)


@pytest.mark.parametrize("agent", ["units_langgraph_stategraph", "units_agents_sdk_run_sync", "command"])
def test_new_agents_train_two_steps(tmp_path, tiny_model_dir, agent):
    if agent == "command":
        program = os.path.join(ROOT, "tests", "agent_programs", "units_command.py")
        how = dict(agent_command=f"{sys.executable} {program}")
    else:
        how = dict(agent=f"agent_programs.{agent}:run")
    check(*train(tmp_path, tiny_model_dir, **how))


def test_smolagents_tool_calling_agent_with_a_typed_tool(tmp_path, tiny_model_dir):
    """(c) smolagents' ToolCallingAgent with a @tool of three typed arguments. smolagents writes its history back as
    text, so its second call starts a sample whose prompt re-renders the history, counted against
    max_completion_length: at the 192 the other agents here train with, its second call is refused 400
    `budget_spent` (whose message now says why and which field to raise); at 512 it fits."""
    final = {r["question"]: '<tool>{"name": "final_answer", "args": {"answer": "%s"}}</tool>' % r["answer"]
             for r in ROWS}
    script = {q: [turns[0], final[q]] for q, turns in SCRIPT.items()}
    records, logs = train(tmp_path, tiny_model_dir, script, budget=512, agent="agent_programs.units_smolagents:run")
    assert len(records) == 8 and all(r["rewards"]["outcome"]["agent_reward"] == 1.0 for r in records)
    assert all(r["answer"] in "".join(t["text"] for t in r["turns"] if t["role"] == "env") for r in records)
    assert all(log["agent/new_samples/rewrite"] == 1 and log["agent/refused_per_episode"] == 0 for log in logs)


def test_the_openai_sdks_parallel_tool_calls_with_its_message_objects_appended(qwen_style_tokenizer):
    """(a) tool_format chat_template: one reply with two calls (parallel tool calls) comes back as two tool_calls;
    the agent appends the SDK's ChatCompletionMessage itself (as the SDK's docs do) and both tool messages: a clean
    append, one sample, both results recorded as environment tokens."""
    from helpers import make_env
    from mt_grpo.agents.runner import AgentEnv, load_agent
    from mt_grpo.base.protocol import ChatTemplateProtocol

    row = ROWS[0]
    fmt = ChatTemplateProtocol().format_call
    calls = fmt("convert", {"value": 3, "from_unit": "mile", "to_unit": "meter"}) + "\n" + \
        fmt("convert", {"value": 3, "from_unit": "mile", "to_unit": "foot"})
    script = {row["question"]: [calls, f"It is {row['answer']} meters."]}
    env = AgentEnv(make_env(qwen_style_tokenizer, [], protocol=ChatTemplateProtocol(qwen_style_tokenizer),
                            max_tokens_per_turn=256, max_completion_length=1024),
                   agent=load_agent("agent_programs.units_openai_parallel:run"), batch_wait=600.0)
    (ep,) = env.rollout(None, ScriptedPolicy(qwen_style_tokenizer, script), rows=[row])
    assert env.results[id(ep.messages)] == {"reward": 1.0}
    # the final reply has no call and no <answer> tags: `no_action`, as the built-in loop names such a turn
    assert ep.sample_starts == [] and ep.stop_reason == "no_action" and ep.agent_stats["calls"] == 2
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["4828.03", "15840.00"]
    assert [c["function"]["arguments"]["to_unit"] for c in ep.messages[0]["tool_calls"]] == ["meter", "foot"]
