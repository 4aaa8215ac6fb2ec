"""adapters/openenv.py: OpenEnv environments (tests/fixtures/openenv/: OpenEnv's echo environment and a
number-guessing game in its style, on the copy of OpenEnv's core types that ships in mt_grpo/compat/openenv) run by
the trainer unchanged, in process and over HTTP: the Action as one tool, the observation as text, `reward` as each
turn's credit (by hand), `done` ending the episode; bad names fail naming the fix; one recipe line trains each."""

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import FIXTURES, ROOT, make_env, rollout_records
from scripted_policy import ScriptedPolicy, ScriptedServer

OE = os.path.join(FIXTURES, "openenv")


@pytest.fixture(scope="module", autouse=True)
def openenv_provided():
    """`openenv`: the copy in mt_grpo/compat, as the adapter provides it (before the module's server fixture)."""
    from mt_grpo.compat import provide

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # provide may add the copy's folder to it
        provide("openenv")
        yield


@pytest.fixture(autouse=True)
def openenv_on_path(monkeypatch):
    monkeypatch.syspath_prepend(OE)


@pytest.fixture(scope="module")
def tokenizer(tiny_agent_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_agent_dir)


def adapted(target: str, action: str | None = None):
    from mt_grpo.adapters.openenv import adapt

    return adapt(SimpleNamespace(openenv_env=target, openenv_action=action))


def episodes(tokenizer, factory, script: dict, rows: list[dict], max_env_steps: int = 5, policy=ScriptedPolicy):
    """The rows' episodes under the scripted `policy` (ScriptedServer: the per-episode scheduler), and the pool."""
    from mt_grpo.rollout.environments import EnvironmentPool
    from mt_grpo.base.protocol import XMLProtocol

    protocol = XMLProtocol()
    pool = EnvironmentPool(factory, [], protocol)
    env = make_env(tokenizer, pool.all_tools(), protocol=protocol, environments=pool, task_prompt=None, examples=None,
                   max_env_steps=max_env_steps, max_completion_length=800, max_tokens_per_turn=64)
    prompts = [env.prompt(row["prompt"]) for row in rows]
    return env.rollout(prompts, policy(tokenizer, script), rows=rows), pool


def act(tool: str, **args) -> str:
    return f'<reasoning>Try.</reasoning>\n<tool>{{"name": "{tool}", "args": {json.dumps(args)}}}</tool>'


def turn_credit(pool, eps) -> list[list[float]]:
    steps = pool.reward_funcs[1][0]
    return steps(completions=[ep.messages for ep in eps], environments=[ep.toolset.environment for ep in eps])


# -- the Action as a tool, the Observation as text ---------------------------------------------------------------
def test_the_action_model_is_one_tool_and_the_observation_its_text():
    import asyncio

    from mt_grpo.adapters.openenv import tool_name

    echo = adapted("echo_env:EchoEnvironment").environment_factory
    schema = echo.echo.json_schema["function"]
    assert (schema["name"], schema["description"]) == ("echo", "Action for the Echo environment - just a message to "
                                                        "echo.")
    assert list(schema["parameters"]["properties"]) == ["message"]  # not the framework's `metadata`
    assert schema["parameters"]["required"] == ["message"]
    assert [tool_name(n) for n in ("GuessAction", "MoveTileAction", "Action", "Play")] == \
        ["guess", "move_tile", "step", "play"]
    episode = echo()
    assert asyncio.run(episode.reset(prompt=[{"role": "user", "content": ""}])) == \
        "echoed_message: Echo environment ready!\nmessage_length: 0"
    assert asyncio.run(episode.echo(message="Hello")) == "echoed_message: Hello\nmessage_length: 5"
    assert episode.step_rewards == [0.5] and not episode.done
    with pytest.raises(ValueError, match=r"message: Input should be a valid string"):
        asyncio.run(episode.echo(message=3))


