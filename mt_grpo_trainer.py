"""MT-GRPO: multi-turn GRPO with turn-level credit assignment, for LLM agents that call tools.

The policy answers in turns: a tool call, whose result the environment appends, or a final answer (`mt_grpo/base/protocol.py`
defines the tool formats). Each episode gets a turn reward R_T (did the first tool call work and bring back the
answer?) and an outcome reward R_O (is the final answer right?), each normalised within its group of
`num_generations` episodes of the same prompt:

    A_T = (R_T - mean_group(R_T)) / std_group(R_T)        A_O = likewise for R_O
    A_t = A_O + turn_advantage_coef * A_T    for model tokens t before the first tool result
    A_t = A_O                                for model tokens t after it

and the loss is TRL's PPO-clipped GRPO objective over model tokens only (Zeng et al. 2025, "Reinforcing Multi-Turn
Reasoning in LLM Agents via Turn-Level Credit Assignment"). `advantage_mode` picks another entry of ADVANTAGE_MODES
(per_turn credits every tool turn). Where this departs from the paper: docs/guide.md, "The algorithm's choices".

    python mt_grpo_trainer.py --config hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml   # CPU demo
    accelerate launch mt_grpo_trainer.py --config hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml
    ./launch.sh hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml   # vLLM on GPU 7, training on 0-6

Sections: 1 config -> 2 rewards -> 3 advantages -> 4 importance weights and loss (the algorithm, ALGO LOGIC: pure
functions tests import) -> 5 the vLLM server client -> 6 the multi-turn env -> 7 the trainer (its step as named
stages) -> 8 wiring and main. The plumbing lives beneath it in mt_grpo/ (README.md, "Layout"). Left out on purpose: a
colocated vLLM engine (a server, or `model.generate`), reward models loaded by the trainer (a reward function may
call one), structured outputs (the protocol's stop strings end each turn).
"""

import concurrent.futures
import copy
import dataclasses
import logging
import math
import time
from dataclasses import InitVar, dataclass, replace
from types import SimpleNamespace
from typing import Callable

import httpx
import torch
import torch.nn.functional as F
from accelerate.utils import gather
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer, get_peft_config
from trl.trainer.utils import use_adapter

from mt_grpo.adapters import AdapterArguments
from mt_grpo.agents import AgentArguments, agent_env
from mt_grpo.base.completions import (RetryableResponse, Sample, check_length, kept_set_logprobs,
                                      parse_completions_response, post_with_retries, wait_for_health)
from mt_grpo.base.fields import Choices, arg, parse_recipe
from mt_grpo.base.protocol import Protocol, ToolCall, build_prompt, get_protocol, template_ids, tool_call_message
from mt_grpo.base.runtime import stop_point
from mt_grpo.base.turn_samples import check_turn_samples, next_sample_prompt
from mt_grpo.engine.packing import PackedForward, PackingArguments, score_labelled_tokens_only
from mt_grpo.engine.sampling import (SamplingParams, TransformersBackend, policy_sampler_logprobs,
                                     sampled_distribution_logps)
from mt_grpo.engine.server_images import ServerImages
from mt_grpo.engine.server_pool import ServerPool, ServerPoolArguments
from mt_grpo.engine.vision import Vision
from mt_grpo.engine.weight_sync import (Probes, ServerEndpoints, WeightSync, WeightSyncArguments, WeightSyncConfig,
                                       server_sampler)
from mt_grpo.rewards import is_per_tool_turn
from mt_grpo.rewards.answers import ANSWER_TYPES
from mt_grpo.rewards.judge import JudgeArguments
from mt_grpo.rewards.scoring import compute_rewards_per_func
from mt_grpo.rollout import RolloutArguments
from mt_grpo.rollout.async_rollout import AsyncRollouts, PromptStream, first_generation, generation_index
from mt_grpo.rollout.dynamic_sampling import resample_groups
from mt_grpo.rollout.environments import episode_columns, prompt_fitter
from mt_grpo.rollout.episodes import (CallRecord, Episode, check_tokenization, length_stop, loss_mask, pad_episodes,
                                      run_length)
from mt_grpo.rollout.scheduling import run_per_episode
from mt_grpo.rollout.tool_calls import ToolResult, cut_tool_output
from mt_grpo.rollout.toolset import Toolset, run_turns
from mt_grpo.rollout.user_turns import UserTurn, add_model_message, ask_user, environment_done, record_reply
from mt_grpo.run import evaluation
from mt_grpo.run.checks import (check_backend, check_best_metric, check_distributed_generation, check_reward_sources,
                                check_script_args, check_training_args, check_trl, settle_training_defaults)
from mt_grpo.run.loss_terms import LossTerms
from mt_grpo.run.reporting import (LOG_FORMAT, RolloutProgress, RunArguments, TrainerReports, end_processes,
                                   install_console, quiet_library_bars, report_outputs, stoppable)
from mt_grpo.tasks import TaskArguments, task_keyword
from mt_grpo.tools import ToolArguments

logger = logging.getLogger("mt_grpo")


# ------------------------------------------------------------------------------------------------
# 1. Config (`arg`, in base/fields.py: a field with its help)
# ------------------------------------------------------------------------------------------------
@dataclass
class MTGRPOScriptArguments(TaskArguments, ToolArguments, RolloutArguments, AdapterArguments, RunArguments,
                            ServerPoolArguments, WeightSyncArguments, PackingArguments, JudgeArguments,
                            AgentArguments):
    """The rewards' and MT-GRPO's fields; it inherits those of the task, the tools, the episode loop, the adapters, the
    run, the vLLM servers, the weight sync, packing and the LLM judge (mt_grpo/). Training arguments are TRL's
    GRPOConfig and model arguments TRL's ModelConfig, all set from one recipe YAML; run/checks.py holds every rule
    across fields; docs/reference.md lists every field (generated from this class)."""

    # Rewards: names from mt_grpo/rewards or dotted paths `module:function`
    turn_reward_funcs: list[str] | None = arg(None, "Turn reward functions (R_T); None: the task's (fictional_kb, "
                                              "triviaqa: tool ran, answer in its result; none for your own data).")
    turn_reward_weights: list[float] | None = arg(None, "One weight per turn reward function (None: all 1.0).")
    outcome_reward_funcs: list[str] | None = arg(None, "Outcome reward functions (R_O), besides TRL's `reward_funcs`; "
                                                 "None: the task's (fictional_kb: exact match, answered, format).")
    outcome_reward_weights: list[float] | None = arg(None, "One weight per outcome reward function (None: all 1.0).")
    answer_type: str = arg("auto", "How rewards compare answers with the gold: text (SQuAD normalised) | math "
                           "(numbers, expressions: math-verify) | auto (math when the gold is one); a dataset "
                           "column `answer_type` overrides it per row.", choices=ANSWER_TYPES)
    # MT-GRPO
    advantage_mode: str = arg("auto", "A mode of ADVANTAGE_MODES (section 3): how A_O and A_T reach the tokens; auto: "
                              "the first mode whose condition the run meets (per_turn with an environment's "
                              "step_rewards, mt_grpo with other turn rewards, else outcome_only).",
                              choices=Choices(lambda: {**ADVANTAGE_MODES, "auto": None}))
    turn_advantage_coef: float = arg(1.0, "Weight of A_T on the tokens of the turn it credits (paper: 1.0).")
    turn_normalization: str = arg("pooled", "per_turn: normalise A_T(k) over all (sample, tool turn) pairs of the "
                                  "group (pooled) | over the samples with a turn k (by_turn_index).",
                                  choices=("pooled", "by_turn_index"))
    turn_credit_discount: float = arg(0.0, "per_turn: turn k also gets sum_{j>k} gamma^(j-k) A_T(j) (0: its own only).")
    mask_zero_advantage_groups: bool = arg(True, "Groups whose advantages are all 0 leave the policy loss's "
                                           "normaliser (the KL still acts on them).")

    def __post_init__(self):
        check_script_args(self)


@dataclass
class MTGRPOConfig(GRPOConfig, MTGRPOScriptArguments):
    """TRL's GRPOConfig with the fields above: the `args` of the Python API and the recipe's keys. Evaluation is
    greedy (TRL's None means num_generations episodes per eval question, and its check then wants the eval batch
    divisible by num_generations, which one greedy episode per question does not need); run/checks.py's
    settle_training_defaults says what else moves."""

    num_generations_eval: int | None = arg(1, "Episodes per eval question: 1 greedy; k > 1 sampled, with pass@k.")
    gradient_checkpointing: bool | None = arg(None, "Deprecated name of `activation_checkpointing`; either may be set.")
    # TRL's ScriptArguments has these two, and argparse refuses a flag twice: constructor keywords, not fields, so that
    # TRL's TrlParser((ScriptArguments, MTGRPOConfig, ModelConfig)) parses; recipes set them (base/fields.parse_recipe).
    dataset_name: InitVar[str | None] = task_keyword("dataset_name")
    dataset_config: InitVar[str | None] = task_keyword("dataset_config")

    def __post_init__(self, dataset_name, dataset_config):
        self.dataset_name, self.dataset_config = dataset_name, dataset_config
        settle_training_defaults(self)  # run/checks.py: the two names of checkpointing; no pinned memory without a GPU
        check_script_args(self)  # GRPOConfig's __post_init__ does not reach the script arguments
        super().__post_init__()

    def to_dict(self) -> dict:  # the saved and logged config, with the two keywords above
        return {**super().to_dict(), "dataset_name": self.dataset_name, "dataset_config": self.dataset_config}

