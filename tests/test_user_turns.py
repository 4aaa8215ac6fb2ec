"""The environment as the user (user_turns.py): replies to turns without a tool call, `done`, `end_episode`,
`max_user_turns`, continuation; each reply's score as its turn's reward, checked by hand."""

import sys

import pytest
import torch

import user_turn_examples as examples
from helpers import final_metrics, rollout_records, run
from scripted_policy import ScriptedPolicy
from test_environments import answer, env_recipe, lock_env, write_jsonl


def roll(env, rows, script, policy=None):
    prompts = [env.prompt(row["prompt"]) for row in rows]
    return env.rollout(prompts, policy or ScriptedPolicy(env.tokenizer, script), rows=rows)


def push(force: int = 1) -> str:
    return f'<reasoning>Push.</reasoning>\n<tool>{{"name": "push", "args": {{"force": {force}}}}}</tool>'


def test_feedback_is_a_user_turn_a_right_answer_ends_and_the_scores_are_each_turns_reward(smollm2_tokenizer):
    """A group of two: A answers 3 (wrong: feedback, score 0), then 7 (right: "Correct!", score 1, done).
    B answers 2, 4, 5: three wrong, then max_user_turns (3) is spent: no fourth reply, the episode ends on its
    answer. Each reply is a user message with mask 0; its score is the turn's R_T."""
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table
    from mt_grpo.rollout.episodes import pad_episodes

    examples.ENDED.clear()
    env, pool = lock_env(smollm2_tokenizer, factory=examples.Quiz, max_user_turns=3)
    rows = [{"prompt": "Guess the number.", "secret": "7"}] * 2
    script = {"Guess the number.": [[answer("3"), answer("7")], [answer("2"), answer("4"), answer("5"), answer("6")]]}
    a, b = roll(env, rows, script)
    assert a.stop_reason == "env_done" and [m["role"] for m in a.messages] == ["assistant", "user"] * 2
    assert a.messages[1]["content"] == "Wrong, try again." and a.messages[3]["content"] == "Correct!"
    assert b.stop_reason == "answer" and b.user_turns == 3 and len(b.messages) == 7  # 4 answers, 3 replies
    # the replies' tokens are the environment's (mask 0) and render as user turns
    for ep in (a, b):
        for span in ep.spans:
            assert set(ep.model_mask[span.start:span.end]) <= {1 if span.role == "model" else 0}
    reply = a.spans[1]
    text = smollm2_tokenizer.decode(a.completion_ids[reply.start:reply.end])
    assert "<|im_start|>user\nWrong, try again.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    # the quiz saw the whole conversation, the model's last answer last
    quiz = a.toolset.environment
    assert quiz.seen[0][-1] == {"role": "assistant", "content": answer("3"), "tool_calls": []}
    assert quiz.seen[0][0]["role"] == "system" and quiz.seen[1][-2]["content"] == "Wrong, try again."
    # the scores are each turn's reward, through Quiz_steps
    outcome_funcs, turn_funcs = pool.reward_funcs
    assert [f.__name__ for f in turn_funcs] == ["Quiz_steps"] and outcome_funcs == []
    columns = {"environments": [ep.toolset.environment for ep in (a, b)]}
    turns = [a.tool_turns, b.tool_turns]
    assert turns == [2, 3]
    per_func = compute_rewards_per_func(turn_funcs, ["p", "p"], [a.messages, b.messages], columns, turns, 3)
    R_T = turn_reward_table(per_func, torch.ones(1), torch.tensor(turns), [True])
    assert R_T[0, :2].tolist() == [0.0, 1.0] and torch.isnan(R_T[0, 2]) and R_T[1].tolist() == [0.0, 0.0, 0.0]
    # per_turn, by hand: pooled over (0, 1, 0, 0, 0): mean 0.2, std (unbiased) 0.4472; A_T(A, turn 1) = 1.7889,
    # every other turn -0.4472. R_O = 0 for both: A_O = 0.
    token_turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), token_turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][token_turns[0] == 1], torch.tensor(1.7889), atol=1e-4)
    assert torch.allclose(adv.tokens[0][token_turns[0] == 0], torch.tensor(-0.4472), atol=1e-4)
    assert torch.allclose(adv.tokens[1][token_turns[1] == 2], torch.tensor(-0.4472), atol=1e-4)
    assert (adv.tokens[1][token_turns[1] == 3] == 0).all()  # the last answer: no reply, no turn credit
    env.release([a, b])
    assert examples.ENDED == [("Quiz", "7"), ("Quiz", "7")]


