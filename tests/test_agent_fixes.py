"""Defects of the agent endpoint found after it was built (mt_grpo/agents/), each with its test: a step in which no
agent calls the model, a call the openai client retries after its sample was drawn, `agent/*` metrics gathered across
processes, and calls past `max_env_steps`."""

import math

import pytest

from helpers import rollout_records

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
