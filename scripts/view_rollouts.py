"""Render a run's recorded episodes (RUN_DIR/rollouts/*.jsonl, or scripts/evaluate.py's RUN_DIR/eval_episodes.jsonl)
as one self-contained HTML page.

    python scripts/view_rollouts.py outputs/cpu_demo                  # -> outputs/cpu_demo/rollouts.html
    python scripts/view_rollouts.py outputs/cpu_demo --steps 100-120 --max-episodes-per-step 64 --out big.html
    chromium --headless --no-sandbox --hide-scrollbars --window-size=1280,860 \
        --screenshot=docs/viewer.png "file://$PWD/outputs/cpu_demo/rollouts.html#:0.4"   # docs image

The page needs no network (inline CSS and JS, no CDN). It shows one step at a time, its groups one
under another and a group's episodes side by side. Every completion token is a span: model tokens
coloured by their advantage (blue < 0 < red), environment tokens grey and italic in a dashed box.
In mt_grpo mode a thick bar marks the first <result> (or the environment's first reply as the user), where the turn
advantage A_T stops applying; in per_turn mode each model turn is labelled with its own R_T and A_T, and an
environment's reply with its score. Hover a token for
its id, its text with visible whitespace, the sampler and trainer logprobs and the IS weight. Filters:
step (train and eval), stop reason, and a min/max on R_T, R_O or one reward function. `#KEY` in the
URL (e.g. `#eval-000002`; default: the last train step) picks the step, and `#KEY:E.I` also shows
the tooltip of token I of the step's episode E (counted in group order from 0; `#:0.4` for the
default step), as in the docs screenshot.

Size (measured): each step's episodes sit in their own `<script type="application/json">` block,
parsed and drawn only when that step is picked, so opening costs little more than reading the file.
The page is ~14 KB plus ~55 bytes per completion token with the default 4 significant digits
(~90 with --digits 0; the JSONL files take ~90): ~44 KB per step for the test fixture (8 episodes,
757 tokens), ~110 KB per step for the CPU demo (8 episodes of ~250 tokens; 200 steps = ~25 MB,
opens in under a second), ~18 MB per step for a 7B recipe (336 episodes of ~1000 tokens). There,
pass --steps and/or --max-episodes-per-step (64 episodes = ~3.5 MB a step); a step with more than
50k tokens draws each episode's tokens only as it scrolls into view (first screen in ~1 s).
"""

import argparse
import glob
import gzip
import html
import json
import math
import os
import re

FILE_NAME = re.compile(r"^(eval-)?step-(\d+)\.jsonl(\.gz)?$")


# ------------------------------------------------------------------------------------------------
# Reading and packing the records
# ------------------------------------------------------------------------------------------------
def record_file(path: str) -> str | None:
    """`path` or its gzipped copy `path.gz`, whichever exists (None if neither): the trainer writes a run's records
    plain, and the runs kept in studies/data/*_runs/ store them gzipped, so that a clone carries code more than records."""
    return next((p for p in (path, path + ".gz") if os.path.isfile(p)), None)


