"""Evaluation: eval/... metrics against episodes checked by hand (scripted policy, greedy and pass@k,
1 and 2 processes); eval_strategy in a real training run, with recorded rollouts; the stand-alone
evaluation command on a saved model."""

import json
import os
import subprocess
import sys

import pytest

import run_trainer
from helpers import RECIPE, ROOT, launch, rollout_records, run, xml_answer, xml_call

E1, E2, E3 = "What is the capital of Veltria?", "Who founded the city of Morvane?", "What is the main river of Veltria?"


# Variant 0 is what a greedy evaluation (one episode per question) plays; pass@2 plays both.
SCRIPT = {
    E1: [[xml_call("Veltria"), xml_answer("Morvane")], [xml_answer("Paris")]],
    E2: [[xml_answer("Bob")], [xml_answer("Bob")]],
    E3: [[xml_call("river", "lookup"), "I am not sure."], [xml_call("Veltria river"), xml_answer("Tifex")]],
}
# greedy: E1 searched (answer in the result) and is right; E2 answered wrong without a call; E3's one
# call failed (unknown tool) and it never answered.
GREEDY = {"eval/exact_match": 1 / 3, "eval/answered_ratio": 2 / 3, "eval/tool_calls_per_episode": 2 / 3,
          "eval/tool_success_rate": 1 / 2, "eval/first_search_hit": 1 / 3, "eval/episodes": 3}
# pass@2 adds E1 "Paris" (wrong, no call), E2 "Bob" again, E3 search + "Tifex" (right, hit): 6 episodes.
PASS_AT_2 = {"eval/exact_match": 2 / 6, "eval/pass@2": 2 / 3, "eval/answered_ratio": 5 / 6,
             "eval/tool_calls_per_episode": 3 / 6, "eval/tool_success_rate": 2 / 3, "eval/first_search_hit": 2 / 6,
             "eval/episodes": 6}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval-task")
    rows = [(E1, "Morvane"), (E2, "Ada Lovelace"), (E3, ["Tifex River", "Tifex"])]
    (d / "eval.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    (d / "train.jsonl").write_text(json.dumps({"question": E1, "answer": "Morvane"}) + "\n")
    (d / "corpus.jsonl").write_text(json.dumps({"title": "Veltria", "text": "Veltria is a country. Its capital is "
                                                "Morvane. Its main river is the Tifex River."}) + "\n")
    return d


def evaluate(tiny_agent_dir, files, tmp_path, processes, *flags):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"script": SCRIPT}))
    out = tmp_path / "dump"
    flags = ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path / "out"),
             "--dataset_name", str(files / "train.jsonl"), "--eval_dataset_name", str(files / "eval.jsonl"),
             "--corpus_path", str(files / "corpus.jsonl"), "--max_completion_length", "512", "--max_tokens_per_turn",
             "128", "--max_tool_response_tokens", "64", *flags]
    if processes == 1:  # the same script's function, in this process: no interpreter to start
        run_trainer.evaluate(str(spec), str(out), flags)
    else:
        run([*launch(processes), "tests/run_trainer.py", "eval", str(spec), str(out), *flags], tmp_path)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(processes)]
    return json.loads((out / "metrics.json").read_text()), ranks


def check(metrics, expected):
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key


def test_greedy_metrics_by_hand(tiny_agent_dir, files, tmp_path):
    metrics, (rank,) = evaluate(tiny_agent_dir, files, tmp_path, 1)
    check(metrics, GREEDY)
    assert "eval/pass@1" not in metrics
    assert metrics["eval/rewards/outcome/exact_match_reward_func"] == pytest.approx(1 / 3)
    by_question = {r["question"]: r for r in rank["records"]}
    assert by_question[E3]["stop_reason"] == "no_action" and by_question[E3]["tool_calls"][0]["ok"] is False
    assert [t["role"] for t in by_question[E1]["turns"]] == ["model", "env", "model"]


