"""The trainer's real scoring path (rollout -> rewards -> advantages -> batch) with a scripted policy,
under 1 and 2 processes, against advantages computed by hand; and lock-step generation rounds: a rank
whose episodes end early still joins every round (ZeRO-3 gathers parameters at each)."""

import json
import math

import pytest
from transformers import AutoTokenizer

import run_trainer
from helpers import RECIPE, launch, run, xml_answer, xml_call

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models, scored and trained in this process

QA, QB = "What is the capital of Veltria?", "Who founded the city of Morvane?"


# QA: four one-turn answers, two right. QB: two env steps then an answer (three rounds).
SCRIPT = {
    QA: [[xml_answer("Morvane", "a")], [xml_answer("Paris", "b")], [xml_answer("Morvane", "c")],
         [xml_answer("Lyon", "d")]],
    QB: [[xml_call("Morvane", why="a"), xml_call("founder Morvane", why="a2"), xml_answer("Ada Lovelace", "done")],
         [xml_call("Morvane", why="b"), xml_call("Morvane", "lookup", "b2"), xml_answer("Bob", "done")],
         [xml_call("Morvane", "lookup", "c"), xml_call("founder", "lookup", "c2"), xml_answer("Ada Lovelace", "done")],
         [xml_call("Morvane", why="d"), xml_call("Morvane city", why="d2"), xml_answer("Grace", "done")]],
}
# Rewards: turn = tool_execution_reward_func (0.2 x successful / calls), outcome = exact match.
#   QA: R_T = 0 0 0 0 (no call)             R_O = 1 0 1 0
#   QB: R_T = 0.2 0.1 0.0 0.2               R_O = 1 0 1 0
# A_O (both groups): R_O has mean 0.5 and sample std sqrt(1/3): +-0.5 * sqrt(3)
# A_T (QB): mean 0.125; deviations .075 -.025 -.125 .075; sample variance .0275 / 3
A_O = [0.5 * math.sqrt(3), -0.5 * math.sqrt(3)] * 2
STD_T = math.sqrt(0.0275 / 3)
A_T = {QA: [0.0] * 4, QB: [d / STD_T for d in (0.075, -0.025, -0.125, 0.075)]}


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("task")
    (d / "data.jsonl").write_text(json.dumps({"question": QA, "answer": "Morvane"}) + "\n"
                                  + json.dumps({"question": QB, "answer": ["Ada Lovelace", "Lovelace"]}) + "\n")
    (d / "corpus.jsonl").write_text(
        json.dumps({"title": "Veltria", "text": "Veltria is a country. Its capital is Morvane."}) + "\n"
        + json.dumps({"title": "Morvane", "text": "Morvane is a city. It was founded by Ada Lovelace."}) + "\n")
    return d


def score(tiny_agent_dir, task_files, tmp_path, processes: int, rows: list[list[int]]):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"script": SCRIPT, "rows": rows}))
    out = tmp_path / "dump"
    flags = ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path / "out"),
             "--dataset_name", str(task_files / "data.jsonl"), "--corpus_path", str(task_files / "corpus.jsonl"),
             "--turn_reward_funcs", "tool_execution_reward_func", "--outcome_reward_funcs", "exact_match_reward_func",
             "--max_completion_length", "512", "--max_tokens_per_turn", "128", "--max_tool_response_tokens", "64",
             "--tokenization_check", "strict", "--per_device_train_batch_size", str(8 // processes)]
    if processes == 1:  # the same script's function, in this process: no interpreter to start
        run_trainer.score(str(spec), str(out), flags)
    else:
        run([*launch(processes), "tests/run_trainer.py", "score", str(spec), str(out), *flags], tmp_path)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(processes)]


def check_group(dump, row_offset: int, question: str, tokenizer):
    for j in range(4):
        adv, mask = dump["advantages"][row_offset + j], dump["loss_mask"][row_offset + j]
        first = len(tokenizer.encode(SCRIPT[question][j][0], add_special_tokens=False))
        model_positions = [t for t, m in enumerate(mask) if m]
        assert model_positions[:first] == list(range(first))  # the first turn opens the completion
        for t in model_positions:
            expected = A_O[j] + (A_T[question][j] if t < first else 0.0)
            assert adv[t] == pytest.approx(expected, abs=1e-5), (question, j, t)