def test_end_episode_runs_for_an_episode_whose_respond_raised(smollm2_tokenizer, caplog):
    examples.ENDED.clear()
    env, _ = lock_env(smollm2_tokenizer, factory=examples.Quiz)
    rows = [{"prompt": "Guess the number.", "secret": "boom"}, {"prompt": "Guess again.", "secret": "1"}]
    boom, fine = roll(env, rows, {"Guess the number.": [answer("3")], "Guess again.": [answer("1")]})
    assert boom.stop_reason == "env_error" and [m["role"] for m in boom.messages] == ["assistant"]
    assert fine.stop_reason == "env_done"
    assert "Quiz.respond failed" in caplog.text and "the interaction broke" in caplog.text
    env.release([boom, fine])
    assert sorted(examples.ENDED) == [("Quiz", "1"), ("Quiz", "boom")]


def test_a_tool_that_sets_done_ends_the_episode_after_its_reply(smollm2_tokenizer):
    env, pool = lock_env(smollm2_tokenizer, factory=examples.Door)
    (ep,) = roll(env, [{"prompt": "Open the door."}], {"Open the door.": [push(), push(), push(), answer()]})
    assert ep.stop_reason == "env_done" and ep.tool_turns == 2 and ep.messages[-1]["content"] == "It opens."
    assert pool.turn_rewards(ep.toolset.environment) == [[0.0], [1.0]]


def test_done_left_true_after_reset_fails_naming_the_fix(smollm2_tokenizer):
    class Stale(examples.Door):
        def reset(self, **kwargs):
            self.step_rewards = []

    env, _ = lock_env(smollm2_tokenizer, factory=Stale)
    env.environments.free[None][0].done = True
    with pytest.raises(ValueError, match=r"Stale.done is True after reset .*self.done = False"):
        roll(env, [{"prompt": "Open the door."}], {"Open the door.": [push()]})


def test_a_reply_of_the_wrong_type_fails_naming_the_class(smollm2_tokenizer):
    class Odd(examples.Quiz):
        def respond(self, messages):
            return 42

    env, _ = lock_env(smollm2_tokenizer, factory=Odd)
    with pytest.raises(ValueError, match=r"Odd.respond returned int .* return None .* a string .*Reply"):
        roll(env, [{"prompt": "Guess the number.", "secret": "7"}], {"Guess the number.": [answer("3")]})


class Continuing(ScriptedPolicy):
    """Writes "I think\\n<answer>3</answer>" first; after the tutor's tip (inside its own message), " it is 7.\\n
    <answer>7</answer>"."""

    def turn_text(self, ids, sample=0):
        text = self.tokenizer.decode(ids)
        return " it is 7.\n<answer>7</answer>" if "But wait," in text else "I think\n<answer>3</answer>"


def test_a_continuation_inserts_inside_the_models_message_and_sampling_continues(smollm2_tokenizer):
    """The tutor cuts the first sample before its <answer> (keep_tokens), inserts " But wait," (mask 0) inside the
    open assistant message, and the model continues the same message; one turn for the credit, the rewards see the
    continued message, and the tip's score is that turn's, though no reply follows (the episode ends on it)."""
    from mt_grpo.rollout.episodes import token_turn_index

    examples.TOKENIZER = smollm2_tokenizer
    env, pool = lock_env(smollm2_tokenizer, factory=examples.Tutor)
    (ep,) = roll(env, [{"prompt": "What is 3 + 4?"}], {}, Continuing(smollm2_tokenizer, {"What is 3 + 4?": []}))
    assert ep.stop_reason == "answer" and ep.user_turns == 1 and ep.tool_turns == 0
    assert [s.role for s in ep.spans] == ["model", "insert", "model"]
    assert ep.messages == [{"role": "assistant", "content": "I think\n But wait, it is 7.\n<answer>7</answer>",
                            "tool_calls": [], "outside_text": [[8, 18]]}]  # the tip: text from outside, in any render
    first, tip, second = ep.spans
    assert smollm2_tokenizer.decode(ep.completion_ids[first.start:first.end]) == "I think\n"  # cut before <answer>
    assert smollm2_tokenizer.decode(ep.completion_ids[tip.start:tip.end]) == " But wait,"
    assert ep.model_mask == [1] * first.end + [0] * (tip.end - tip.start) + [1] * (second.end - second.start)
    assert len(ep.sampler_logprobs) == len(ep.completion_ids)
    steps = pool.reward_funcs[1][0]
    assert steps(completions=[ep.messages], environments=[ep.toolset.environment]) == [[0.5]]  # the final turn's
    assert token_turn_index(ep.spans, len(ep.completion_ids)).tolist() == \
        [0] * first.end + [-1] * (tip.end - tip.start) + [0] * (second.end - second.start)
    # the whole completion reads as one assistant message, as a fresh render of the conversation gives it
    rendered = env.render_ids(ep.prompt_messages + ep.messages)
    assert smollm2_tokenizer.decode(ep.prompt_ids + ep.completion_ids) in smollm2_tokenizer.decode(rendered)
    assert not ep.tokenization_mismatch


