"""The rollout viewer (scripts/view_rollouts.py) and the run plots (scripts/plot_runs.py), run as a
user runs them on a fixture run folder (tests/rollout_records.py), and the records a run writes against the
guide's description of them. The page's structure is always
checked; the page itself is loaded in headless Chromium over the DevTools protocol. scripts/test.sh installs
chromium where it can (root with apt); elsewhere that test skips, and on CI (CI=true) it fails instead."""

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser

import pytest

from helpers import ROOT, fake_search, make_env
from plot_runs import plot_runs
from rollout_records import step_records, write_run
from view_rollouts import build_page, compact

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """Every element as (tag, attributes), and the text of each JSON data block by id."""

    def __init__(self, text: str):
        super().__init__()
        self.elements, self.blocks, self._block = [], {}, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "script" and attrs.get("type") == "application/json":
            self._block = attrs["id"]
            self.blocks[self._block] = ""

    def handle_data(self, data):
        if self._block:
            self.blocks[self._block] += data

    def handle_endtag(self, tag):
        if tag == "script":
            self._block = None

    def skeleton(self) -> list:
        """The elements that are not data blocks: what the page is built of before its JS runs."""
        return [e for e in self.elements if e[1].get("type") != "application/json"]


def view(run_dir, *flags) -> str:
    """Run the viewer's command line; returns the page."""
    out = os.path.join(run_dir, "page.html")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "view_rollouts.py"), run_dir, "--out", out, *flags],
                   check=True, capture_output=True)
    with open(out, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, {file name: records}): train steps 1-3, eval step 2."""
    run_dir = str(tmp_path_factory.mktemp("run"))
    return run_dir, write_run(run_dir, seed=0)


# ------------------------------------------------------------------------------------------------
# The page's structure (always)
# ------------------------------------------------------------------------------------------------
def test_page_is_self_contained_and_holds_every_step_exactly(run, tmp_path):
    run_dir, files = run
    text = view(run_dir, "--digits", "0")
    page = Page(text)
    urls = [value for _, attrs in page.elements for name, value in attrs.items() if name in ("src", "href")]
    assert not [u for u in urls if u and u.lower().startswith(("http:", "https:", "//"))], urls
    assert set(page.blocks) == {"index", "data-train-000001", "data-train-000002", "data-train-000003",
                                "data-eval-000002"}
    for name, records in files.items():
        key = ("eval-" if name.startswith("eval") else "train-") + name[-12:-6]
        assert json.loads(page.blocks["data-" + key]) == records, key
    index = json.loads(page.blocks["index"])
    assert [s["key"] for s in index["steps"]] == ["train-000001", "train-000002", "train-000003", "eval-000002"]
    assert {"R_O", "R_T", "turn/tool_execution_reward_func", "outcome/exact_match_reward_func"} <= set(index["rewards"])
    # Model text (`</script><b>x</b>`, `<result>`, `&`) made no element: the page is built of the same
    # elements as the page of a run with no rollouts at all.
    assert "</script><b>x</b>" not in text
    empty = tmp_path / "empty"
    (empty / "rollouts").mkdir(parents=True)
    assert page.skeleton() == Page(view(str(empty))).skeleton()


def test_embedded_floats_keep_four_significant_digits_and_non_finite_values():
    assert compact({"a": [0.123456789, -1234.5678, 3e-7], "b": [1, "x", None, True]}, digits=4) == \
        {"a": [0.1235, -1235.0, 3e-7], "b": [1, "x", None, True]}
    assert compact([float("-inf"), float("inf"), float("nan")], digits=4) == ["-Infinity", "Infinity", "NaN"]
    assert compact([0.123456789], digits=0) == [0.123456789]


def test_steps_and_episode_limit(run):
    run_dir, _ = run
    page = Page(view(run_dir, "--steps", "2-2", "--max-episodes-per-step", "3"))
    assert set(page.blocks) == {"index", "data-train-000002", "data-eval-000002"}
    assert [(e["group"], e["sample"]) for e in json.loads(page.blocks["data-train-000002"])] == [(0, 0), (0, 1), (0, 2)]


def test_the_page_of_an_evaluation_alone(tmp_path):
    """scripts/evaluate.py's output folder: its eval_episodes.jsonl is the page's one step, at its records' step."""
    records = step_records(30, "eval", seed=0)
    (tmp_path / "eval_episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = Page(view(str(tmp_path), "--digits", "0"))
    assert set(page.blocks) == {"index", "data-eval-000030"}
    assert json.loads(page.blocks["data-eval-000030"]) == records


def test_default_page_is_smaller_and_matches_to_four_digits(run):
    run_dir, files = run
    page = build_page(run_dir)
    assert len(page) < len(build_page(run_dir, digits=0))
    embedded = json.loads(Page(page).blocks["data-train-000001"])
    sampler = [lp for r in files["step-000001.jsonl"] for lp in r["tokens"]["sampler_logprob"]]
    assert [lp for r in embedded for lp in r["tokens"]["sampler_logprob"]] == pytest.approx(sampler, rel=1e-3)


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------
def test_plot_two_runs_overlaid(tmp_path):
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, run_dir in enumerate(runs):
        write_run(run_dir, seed=seed)
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_runs.py"), *runs, "--labels", "mt-grpo",
                    "outcome-only", "--out", str(tmp_path / "plots")], check=True, capture_output=True)
    with open(tmp_path / "plots" / "run_plots.png", "rb") as f:
        png = f.read()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 50_000