def test_an_observation_that_carries_a_screenshot_is_an_image_before_its_text():
    """BrowserGym's form: the screenshot an (H, W, 3) list of pixels beside a caption. A step's observation is the
    screenshot as an image block (engine/vision.py), then the caption, with its reward; a PIL image or a data URL is
    an image too, a list of numbers that is no picture stays text."""
    import asyncio
    import base64
    import io

    from PIL import Image

    from mt_grpo.adapters.openenv import first_observation, observation_content

    episode = adapted("screen_env:ScreenEnvironment").environment_factory()
    asyncio.run(episode.reset(prompt=[{"role": "user", "content": "Paint."}]))
    image, caption = asyncio.run(episode.paint(shade=200))
    assert image["type"] == "image" and image["image"].size == (4, 2) and image["image"].getpixel((3, 1)) == (200,) * 3
    assert caption == {"type": "text", "text": "Painted 200."}
    assert episode.step_rewards == [1.0] and episode.done
    picture = Image.new("RGB", (3, 5), (1, 2, 3))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    for value in (picture, url):
        (block,) = observation_content({"frame": value, "done": False, "reward": 0.0})
        assert block["image"].size == (3, 5) and block["image"].convert("RGB").getpixel((0, 0)) == (1, 2, 3)
    assert observation_content({"board": [[1, 2], [3, 4]], "score": 7}) == "board: [[1, 2], [3, 4]]\nscore: 7"
    assert observation_content({"grid": [[[300, 0, 0]]]}) == "[[[300, 0, 0]]]"  # out of 0-255: not pixels
    gap, screen, caption = first_observation([{"role": "user", "content": "Paint."}],
                                             {"screenshot": [[[0, 0, 0]]], "caption": "Dark.", "done": False})
    assert gap == {"type": "text", "text": "\n\n"} and screen["image"].size == (1, 1)
    assert caption == {"type": "text", "text": "Dark."}  # a reset's screenshot joins the prompt (environments.py)


# -- a game: step rewards as turn credit, done ends it ------------------------------------------------------------
def test_number_guess_rewards_each_turn_and_done_ends_the_episode(tokenizer):
    """Seed 1: the secret is 3. A guesses 5 (-0.1, "Lower."), then 3 (+1, done: the episode ends, its next scripted
    turn is never sampled). B guesses 1, 2, 4, 5: -0.1 each, and the fourth try is the last (done). per_turn pools
    the group's six turns: mean (1 - 0.5) / 6, the unbiased std of the six; A_T by hand."""
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages

    factory = adapted("number_guess:NumberGuessEnvironment").environment_factory
    rows = [{"prompt": "Guess the number.", "seed": 1}] * 2
    script = {"Guess the number.": [[act("guess", guess=5), act("guess", guess=3), act("guess", guess=3)],
                                    [act("guess", guess=g) for g in (1, 2, 4, 5, 6)]]}
    (a, b), pool = episodes(tokenizer, factory, script, rows, max_env_steps=6)
    assert "I picked a number from 1 to 10. Guess it." in a.prompt_messages[-1]["content"]
    assert [m["content"].splitlines()[0] for m in a.messages if m["role"] == "tool"] == ["feedback: Lower.",
                                                                                          "feedback: Correct!"]
    assert a.stop_reason == b.stop_reason == "env_done"
    assert [m["role"] for m in b.messages].count("tool") == 4  # the fifth scripted guess is never asked for
    credit = turn_credit(pool, [a, b])
    assert credit == [[pytest.approx(-0.1), 1.0], [pytest.approx(-0.1)] * 4]
    R_T = torch.tensor([credit[0] + [float("nan")] * 2, credit[1]])
    turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    values = torch.tensor([-0.1, 1.0, -0.1, -0.1, -0.1, -0.1])
    mean, std = values.mean(), values.std()
    assert torch.allclose(adv.tokens[0][turns[0] == 1], (1.0 - mean) / std, atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], (-0.1 - mean) / std, atol=1e-4)


# -- over HTTP ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def http_server(env_name: str = "NumberGuessEnvironment"):
    """A game of number_guess behind the minimal OpenEnv HTTP server (tests/fixtures/openenv/serve.py), on a free
    local port, in a thread of this process: its URL; stopped at the end."""
    import uvicorn

    sys.path.insert(0, OE)
    import number_guess
    from serve import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(getattr(number_guess, env_name), number_guess.GuessAction, number_guess.GuessObservation)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def guess_server():
    with http_server() as url:
        yield url


def test_an_http_server_plays_the_same_game(tokenizer, guess_server):
    factory = adapted(guess_server).environment_factory
    assert factory.guess.json_schema["function"]["parameters"]["required"] == ["guess"]  # from GET /schema
    rows = [{"prompt": "Guess the number.", "seed": 1}] * 2
    script = {"Guess the number.": [[act("guess", guess=5), act("guess", guess=3)],
                                    [act("guess", guess=3), act("guess", guess=9)]]}
    (a, b), pool = episodes(tokenizer, factory, script, rows)
    assert turn_credit(pool, [a, b]) == [[pytest.approx(-0.1), 1.0], [1.0]]  # concurrent episodes, each its own game
    assert a.stop_reason == b.stop_reason == "env_done"
    bad = act("guess", guess="three")
    (c,), _ = episodes(tokenizer, factory, {"Guess the number.": [bad, act("guess", guess=3)]}, rows[:1])
    assert "the server refused the action" in [m["content"] for m in c.messages if m["role"] == "tool"][0]


