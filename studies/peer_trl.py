"""Side by side with TRL's own multi-turn tool training: TRL 1.16's `GRPOTrainer(tools=[search])`
against ours (`mt_grpo`; `outcome_only`, plain GRPO on the outcome reward; and `merged`, which is what TRL
computes here: one group-normalised advantage of the summed turn and outcome rewards on every model token),
on the same model, task, tool, prompts, rewards, seeds and step budget, each evaluated by our evaluation code
on the same test questions from step 0.

    .venv/bin/python studies/peer_trl.py --trainers trl mt_grpo -- --max_steps 10 --eval_steps 10  # studies/data/peer_trl_matched.*
    .venv/bin/python studies/peer_trl.py --trainers trl mt_grpo --seeds 1 --turn_caps 64 -- --max_steps 2

The per-turn cap is matched (`--turn_caps`, default 64 and none): TRL's tool loop takes one through
`generation_kwargs={"max_new_tokens": cap}`, which it applies to every turn, as ours takes `max_tokens_per_turn`;
without a cap ours may spend the whole completion budget in one turn, as TRL's default does. Each cap is its own
comparison: a trainer is named `<trainer> cap64` or `<trainer> nocap` in the outputs, and is evaluated with the
same cap.

What is shared, and how:
- the recipe: hf_recipes/SmolLM2-135M-Instruct/study.yaml (learning rate, loss type, episodes per step,
  temperature, lengths, seeds, step budget), plus the flags after `--`; both trainers get the same parsed
  GRPOConfig. TRL's tool loop runs up to `max_env_steps` tool rounds (`max_tool_calling_iterations`).
- the model: SmolLM2-135M-Instruct with Qwen2.5's tool-capable chat template (the one TRL ships and can
  parse; the special tokens are the same <|im_start|> / <|im_end|>), written once to outputs/peer_trl/model.
  Ours runs with `tool_format: chat_template`. Untrained, it makes no tool call under that template, so
  both trainers start from one warm start (`--warm_start N`, made once in outputs/peer_trl/warm-N): the
  model taught the call turn (a search for the question) of N training-split episodes, not the answer.
  The default, 4, leaves the first turn varied (it searches in about 2 of 3 held-out training questions and
  hits in 2 of 5), so that the turn reward differs within a group; 8 or more demonstrations make every
  first turn a hit, which leaves MT-GRPO's turn advantage nothing to act on (docs/results.md).
- the prompts: the same system prompt and few-shot exchange, in the same rendering (checked: TRL's
  prompt token ids equal our env's, or the run stops).
- the task and tool: the fictional KB's training split (the same question order: both trainers use
  TRL's sampler with the same seed) and its `search`.
- the rewards: TRL's one reward is the weighted sum of our turn and outcome reward functions (the same
  functions, on TRL's completions, which are the same message format).
- evaluation: our `run_evaluation` on the trained weights (TRL's model object is our evaluator's model).

What it measures, per trainer and seed, into outputs/peer_trl/w<N>/<cap>/<trainer>-s<seed>/peer.jsonl (N: the
warm start, so that runs from different starting models are never reported together): eval metrics
at step 0 (the warm start, greedy: evaluated once per cap and shared by its runs) and every `eval_steps`; each optimizer step's seconds, split into rollout (generation, tools,
rewards and advantages: `_generate_and_score_completions`) and training (the rest); peak RSS during
training steps (sampled every 0.1 s) and over the run; and the mask check: every trained row's loss mask
is split into runs, and each environment run (mask 0) must decode to exactly one template tool-reply
block, and each model run (mask 1) that precedes one must end at <|im_end|>. Writes OUT.csv and OUT.png as
the learning study does (the trainer in the `mode` column; the plot against steps and against minutes of
training), OUT_steps.csv (one row per run: mean step, rollout and training seconds, model tokens per episode
(both trainers log them as `completions/mean_length`: a step's cost follows what the policy writes, so read
the seconds beside it), peak RSS, rows checked, mask problems, the machine's mean 1-minute load during the
steps), and prints both tables. Run it alone on the machine (`--parallel 1`, the default) for seconds that
compare the trainers rather than the contention: the load column shows whether a run had it alone (about 2
on 2 cores).
"""

import argparse
import functools
import json
import math
import os
import re
import resource
import shutil
import sys
import threading
import time