def test_plot_skips_missing_metrics(tmp_path):
    history = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4, "unknown/metric": 1.0}, {"train_runtime": 3.0}]
    assert plot_runs([("only loss", [{"step": 1, "unknown/metric": 1.0}])], "/nonexistent/x.png") is None
    path = plot_runs([("only loss", history)], str(tmp_path / "loss_only.png"))
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE


# ------------------------------------------------------------------------------------------------
# The page in a real browser (headless Chromium, DevTools protocol over a local websocket)
# ------------------------------------------------------------------------------------------------
class DevTools:
    """A minimal Chrome DevTools Protocol client: commands wait for their answer, events are kept."""

    def __init__(self, websocket_url: str):
        import websocket

        self.ws = websocket.create_connection(websocket_url, timeout=30, suppress_origin=True)
        self.events, self.last_id = [], 0

    def send(self, method: str, **params) -> dict:
        self.last_id += 1
        self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.last_id:
                assert "error" not in message, message
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str):
        while not any(e.get("method") == method for e in self.events):
            self.events.append(json.loads(self.ws.recv()))

    def js(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def errors(self) -> list:
        return [e for e in self.events if e.get("method") == "Runtime.exceptionThrown"
                or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
                or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, ["chromium", "chromium-browser", "google-chrome", "chrome"])), None)