class Checking(ScriptedPolicy):
    """Sample j plays variant j of its question; after each " Check again:" inside its message, the next turn."""

    def turn_text(self, ids, sample=0):
        text = self.tokenizer.decode(ids)
        variants = next(v for q, v in self.script.items() if q in text)
        k = text.count("Check again:")
        turns = variants[sample % len(variants)] if k == 0 else next(v for v in variants if v[0] in text)
        return turns[min(k, len(turns) - 1)]


def test_a_continued_turn_that_ends_the_episode_keeps_its_scores_summed(smollm2_tokenizer):
    """Secret 7, max_user_turns 2, a group of three whose episodes are each one continued message. A answers 3
    (" Check again:", 0.25), then 7 (no message, score 1: Reply(end=True)): R_T 1.25. B answers 2, 4 (0.25 each),
    then 5, past max_user_turns: no respond, its turn's two scores stay: 0.5. C answers 7 at once: 1. per_turn, by
    hand: mean 0.9167, std (unbiased) 0.3819: A_T = 0.8729, -1.0911, 0.2182 (R_O 0: A_O 0)."""
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table

    env, pool = lock_env(smollm2_tokenizer, factory=examples.Checker, max_user_turns=2)
    rows = [{"prompt": "Guess the number.", "secret": "7"}] * 3
    script = {"Guess the number.": [[answer("3"), answer("7")], [answer("2"), answer("4"), answer("5")],
                                    [answer("7")]]}
    eps = roll(env, rows, {}, Checking(smollm2_tokenizer, script))
    assert [[s.role for s in ep.spans] for ep in eps] == [["model", "insert", "model"],
                                                          ["model", "insert", "model", "insert", "model"], ["model"]]
    assert [ep.stop_reason for ep in eps] == ["answer"] * 3 and [ep.tool_turns for ep in eps] == [0, 0, 0]
    assert [pool.turn_rewards(ep.toolset.environment) for ep in eps] == [[[0.25, 1.0]], [[0.25, 0.25]], [[1.0]]]
    columns = {"environments": [ep.toolset.environment for ep in eps]}
    per_func = compute_rewards_per_func(pool.reward_funcs[1], ["p"] * 3, [ep.messages for ep in eps], columns,
                                        [0, 0, 0], 1)
    R_T = turn_reward_table(per_func, torch.ones(1), torch.zeros(3, dtype=torch.long), [True])
    assert R_T.flatten().tolist() == [1.25, 0.5, 1.0]
    token_turns = pad_episodes(eps, 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(3), token_turns, AdvantageSettings.of("per_turn", 3))
    for i, value in enumerate([0.8729, -1.0911, 0.2182]):
        assert torch.allclose(adv.tokens[i][token_turns[i] == 0], torch.tensor(value), atol=1e-4), i


def test_an_environment_with_respond_trains_from_the_recipe(tiny_agent_dir, tmp_path):
    """Two steps of the tiny model on the quiz; its user turns' scores are a turn reward (advantage_mode auto:
    per_turn), logged and recorded."""
    data = write_jsonl(tmp_path / "quiz.jsonl", [{"prompt": "Guess the number.", "secret": s} for s in "37"])
    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", env_recipe(
        tmp_path, dataset_name=data, environment_factory="tests.user_turn_examples:Quiz", max_steps=2,
        max_user_turns=2, outcome_reward_funcs=["format_reward_func"]),
         "--model_name_or_path", tiny_agent_dir, "--output_dir", out], tmp_path)
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2 and "rewards/turn/Quiz_steps" in steps[0], sorted(steps[0])
    records = rollout_records(out)
    replies = [t for r in records for t in r["turns"] if t["role"] == "env"]
    assert replies and all("user\n" in t["text"] and "step_rewards" in t for t in replies)
    assert {r["environment"] for r in records} == {"Quiz"}