import learning_study as study
from common import ROOT, SMOLLM2, print_table, rss, write_rows_csv
from learning_study import finished, run_all, stopped_early
from plot_runs import load_log_history  # scripts/, put on the path by learning_study

RECIPE = os.path.join(ROOT, "hf_recipes", "SmolLM2-135M-Instruct", "study.yaml")
# TRL's one reward is the sum of ours, so its advantage is our `merged` one (GRPO-MR): that pair compares
# two implementations of one algorithm, and `mt_grpo` against both what the turn-level credit adds.
TRAINERS = ("trl", "mt_grpo", "outcome_only", "merged")
# One template tool-reply block of Qwen2.5's template (what follows a model turn that ended at <|im_end|>):
# the tool messages in one user turn, then the next generation prompt. A turn cut at a token limit gets
# its <|im_end|> from the environment, so that may lead the block.
TOOL_BLOCK = re.compile(r"(<\|im_end\|>)?\n<\|im_start\|>user(\n<tool_response>\n.*?\n</tool_response>)+"
                        r"<\|im_end\|>\n<\|im_start\|>assistant\n", re.DOTALL)


# -- the shared model --------------------------------------------------------------------------------
def peer_model_dir(out: str, source: str = SMOLLM2) -> str:
    """`source` with Qwen2.5's chat template (TRL's copy), once."""
    from trl.chat_template_utils import qwen2_5_chat_template

    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        if not os.path.isfile(os.path.join(source, "model.safetensors")):
            raise SystemExit(f"No model at {source}: run `bash scripts/setup.sh` first (it converts SmolLM2).")
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(source):
            if os.path.isfile(os.path.join(source, name)) and name != "chat_template.jinja":
                shutil.copy(os.path.join(source, name), out)
        with open(os.path.join(out, "chat_template.jinja"), "w") as f:
            f.write(qwen2_5_chat_template)
    return out


