"""ms-swift's multi-turn schedulers and ORM rewards, trained unchanged (adapters/swift.py): the scheduler's loop body
as respond's replies (a new round, a continuation with the tokens that stay), swift's reward keywords, the errors."""

import asyncio
import os
import sys
import textwrap
from types import SimpleNamespace

import pytest

from helpers import ROOT

PLUGIN = os.path.join("tests", "fixtures", "swift", "plugin.py")
WRONG = "<think>4 times 9 is 36</think><answer>13</answer>"  # solution 12: MathAccuracy says 0
SOLUTION = "So the value is \\boxed{12}."


def config(spec, **fields):
    return SimpleNamespace(multi_turn_scheduler=spec, external_plugins=fields.pop("external_plugins", None),
                           swift_max_turns=fields.pop("swift_max_turns", None),
                           model_name_or_path=fields.pop("model_name_or_path", None), **fields)


def episode(spec, row=None, **fields):
    from mt_grpo.adapters.swift import adapt

    env = adapt(config(spec, **fields)).environment_factory()
    env.reset(**(row or {"prompt": [{"role": "user", "content": "What is sqrt(36*sqrt(16))?"}],
                         "solution": SOLUTION}))
    return env


def respond(env, messages):
    return asyncio.run(env.respond(messages))


QUESTION = [{"role": "system", "content": "Think, then answer."},
            {"role": "user", "content": "What is sqrt(36*sqrt(16))?"}]


# -- the scheduler's turns as replies ---------------------------------------------------------------------------------
def test_math_tips_scheduler_is_a_continuation_that_keeps_the_thinking(qwen_style_tokenizer, tiny_model_dir):
    """swift's MathTipsScheduler cuts the completion at the first of <answer> and </think> and appends its tip inside
    the model's message: the reply inserts the tip (continuation), and the text '<think>4 times 9 is 36' stays."""
    env = episode(f"{PLUGIN}:MathTipsScheduler", model_name_or_path=tiny_model_dir)
    reply = respond(env, QUESTION + [{"role": "assistant", "content": WRONG}])
    kept = "<think>4 times 9 is 36"
    assert (reply.continuation, reply.content, reply.score) == (True, "But wait... It seems I made a mistake,", None)
    assert reply.keep_chars == len(kept) and reply.keep_tokens is None  # the trainer cuts its own tokens there
    # the model continues in the same message; the tip is in it now, so swift stops (tips once)
    continued = kept + reply.content + " 6 times 2.</think><answer>12</answer>"
    assert respond(env, QUESTION + [{"role": "assistant", "content": continued}]) is None
    assert env.rollout_infos == {"num_turns": 2}


def test_a_right_answer_gets_no_reply_and_max_turns_stops_first():
    env = episode(f"{PLUGIN}:MathTipsScheduler")
    assert respond(env, QUESTION + [{"role": "assistant", "content": "<answer>12</answer>"}]) is None
    env = episode(f"{PLUGIN}:math_tip_trick_multi_turn", swift_max_turns=1)  # swift's --max_turns 1: one model turn
    assert env.scheduler.max_turns == 1
    assert respond(env, QUESTION + [{"role": "assistant", "content": WRONG}]) is None


def test_math_tips_multi_turn_scheduler_is_a_new_round():
    """3.x's MathTipsMultiTurnScheduler appends a user message (its step returns the request, 3.x's form)."""
    env = episode("math_tip_trick_multi_turn", external_plugins=[PLUGIN])
    first = QUESTION + [{"role": "assistant", "content": WRONG}]
    reply = respond(env, first)
    assert (reply.continuation, reply.done, reply.score) == (False, False, None)
    assert reply.content.startswith("The answer is not correct")
    again = first + [{"role": "user", "content": reply.content},
                     {"role": "assistant", "content": "<answer>11</answer>"}]
    assert respond(env, again) is None  # tips once: the query before the last answer is the tip
    assert env.rollout_infos["num_turns"] == 2 and env.multi_turn_infos is env.rollout_infos


def write_plugin(tmp_path, body: str, name: str = "my_plugin.py") -> str:
    path = tmp_path / name
    path.write_text("from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns\n"
                    + textwrap.dedent(body))
    return str(path)


def test_a_react_tool_scheduler_appends_its_observation_and_the_gym_rewards_are_turn_credit(tmp_path):
    """plugin.py's ToolCallScheduler form: step runs a tool named in the model's text and appends its result to the
    model's message (a continuation keeping the whole sample); rollout_infos reach the rewards, and the rewards the
    step appended to `step_rewards` (swift's gym convention) are the turn's score."""
    path = write_plugin(tmp_path, """
        class Calc(MultiTurnScheduler):
            def check_finished(self, infer_request, response_choice, current_turn):
                return 'Action:' not in response_choice.message.content or super().check_finished(
                    infer_request, response_choice, current_turn)

            def step(self, infer_request, response_choice, current_turn):
                expression = response_choice.message.content.split('Action Input:')[1].strip()
                result = f'Observation: {eval(expression)}\\n'
                infer_request.messages[-1]['content'] += result
                steps = [0.5] * current_turn
                return {'infer_request': infer_request, 'rollout_infos': {'tool_results': result,
                                                                          'step_rewards': steps}}
        """)
    env = episode(f"{path}:Calc")
    sample = "Thought: add.\nAction: calculator\nAction Input: 2+3"
    reply = respond(env, QUESTION + [{"role": "assistant", "content": sample}])
    assert (reply.continuation, reply.content, reply.keep_chars, reply.score) == (True, "Observation: 5\n", None, 0.5)
    # the next sample continues the same message: the scheduler sees only what was sampled after the observation
    second = "Action: calculator\nAction Input: 2*3"
    reply = respond(env, QUESTION + [{"role": "assistant", "content": sample + "Observation: 5\n" + second}])
    assert (reply.content, reply.score) == ("Observation: 6\n", 0.5)  # step_rewards grew by one 0.5
    assert respond(env, QUESTION + [{"role": "assistant", "content": "Final Answer: 6"}]) is None
    assert env.rollout_infos == {"tool_results": "Observation: 6\n", "step_rewards": [0.5, 0.5], "num_turns": 3}