def test_websocket_sessions_play_the_game_as_openenvs_client_does(tokenizer):
    """`ws://`: OpenEnv's EnvClient contract, a session (one environment on the server) per episode instance."""
    from number_guess import GuessAction, NumberGuessEnvironment
    from session_server import SessionServer

    server = SessionServer(NumberGuessEnvironment, GuessAction)
    port = server.start()
    try:
        factory = adapted(f"ws://127.0.0.1:{port}").environment_factory
        rows = [{"prompt": "Guess the number.", "seed": 1}] * 2
        script = {"Guess the number.": [[act("guess", guess=5), act("guess", guess=3)],
                                        [act("guess", guess="three"), act("guess", guess=3)]]}
        (a, b), pool = episodes(tokenizer, factory, script, rows)
        assert "I picked a number from 1 to 10." in a.prompt_messages[-1]["content"]
        assert turn_credit(pool, [a, b]) == [[pytest.approx(-0.1), 1.0], [None, 1.0]]  # a refused call: no score
        assert "VALIDATION_ERROR" in [m["content"] for m in b.messages if m["role"] == "tool"][0]
        assert a.stop_reason == b.stop_reason == "env_done"
    finally:
        server.stop()


# -- a group plays one game --------------------------------------------------------------------------------------
@contextlib.contextmanager
def seeded_game(where: str):
    """`openenv_env` of number_guess's SeededNumberGuessEnvironment (its prompt names the game it plays): the class
    in process, or its server over HTTP or over WebSocket sessions, stopped at the end."""
    from number_guess import GuessAction, SeededNumberGuessEnvironment
    from session_server import SessionServer

    if where == "class":
        yield "number_guess:SeededNumberGuessEnvironment"
    elif where == "http":
        with http_server("SeededNumberGuessEnvironment") as url:
            yield url
    else:
        server = SessionServer(SeededNumberGuessEnvironment, GuessAction)
        port = server.start()
        try:
            yield f"ws://127.0.0.1:{port}"
        finally:
            server.stop()


def placeholder_rows(seed: int, groups: int, G: int) -> list[dict]:
    """A generation batch of a run without a dataset: the placeholder rows (builders.placeholder_task), each with the
    seed builders.seed_rows draws for it with the run's `seed`, each repeated for its G episodes (TRL's layout)."""
    from mt_grpo.run.builders import placeholder_task, seed_rows

    task = placeholder_task(SimpleNamespace(generation_batch_size=groups * G, num_generations=G))
    return [row for row in seed_rows(task.dataset, seed, "train") for _ in range(G)]