def call_example(env, prompt: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, labels) of `prompt` followed by the model's turn that searches for the question; the
    labels leave out the prompt (-100), so only the turn is taught."""
    call = {"role": "assistant", "content": env.protocol.format_call("search", {"query": prompt[-1]["content"]})}
    start, ids = env.render_ids(prompt, add_generation_prompt=True), env.render_ids(prompt + [call])
    if ids[: len(start)] != start:
        raise SystemExit("The template does not render the call as a continuation of the prompt.")
    return ids, [-100] * len(start) + ids[len(start) :]


def warm_start(out: str, source: str, recipe: str, demos: int, learning_rate: float = 1e-5) -> str:
    """`source` fine-tuned once on the first turn of `demos` training-split episodes: the call the few-shot
    exchange makes, a search for the question, in the template's format. Untrained SmolLM2 makes no call
    under this template (docs/results.md) while it makes some under our XML protocol, so both trainers start
    from a model that calls the tool sometimes. Only the call is taught, not the answer: copying the
    answer out of the result is what the trainers are compared on. (Demonstrating whole episodes, 64 at
    this learning rate, gave exact match 0.78 on held-out training questions before any RL.) Writes
    warm_start.json: tool calls, first-search hit and exact match of greedy episodes on 32 training
    questions the warm start did not see (the test split is not looked at)."""
    import torch

    from mt_grpo_trainer import build_trainer

    if os.path.isfile(os.path.join(out, "warm_start.json")):
        return out
    ours = build_trainer(["--config", recipe, "--tool_format", "chat_template", "--model_name_or_path", source,
                          "--output_dir", out, "--eval_strategy", "no"])
    env, model, tokenizer = ours.env, ours.model, ours.env.tokenizer
    rows = ours.train_dataset.shuffle(seed=0)
    held_out, taught = rows.select(range(32)), rows.select(range(32, 32 + demos))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    for row in taught:  # one epoch, one episode per step
        ids, labels = call_example(env, row["prompt"])
        model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    metrics = ours.run_evaluation(held_out)[0]
    after = {k: metrics[k] for k in ("eval/tool_calls_per_episode", "eval/first_search_hit", "eval/exact_match",
                                     "eval/answered_ratio")}
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "warm_start.json"), "w") as f:
        json.dump({"source": source, "demos": demos, "learning_rate": learning_rate, "taught": "the call turn",
                   "held_out_train_questions": 32, "after": after}, f, indent=1)
    print(f"warm start on the calls of {demos} episodes: {after}")
    return out


# -- the checks --------------------------------------------------------------------------------------
def mask_problems(tokenizer, ids: list[int], loss_mask: list[int], eos_id: int) -> list[str]:
    """What is wrong with one row's loss mask (1 = trained), [] if nothing: the row is split into runs of
    equal mask, and
    - every environment run (0) must be exactly one tool-reply block of the template;
    - a model run (1) holds <|im_end|> only as its last token (both trainers end a turn there; anything
      after it in the same run was not sampled in that turn);
    - a model run followed by the environment ended its turn at <|im_end|>, or the block starts with the
      <|im_end|> that closes a turn cut at a token limit (so a model's own <|im_end|> counted as the
      environment's is the one leak this check cannot tell apart)."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or loss_mask[i] != loss_mask[start]:
            runs.append((loss_mask[start], ids[start:i]))
            start = i
    problems = []
    for k, (trained, run) in enumerate(runs):
        if not trained:
            text = tokenizer.decode(run, skip_special_tokens=False)
            if not TOOL_BLOCK.fullmatch(text):
                problems.append(f"environment run {k} is not one tool-reply block: {text[:120]!r}")
            continue
        if eos_id in run[:-1]:
            problems.append(f"model run {k} goes on past its end of turn: "
                            f"{tokenizer.decode(run[run.index(eos_id):], skip_special_tokens=False)[:120]!r}")
        if k + 1 < len(runs) and run[-1] != eos_id and runs[k + 1][1][0] != eos_id:
            problems.append(f"model run {k} is followed by the environment but did not end its turn")
    return problems


class MaskCheck:
    """Wraps a trainer's `_compute_loss`: every row it trains goes through `mask_problems`."""

    def __init__(self, trainer):
        self.trainer, self.rows, self.env_runs, self.problems = trainer, 0, 0, []
        inner = trainer._compute_loss

        def checked(model, inputs):
            mask = (inputs["completion_mask"] * inputs.get("tool_mask", inputs["completion_mask"])).tolist()
            for ids, row, length in zip(inputs["completion_ids"].tolist(), mask,
                                        inputs["completion_mask"].sum(dim=1).tolist()):
                self.rows += 1
                self.env_runs += sum(1 for a, b in zip([1] + row[:length], row[:length]) if a == 1 and b == 0)
                self.problems += mask_problems(trainer.processing_class, ids[:length], row[:length],
                                               trainer.processing_class.eos_token_id)[:2]
            return inner(model, inputs)

        trainer._compute_loss = checked


class PeakRSS:
    """Peak resident memory per window ('train' inside optimizer steps, 'eval' otherwise), sampled by a
    thread every 0.1 s from /proc (ru_maxrss cannot be reset between windows)."""

    def __init__(self):
        self.window, self.peak = "eval", {"train": 0, "eval": 0}
        threading.Thread(target=self._sample, daemon=True).start()

    rss = staticmethod(rss)

    def _sample(self):
        while True:
            self.peak[self.window] = max(self.peak[self.window], self.rss())
            time.sleep(0.1)


def timed(fn, into: list):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    return wrapper


# -- one run: a worker process -------------------------------------------------------------------------
def cap_flags(recipe: str, flags: list[str], turn_cap: int) -> list[str]:
    """`flags` with our per-turn cap set: `turn_cap` tokens, or the whole completion budget when 0 (no cap)."""
    from mt_grpo_trainer import parse_args

    budget = parse_args(["--config", recipe, *flags])[1].max_completion_length
    return [*flags, "--max_tokens_per_turn", str(turn_cap or budget)]


def run_one(trainer_name: str, seed: int, out: str, model: str, recipe: str, flags: list[str],
            turn_cap: int = 0) -> None:
    """Train one trainer for the recipe's steps, writing peer.jsonl in `out`. `turn_cap`: tokens per model
    turn for both trainers (ours: `max_tokens_per_turn`; TRL: `generation_kwargs={"max_new_tokens": cap}`,
    which its tool loop applies to every turn); 0: no cap (ours: the whole completion budget; TRL: its default).
    The evaluation runs our env with the same cap, so both trainers of one cap are evaluated alike."""
    from transformers import TrainerCallback

    from transformers.trainer_utils import get_last_checkpoint

    from mt_grpo_trainer import build_trainer
    from mt_grpo.run.reporting import GracefulStop

    flags = cap_flags(recipe, flags, turn_cap)
    argv = ["--config", recipe, "--tool_format", "chat_template", "--model_name_or_path", model,
            "--seed", str(seed), "--output_dir", out, "--save_strategy", "steps", "--save_total_limit", "1",
            "--advantage_mode", "outcome_only" if trainer_name == "trl" else trainer_name,
            # the study's outcome rewards, with the format reward of the chat_template protocol (the xml one
            # would score every call as malformed)
            "--outcome_reward_funcs", "exact_match_reward_func", "exist_answer_reward_func", "chat_format_reward_func",
            *flags,
            "--eval_strategy", "no"]  # evaluation is ours, called below, for both trainers
    ours = build_trainer(argv, evaluation=True)
    eval_steps = int(ours.args.eval_steps or 10)
    ours.args.save_steps = eval_steps
    trainer = ours if trainer_name != "trl" else trl_trainer(ours, argv, turn_cap)
    record_path = os.path.join(out, "peer.jsonl")
    resume = get_last_checkpoint(out) if stopped_early(out) else None
    done = set()
    if resume and os.path.isfile(record_path):
        with open(record_path) as f:
            done = {r["step"] for r in map(json.loads, f) if r["kind"] == "eval"}
    rss, mask = PeakRSS(), MaskCheck(trainer)
    rollout: list[float] = []
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, rollout)

    def write(record: dict) -> None:
        with open(record_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # Step 0 is the warm start under greedy decoding, the same for every trainer and seed of one cap: evaluated
    # by the first run of that cap, and read by the others (the file sits in the cap's folder)
    step0 = os.path.join(os.path.dirname(out), "eval-step-0.json")

    def evaluate(step: int) -> None:
        if step in done:
            return
        rss.window = "eval"
        if step == 0 and os.path.isfile(step0):
            with open(step0) as f:
                metrics = json.load(f)
        else:
            metrics, records = ours.run_evaluation()
            ours.write_records(f"eval-step-{step:06d}.jsonl", records, folder=out)  # view_rollouts.py reads them
            if step == 0:
                with open(step0, "w") as f:
                    json.dump(metrics, f)
        write({"kind": "eval", "step": step, "metrics": metrics})
        done.add(step)

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if not resume:  # a resumed run evaluated step 0 before it stopped
                evaluate(0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, rss.window = time.perf_counter(), "train"
            rollout.clear()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.t0
            write({"kind": "step", "step": state.global_step, "seconds": seconds, "rollout_seconds": sum(rollout),
                   "load_1min": os.getloadavg()[0],  # the machine's load: what else ran beside this run
                   "peak_rss_train": rss.peak["train"], "mask_rows": mask.rows, "mask_env_runs": mask.env_runs,
                   "mask_problems": mask.problems[:5]})
            rss.window = "eval"
            if state.global_step % eval_steps == 0 or state.global_step == args.max_steps:
                evaluate(state.global_step)

    trainer.add_callback(Recorder())
    if trainer is not ours:
        trainer.add_callback(GracefulStop(trainer))
    trainer.train(resume_from_checkpoint=resume)
    write({"kind": "end", "peak_rss_train": rss.peak["train"], "peak_rss_eval": rss.peak["eval"],
           "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "mask_rows": mask.rows,
           "mask_env_runs": mask.env_runs,
           "mask_problems": mask.problems[:20]})
    trainer.save_state()  # trainer_state.json at max_steps: `finished`


def cut_as_ours(env, tool):
    """`tool` whose output is cut to the recipe's `max_tool_response_tokens`, as our env cuts it, so that both
    trainers' models see the same results. TRL passes a tool's whole output on, and drops a result that
    would pass `max_completion_length` (the episode then ends at the call, unanswered): with the study's
    3 whole search results that happened to most of TRL's episodes (measured: completions of 36-40 tokens,
    the call alone, in 2 of each 3 steps). The same name, docstring and signature, so TRL's schema and
    prompt stay the same (the prompt-equality check below would stop the run otherwise)."""

    @functools.wraps(tool)
    def cut(*args, **kwargs):
        return env.truncate_tool_output(str(tool(*args, **kwargs)))

    return cut


def trl_trainer(ours, argv: list[str], turn_cap: int = 0):
    """TRL's GRPOTrainer on our evaluator's model object, with the recipe's GRPOConfig, our tools, our
    reward functions as one weighted sum, and our prompts as TRL renders them. `turn_cap` > 0 caps every
    turn of TRL's tool loop at that many new tokens: `generation_kwargs` overrides `max_new_tokens` in the
    GenerationConfig that each of its turns uses (after a tool reply TRL still trims the whole completion
    to `max_completion_length`)."""
    from trl import GRPOTrainer

    from mt_grpo_trainer import parse_args

    script_args, args, _ = parse_args(argv)  # a config of its own: TRL reads and sets fields on it
    args.max_tool_calling_iterations = script_args.max_env_steps
    if turn_cap:
        args.generation_kwargs = {**(args.generation_kwargs or {}), "max_new_tokens": turn_cap}
    args.save_steps = ours.args.save_steps  # a checkpoint at each evaluation, to resume from, as ours
    args.reward_weights = [*ours.turn_weights.tolist(), *ours.outcome_weights.tolist()]
    env = ours.env
    dataset = ours.train_dataset
    dataset = dataset.remove_columns("prompt").add_column(
        "prompt", [env.protocol.template_messages(p) for p in dataset["prompt"]])
    trainer = GRPOTrainer(model=ours.model, reward_funcs=[*ours.turn_reward_funcs, *ours.outcome_reward_funcs],
                          args=args, train_dataset=dataset, processing_class=env.tokenizer,
                          tools=[cut_as_ours(env, tool) for tool in env.tools.values()])
    if trainer.model is not ours.model:
        raise SystemExit("TRL wrapped the model: our evaluation would not see its weights.")
    # The same prompt tokens as ours, or the comparison is not of the same task.
    theirs = trainer._tokenize_prompts([dataset[0]["prompt"]])[0][0]
    mine = env.render_ids(ours.train_dataset[0]["prompt"], add_generation_prompt=True)
    if list(theirs) != list(mine):
        raise SystemExit(f"TRL renders the prompt differently from our env ({len(theirs)} vs {len(mine)} tokens):\n"
                         f"TRL:  {env.tokenizer.decode(theirs)[-400:]!r}\nours: {env.tokenizer.decode(mine)[-400:]!r}")
    return trainer


# -- the study ---------------------------------------------------------------------------------------
def command(trainer_name: str, seed: int, path: str, flags: list[str], model: str, recipe: str = RECIPE,
            turn_cap: int = 0) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", trainer_name, "--seed", str(seed),
            "--output_dir", path, "--model", model, "--recipe", recipe, "--turn_cap", str(turn_cap), "--", *flags]


def cap_folder(turn_cap: int) -> str:
    return f"cap{turn_cap}" if turn_cap else "nocap"


def read_run(path: str) -> list[dict]:
    with open(os.path.join(path, "peer.jsonl")) as f:
        return [json.loads(line) for line in f]


def collect(jobs: list[tuple[str, int, str]]) -> tuple[list[dict], list[dict]]:
    """(one row per run and evaluation, one row per run)."""
    evals, runs = [], []
    for name, seed, path in jobs:
        records = read_run(path)
        steps = [r for r in records if r["kind"] == "step"]
        minutes = {0: 0.0}
        for r in steps:
            minutes[r["step"]] = minutes[max(minutes)] + r["seconds"] / 60
        for r in records:  # rows as the learning study writes them, with the trainer as the mode
            if r["kind"] == "eval":
                evals.append({"mode": name, "seed": seed, "step": r["step"], "minutes": minutes.get(r["step"], math.nan),
                              **{m: r["metrics"].get(m, math.nan) for m in study.METRICS}})
        ends = [r for r in records if r["kind"] == "end"]
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
        # both trainers log model tokens per episode under TRL's name (ours: reporting.py)
        logged = [h["completions/mean_length"] for h in load_log_history(path) if "completions/mean_length" in h]
        runs.append({"trainer": name, "seed": seed, "steps": len(steps),
                     "step_s": mean([r["seconds"] for r in steps]),
                     "rollout_s": mean([r["rollout_seconds"] for r in steps]),
                     "train_s": mean([r["seconds"] - r["rollout_seconds"] for r in steps]),
                     "model_tokens_per_episode": mean(logged),
                     # runs alone on 2 cores read about 2; more means other work shared the cores
                     "load_1min": mean([r.get("load_1min", math.nan) for r in steps]),
                     "peak_rss_train_gib": max([r["peak_rss_train"] for r in steps], default=0) / 2**30,
                     "max_rss_gib": max([e["max_rss"] for e in ends], default=math.nan) / 2**30,
                     "mask_rows": steps[-1]["mask_rows"] if steps else 0,
                     "mask_env_runs": steps[-1]["mask_env_runs"] if steps else 0,
                     # each record holds the run's problems so far (the first 5, the end record's first 20)
                     "mask_problems": max((len(r["mask_problems"]) for r in records if "mask_problems" in r),
                                          default=0)})
    return evals, runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (they share the cores)")
    ap.add_argument("--runs", default=os.path.join(ROOT, "outputs", "peer_trl"), help="folder of the runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "studies", "data", "peer_trl_matched"),
                    help="OUT.csv, OUT_steps.csv, OUT.png (studies/data/peer_trl.*: the first, unmatched comparison)")
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2 with Qwen2.5's template, "
                    "made in --runs/model)")
    ap.add_argument("--recipe", default=RECIPE, help="the shared recipe (default: the learning study's)")
    ap.add_argument("--warm_start", type=int, default=4, help="both trainers start from the model taught the "
                    "call turn of this many training-split episodes (made once in --runs/warm-N; the runs go to "
                    "--runs/wN); 0: the untrained model, which makes no tool call under this template; 8 or more: "
                    "every first turn searches and hits, so turn credit has nothing to act on")
    ap.add_argument("--turn_caps", nargs="+", type=int, default=[64, 0], help="tokens per model turn, for both "
                    "trainers (ours: max_tokens_per_turn; TRL: generation_kwargs max_new_tokens); 0: no cap. Each cap's "
                    "runs go to --runs/wN/cap<C> (or nocap), its trainers named `<trainer> cap<C>` in the outputs")
    ap.add_argument("--fresh", action="store_true", help="redo runs that already finished")
    ap.add_argument("--report", action="store_true", help="run nothing: write the outputs from the runs that finished")
    ap.add_argument("--deadline", type=float, help="seconds; then running runs stop after their step (SIGTERM)")
    ap.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--turn_cap", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--output_dir", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    model = args.model or peer_model_dir(os.path.join(args.runs, "model"))
    if args.warm_start and not args.worker:
        model = warm_start(os.path.join(args.runs, f"warm-{args.warm_start}"), model, args.recipe, args.warm_start)
    if args.worker:
        return run_one(args.worker, args.seed, args.output_dir, model, args.recipe, flags, args.turn_cap)
    # seed by seed, each cap's trainers in turn, so that a drift in the machine's speed reaches every trainer
    runs_of = {os.path.join(args.runs, f"w{args.warm_start}", cap_folder(cap), f"{name}-s{seed}"): (name, cap)
               for seed in args.seeds for cap in args.turn_caps for name in args.trainers}
    jobs = [(f"{name} {cap_folder(cap)}", seed, path) for path, (name, cap) in runs_of.items()
            for seed in [int(path.rpartition("-s")[2])]]
    todo = [] if args.report else [j for j in jobs if args.fresh or not finished(j[2])]
    for _, _, path in todo if args.fresh else []:
        shutil.rmtree(path, ignore_errors=True)
    start = time.monotonic()
    failed = run_all(todo, flags, args.parallel, args.deadline,
                     command_fn=lambda _, seed, path, f: command(runs_of[path][0], seed, path, f, model, args.recipe,
                                                                 runs_of[path][1]))
    evals, runs = collect([j for j in jobs if finished(j[2])])
    if evals:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        study.write_csv(evals, args.out + ".csv")
        write_rows_csv(runs, args.out + "_steps.csv")
        study.plot(evals, args.out + ".png", "SmolLM2-135M-Instruct (Qwen2.5 template) on the fictional KB: TRL's "
                                             "tool loop and ours, mean over seeds")
        study.summary(evals)
        print_table("Cost per optimizer step (mean over steps)", list(runs[0]), [list(r.values()) for r in runs])
    print(f"\n{len(todo)} runs in {(time.monotonic() - start) / 60:.1f} min; wrote {args.out}.csv, "
          f"{args.out}_steps.csv and {args.out}.png")
    if failed:
        raise SystemExit(f"{len(failed)} runs failed; their logs: {[f + '/log.txt' for f in failed]}")



if __name__ == "__main__":
    main()