def open_record(path: str):
    """A run's record (trainer_state.json, a rollouts/*.jsonl, log.txt), opened to read as text, plain or .gz."""
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def write_gzipped(path: str, text: str) -> None:
    """`text` to `path` (a .gz name), gzipped without a time stamp in its header: the same text, the same bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(text.encode())


def without_tokens(record: dict) -> dict:
    """A record without its token arrays and prompt text, most of its size: what a run's committed copy keeps
    (answer_errors.py --strip, learning_study.py --keep); this viewer needs them, the reports do not."""
    return {k: v for k, v in record.items() if k not in ("tokens", "prompt_text")}


def step_key(mode: str, step: int) -> str:
    return f"{mode}-{step:06d}"


def load_rollouts(run_dir: str, steps: tuple[int, int] | None = None) -> dict[str, list[dict]]:
    """{step_key: episodes sorted by (group, sample)}, train steps first, then eval, each in step order: the
    trainer's RUN_DIR/rollouts/*.jsonl, and scripts/evaluate.py's RUN_DIR/eval_episodes.jsonl as an evaluation
    at the step its records name; each file plain or gzipped (.jsonl.gz, as studies/data/*_runs/ keep them)."""
    files = []  # (mode, step, path)
    for path in glob.glob(os.path.join(run_dir, "rollouts", "*.jsonl*")):
        match = FILE_NAME.match(os.path.basename(path))
        if match is not None:
            files.append(("eval" if match.group(1) else "train", int(match.group(2)), path))
    evaluated = record_file(os.path.join(run_dir, "eval_episodes.jsonl"))
    if evaluated is not None:
        with open_record(evaluated) as f:
            first = f.readline()
        files.append(("eval", json.loads(first)["step"] if first.strip() else 0, evaluated))
    found = [(mode != "train", step, mode, path) for mode, step, path in files
             if steps is None or steps[0] <= step <= steps[1]]
    rollouts = {}
    for _, step, mode, path in sorted(found):
        with open_record(path) as f:
            episodes = [json.loads(line) for line in f if line.strip()]
        rollouts[step_key(mode, step)] = sorted(episodes, key=lambda e: (e.get("group", 0), e.get("sample", 0)))
    return rollouts


def compact(value, digits: int):
    """A copy for embedding: floats to `digits` significant digits (0 keeps them exact), and the
    non-finite floats JSON cannot hold (a -inf logprob) as the strings "-Infinity", "Infinity", "NaN"."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value).replace("inf", "Infinity").replace("nan", "NaN")
        return float(f"{value:.{digits}g}") if digits > 0 else value
    if isinstance(value, dict):
        return {k: compact(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v, digits) for v in value]
    return value


def script_json(value) -> str:
    """JSON that is safe inside a <script> block: `<`, `>` and `&` become \\u escapes, so model text
    such as `</script>` or `<!--` cannot end the block or change how the HTML parser reads it."""
    text = json.dumps(value, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def reward_names(rollouts: dict[str, list[dict]]) -> list[str]:
    """What the reward filter can select: R_T, R_O, then every reward function as turn/<f>, outcome/<f>."""
    names = {}
    for episodes in rollouts.values():
        for ep in episodes:
            for kind in ("turn", "outcome"):
                for name in (ep.get("rewards") or {}).get(kind) or {}:
                    names[f"{kind}/{name}"] = None
    return ["R_O", "R_T", *names]


def build_page(run_dir: str, steps: tuple[int, int] | None = None, max_episodes: int | None = None,
               digits: int = 4) -> str:
    """The page: an index block, one JSON block per step (train, then eval), and the CSS and JS."""
    rollouts = load_rollouts(run_dir, steps)
    if max_episodes:
        rollouts = {key: episodes[:max_episodes] for key, episodes in rollouts.items()}
    index = {"run": os.path.abspath(run_dir), "rewards": reward_names(rollouts),
             "steps": [{"key": key, "episodes": len(eps),
                        "stop_reasons": sorted({str(e.get("stop_reason")) for e in eps})} for key, eps in rollouts.items()]}
    blocks = [f'<script type="application/json" id="index">{script_json(index)}</script>']
    blocks += [f'<script type="application/json" id="data-{key}">{script_json(compact(eps, digits))}</script>'
               for key, eps in rollouts.items()]
    parts = {"TITLE": html.escape(f"rollouts: {os.path.basename(os.path.abspath(run_dir))}"),
             "CSS": CSS, "JS": JS, "DATA": "\n".join(blocks)}
    # One pass over the template, so that a `__JS__` in model text is never itself replaced.
    return re.sub(r"__(TITLE|CSS|JS|DATA)__", lambda m: parts[m.group(1)], PAGE)


# ------------------------------------------------------------------------------------------------
# The page: CSS, then the JS that draws the picked step. Model text only ever reaches the DOM
# through textContent, never innerHTML.
# ------------------------------------------------------------------------------------------------
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title><link rel="icon" href="data:,">
<style>__CSS__</style></head>
<body>
<header>
  <b id="title">__TITLE__</b>
  <label>step <button id="prev" title="previous step (key: left arrow)">&#9664;</button><select id="step"></select>
    <button id="next" title="next step (key: right arrow)">&#9654;</button></label>
  <label>stop reason <select id="stop"><option value="">all</option></select></label>
  <label>reward <select id="reward"></select>
    min <input id="min" type="number" step="any"> max <input id="max" type="number" step="any"></label>
  <span id="count"></span>
  <span id="legend">advantage <span id="lo"></span><span class="bar"></span><span id="hi"></span>
    <span class="t e">environment</span> <span class="split-key">first &lt;result&gt; or reply</span></span>
</header>
<main id="groups"></main>
<div id="tip"></div>
__DATA__
<script>__JS__</script>
</body></html>
"""

CSS = """
.thumbs { display: flex; gap: 4px; margin: 2px 0; }
.thumbs img { height: 56px; image-rendering: pixelated; border: 1px solid #bbb; background: #fff; }
body { font: 13px system-ui, sans-serif; margin: 0; background: #fafafa; color: #222; }
header { position: sticky; top: 0; z-index: 2; background: #fff; border-bottom: 1px solid #ccc; padding: 6px 10px;
  display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: center; }
header input { width: 5em; }
#legend { display: inline-flex; gap: 6px; align-items: center; }
#legend .bar { display: inline-block; width: 120px; height: 12px; border: 1px solid #999;
  background: linear-gradient(to right, rgb(90,90,255), #fff, rgb(255,90,90)); }
.split-key { border-left: 4px solid #000; padding-left: 4px; }
main { padding: 8px 10px; }
.group { margin-bottom: 16px; }
.group h2 { font-size: 14px; margin: 4px 0; }
.group details { margin: 0 0 4px; color: #555; }
.group pre { white-space: pre-wrap; background: #f0f0f0; padding: 4px; max-height: 200px; overflow: auto; }
.episodes { display: flex; gap: 8px; align-items: flex-start; overflow-x: auto; }
.episode { flex: 1 1 0; min-width: 260px; max-width: 640px; background: #fff; border: 1px solid #ccc; border-radius: 4px;
  padding: 6px; }
.ep-head { display: flex; justify-content: space-between; font-weight: bold; margin-bottom: 4px; }
.stop { font-weight: normal; padding: 0 6px; border-radius: 8px; background: #ddd; }
.stop.answer { background: #cde8cd; }
.scores { font-size: 12px; margin-bottom: 4px; }
.chip { display: inline-block; margin: 0 4px 2px 0; padding: 0 5px; border: 1px solid #ccc; border-radius: 3px; }
.scores table { border-collapse: collapse; }
.scores td { padding: 0 8px 0 0; }
.scores td:first-child { color: #666; }
.calls { margin: 0 0 6px; padding-left: 18px; font-size: 12px; }
.calls li.err { background: #fdd; }
.calls .out { color: #555; white-space: pre-wrap; max-height: 4.5em; overflow: hidden; }
.tokens { font: 12px/1.7 ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.turn { margin: 2px 0; }
.turn-label { display: block; font: 10px system-ui, sans-serif; color: #888; }
.turn.env, .turn.insert { background: #f2f2f2; border: 1px dashed #aaa; padding: 2px 4px; }
.turn.env.err { border: 2px solid #d33; background: #fff0f0; }
.t { border-radius: 2px; }
.t:hover, .t.pinned { outline: 1px solid #000; }
.t.e { color: #777; font-style: italic; }
.split { display: block; border-top: 4px solid #000; margin: 6px 0 2px; font: bold 10px system-ui, sans-serif; }
.split.none { border-top: 2px dashed #000; font-weight: normal; }
#tip { position: fixed; display: none; z-index: 3; pointer-events: none; background: #222; color: #fff; padding: 6px 8px;
  border-radius: 4px; font: 12px ui-monospace, monospace; white-space: pre; }
"""

JS = r"""
const $ = (id) => document.getElementById(id);
const INDEX = JSON.parse($("index").textContent);
let shown = [];  // the picked step's episodes; token spans point into it by data-e / data-i

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(x) {
  if (x === null || x === undefined) return "–";
  if (Array.isArray(x)) return "[" + x.map(fmt).join(", ") + "]";
  return typeof x === "number" ? String(Number(x.toPrecision(4))) : String(x);
}
const visible = (s) => s.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "→").replace(/\r/g, "␍");

// Diverging scale: blue (-scale) - white (0) - red (+scale).
function advColor(a, scale) {
  const t = Math.max(-1, Math.min(1, a / scale)), fade = Math.round(255 - 165 * Math.abs(t));
  return t >= 0 ? `rgb(255,${fade},${fade})` : `rgb(${fade},${fade},255)`;
}
// The value the reward filter compares; a per-turn list counts as its sum.
function rewardValue(ep, name) {
  const [kind, fn] = [name.slice(0, name.indexOf("/")), name.slice(name.indexOf("/") + 1)];
  let v = name === "R_O" || name === "R_T" ? ep[name] : ((ep.rewards || {})[kind] || {})[fn];
  if (Array.isArray(v)) v = v.reduce((a, b) => a + b, 0);
  return typeof v === "number" ? v : null;
}
function passes(ep) {
  const stop = $("stop").value, name = $("reward").value, lo = $("min").value, hi = $("max").value;
  if (stop && String(ep.stop_reason) !== stop) return false;
  if (lo === "" && hi === "") return true;
  const v = rewardValue(ep, name);
  return v !== null && (lo === "" || v >= Number(lo)) && (hi === "" || v <= Number(hi));
}

function scores(ep) {
  const box = el("div", "scores"), table = el("table");
  for (const k of ["R_T", "A_T", "R_O", "A_O"]) box.append(el("span", "chip", `${k} ${fmt(ep[k])}`));
  for (const kind of ["turn", "outcome"])
    for (const [name, v] of Object.entries((ep.rewards || {})[kind] || {})) {
      const tr = table.insertRow();
      tr.title = kind + "/" + name;
      tr.insertCell().textContent = kind + "/" + name.replace(/_reward_func$/, "");
      tr.insertCell().textContent = fmt(v);
    }
  box.append(table);
  return box;
}
// A failed call, as its record says (`ok`); a record without `ok` by its text, in either protocol's form: `Error: ...`
// (xml, and failures TRL has not) or TRL's `{'error': ...}` (chat_template: a raise, bad arguments, an unknown tool)
const isError = (call) => call.ok !== undefined ? call.ok === false :
  /^(Error:|\{'error': )/.test(String(call.output || ""));
// An env turn that answers no tool call: the environment's reply as the user (mt_grpo/rollout/user_turns.py), whose
// score is its turn's R_T. Older records without `tool_calls` on a turn read as tool turns.
const isReply = (turn) => turn.role === "env" && Array.isArray(turn.tool_calls) && !turn.tool_calls.length;
// How the episode's A_T reached its tokens: the record's `advantage_mode` where it has one, else what A_T shows: a
// list is per_turn's (one value per turn, each on its own model turn), a number mt_grpo's (A_T before the first
// environment turn only; outcome_only and merged also record a number, which only the field tells apart). An
// evaluation record (A_T null) has none.
function creditMode(ep) {
  if (ep.A_T === null || ep.A_T === undefined) return null;
  return ep.advantage_mode || (Array.isArray(ep.A_T) ? "per_turn" : "mt_grpo");
}
// A per-turn list's value at turn k ("–" past its end: that turn got no A_T), or the value itself.
const atTurn = (v, k) => Array.isArray(v) ? v[k] : v;

// Tool calls with their outputs, from the env turns (the top-level list has no outputs).
function callsList(ep) {
  const envTurns = (ep.turns || []).filter((t) => t.role === "env");
  let calls = envTurns.flatMap((t, k) => (t.tool_calls || []).map((c) => ({ turn: k, ...c })));
  if (!calls.length) calls = ep.tool_calls || [];
  const list = el("ol", "calls");
  for (const c of calls) {
    const li = el("li", isError(c) ? "err" : "", `turn ${c.turn} ${c.name}(${JSON.stringify(c.args)}) ` +
      `${c.ok === false ? "✗" : "✓"} ${fmt(c.seconds)} s`);
    if (c.output !== undefined) li.append(el("div", "out", typeof c.output === "string" ? c.output : JSON.stringify(c.output)));
    list.append(li);
  }
  return list;
}

// the images a prompt or an environment turn brought (engine/vision.py: PNG thumbnails as data URLs), where they entered
function thumbs(images) {
  const box = el("div", "thumbs");
  for (const im of images || []) {
    const img = el("img");
    img.src = im.thumbnail;
    img.title = `image ${(im.size || []).join(" x ")} px`;
    box.append(img);
  }
  return box;
}

function fillTokens(box, ep, e, scale) {
  const tok = ep.tokens || {}, texts = tok.text || [], mask = tok.model_mask || tok.env_mask || [], adv = tok.advantage || [];
  const n = (tok.ids || []).length, mode = creditMode(ep);
  // mt_grpo: A_T stops at the first environment turn (episodes.token_turn_index), a tool result or a reply
  const splitAt = mode === "mt_grpo" ? ep.first_result : undefined;
  const splitTurn = (ep.turns || []).find((t) => t.start === splitAt);
  // Turns tile the completion; anything they leave out is drawn as an unlabelled segment.
  const segments = [];
  let pos = 0, modelTurn = 0;  // the model turn k of R_T and A_T: the environment turns before it
  for (const t of ep.turns || []) {
    if (t.start > pos) segments.push({ start: pos, end: t.start });
    segments.push(t);
    pos = Math.max(pos, t.end);
  }
  if (pos < n) segments.push({ start: pos, end: n });
  for (const seg of segments) {
    const div = el("div", "turn" + (seg.role ? " " + seg.role : ""));
    const err = seg.role === "env" && (seg.tool_calls || []).some(isError);
    if (err) div.classList.add("err");
    if (seg.role === "model") {
      // per_turn: the turn's own reward and advantage, which its tokens' colour shows (with A_O)
      const own = mode !== "per_turn" ? "" :
        ` · R_T ${fmt(atTurn(ep.R_T, modelTurn))} · A_T ${fmt(atTurn(ep.A_T, modelTurn))}`;
      div.append(el("span", "turn-label", `model turn ${modelTurn}` + own));
    }
    // a continuation (mt_grpo/rollout/user_turns.py): the environment's text inside the model's own message; the
    // turn goes on
    if (seg.role === "insert") div.append(el("span", "turn-label", "environment, inside the model's message"));
    if (seg.role === "env") {
      // what the turn earned, R_T of the model turn it answers: a reply's score (user_turns.py), or the per-step
      // rewards its calls appended (mt_grpo/rollout/environments.py)
      const reply = isReply(seg), scored = seg.step_rewards ? seg.step_rewards.map(fmt).join(" + ") : null;
      const steps = scored === null ? "" :
        reply ? ` · reply score ${scored || "none"}` : ` · step reward ${scored || "none (0)"}`;
      // turn_samples: this turn starts a new training sample, whose prompt is the template's render of the history
      const sample = seg.sample ? ` · sample ${seg.sample}: its prompt, the template's render of the history` : "";
      const name = err ? "environment (error)" : reply ? "environment's reply" : "environment";
      div.append(el("span", "turn-label", name + steps + sample));
      if (seg.images) div.append(thumbs(seg.images));
      modelTurn++;
    }
    for (let i = seg.start; i < Math.min(seg.end, n); i++) {
      if (i === splitAt) {
        const what = splitTurn && isReply(splitTurn) ? "first reply" : "first <result>";
        const bar = el("span", "split", `${what} · token ${i} · A_T counts above this line only`);
        (i === seg.start ? box : div).append(bar);
      }
      const env = mask[i] === 0, span = el("span", env ? "t e" : "t m", String(texts[i] ?? "") || "∅");
      if (!env) span.style.background = advColor(adv[i] || 0, scale);
      span.dataset.e = e;
      span.dataset.i = i;
      div.append(span);
    }
    box.append(div);
  }
  if (mode === "mt_grpo" && n && !(ep.first_result < n))
    box.append(el("span", "split none", "no <result>: A_T counts on every token"));
}

// A big step (a 7B recipe: ~300k tokens) would take seconds to draw as spans, so past EAGER_TOKENS an
// episode's tokens are drawn only when its card comes near the screen; until then a box of about
// their height (~45 characters a line) keeps the page's length.
let EAGER_TOKENS = 50000, observer = null;
function tokensBox(ep, e, scale) {
  const box = el("div", "tokens");
  if (!observer) {
    fillTokens(box, ep, e, scale);
    return box;
  }
  const texts = (ep.tokens || {}).text || [];
  const lines = texts.reduce((sum, t) => sum + String(t).length / 45 + (String(t).match(/\n/g) || []).length, 0);
  box.style.minHeight = Math.round(lines * 20) + "px";
  box.fill = () => fillTokens(box, ep, e, scale);
  observer.observe(box);
  return box;
}
function fillVisible(entries) {
  for (const entry of entries) {
    if (!entry.isIntersecting) continue;
    observer.unobserve(entry.target);
    entry.target.fill();
    entry.target.style.minHeight = "";
  }
}

function episodeCard(ep, e, scale) {
  const card = el("div", "episode"), head = el("div", "ep-head");
  head.append(el("span", "", `sample ${ep.sample} · policy v${fmt(ep.policy_version)}`),
              el("span", "stop " + ep.stop_reason, String(ep.stop_reason)));
  card.append(head, scores(ep), callsList(ep), tokensBox(ep, e, scale));
  return card;
}

function render() {
  const key = $("step").value;
  history.replaceState(null, "", "#" + key);
  shown = JSON.parse($("data-" + key).textContent);
  let scale = 0;
  for (const ep of shown) for (const a of (ep.tokens || {}).advantage || []) scale = Math.max(scale, Math.abs(a) || 0);
  scale = scale || 1;
  $("lo").textContent = fmt(-scale);
  $("hi").textContent = "+" + fmt(scale);
  document.querySelector("#legend .split-key").hidden = !shown.some((ep) => creditMode(ep) === "mt_grpo");
  const groups = new Map();
  shown.forEach((ep, e) => {
    if (!passes(ep)) return;
    if (!groups.has(ep.group)) groups.set(ep.group, []);
    groups.get(ep.group).push([ep, e]);
  });
  const tokens = [...groups.values()].flat().reduce((sum, [ep]) => sum + ((ep.tokens || {}).ids || []).length, 0);
  if (observer) observer.disconnect();
  observer = tokens > EAGER_TOKENS ? new IntersectionObserver(fillVisible, { rootMargin: "1500px" }) : null;
  const main = $("groups");
  main.replaceChildren();
  let count = 0;
  for (const [g, members] of groups) {
    const first = members[0][0], section = el("section", "group"), row = el("div", "episodes");
    // a mean over every value the group's episodes hold: a per-turn list gives one per turn (per_turn normalises A_T
    // over that pool; rewards/turn/mean is its mean over the batch); none (an evaluation): "–"
    const values = (k) => members.flatMap(([ep]) => [ep[k]].flat()).filter((v) => typeof v === "number");
    const mean = (k) => values(k).length ? fmt(values(k).reduce((a, b) => a + b, 0) / values(k).length) : "–";
    const turns = members.some(([ep]) => Array.isArray(ep.R_T)) ? ` (${values("R_T").length} turns)` : "";
    section.append(el("h2", "", `group ${g}: ${first.question || ""}   answer: ${fmt(first.answer_aliases || first.answer)}   ` +
                                `mean R_T ${mean("R_T")}${turns}, R_O ${mean("R_O")}`));
    const details = el("details");
    details.append(el("summary", "", "prompt"), el("pre", "", first.prompt_text || ""));
    section.append(details, ...(first.prompt_images ? [thumbs(first.prompt_images)] : []), row);
    for (const [ep, e] of members) row.append(episodeCard(ep, e, scale));
    main.append(section);
    count += members.length;
  }
  $("count").textContent = `${count} of ${shown.length} episodes`;
}

function showTip(ev) {
  const t = ev.target.closest(".t"), tip = $("tip");
  if (!t || t.dataset.e === undefined) { tip.style.display = "none"; return; }
  const ep = shown[t.dataset.e], i = Number(t.dataset.i), tok = ep.tokens, at = (k) => tok[k] ? fmt(tok[k][i]) : "–";
  tip.textContent = [`token ${i}   id ${tok.ids[i]}   ${(tok.model_mask || tok.env_mask)[i] === 0 ? "environment" : "model"}`,
    `text      "${visible(String(tok.text[i] ?? ""))}"`, `advantage ${at("advantage")}`,
    `sampler logprob ${at("sampler_logprob")}`,
    `trainer logprob ${at("trainer_logprob")}`, `IS weight ${at("is_weight")}`].join("\n");
  tip.style.display = "block";
  tip.style.left = Math.min(ev.clientX + 12, innerWidth - tip.offsetWidth - 4) + "px";
  tip.style.top = Math.min(ev.clientY + 14, innerHeight - tip.offsetHeight - 4) + "px";
}

// `#KEY:E.I` in the URL shows the tooltip of token I of episode E (for a link or a screenshot).
function pinTip(pin) {
  const [e, i] = pin.split(".").map(Number), span = document.querySelector(`.t[data-e="${e}"][data-i="${i}"]`);
  if (!span) return;
  const r = span.getBoundingClientRect();
  span.classList.add("pinned");
  showTip({ target: span, clientX: r.right, clientY: r.bottom });
}

function setup() {
  const step = $("step"), stop = $("stop"), reward = $("reward");
  for (const mode of ["train", "eval"]) {
    const group = el("optgroup");
    group.label = mode;
    for (const s of INDEX.steps.filter((s) => s.key.startsWith(mode + "-")))
      group.append(new Option(`${mode} ${Number(s.key.split("-")[1])} (${s.episodes})`, s.key));
    if (group.children.length) step.append(group);
  }
  const reasons = [...new Set(INDEX.steps.flatMap((s) => s.stop_reasons))].sort();
  for (const r of reasons) stop.append(new Option(r, r));
  for (const r of INDEX.rewards) reward.append(new Option(r, r));
  const keys = INDEX.steps.map((s) => s.key), train = keys.filter((k) => k.startsWith("train-"));
  const [wanted, pin] = decodeURIComponent(location.hash.slice(1)).split(":");
  step.value = keys.includes(wanted) ? wanted : (train.length ? train[train.length - 1] : keys[0]);
  const move = (d) => {
    step.selectedIndex = Math.max(0, Math.min(step.options.length - 1, step.selectedIndex + d));
    render();
  };
  $("prev").onclick = () => move(-1);
  $("next").onclick = () => move(1);
  document.addEventListener("keydown", (ev) => {
    if (ev.target.tagName === "INPUT" || ev.target.tagName === "SELECT") return;
    if (ev.key === "ArrowLeft") move(-1);
    if (ev.key === "ArrowRight") move(1);
  });
  for (const id of ["step", "stop", "reward", "min", "max"]) $(id).addEventListener("input", render);
  $("groups").addEventListener("mouseover", showTip);
  $("groups").addEventListener("mouseleave", () => $("tip").style.display = "none");
  if (keys.length) {
    render();
    if (pin) pinTip(pin);
  } else $("groups").textContent = "No rollouts found in " + INDEX.run + "/rollouts.";
}
setup();
"""


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def parse_steps(text: str) -> tuple[int, int]:
    """"100-120" -> (100, 120); "7" -> (7, 7)."""
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the trainer's output_dir, holding rollouts/*.jsonl (or evaluate.py's, "
                        "holding eval_episodes.jsonl)")
    parser.add_argument("--out", help="the HTML file to write (default: RUN_DIR/rollouts.html)")
    parser.add_argument("--steps", type=parse_steps, help="only steps A-B (inclusive), train and eval; e.g. 100-120")
    parser.add_argument("--max-episodes-per-step", type=int, help="keep the first N episodes of each step (group order)")
    parser.add_argument("--digits", type=int, default=4, help="significant digits of embedded floats; 0 keeps them exact")
    args = parser.parse_args()
    page = build_page(args.run_dir, args.steps, args.max_episodes_per_step, args.digits)
    out = args.out or os.path.join(args.run_dir, "rollouts.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