def test_one_process(tiny_agent_dir, task_files, tmp_path):
    (dump,) = score(tiny_agent_dir, task_files, tmp_path, 1, [[0, 1]])
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    check_group(dump, 0, QA, tokenizer)
    check_group(dump, 4, QB, tokenizer)
    assert dump["rounds"] == 3


def test_two_processes_score_their_local_slice_and_run_the_same_rounds(tiny_agent_dir, task_files, tmp_path):
    rank0, rank1 = score(tiny_agent_dir, task_files, tmp_path, 2, [[0], [1]])
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    check_group(rank0, 0, QA, tokenizer)
    check_group(rank1, 0, QB, tokenizer)
    # rank 0's episodes all ended after one turn, rank 1's after three: rank 0 still joined rounds 2 and 3
    assert rank0["generate_calls"] == [[1, 4]] and rank0["rounds"] == 3
    assert rank1["generate_calls"] == [[1, 4], [4, 1], [4, 1]] and rank1["rounds"] == 3


QC = "What is the currency of Veltria?"
SIGNAL_SCRIPT = {QA: [[xml_answer(a, "done")] for a in ("Morvane", "Paris, a city far away", "Morvane", "Lyon")],
                 QC: [[xml_answer("gold", "done")]] * 4}  # all four equally wrong: no signal


def signal_trainer(tiny_agent_dir, task_files, tmp_path, *flags, extra_rows: int = 0):
    """The trainer on QA (a group with signal) and QC (none), with `extra_rows` more copies of QC in the dataset;
    returns it and the batch of one generation batch: QA's group, then QC's."""
    from mt_grpo_trainer import build_trainer
    from scripted_policy import ScriptedTransformersBackend

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": QA, "answer": "Morvane"}) + "\n"
                    + (json.dumps({"question": QC, "answer": "veltrian mark"}) + "\n") * (1 + extra_rows))
    trainer = build_trainer(
        ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path / "out"),
         "--dataset_name", str(data), "--corpus_path", str(task_files / "corpus.jsonl"),
         "--outcome_reward_funcs", "exact_match_reward_func", "--turn_reward_funcs", "tool_execution_reward_func",
         "--max_completion_length", "256", *flags],
        backend_factory=lambda env: ScriptedTransformersBackend(env.tokenizer, SIGNAL_SCRIPT))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the test calls the loss directly
    batch = trainer._generate_and_score_completions([dict(trainer.train_dataset[i]) for i in (0, 1) for _ in range(4)])
    return trainer, batch


@pytest.mark.parametrize("loss_type, mask", [("dapo", True), ("dapo", False), ("bnpo", False), ("dr_grpo", True),
                                             ("dr_grpo", False)])  # bnpo with masking is refused (below)