@pytest.mark.parametrize("scheduler", ["rounds", "per_episode"])
@pytest.mark.parametrize("where", ["class", "http", "ws"])
def test_without_a_dataset_a_group_plays_one_game(tokenizer, where, scheduler):
    """No dataset, the run's seed 5: the two groups' rows get two seeds, whose games hide 2 and 10. A group's G = 2
    episodes read one game in their prompts (reset got its row's seed), the groups two. Variant A guesses 1, 2, 3, 4
    and B 10, 9, 8, 7: in game 2 A wins at its second guess and B misses four times, in game 10 the other way round,
    which only one secret per group gives. per_turn pools a group's own turns: A_T by hand from that game's alone."""
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages

    rows = placeholder_rows(5, groups=2, G=2)
    script = {"Guess it.": [[act("guess", guess=g) for g in (1, 2, 3, 4)],
                            [act("guess", guess=g) for g in (10, 9, 8, 7)]]}
    with seeded_game(where) as target:
        eps, pool = episodes(tokenizer, adapted(target).environment_factory, script, rows,
                             policy=ScriptedPolicy if scheduler == "rounds" else ScriptedServer)
    games = [int(re.search(r"Game (\d+)\.", ep.prompt_messages[-1]["content"]).group(1)) for ep in eps]
    assert games == [row["seed"] for row in rows] and games[0] == games[1] != games[2] == games[3]
    if where == "class":
        assert [ep.toolset.environment.env._secret for ep in eps] == [2, 2, 10, 10]
    miss = pytest.approx(-0.1)
    credit = turn_credit(pool, eps)
    assert credit == [[miss, 1.0], [miss] * 4, [miss] * 4, [1.0]]
    R_T = torch.tensor([c + [float("nan")] * (4 - len(c)) for c in credit])
    turns = pad_episodes(eps, 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(4), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    game_2, game_10 = torch.tensor([-0.1, 1.0] + [-0.1] * 4), torch.tensor([-0.1] * 4 + [1.0])  # each group's turns
    for group, values in ((slice(0, 2), game_2), (slice(2, 4), game_10)):
        expected = ((R_T[group] - values.mean()) / values.std()).nan_to_num(0.0)
        assert torch.allclose(adv.turn[group], expected, atol=1e-4)
    assert torch.allclose(adv.tokens[0][turns[0] == 1], (1.0 - game_2.mean()) / game_2.std(), atol=1e-4)


def test_a_rows_own_seed_is_kept_and_the_drawn_ones_follow_the_runs_seed():
    """seed_rows: a row's own seed stays; one without gets a seed drawn with the run's (the same again on a re-run or
    a resume, another with another seed, and the eval rows apart). No dataset: one row a group of the run
    (run_groups: 10 steps x 4 micro-steps, a generation every 2, 32 / 8 groups each)."""
    import datasets

    from mt_grpo.run.builders import run_groups, seed_rows

    rows = datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "seed": [5, None, 7]})
    seeds = list(seed_rows(rows, 0, "train")["seed"])
    assert seeds[0] == 5 and seeds[2] == 7 and seeds[1] not in (None, 5, 7)
    assert list(seed_rows(rows, 0, "train")["seed"]) == seeds
    assert list(seed_rows(rows, 1, "train")["seed"])[1] != seeds[1] != list(seed_rows(rows, 0, "eval")["seed"])[1]
    args = SimpleNamespace(max_steps=10, gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=1,
                           generation_batch_size=32, num_generations=8)
    assert run_groups(args) == 20 * 4
    args.max_steps = -1  # TRL's default: a run of epochs, which replays the placeholder rows (no count to repeat to)
    assert run_groups(args) is None


def test_mistakes_fail_naming_the_fix():
    with pytest.raises(ValueError, match=r"no OpenEnv server answers there.*Start it"):
        adapted("http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"not an OpenEnv Environment class"):
        adapted("number_guess:GuessAction")
    import types

    module = types.ModuleType("two_actions")
    exec("from typing import Union\nfrom echo_env import EchoAction\nfrom number_guess import GuessAction\n"
         "class TwoActions:\n    def reset(self):\n        pass\n"
         "    def step(self, action: Union[EchoAction, GuessAction]):\n        pass\n", module.__dict__)
    sys.modules["two_actions"] = module
    with pytest.raises(ValueError, match=r"names no single Action class: set `openenv_action"):
        adapted("two_actions:TwoActions")
    assert adapted("two_actions:TwoActions", "number_guess:GuessAction").environment_factory.guess
    from mt_grpo.adapters import adapt

    with pytest.raises(ValueError, match=r"`openenv_action` is set but `openenv_env` is not"):
        adapt(SimpleNamespace(openenv_env=None, openenv_action="number_guess:GuessAction"))


# -- one recipe line trains it ------------------------------------------------------------------------------------
def oe_recipe(tmp_path, **fields) -> str:
    import yaml

    with open(os.path.join(ROOT, "tests", "recipes", "tiny.yaml")) as f:
        recipe = {k: v for k, v in yaml.safe_load(f).items()
                  if k not in ("dataset_name", "max_samples", "tools", "turn_reward_funcs", "outcome_reward_funcs",
                               "advantage_mode", "turn_advantage_coef")}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, "save_rollouts_steps": 1, "per_device_train_batch_size": 4,
                                    "max_completion_length": 96, "max_tokens_per_turn": 24,
                                    "max_env_steps": 3, **fields}))
    return str(path)


