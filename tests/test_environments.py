"""TRL's environment_factory contract (environments.py): an instance per episode reset with its row, its methods
as tools, get_reward and the `environments=` of rewards; per-step rewards as turn credit, by hand; bad classes
fail at start-up naming the fix; and one class trained by the recipe field and by the Python API."""

import json
import os
import random
import sys
import threading
import time

import pytest
import torch

from env_examples import AsyncLock, BadReward, Clashing, Counter, Lock, NoDocstring, NoHints, NoReset, counter_value
from helpers import RECIPE, changed_parameters, fake_search, final_metrics, make_env, rollout_records, run
from scripted_policy import ScriptedPolicy


def xml_press(digit: int) -> str:
    return f'<reasoning>Try it.</reasoning>\n<tool>{{"name": "press", "args": {{"digit": {digit}}}}}</tool>'


def answer(text: str = "done") -> str:
    return f"<reasoning>So.</reasoning>\n<answer>{text}</answer>"


def lock_env(tokenizer, factory=Lock, tools=(), protocol=None, **overrides):
    from mt_grpo.rollout.environments import EnvironmentPool
    from mt_grpo.base.protocol import XMLProtocol

    protocol = protocol or XMLProtocol()
    pool = EnvironmentPool(factory, list(tools), protocol)
    return make_env(tokenizer, pool.all_tools(), protocol=protocol, environments=pool, task_prompt=None,
                    examples=None, max_env_steps=3, max_completion_length=600, **overrides), pool


def roll(env, rows, script):
    prompts = [env.prompt(row["prompt"]) for row in rows]
    return env.rollout(prompts, ScriptedPolicy(env.tokenizer, script), rows=rows)


# -- the contract --------------------------------------------------------------------------------------
def test_each_episode_gets_its_own_reset_instance_and_its_methods_as_tools(smollm2_tokenizer):
    env, pool = lock_env(smollm2_tokenizer)
    rows = [{"prompt": "Open lock A.", "code": "12"}, {"prompt": "Open lock B.", "code": "34"}]
    script = {"Open lock A.": [xml_press(1), xml_press(2), answer()], "Open lock B.": [xml_press(3), xml_press(9),
                                                                                          answer()]}
    a, b = roll(env, rows, script)
    # reset got the row, and its observation follows the user's message
    prompt_a = smollm2_tokenizer.decode(a.prompt_ids)
    assert "Open lock A. The lock has 2 digits." in prompt_a
    assert "press(digit: int)" in prompt_a and "Press the next digit" in prompt_a  # the method, as a tool
    lock_a, lock_b = a.toolset.environment, b.toolset.environment
    assert lock_a is not lock_b and isinstance(lock_a, Lock)
    assert (lock_a.code, lock_a.position, lock_b.code, lock_b.position) == ("12", 2, "34", 0)  # b's 9 reset it
    assert [m["content"] for m in a.messages if m["role"] == "tool"] == ["Click. 1 right so far.", "Open!"]
    assert [m["content"] for m in b.messages if m["role"] == "tool"] == ["Click. 1 right so far.",
                                                                         "Wrong: the lock resets."]
    assert a.toolset.turn_rewards == [[1.0], [1.0]] and b.toolset.turn_rewards == [[1.0], [-0.5]]
    # released after scoring, the instances serve the next episodes: reset, not rebuilt
    env.release([a, b])
    c, = roll(env, [{"prompt": "Open lock A.", "code": "5"}], {"Open lock A.": [xml_press(5), answer()]})
    assert c.toolset.environment in (lock_a, lock_b) and c.toolset.environment.code == "5"
    assert c.toolset.environment.step_rewards == [1.0]


def test_chat_template_format_lists_the_methods_schema(qwen_style_tokenizer):
    from mt_grpo.base.protocol import ChatTemplateProtocol, tool_schemas

    env, pool = lock_env(qwen_style_tokenizer, protocol=ChatTemplateProtocol(qwen_style_tokenizer))
    row = {"prompt": "Open it.", "code": "7"}
    text = env.render(env.prompt(row["prompt"]), add_generation_prompt=True)
    assert json.dumps(tool_schemas([Lock().press])[0]["function"]["parameters"])[:40] in text.replace("\n", "")
    assert '"name": "press"' in text


def test_async_methods_and_async_get_reward(smollm2_tokenizer):
    from mt_grpo_trainer import compute_rewards_per_func

    env, pool = lock_env(smollm2_tokenizer, factory=AsyncLock)
    rows = [{"prompt": "Open it.", "code": "4"}]
    ep, = roll(env, rows, {"Open it.": [xml_press(4), answer()]})
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["Open!"]
    outcome, turn = pool.reward_funcs
    assert [f.__name__ for f in outcome] == ["AsyncLock"] and [f.__name__ for f in turn] == ["AsyncLock_steps"]
    values = compute_rewards_per_func(outcome, [rows[0]["prompt"]], [ep.messages],
                                      {"environments": [ep.toolset.environment]})
    assert values.tolist() == [[1.0]]