@pytest.fixture
def browser(tmp_path):
    binary = find_chromium()
    if binary is None:
        if os.environ.get("CI") == "true":  # scripts/test.sh installs it where it can: on CI a skip would hide that
            pytest.fail("no chromium binary on PATH on CI: scripts/test.sh should have installed it (apt-get install chromium)")
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; scripts/test.sh installs it as root)")
    pytest.importorskip("websocket", reason="websocket-client is not installed (see requirements.txt)")
    profile = tmp_path / "profile"
    proc = subprocess.Popen([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Port 0: Chromium picks a free port and writes it to DevToolsActivePort in the profile.
        port_file, deadline = profile / "DevToolsActivePort", time.time() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert time.time() < deadline and proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        targets = json.load(no_proxy.open(f"http://127.0.0.1:{port}/json/list", timeout=10))
        client = DevTools(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
        yield client
        client.send("Browser.close")  # lets Chromium end its own child processes
        proc.wait(10)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_page_in_chromium(run, browser, tmp_path):
    run_dir, files = run
    view(run_dir)
    browser.send("Emulation.setDeviceMetricsOverride", width=1280, height=860, deviceScaleFactor=1, mobile=False)
    for domain in ("Runtime", "Log", "Page"):
        browser.send(f"{domain}.enable")
    browser.send("Page.navigate", url="file://" + os.path.join(run_dir, "page.html"))
    browser.wait_for("Page.loadEventFired")
    assert browser.errors() == []

    # The latest train step is shown, every token of it is a span, env tokens are styled apart.
    assert browser.js("document.getElementById('step').value") == "train-000003"
    records = files["step-000003.jsonl"]
    masks = [m for r in records for m in r["tokens"]["model_mask"]]
    assert browser.js("document.querySelectorAll('#groups .t').length") == len(masks)
    assert browser.js("document.querySelectorAll('#groups .t.e').length") == masks.count(0)
    style = browser.js("""['.t.m', '.t.e'].map((s) => {
        const c = getComputedStyle(document.querySelector('#groups ' + s)); return [c.fontStyle, c.color]; })""")
    assert style[0][0] == "normal" and style[1][0] == "italic" and style[0][1] != style[1][1], style
    assert browser.js("document.querySelectorAll('#groups b, #groups script').length") == 0  # model text made no tag
    assert browser.js("[...document.querySelectorAll('.t')].some((t) => t.textContent === '</script><b>x</b>')")
    # a call failed as its record says; a record without `ok` by either protocol's failure text
    assert browser.js("""[{ok: false, output: "fine"}, {ok: true, output: "Error: a tool's own text"},
        {output: "Error: tool 'x' raised"}, {output: "{'error': 'Tool x not found.'}"}, {output: "fine"}]
        .map(isError)""") == [True, False, True, True, False]

    # Hovering a token shows its id, its text with visible whitespace, and its logprobs.
    tokens = records[0]["tokens"]
    i = next(k for k, t in enumerate(tokens["text"]) if t.startswith(" ") and tokens["model_mask"][k])
    x, y = browser.js(f"""(() => {{ const r = document.querySelector('.t[data-e="0"][data-i="{i}"]')
        .getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
    browser.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    display, tip = browser.js("[getComputedStyle($('tip')).display, $('tip').textContent]")
    assert display == "block"
    assert f"id {tokens['ids'][i]}" in tip and "␣" + tokens["text"][i][1:] in tip and "trainer logprob" in tip, tip
    shot = browser.send("Page.captureScreenshot", format="png")["data"]
    (tmp_path / "viewer.png").write_bytes(base64.b64decode(shot))
    assert (tmp_path / "viewer.png").read_bytes().startswith(PNG_SIGNATURE)

    # Filters: a stop reason, a reward range, then the eval step.
    def shown_after(js_change):
        browser.js(js_change + "; render()")
        return browser.js("document.querySelectorAll('.episode').length")

    assert shown_after("$('stop').value = 'max_env_steps'") == sum(r["stop_reason"] == "max_env_steps" for r in records)
    at_least_one = sum(r["R_O"] >= 1 for r in records)
    assert shown_after("$('stop').value = ''; $('reward').value = 'R_O'; $('min').value = '1'") == at_least_one
    eval_records = files["eval-step-000002.jsonl"]
    assert shown_after("$('min').value = ''; $('step').value = 'eval-000002'") == len(eval_records)
    eval_tokens = sum(len(r["tokens"]["ids"]) for r in eval_records)
    assert browser.js("document.querySelectorAll('#groups .t').length") == eval_tokens

    # A step with more than EAGER_TOKENS tokens is drawn as its cards come near the screen.
    count = "document.querySelectorAll('#groups .t').length"
    assert browser.js(f"EAGER_TOKENS = 0; render(); {count}") == 0
    deadline = time.time() + 10
    while browser.js(count) < eval_tokens and time.time() < deadline:
        time.sleep(0.05)
    assert browser.js(count) == eval_tokens

    # `#:E.I` pins the tooltip of a token of the default step (the docs screenshot uses it).
    browser.js("history.replaceState(null, '', '#:0.4')")
    browser.events.clear()
    browser.send("Page.reload")
    browser.wait_for("Page.loadEventFired")
    assert f"id {records[0]['tokens']['ids'][4]}" in browser.js("$('tip').textContent")
    assert browser.errors() == []


def turn_labels(browser, run_dir) -> list[str]:
    """The page of `run_dir` opened in the browser: the text of every turn label."""
    view(run_dir)
    browser.send("Runtime.enable")
    browser.send("Page.enable")
    browser.send("Page.navigate", url="file://" + os.path.join(run_dir, "page.html"))
    browser.wait_for("Page.loadEventFired")
    return browser.js("[...document.querySelectorAll('.turn-label')].map((l) => l.textContent)")


def test_an_environments_step_rewards_label_its_turns(browser, tmp_path):
    """A run with an environment_factory records each env turn's step_rewards (environments.py): the page labels
    the turn with them, and a turn whose calls reported none says so."""
    run_dir = str(tmp_path / "run")
    files = write_run(run_dir, seed=0, train_steps=(1,), eval_steps=())
    records = files["step-000001.jsonl"]
    env_turns = [t for t in records[0]["turns"] if t["role"] == "env"]
    env_turns[0]["step_rewards"] = [0.5, -0.1]
    for extra in env_turns[1:]:
        extra["step_rewards"] = []
    records[0]["environment"] = "Lock"
    with open(os.path.join(run_dir, "rollouts", "step-000001.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    labels = turn_labels(browser, run_dir)
    assert "environment · step reward 0.5 + -0.1" in labels, labels
    assert browser.errors() == []


def test_the_samples_of_a_split_episode_are_labelled(browser, tmp_path, smollm2_tokenizer):
    """An episode split into per-turn samples (turn_samples: per_model_turn) is recorded with the env turns that start a
    sample numbered, and the page labels them."""
    from mt_grpo.run.reporting import episode_records
    from scripted_policy import ScriptedPolicy

    question = "What is the capital of Veltria?"
    call = '<reasoning>Look it up.</reasoning>\n<tool>{"name": "search", "args": {"query": "Veltria"}}</tool>'
    script = {question: [call, call, "<reasoning>Found it.</reasoning>\n<answer>Morvane</answer>"]}
    env = make_env(smollm2_tokenizer, [fake_search(lambda query: "Veltria: its capital is Morvane.")],
                   turn_samples="per_model_turn")
    episodes = env.rollout([env.prompt(question)], ScriptedPolicy(smollm2_tokenizer, script))
    records = episode_records(smollm2_tokenizer, episodes, [{"question": question, "answer": ["Morvane"]}], step=1,
                              mode="train", first_index=0, group_size=1, rewards={}, token_values={})
    assert [t.get("sample") for t in records[0]["turns"] if t["role"] == "env"] == [2, 3]
    run_dir = str(tmp_path / "run")
    write_run(run_dir, seed=0, train_steps=(1,), eval_steps=())
    with open(os.path.join(run_dir, "rollouts", "step-000001.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    labels = turn_labels(browser, run_dir)
    assert "environment · sample 3: its prompt, the template's render of the history" in labels, labels
    assert browser.errors() == []


class HotCold:
    """A guessing game that replies as the user (user_turns.py): a wrong guess gets "Lower." or "Higher." with score
    0.5 when within 2 of the number, else 0.2; the right one "Correct!" with score 1, and ends the episode. Its tool,
    `hint`, appends a step reward of 0.1."""

    def reset(self, secret: str, **kwargs) -> None:
        self.secret, self.step_rewards = int(secret), []

    def hint(self, low: int) -> str:
        """Whether the number is above a bound.

        Args:
            low: The bound.
        """
        self.step_rewards.append(0.1)
        return "yes" if self.secret > low else "no"

    def respond(self, messages):
        guess = int(re.findall(r"<answer>(.*?)</answer>", messages[-1]["content"])[-1])
        if guess == self.secret:
            return {"content": "Correct!", "done": True, "score": 1.0}
        return {"content": "Lower." if guess > self.secret else "Higher.",
                "score": 0.5 if abs(guess - self.secret) <= 2 else 0.2}


def hot_cold_run(run_dir: str, tokenizer, mode: str) -> list[dict]:
    """A recorded step of one group of two games, scored and credited as the trainer does in `mode`: A asks the hint
    (step reward 0.1), guesses 5 ("Lower.", 0.5), then 4 ("Correct!", 1); B guesses 9 ("Lower.", 0.2), then 4 (1).
    R_O: 1 and 0. Writes RUN_DIR/rollouts/step-000001.jsonl; returns its records."""
    import torch

    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo.run.reporting import episode_records
    from mt_grpo_trainer import ADVANTAGE_MODES, AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, \
        turn_reward_table
    from scripted_policy import ScriptedPolicy
    from test_environments import answer, lock_env

    env, pool = lock_env(tokenizer, factory=HotCold, max_user_turns=3)
    hint = '<reasoning>Ask.</reasoning>\n<tool>{"name": "hint", "args": {"low": 3}}</tool>'
    rows = [{"prompt": "Guess my number.", "secret": "4", "question": "Guess my number."}] * 2
    script = {"Guess my number.": [[hint, answer("5"), answer("4")], [answer("9"), answer("4")]]}
    episodes = env.rollout([env.prompt(row["prompt"]) for row in rows], ScriptedPolicy(tokenizer, script), rows=rows)
    turns = [ep.tool_turns for ep in episodes]
    assert turns == [3, 2] and [ep.stop_reason for ep in episodes] == ["env_done"] * 2
    _, turn_funcs = pool.reward_funcs  # HotCold_steps: the step rewards and the replies' scores, a value per turn
    K = max(turns) + 1 if ADVANTAGE_MODES[mode].turn_columns else 1  # as the trainer's _score
    per_func = compute_rewards_per_func(turn_funcs, ["p"] * 2, [ep.messages for ep in episodes],
                                        {"environments": [ep.toolset.environment for ep in episodes]}, turns, K)
    R_T, R_O = turn_reward_table(per_func, torch.ones(1), torch.tensor(turns), [True]), torch.tensor([1.0, 0.0])
    token_turns = pad_episodes(episodes, tokenizer.pad_token_id, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, R_O, token_turns, AdvantageSettings.of(mode, 2, turn_advantage_coef=1.0))
    records = episode_records(tokenizer, episodes, rows, step=1, mode="train", first_index=0, group_size=2, rewards={},
                              R_T=R_T, R_O=R_O, A_T=adv.turn, A_O=adv.outcome, token_values={"advantage": adv.tokens})
    env.release(episodes)
    os.makedirs(os.path.join(run_dir, "rollouts"))
    with open(os.path.join(run_dir, "rollouts", "step-000001.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records


def test_a_per_turn_run_with_user_turns_shows_each_turns_own_credit(browser, tmp_path, smollm2_tokenizer):
    """per_turn with user turns (issue 78, point 9): no "first <result>" bar (A_T reaches every turn, and B has no
    tool result), each model turn labelled with its own R_T and A_T and coloured by A_O + its A_T, a reply's score
    labelled as one and the tool's step reward as before, and the group's mean R_T over the five per-turn values.
    By hand: R_T pooled over (0.1, 0.5, 1, 0.2, 1): mean 0.56, std (unbiased) 0.4278, A_T = (R_T - 0.56) / 0.4278;
    A_O = +-0.7071."""
    run_dir = str(tmp_path / "per_turn")
    records = hot_cold_run(run_dir, smollm2_tokenizer, "per_turn")
    assert [r["R_T"] for r in records] == [pytest.approx([0.1, 0.5, 1.0]), pytest.approx([0.2, 1.0])]
    assert records[1]["first_result"] < len(records[1]["tokens"]["ids"])  # its first reply: what the bar once showed
    assert turn_labels(browser, run_dir) == [
        "model turn 0 · R_T 0.1 · A_T -1.075", "environment · step reward 0.1",
        "model turn 1 · R_T 0.5 · A_T -0.1403", "environment's reply · reply score 0.5",
        "model turn 2 · R_T 1 · A_T 1.029", "environment's reply · reply score 1",
        "model turn 0 · R_T 0.2 · A_T -0.8415", "environment's reply · reply score 0.2",
        "model turn 1 · R_T 1 · A_T 1.029", "environment's reply · reply score 1"]
    assert browser.js("document.querySelectorAll('.split').length") == 0
    assert browser.js("document.querySelector('#legend .split-key').offsetParent") is None  # the bar's key hidden
    assert "mean R_T 0.56 (5 turns), R_O 0.5" in browser.js("document.querySelector('.group h2').textContent")
    # each model turn's tokens: one colour, the page's colour of A_O + that turn's A_T (by hand)
    colours = browser.js("""[...document.querySelectorAll('.episode')].map((card) =>
        [...card.querySelectorAll('.turn.model')].map((turn) =>
            [...new Set([...turn.querySelectorAll('.t.m')].map((t) => t.style.background))]))""")
    A_O, scale = 0.7071, 0.7071 + 1.029  # the step's largest |advantage|: A's last turn
    expected = [[A_O - 1.0753, A_O - 0.1403, A_O + 1.0286], [-A_O - 0.8415, -A_O + 1.0286]]
    as_css = "(a) => { const s = document.createElement('span'); s.style.background = advColor(a, %s); " \
             "return [s.style.background]; }" % scale  # the colour as the browser writes it back
    assert colours == browser.js(f"{expected}.map((card) => card.map({as_css}))")
    assert len({c for card in colours for [c] in card}) == 5  # five turns, five advantages, five colours
    assert browser.errors() == []


def test_an_mt_grpo_run_with_user_turns_marks_where_A_T_stops(browser, tmp_path, smollm2_tokenizer):
    """mt_grpo: A_T stops at the first environment turn, a tool result (A) or a reply (B), and the bar names which;
    the model turns carry no per-turn values, and the header's mean R_T is over the two episodes' numbers."""
    run_dir = str(tmp_path / "mt_grpo")
    records = hot_cold_run(run_dir, smollm2_tokenizer, "mt_grpo")
    assert [r["R_T"] for r in records] == [pytest.approx(0.1), pytest.approx(0.2)]
    labels = turn_labels(browser, run_dir)
    assert labels[:2] == ["model turn 0", "environment · step reward 0.1"] and labels[3] == \
        "environment's reply · reply score 0.5", labels
    bars = browser.js("[...document.querySelectorAll('.split')].map((b) => b.textContent)")
    assert bars == [f"first <result> · token {records[0]['first_result']} · A_T counts above this line only",
                    f"first reply · token {records[1]['first_result']} · A_T counts above this line only"]
    assert browser.js("document.querySelector('#legend .split-key').offsetParent") is not None
    assert "mean R_T 0.15, R_O 0.5" in browser.js("document.querySelector('.group h2').textContent")
    assert browser.errors() == []


# ------------------------------------------------------------------------------------------------
# scripts/answer_errors.py: where a run's wrong answers come from
# ------------------------------------------------------------------------------------------------
def qa_episode(question: str, gold: list[str], result: str | None, last: str) -> dict:
    """A recorded episode: an optional search whose <result> holds `result`, then the model's last turn."""
    turns = []
    if result is not None:
        turns += [{"role": "model", "text": "<reasoning>Look it up.</reasoning>\n<tool>{}</tool>"},
                  {"role": "env", "text": f"<|im_end|>\n<|im_start|>user\n<result>\n{result}\n</result><|im_end|>\n"}]
    return {"question": question, "answer": gold, "turns": turns + [{"role": "model", "text": last}]}


def test_answer_errors_classes():
    from answer_errors import classify

    q, gold = "What is the best-known landmark of Stakragard?", ["Trarfath Gate"]
    docs = ("Stakragard: Stakragard is a city. Its best-known landmark is the Trarfath Gate.\n"
            "Hurtrewick: Hurtrewick is a city. It was founded by Fasthath Zurkun.")
    said = "<reasoning>The result says the best-known landmark of Stakragard is the Trarfath Gate.</reasoning>\n"
    assert classify(qa_episode(q, gold, docs, said + "<answer>the Trarfath gate</answer>")) == ("exact", False, True)
    # the fact written in the reasoning, then the question's entity as the answer
    assert classify(qa_episode(q, gold, docs, said + "<answer>Stakragard</answer>")) == ("from the question", True, True)
    assert classify(qa_episode(q, gold, docs, "<reasoning>Next one.</reasoning>\n<answer>Fasthath Zurkun</answer>")) \
        == ("result document 1", False, True)
    assert classify(qa_episode(q, gold, docs, "<answer>It is the Trarfath Gate.</answer>"))[0] == "holds the gold"
    assert classify(qa_episode(q, gold, None, "<answer>Eiffel Tower</answer>")) == ("in no result", False, False)
    assert classify(qa_episode(q, gold, docs, "<reasoning>Now I")) == ("no answer", False, True)
    # numbers as the rewards compare them (rewards/answers.py): 35.0 is 35, and "about 35" holds it
    sum_q = "What is 24 + 11?"
    assert classify(qa_episode(sum_q, ["35"], None, "<answer>35.0</answer>"))[0] == "exact"
    assert classify(qa_episode(sum_q, ["35"], None, "<answer>It is about 35 in all.</answer>"))[0] == "holds the gold"
    assert classify(qa_episode(sum_q, ["35"], None, "<answer>3.5</answer>"))[0] == "in no result"


def test_the_kept_runs_are_read_gzipped():
    """The runs kept in studies/data/*_runs/ store every record gzipped; the readers open them as they are: answer_errors
    (through load_rollouts) gives one_document-s1's counts that docs/results.md quotes (48 training episodes of 6
    steps: the gold seen in a result in 28, exact 2, no answer 15, 15 wrong with the gold in their reasoning), and
    plot_runs reads its trainer_state.json.gz."""
    from answer_errors import tally
    from plot_runs import load_log_history
    from view_rollouts import load_rollouts

    run = os.path.join(ROOT, "studies", "data", "ablation_runs", "one_document-s1")
    assert not any(name.endswith((".json", ".jsonl", ".txt")) for _, _, names in os.walk(run) for name in names)
    rollouts = load_rollouts(run)
    assert sorted(rollouts) == [f"train-{s:06d}" for s in (1, 6, 11, 16, 21, 26)]
    counts = dict(tally([e for episodes in rollouts.values() for e in episodes]))
    assert sum(len(e) for e in rollouts.values()) == 48
    assert (counts["exact"], counts["no answer"], counts["gold in a result it saw"],
            counts["wrong answer, gold in its reasoning"]) == (2, 15, 28, 15)
    assert max(h["step"] for h in load_log_history(run)) == 27


def test_answer_errors_cli(tmp_path):
    """On the fixture run (tests/rollout_records.py), per step: 3 searches then the exact answer, 4 answers of
    "Paris" found in no result, 1 episode out of turns; 4 episodes saw the gold in a result."""
    run_dir = str(tmp_path / "run")
    write_run(run_dir, train_steps=(1, 2), eval_steps=(2,))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "answer_errors.py"), run_dir, "--steps", "1-2"],
                         capture_output=True, text=True, check=True).stdout
    train, evals = out.split("eval:")
    assert train.startswith("train: 16 episodes of 2 steps") and evals.startswith(" 8 episodes of 1 steps")

    def count(section: str, kind: str) -> int:
        return int(next(line.split()[-2] for line in section.splitlines() if line.strip().startswith(kind)))

    assert (count(train, "exact"), count(train, "in no result"), count(train, "no answer")) == (6, 8, 2)
    assert count(train, "gold in a result it saw") == 8 and count(evals, "exact") == 3
    # --strip: the training episodes without token arrays or prompt text read the same, and the eval ones are left
    small = str(tmp_path / "small")
    stripped = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "answer_errors.py"), run_dir,
                               "--strip", small], capture_output=True, text=True, check=True).stdout
    assert stripped.startswith("16 training episodes written") and "eval:" not in stripped
    assert stripped.split("\n", 1)[1] == train
    assert sorted(os.listdir(os.path.join(small, "rollouts"))) == ["step-000001.jsonl.gz", "step-000002.jsonl.gz"]
    with gzip.open(os.path.join(small, "rollouts", "step-000001.jsonl.gz"), "rt") as f:
        record = json.loads(f.readline())
    assert "tokens" not in record and "prompt_text" not in record and record["turns"]
    assert os.path.exists(os.path.join(small, "trainer_state.json.gz"))
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "answer_errors.py"), str(empty)],
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "--save_rollouts_steps" in failed.stderr