# ------------------------------------------------------------------------------------------------
# 2. Rewards: each function once on the batch (compute_rewards_per_func, rewards/scoring.py), weighted per kind
# ------------------------------------------------------------------------------------------------
# ALGO LOGIC: sections 2 to 4
def weighted_reward(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, F) -> (B,), or per turn (B, F, K) -> (B, K); NaN entries (None) left out, all NaN stays NaN."""
    w = weights.view(1, -1, *([1] * (rewards_per_func.dim() - 2)))
    total = (rewards_per_func * w).nansum(dim=1)
    total[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    return total


def turn_reward_table(turn_per_func: torch.Tensor, weights: torch.Tensor, tool_turns: torch.Tensor,
                      per_turn_funcs: list[bool]) -> torch.Tensor:
    """(B, F, K) turn rewards per function and tool turn -> (B, K) R_T (K = 1 but in per_turn mode); columns past an
    episode's turns (its tool turns, then the final model turn's where a function scored it) are NaN. An episode that
    called no tool still has a first turn, credited like any other: 0 from each per-turn function that gave it no
    value (it did no tool work), its own value from each per-sample one. Left NaN, it would get no A_T, and the
    pressure to search (a no-tool episode's A_T below its group's mean) would vanish."""
    no_tool = (tool_turns == 0)[:, None]  # (B, 1)
    flags = torch.tensor(per_turn_funcs, dtype=torch.bool, device=turn_per_func.device)[None, :]  # (1, F)
    table = turn_per_func.clone()
    table[:, :, 0].masked_fill_(no_tool & flags & table[:, :, 0].isnan(), 0.0)  # (B, F) view of the first turn
    R_T = weighted_reward(table, weights)  # (B, K)
    turns = torch.arange(turn_per_func.shape[2], device=R_T.device)[None, :]
    R_T[turns > tool_turns[:, None]] = float("nan")
    return R_T


def group_normalize(rewards: torch.Tensor, num_generations: int, scale: str = "group",
                    eps: float = 1e-6) -> torch.Tensor:
    """(B,) rewards -> (B,) advantages, centred on the group mean and scaled as TRL's `scale_rewards`
    says: group (the group's sample std), batch (the std over the whole batch) or none. A group whose
    rewards are all equal (std below eps) gets exactly 0, not a rounding-noise blow-up. NaN rewards
    (no applicable function) are left out of the statistics and get 0."""
    r = rewards.view(-1, num_generations)
    valid = ~torch.isnan(r)
    count = valid.sum(dim=1, keepdim=True)
    mean = r.nansum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    group_std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    if scale == "group":
        std = group_std
    elif scale == "batch":
        flat = rewards[~torch.isnan(rewards)]
        std = torch.full_like(group_std, flat.std().item() if flat.numel() > 1 else 0.0)
    elif scale == "none":
        std = torch.ones_like(group_std)
    else:
        raise ValueError(f"scale_rewards is {scale!r}; choose one of group, batch, none.")
    adv = torch.where((group_std > eps) & valid, centred / std.clamp(min=eps), torch.zeros_like(r))
    return adv.view(-1)


# ------------------------------------------------------------------------------------------------
# 3. Advantages: one pure function, and the table of modes it applies
# ------------------------------------------------------------------------------------------------
@dataclass
class Advantages:
    tokens: torch.Tensor  # (B_local, T) per-token advantage of this process's samples
    turn: torch.Tensor  # (B, K) A_T of every sample of the generation batch (K = 1 but for per_turn); 0 if absent
    outcome: torch.Tensor  # (B,) A_O
    informative: torch.Tensor  # (B,) bool: the sample's group carries a learning signal (some advantage != 0)


@dataclass(frozen=True)
class AdvantageSettings:
    """How rewards become advantages, built once from the config: the mode, the group size, and `config`, whose
    fields the modes read by name (TRL's scale_rewards, turn_advantage_coef, turn_normalization, turn_credit_discount).
    A new mode's knob is one field in section 1 and its use in the mode's function."""

    mode: str
    group_size: int
    config: object  # the trainer's MTGRPOConfig, or any object with the fields the modes read (`of`)

    @classmethod
    def of(cls, mode: str, group_size: int, **fields) -> "AdvantageSettings":
        """Settings with the config's defaults except `fields`, without a config (tests, studies)."""
        defaults = {f.name: f.default for f in dataclasses.fields(MTGRPOConfig) if f.default is not dataclasses.MISSING}
        return cls(mode, group_size, SimpleNamespace(**{**defaults, **fields}))

    def normalize(self, rewards: torch.Tensor) -> torch.Tensor:  # (B,) -> (B,) within groups, as TRL's scale_rewards
        return group_normalize(rewards, self.group_size, self.config.scale_rewards)


def turn_advantages(R_T: torch.Tensor, group_size: int, normalization: str, scale_rewards: str) -> torch.Tensor:
    """(B, K) turn rewards (NaN: no such tool turn) -> (B, K) A_T. by_turn_index: each turn index k is normalised
    over the group's samples that have a turn k; pooled: over all (sample, turn) pairs of the group."""
    B, K = R_T.shape
    if normalization == "by_turn_index":
        return torch.stack([group_normalize(R_T[:, k], group_size, scale_rewards) for k in range(K)], dim=1)
    return group_normalize(R_T.reshape(-1), group_size * K, scale_rewards).view(B, K)  # rows are group-major


# A mode: (R_T (B, K), R_O (B,), A_O (B,), AdvantageSettings) -> (base (B,), A_T (B, K'), credit (B, K' + 1)). Every
# model token gets base; those of model turn k also get turn_advantage_coef * credit[:, k] (column K': no credit).
def mt_grpo_credit(R_T, R_O, A_O, s):
    """The paper: A_O everywhere, and A_T on turn 0, the tokens before the first tool result."""
    A_T = s.normalize(R_T[:, 0])[:, None]
    return A_O, A_T, F.pad(A_T, (0, 1))


def per_turn_credit(R_T, R_O, A_O, s):
    """Every tool turn k: C(k) = sum_{j >= k} gamma^(j-k) A_T(j) on the model turn that made it; the final turn A_O."""
    c = s.config
    A_T = torch.nan_to_num(turn_advantages(R_T, s.group_size, c.turn_normalization, c.scale_rewards), nan=0.0)
    credit = A_T.new_zeros(A_T.shape[0], A_T.shape[1] + 1)  # the column past the last turn: no later turns
    for k in reversed(range(A_T.shape[1])):
        credit[:, k] = A_T[:, k] + c.turn_credit_discount * credit[:, k + 1]
    return A_O, A_T, credit


def outcome_only_credit(R_T, R_O, A_O, s):
    """GRPO-OR: A_O on every token (A_T recorded, not credited)."""
    A_T = s.normalize(R_T[:, 0])[:, None]
    return A_O, A_T, torch.zeros_like(F.pad(A_T, (0, 1)))


def merged_credit(R_T, R_O, A_O, s):
    """GRPO-MR: the advantage of R_T + R_O on every token."""
    A_T, R_T0 = s.normalize(R_T[:, 0])[:, None], R_T[:, 0]
    both_nan = torch.isnan(R_T0) & torch.isnan(R_O)
    A_M = s.normalize(torch.where(both_nan, float("nan"), R_T0.nan_to_num() + R_O.nan_to_num()))
    return A_M, A_T, torch.zeros_like(F.pad(A_T, (0, 1)))


@dataclass(frozen=True)
class AdvantageMode:
    credit: Callable  # the mode's function, above
    help: str  # one line, for `advantage_mode`'s help and docs/reference.md
    auto: str | None = None  # when `advantage_mode: auto` picks it: "step_rewards", "turn_rewards", "always"
    turn_columns: bool = False  # R_T has a column per tool turn (else one: the episode's turn reward)
    credits_turns: bool = False  # A_T reaches the tokens: the run needs a turn reward


# `advantage_mode` -> its mode. `auto` takes the first entry, in this order, whose condition the run meets.
# Adding a mode: its credit function above and one entry here.
ADVANTAGE_MODES: dict[str, AdvantageMode] = {
    "per_turn": AdvantageMode(per_turn_credit, "credit for every tool turn", auto="step_rewards",
                              turn_columns=True, credits_turns=True),
    "mt_grpo": AdvantageMode(mt_grpo_credit, "the paper", auto="turn_rewards", credits_turns=True),
    "outcome_only": AdvantageMode(outcome_only_credit, "GRPO-OR, TRL's GRPO", auto="always"),
    "merged": AdvantageMode(merged_credit, "GRPO-MR"),
}


def resolve_advantage_mode(mode: str, turn_rewards: bool, step_rewards: bool) -> str:
    """`advantage_mode: auto` -> the first mode of ADVANTAGE_MODES whose condition the run meets; others as given."""
    met = {"step_rewards": step_rewards, "turn_rewards": turn_rewards, "always": True}
    return mode if mode != "auto" else next(name for name, m in ADVANTAGE_MODES.items() if m.auto and met[m.auto])


def mode_advantages(R_T: torch.Tensor, R_O: torch.Tensor, s: AdvantageSettings):
    """(A_O (B,), base (B,), A_T (B, K'), credit (B, K' + 1), informative (B,)) of the mode on the generation batch:
    `informative` marks the samples of groups where some token gets a non-zero advantage."""
    if s.mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage_mode is {s.mode!r}; choose one of {list(ADVANTAGE_MODES)}.")
    A_O = s.normalize(R_O)
    base, A_T, credit = ADVANTAGE_MODES[s.mode].credit(R_T if R_T.dim() == 2 else R_T[:, None], R_O, A_O, s)
    signal = base.abs() + credit.abs().amax(dim=1) * (s.config.turn_advantage_coef != 0)  # (B,)
    informative = (signal.view(-1, s.group_size).amax(dim=1) > 0).repeat_interleave(s.group_size)
    return A_O, base, A_T, credit, informative


def mt_grpo_advantages(R_T: torch.Tensor, R_O: torch.Tensor, token_turns: torch.Tensor, s: AdvantageSettings,
                       local: slice = slice(None)) -> Advantages:
    """The algorithm. R_T: (B, K) turn rewards of the whole generation batch, one column per tool turn
    (K = 1: the episode's turn reward; NaN: not applicable or no such turn); R_O: (B,); token_turns:
    (B_local, T) model-turn index of each of this process's completion tokens (turn 0 is everything
    before the first <result>; -1 for environment tokens and padding); `local` picks this process's rows.
    The mode (ADVANTAGE_MODES) gives each sample a base advantage and a credit per model turn:
        tokens of model turn k:  base + turn_advantage_coef * credit[k]     (mt_grpo: credit = [A_T, 0])"""
    A_O, base, A_T, credit, informative = mode_advantages(R_T, R_O, s)
    K = credit.shape[1] - 1
    turn_credit = credit[local].gather(1, token_turns.clamp(0, K).to(credit.device)) * (token_turns >= 0)
    tokens = base[local, None] + s.config.turn_advantage_coef * turn_credit  # (B_local, T)
    return Advantages(tokens=tokens, turn=A_T, outcome=A_O, informative=informative)


def groups_with_signal(R_T: torch.Tensor, R_O: torch.Tensor, s: AdvantageSettings) -> torch.Tensor:
    """(B // group_size,) True where a group gives some token a non-zero advantage under the mode: what DAPO's
    dynamic sampling keeps. The same definition as the loss's masking (`Advantages.informative`)."""
    return mode_advantages(R_T, R_O, s)[-1][::s.group_size]


# ------------------------------------------------------------------------------------------------
# 4. Importance weights and loss: the correction for sampling from another engine than the trainer, then TRL's menu of
# losses (`loss_type`), each a per-token loss and a normaliser (LOSS_TYPES), over model tokens only
# ------------------------------------------------------------------------------------------------
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                       mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """(B, T) weights pi_trainer / pi_sampler as TRL's `vllm_importance_sampling_mode` defines them: per token or
    per sequence (the product over its model tokens), truncated to [clip_min, clip_max] or masked (0) outside it.
    Off-mask tokens and NaN sampler logprobs count as ratio 1. Detached and >= 0: scaling the advantages by them
    scales each token's clipped loss, as TRL applies them."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode is {mode!r}; choose one of {list(IS_MODES)}.")
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)  # (B, T)
    log_ratio = diff.sum(dim=1, keepdim=True) if mode.startswith("sequence") else diff
    low = -math.inf if clip_min is None else math.log(max(clip_min, 1e-30))
    high = math.inf if clip_max is None else math.log(clip_max)
    if mode.endswith("truncate"):
        ratio = log_ratio.clamp(min=low, max=high).exp()
    else:
        ratio = torch.where((log_ratio >= low) & (log_ratio <= high), log_ratio.clamp(max=80.0).exp(),
                            torch.zeros_like(log_ratio))
    ratio = ratio.expand_as(diff)
    return torch.where(mask.bool(), ratio, torch.ones_like(ratio)).detach()


@dataclass
class LossInputs:
    """One micro-batch's tensors for a per-token loss: B rows, T completion positions."""

    logps: torch.Tensor  # (B, T) log pi_theta of the sampled tokens, with grad
    advantages: torch.Tensor  # (B, T) A_t (times the sampler's importance weights; section 3)
    mask: torch.Tensor  # (B, T) 1 on the model tokens the loss counts
    log_ratio: torch.Tensor  # (B, T) log pi_theta - log pi_old
    ratio: torch.Tensor  # (B, T), or (B, 1) at importance_sampling_level sequence: pi_theta / pi_old
    sampler_weights: torch.Tensor | None = None  # (B, T) the importance weights VESPO folds into phi (_correct_for_sampler)


# A per-token loss: (LossInputs, the config: TRL's fields) -> ((B, T) or (B, 1) loss, {name: tensor} for its metrics).
def epsilon_high(c) -> float:  # TRL's: None is `epsilon`
    return c.epsilon if c.epsilon_high is None else c.epsilon_high


def clipped_loss(x: LossInputs, c):
    """PPO's clipped surrogate -min(r A, clip(r, 1 - eps, 1 + eps_high) A), r capped at `delta` if set (as in TRL, the
    clip metrics read the capped r)."""
    clipped = x.ratio.clamp(1 - c.epsilon, 1 + epsilon_high(c))
    ratio = x.ratio if c.delta is None else x.ratio.clamp(max=c.delta)
    low, high = (ratio < 1 - c.epsilon) & (x.advantages < 0), (ratio > 1 + epsilon_high(c)) & (x.advantages > 0)
    return -torch.min(ratio * x.advantages, clipped * x.advantages), {"clip_ratio": (low, high)}


def cispo_loss(x: LossInputs, c):
    """CISPO: -sg(min(r, eps_high)) A log pi, a gradient on every token."""
    capped = x.ratio.clamp(max=epsilon_high(c)).detach()
    return -capped * x.advantages * x.logps, {"cispo_clip_ratio": (x.ratio > epsilon_high(c)) & (x.advantages > 0)}


def sapo_loss(x: LossInputs, c):
    """SAPO: a soft gate 4/tau sigmoid(tau (r - 1)) in place of the clip, tau by the advantage's sign."""
    tau = torch.where(x.advantages > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
    return -torch.sigmoid(tau * (x.ratio - 1)) * 4 / tau * x.advantages, {}


def vespo_loss(x: LossInputs, c):
    """VESPO: -phi(w) A log pi, phi a gamma weight of the sequence's ratio w (TRL's get_gamma_weights), detached."""
    phi = GRPOTrainer.get_gamma_weights(x.advantages, x.log_ratio, x.mask, x.sampler_weights, c.vespo_k_pos,
                                        c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg)
    return -phi * x.advantages * x.logps, {"vespo/phi_seq_mean": phi}


@dataclass(frozen=True)
class LossWindow:  # what the normalisers count
    accumulation: float  # micro-batches of one optimizer step (1 in evaluation)
    window_tokens: torch.Tensor  # loss tokens of the generation batch, per process, per accumulation window
    max_completion_length: int


# A normaliser: (loss * mask (B, T), mask, LossWindow) -> the micro-batch's loss (divided by `accumulation` after).
def sequence_mean(loss, mask, w):  # each row's mean over its tokens, then over rows
    return (loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def sequence_sum(loss, mask, w):  # each row's sum, then the mean over rows
    return loss.sum(-1).mean()


def micro_batch_token_mean(loss, mask, w):
    return loss.sum() / mask.sum().clamp(min=1.0)


def fixed_length_mean(loss, mask, w):  # over rows x max_completion_length
    return loss.sum() / (loss.size(0) * w.max_completion_length)


def window_token_mean(loss, mask, w):  # over the loss tokens of one optimizer step
    return loss.sum() / w.window_tokens


@dataclass(frozen=True)
class LossType:
    per_token: Callable  # the loss of each token, above
    normalise: Callable  # the normaliser, above
    per_window: bool = False  # the normaliser spans the accumulation window (else the loss is divided by its steps)
    # what mask_zero_advantage_groups rescales (zero_signal_scale): "rows" | "tokens" of the generation batch; None: a
    # normaliser it cannot make exact (bnpo's depends on which rows share a micro-batch), refused at start
    zero_signal: str | None = None


# `loss_type` -> its loss: TRL's menu, the same numbers (tests/test_loss.py holds each against TRL's _compute_loss).
# Adding a loss: its per-token function (and a normaliser, if none fits) above and one entry here.
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_loss, sequence_mean, zero_signal="rows"),
    "bnpo": LossType(clipped_loss, micro_batch_token_mean),
    "dr_grpo": LossType(clipped_loss, fixed_length_mean, zero_signal="rows"),
    "dapo": LossType(clipped_loss, window_token_mean, per_window=True, zero_signal="tokens"),
    "luspo": LossType(clipped_loss, sequence_sum, zero_signal="rows"),
    "cispo": LossType(cispo_loss, window_token_mean, per_window=True, zero_signal="tokens"),
    "sapo": LossType(sapo_loss, sequence_mean, zero_signal="rows"),
    "vespo": LossType(vespo_loss, window_token_mean, per_window=True, zero_signal="tokens"),
}


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                c, w: LossWindow, ref_logps: torch.Tensor | None = None, sampling_logps: torch.Tensor | None = None,
                sampler_weights: torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None, beta=None):
    """(the micro-batch's loss before TRL's entropy bonus, its policy term before / accumulation steps, the per-token
    KL or None, the loss type's metrics), as TRL's _compute_loss: the loss type's per-token loss, off-policy sequences
    (DeepSeek-V3.2's mask) and tokens outside the entropy mask dropped, plus beta x the k3 KL, then normalised."""
    log_ratio = logps - old_logps
    if c.importance_sampling_level == "sequence":  # GSPO: the mean log-ratio of the sequence
        log_ratio_used = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif c.importance_sampling_level == "token":
        log_ratio_used = log_ratio
    else:
        raise ValueError(f"importance_sampling_level is {c.importance_sampling_level!r}; choose token or sequence.")
    if c.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type is {c.loss_type!r}; choose one of {list(LOSS_TYPES)} (LOSS_TYPES, section 4).")
    loss_type, ratio = LOSS_TYPES[c.loss_type], log_ratio_used.exp()
    per_token, metrics = loss_type.per_token(LossInputs(logps, advantages, mask, log_ratio, ratio, sampler_weights), c)
    if c.off_policy_mask_threshold is not None:
        per_token = per_token * GRPOTrainer.get_off_policy_mask(
            advantages, logps, old_logps if sampling_logps is None else sampling_logps, mask, c.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    kl = None
    beta = c.beta if beta is None else beta  # the trainer's `beta` (TRL's attribute, which a schedule may move)
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        kl = kl * ratio if c.use_bias_correction_kl else kl
        per_token = per_token + beta * kl
    term = loss_type.normalise(per_token * mask, mask, w)
    return (term if loss_type.per_window else term / w.accumulation), term.detach(), kl, metrics


def zero_signal_scale(loss_type: str, items: torch.Tensor, informative_items: torch.Tensor,
                      rows: torch.Tensor, informative_rows: torch.Tensor) -> torch.Tensor:
    """() factor on one generation batch's advantages that takes groups without signal out of the policy term's
    normaliser, from its loss tokens and rows, all and informative (all processes). Exact, as every policy term is
    linear in a positively scaled advantage (docs/guide.md, "The algorithm's choices"); no signal at all: 1."""
    counted = LOSS_TYPES[loss_type].zero_signal if loss_type in LOSS_TYPES else None
    if counted is None:
        raise ValueError(f"`loss_type: {loss_type}` has no normaliser that `mask_zero_advantage_groups` makes "
                         "exact; set `mask_zero_advantage_groups: false`, or use one of "
                         f"{[name for name, t in LOSS_TYPES.items() if t.zero_signal]}.")
    total, kept = (rows, informative_rows) if counted == "rows" else (items, informative_items)
    total, kept = total.float(), kept.float()
    return torch.where(kept > 0, total / kept.clamp(min=1e-9), torch.ones_like(total))


# ALGO LOGIC ends (the trainer's stages, section 7, call it in order)

# ------------------------------------------------------------------------------------------------
# 5. The vLLM server client: token ids in; sampled ids, their logprobs and a finish reason out.
# The in-process backend, TransformersBackend, is in engine/sampling.py; make_backend (section 8) picks one by name.
# ------------------------------------------------------------------------------------------------
class VLLMServerClient(ServerImages, ServerEndpoints):
    """Token-in/token-out client of vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`).
    Each env round sends all live conversations as a few batched `/v1/completions` requests (a prompt with images: one
    `/inference/v1/generate` request, engine/server_images.py), `vllm_max_concurrent_requests` at a time; each has a
    timeout, and connection errors, 5xx and aborted completions are retried with backoff, then raised: the client never
    returns a made-up completion. It keeps the server's weights equal to the policy's (`sync_weights`), and checks."""

    external = True  # another engine samples: the trainer corrects for the mismatch
    can_submit = True

    def __init__(self, *, base_url: str, params: SamplingParams, eos_token_ids: list[int] | None = None,
                 stop_strings: list[str] | None = None, startup_timeout: float = 240.0,
                 request_timeout: float = 600.0, max_concurrent_requests: int = 16, max_retries: int = 3,
                 prompts_per_request: int = 64, weight_sync: WeightSyncConfig | None = None,
                 probes: Probes | None = None, tie_rule: str = "auto", vision=None):
        self.base_url = base_url.rstrip("/")
        self.eos_token_ids = list(eos_token_ids or [])
        self.stop_strings = list(stop_strings or [])
        self.request_timeout, self.max_retries = request_timeout, max_retries
        self.max_concurrent_requests, self.prompts_per_request = max_concurrent_requests, prompts_per_request
        self.aborted_requests = 0  # completions the server aborted, then retried (a metric)
        self.http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(request_timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=max_concurrent_requests))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="vllm-http")
        wait_for_health(self.http, self.base_url, startup_timeout)
        model = self.http.get("/v1/models").raise_for_status().json()["data"][0]
        self.model_name = model["id"]  # what requests sample; with LoRA adapter sync, the newest adapter's name
        self.base_model_name = model["id"]
        self.max_model_len = model.get("max_model_len")
        # refuses raw logprobs; the tie rule of the server's truncation, which the trainer's scoring reproduces
        self.params = replace(params, ties=server_sampler(self.http, self.base_url, tie_rule,
                                                          trainer_has_cuda=torch.cuda.is_available()))
        score = lambda model, *ids, processed, kept=None: policy_sampler_logprobs(  # noqa: E731
            model, *ids, self.params if processed else SamplingParams(suppress=self.params.suppress), None, kept)
        self.weights = WeightSync(self, weight_sync or WeightSyncConfig(), probes, score_sampled=score)
        self.check_images(vision)  # a vision-language policy: the server must take images with token ids

    # -- HTTP: bounded waits and retries (base/completions.py) ----------------------------------------
    def post(self, path: str, body: dict, parse: Callable[[dict], object] | None = lambda r: r):
        """POST with bounded retries (base/completions.post_with_retries); `parse` None: the response is text."""
        return post_with_retries(self.http, self.base_url, path, body, parse, self.max_retries)

    # -- generation --------------------------------------------------------------------------------
    def another_round(self, has_work: bool) -> bool:
        return has_work  # the server batches on its own; ranks need not wait for each other

    def submit(self, prompts: list[list[int]], max_tokens: int, n: int = 1,
               params: SamplingParams | None = None, images: list[list] | None = None) -> concurrent.futures.Future:
        """One /v1/completions request, in the background: a Future of len(prompts) * n samples,
        prompt-major. The per-episode scheduler keeps `max_concurrent_requests` of these in flight."""
        check_length(self.max_model_len, prompts, [max_tokens] * len(prompts))  # vLLM would shorten it
        if images:  # one request per prompt, its images beside it (engine/server_images.py)
            return self.submit_images(prompts, images, [max_tokens] * len(prompts), n, params or self.params)
        return self.pool.submit(
            lambda: [s for row in self._complete(prompts, max_tokens, n, params or self.params) for s in row])

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1,
                 params: SamplingParams | None = None, images: list[list] | None = None) -> list[Sample]:
        check_length(self.max_model_len, prompts, max_tokens)
        if images:
            return self.submit_images(prompts, images, max_tokens, n, params or self.params).result()
        # Requests carry one max_tokens each, so group prompts by their limit, then chunk.
        by_limit: dict[int, list[int]] = {}
        for i, m in enumerate(max_tokens):
            by_limit.setdefault(m, []).append(i)
        jobs = [(m, idx[k : k + self.prompts_per_request]) for m, idx in by_limit.items()
                for k in range(0, len(idx), self.prompts_per_request)]
        futures = [self.pool.submit(self._complete, [prompts[i] for i in idx], m, n, params or self.params)
                   for m, idx in jobs]
        out: list[Sample | None] = [None] * (len(prompts) * n)
        for (m, idx), future in zip(jobs, futures):
            for j, samples in zip(idx, future.result()):
                out[j * n : (j + 1) * n] = samples
        return out

    def completion_body(self, prompts: list[list[int]], max_tokens: int, n: int, p: SamplingParams) -> dict:
        body = {"model": self.model_name, "prompt": prompts, "max_tokens": max_tokens, "n": n,
                "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,  # top_k 0 = off in both
                "min_p": p.min_p, "repetition_penalty": p.repetition_penalty, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "stop": self.stop_strings, "stop_token_ids": self.eos_token_ids,
                "include_stop_str_in_output": True, "skip_special_tokens": False, "return_token_ids": True,
                "logprobs": 0, **self.never_sampled}  # a vision policy's placeholders (engine/server_images.py)
        if asked := kept_set_logprobs(p.top_p, p.top_k, p.min_p):  # the sampler's kept sets (base/completions.py)
            body.update(logprobs=asked, return_tokens_as_token_ids=True)
        if p.seed is not None:  # leave unset in training: vLLM gives sample j of every prompt seed + j
            body["seed"] = p.seed
        return body

    def _complete(self, prompts: list[list[int]], max_tokens: int, n: int,
                  p: SamplingParams, **body) -> list[list[Sample]]:  # body: request fields over completion_body's
        body = {**self.completion_body(prompts, max_tokens, n, p), **body}
        asked = body["logprobs"] if body.get("return_tokens_as_token_ids") else 0  # the kept sets' top logprobs

        def parse(response):
            try:
                return parse_completions_response(response, len(prompts), n, asked, p.top_k)
            except RetryableResponse:
                self.aborted_requests += 1
                raise

        return self.post("/v1/completions", body, parse)

    # -- weight sync: the logic and the server's endpoints (ServerEndpoints) are in engine/weight_sync.py --------
    def sync_weights(self, model, accelerator) -> dict:
        """Give the server the current policy and check that it took (WeightSync). Returns `sync/...` metrics."""
        return self.weights(model, accelerator)