def test_user_turns_under_the_per_episode_scheduler(smollm2_tokenizer):
    """The same quiz through a server's per-episode scheduler (requests out of order): the same conversations."""
    from scripted_policy import ScriptedServer

    env, _ = lock_env(smollm2_tokenizer, factory=examples.Quiz, max_user_turns=3, scheduler="per_episode")
    rows = [{"prompt": "Guess the number.", "secret": "7"}] * 2 + [{"prompt": "Guess again.", "secret": "1"}] * 2
    script = {"Guess the number.": [[answer("3"), answer("7")], [answer("2"), answer("4"), answer("5"), answer("6")]],
              "Guess again.": [answer("1")]}
    episodes = roll(env, rows, script, ScriptedServer(smollm2_tokenizer, script))
    assert [ep.stop_reason for ep in episodes] == ["env_done", "answer", "env_done", "env_done"]
    assert [ep.user_turns for ep in episodes] == [2, 3, 1, 1]
    assert episodes[0].messages[-1]["content"] == "Correct!" and episodes[1].messages[-2]["content"] == "Wrong, try again."


def test_the_guides_quiz_runs_as_written(smollm2_tokenizer, tmp_path, monkeypatch):
    """docs/guide.md's "The environment as the user": its Quiz, imported from the file the guide names."""
    import os
    import re

    from helpers import ROOT

    text = open(os.path.join(ROOT, "docs", "guide.md")).read()
    (code,) = re.findall(r"```python\n# my_env/quiz.py\n(.*?)```", text, re.S)
    (tmp_path / "my_env").mkdir()
    (tmp_path / "my_env" / "quiz.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_env.quiz import Quiz

    env, _ = lock_env(smollm2_tokenizer, factory=Quiz)
    wrong, right = roll(env, [{"prompt": "Guess the number.", "secret": "7"}, {"prompt": "Guess again.", "secret": "1"}],
                        {"Guess the number.": [answer("3"), answer("7")], "Guess again.": [answer("1")]})
    assert wrong.stop_reason == right.stop_reason == "env_done"
    assert [m["content"] for m in wrong.messages if m["role"] == "user"] == ["Wrong, try again.", "Correct!"]
    assert env.environments.turn_rewards(wrong.toolset.environment) == [[0.0], [1.0]]


def test_keep_chars_cuts_the_sample_where_its_text_reaches_them(smollm2_tokenizer):
    """The same tutor, saying where to cut in characters of the model's text: the same tokens stay."""
    class TutorChars(examples.Tutor):
        def respond(self, messages):
            if self.tipped:
                return None
            self.tipped = True
            return Reply(" But wait,", continuation=True, keep_chars=messages[-1]["content"].index("<answer>"))

    from mt_grpo.rollout.user_turns import Reply

    env, _ = lock_env(smollm2_tokenizer, factory=TutorChars)
    (ep,) = roll(env, [{"prompt": "What is 3 + 4?"}], {}, Continuing(smollm2_tokenizer, {"What is 3 + 4?": []}))
    first = ep.spans[0]
    assert smollm2_tokenizer.decode(ep.completion_ids[first.start:first.end]) == "I think\n"
    assert ep.messages[0]["content"] == "I think\n But wait, it is 7.\n<answer>7</answer>"


def test_a_respond_that_uses_signal_runs_once_then_on_the_main_thread(smollm2_tokenizer):
    """math_verify's default timeouts use `signal`, which works only on the main thread. A respond that counts its
    turn before it arms its alarm: its first call runs once, off the main thread with the alarm skipped (it used to
    fail there and run again on the main thread, counting twice); from then on it runs on the main thread, as a tool
    that uses `signal` does (tools.run_on_main), under both schedulers."""
    import signal
    import threading

    from scripted_policy import ScriptedServer

    script = {"Guess the number.": [answer("3"), answer("7")]}
    handler = signal.getsignal(signal.SIGALRM)  # pytest-timeout's, under the suite's --timeout
    for scheduler, policy in (("rounds", None), ("per_episode", ScriptedServer(smollm2_tokenizer, script))):
        on_main = []

        class Strict(examples.Quiz):  # a class per scheduler: each finds out on its first call
            def respond(self, messages):
                on_main.append(threading.current_thread() is threading.main_thread())
                old = signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))  # refused off the main thread
                signal.alarm(5)
                try:
                    return super().respond(messages)
                finally:
                    signal.alarm(0)
                    signal.signal(signal.SIGALRM, old)

        env, _ = lock_env(smollm2_tokenizer, factory=Strict, scheduler=scheduler)
        (ep,) = roll(env, [{"prompt": "Guess the number.", "secret": "7"}], script, policy)
        assert ep.stop_reason == "env_done" and ep.user_turns == 2, scheduler
        assert on_main == [False, True], scheduler  # each turn answered once: the second on the main thread
    assert signal.getsignal(signal.SIGALRM) is handler  # restored by respond on the main thread, skipped off it


