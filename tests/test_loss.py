"""Section 4's loss table (LOSS_TYPES, policy_loss) and the trainer's loss stage against TRL's own `_compute_loss`: for
every `loss_type` of TRL's menu, at both importance-sampling levels, with and without the KL term (and its bias
correction), the off-policy mask, two-sided clipping, the entropy mask, the entropy bonus (static and adaptive), a
mixture-of-experts auxiliary loss, in training and in evaluation, the two give the same loss, the same gradient and the
same metrics on the same tensors. Then a loss added by one function and one table entry trains."""

from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from helpers import final_metrics
from mt_grpo.run.loss_terms import LossTerms
from mt_grpo_trainer import LOSS_TYPES, LossType, MTGRPOEnvTrainer, clipped_loss, sequence_mean

TRL_MENU = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
B, P, T = 4, 3, 6  # rows, prompt and completion positions


class Accelerator:
    """One process: what TRL's loss and ours ask of accelerate."""

    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


class LossStage(LossTerms):
    """The state the two `_compute_loss` read, set as GRPOTrainer.__init__ sets it from the config; the forward gives
    fixed logprobs (a leaf, so the gradient can be compared), entropies and an auxiliary loss."""

    def __init__(self, args: GRPOConfig, logps: torch.Tensor, entropies: torch.Tensor, training: bool, aux: bool):
        self.args, self.loss_type, self.beta = args, args.loss_type, args.beta
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.importance_sampling_level, self.off_policy_mask_threshold = args.importance_sampling_level, \
            args.off_policy_mask_threshold
        self.max_completion_length, self.top_entropy_quantile = args.max_completion_length, args.top_entropy_quantile
        self.entropy_coef, self.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self._last_world_entropy, self._entropy_window_stats = 0.5, None  # a window seen, below the target
        self.aux_loss_enabled, self.router_aux_loss_coef = aux, 0.02
        self.use_vllm, self.vllm_importance_sampling_correction = False, False  # ours scales A by the weights itself
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self.model, self.accelerator = SimpleNamespace(training=training), Accelerator()
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.logps, self.entropies = logps, entropies
        self.packing = SimpleNamespace(row_samples=lambda *a: nullcontext())
        self.get_off_policy_mask, self.get_gamma_weights = GRPOTrainer.get_off_policy_mask, GRPOTrainer.get_gamma_weights

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert input_ids.shape == (B, P + T) and logits_to_keep == T
        return self.logps * 1.0, self.entropies, torch.tensor(0.7)

    def get_high_entropy_mask(self, entropies, mask, threshold):
        return GRPOTrainer.get_high_entropy_mask(self, entropies, mask, threshold)

    def _loss_window(self, inputs, mode):
        return MTGRPOEnvTrainer._loss_window(self, inputs, mode)


def batch(seed: int, level: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:], mask[3, 2:] = 0, 0  # padding
    tool = torch.ones(B, T, dtype=torch.long)
    tool[0, 2:4] = 0  # a tool reply inside the completion
    old = -torch.rand(B, T, generator=g) * 2
    inputs = {"prompt_ids": torch.randint(0, 50, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.randint(0, 50, (B, T), generator=g), "completion_mask": mask, "tool_mask": tool,
              "advantages": torch.randn(B, T, generator=g), "num_items_in_batch": (mask * tool).sum() * 2.0,
              "old_per_token_logps": old, "ref_per_token_logps": old + 0.3 * torch.randn(B, T, generator=g),
              "sampling_per_token_logps": old + 0.2 * torch.randn(B, T, generator=g),
              "importance_sampling_ratio": torch.rand(B, T, generator=g) + 0.5}
    shift = 0.25 if level == "token" else 0.05  # ratios that reach the clip either side
    logps = (old + shift * torch.randn(B, T, generator=g)).requires_grad_(True)
    entropies = torch.rand(B, T, generator=g) * 3
    return inputs, logps, entropies


CASES = {  # name -> GRPOConfig fields (and the stage's mode, aux loss)
    "plain": {},
    "kl": {"beta": 0.05},
    "kl_bias_corrected": {"beta": 0.05, "use_bias_correction_kl": True},
    "off_policy_mask": {"off_policy_mask_threshold": 0.01},
    "delta_and_eps_high": {"delta": 1.2, "epsilon_high": 0.28},
    "entropy_mask_and_bonus": {"top_entropy_quantile": 0.5, "entropy_coef": 0.01},
    "adaptive_entropy": {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 1.0},
    "eval": {"beta": 0.05, "entropy_coef": 0.01, "_training": False},
    "aux_loss": {"_aux": True, "gradient_accumulation_steps": 1},
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_type", TRL_MENU)
def test_each_loss_type_equals_trls_compute_loss(tmp_path, loss_type, case, level):
    fields = dict(CASES[case])
    training, aux = fields.pop("_training", True), fields.pop("_aux", False)
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, loss_type=loss_type,
                      importance_sampling_level=level, per_device_train_batch_size=B, num_generations=2,
                      max_completion_length=8, **{"gradient_accumulation_steps": 2, "steps_per_generation": 4,
                                                  **fields})
    results = []
    for compute_loss in (GRPOTrainer._compute_loss, MTGRPOEnvTrainer._compute_loss):
        inputs, logps, entropies = batch(7, level)
        stage = LossStage(args, logps, entropies, training, aux)
        loss = compute_loss(stage, None, inputs)
        loss.backward()
        mode = "train" if training else "eval"
        results.append((loss.detach(), logps.grad.clone(), dict(stage._metrics[mode]),
                        (stage.entropy_coef, stage._last_world_entropy)))
    (trl_loss, trl_grad, trl_metrics, trl_state), (loss, grad, metrics, state) = results
    assert torch.isfinite(trl_loss) and trl_grad.abs().sum() > 0
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-8)
    assert torch.allclose(grad, trl_grad, rtol=1e-5, atol=1e-9)
    assert metrics.keys() == trl_metrics.keys()
    for name, values in trl_metrics.items():
        assert metrics[name] == pytest.approx(values, rel=1e-6, nan_ok=True), name
    assert state == pytest.approx(trl_state)