# ------------------------------------------------------------------------------------------------
# 6. Multi-turn env: the generate/step loop
# ------------------------------------------------------------------------------------------------
_SENTINEL = "\x00MT_GRPO_TURN_END\x00"  # marks where the model's turn ends in a template render


class MultiTurnToolEnv:
    """Advances a batch of conversations together: each round makes one batched generation call for
    every live conversation, parses each turn with the protocol, runs the tool calls concurrently and
    appends the replies. The budget `max_completion_length` covers model and env tokens together."""

    def __init__(self, *, tokenizer, protocol: Protocol, tools: list[Callable], max_env_steps: int | None,
                 max_tokens_per_turn: int | None, max_completion_length: int, max_tool_response_tokens: int | None,
                 tool_timeout: float = 10.0, tool_max_workers: int | None = None,
                 tokenization_check: str = "ignore_whitespace", few_shot: bool = False,
                 chat_template_kwargs: dict | None = None, eos_token_ids: list[int] | None = None,
                 scheduler: str = "auto", task_prompt: str | None = None, examples=None, environments=None,
                 turn_samples: str = "interleaved", questions: bool = True, reset_timeout: float | None = None,
                 max_prompt_length: int | None = None, max_user_turns: int | None = None):
        self.tokenizer, self.protocol, self.vision = tokenizer, protocol, Vision.of(tokenizer)  # images: engine/vision.py
        self.scheduler = scheduler  # rounds | per_episode | auto (per_episode when the backend can submit requests)
        self.tools = {fn.__name__: fn for fn in tools}
        self.template_tools = protocol.template_tools(tools)
        self.toolset = Toolset(self.tools, self.template_tools)
        self.environments = environments  # environments.EnvironmentPool: an instance per episode, reset with its row
        self.max_env_steps = max_env_steps if max_env_steps is not None else math.inf  # None: TRL's no limit
        self.max_user_turns = max_user_turns if max_user_turns is not None else math.inf  # respond's replies
        self.max_tokens_per_turn = max_tokens_per_turn or max_completion_length  # None: only the budget
        self.max_completion_length = max_completion_length
        self.max_tool_response_tokens = max_tool_response_tokens or max_completion_length  # None: the budget's
        self.tool_timeout, self.reset_timeout = tool_timeout, reset_timeout or tool_timeout
        self.tool_max_workers = tool_max_workers
        self.fit = None if max_prompt_length is None or environments is None else \
            prompt_fitter(self.render_ids, tokenizer, max_prompt_length)  # an environment's observation, cut to fit
        self.tokenization_check = tokenization_check
        check_turn_samples(turn_samples)  # a wrong value fails here, naming the choices, not at the first tool turn
        self.turn_samples = turn_samples  # interleaved | per_model_turn | auto (base/turn_samples.py)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # the system prompt's task part and the worked examples (protocol.build_prompt): the task's, not the protocol's
        self.prompt_parts = dict(tools=tools, task_prompt=task_prompt, examples=examples, few_shot=few_shot,
                                 questions=questions)  # questions: answered in <answer> (protocol.build_prompt)
        # Every id that ends a model turn (Qwen2.5-Instruct has two); see record_env_turn.
        self.eos_token_ids = list(dict.fromkeys([*(eos_token_ids or []), tokenizer.eos_token_id]))

    # -- rendering: the one place the chat template is applied ---------------------------------------
    def prompt(self, prompt: str | list[dict], tools: list[Callable] | None = None) -> list[dict]:
        """The chat prompt of a question, or of a TRL prompt (text, messages): system, examples, question (`tools`: an
        environment's, when they are not the env's)."""
        return build_prompt(self.protocol, prompt=prompt, **{**self.prompt_parts, **({"tools": tools} if tools else {})})

    def render(self, messages: list[dict], add_generation_prompt: bool = False, toolset: Toolset | None = None) -> str:
        return self.tokenizer.apply_chat_template(self.protocol.template_messages(messages), tokenize=False,
            tools=(toolset or self.toolset).template_tools, add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs)

    def render_ids(self, messages: list[dict], add_generation_prompt: bool = False,
                   toolset: Toolset | None = None) -> list[int]:
        """Token ids of a render, text from outside (protocol.OUTSIDE_TEXT) as plain text (protocol.template_ids)."""
        render = lambda m: self.render(m, add_generation_prompt, toolset)  # noqa: E731
        return self.vision.expand(lambda: template_ids(self.tokenizer, render, messages), messages)  # images' placeholders

    def env_reply_ids(self, tool_messages: list[dict], last: bool = False) -> list[int]:
        """Token ids that follow a model turn when the env replies `tool_messages`: the template's end
        of the assistant turn, the reply, and the next generation prompt (none after the `last` reply). Rendered
        against a fixed base conversation, so the cost does not grow with the episode."""
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": _SENTINEL, "tool_calls": []}]
        after = lambda m: (t := self.render(m, not last))[t.rindex(_SENTINEL) + len(_SENTINEL):]  # noqa
        return self.vision.expand(lambda: template_ids(self.tokenizer, after, base + tool_messages), tool_messages)

    def truncate_tool_output(self, text: str) -> str:  # cut by characters first: a 10 MB output is not tokenized whole
        return cut_tool_output(text, self.tokenizer, self.max_tool_response_tokens)

    # -- the loop ----------------------------------------------------------------------------------
    def rollout(self, prompts: list[list[dict]], backend, params: SamplingParams | None = None,
                progress: bool = False, rows: list[dict] | None = None) -> list[Episode]:
        """Episodes for `prompts` (groups of identical prompts arrive together, as GRPO sends them).
        `progress`: a progress bar of finished episodes and tool calls in flight. `rows`: the dataset rows, which
        reset each episode's environment instance (`environments`; it appends its observation to the prompt)."""
        prompts, toolsets = self.vision.with_row_images(prompts, rows), [self.toolset] * len(prompts)  # TRL's image columns
        if self.environments is not None:
            prompts, toolsets = self.environments.start(rows, prompts, self.reset_timeout, self.fit)
        episodes = [Episode(self.render_ids(p, True, ts), toolset=ts, prompt_messages=p,
                            stop_reason="reset_timeout" if ts.stuck else "") for p, ts in zip(prompts, toolsets)]
        bar = RolloutProgress(len(episodes), progress)
        if self.scheduler == "per_episode" and not backend.can_submit:
            raise ValueError("`rollout_scheduler: per_episode` needs a backend that takes requests one at a time "
                             "(`generation_backend: vllm_server`); in-process generation runs in rounds.")
        if backend.can_submit and self.scheduler != "rounds":
            run_per_episode(self, episodes, backend, params, bar)  # rollout/scheduling.py
        else:
            self._rounds(episodes, backend, params, bar)
        bar.close()
        check_tokenization(self, prompts, episodes, self.tokenization_check)
        return episodes

    def _rounds(self, episodes: list[Episode], backend, params: SamplingParams | None, bar: "RolloutProgress") -> None:
        """Lock-step rounds: every live conversation takes one turn per round, in one batched generate
        call (what an in-process model needs). Every rank runs the same number of rounds when the backend
        asks for it (backend.another_round)."""
        first = True
        while backend.another_round(bool(live := [ep for ep in episodes if not ep.done])):
            stop_point()  # SIGTERM on one process: the step is dropped (run/reporting.stoppable)
            budgets = [self.budget(ep) for ep in live]
            samples = self._generate(backend, live, budgets, first, params)
            first = False
            pending = [(ep, calls) for ep, sample in zip(live, samples)
                       if (calls := self.record_model_turn(ep, sample)) is not None]
            bar.update(episodes, tool_calls=sum(len(calls) for _, calls in pending))
            results = run_turns([(ep.toolset, calls) for ep, calls in pending], self.tool_timeout,
                                self.tool_max_workers)
            for (ep, calls), turn_results in zip(pending, results):
                self.record_env_turn(ep, calls, turn_results)
            bar.update(episodes, tool_calls=0)

    def budget(self, ep: Episode) -> int:
        return min(self.max_tokens_per_turn, self.max_completion_length - ep.context_length)

    def _generate(self, backend, live: list[Episode], budgets: list[int], first: bool,
                  params: SamplingParams | None) -> list[Sample]:
        seqs = [ep.context_ids for ep in live]
        # First turn: the batch holds groups of identical prompts (ids and images); ask for n samples of each.
        n = run_length([self.vision.request_key(ep) for ep in live]) if first and len(set(budgets)) == 1 else 1
        samples = backend.generate(seqs[::n], budgets[::n], n=n, params=params, **self.vision.generation_images(live[::n]))
        if len(samples) != len(live):
            raise RuntimeError(f"generation backend returned {len(samples)} samples for "
                               f"{len(live)} conversations")
        return samples

    def record_model_turn(self, ep: Episode, sample: Sample) -> list[ToolCall] | None:
        """Append the sampled tokens as they are; return the tool calls to run, or None when the episode
        ends."""
        ep.append("model", sample.token_ids, sample.logprobs, sample.kept)
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        turn = self.protocol.parse(text)
        add_model_message(ep, text, [tool_call_message(c.name, c.arguments) for c in turn.calls if not c.error])
        if turn.kind == "answer":
            ep.stop_reason = "answer"
        elif sample.finish_reason == "length":  # its calls are not run (TRL runs a budget-cut one: logged once)
            ep.stop_reason = length_stop(ep, turn, self.max_completion_length)
        elif sample.finish_reason == "repetition":
            ep.stop_reason = "repetition"
        elif turn.kind == "none":
            ep.stop_reason = "no_action"
        elif len({c.turn for c in ep.calls}) >= self.max_env_steps:  # tool turns run (user turns are no steps)
            ep.stop_reason = "max_env_steps"  # these calls are not run
        else:
            return turn.calls
        return ask_user(self, ep)  # rollout/user_turns.py: a UserTurn when the environment replies as the user

    def record_env_turn(self, ep: Episode, calls: list[ToolCall], results: list[ToolResult]) -> None:
        if isinstance(calls, UserTurn):
            return record_reply(self, ep, calls, results[0])
        messages = [{"role": "tool", "name": "" if c.error else c.name,  # a failure as the protocol shows it
                     "content": self.truncate_tool_output(self.protocol.tool_reply(r)),  # tool_output's step reward:
                     **({} if r.reward is None else {"reward": r.reward})} for c, r in zip(calls, results)]
        turn, done = ep.tool_turns, environment_done(getattr(ep.toolset, "environment", None))
        if self.append_reply(ep, messages, last=done):
            ep.calls += [CallRecord(turn, c.name, c.arguments, r.ok, r.seconds, m["content"])
                         for c, r, m in zip(calls, results, messages)]
            ep.stop_reason = "env_done" if done else ""

    def append_reply(self, ep: Episode, messages: list[dict], last: bool = False) -> bool:
        """Append the environment's reply to the model's turn (tool results, or a user message; the `last` without
        a generation prompt); False when it does not fit the budget (the episode ends)."""
        ids = self.env_reply_ids(messages, last)
        # The model may have closed its turn itself with an end-of-turn id; the template's close must not repeat it.
        if ep.completion_ids and ids and ep.completion_ids[-1] == ids[0] and ids[0] in self.eos_token_ids:
            ids = ids[1:]
        # the next sample's prompt where the template renders the history otherwise (base/turn_samples.py)
        prompt = None if last else next_sample_prompt(self.turn_samples, ep.context_ids, ids, lambda: self.render_ids(
            ep.prompt_messages + ep.messages + messages, add_generation_prompt=True, toolset=ep.toolset))
        if (len(prompt) if prompt is not None else len(ep.context_ids) + len(ids)) - len(ep.prompt_ids) \
                >= self.max_completion_length:  # the reply does not fit with a token left to answer
            ep.stop_reason = "budget"
            return False
        ep.messages += messages
        if prompt is not None:
            ep.sample_starts.append((len(ep.completion_ids), len(ep.messages)))
        ep.append("env", ids if prompt is None else prompt)
        return True

    def release(self, episodes: list[Episode]) -> None:
        if self.environments is not None:
            self.environments.release([ep.toolset for ep in episodes])

