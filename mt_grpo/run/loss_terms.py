"""TRL's terms around the policy loss, as its `_compute_loss` has them, for the trainer's loss stage (section 4 of
mt_grpo_trainer.py computes the policy term): the entropy bonus (static, or TRL's adaptive controller), a
mixture-of-experts model's auxiliary loss, and the loss's metrics (`kl`, `entropy`, each loss type's clip ratios)."""

import torch
from trl.trainer.utils import nanmax, nanmin


class LossTerms:
    """Mixed into MTGRPOEnvTrainer: reads TRL's state (entropy_coef, use_adaptive_entropy, _entropy_window_stats,
    _last_world_entropy, aux_loss_enabled, router_aux_loss_coef, current_gradient_accumulation_steps) and writes its
    metrics (`_metrics`)."""

    def _loss_terms(self, mode: str, loss: torch.Tensor, term: torch.Tensor, entropies: torch.Tensor,
                    mask: torch.Tensor, entropy_mask: torch.Tensor | None, aux_loss, kl: torch.Tensor | None,
                    metrics: dict) -> torch.Tensor:
        """`loss` (the policy term over accumulation steps) with TRL's entropy bonus and auxiliary loss; logs the
        metrics. `term`: the policy term before that division (TRL's `policy_loss` metric)."""
        steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(mode, entropies, mask if entropy_mask is None else mask * entropy_mask,
                                              steps)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(term).nanmean().item())
        if self.aux_loss_enabled:  # scaled for accumulation, as the policy term is
            loss = loss + self.router_aux_loss_coef * aux_loss / steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_loss_metrics(mode, mask, kl, entropies, metrics)
        return loss

    def _entropy_bonus(self, mode: str, entropies: torch.Tensor, mask: torch.Tensor, steps: float) -> torch.Tensor:
        """coef * the mean entropy over the tokens the policy term acts on, over accumulation steps. The coefficient
        is the one set at the last optimizer step; TRL's adaptive controller moves it from the window-global entropy
        at each step's boundary (toward `entropy_target`)."""
        bonus = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / steps
        adaptive, args = self.use_adaptive_entropy, self.args
        coef = (self.entropy_coef if self._last_world_entropy <= args.entropy_target else 0.0) if adaptive \
            else self.entropy_coef
        if adaptive and mode == "train":
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None else \
                self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max) \
                    if world <= args.entropy_target else max(self.entropy_coef - args.entropy_coef_delta,
                                                             args.entropy_coef_min)
                self._last_world_entropy, self._entropy_window_stats = world, None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * bonus

    def _log_loss_metrics(self, mode: str, mask: torch.Tensor, kl: torch.Tensor | None, entropies: torch.Tensor,
                          metrics: dict) -> None:
        """TRL's: `kl`, `entropy`, and the loss type's own (`clip_ratio/...` for the clipped losses, `cispo_clip_ratio`,
        `vespo/phi_seq_mean`), each a mean over every process's loss tokens (a sequence-level value: its sequences)."""
        def global_mean(x):
            local = (x.sum(), torch.tensor(float(x.shape[0]), device=x.device)) if x.shape[1] == 1 else \
                ((x * mask).sum(), mask.sum().float())
            totals = self.accelerator.reduce(torch.stack(list(local)), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def sequence_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        m = self._metrics[mode]
        if kl is not None:
            m["kl"].append(global_mean(kl))
        m["entropy"].append(global_mean(entropies))
        for name, value in metrics.items():
            if name != "clip_ratio":
                m[name].append(global_mean(value.float()))
                continue
            low, high = (v.float() for v in value)
            m["clip_ratio/low_mean"].append(global_mean(low))
            m["clip_ratio/high_mean"].append(global_mean(high))
            m["clip_ratio/region_mean"].append(global_mean(((low + high) > 0).float()))
            m["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(sequence_mean(low))).item())
            m["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(sequence_mean(high))).item())