def test_the_table_is_trls_menu_and_each_names_what_masking_rescales():
    assert list(LOSS_TYPES) == TRL_MENU
    assert {n for n, t in LOSS_TYPES.items() if t.zero_signal == "rows"} == {"grpo", "dr_grpo", "luspo", "sapo"}
    assert {n for n, t in LOSS_TYPES.items() if t.zero_signal == "tokens"} == {"dapo", "cispo", "vespo"}
    assert LOSS_TYPES["bnpo"].zero_signal is None  # refused with mask_zero_advantage_groups (checks.py)


def test_zero_signal_scale_scales_the_policy_term_only(tmp_path):
    """The stage multiplies the advantages by the batch's zero_signal_scale: the policy term scales by it (dapo is
    linear in a positively scaled A), the KL term does not."""
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, loss_type="dapo", beta=0.05,
                      per_device_train_batch_size=B, num_generations=2, max_completion_length=8)
    losses = {}
    for scale in (1.0, 2.0):
        inputs, logps, entropies = batch(3, "token")
        stage = LossStage(args, logps, entropies, True, False)
        losses[scale] = MTGRPOEnvTrainer._compute_loss(stage, None, {**inputs, "zero_signal_scale": torch.tensor(scale)})
        kl = stage._metrics["train"]["kl"]
    inputs, logps, entropies = batch(3, "token")
    no_kl = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, loss_type="dapo",
                       per_device_train_batch_size=B, num_generations=2, max_completion_length=8)
    policy = MTGRPOEnvTrainer._compute_loss(LossStage(no_kl, logps, entropies, True, False), None, inputs)
    assert (losses[2.0] - losses[1.0]).item() == pytest.approx(policy.item(), rel=1e-5)
    assert len(kl) == 1 and kl[0] > 0


def test_an_unknown_loss_type_is_refused_naming_the_table(tmp_path):
    from mt_grpo.run.checks import check_training_args

    args = SimpleNamespace(loss_type="no_such_loss")
    with pytest.raises(ValueError, match=r"`loss_type: no_such_loss` is not a loss of LOSS_TYPES.*grpo"):
        check_training_args(args, LOSS_TYPES)


# ---- a new loss is one function and one entry of LOSS_TYPES
def halved_clipped_loss(x, c):
    """A test's loss: PPO's clipped surrogate at half weight, with its clip metrics."""
    loss, metrics = clipped_loss(x, c)
    return 0.5 * loss, metrics


def test_a_loss_added_by_one_function_and_one_entry(monkeypatch, tmp_path):
    monkeypatch.setitem(LOSS_TYPES, "half_grpo", LossType(halved_clipped_loss, sequence_mean, zero_signal="rows"))
    losses = {}
    for loss_type in ("grpo", "half_grpo"):
        args = SimpleNamespace(**{**vars(GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                     per_device_train_batch_size=B, num_generations=2,
                                                     max_completion_length=8)), "loss_type": loss_type})
        inputs, logps, entropies = batch(5, "token")
        losses[loss_type] = MTGRPOEnvTrainer._compute_loss(LossStage(args, logps, entropies, True, False), None,
                                                           inputs).item()
    assert losses["half_grpo"] == pytest.approx(0.5 * losses["grpo"]) and losses["grpo"] != 0


ADD_A_LOSS = """
import sys
import mt_grpo_trainer as mt
sys.path.insert(0, "tests")
from test_loss import halved_clipped_loss
mt.LOSS_TYPES["half_grpo"] = mt.LossType(halved_clipped_loss, mt.sequence_mean, zero_signal="rows")
mt.main(sys.argv[1:])
"""


def test_the_trainer_trains_with_an_added_loss(tiny_agent_dir, tmp_path):
    """The recipe's `loss_type` takes the new entry, and a step trains with it: a finite loss, a gradient, TRL's clip
    metrics of the clipped family."""
    from test_advantages import train_one_step

    out = train_one_step(ADD_A_LOSS, tiny_agent_dir, tmp_path, "--loss_type", "half_grpo")
    (step,) = [h for h in final_metrics(out) if "loss" in h]
    assert step["grad_norm"] > 0 and "clip_ratio/region_mean" in step