# ------------------------------------------------------------------------------------------------
# 7. Trainer
# ------------------------------------------------------------------------------------------------
@dataclass
class Scores:
    """Rewards of the whole generation batch (gathered from every process)."""

    turn_per_func: torch.Tensor  # (B, F_turn, K): K = 1 (the episode's), or one column per tool turn (per_turn)
    outcome_per_func: torch.Tensor  # (B, F_outcome)
    R_T: torch.Tensor  # (B, K) weighted turn reward (NaN: not applicable, or no such tool turn)
    R_O: torch.Tensor  # (B,) weighted outcome reward


class MTGRPOEnvTrainer(TrainerReports, LossTerms, GRPOTrainer):
    """GRPOTrainer whose rollouts are multi-turn episodes and whose advantages are per token. Its metrics and
    recorded rollouts (`_log`, `_record_rollout`) are written by TrainerReports (run/reporting.py); TRL's terms around
    the policy loss (entropy bonus, auxiliary loss, the loss metrics) by LossTerms (run/loss_terms.py)."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools: list | None = None,
                 rollout_func=None, environment_factory=None, *, turn_reward_funcs: list | None = None,
                 outcome_reward_funcs: list | None = None, env: "MultiTurnToolEnv | None" = None, backend=None,
                 script_args: MTGRPOScriptArguments | None = None, eval_metric_funcs: dict[str, Callable] | None = None,
                 corpus: list[dict] | None = None, agent=None):
        """TRL's GRPOTrainer's arguments, in its order (run/builders.py says what each may be). `reward_funcs` join the
        outcome rewards, those marked @per_tool_turn the turn rewards. `args`: an MTGRPOConfig (a plain GRPOConfig
        takes ours from `script_args`); the trainer keeps a copy. Without `env`, the env, tools and prompts are built
        from the config. `backend`: a backend, a function env -> backend, or None (`generation_backend`)."""
        args = trainer_config(args, script_args, model)  # the trainer's own MTGRPOConfig; the caller's stays as given
        score_labelled_tokens_only()
        check_trl(reward_processing_classes=reward_processing_classes, rollout_func=rollout_func)
        check_training_args(args, LOSS_TYPES)
        configured = backend is None
        if configured:  # the configured one's capabilities, before it connects; a given one's below
            check_backend(args, peft_config, backend_class(args))
        weights, step_rewards = (args.turn_reward_weights, args.outcome_reward_weights), False
        if env is None:  # the Python API and the recipe: build from the config
            from mt_grpo.run import builders

            parts, env, train_dataset, eval_dataset = builders.build_from_config(
                model, args, make_env, train_dataset=train_dataset, eval_dataset=eval_dataset, tools=tools,
                turn_reward_funcs=turn_reward_funcs, outcome_reward_funcs=outcome_reward_funcs, corpus=corpus,
                processing_class=processing_class, environment_factory=environment_factory, reward_funcs=reward_funcs,
                agent=agent)
            processing_class, turn_reward_funcs, outcome_reward_funcs = parts.tokenizer, parts.turn_funcs, parts.outcome_funcs
            eval_metric_funcs = parts.eval_metrics if eval_metric_funcs is None else eval_metric_funcs
            weights, step_rewards = parts.weights, parts.step_rewards  # the environment's functions weigh 1
        self.advantage_mode = resolve_advantage_mode(args.advantage_mode, bool(turn_reward_funcs), step_rewards)
        check_reward_sources(args, self.advantage_mode, ADVANTAGE_MODES[self.advantage_mode].credits_turns,
                             turn_reward_funcs, outcome_reward_funcs)
        args.metric_for_best_model = check_best_metric(args, turn_reward_funcs, outcome_reward_funcs,
                                                       list(eval_metric_funcs or {}))
        if backend is None or not hasattr(backend, "generate"):
            backend = backend(env) if backend is not None else make_backend(args, env)
        if not configured:  # a backend given (or made by a given function): what it can do, not what the config says
            check_backend(args, peft_config, backend)
        # TRL sees every reward function (for its bookkeeping); we score them ourselves, once each, with the weights
        # of their kind (TRL's `reward_weights` weigh `reward_funcs` only: run/builders.reward_lists split them). On the
        # trainer's copy of the config: the caller's is never changed
        trl_weights, args.reward_weights = args.reward_weights, None
        super().__init__(model=model, reward_funcs=turn_reward_funcs + outcome_reward_funcs, args=args,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config)
        args.reward_weights = trl_weights
        self.env, self.backend = env, backend
        self.packing = PackedForward(args, self.accelerator.autocast, self._metrics)
        self.advantage = {mode: AdvantageSettings(self.advantage_mode, self._episodes_per_prompt(mode), args)
                          for mode in ("train", "eval")}  # section 3's settings, one object each
        self.turn_reward_funcs = turn_reward_funcs
        self.outcome_reward_funcs = outcome_reward_funcs
        self.eval_metric_funcs = dict(eval_metric_funcs or {})  # the task's: eval/<name> = share of episodes > 0
        # one weight per function; those an environment adds after the caller's (rollout/environments.py) weigh 1.0
        self.turn_weights, self.outcome_weights = (torch.tensor([*(w or []), *[1.0] * (len(f) - len(w or []))])
                                                   for w, f in zip(weights, (turn_reward_funcs, outcome_reward_funcs)))
        self._synced_step = -1
        self._rollouts = 0  # rollouts made so far (save_rollouts_steps counts them)
        self._async = (
            AsyncRollouts(PromptStream(train_dataset, self.num_generations, args, self.accelerator),
                          roll_out=lambda prompts, rows: self.env.rollout(prompts, self.backend, rows=rows),
                          sync=self._sync_weights, version=lambda: self.state.global_step)
            if args.async_rollout else None
        )
        self._first_generation: int | None = None  # set at this run's first generation (async_rollout)
        check_distributed_generation(backend, self.accelerator, args, env)
        install_console(self, args.max_train_minutes, args.stop_timeout)  # SIGTERM, time budget, one line per step (run/reporting.py)

    # -- one generation batch: sync, roll out, score, advantages, correct, log ------------------------
    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        mode = "train" if self.model.training else "eval"
        inputs, episodes, seconds = self._roll_out(inputs, mode)  # 1-2. sync the sampler; multi-turn episodes
        scores = self._score([x["prompt"] for x in inputs], episodes, inputs)  # 3. rewards of all processes
        if mode == "train" and self.args.dynamic_sampling:  # groups without signal: new questions
            inputs, episodes, scores, seconds = resample_groups(  # rollout/dynamic_sampling.py, with these stages
                self, inputs, episodes, scores, seconds, roll_out=self._roll_out, score=self._score,
                has_signal=self._has_signal)
        prompts = [x["prompt"] for x in inputs]
        batch = self._tensors(episodes)  # 4. padded ids and masks, old and reference logprobs
        adv = self._advantages(scores, batch, mode)  # 5. MT-GRPO advantages; groups without signal masked
        weights = self._correct_for_sampler(batch, mode)  # 6. importance weights of an external sampler
        self._log(mode, prompts, episodes, scores, adv, seconds)  # 7. metrics and the completions table
        self._record_rollout(inputs, episodes, scores, adv, batch, weights)  # 8. rollouts/step-N.jsonl
        self.env.release(episodes)  # their environment instances, if any, serve the next episodes
        batch.pop("token_turns")
        return batch

    def _has_signal(self, scores: Scores) -> torch.Tensor:
        """(groups,) True where a group gives some token a non-zero advantage: what dynamic sampling keeps."""
        return groups_with_signal(scores.R_T, scores.R_O, self.advantage["train"])

    def _progress(self) -> bool:
        return not self.args.disable_tqdm and self.accelerator.is_main_process

    def _generate_every(self) -> int:
        """Micro-steps between generations: TRL generates when `_step` is a multiple of it."""
        return self.args.steps_per_generation * self.num_iterations

    def _episodes_per_prompt(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _sync_weights(self) -> None:
        """Before a rollout that follows an optimizer step (and once at start), give the sampler the policy."""
        if self.state.global_step == self._synced_step:
            return
        metrics = self.backend.sync_weights(self.model_wrapped, self.accelerator)
        self._synced_step = self.state.global_step
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)

    def _roll_out(self, inputs: list[dict], mode: str) -> tuple[list[dict], list[Episode], float]:
        """The generation batch's episodes. Synchronous: sync the weights, then roll out `inputs`.
        async_rollout: the batch was rolled out in the background (AsyncRollouts), from its prompt stream."""
        if self._async is not None and mode == "train":
            if self._first_generation is None:
                self._first_generation = first_generation(self.state.global_step,
                                                          self.args.gradient_accumulation_steps, self._generate_every())
            return self._async.next(generation_index(self._step, self._generate_every(), self._first_generation))
        self._sync_weights()
        t0 = time.perf_counter()
        episodes = self.env.rollout([x["prompt"] for x in inputs], self.backend, progress=self._progress(), rows=inputs)
        for ep in episodes:
            ep.policy_version = self.state.global_step
        return inputs, episodes, time.perf_counter() - t0

    def _tensors(self, episodes: list[Episode]) -> dict:
        """Padded ids and masks, the sampler's logprobs, and the old / reference logprobs the loss needs."""
        batch = pad_episodes(episodes, self.processing_class.pad_token_id,
                             self.args.mask_truncated_completions, self.pad_to_multiple_of)
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        batch["sampling_per_token_logps"] = batch.pop("sampler_logps")  # TRL's name (off-policy masking reads it)
        self._add_old_and_ref_logps(batch, batch.pop("sampler_kept", None))
        return batch

    def _add_old_and_ref_logps(self, batch: dict, sampler_kept: torch.Tensor | None = None) -> None:
        """Logprobs of the sampled tokens under the current policy (when the loss or the sampler
        correction needs them) and under the reference model (when beta > 0)."""
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        T, bs = batch["completion_ids"].shape[1], self.args.per_device_train_batch_size
        frame = self.args.off_policy_mask_threshold is not None and self.backend.params.truncates  # its frame: below
        need_old = (self.args.gradient_accumulation_steps % self._generate_every() != 0 or self._corrects_sampler()
                    or frame)
        logps = lambda model: self._get_per_token_logps_and_entropies(  # noqa: E731
            model, ids, attention, T, batch_size=bs)[0]
        with torch.no_grad(), self.packing.row_samples(batch["sample_starts"], images=batch.get("images")):
            if need_old:
                batch["old_per_token_logps"] = logps(self.model)
            if self._corrects_sampler() or frame:  # pi_trainer of the distribution the sampler drew from
                if self.backend.params.truncates:  # IS weights and off-policy mask: engine/sampling.py
                    with self.accelerator.autocast():
                        batch.update(sampled_distribution_logps(self.model, batch, self.backend.params, sampler_kept))
                else:  # the softmax at the temperature: what TRL's logprobs already are
                    batch["trainer_sampler_logps"] = batch["old_per_token_logps"]
            if self.beta != 0.0 and self.ref_model is not None:
                batch["ref_per_token_logps"] = logps(self.ref_model)
            elif self.beta != 0.0:  # PEFT: the reference is the policy with its adapter off (as TRL does)
                peft_model = self.accelerator.unwrap_model(self.model)
                with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
                    batch["ref_per_token_logps"] = logps(self.model)

    def _corrects_sampler(self) -> bool:
        return self.backend.external and self.args.vllm_importance_sampling_correction

    def _score(self, prompts: list, episodes: list[Episode], inputs: list[dict], all_processes: bool = True,
               turns: int | None = None) -> Scores:
        """Each reward function once, on this process's samples; then gathered, since groups may span
        processes and are normalised over the whole generation batch (`all_processes`; evaluation keeps its
        own). `turns`: columns of the turn rewards (default: one per tool turn in per_turn mode, else 1)."""
        device = self.accelerator.device
        collect = gather if all_processes else (lambda x: x)  # noqa: E731
        completions = [ep.messages for ep in episodes]
        # the dataset's columns and TRL's keywords: `environments` (rollout/environments.py), completion_ids, and the batch's
        columns = {**episode_columns(inputs, episodes), "completion_ids": [ep.completion_ids for ep in episodes]}
        keywords = dict(trainer_state=self.state, log_extra=self._log_completion_extra, log_metric=self._log_metric)
        tool_turns = [ep.tool_turns for ep in episodes]
        longest = lambda: collect(torch.tensor([max(tool_turns, default=0)], device=device)).max().item()  # noqa: E731
        K = turns or (longest() + 1 if ADVANTAGE_MODES[self.advantage_mode].turn_columns else 1)  # per_turn: a column per
        # model turn of the batch's longest episode, its final one's too (over every process: all gather or none)
        turn = collect(compute_rewards_per_func(self.turn_reward_funcs, prompts, completions, columns,
                                               tool_turns, K, keywords).to(device))
        outcome = collect(compute_rewards_per_func(self.outcome_reward_funcs, prompts, completions,
                                                  columns, keywords=keywords).to(device))
        if not self.turn_reward_funcs:
            R_T = torch.zeros(len(turn), K, device=device)
        else:  # per_turn: a column per tool turn; every mode: turn 0 for everyone, with or without a tool call
            R_T = turn_reward_table(turn, self.turn_weights.to(device),
                                        collect(torch.tensor(tool_turns, device=device)),
                                        [is_per_tool_turn(fn) for fn in self.turn_reward_funcs])
        R_O = weighted_reward(outcome, self.outcome_weights.to(device)) if self.outcome_reward_funcs else \
            torch.zeros(len(R_T), device=device)
        return Scores(turn_per_func=turn, outcome_per_func=outcome, R_T=R_T, R_O=R_O)

    def _advantages(self, scores: Scores, batch: dict, mode: str) -> Advantages:
        """Normalised over the whole generation batch; this process keeps the per-token advantages of its
        rows. Groups without signal leave the loss and its normaliser (mask_zero_advantage_groups)."""
        B, rank, a = len(batch["completion_ids"]), self.accelerator.process_index, self.args
        local = slice(rank * B, (rank + 1) * B)
        adv = mt_grpo_advantages(scores.R_T, scores.R_O, batch["token_turns"], self.advantage[mode], local=local)
        batch["advantages"] = adv.tokens
        mask = loss_mask(batch)
        informative = adv.informative[local].to(mask.dtype)  # (B_local,)
        counts = self.accelerator.gather(torch.stack([mask.sum(), (mask * informative[:, None]).sum(),
                                                      mask.new_tensor(B), informative.sum()]).view(1, 4)).sum(dim=0)
        batch["num_items_in_batch"] = counts[0]  # tokens, informative tokens, rows, informative rows
        if a.mask_zero_advantage_groups:  # one factor for the generation batch, read by _compute_loss
            batch["zero_signal_scale"] = zero_signal_scale(self.loss_type, *counts)
        return adv

    def _correct_for_sampler(self, batch: dict, mode: str) -> torch.Tensor | None:
        """Scale the advantages by the importance weights of an external sampler (vLLM), as TRL's
        `vllm_importance_sampling_*` fields say; log the trainer-vs-sampler mismatch per turn. Returns
        the (B, T) weights, or None when there is no correction (in-process, or the correction off)."""
        old, sampler = batch.pop("trainer_sampler_logps", None), batch["sampling_per_token_logps"]
        listed = batch.pop("sampler_kept_listed", None)
        if old is not None and self.backend.params.truncates and self.args.off_policy_mask_threshold is not None:
            # TRL's off-policy mask compares these with the untruncated policy: truncation alone would read as
            # a positive gap on every token, so move them to that frame (the mismatch itself is kept), always
            batch["sampling_per_token_logps"] = sampler - old + batch["old_per_token_logps"]
        if not self._corrects_sampler():
            return None
        mask = loss_mask(batch)
        weights = importance_weights(old, sampler, mask, self.args.vllm_importance_sampling_mode,
                                     self.args.vllm_importance_sampling_clip_min,
                                     self.args.vllm_importance_sampling_clip_max)
        if self.loss_type == "vespo":  # VESPO takes the weights into its sequence weight phi(w), not as a factor
            batch["importance_sampling_ratio"] = weights
        else:  # the weights are detached and >= 0: scaling A scales each token's clipped loss by the weight
            batch["advantages"] = batch["advantages"] * weights
        self._log_sampler_gap(mode, weights, mask, old, sampler, listed, batch["token_turns"])  # run/reporting.py
        return weights

    def _compute_loss(self, model, inputs):
        """The loss stage: the policy's logprobs (packed where asked), then section 4's `policy_loss` on them, with the
        advantages times the generation batch's zero_signal_scale; TRL's entropy bonus and auxiliary loss join it, and
        its metrics are logged (LossTerms)."""
        mode, mask = "train" if self.model.training else "eval", inputs["completion_mask"] * inputs["tool_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.packing.row_samples(inputs.get("sample_starts"), inputs["advantages"], inputs.get("images")):
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, ids, attention, mask.shape[1], compute_entropy=True, compute_aux_loss=self.aux_loss_enabled)
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile) \
                if self.top_entropy_quantile < 1.0 else None
        old = inputs.get("old_per_token_logps")  # None: the policy has not moved since the rollout (TRL's rule)
        advantages = inputs["advantages"] * inputs.get("zero_signal_scale", 1.0)  # the recorded ones stay unscaled
        loss, term, kl, metrics = policy_loss(
            logps, logps.detach() if old is None else old, advantages, mask, self.args, self._loss_window(inputs, mode),
            inputs.get("ref_per_token_logps"), inputs.get("sampling_per_token_logps"),
            inputs.get("importance_sampling_ratio"), entropy_mask, beta=self.beta)
        return self._loss_terms(mode, loss, term, entropies, mask, entropy_mask, aux_loss, kl, metrics)  # LossTerms

    def _loss_window(self, inputs: dict, mode: str) -> LossWindow:
        """The normalisers' counts, as TRL's: the window's micro-batches, and its loss tokens per process."""
        steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # evaluation accumulates none
        share = steps / self.args.steps_per_generation if mode == "train" else 1.0  # num_items spans the generation
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes * share  # batch
        return LossWindow(steps, tokens, self.args.max_completion_length)

    def train(self, *args, **kwargs):
        """TRL's training loop; a SIGTERM mid-rollout ends it with the last step's checkpoint (run/reporting.stoppable)."""
        return stoppable(self, super().train, *args, **kwargs)

    # -- forwards: packed tries where padding_free or per-turn samples ask for them (engine/packing.py) -----
    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        return self.packing.logps_and_entropies(super()._get_per_token_logps_and_entropies, model, *args, **kwargs)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        return super().get_high_entropy_mask(entropies, self.packing.signal_mask(mask), threshold)

    # -- evaluation: the same stages on the eval set; run/evaluation.py runs them and aggregates --------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval") -> dict[str, float]:
        """What `eval_strategy` runs, in place of TRL's loop (which scores single-turn completions)."""
        return evaluation.evaluate(self, eval_dataset)

    def run_evaluation(self, dataset=None) -> tuple[dict[str, float], list[dict]]:
        """(eval/... metrics, per-episode records): the sampler synced, episodes rolled out and scored by `_score`."""
        return evaluation.run_evaluation(self, dataset, sync=self._sync_weights, score=self._score,
                                         progress=self._progress(), async_rollouts=self._async)


