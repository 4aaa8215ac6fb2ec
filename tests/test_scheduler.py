"""The per-episode scheduler (no round barriers) against lock-step rounds: identical episodes, token
for token, from the same scripted policy; a slow tool holds up only its own conversation."""

import threading

import pytest

from helpers import fake_search, make_env, xml_answer, xml_call
from mt_grpo_trainer import MultiTurnToolEnv
from mt_grpo.base.protocol import XMLProtocol
from scripted_policy import ScriptedPolicy, ScriptedServer


# Groups of four with episodes of one to four turns, failed calls, a call past max_env_steps, no action.
SCRIPT = {
    "Q-mixed": [[xml_answer("A")], [xml_call("a"), xml_answer("B")], [xml_call("a"), xml_call("b"), xml_answer("C")],
                [xml_call("a"), xml_call("x", "nope"), xml_call("c"), xml_answer("D")]],
    "Q-long": [[xml_call("1"), xml_call("2"), xml_call("3"), xml_answer("E")],
               [xml_call("one"), xml_call("2"), xml_call("3"), xml_call("4")],
               ["thinking aloud"], [xml_call('"bad json')]],
    "Q-one": [[xml_answer("F")]] * 4,
}


search = fake_search(lambda query: f"Result for {query}.")
LIMITS = dict(max_env_steps=3, max_tokens_per_turn=64, max_completion_length=600, max_tool_response_tokens=32)


def scheduler_env(tokenizer, scheduler):
    return make_env(tokenizer, [search], scheduler=scheduler, **LIMITS)


def as_record(ep):
    return (ep.prompt_ids, ep.completion_ids, ep.model_mask, ep.sampler_logprobs, ep.spans, ep.messages, ep.stop_reason,
            [(c.turn, c.name, c.args, c.ok, c.output) for c in ep.calls], ep.tokenization_mismatch)


@pytest.mark.parametrize("per_request, concurrency", [(1, 1), (2, 3), (64, 8)])
def test_both_schedulers_give_identical_episodes(smollm2_tokenizer, per_request, concurrency):
    prompts = [scheduler_env(smollm2_tokenizer, "rounds").prompt(q) for q in SCRIPT for _ in range(4)]
    rounds = scheduler_env(smollm2_tokenizer, "rounds").rollout(prompts, ScriptedPolicy(smollm2_tokenizer, SCRIPT))
    server = ScriptedServer(smollm2_tokenizer, SCRIPT, max_concurrent_requests=concurrency, prompts_per_request=per_request)
    per_episode = scheduler_env(smollm2_tokenizer, "per_episode").rollout(prompts, server)
    assert [as_record(ep) for ep in per_episode] == [as_record(ep) for ep in rounds]
    assert {ep.stop_reason for ep in rounds} == {"answer", "max_env_steps", "no_action"}
    assert server.most_in_flight <= concurrency
    # the first turn of a group is one request for four samples; later turns share requests up to per_request
    assert (1, 4) in server.calls and max(p for p, _ in server.calls) <= max(per_request, 1)


def test_auto_picks_per_episode_for_a_backend_that_submits_requests(smollm2_tokenizer):
    env = scheduler_env(smollm2_tokenizer, "auto")
    server = ScriptedServer(smollm2_tokenizer, SCRIPT)
    env.rollout([env.prompt("Q-one")] * 4, server)
    assert server.calls == [(1, 4)] and server.rounds == 0  # submit, never the rounds' another_round


def test_a_slow_tool_holds_up_only_its_own_conversation(smollm2_tokenizer):
    """With rounds, a fast three-turn conversation waits for a slow tool call in every round; per
    episode, it finishes while the slow call is still running. The slow call runs until the fast conversation
    has finished (an event, so that nothing depends on the machine's speed), or gives up: with rounds the fast
    one cannot finish meanwhile, so it gives up after 0.2 s; per episode it is let go at once (60 s would be a
    hang)."""
    script = {"Q-slow": [xml_call("slow"), xml_answer("S")], "Q-fast": [xml_call("1"), xml_call("2"), xml_answer("F")]}

    def slow_search(query: str) -> str:
        """Search the knowledge base."""
        if query == "slow":
            let_go.append(fast_done.wait(timeout=patience))
        return f"Result for {query}."

    class Recording(MultiTurnToolEnv):
        def record_model_turn(self, ep, sample):
            calls = super().record_model_turn(ep, sample)
            if ep.done:
                fast = self.tokenizer.decode(ep.prompt_ids).count("Q-fast")
                finished.append(fast)
                if fast:
                    fast_done.set()
            return calls

    slow_search.__name__ = "search"
    for scheduler, patience, expected in (("rounds", 0.2, [0, 1]), ("per_episode", 60, [1, 0])):
        finished, fast_done, let_go = [], threading.Event(), []  # what the tool and Recording see on this pass
        env = Recording(tokenizer=smollm2_tokenizer, protocol=XMLProtocol(), tools=[slow_search], scheduler=scheduler,
                        **LIMITS)
        backend = ScriptedPolicy(smollm2_tokenizer, script) if scheduler == "rounds" else ScriptedServer(smollm2_tokenizer, script)
        env.rollout([env.prompt("Q-slow"), env.prompt("Q-fast")], backend)
        assert finished == expected, scheduler  # 1 = the fast conversation finished
        assert let_go == [scheduler == "per_episode"], scheduler  # the slow call ended when the fast one did