def test_rewards_read_the_final_state_through_environments(smollm2_tokenizer):
    from mt_grpo_trainer import compute_rewards_per_func

    env, pool = lock_env(smollm2_tokenizer, factory=Counter)
    add = lambda n: f'<reasoning>Add.</reasoning>\n<tool>{{"name": "add", "args": {{"amount": {n}}}}}</tool>'  # noqa: E731
    eps = roll(env, [{"prompt": "Count up."}, {"prompt": "Count more."}],
               {"Count up.": [add(2), add(3), answer()], "Count more.": [add(7), answer()]})
    assert pool.reward_funcs == ([], [])  # no get_reward, no step_rewards: the recipe's rewards score it
    values = compute_rewards_per_func([counter_value], ["a", "b"], [ep.messages for ep in eps],
                                      {"environments": [ep.toolset.environment for ep in eps]})
    assert values.flatten().tolist() == [5.0, 7.0]


# -- per-step rewards as turn credit, by hand ---------------------------------------------------------------
def test_step_rewards_become_each_turns_reward_and_the_advantages_by_hand(smollm2_tokenizer):
    """Two episodes of one group. A: presses 1 (right, +1), then 2 (right, +1): turn rewards [1, 1], solved.
    B: presses 3 (wrong, -0.5), then 1 (right, +1): [-0.5, 1], not solved. A turn's R_T is the sum of what the
    environment appended during it; get_reward is R_O."""
    from mt_grpo_trainer import (AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table,
                                 weighted_reward)
    from mt_grpo.rollout.episodes import pad_episodes

    env, pool = lock_env(smollm2_tokenizer)
    rows = [{"prompt": "Open the lock.", "code": "12"}] * 2
    script = {"Open the lock.": [[xml_press(1), xml_press(2), answer()], [xml_press(3), xml_press(1), answer()]]}
    eps = roll(env, rows, script)
    outcome_funcs, turn_funcs = pool.reward_funcs
    columns = {"code": ["12", "12"], "environments": [ep.toolset.environment for ep in eps]}
    completions = [ep.messages for ep in eps]
    turn = compute_rewards_per_func(turn_funcs, ["p", "p"], completions, columns, [ep.tool_turns for ep in eps], 3)
    R_T = turn_reward_table(turn, torch.ones(1), torch.tensor([2, 2]), [True])
    assert R_T[:, :2].tolist() == [[1.0, 1.0], [-0.5, 1.0]] and torch.isnan(R_T[:, 2]).all()
    R_O = weighted_reward(compute_rewards_per_func(outcome_funcs, ["p", "p"], completions, columns), torch.ones(1))
    assert R_O.tolist() == [1.0, 0.0]
    turns = pad_episodes(eps, 0, False)["token_turns"]
    # mt_grpo: the first turn's R_T. A_T = (1, -0.5) normalised in the group = (+1, -1)/... with std of 2 values:
    # mean 0.25, deviations +-0.75, std (unbiased) 1.0607: A_T = +-0.7071. A_O likewise: +-0.7071.
    adv = mt_grpo_advantages(R_T[:, :1], R_O, turns, AdvantageSettings.of("mt_grpo", 2, turn_advantage_coef=1.0))
    first = (turns[0] == 0)
    assert torch.allclose(adv.tokens[0][first], torch.tensor(0.7071 + 0.7071), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(-0.7071 - 0.7071), atol=1e-4)
    later = turns[0] >= 1
    assert torch.allclose(adv.tokens[0][later], torch.tensor(0.7071), atol=1e-4)
    # per_turn: turn 1's rewards are equal (1, 1) and pooled with turn 0's: (1, 1, -0.5, 1), mean 0.625,
    # std (unbiased) 0.75: A_T(A, turn 1) = (1 - 0.625) / 0.75 = 0.5; A_T(B, turn 0) = -1.5
    adv = mt_grpo_advantages(R_T, R_O, turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][turns[0] == 1], torch.tensor(0.7071 + 0.5), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(-0.7071 - 1.5), atol=1e-4)


def test_a_turn_that_appended_nothing_has_no_score_and_a_non_number_fails(smollm2_tokenizer):
    from mt_grpo_trainer import compute_rewards_per_func

    env, pool = lock_env(smollm2_tokenizer)
    bad = '<reasoning>x</reasoning>\n<tool>{"name": "press", "args": {"digit": "one", "extra": 1}}</tool>'
    ep, = roll(env, [{"prompt": "Open.", "code": "1"}], {"Open.": [bad, answer()]})
    assert ep.tool_failures == 1  # bad arguments: the method never ran, nothing appended
    steps = pool.reward_funcs[1][0]
    assert steps(completions=[ep.messages], environments=[ep.toolset.environment]) == [[None]]  # not applicable
    ep.toolset.environment.step_rewards.append("a lot")
    ep.toolset.turn_rewards[0].append("a lot")
    with pytest.raises(RuntimeError, match=r"step_rewards holds 'a lot'"):
        compute_rewards_per_func([steps], ["p"], [ep.messages], {"environments": [ep.toolset.environment]},
                                 [1], 1)