def test_groups_without_signal_leave_the_loss_and_its_normaliser(tiny_agent_dir, task_files, tmp_path, mask, loss_type):
    """Policy ratio 1, so each loss is -sum(A over loss tokens) / its normaliser. QA's group has signal
    (R_O 1 0 1 0); QC's rewards are all equal, so its advantages are 0: with masking its tokens (dapo)
    or rows (dr_grpo) leave the normaliser, and nothing else changes (the loss mask keeps every model token)."""
    trainer, batch = signal_trainer(tiny_agent_dir, task_files, tmp_path, "--loss_type", loss_type,
                                    "--mask_zero_advantage_groups", str(mask).lower())
    loss = trainer._compute_loss(trainer.model, batch).item()

    tokenizer = trainer.processing_class
    n = [len(tokenizer.encode(v[0], add_special_tokens=False)) for v in SIGNAL_SCRIPT[QA]]  # QA episode lengths
    n_qc = len(tokenizer.encode(SIGNAL_SCRIPT[QC][0][0], add_special_tokens=False))
    a = 0.5 * math.sqrt(3)  # A_O = +-a in QA's group, A_T = 0 (no tool call)
    numerator = a * (n[0] - n[1] + n[2] - n[3])
    denominator = {"dapo": sum(n) + (0 if mask else 4 * n_qc), "bnpo": sum(n) + 4 * n_qc,
                   "dr_grpo": (4 if mask else 8) * 256}[loss_type]
    assert batch["num_items_in_batch"].item() == sum(n) + 4 * n_qc  # every model token stays in the loss mask
    assert (batch["completion_mask"] * batch["tool_mask"]).sum().item() == sum(n) + 4 * n_qc
    assert loss == pytest.approx(-numerator / denominator, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo"])
def test_masking_gives_one_gradient_whatever_the_micro_batch_layout(tiny_agent_dir, task_files, tmp_path, loss_type):
    """Two micro-batches of 4 rows accumulated (gradient_accumulation_steps = steps_per_generation = 2), rows
    0-3 (QA) with signal, 4-7 (QC) without. Laid out {0-3}, {4-7} or {0, 1, 4, 5}, {2, 3, 6, 7}, the same rows
    give the same gradient, and it is the gradient of a generation batch of QA's group alone: the rows without
    signal neither dilute the others nor change their weight."""
    import torch

    flags = ["--loss_type", loss_type, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    if loss_type == "vespo":  # its checked IS mode (the in-process sampler needs no correction)
        flags += ["--vllm_importance_sampling_mode", "token_truncate"]
    trainer, batch = signal_trainer(tiny_agent_dir, task_files, tmp_path, *flags)
    alone = trainer._generate_and_score_completions([dict(trainer.train_dataset[0])] * 4)  # QA's group, as in batch
    trainer.current_gradient_accumulation_steps = 2

    def gradient(batch: dict, layout: list[list[int]]) -> torch.Tensor:
        """The accumulated gradient of `batch` laid out in the micro-batches `layout` (row indices)."""
        trainer.model.zero_grad()
        for rows in layout:
            micro = {k: v[rows] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in batch.items()}
            trainer._compute_loss(trainer.model, micro).backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    by_group = gradient(batch, [[0, 1, 2, 3], [4, 5, 6, 7]])
    mixed = gradient(batch, [[0, 1, 4, 5], [2, 3, 6, 7]])
    without = gradient(alone, [[0, 1], [2, 3]])
    largest = by_group.abs().max()
    assert largest > 1e-3
    # float32 rounding only (QA's group alone is padded to its own length): 2e-6 of the largest entry seen
    assert (by_group - mixed).abs().max() <= 1e-5 * largest
    assert (by_group - without).abs().max() <= 1e-5 * largest


def test_bnpo_with_masking_is_refused_with_the_fix(tiny_agent_dir, task_files, tmp_path):
    """bnpo divides each micro-batch by its own tokens: no one factor makes masking independent of the layout."""
    with pytest.raises(ValueError) as info:
        signal_trainer(tiny_agent_dir, task_files, tmp_path, "--loss_type", "bnpo",
                       "--mask_zero_advantage_groups", "true")
    for named in ("`loss_type: bnpo`", "`mask_zero_advantage_groups: true`", "`loss_type: dapo`",
                  "`mask_zero_advantage_groups: false`"):
        assert named in str(info.value)


def test_the_kl_and_the_metrics_act_on_every_group_whatever_the_masking(tiny_agent_dir, task_files, tmp_path):
    """With beta > 0, the KL term and TRL's metrics (entropy, kl) are the same with and without
    mask_zero_advantage_groups: masking changes only the policy term's normaliser."""
    import torch

    trainer, batch = signal_trainer(tiny_agent_dir, task_files, tmp_path, "--mask_zero_advantage_groups", "true")
    loss_mask = batch["completion_mask"] * batch["tool_mask"]
    # a reference policy that differs from the current one, so the KL is not 0
    ref = batch["old_per_token_logps"] if "old_per_token_logps" in batch else None
    if ref is None:
        with torch.no_grad():
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            ref = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, batch["completion_ids"].shape[1])[0]
    batch["ref_per_token_logps"] = ref - 0.3 * loss_mask

    def loss_and_metrics(masking: bool, beta: float):
        trainer.beta = beta
        b = dict(batch)
        if not masking:
            b.pop("zero_signal_scale")
        for values in trainer._metrics["train"].values():
            values.clear()
        loss = trainer._compute_loss(trainer.model, b).item()
        return loss, {k: v[-1] for k, v in trainer._metrics["train"].items() if k in ("kl", "entropy") and v}

    (on, m_on), (off, m_off) = loss_and_metrics(True, 0.5), loss_and_metrics(False, 0.5)
    (on0, _), (off0, _) = loss_and_metrics(True, 0.0), loss_and_metrics(False, 0.0)
    assert m_on == m_off and m_on["kl"] > 0
    assert on - on0 == pytest.approx(off - off0, rel=1e-5) and on - on0 > 0  # the same KL term either way
    assert on0 != pytest.approx(off0)  # the policy term does change with masking


def test_the_entropy_quantile_counts_only_the_tokens_of_rows_with_signal(tiny_agent_dir, task_files, tmp_path):
    """top_entropy_quantile 0.2: the policy term acts on the tokens of QA's group (signal) whose entropy reaches the
    0.8-quantile of QA's tokens alone (18 of QA's 87 tokens; 21 with QC's tokens counted); QC's tokens (no signal, advantage 0) do not move the threshold. Ratio 1, so the
    dapo loss is -sum(A over the kept tokens) / all loss tokens (no masking of QC: it stays in the normaliser)."""
    import torch

    trainer, batch = signal_trainer(tiny_agent_dir, task_files, tmp_path, "--top_entropy_quantile", "0.2",
                                    "--mask_zero_advantage_groups", "false")
    mask = batch["completion_mask"] * batch["tool_mask"]
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        entropies = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, mask.shape[1],
                                                              compute_entropy=True)[1]
    signal = batch["advantages"].ne(0).any(1)
    assert signal.tolist() == [True] * 4 + [False] * 4
    ours = torch.quantile(entropies[(mask * signal[:, None]).bool()], 0.8)
    everyone = torch.quantile(entropies[mask.bool()], 0.8)  # the threshold with QC's tokens counted
    kept_ours = ((entropies >= ours) * mask)[:4].sum()
    assert kept_ours != ((entropies >= everyone) * mask)[:4].sum()  # the test can tell the two apart
    expected = -(batch["advantages"] * (entropies >= ours) * mask).sum() / mask.sum()
    assert trainer._compute_loss(trainer.model, batch).item() == pytest.approx(expected.item(), rel=1e-5)
    print(f"0.8-quantile of the entropy of QA's tokens {ours:.4f}, of all {everyone:.4f}; QA tokens kept "
          f"{int(kept_ours)} of {int(mask[:4].sum())}")