def test_a_user_turn_starts_a_new_sample_where_the_template_rewrites_the_history(smollm2_tokenizer):
    """turn_samples: per_model_turn: after each reply the next sample's prompt is the template's render of the whole
    conversation, the user turn included (turn_samples.py), as after a tool reply."""
    env, _ = lock_env(smollm2_tokenizer, factory=examples.Quiz, turn_samples="per_model_turn")
    (ep,) = roll(env, [{"prompt": "Guess the number.", "secret": "7"}], {"Guess the number.": [answer("3"), answer("7")]})
    assert ep.stop_reason == "env_done" and len(ep.sample_starts) == 1  # the last reply ends it: no sample after it
    start, messages = ep.sample_starts[0]
    assert messages == 2 and ep.spans[1].start == start
    second = smollm2_tokenizer.decode(ep.completion_ids[start:ep.spans[1].end])
    assert second == smollm2_tokenizer.decode(env.render_ids(ep.prompt_messages + ep.messages[:2], True))
    assert "Wrong, try again." in second and not ep.tokenization_mismatch


def test_a_class_without_step_rewards_calls_its_tools_without_a_replaced_list_warning(smollm2_tokenizer, caplog):
    """Toolset.step_rewards gives one object for a class without step_rewards, so a call of its tool added nothing
    and replaced no list: no 'replaces its step_rewards' warning, and the turn earned nothing."""
    class Knock(examples.Quiz):
        def knock(self, times: int) -> str:
            """Knock on the door.

            Args:
                times: How many times.
            """
            return "Nobody answers."

    env, pool = lock_env(smollm2_tokenizer, factory=Knock)
    call = '<reasoning>Knock.</reasoning>\n<tool>{"name": "knock", "args": {"times": 2}}</tool>'
    (ep,) = roll(env, [{"prompt": "Guess the number.", "secret": "7"}], {"Guess the number.": [call, answer("7")]})
    assert ep.stop_reason == "env_done" and pool.turn_rewards(ep.toolset.environment) == [[], [1.0]]
    assert "replaces its step_rewards" not in caplog.text


def test_tool_turns_and_reply_turns_are_normalised_in_one_pool(smollm2_tokenizer):
    """Issue 78, point 13 (docs/guide.md, "One pool for every turn's score"): A calls `hint` (0.1), then answers
    right (1.0); B answers wrong (0.5), then right (1.0). R_T pools (0.1, 1.0, 0.5, 1.0) per group: mean 0.65,
    unbiased std 0.4359, so A's tool turn, below every reply, gets A_T = -1.2618 and B's wrong answer -0.3441."""
    from helpers import xml_call
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table
    from mt_grpo.rollout.episodes import pad_episodes

    env, pool = lock_env(smollm2_tokenizer, factory=examples.HintQuiz, max_user_turns=3)
    rows = [{"prompt": "Guess the number.", "secret": "7"}] * 2
    script = {"Guess the number.": [[xml_call("odd?", tool="hint"), answer("7")], [answer("3"), answer("7")]]}
    a, b = roll(env, rows, script)
    assert a.stop_reason == b.stop_reason == "env_done" and a.tool_turns == b.tool_turns == 2
    outcome_funcs, turn_funcs = pool.reward_funcs
    columns = {"environments": [ep.toolset.environment for ep in (a, b)]}
    per_func = compute_rewards_per_func(turn_funcs, ["p", "p"], [a.messages, b.messages], columns, [2, 2], 2)
    R_T = turn_reward_table(per_func, torch.ones(1), torch.tensor([2, 2]), [True])
    assert R_T.tolist() == [[pytest.approx(0.1), 1.0], [0.5, 1.0]]
    token_turns = pad_episodes([a, b], 0, False)["token_turns"]
    settings = AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0)
    adv = mt_grpo_advantages(R_T, torch.zeros(2), token_turns, settings)
    assert torch.allclose(adv.tokens[0][token_turns[0] == 0], torch.tensor(-1.2618), atol=1e-4)
    assert torch.allclose(adv.tokens[1][token_turns[1] == 0], torch.tensor(-0.3441), atol=1e-4)
    env.release([a, b])