class Penalized:
    """Penalty-only step rewards: a wrong guess appends -0.1, a right one nothing (no score); a guess that is not a
    number raises; `hint` appends None (no score); `skip` appends 0.0, a turn scored 0 on purpose."""

    def __init__(self):
        self.secret, self.step_rewards = "7", []

    def reset(self, secret: str = "7", **kwargs) -> None:
        self.secret, self.step_rewards = secret, []

    def guess(self, number: str) -> str:
        """Guess the secret.

        Args:
            number: the guess, a whole number.
        """
        int(number)
        if number == self.secret:
            return "Right."
        self.step_rewards.append(-0.1)
        return "Wrong."

    def hint(self) -> str:
        """Ask for a hint."""
        self.step_rewards.append(None)
        return "It is odd."

    def skip(self) -> str:
        """Skip a turn."""
        self.step_rewards.append(0.0)
        return "Skipped."


def xml_call(name: str, **args) -> str:
    return f'<reasoning>x</reasoning>\n<tool>{{"name": "{name}", "args": {json.dumps(args)}}}</tool>'


def test_a_turn_without_a_score_is_left_out_of_the_group_and_credited_nothing(smollm2_tokenizer):
    """Penalty-only step rewards. A guesses 5 (-0.1), then 7 (right: nothing appended). B guesses "x" (raises: nothing
    appended), asks a hint (None appended), skips (0.0, on purpose). Only the two scored turns pool: (-0.1, 0.0),
    mean -0.05, std (unbiased) 0.0707: A_T -0.7071 (A, turn 0) and 0.7071 (B, turn 2); the three turns without a
    score get no A_T (0 here: R_O 0, so A_O 0), where an implicit 0.0 would have ranked B's crash above A's guess."""
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table

    env, pool = lock_env(smollm2_tokenizer, factory=Penalized)
    rows = [{"prompt": "Find the secret.", "secret": "7"}] * 2
    script = {"Find the secret.": [[xml_call("guess", number="5"), xml_call("guess", number="7"), answer("7")],
                                   [xml_call("guess", number="x"), xml_call("hint"), xml_call("skip"), answer("7")]]}
    a, b = roll(env, rows, script)
    assert (a.tool_turns, b.tool_turns, a.tool_failures, b.tool_failures) == (2, 3, 0, 1)
    steps = pool.reward_funcs[1][0]
    environments = [a.toolset.environment, b.toolset.environment]
    assert steps(completions=[a.messages, b.messages], environments=environments) == [[-0.1, None],
                                                                                      [None, None, 0.0]]
    per_func = compute_rewards_per_func([steps], ["p"] * 2, [a.messages, b.messages],
                                        {"environments": environments}, [2, 3], 4)
    R_T = turn_reward_table(per_func, torch.ones(1), torch.tensor([2, 3]), [True])
    assert R_T[0, 0].item() == pytest.approx(-0.1) and R_T[1, 2].item() == 0.0
    assert torch.isnan(R_T[0, 1:]).all() and torch.isnan(R_T[1, :2]).all() and torch.isnan(R_T[1, 3])
    token_turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), token_turns, AdvantageSettings.of("per_turn", 2))
    for i, k, value in [(0, 0, -0.7071), (0, 1, 0.0), (0, 2, 0.0), (1, 0, 0.0), (1, 1, 0.0), (1, 2, 0.7071),
                        (1, 3, 0.0)]:
        assert torch.allclose(adv.tokens[i][token_turns[i] == k], torch.tensor(value), atol=1e-4), (i, k)


# -- timeouts, slow calls and pooled instances: each reward to its own turn and episode ------------------------
def call(name: str, **arguments):
    from mt_grpo.base.protocol import ToolCall

    return ToolCall(name=name, arguments=arguments)


@pytest.fixture
def gated():
    """A pool of Gated environments (step_rewards created in reset), the gate closed and the events cleared;
    the gate is opened at the end, so that no action is left waiting."""
    from mt_grpo.rollout.environments import EnvironmentPool
    from env_examples import Gated
    from mt_grpo.base.protocol import XMLProtocol

    Gated.gate.clear()
    Gated.events.clear()
    yield EnvironmentPool(Gated, [], XMLProtocol())
    Gated.gate.set()


def start_episode(pool, code="0"):
    prompts, (toolset,) = pool.start([{"prompt": "Act.", "row": 7, "code": code}], [[{"role": "user",
                                                                                      "content": "Act."}]])
    return toolset