# ------------------------------------------------------------------------------------------------
# 8. Wiring and main
# ------------------------------------------------------------------------------------------------
def trainer_config(args: GRPOConfig | None, script_args: "MTGRPOScriptArguments | None", model) -> "MTGRPOConfig":
    """The trainer's own MTGRPOConfig (one object: TRL's fields and ours): a copy of `args` (the caller's is never
    changed); a plain GRPOConfig gets ours from `script_args` (else their defaults), as the same object."""
    if args is None:
        return MTGRPOConfig(output_dir=f"{str(model).rstrip('/').split('/')[-1]}-MT-GRPO")
    config = copy.copy(args)
    if not isinstance(args, MTGRPOConfig):  # TRL's fields stay as its __post_init__ settled them
        config.__class__ = MTGRPOConfig
        ours = script_args or MTGRPOScriptArguments()
        for f in dataclasses.fields(MTGRPOScriptArguments):  # no name of ours is TRL's
            setattr(config, f.name, getattr(ours, f.name))
    return config


def make_env(args: "MTGRPOConfig", parts) -> MultiTurnToolEnv:
    """The env of a config, from what run/builders.py resolved (`parts`: tokenizer, tools, prompt parts)."""
    return agent_env(args, parts, MultiTurnToolEnv(  # an agent program's episodes wrap it (agents/runner.py)
        tokenizer=parts.tokenizer, protocol=get_protocol(args.tool_format, tokenizer=parts.tokenizer), tools=parts.tools,
        max_env_steps=next((n for n in (args.max_env_steps, args.max_tool_calling_iterations) if n is not None), None),
        max_tokens_per_turn=args.max_tokens_per_turn, max_completion_length=args.max_completion_length,
        max_tool_response_tokens=args.max_tool_response_tokens, max_user_turns=args.max_user_turns,
        tool_timeout=args.tool_timeout, tool_max_workers=args.tool_max_workers, tokenization_check=args.tokenization_check,
        reset_timeout=args.reset_timeout, max_prompt_length=args.max_prompt_length, few_shot=args.few_shot,
        chat_template_kwargs=args.chat_template_kwargs, eos_token_ids=parts.eos_token_ids, task_prompt=parts.task_prompt,
        scheduler=args.rollout_scheduler, examples=parts.examples, environments=parts.environments,
        turn_samples=args.turn_samples, questions=parts.questions))