def test_a_step_that_adds_an_image_replies_with_it_where_its_tag_is(tmp_path):
    """swift's DeepEyes form: step crops the request's image, appends a user message with an `<image>` tag and the
    crop to `infer_request.images`. The reply holds the crop where its tag was (engine/vision.py's blocks); on the next
    turn the request holds the conversation's images in order, each message's images as `<image>` tags; a crop in a
    file comes in by its path; tags that do not match the images added, or images with a continuation, are refused."""
    from PIL import Image

    picture = Image.new("RGB", (64, 64), (200, 30, 30))
    picture.save(tmp_path / "crop.png")
    path = write_plugin(tmp_path, f"""
        class Zoom(MultiTurnScheduler):
            seen = []

            def step(self, infer_request, response_choice, current_turn):
                Zoom.seen.append((infer_request.messages[0]['content'], list(infer_request.images)))
                crop = infer_request.images[-1].crop((0, 0, 32, 32))
                infer_request.messages.append({{'role': 'user', 'content': f'Zoomed <image> turn {{current_turn}}.'}})
                infer_request.images.append(crop if current_turn == 1 else {str(tmp_path / "crop.png")!r})
                return {{'infer_request': infer_request}}

        class Untagged(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({{'role': 'user', 'content': 'Zoomed.'}})
                infer_request.images.append(infer_request.images[0])
                return {{'infer_request': infer_request}}

        class Continued(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages[-1]['content'] += ' <image>'
                infer_request.images.append(infer_request.images[0])
                return {{'infer_request': infer_request}}
        """)
    question = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Zoom?"}]}]
    env = episode(f"{path}:Zoom", row={"prompt": question})
    first = question + [{"role": "assistant", "content": "zoom in"}]
    reply = respond(env, first)
    text_before, crop, text_after = reply.content
    assert (text_before, text_after) == ({"type": "text", "text": "Zoomed "}, {"type": "text", "text": " turn 1."})
    assert crop["type"] == "image" and crop["image"].size == (32, 32)
    assert crop["image"].getpixel((0, 0)) == picture.getpixel((0, 0))
    second = first + [{"role": "user", "content": reply.content}, {"role": "assistant", "content": "again"}]
    reply = respond(env, second)
    assert reply.content[1]["image"].size == (64, 64)  # the file, opened
    scheduler = env.scheduler
    assert [(text, [im.size for im in images]) for text, images in type(scheduler).seen] == [
        ("<image>Zoom?", [(64, 64)]), ("<image>Zoom?", [(64, 64), (32, 32)])]
    for name, message in (("Untagged", "added 1 images to the request and 0 `<image>` tags"),
                          ("Continued", "added images and continued the model's message")):
        with pytest.raises(ValueError, match=message):
            respond(episode(f"{path}:{name}", row={"prompt": question}), first)


# -- rewards: swift's keywords ----------------------------------------------------------------------------------------
def test_orm_rewards_get_swift_keywords_and_text_completions():
    from mt_grpo.adapters.swift import adapt
    from mt_grpo.adapters import resolve_reward

    adapt(config(None, external_plugins=[PLUGIN]))  # the plugin's `orms` registrations serve the reward lists
    seen = {}

    import swift.rewards as swift_rewards

    class Probe(swift_rewards.ORM):
        def __call__(self, completions, solution, **kwargs):
            seen.update(kwargs, completions=completions, solution=solution)
            return [float(len(c)) for c in completions]

    from mt_grpo.adapters import swift_form as swift_style

    probe = swift_style(Probe)
    assert probe.__name__ == "Probe"
    env = SimpleNamespace(rollout_infos={"num_turns": 2})
    completion = [{"role": "assistant", "content": "<think>a"}, {"role": "user", "content": "tip"},
                  {"role": "assistant", "content": "<answer>12</answer>"}]
    values = probe(prompts=[QUESTION], completions=[completion], solution=[SOLUTION], environments=[env],
                   stop_reason=["answer"], trainer_state=None)
    assert values == [len("<answer>12</answer>")]
    assert seen["completions"] == ["<answer>12</answer>"] and seen["solution"] == [SOLUTION]
    assert seen["messages"] == [QUESTION + completion]
    assert seen["rollout_infos"] == [{"num_turns": 2}] == seen["multi_turn_infos"]
    assert seen["is_truncated"] == [False] and seen["finish_reason"] == ["stop"]
    assert probe(prompts=[QUESTION], completions=[completion], solution=[SOLUTION],
                 stop_reason=["turn_length"]) == [19.0]
    assert seen["is_truncated"] == [True]
    # by dotted path, by the plugin's `orms` name, and swift's built-in 'accuracy' (MathAccuracy)
    fmt = resolve_reward("plugin:MultiTurnFormat")
    assert fmt.__name__ == "MultiTurnFormat" and resolve_reward("multi_turn_format").__name__ == "MultiTurnFormat"
    assert fmt(prompts=[QUESTION], completions=[completion]) == [1.0]
    accuracy = resolve_reward("accuracy")
    assert accuracy(prompts=[QUESTION], completions=[completion, [{"role": "assistant", "content": "13"}]],
                    solution=[SOLUTION] * 2) == [1.0, 0.0]