# seed 0, step 0: the draws are [0, ...] with 2 rows (found in round 1), [4, 0, 3] with 5 (round 2), [4, 5, 8] with 10
# (never: the group stays without signal after the rounds allowed)
@pytest.mark.parametrize("extra_rows", [0, 3, 8])
def test_dynamic_sampling_replaces_groups_without_signal_by_new_questions(tiny_agent_dir, task_files, tmp_path,
                                                                       extra_rows):
    """QC's group has no signal, so each round rolls it out again on a new question drawn from the dataset
    (resample_questions); it stops at the first draw of QA (row 0) or after the rounds allowed. Computed from the
    draws themselves, the metrics and the batch then say exactly that."""
    from mt_grpo.rollout.dynamic_sampling import resample_questions

    rounds_allowed = 3
    trainer, batch = signal_trainer(tiny_agent_dir, task_files, tmp_path, "--dynamic_sampling", "true",
                                    "--dynamic_sampling_max_rounds", str(rounds_allowed), extra_rows=extra_rows)
    draws = [resample_questions(2 + extra_rows, 1, trainer.args.seed, 0, r)[0] for r in range(rounds_allowed)]
    rounds = next((r + 1 for r, row in enumerate(draws) if row == 0), rounds_allowed)
    found = 0 in draws
    m = trainer._metrics["train"]
    assert m["dynamic_sampling/rounds"] == [rounds] and m["dynamic_sampling/groups_replaced"] == [rounds]
    assert m["dynamic_sampling/groups_with_signal"] == [1.0 if found else 0.5]
    # what was logged: QA's group scores exact match 1 0 1 0 (signal), QC's 0 0 0 0 (none); no tool call, so
    # every turn reward is 0. The trained batch is after replacement; the first draw is QA and QC as sampled;
    # the replacements are the `rounds` groups rolled out again, all QC but the last when it found QA.
    exact = "rewards/outcome/exact_match_reward_func"
    assert m[exact] == [0.5 if found else 0.25] and m["rewards/frac_zero_signal_groups"] == [0.0 if found else 0.5]
    first, again = "dynamic_sampling/first_draw/", "dynamic_sampling/replacements/"
    assert m[first + exact] == [0.25] and m[first + "rewards/outcome/mean"] == [0.25]
    assert m[first + "rewards/frac_zero_signal_groups"] == [0.5] and m[first + "rewards/turn/mean"] == [0.0]
    assert m[again + exact] == [pytest.approx(0.5 * found / rounds)]
    assert m[again + "rewards/frac_zero_signal_groups"] == [pytest.approx(1 - found / rounds)]
    assert m[again + "rewards/turn/tool_execution_reward_func"] == [0.0]
    # QA's group keeps its advantages; the second group has signal iff it became QA
    assert batch["advantages"][:4].abs().sum() > 0
    assert (batch["advantages"][4:].abs().sum() > 0) == found
    mask = batch["completion_mask"] * batch["tool_mask"]  # dapo: the factor is tokens / informative tokens
    assert batch["zero_signal_scale"].item() == pytest.approx(1.0 if found else (mask.sum() / mask[:4].sum()).item())