def test_step_rewards_created_in_reset_are_found_at_start_up(gated):
    from env_examples import Gated

    assert not hasattr(Gated(), "step_rewards")  # the probe instance, never reset, has none
    outcome, turn = gated.reward_funcs
    assert [f.__name__ for f in outcome] == ["Gated"] and [f.__name__ for f in turn] == ["Gated_steps"]


def test_a_trainer_with_step_rewards_made_in_reset_gets_its_turn_reward(tiny_agent_dir, tmp_path):
    """With `turn_reward_funcs: []`, the environment's `<Class>_steps` is the turn reward (it once was missed, and
    the run stopped with "turn_reward_funcs is empty")."""
    from env_examples import Gated
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    args = MTGRPOConfig(output_dir=str(tmp_path), dataset_name=None, tools=[], turn_reward_funcs=[],
                        outcome_reward_funcs=[], num_generations=4, per_device_train_batch_size=4, use_cpu=True,
                        bf16=False, report_to="none", max_steps=1)
    trainer = MTGRPOEnvTrainer(tiny_agent_dir, args=args, environment_factory=Gated)
    assert [f.__name__ for f in trainer.turn_reward_funcs] == ["Gated_steps"]
    assert [f.__name__ for f in trainer.outcome_reward_funcs] == ["Gated"]


def test_a_slow_call_within_the_timeout_is_credited_to_its_own_turn(gated):
    from env_examples import Gated

    toolset = start_episode(gated)
    opener = threading.Thread(target=lambda: (wait_for(lambda: Gated.events == ["start 5"]), Gated.gate.set()))
    opener.start()
    first = toolset.run([call("act", worth=5.0)], timeout=30.0, max_workers=4)
    opener.join()
    second = toolset.run([call("quick", worth=1.0)], timeout=30.0, max_workers=4)
    assert [r.output for r in first + second] == ["done 5", "done 1"]
    assert toolset.turn_rewards == [[5.0], [1.0]]


def test_a_timed_out_call_is_waited_for_and_its_late_append_is_credited_to_no_turn(gated):
    """The issue's case: turn 1's action (worth 5) runs past tool_timeout; it ends while turn 2 waits to start. Turn 2's
    action (worth 1) starts only after it, and each turn holds only what its own calls appended in time."""
    from env_examples import Gated

    toolset = start_episode(gated)
    first = toolset.run([call("act", worth=5.0)], timeout=0.05, max_workers=4)
    assert first[0].output == "Error: tool 'act' timed out after 0.05s" and not first[0].ok
    Gated.gate.set()  # the late call now ends, after its turn
    second = toolset.run([call("quick", worth=1.0)], timeout=30.0, max_workers=4)
    assert second[0].output == "done 1"
    assert Gated.events == ["start 5", "end 5", "start quick 1", "end quick 1"]  # never at once
    assert toolset.turn_rewards == [[], [1.0]]  # the late 5 is credited to no turn
    steps = gated.reward_funcs[1][0]
    completion = [{"role": "assistant", "content": "", "tool_calls": [{}]}, {"role": "tool", "content": "x"}] * 2
    assert steps(completions=[completion], environments=[toolset.environment]) == [[None, 1.0]]  # no score


def test_a_call_still_running_after_the_grace_fails_the_rest_and_its_instance_is_not_reused(gated):
    from env_examples import Gated

    toolset = start_episode(gated)
    toolset.run([call("act", worth=5.0)], timeout=0.05, max_workers=4)
    second = toolset.run([call("quick", worth=1.0)], timeout=0.05, max_workers=4)  # the first still holds it
    assert toolset.stuck and second[0].output.startswith("Error: tool 'quick' was not run: an earlier call")
    assert toolset.turn_rewards == [[], []] and Gated.events == ["start 5"]  # quick never ran
    instance = toolset.environment
    outcome, turn = gated.reward_funcs
    assert outcome[0](environments=[instance]) == [None]  # its state is not settled: no reward from it
    gated.release([toolset])
    Gated.gate.set()
    wait_for(lambda: Gated.events[-1] == "end 5")  # the late call ends on the dropped instance
    fresh = start_episode(gated)
    assert fresh.environment is not instance and fresh.environment.step_rewards == []
    fresh.run([call("quick", worth=2.0)], timeout=30.0, max_workers=4)
    assert fresh.turn_rewards == [[2.0]] and outcome[0](environments=[fresh.environment]) == [2.0]


def test_a_pooled_instance_reused_after_a_timeout_starts_clean(gated):
    """Episode 1 times out and ends; its instance is released (the late call waited for: settled) and reset for
    episode 2, whose rewards hold only its own steps."""
    from env_examples import Gated

    first = start_episode(gated)
    first.run([call("act", worth=5.0)], timeout=0.05, max_workers=4)
    Gated.gate.set()
    gated.release([first])  # waits for the late call, then returns the instance
    second = start_episode(gated)
    assert second.environment is first.environment and second.environment.done == []
    second.run([call("quick", worth=1.0)], timeout=30.0, max_workers=4)
    assert second.turn_rewards == [[1.0]] and gated.reward_funcs[0][0](environments=[second.environment]) == [1.0]