def test_an_async_orm_and_a_trl_function_are_told_apart():
    from mt_grpo.adapters.swift import is_swift_reward, swift_modules
    from mt_grpo.adapters import swift_form as swift_style

    swift_modules()
    import swift.rewards as swift_rewards

    class Later(swift_rewards.AsyncORM):
        async def __call__(self, completions, **kwargs):
            return [1.0 for _ in completions]

    def trl_reward(prompts, completions, **kwargs):
        return [0.0 for _ in completions]

    assert is_swift_reward(Later) and is_swift_reward(Later()) and not is_swift_reward(trl_reward)
    assert swift_style(trl_reward) is trl_reward
    assert swift_style(Later())(prompts=["q"], completions=[[{"role": "assistant", "content": "x"}]]) == [1.0]


# -- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, body, message", [
    ("missing.py:S", None, "plugin file 'missing.py' not found"),
    ("{plugin}:Nope", "", "has no class 'Nope'"),
    ("{plugin}", "", "is a file: name its class too"),
    ("not_registered", None, "is not a registered ms-swift scheduler"),
    ("{plugin}:NotOne", "class NotOne:\n    pass\n", "is not an ms-swift MultiTurnScheduler"),
    ("{plugin}:NoStep", "class NoStep(MultiTurnScheduler):\n    pass\n", "does not implement `step`"),
    ("{plugin}:Full", """
        class Full(MultiTurnScheduler):
            async def run(self, infer_request, request_config, **kwargs):
                return None
        """, "overrides `run`"),
    ("{plugin}:MyGym", """
        class GYMScheduler(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                return {'infer_request': infer_request}
        class MyGym(GYMScheduler):
            pass
        """, "is swift's GYMScheduler"),
    ("{plugin}:Broken", "import swift.infer_engine.vllm_engine_pieces_nobody_has\n", "failed to import"),
    ("{plugin}:Sudoku", """
        from swift.rollout.multi_turn import OpenEnvScheduler
        class Sudoku(OpenEnvScheduler):
            def parse_action(self, text):
                return {'message': text}
        """, "is swift's OpenEnvScheduler.*the `openenv_env` field"),
    ("gym_scheduler", None, "is swift's GYMScheduler"),
])
def test_scheduler_errors_name_the_problem_and_the_fix(tmp_path, spec, body, message):
    from mt_grpo.adapters.swift import adapt

    plugin = write_plugin(tmp_path, body, name=f"p{abs(hash(spec + (body or ''))) % 10**8}.py") if body is not None \
        else None
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", "`")):
        adapt(config(spec.format(plugin=plugin)))


def test_a_missing_swift_name_says_what_the_copy_offers():
    from mt_grpo.adapters.swift import swift_modules

    swift_modules()
    with pytest.raises(ImportError, match="pip install ms-swift"):
        from swift.infer_engine import VllmEngine  # noqa: F401
    from swift.infer_engine import TransformersEngine  # a plugin may import it (swift's own does): it stands in

    with pytest.raises(RuntimeError, match="mt-grpo's sampler generates every turn"):
        TransformersEngine("Qwen/Qwen2.5-7B-Instruct")


def test_a_step_that_appends_a_tool_message_or_rewrites_history_fails_naming_the_fix(tmp_path):
    path = write_plugin(tmp_path, """
        class ToolStep(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({'role': 'tool', 'content': '42'})
                return {'infer_request': infer_request}

        class Zoom(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({'role': 'user', 'content': '<tool_response><image></tool_response>'})
                infer_request.images.append('crop.png')
                return {'infer_request': infer_request}

        class Rewrite(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages[0]['content'] = 'another system prompt'
                return {'infer_request': infer_request}
        """)
    with pytest.raises(ValueError, match="Tool calls are run by the recipe's `tools`"):
        respond(episode(f"{path}:ToolStep"), QUESTION + [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"added an image of type str \('crop.png'\); give a PIL image or a local"):
        respond(episode(f"{path}:Zoom"), QUESTION + [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="rewrote the conversation"):
        respond(episode(f"{path}:Rewrite"), QUESTION + [{"role": "assistant", "content": "x"}])


# -- episodes: the scheduler's replies in the token stream, and each turn's credit -----------------------------------
class Tipped:
    """A scripted model: the first sample of each question, then, once the conversation holds a tip (a continuation
    inside the open message, or a user message), the next turn of its script."""

    def __init__(self, tokenizer, script: dict, marker: str = "mistake"):
        from scripted_policy import ScriptedPolicy

        self.policy = ScriptedPolicy(tokenizer, script)
        self.policy.turn_text = self.turn_text
        self.tokenizer, self.script, self.marker = tokenizer, script, marker

    def turn_text(self, ids, sample=0):
        text = self.tokenizer.decode(ids)
        question = next(q for q in self.script if q in text)
        variants = self.script[question]
        turns = variants[sample % len(variants)] if isinstance(variants[0], list) else variants
        if len(variants) > 1 and isinstance(variants[0], list) and turns[0] not in text and self.marker in text:
            turns = next(v for v in variants if v[0] in text or v[0].split("</think>")[0] in text)
        return turns[min(text.count(self.marker), len(turns) - 1)]


def swift_env(tokenizer, spec, **fields):
    from mt_grpo.adapters.swift import adapt
    from test_environments import lock_env

    factory = adapt(config(spec, **fields)).environment_factory
    return lock_env(tokenizer, factory=factory)


def roll(env, rows, policy):
    prompts = [env.prompt(row["prompt"]) for row in rows]
    return env.rollout(prompts, policy.policy, rows=rows)


def test_a_continuation_tip_sits_inside_the_models_message_with_mask_0(smollm2_tokenizer, smollm2_dir):
    """MathTipsScheduler, scripted: the first sample is cut before '</think>' (its tokens that stay are the model's),
    the tip follows inside the same assistant message (mask 0), sampling continues there; the rewards read the
    continued message (swift's MathAccuracy: right), and the turns count 2 (swift's num_turns). check_finished runs
    swift's MathAccuracy as ms-swift 4.6 ships it (math_verify's default SIGALRM timeouts) on respond's loop thread:
    its alarms are skipped there, where they once failed every episode at turn 1 (issue 77, point 15)."""
    from mt_grpo.adapters import resolve_reward

    env, pool = swift_env(smollm2_tokenizer, f"{PLUGIN}:MathTipsScheduler", model_name_or_path=smollm2_dir)
    question = "What is the value of sqrt(36 sqrt(16))?"
    rows = [{"prompt": [{"role": "user", "content": question}], "solution": SOLUTION}]
    (ep,) = roll(env, rows, Tipped(smollm2_tokenizer, {question: [WRONG, " 6 times 2.</think><answer>12</answer>"]}))
    tip = "But wait... It seems I made a mistake,"
    assert ep.stop_reason == "answer" and [s.role for s in ep.spans] == ["model", "insert", "model"]
    first, inserted, second = ep.spans
    decode = lambda s: smollm2_tokenizer.decode(ep.completion_ids[s.start:s.end])  # noqa: E731
    assert (decode(first), decode(inserted), decode(second)) == ("<think>4 times 9 is 36", tip,
                                                                 " 6 times 2.</think><answer>12</answer>")
    assert ep.model_mask == [1] * first.end + [0] * (inserted.end - first.end) + [1] * (second.end - inserted.end)
    continued = "<think>4 times 9 is 36" + tip + " 6 times 2.</think><answer>12</answer>"
    assert [m["content"] for m in ep.messages] == [continued]
    assert ep.toolset.environment.rollout_infos == {"num_turns": 2}
    completions = [ep.messages]
    assert resolve_reward("accuracy")(prompts=[rows[0]["prompt"]], completions=completions,
                                      solution=[SOLUTION]) == [1.0]
    # one model turn for the credit: the continuation's turn is the turn it continues, answered by no one
    assert ep.tool_turns == 0 and pool.reward_funcs[1][0].__name__ == "MathTipsScheduler_steps"


def test_swift_s_own_plugin_file_imports_and_its_react_tool_scheduler_runs(smollm2_tokenizer, smollm2_dir):
    """examples/train/grpo/plugin/plugin.py, verbatim (it imports swift's engines, templates and gym envs, which the
    copy stands in for): its ToolCallScheduler runs the calculator named in the model's ReAct text and appends the
    result inside the model's message (a continuation keeping the whole sample); its CountdownORM is a reward by its
    `orms` name."""
    from mt_grpo.adapters import resolve_reward

    spec = os.path.join("tests", "fixtures", "swift", "examples_plugin.py") + ":tool_call_scheduler"
    env, pool = swift_env(smollm2_tokenizer, spec, swift_max_turns=5, model_name_or_path=smollm2_dir)
    question = "What is 2 + 3?"
    first = "Thought: add them.\nAction: calculator\nAction Input: 2+3\n"
    final = "\nThought: I now know the final answer\nFinal Answer: \\(\\boxed{5}\\)"
    rows = [{"prompt": [{"role": "user", "content": question}], "solution": "5"}]
    (ep,) = roll(env, rows, Tipped(smollm2_tokenizer, {question: [first, final]}, marker="Result:"))
    assert [s.role for s in ep.spans] == ["model", "insert", "model"] and ep.stop_reason == "no_action"
    decode = lambda s: smollm2_tokenizer.decode(ep.completion_ids[s.start:s.end])  # noqa: E731
    assert (decode(ep.spans[0]), decode(ep.spans[1])) == (first, "Result: 5")
    assert ep.messages[0]["content"] == first + "Result: 5" + final
    assert ep.toolset.environment.rollout_infos == {"tool_results": "Result: 5", "num_turns": 2}
    countdown = resolve_reward("external_countdown")
    assert countdown(prompts=["p"] * 2, completions=[[{"role": "assistant", "content": "<answer>(2+3)*4</answer>"}],
                                                      [{"role": "assistant", "content": "<answer>2+3+4</answer>"}]],
                     target=[20, 20], nums=[[2, 3, 4]] * 2) == [1.0, 0.0]


GRADED = """
import sys
sys.path.insert(0, {fixtures!r})
from plugin import MathTipsMultiTurnScheduler

class GradedTips(MathTipsMultiTurnScheduler):
    # swift's gym convention: each turn's reward appended to rollout_infos['step_rewards'] (as GYMScheduler does)
    rewards = {{}}

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        acc = self.acc_func([response_choice.message.content], [infer_request.data_dict['solution']])[0]
        rewards = self.rewards.setdefault(infer_request.uuid, [])
        rewards.append(acc - 0.5)
        return {{'rollout_infos': {{'step_rewards': list(rewards)}}}}
"""


def test_a_new_round_scheduler_s_turns_and_their_credit_by_hand(smollm2_tokenizer, tmp_path):
    """A group of two on MathTipsMultiTurnScheduler with gym-style step rewards (acc - 0.5 per turn). A answers 13
    (-0.5): the tip comes as a user message, A answers 12 and the scheduler stops (tips once): no reply, and the final
    step keeps its +0.5 (gym's convention). B answers 12 at once: no reply, +0.5 on its only turn. R_T: A [-0.5, 0.5],
    B [0.5]. per_turn, pooled over (-0.5, 0.5, 0.5): mean 1/6, std (unbiased) 0.5774: A_T(A, 0) = -1.1547, A_T(A, 1)
    = A_T(B, 0) = 0.5774; swift's accuracy R_O = 1 for both: A_O = 0."""
    import torch

    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table
    from mt_grpo.adapters import resolve_reward

    plugin = tmp_path / "graded.py"
    plugin.write_text(GRADED.format(fixtures=os.path.join(ROOT, "tests", "fixtures", "swift")))
    env, pool = swift_env(smollm2_tokenizer, f"{plugin}:GradedTips")
    question = "What is the value of sqrt(36 sqrt(16))?"
    rows = [{"prompt": [{"role": "user", "content": question}], "solution": SOLUTION}] * 2
    script = {question: [[WRONG, "<answer>12</answer>"], ["<answer>12</answer>"]]}
    a, b = roll(env, rows, Tipped(smollm2_tokenizer, script))
    assert [m["role"] for m in a.messages] == ["assistant", "user", "assistant"] and len(b.messages) == 1
    assert a.messages[1]["content"].startswith("The answer is not correct")
    assert (a.stop_reason, b.stop_reason, a.tool_turns, b.tool_turns) == ("answer", "answer", 1, 0)
    reply = smollm2_tokenizer.decode(a.completion_ids[a.spans[1].start:a.spans[1].end])
    assert "<|im_start|>user\nThe answer is not correct" in reply and set(a.model_mask[a.spans[1].start:
                                                                                      a.spans[1].end]) == {0}
    environments = [ep.toolset.environment for ep in (a, b)]
    assert environments[0].rollout_infos == {"step_rewards": [-0.5, 0.5], "num_turns": 2}
    _, turn_funcs = pool.reward_funcs
    turns = [a.tool_turns, b.tool_turns]
    per_func = compute_rewards_per_func(turn_funcs, ["p", "p"], [a.messages, b.messages],
                                        {"environments": environments}, turns, 2)  # the trainer's K: 1 + 1
    R_T = turn_reward_table(per_func, torch.ones(1), torch.tensor(turns), [True])
    assert R_T[0].tolist() == [-0.5, 0.5] and R_T[1, 0] == 0.5 and torch.isnan(R_T[1, 1])
    accuracy = resolve_reward("accuracy")
    R_O = compute_rewards_per_func([accuracy], ["p", "p"], [a.messages, b.messages],
                                   {"solution": [SOLUTION] * 2, "environments": environments})[:, 0]
    assert R_O.tolist() == [1.0, 1.0]
    token_turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, R_O, token_turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][token_turns[0] == 0], torch.tensor(-1.1547), atol=1e-4)
    assert torch.allclose(adv.tokens[0][token_turns[0] == 1], torch.tensor(0.5774), atol=1e-4)
    assert torch.allclose(adv.tokens[1][token_turns[1] == 0], torch.tensor(0.5774), atol=1e-4)


REACT = """
    class Calc(MultiTurnScheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            return 'Action:' not in response_choice.message.content or super().check_finished(
                infer_request, response_choice, current_turn)

        def step(self, infer_request, response_choice, current_turn):
            expression = response_choice.message.content.split('Action Input:')[1].strip()
            result = f'Observation: {eval(expression)}\\n'
            infer_request.messages[-1]['content'] += result
            return {'infer_request': infer_request, 'rollout_infos': {'step_rewards': [0.5] * current_turn}}
    """


def test_a_react_episode_in_one_continued_message_gets_its_step_rewards_summed(smollm2_tokenizer, tmp_path):
    """A ReAct scheduler whose whole episode is one message: A calls the calculator twice (each observation inserted
    inside its message, 0.5 each in step_rewards), then answers (no reply): one model turn, which ends the episode,
    R_T 0.5 + 0.5 = 1. B answers at once: no step reward, R_T 0 (a first turn with no tool work, as any). per_turn
    over (1, 0): A_T = +-0.7071 (R_O 0)."""
    import torch

    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table

    env, pool = swift_env(smollm2_tokenizer, f"{write_plugin(tmp_path, REACT)}:Calc")
    question = "What is (2+3)+1?"
    rows = [{"prompt": [{"role": "user", "content": question}]}] * 2
    script = {question: [["Thought: add.\nAction: calculator\nAction Input: 2+3\n",
                          "Action: calculator\nAction Input: 5+1\n", "Final Answer: 6"], ["Final Answer: 6"]]}
    a, b = roll(env, rows, Tipped(smollm2_tokenizer, script, marker="Observation:"))
    assert [s.role for s in a.spans] == ["model", "insert", "model", "insert", "model"] and [s.role for s in
                                                                                              b.spans] == ["model"]
    assert (a.tool_turns, b.tool_turns, a.stop_reason) == (0, 0, "no_action")
    assert a.toolset.environment.rollout_infos["step_rewards"] == [0.5, 0.5]
    environments = [a.toolset.environment, b.toolset.environment]
    assert [pool.turn_rewards(e) for e in environments] == [[[0.5, 0.5]], []]
    per_func = compute_rewards_per_func(pool.reward_funcs[1], ["p"] * 2, [a.messages, b.messages],
                                        {"environments": environments}, [0, 0], 1)
    R_T = turn_reward_table(per_func, torch.ones(1), torch.tensor([0, 0]), [True])
    assert R_T.tolist() == [[1.0], [0.0]]
    token_turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), token_turns, AdvantageSettings.of("per_turn", 2))
    assert torch.allclose(adv.tokens[0][token_turns[0] == 0], torch.tensor(0.7071), atol=1e-4)
    assert torch.allclose(adv.tokens[1][token_turns[1] == 0], torch.tensor(-0.7071), atol=1e-4)


def test_the_swift_plugin_trains_from_the_recipe(tiny_agent_dir, tmp_path):
    """swift's own example, as written (tests/fixtures/swift/plugin.py): two steps of the tiny model with the
    continuation scheduler named by one recipe field, swift's reward names in the reward list."""
    from helpers import final_metrics, rollout_records, run
    from test_environments import env_recipe

    out = str(tmp_path / "out")
    recipe = env_recipe(tmp_path, environment_factory=None, multi_turn_scheduler=f"{PLUGIN}:MathTipsScheduler",
                        dataset_name=os.path.join("tests", "fixtures", "swift", "math.jsonl"), max_steps=2,
                        outcome_reward_funcs=["accuracy", "plugin:MultiTurnFormat"], max_completion_length=160,
                        max_tool_response_tokens=64)  # the tip (33 tokens) whole: it is cut as a tool's output is
    run([sys.executable, "mt_grpo_trainer.py", "--config", recipe, "--model_name_or_path", tiny_agent_dir,
         "--output_dir", out], tmp_path)
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2, steps
    assert {"rewards/outcome/MathAccuracy", "rewards/outcome/MultiTurnFormat",
            "rewards/turn/MathTipsScheduler_steps"} <= set(steps[0]), sorted(steps[0])
    records = rollout_records(out)
    assert {r["environment"] for r in records} == {"MathTipsScheduler"}
    # the tiny agent answers at times: the tip then goes inside its message, and it samples on
    inserts = [t["text"] for r in records for t in r["turns"] if t["role"] == "insert"]
    assert inserts and set(inserts) == {"But wait... It seems I made a mistake,"}, [r["turns"] for r in records]


def test_a_scheduler_adding_images_trains_a_vision_model_two_steps(tmp_path, tmp_path_factory):
    """DeepEyes' form from the recipe fields: a swift dataset file whose rows name their picture by path with an
    `<image>` tag (`dataset_name`), the tiny Qwen2-VL agent (sampled in process) answers, and the scheduler's step
    crops the question's picture into a new round with an `<image>` tag, once. Two steps; the records hold the row's
    picture in the prompt and the crops in the user turns (mask 0), and the step's reward is that turn's R_T."""
    from conftest import shared_folder
    from helpers import final_metrics, rollout_records, run
    from prepare_models import make_tiny_vlm_agent

    model = shared_folder(tmp_path_factory, "tiny-vl-agent-qwen2_vl", lambda out: make_tiny_vlm_agent(out, "qwen2_vl"))
    plugin = write_plugin(tmp_path, """
        class Crop(MultiTurnScheduler):
            def check_finished(self, infer_request, response_choice, current_turn):
                return current_turn > 1

            def step(self, infer_request, response_choice, current_turn):
                crop = infer_request.images[0].crop((0, 0, 28, 28))
                infer_request.messages.append({'role': 'user', 'content': '<image>Look closer.'})
                infer_request.images.append(crop)
                return {'infer_request': infer_request, 'rollout_infos': {'step_rewards': [0.25]}}
        """)
    import json

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_vision import digit

    rows = []
    for i in range(8):
        digit(i).save(tmp_path / f"digit{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>Which number is drawn?"},
                                  {"role": "assistant", "content": str(i)}],
                     "images": [str(tmp_path / f"digit{i}.png")], "solution": str(i)})
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    code = f"""
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

def correct(completions, solution, **kwargs):
    return [1.0 if a in str(c[-1]["content"]) else 0.0 for c, a in zip(completions, solution)]

args = MTGRPOConfig(output_dir={out!r}, dataset_name={str(data)!r}, multi_turn_scheduler={plugin + ":Crop"!r},
                    max_steps=2, num_generations=2, per_device_train_batch_size=4, max_completion_length=160,
                    learning_rate=1e-3, use_cpu=True, bf16=False, logging_steps=1, report_to="none",
                    save_strategy="no", save_rollouts_steps=1, disable_tqdm=True)
MTGRPOEnvTrainer({model!r}, args=args, reward_funcs=correct).train()
"""
    run([sys.executable, "-c", code], tmp_path)
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2 and "rewards/turn/Crop_steps" in steps[0], steps
    records = rollout_records(out)
    assert all([im["size"] for im in r["prompt_images"]] == [[56, 56]] for r in records)
    assert all("<image>" not in r["prompt_text"] for r in records)
    crops = [t["images"] for r in records for t in r["turns"] if t["role"] == "env" and t.get("images")]
    assert crops and all(len(im) == 1 for im in crops), [r["turns"] for r in records]
    for r in records:  # the model turn step answered with a crop scores the step's 0.25; a tool turn has none
        cropped = [t for t in r["turns"] if t["role"] == "env" and t.get("images")]
        assert r["R_T"].count(0.25) == len(cropped) <= 1


def test_on_trajectory_start_may_add_to_the_question_only(tmp_path):
    path = write_plugin(tmp_path, """
        class Hinted(MultiTurnScheduler):
            async def on_trajectory_start(self, requests):
                for request in requests:
                    request.messages[-1]['content'] += ' (hint: ' + request.data_dict['hint'] + ')'

            def step(self, infer_request, response_choice, current_turn):
                return {'infer_request': infer_request}

        class Rewriter(Hinted):
            async def on_trajectory_start(self, requests):
                requests[0].messages = [{'role': 'user', 'content': 'another question'}]
        """)
    from mt_grpo.adapters.swift import adapt

    env = adapt(config(f"{path}:Hinted")).environment_factory()
    assert env.reset(prompt=[{"role": "user", "content": "Add 2 and 3."}], hint="five") == " (hint: five)"
    env = adapt(config(f"{path}:Rewriter")).environment_factory()
    with pytest.raises(ValueError, match="on_trajectory_start rewrote the prompt"):
        env.reset(prompt=[{"role": "user", "content": "Add 2 and 3."}], hint="five")


def test_max_turns_without_a_scheduler_and_a_step_of_the_wrong_type_fail_naming_the_fix(tmp_path):
    from mt_grpo.adapters.swift import adapt

    with pytest.raises(ValueError, match="`swift_max_turns` is set but `multi_turn_scheduler` is not"):
        adapt(config(None, swift_max_turns=3))
    path = write_plugin(tmp_path, """
        class Text(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                return 'try again'
        """)
    with pytest.raises(ValueError, match=r"Text.step returned str: return \{'infer_request': infer_request\}"):
        respond(episode(f"{path}:Text"), QUESTION + [{"role": "assistant", "content": "x"}])


def test_a_dataset_in_swift_s_format_becomes_prompts(tmp_path):
    """swift's `messages` column (its reference answer, the last assistant message, dropped) or `query` + `system`
    becomes the prompt; the other columns stay for the scheduler's data_dict and the rewards."""
    import json

    from mt_grpo.adapters.swift import adapt

    data = adapt(config(f"{PLUGIN}:MathTipsScheduler", dataset_name=os.path.join("tests", "fixtures", "swift",
                                                                                  "math.jsonl"), max_samples=3))
    rows = list(data.train_dataset)
    assert len(rows) == 3 and set(rows[0]) == {"prompt", "solution"}
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"] and "sqrt" in rows[0]["prompt"][1]["content"]
    path = tmp_path / "queries.jsonl"
    path.write_text(json.dumps({"query": "2+2?", "system": "Be brief.", "response": "4", "solution": "4"}) + "\n")
    adapted = adapt(config(f"{PLUGIN}:MathTipsScheduler", dataset_name=str(path), max_samples=None,
                           eval_dataset_name=str(path), eval_strategy="steps", eval_max_samples=None))
    (row,), (held_out,) = adapted.train_dataset, adapted.eval_dataset
    assert row == held_out == {"prompt": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "2+2?"}], "solution": "4"}
    prompts = tmp_path / "prompts.jsonl"  # already the trainer's format: loaded by the trainer as usual
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"}) + "\n")
    assert adapt(config(f"{PLUGIN}:MathTipsScheduler", dataset_name=str(prompts))).train_dataset is None


def test_a_swift_dataset_row_with_image_paths_becomes_prompt_and_images(tmp_path, monkeypatch):
    """swift's multimodal rows (ms-swift 4.6's dataset docs and preprocessor): `images` as local paths (from the
    directory the run starts in, or under $ROOT_IMAGE_DIR), a base64 `data:` URL or `{"bytes", "path"}`, and an
    `<image>` tag per image at the start of the first user message, or none (swift puts untagged images there): the
    tags leave the text and the images become TRL's `images` column of PIL images. A tag elsewhere, more tags than
    images, a URL, a missing file or a `<video>` is refused naming the row and the fix."""
    import base64
    import io
    import json

    from PIL import Image

    from mt_grpo.adapters.swift import swift_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pics").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "pics" / "red.png")
    png = io.BytesIO()
    Image.new("RGB", (20, 10), "blue").save(png, format="PNG")
    blue = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    monkeypatch.setenv("ROOT_IMAGE_DIR", str(tmp_path / "pics"))

    def rows(*rows) -> str:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    def row(text, images, answer="1"):
        return {"messages": [{"role": "system", "content": "Look."}, {"role": "user", "content": text},
                             {"role": "assistant", "content": answer}], "images": images, "solution": answer}

    data = swift_dataset(rows(row("<image>What is red?", ["pics/red.png"]), row("<image><image>Which?", [
        str(tmp_path / "pics" / "red.png"), blue]), row("Untagged?", ["red.png"])))  # the last under ROOT_IMAGE_DIR
    assert [r["prompt"][1]["content"] for r in data] == ["What is red?", "Which?", "Untagged?"]
    assert [[im.size for im in r["images"]] for r in data] == [[(40, 30)], [(40, 30), (20, 10)], [(40, 30)]]
    assert all(r["prompt"][0] == {"role": "system", "content": "Look."} and len(r["prompt"]) == 2 for r in data)
    for text, images, message in (
            ("Which <image>?", ["red.png"], "`<image>` tags inside the text or in another message: here a row's images "
             "go at the start of its first user message"),
            ("<image><image>Which?", ["red.png"], "`<image>` tags for 2 images, and it has 1"),
            ("<image>Which?", ["https://example.com/a.png"], "is a URL; download it and give its local path"),
            ("<image>Which?", ["nope.png"], "'nope.png' is not a file"),
            ("<video>Which?", [], "`<video>`: videos are not supported")):
        with pytest.raises(ValueError, match=f"Row 0 of .*rows.jsonl: .*{message}"):
            swift_dataset(rows(row(text, images)))


# -- a scheduler that hangs or breaks its contract -------------------------------------------------------------------
STUCK = """
    import threading

    class Stuck(MultiTurnScheduler):
        release = threading.Event()  # set by the test: the hung steps return

        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn > 1

        def step(self, infer_request, response_choice, current_turn):
            if 'hang' in response_choice.message.content:
                self.release.wait()
            if 'text' in response_choice.message.content:
                return 'try again'
            infer_request.messages.append({'role': 'user', 'content': 'Once more.'})
            return {'infer_request': infer_request}
    """


def test_a_step_that_never_returns_ends_only_its_own_episode(smollm2_tokenizer, tmp_path):
    """Episode 0's step never returns (until the test lets it): it ends `env_error`; the other three episodes, in this
    rollout and the next, get the scheduler's reply and end on their answers (the hung step held the scheduler's
    lock: every episode ended env_error). Threads: the hung steps' own, given back once they return."""
    import threading
    from helpers import xml_answer
    from test_environments import roll

    env, pool = swift_env(smollm2_tokenizer, f"{write_plugin(tmp_path, STUCK)}:Stuck", tool_timeout=6.0)
    env.tool_timeout = 6.0
    rows = [{"prompt": f"Question {i}."} for i in range(4)]
    script = {f"Question {i}.": [xml_answer("hang" if i == 0 else "one"), xml_answer("two")] for i in range(4)}
    scheduler = pool.factories[None].scheduler
    before = threading.active_count()
    try:
        for _ in range(2):
            episodes = roll(env, rows, script)
            assert [ep.stop_reason for ep in episodes] == ["env_error", "answer", "answer", "answer"]
            assert all([m["content"] for m in ep.messages if m["role"] == "user"] == ["Once more."]
                       for ep in episodes[1:])
            pool.release([ep.toolset for ep in episodes])
    finally:
        scheduler.release.set()
    waited = threading.Event()
    for _ in range(240):  # the hung steps' threads end once released (a generous bound only a leak reaches)
        if threading.active_count() <= before + len(pool.free[None]):
            break
        waited.wait(0.25)
    assert threading.active_count() <= before + len(pool.free[None])  # at most one loop per pooled instance


def test_a_step_of_the_wrong_type_in_a_rollout_stops_the_run_naming_the_class(smollm2_tokenizer, tmp_path):
    """As a `respond` of the wrong type does: a bug in the scheduler, not one episode's failure."""
    from helpers import xml_answer
    from test_environments import roll

    env, pool = swift_env(smollm2_tokenizer, f"{write_plugin(tmp_path, STUCK)}:Stuck")
    rows = [{"prompt": "Question 0."}, {"prompt": "Question 1."}]
    script = {"Question 0.": [xml_answer("one")], "Question 1.": [xml_answer("text")]}
    with pytest.raises(ValueError, match=r"Stuck.step returned str: return \{'infer_request': infer_request\}.*row"):
        roll(env, rows, script)