def test_pass_at_k_with_sampled_episodes(tiny_agent_dir, files, tmp_path):
    metrics, _ = evaluate(tiny_agent_dir, files, tmp_path, 1, "--num_generations_eval", "2",
                          "--per_device_eval_batch_size", "4")  # two rollouts of 2 questions x 2 episodes
    check(metrics, PASS_AT_2)


def test_two_processes_share_the_questions_and_run_the_same_rounds(tiny_agent_dir, files, tmp_path):
    metrics, ranks = evaluate(tiny_agent_dir, files, tmp_path, 2)
    check(metrics, GREEDY)
    assert sorted(r["question"] for rank in ranks for r in rank["records"]) == sorted([E1, E2, E3])
    assert [rank["rounds"] for rank in ranks] == [2, 2]  # rank 1's one question ends after one round


def test_eval_strategy_logs_from_step_zero_records_rollouts_and_keeps_the_best_model(tiny_agent_dir, tmp_path):
    """A real run: eval before the first step and after each; every rollout and eval recorded; the
    viewer turns the records into a page. Greedy evaluation (the default) takes any eval batch size (here 3; TRL's
    check wants one divisible by num_generations), and `metric_for_best_model` may name an eval metric as it is
    logged."""
    out = tmp_path / "out"
    run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", tiny_agent_dir,
         "--output_dir", str(out), "--eval_strategy", "steps", "--eval_steps", "1", "--eval_max_samples", "3",
         "--per_device_eval_batch_size", "3", "--save_strategy", "steps", "--save_steps", "1",
         "--load_best_model_at_end", "true", "--metric_for_best_model", "eval/first_search_hit",
         "--save_rollouts_steps", "1"], tmp_path)
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval/exact_match" in h]
    assert [h["step"] for h in evals] == [0, 1, 2] and all(h["eval/episodes"] == 3 for h in evals)
    for key in ("eval/answered_ratio", "eval/tool_calls_per_episode", "eval/first_search_hit",
                "eval/rewards/outcome/exact_match_reward_func"):
        assert all(key in h for h in evals), key
    assert state["best_metric"] == max(h["eval/first_search_hit"] for h in evals[1:])
    assert os.path.isdir(state["best_model_checkpoint"])
    files = sorted(os.listdir(out / "rollouts"))
    assert files == ["eval-step-000000.jsonl", "eval-step-000001.jsonl", "eval-step-000002.jsonl",
                     "step-000001.jsonl", "step-000002.jsonl"]
    records = rollout_records(out)
    assert len(records) == 8 and {r["group"] for r in records} == {0, 1}
    for r in records:
        tokens = r["tokens"]
        assert len(tokens["ids"]) == len(tokens["text"]) == len(tokens["model_mask"]) == len(tokens["advantage"])
        assert r["turns"][0]["start"] == 0 and r["turns"][-1]["end"] == len(tokens["ids"])
        # mt_grpo: model tokens before the first <result> get A_O + A_T, later ones A_O
        for t, (a, m) in enumerate(zip(tokens["advantage"], tokens["model_mask"])):
            if m:
                assert a == pytest.approx(r["A_O"] + (r["A_T"] if t < r["first_result"] else 0.0), abs=1e-5)
    html = out / "rollouts.html"
    subprocess.run([sys.executable, "scripts/view_rollouts.py", str(out)], cwd=ROOT, check=True, timeout=120)
    assert html.stat().st_size > 10_000


def test_evaluation_command_on_a_saved_model(tiny_agent_dir, tmp_path):
    out = tmp_path / "eval"
    run([sys.executable, "scripts/evaluate.py", "--config", RECIPE, "--model_name_or_path", tiny_agent_dir,
         "--output_dir", str(out), "--eval_max_samples", "3"], tmp_path)
    summary = json.loads((out / "eval_summary.json").read_text())
    assert summary["metrics"]["eval/episodes"] == 3 and "eval/exact_match" in summary["metrics"]
    episodes = [json.loads(line) for line in (out / "eval_episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 and all(e["mode"] == "eval" and e["answer"] for e in episodes)