def wait_for(condition, timeout: float = 30.0) -> None:
    """Wait until `condition()` holds, polling; fail after `timeout` seconds (a hang, not a timing)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


# -- step_rewards types, and errors that name the class, the method and the row -------------------------------
def test_a_tuple_step_rewards_is_read_and_a_wrong_type_fails_naming_the_class():
    from mt_grpo.rollout.environments import EnvironmentPool
    from env_examples import DictSteps, ResetDictSteps, TupleSteps
    from mt_grpo.base.protocol import XMLProtocol

    pool = EnvironmentPool(TupleSteps, [], XMLProtocol())
    assert [f.__name__ for f in pool.reward_funcs[1]] == ["TupleSteps_steps"]
    toolset = start_episode(pool)
    toolset.run([call("add", amount=2), call("add", amount=3)], timeout=30.0, max_workers=4)
    assert toolset.turn_rewards == [[2.0, 3.0]]
    with pytest.raises(ValueError, match=r"DictSteps.step_rewards is a dict; make it a list of numbers"):
        EnvironmentPool(DictSteps, [], XMLProtocol())
    with pytest.raises(TypeError, match=r"ResetDictSteps.step_rewards is a dict \(row 7 \(code='0'\)\); make it"):
        start_episode(EnvironmentPool(ResetDictSteps, [], XMLProtocol()))


def test_step_rewards_the_start_up_could_not_see_fail_at_the_first_reset():
    """A class without readable source (made at run time) that creates step_rewards in reset: the first reset
    stops the run with the fix, instead of training without the turn reward."""
    from mt_grpo.rollout.environments import EnvironmentPool
    from env_examples import Counter
    from mt_grpo.base.protocol import XMLProtocol

    def reset(self, **kwargs):
        self.value, self.step_rewards = 0, []

    Made = type("Made", (Counter,), {"reset": reset, "__module__": "nowhere"})
    pool = EnvironmentPool(Made, [], XMLProtocol())
    assert pool.reward_funcs == ([], [])
    with pytest.raises(ValueError, match=r"Made has `step_rewards` after reset, but .* create it in `__init__`"):
        start_episode(pool)


def test_a_reset_that_raises_names_the_class_and_the_row():
    from mt_grpo.rollout.environments import EnvironmentPool
    from env_examples import MissingColumn
    from mt_grpo.base.protocol import XMLProtocol

    pool = EnvironmentPool(MissingColumn, [], XMLProtocol())
    with pytest.raises(RuntimeError, match=r"MissingColumn.reset raised KeyError: 'missing_column', for row 7 "
                                           r"\(code='0'\)") as error:
        start_episode(pool)
    assert isinstance(error.value.__cause__, KeyError)


def test_a_tool_that_raises_shows_the_model_its_message_and_names_the_class_method_and_row():
    from mt_grpo.rollout.environments import EnvironmentPool
    from env_examples import FailingTool
    from mt_grpo.base.protocol import XMLProtocol

    toolset = start_episode(EnvironmentPool(FailingTool, [], XMLProtocol()))
    result, = toolset.run([call("add", amount=12)], timeout=30.0, max_workers=4)
    assert result.output == "Error: tool 'add' raised ValueError: unknown amount 12; use 1 to 9"
    assert toolset.failures == ["FailingTool.add (row 7 (code='0')): " + result.output]


# -- bad input fails at start-up, naming the fix ------------------------------------------------------------
@pytest.mark.parametrize("factory, message", [
    (NoReset, r"NoReset has no `reset` method.*def reset\(self, \*\*kwargs\)"),
    (NoHints, r"NoHints.press is a tool, and its argument\(s\) \['digit'\] have no type hint"),
    (NoDocstring, r"NoDocstring.press is a tool without a docstring"),
    (Clashing, r"\['search'\] have the name of a tool in `tools`.*rename the method"),
    ("tests.env_examples:Missing", r"module 'tests.env_examples' has no attribute 'Missing'"),
    (42, r"`environment_factory` is a int"),
])
def test_bad_environment_classes_fail_at_start_up(factory, message):
    from mt_grpo.rollout.environments import EnvironmentPool, load_factory
    from mt_grpo.base.protocol import XMLProtocol

    with pytest.raises(ValueError, match=message):
        EnvironmentPool(load_factory(factory), [fake_search(lambda q: "")], XMLProtocol())


def test_get_reward_returning_a_non_number_names_it(smollm2_tokenizer):
    from mt_grpo_trainer import compute_rewards_per_func

    env, pool = lock_env(smollm2_tokenizer, factory=BadReward)
    ep, = roll(env, [{"prompt": "Open.", "code": "1"}], {"Open.": [answer()]})
    with pytest.raises(RuntimeError, match=r"BadReward.get_reward returned 'high' \(str\); it must return a number"):
        compute_rewards_per_func(pool.reward_funcs[0], ["p"], [ep.messages], {"environments": [ep.toolset.environment]})


def test_a_dict_of_factories_routes_rows_by_their_environment_column(smollm2_tokenizer):
    from mt_grpo.rollout.environments import EnvironmentPool
    from mt_grpo.base.protocol import XMLProtocol

    pool = EnvironmentPool({"lock": Lock, "counter": Counter}, [], XMLProtocol())
    env = make_env(smollm2_tokenizer, pool.all_tools(), environments=pool, task_prompt=None, examples=None,
                   max_completion_length=600)
    rows = [{"prompt": "Open.", "code": "3", "environment": "lock"}, {"prompt": "Count.", "environment": "counter"}]
    prompts = [env.prompt(r["prompt"], pool.tools(r["environment"])) for r in rows]
    add = '<reasoning>Add.</reasoning>\n<tool>{"name": "add", "args": {"amount": 4}}</tool>'
    lock_ep, counter_ep = env.rollout(prompts, ScriptedPolicy(smollm2_tokenizer, {"Open.": [xml_press(3), answer()],
                                                                                   "Count.": [add, answer()]}),
                                      rows=rows)
    lock_prompt, counter_prompt = (smollm2_tokenizer.decode(ep.prompt_ids) for ep in (lock_ep, counter_ep))
    assert "press(" in lock_prompt and "add(" not in lock_prompt  # only its environment's tools
    assert "add(" in counter_prompt and "press(" not in counter_prompt
    assert isinstance(counter_ep.toolset.environment, Counter) and counter_ep.toolset.environment.value == 4
    assert [f.__name__ for f in pool.reward_funcs[0]] == ["Lock"]
    assert pool.reward_funcs[0][0](environments=[lock_ep.toolset.environment, counter_ep.toolset.environment]) \
        == [1.0, None]  # only the Lock's episode is scored by the Lock's get_reward
    with pytest.raises(ValueError, match=r"`environment: 'chess'`, which is not a key of `environment_factory`"):
        env.rollout(prompts[:1], ScriptedPolicy(smollm2_tokenizer, {}), rows=[{"prompt": "x", "environment": "chess"}])


# -- training, by the recipe field and by the Python API ---------------------------------------------------
def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


ENV_RECIPE = {"environment_factory": "tests.env_examples:Lock", "tools": [], "turn_reward_funcs": [],
              "outcome_reward_funcs": [], "max_steps": 1, "save_rollouts_steps": 1, "per_device_train_batch_size": 4,
              "eval_strategy": "no", "max_env_steps": 3}


def env_recipe(tmp_path, **fields) -> str:
    """The tiny recipe with an environment's fields (a list cannot be emptied from the command line)."""
    import yaml

    with open(RECIPE) as f:
        recipe = yaml.safe_load(f)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, **ENV_RECIPE, **fields}))
    return str(path)