def backend_class(args: "MTGRPOConfig") -> type:
    """The one place a backend is named (`generation_backend`); everything else asks it what it can do."""
    return TransformersBackend if args.generation_backend == "transformers" else VLLMServerClient


def make_backend(args: "MTGRPOConfig", env: MultiTurnToolEnv):
    params, stop_strings, eos_token_ids = SamplingParams.from_config(args), env.protocol.stop_strings, env.eos_token_ids
    if backend_class(args) is TransformersBackend:
        return TransformersBackend(tokenizer=env.tokenizer, params=params, eos_token_ids=eos_token_ids,
                                   stop_strings=stop_strings, gather_deepspeed3_params=args.ds3_gather_for_generation,
                                   cache_implementation=args.cache_implementation)
    client = lambda url: VLLMServerClient(base_url=url, params=params, eos_token_ids=eos_token_ids,  # noqa: E731
        stop_strings=stop_strings, startup_timeout=args.vllm_server_timeout, request_timeout=args.vllm_request_timeout,
        max_concurrent_requests=args.vllm_max_concurrent_requests, max_retries=args.vllm_max_retries,
        prompts_per_request=args.vllm_prompts_per_request, weight_sync=WeightSyncConfig.from_args(args),
        probes=Probes.render(env.render_ids), tie_rule=args.vllm_tie_rule, vision=env.vision)
    return ServerPool.connect(args, client)  # one server: its client; several: a pool that routes