# ------------------------------------------------------------------------------------------------
# The records themselves (reporting.episode_records) against the guide's description of them
# ------------------------------------------------------------------------------------------------
def schema(x):
    """The field names of a record, nested; a list of objects gives the union of its objects' fields."""
    if isinstance(x, dict):
        return {k: schema(v) for k, v in x.items()}
    if isinstance(x, list) and any(isinstance(v, dict) for v in x):
        return [{k: v for item in x for k, v in schema(item).items()}]
    return "value"


def test_the_guide_shows_every_field_of_a_record(smollm2_tokenizer):
    """A real episode (the env, a scripted policy, a search tool) recorded as the trainer records one has the
    fields of the guide's example record, no more, no less; its env turn holds the tool's output."""
    import torch

    from mt_grpo.run.reporting import episode_records
    from scripted_policy import ScriptedPolicy

    question, reply = "What is the capital of Veltria?", "Veltria: a country. Its capital is Morvane."
    script = {question: ['<reasoning>Look it up.</reasoning>\n<tool>{"name": "search", "args": {"query": "Veltria"}}'
                         '</tool>', "<reasoning>Found it.</reasoning>\n<answer>Morvane</answer>"]}
    env = make_env(smollm2_tokenizer, [fake_search(lambda query: reply)])
    episodes = env.rollout([env.prompt(question)], ScriptedPolicy(smollm2_tokenizer, script))
    T = len(episodes[0].completion_ids)
    rewards = {"turn": {"tool_execution_reward_func": [0.2]}, "outcome": {"exact_match_reward_func": [1.0]}}
    kwargs = dict(step=3, first_index=0, group_size=1, inputs=[{"question": question, "answer": ["Morvane"]}],
                  rewards=rewards)
    train, = episode_records(smollm2_tokenizer, episodes, mode="train", R_T=torch.tensor([0.2]),
                             R_O=torch.tensor([1.0]), A_T=torch.tensor([[0.5]]), A_O=torch.tensor([0.87]),
                             token_values={"advantage": torch.ones(1, T), "trainer_logprob": torch.zeros(1, T),
                                           "is_weight": torch.ones(1, T)}, **kwargs)
    evaluation, = episode_records(smollm2_tokenizer, episodes, mode="eval", token_values={}, **kwargs)
    with open(os.path.join(ROOT, "docs", "guide.md")) as f:
        section = f.read().split("## Looking at rollouts and runs")[1].split("\n## ")[0]
    documented = json.loads(section.split("```json\n")[1].split("```")[0])
    assert schema(train) == schema(documented)
    env_turn = next(t for t in train["turns"] if t["role"] == "env")
    assert env_turn["tool_calls"][0]["output"] == reply and reply in env_turn["text"]
    assert "output" not in train["tool_calls"][0]  # the top-level list, as the guide says
    # an evaluation record: no per-token training values, no R_T, R_O, A_T, A_O
    assert set(schema(train)["tokens"]) - set(evaluation["tokens"]) == {"advantage", "trainer_logprob", "is_weight"}
    assert [evaluation[k] for k in ("R_T", "R_O", "A_T", "A_O")] == [None] * 4 and schema(evaluation)["turns"] == \
        schema(train)["turns"]