def test_the_recipe_field_trains_on_an_environment(tiny_agent_dir, tmp_path):
    data = write_jsonl(tmp_path / "locks.jsonl", [{"prompt": "Open the lock.", "code": c} for c in ("12", "3")])
    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", env_recipe(tmp_path, dataset_name=data),
         "--model_name_or_path", tiny_agent_dir, "--output_dir", out], tmp_path)
    step = [h for h in final_metrics(out) if "loss" in h][0]
    assert "rewards/outcome/Lock" in step and "rewards/turn/Lock_steps" in step, sorted(step)
    record = rollout_records(out)[0]
    assert "Open the lock. The lock has" in record["prompt_text"] and "press(digit: int)" in record["prompt_text"]


def test_the_python_api_trains_without_a_dataset(tiny_agent_dir, tmp_path):
    """TRL's form: no dataset, reset gives the prompt, max_steps the length."""
    out = str(tmp_path / "api")
    code = f"""
import sys; sys.path.insert(0, "tests")
from env_examples import Lock
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
from scripted_policy import ScriptedTransformersBackend
press = lambda d: '<reasoning>Try.</reasoning>\\n<tool>{{"name": "press", "args": {{"digit": %d}}}}</tool>' % d
done = "<reasoning>So.</reasoning>\\n<answer>open</answer>"
# the sampled turns: one variant per sample of the group, so that the group's rewards differ
script = {{"The lock has 2 digits.": [[press(1), press(2), done], [press(3), done], [press(2), press(1), done],
                                      [done]]}}
args = MTGRPOConfig(output_dir={out!r}, dataset_name=None, tools=[], turn_reward_funcs=[], outcome_reward_funcs=[],
                    max_steps=2, num_generations=4, per_device_train_batch_size=4, max_completion_length=256,
                    max_tokens_per_turn=64, max_tool_response_tokens=16, use_cpu=True, bf16=False, report_to="none",
                    save_strategy="no", learning_rate=1e-3, logging_steps=1, disable_tqdm=True, save_rollouts_steps=1,
                    advantage_mode="per_turn", max_env_steps=3)
trainer = MTGRPOEnvTrainer({tiny_agent_dir!r}, args=args, environment_factory=Lock,
                           backend=lambda env: ScriptedTransformersBackend(env.tokenizer, script))
trainer.train()
trainer.save_model()
trainer.save_state()
"""
    run([sys.executable, "-c", code], tmp_path)
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2
    records = rollout_records(out)
    assert all(r["prompt_text"].endswith("user\n The lock has 2 digits.<|im_end|>\n<|im_start|>assistant\n")
               for r in records)
    # per_turn credit from the step rewards, by hand: (+1, +1), (-0.5), (-0.5, +1), no turn; get_reward 1, 0, 0, 0
    # the episode without a tool call has its first turn, credited 0 and pooled (issue 70: it once recorded [])
    assert [r["R_T"] for r in records[:4]] == [[1.0, 1.0], [-0.5], [-0.5, 1.0], [0.0]]
    mean = 1 / 3  # of the group's six turns; std 0.7528
    std = (sum((x - mean) ** 2 for x in (1.0, 1.0, -0.5, -0.5, 1.0, 0.0)) / 5) ** 0.5
    a = {x: (x - mean) / std for x in (1.0, -0.5, 0.0)}
    assert [r["A_T"] for r in records[:4]] == [pytest.approx(v) for v in
                                               ([a[1.0], a[1.0]], [a[-0.5]], [a[-0.5], a[1.0]], [a[0.0]])]
    assert [r["R_O"] for r in records[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert changed_parameters(tiny_agent_dir, out), "a group with signal moved no parameter"


def test_environment_config_errors(tiny_agent_dir, tmp_path):
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer, build_trainer

    args = MTGRPOConfig(output_dir=str(tmp_path), dataset_name=None, tools=[], turn_reward_funcs=[],
                        outcome_reward_funcs=[], num_generations=4, per_device_train_batch_size=4, use_cpu=True,
                        bf16=False, report_to="none")
    with pytest.raises(ValueError, match=r"`max_steps` sets the run's length"):
        MTGRPOEnvTrainer(tiny_agent_dir, args=args, environment_factory=Lock)
    # no dataset and the default dataset_name: no dataset, as in TRL (issue 70: it was refused; before that, a
    # newcomer's run trained on the knowledge base silently), so max_steps is needed, and then it builds
    args.dataset_name = "fictional_kb"
    with pytest.raises(ValueError, match=r"`max_steps` sets the run's length"):
        MTGRPOEnvTrainer(tiny_agent_dir, args=args, environment_factory=Lock)
    args.max_steps = 2
    trainer = MTGRPOEnvTrainer(tiny_agent_dir, args=args, environment_factory=Lock)
    assert trainer.args.dataset_name is None and args.dataset_name == "fictional_kb"  # the caller's config as given
    assert len(trainer.train_dataset) == 1 and trainer.train_dataset[0]["prompt"][-1] == {"role": "user", "content": ""}
    assert sorted(t.__name__ for t in trainer.env.environments.tools()) == ["press"]  # no search tool of the base
    argv = ["--config", env_recipe(tmp_path), "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"`environment_factory` with `async_rollout`"):
        build_trainer(argv + ["--async_rollout", "true", "--generation_backend", "vllm_server",
                              "--vllm_importance_sampling_correction", "true"])


# -- the same class under TRL's GRPOTrainer and under ours -------------------------------------------------
def test_one_class_gives_trl_and_us_the_same_prompts_and_tool_schemas(tiny_model_dir, tmp_path, monkeypatch):
    """Lock under TRL 1.16's GRPOTrainer(environment_factory=Lock) for a step, its chat template calls recorded;
    then under ours, chat_template tool format. The tool schemas are equal, the user's message after reset is
    equal, and our prompt is TRL's conversation rendered with the same tools: nothing differs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from transformers.utils import get_json_schema
    from trl import GRPOConfig, GRPOTrainer

    from helpers import qwen_tokenizer
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = qwen_tokenizer(tiny_model_dir, "qwen2.5")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer))
    rows = [{"prompt": [{"role": "user", "content": "Open the lock."}], "code": "12"}] * 2
    renders = []
    render = tokenizer.apply_chat_template

    def spy(conversation, *args, **kwargs):
        batch = conversation if conversation and isinstance(conversation[0], list) else [conversation]
        renders.extend((c, kwargs.get("tools")) for c in batch if "Open the lock." in str(c))
        return render(conversation, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    common = dict(max_steps=1, num_generations=2, per_device_train_batch_size=2, max_completion_length=16,
                  use_cpu=True, bf16=False, report_to="none", save_strategy="no")
    GRPOTrainer(model=model, args=GRPOConfig(output_dir=str(tmp_path / "trl"), **common),
                train_dataset=Dataset.from_list(rows), processing_class=tokenizer, environment_factory=Lock).train()
    trl_conversation, trl_tools = renders[0]
    monkeypatch.setattr(tokenizer, "apply_chat_template", render)

    ours = MTGRPOEnvTrainer(model, args=MTGRPOConfig(output_dir=str(tmp_path / "ours"), tool_format="chat_template",
                                                     tools=[], outcome_reward_funcs=[], turn_reward_funcs=[],
                                                     eval_strategy="no", max_tokens_per_turn=16,
                                                     max_tool_response_tokens=8, **common),
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer, environment_factory=Lock)
    row = dict(ours.train_dataset[0])
    (prompt,), (toolset,) = ours.env.environments.start([row], [row["prompt"]])
    assert toolset.template_tools == [get_json_schema(fn) for fn in trl_tools]  # the same schemas
    assert prompt[-1] == trl_conversation[-1] == {"role": "user", "content": "Open the lock. The lock has 2 digits."}
    assert prompt == trl_conversation  # a TRL prompt with no task prompt of its own: no system message is added
    expected = render(trl_conversation, tools=trl_tools, tokenize=False, add_generation_prompt=True)
    assert ours.env.render(prompt, add_generation_prompt=True, toolset=toolset) == expected
    assert row["code"] == "12" and toolset.environment.code == "12"  # reset received the row


def test_the_guides_environment_trains_as_written(tiny_agent_dir, tmp_path, monkeypatch):
    """docs/guide.md's "Bring your own environment": its class in my_env/lock.py, its recipe keys over the tiny
    recipe, a file of locks; one step trains, with the class's tool in the prompt and its rewards logged."""
    import re

    import yaml

    from helpers import ROOT

    text = open(os.path.join(ROOT, "docs", "guide.md")).read()
    files = dict(re.findall(r"```(?:python|yaml)\n# (my_env/[\w.]+)[^\n]*\n(.*?)```", text, re.S))
    # quiz: test_user_turns; hotcold (a worked game): test_protocol
    assert sorted(files) == ["my_env/hotcold.py", "my_env/hotcold.yaml", "my_env/lock.py", "my_env/quiz.py",
                             "my_env/recipe.yaml"]
    (tmp_path / "my_env").mkdir()
    (tmp_path / "my_env" / "lock.py").write_text(files["my_env/lock.py"])
    assert len(files["my_env/lock.py"].strip().splitlines()) <= 30
    data = write_jsonl(tmp_path / "my_env" / "locks.jsonl", [{"prompt": "Open the lock.", "code": "4071"}] * 2)
    keys = yaml.safe_load(files["my_env/recipe.yaml"])
    with open(RECIPE) as f:
        recipe = {**yaml.safe_load(f), **keys, "dataset_name": data, "max_steps": 1, "save_rollouts_steps": 1,
                  "per_device_train_batch_size": 4, "max_completion_length": 192, "max_tokens_per_turn": 48}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", str(tmp_path / "recipe.yaml"), "--model_name_or_path",
         tiny_agent_dir, "--output_dir", out], tmp_path)
    step = [h for h in final_metrics(out) if "loss" in h][0]
    assert "rewards/outcome/Lock" in step and "rewards/turn/Lock_steps" in step
    record = rollout_records(out)[0]
    assert "The lock has 4 digits." in record["prompt_text"] and "press(digit: int)" in record["prompt_text"]
    assert record["environment"] == "Lock"


class Dice:
    """reset draws its game from `seed`, as DigitZoom and TextWorld do; the seeds it was given, in order."""

    seeds: list = []

    def reset(self, seed=None, **kwargs):
        Dice.seeds.append(seed)
        return f"Guess the die (game {random.Random(seed).randint(1, 6)})."

    def guess(self, face: int) -> str:
        """Guess the face.

        Args:
            face: A face from 1 to 6.
        """
        return "no"


@pytest.mark.parametrize("with_dataset", [False, True], ids=["no_dataset", "rows_without_seeds"])
def test_a_reset_that_names_seed_gets_one_per_group(tiny_agent_dir, tmp_path, with_dataset):
    """A group's G episodes play one game: an environment_factory whose reset names `seed` gets each row's (drawn with
    the run's seed where the row has none), the same for a group's episodes and another for each group. TRL passes
    only the row's own columns, so each episode there draws its own game, and the group's advantages compare
    different tasks."""
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    Dice.seeds = []
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Play."}]}] * 2) if with_dataset else None
    args = MTGRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4, use_cpu=True,
                        bf16=False, report_to="none", max_steps=1, max_completion_length=16, save_strategy="no",
                        turn_reward_funcs=[], outcome_reward_funcs=[], disable_tqdm=True)
    trainer = MTGRPOEnvTrainer(tiny_agent_dir, args=args, environment_factory=Dice, train_dataset=dataset,
                               reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    trainer.train()
    seeds = Dice.seeds[-4:]  # the step's 4 episodes
    assert None not in seeds and seeds[0] == seeds[1] != seeds[2] == seeds[3], Dice.seeds