def parse_args(argv: list[str] | None = None):
    """(args, args, model arguments), TRL's scripts' shape: the one MTGRPOConfig as script and training arguments."""
    args, model_args = parse_recipe(argv, MTGRPOConfig)
    return args, args, model_args


def build_trainer(argv: list[str] | None = None, backend_factory: Callable | None = None,
                  evaluation: bool = False) -> MTGRPOEnvTrainer:
    """The recipe's trainer, through the Python API: parse and check the recipe, then MTGRPOEnvTrainer builds the
    task, tools, rewards, env and backend from it. `backend_factory(env)` replaces the recipe's generation backend
    (tests use a scripted one). The eval set is loaded when `eval_strategy` is set, or with `evaluation`."""
    args, _, model_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    quiet_library_bars()  # no library progress bar where the output is a log, not a terminal (run/reporting.py)
    args.model_init_kwargs = {**(args.model_init_kwargs or {}), "dtype": model_args.dtype or "auto",  # as TRL's
                              "attn_implementation": model_args.attn_implementation,  # scripts set them
                              "revision": model_args.model_revision}
    from mt_grpo.run import builders  # here, not at the top: importing this file for its functions stays light

    held_out = builders.load_recipe_task(args, held_out=True) if evaluation and args.eval_strategy == "no" else None
    trainer = MTGRPOEnvTrainer(model_args.model_name_or_path, args=args, eval_dataset=held_out,
                               peft_config=get_peft_config(model_args), backend=backend_factory)
    if trainer.accelerator.is_main_process:
        logger.info("Training on %d processes (%s), generation: %s, tool format: %s.", trainer.accelerator.num_processes,
                    trainer.accelerator.distributed_type, args.generation_backend, trainer.args.tool_format)
    return trainer


def main(argv: list[str] | None = None):
    trainer = build_trainer(argv)
    resume = trainer.args.resume_from_checkpoint
    if resume == "last":
        resume = get_last_checkpoint(trainer.args.output_dir)
        if resume is None:
            raise SystemExit(f"--resume_from_checkpoint last: no checkpoint-* folder in "
                             f"{trainer.args.output_dir}.")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(trainer.args.output_dir)  # (train wrote trainer_state.json: run/reporting.stoppable)
    report_outputs(trainer)  # the output folder, the saved model, the recorded rollouts and the viewer's command
    end_processes(trainer)


if __name__ == "__main__":
    main()