def test_an_episode_without_a_tool_call_records_the_turn_credit_its_tokens_got(smollm2_tokenizer):
    """per_turn (issue 70): an episode that called no tool still has a first turn, and its tokens got
    A_O + A_T(0); its record shows that turn's R_T and A_T (it once showed `[]` for both), and the per-token
    advantage it records is that sum. Two tool turns beside it keep one value each."""
    import torch

    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
    from mt_grpo.run.reporting import episode_records
    from scripted_policy import ScriptedPolicy

    call = '<reasoning>Look it up.</reasoning>\n<tool>{"name": "search", "args": {"query": "Veltria"}}</tool>'
    searching, direct = "What is the capital of Veltria?", "Who founded Veltria?"
    script = {searching: [call, call, "<reasoning>Found it.</reasoning>\n<answer>Morvane</answer>"],
              direct: ["<reasoning>I know it.</reasoning>\n<answer>Ost</answer>"]}
    env = make_env(smollm2_tokenizer, [fake_search(lambda query: "Veltria: its capital is Morvane.")])
    episodes = env.rollout([env.prompt(searching), env.prompt(direct)], ScriptedPolicy(smollm2_tokenizer, script))
    assert [ep.tool_turns for ep in episodes] == [2, 0]
    # what turn_reward_table gives: the searches' two turns, and the direct answer's first turn (0 from a
    # per-turn function); pooled over the group: mean 0.3, std 0.2646
    R_T, R_O = torch.tensor([[0.5, 0.4], [0.0, float("nan")]]), torch.tensor([1.0, 0.0])
    batch = pad_episodes(episodes, smollm2_tokenizer.pad_token_id, False)
    adv = mt_grpo_advantages(R_T, R_O, batch["token_turns"], AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    records = episode_records(smollm2_tokenizer, episodes, [{"question": searching}, {"question": direct}], step=1,
                              mode="train", first_index=0, group_size=2, rewards={}, R_T=R_T, R_O=R_O, A_T=adv.turn,
                              A_O=adv.outcome, token_values={"advantage": adv.tokens})
    std = (((0.5 - 0.3) ** 2 + (0.4 - 0.3) ** 2 + 0.3 ** 2) / 2) ** 0.5
    assert records[0]["R_T"] == pytest.approx([0.5, 0.4]) and records[1]["R_T"] == [0.0]
    assert records[0]["A_T"] == pytest.approx([0.2 / std, 0.1 / std]) and records[1]["A_T"] == pytest.approx([-0.3 / std])
    assert records[1]["A_O"] == pytest.approx(-0.7071, abs=1e-4)
    model = [a for a, m in zip(records[1]["tokens"]["advantage"], records[1]["tokens"]["model_mask"]) if m]
    assert model and model == pytest.approx([records[1]["A_O"] + records[1]["A_T"][0]] * len(model))