@pytest.mark.parametrize("target", ["echo_env:EchoEnvironment", "number_guess:NumberGuessEnvironment"])
def test_one_recipe_line_trains_two_steps(target, tiny_agent_dir, tmp_path):
    from mt_grpo_trainer import build_trainer

    fields = {"openenv_env": target}
    if target.startswith("number_guess"):  # a dataset of seeds, so that a group plays one game
        data = tmp_path / "seeds.jsonl"
        data.write_text("".join(json.dumps({"prompt": "Guess the number.", "seed": s}) + "\n" for s in (1, 2)))
        fields["dataset_name"] = str(data)
    else:
        fields["max_steps"] = 2  # no dataset: reset gives the prompt, as in TRL
    out = str(tmp_path / "out")
    trainer = build_trainer(["--config", oe_recipe(tmp_path, **fields), "--model_name_or_path", tiny_agent_dir,
                             "--output_dir", out])
    trainer.train()  # in this process, as the command line builds it
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    name = target.split(":")[1]
    assert f"rewards/turn/{name}_steps" in steps[0], sorted(steps[0])
    record = rollout_records(out)[0]
    tool = "echo(message: str)" if name == "EchoEnvironment" else "guess(guess: int)"
    assert tool in record["prompt_text"]


def test_without_a_dataset_each_group_of_a_run_plays_its_own_game(tiny_agent_dir, tmp_path):
    """One recipe line and no dataset, 2 steps of 2 groups of G = 2: the trainer's rows are one per group the run
    plays, each its own seed; in the recorded rollouts each group read one game in its prompt, and the 4 groups 4."""
    from mt_grpo_trainer import build_trainer

    out = str(tmp_path / "out")
    recipe = oe_recipe(tmp_path, openenv_env="number_guess:SeededNumberGuessEnvironment", max_steps=2,
                       num_generations=2, per_device_train_batch_size=4)
    trainer = build_trainer(["--config", recipe, "--model_name_or_path", tiny_agent_dir, "--output_dir", out])
    seeds = list(trainer.train_dataset["seed"])
    assert len(set(seeds)) == len(seeds) == 4
    trainer.train()
    games = {}
    for step in (1, 2):
        for record in rollout_records(out, f"step-{step:06d}.jsonl"):
            game = int(re.search(r"Game (\d+)\.", record["prompt_text"]).group(1))
            games.setdefault((step, record["group"]), set()).add(game)
    assert sorted(games) == [(1, 0), (1, 1), (2, 0), (2, 1)] and all(len(g) == 1 for g in games.values())
    assert sorted(g.pop() for g in games.values()) == sorted(seeds)


# -- a server that fails ------------------------------------------------------------------------------------------
@pytest.fixture
def faulty_server(monkeypatch):
    """A server with the guessing game's /schema whose POST /reset answers, in turn, what `faults` lists (a status
    and a body), then {"observation": {"text": "Ready."}}; the retries' sleeps cut to nothing."""
    import http.server
    import json as json_module

    from mt_grpo.base import completions

    monkeypatch.setattr(completions, "backoff", lambda attempt: 0.0)
    faults, resets = [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, status: int, body: str):
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            schema = {"title": "GuessAction", "type": "object", "properties": {"guess": {"type": "integer"}},
                      "required": ["guess"]}
            self.answer(200, json_module.dumps({"action": schema}))

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            resets.append(self.path)
            self.answer(*(faults.pop(0) if faults else (200, json_module.dumps({"observation": {"text": "Ready."}}))))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", faults, resets
    server.shutdown()
    server.server_close()


def test_a_reset_that_fails_is_retried_then_fails_naming_the_server(faulty_server):
    """A 500, a body that is not JSON and a JSON list: retried (as the vLLM client retries), the fourth answer
    plays. Four faults in a row: the run stops naming the server, not the class or the row."""
    from mt_grpo.base.protocol import XMLProtocol
    from mt_grpo.rollout.environments import EnvironmentPool

    url, faults, resets = faulty_server
    pool = EnvironmentPool(adapted(url).environment_factory, [], XMLProtocol())
    start = lambda: pool.start([{"prompt": "Guess.", "row": 2}], [[{"role": "user", "content": "Guess."}]],  # noqa
                               reset_timeout=120.0)
    faults[:] = [(500, "Internal Server Error"), (200, "<html>gateway</html>"), (200, "[1, 2]")]
    (prompt,), _ = start()
    assert prompt[-1]["content"] == "Guess.\n\nReady." and resets == ["/reset"] * 4
    faults[:] = [(500, "Internal Server Error")] * 4
    with pytest.raises(RuntimeError, match=rf"reset failed for row 2.*OpenEnv server at {url} failed /reset 4 times "
                                           r"\(status 500") as failed:
        start()
    assert "fix the class" not in str(failed.value).lower()