def test_prompt_stream_lays_out_groups_and_ranks_like_trl_and_depends_only_on_the_batch_index():
    from types import SimpleNamespace

    from datasets import Dataset

    from mt_grpo_trainer import PromptStream

    data = Dataset.from_dict({"question": [f"q{i}" for i in range(5)]})
    args = SimpleNamespace(generation_batch_size=8, seed=3, shuffle_dataset=True)  # 2 prompts x 4 samples

    def stream(rank, world):
        return PromptStream(data, 4, args, SimpleNamespace(process_index=rank, num_processes=world))

    whole = [[r["question"] for r in stream(0, 1).batch(b)] for b in range(5)]
    for rows in whole:  # two groups of four identical prompts
        assert rows[:4] == [rows[0]] * 4 and rows[4:] == [rows[4]] * 4 and rows[0] != rows[4]
    # every question once per epoch (5 questions, 2 per batch: batch 2 straddles the epochs)
    first_epoch = [q for rows in whole[:2] for q in rows[::4]] + [whole[2][0]]
    assert sorted(first_epoch) == [f"q{i}" for i in range(5)]
    assert [[r["question"] for r in stream(0, 1).batch(b)] for b in range(5)] == whole  # the same again
    # two processes: rank r takes its half of the batch, in order
    for b in range(3):
        assert [r["question"] for r in stream(0, 2).batch(b)] + [r["question"] for r in stream(1, 2).batch(b)] == whole[b]


# (gradient_accumulation_steps, steps_per_generation, num_iterations): generations on, before, across and
# between optimizer-step boundaries (TRL allows steps_per_generation < gradient_accumulation_steps)
ASYNC_GRID = [(1, 1, 1), (4, 2, 1), (3, 2, 1), (2, 3, 1), (3, 1, 2)]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("ga, spg, iterations", ASYNC_GRID)
def test_async_rollout_trains_each_batch_once_in_order(tiny_agent_dir, tmp_path, ga, spg, iterations):
    """A real training run on TRL's micro-step schedule, with a scripted server: the batches handed to the
    trainer are 0, 1, 2, ... (each once, none dropped), each rolled out one batch ahead in the background
    (never again synchronously), so the sampler is never more than one generation batch ahead."""
    import json
    import math

    from helpers import RECIPE
    from mt_grpo_trainer import build_trainer

    data = tmp_path / "data.jsonl"
    # enough questions that no epoch ends inside the run (an epoch's end shortens its last accumulation window)
    data.write_text("".join(json.dumps({"question": f"{q} {i}", "answer": "A"}) + "\n"
                            for i in range(40) for q in ("Q-one",)))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"title": "A", "text": "A is the answer."}) + "\n")
    generations = 4
    max_steps = math.ceil(generations * spg * iterations / ga)
    trainer = build_trainer(
        ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path / "out"),
         "--dataset_name", str(data), "--corpus_path", str(corpus), "--generation_backend", "vllm_server",
         "--async_rollout", "true",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", str(ga),
         "--steps_per_generation", str(spg), "--num_iterations", str(iterations), "--max_steps", str(max_steps),
         "--max_completion_length", "256", "--max_tokens_per_turn", "64", "--max_tool_response_tokens", "32"],
        backend_factory=lambda env: ScriptedServer(env.tokenizer, SCRIPT))
    asked, started = [], []
    next_batch, start = trainer._async.next, trainer._async.start

    def recording_next(b):
        asked.append(b)
        return next_batch(b)

    def recording_start(b):
        started.append(b)
        return start(b)

    trainer._async.next, trainer._async.start = recording_next, recording_start
    trainer.train()
    trainer._async.wait()
    assert trainer._step == max_steps * ga  # micro-steps TRL ran
    expected = math.ceil(max_steps * ga / (spg * iterations))  # TRL generates every spg x iterations micro-steps
    assert asked == list(range(expected))
    assert started == list(range(expected + 1))  # each once; the last one is the prefetch nobody trains