def test_mt_grpo_gives_a_per_turn_turn_reward_of_an_episode_without_a_tool_call_zero(tiny_agent_dir, task_files,
                                                                                     tmp_path):
    """`advantage_mode: mt_grpo` with a @per_tool_turn turn reward, on episodes that all answer at once: the function
    returns [] (no tool turn), and the first turn of each episode earns 0 from it (turn_reward_table), as
    in per_turn mode, not NaN ("not applicable", which would leave it out of its group's A_T)."""
    trainer, _ = signal_trainer(tiny_agent_dir, task_files, tmp_path, "--advantage_mode", "mt_grpo",
                                "--turn_reward_funcs", "tool_execution_per_turn")
    m = trainer._metrics["train"]
    assert [fn.__name__ for fn in trainer.turn_reward_funcs] == ["tool_execution_per_turn"]
    assert m["rewards/turn/mean"] == [0.0] and m["rewards/turn/frac_zero_std_groups"] == [1.0]


def test_dynamic_sampling_draws_the_same_questions_everywhere_and_on_resume():
    from mt_grpo.rollout.dynamic_sampling import resample_questions

    assert resample_questions(100, 5, 1, 7, 0) == resample_questions(100, 5, 1, 7, 0)
    assert resample_questions(100, 5, 1, 7, 0) != resample_questions(100, 5, 1, 7, 1)
    assert resample_questions(100, 5, 1, 7, 0) != resample_questions(100, 5, 1, 8, 0)
    assert all(0 <= r < 100 for r in resample_questions(100, 50, 2, 3, 1))


def test_dynamic_sampling_on_two_processes_joins_every_round_and_replaces_only_the_empty_group(
        tiny_agent_dir, task_files, tmp_path):
    """Rank 0 holds QA's group (signal), rank 1 a group of QB made to have none: rank 1 rolls out again, rank 0
    joins the rounds with nothing to roll out, and both see the same rounds (no hang)."""
    spec = tmp_path / "spec.json"
    script = {QA: SCRIPT[QA], QB: [[xml_answer("Bob", "same")]] * 4}
    spec.write_text(json.dumps({"script": script, "rows": [[0], [1]]}))
    out = tmp_path / "dump"
    flags = ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path / "out"),
             "--dataset_name", str(task_files / "data.jsonl"), "--corpus_path", str(task_files / "corpus.jsonl"),
             "--turn_reward_funcs", "tool_execution_reward_func", "--outcome_reward_funcs", "exact_match_reward_func",
             "--max_completion_length", "256", "--per_device_train_batch_size", "4",
             "--dynamic_sampling", "true", "--dynamic_sampling_max_rounds", "2"]
    run([*launch(2), "tests/run_trainer.py", "score", str(spec), str(out), *flags], tmp_path)
    rank0, rank1 = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert rank0["metrics"] == rank1["metrics"]
    rounds = rank0["metrics"]["dynamic_sampling/rounds"][0]
    assert rank0["metrics"]["dynamic_sampling/groups_replaced"][0] == rounds >= 1
    # rank 0 generated once (its own group); rank 1 once more per round
    assert len(rank0["generate_calls"]) == 1 and len(rank1["generate_calls"]) == 1 + rounds
