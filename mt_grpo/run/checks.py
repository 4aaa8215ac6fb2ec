"""Every config rule across fields in one place, with errors that name the field to change, and the TRL check. A
field's own allowed values are declared on it (`arg(..., choices=...)`, checked by fields.check_choices).
MTGRPOScriptArguments.__post_init__ calls check_script_args; the trainer calls the rest at start-up."""

import dataclasses
import inspect
import logging
import os
import warnings
from typing import Callable

import torch
from trl import GRPOConfig, GRPOTrainer

from mt_grpo.base.fields import check_choices, check_values, choices_of
from mt_grpo.run.reporting import eval_metric_names
from mt_grpo.rewards.judge import check_judge_args

logger = logging.getLogger("mt_grpo")


# TRL names mt_grpo_trainer.py relies on beyond GRPOTrainer's public API: the checklist for a TRL upgrade.
# `check_trl` verifies the version range and that each name still exists at start-up.
#   GRPOTrainer._generate_and_score_completions(inputs) -> batch   overridden: rollout, rewards, advantages
#   GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
#       batch_size=) -> (logps, entropies, aux_loss)               old, reference and probe logprobs
#   GRPOTrainer._compute_loss(model, inputs) -> loss   overridden: section 4's LOSS_TYPES (TRL's compute_loss calls it)
#   GRPOTrainer.get_off_policy_mask, get_gamma_weights (static), get_high_entropy_mask: the off-policy mask, VESPO's
#       weights and the entropy mask, called by the loss stage as TRL's _compute_loss calls them
#   GRPOTrainer state read by the loss stage (run/loss_terms.py): aux_loss_enabled, router_aux_loss_coef,
#       top_entropy_quantile, entropy_coef, use_adaptive_entropy, _entropy_bonus_enabled, _last_world_entropy,
#       _entropy_window_stats, current_gradient_accumulation_steps
#   GRPOTrainer._metrics[mode][name] (lists averaged by `log`), GRPOTrainer._logs (completions table)
#   GRPOTrainer._pending_extra_logs, _pending_metrics: what rewards logged through `log_extra` / `log_metric`, taken
#       (and emptied) by reporting.TrainerReports.take_reward_logs only
#   GRPOTrainer.num_generations / num_generations_eval / beta / ref_model / pad_to_multiple_of / loss_type (attributes)
#   GRPOTrainer._step (micro-steps of this run; _prepare_inputs generates when _step % (steps_per_generation x
#       num_iterations) == 0): async_rollout's batch index follows it
#   trl.trainer.utils._use_triton(device) -> bool   the fused LM head's switch to score labelled positions only
#   trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size, ...)
#       the fused LM head's kernel; chunk_size: the vocabulary columns of one tile (narrowed on CPU)
#   trl.trainer.utils.pad, trl.trainer.utils.use_adapter, trl.trainer.utils.nanstd (TRL's metrics, reporting.py),
#   trl.models.unwrap_model_for_generation,
#   trl.distributed.DistributedBackend (is_zero3, fsdp_version, summon_full_params)
#   transformers.Trainer._save_checkpoint(model, trial=None): run/reporting.stoppable saves the last finished step
#       on SIGTERM
TRL_TESTED_RANGE = ">=1.16.0,<1.17"
TRL_PRIVATE_NAMES = ("_generate_and_score_completions", "_get_per_token_logps_and_entropies", "_compute_loss",
                     "get_off_policy_mask", "get_gamma_weights", "get_high_entropy_mask")



def settle_training_defaults(config) -> None:
    """MTGRPOConfig's two moves of TRL's training defaults, before GRPOConfig checks them. Activation checkpointing
    keeps TRL's default, on, under transformers' new name (TRL sets the deprecated `gradient_checkpointing`, and every
    run printed transformers' warning; a recipe may use either name). Without a GPU, no pinned memory: torch's
    DataLoader warned of it on every CPU run, for nothing."""
    old, new = config.gradient_checkpointing, config.activation_checkpointing
    if old is not None and new is not None and old != new:
        raise ValueError(f"`gradient_checkpointing` ({old}) and `activation_checkpointing` ({new}) disagree; "
                         "they are one setting: keep `activation_checkpointing` only.")
    config.activation_checkpointing = next((v for v in (new, old) if v is not None), True)
    config.gradient_checkpointing = None
    if not torch.cuda.is_available() and not (getattr(torch, "xpu", None) and torch.xpu.is_available()):
        config.dataloader_pin_memory = False


def check_script_args(args) -> None:
    """MTGRPOScriptArguments' own rules (its __post_init__ calls this), with errors that name the field. The reward
    weights are checked where their functions are known, which may come from the trainer's arguments
    (check_reward_weights)."""
    check_values(args)  # every field's type and `minimum` (fields.py)
    check_choices(args)  # every field declared with `choices` (fields.py)
    check_judge_args(args)
    check_server_urls(args)
    if args.max_train_minutes is not None and not args.max_train_minutes > 0:
        raise ValueError(f"`max_train_minutes` must be > 0 (or unset for no limit), got {args.max_train_minutes}.")
    if not 0.0 <= args.turn_credit_discount <= 1.0:
        raise ValueError(f"`turn_credit_discount` must be from 0 to 1, got {args.turn_credit_discount}.")
    for name in ("tool_timeout", "vllm_request_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"`{name}` must be a positive number of seconds, got {getattr(args, name)}.")
    if args.max_tokens_per_microbatch is not None and args.max_tokens_per_microbatch < 1:
        raise ValueError(f"`max_tokens_per_microbatch` must be at least 1, or null (one packed forward per "
                         f"micro-batch); got {args.max_tokens_per_microbatch}.")
    if args.async_rollout and args.max_staleness != 1:
        raise ValueError(f"`max_staleness` is {args.max_staleness}; only 1 is supported: the weights are "
                         "synced between generation batches and never during a request, so one batch "
                         "runs ahead at most.")
    if args.dynamic_sampling and args.dynamic_sampling_max_rounds < 1:
        raise ValueError(f"`dynamic_sampling_max_rounds` must be at least 1 with `dynamic_sampling`, got "
                         f"{args.dynamic_sampling_max_rounds}.")
    if args.dynamic_sampling and args.async_rollout:
        raise ValueError("`dynamic_sampling` with `async_rollout`: the replacement groups would be rolled out after "
                         "the background batch, on other weights; set one of them to false.")
    if not 0.0 <= args.kb_multi_hop <= 1.0:
        raise ValueError(f"`kb_multi_hop` must be a share from 0 to 1, got {args.kb_multi_hop}.")


def check_server_urls(args) -> None:
    """`vllm_server_urls` and `vllm_server_loss` (server_pool.py), against TRL's one-server fields when the config has
    them (MTGRPOConfig; the script arguments alone do not)."""
    urls = args.vllm_server_urls
    if not urls:
        return
    if bad := [u for u in urls if not isinstance(u, str) or not u.startswith(("http://", "https://"))]:
        raise ValueError(f"`vllm_server_urls` holds {bad}: give each server as http://HOST:PORT.")
    if len({u.rstrip("/") for u in urls}) < len(urls):
        raise ValueError(f"`vllm_server_urls` names a server twice ({urls}): list each once.")
    one_server = {name: getattr(args, name) for name, default in
                  (("vllm_server_base_url", None), ("vllm_server_host", "0.0.0.0"), ("vllm_server_port", 8000))
                  if getattr(args, name, default) != default}
    if one_server:
        raise ValueError(f"`vllm_server_urls` and {', '.join(f'`{k}: {v}`' for k, v in one_server.items())} both say "
                         "where the server is: put every server in `vllm_server_urls` and remove "
                         f"{', '.join(f'`{k}`' for k in one_server)} (TRL's one-server fields).")


# GRPOConfig fields this trainer replaces or cannot honour. A value other than TRL's default is an
# error that says what to set instead: a silently ignored field trains something else than the recipe
# says. {advantage_modes}: the values the config's `advantage_mode` allows (its declared choices).
REPLACED_GRPO_FIELDS = {
    "multi_objective_aggregation": "turn and outcome rewards are each summed and normalised per kind; choose "
                                   "`advantage_mode` ({advantage_modes})",
    "generation_kwargs": "set the sampling fields `temperature`, `top_p`, `top_k`, `min_p` and "
                         "`repetition_penalty`; other generation options are not sent, so that both backends "
                         "sample from what the recipe says",
    "vllm_mode": "it belongs to TRL's `use_vllm` path; this trainer's server path is "
                 "`generation_backend: vllm_server`",
    "vllm_model_impl": "set it on the vLLM server",
    "vllm_enable_sleep_mode": "it belongs to TRL's colocated vLLM, which this trainer does not use",
    "vllm_gpu_memory_utilization": "set it on the vLLM server (launch.sh: VLLM_GPU_MEMORY)",
    "vllm_tensor_parallel_size": "set it on the vLLM server (launch.sh: VLLM_TP)",
    "vllm_max_model_length": "set it on the vLLM server (launch.sh: VLLM_MAX_MODEL_LEN)",
    "vllm_structured_outputs_regex": "structured outputs are not supported: the protocol's stop strings end "
                                     "each turn",
    "vllm_group_port": "set `nccl_master_port`",
    "use_transformers_continuous_batching": "the in-process backend uses model.generate; for a faster engine "
                                            "use `generation_backend: vllm_server`",
    "transformers_continuous_batching_config": "see `use_transformers_continuous_batching`",
    "use_transformers_paged": "see `use_transformers_continuous_batching`",
}


def check_reward_sources(args, mode: str, credits_turns: bool, turn_funcs: list[Callable],
                         outcome_funcs: list[Callable]) -> None:
    """The run's reward functions, the recipe's and those its environment brings (environments.py), against the
    advantage mode (`mode`: `args.advantage_mode` resolved; says which in one line when that was auto)."""
    if args.advantage_mode == "auto":
        logger.info("advantage_mode auto: %s%s", mode, "" if turn_funcs else (
            " (TRL's GRPO): the run has no turn reward. For turn credit, give `turn_reward_funcs` (e.g. "
            "tool_execution_reward_func), a @per_tool_turn function in `reward_funcs`, or a `step_rewards` list in "
            "your environment."))
    if not outcome_funcs and not turn_funcs:
        raise ValueError("No reward functions: pass `reward_funcs` (a function or a list, as to TRL's GRPOTrainer), "
                         "or set `outcome_reward_funcs` and/or `turn_reward_funcs`, or give an `environment_factory` "
                         "whose class defines `get_reward` (or `step_rewards`).")
    if not turn_funcs and credits_turns and args.turn_advantage_coef != 0:
        raise ValueError(
            f"`advantage_mode: {mode}` credits turns, but the run has no turn reward, so A_T would "
            "always be 0. Give `turn_reward_funcs` (or a @per_tool_turn function in `reward_funcs`, or a "
            "`step_rewards` list in your environment), or set `advantage_mode: auto` (outcome_only here, TRL's GRPO)."
        )


def check_environment_args(args, train_dataset) -> None:
    """What TRL's environment_factory needs of the rest of the config (after builders.no_dataset_by_default)."""
    if args.async_rollout:
        raise ValueError("`environment_factory` with `async_rollout`: the next batch's episodes would reset instances "
                         "whose final state this batch's rewards still read. Set `async_rollout: false`.")
    if train_dataset is None and args.dataset_name is None and args.max_steps <= 0:
        raise ValueError("No dataset (no `train_dataset`, and `dataset_name` null or left at its default): the "
                         "environment's reset gives each prompt, and `max_steps` sets the run's length, as in TRL. "
                         "Set `max_steps` to a positive number of steps, or give a `dataset_name`.")


def check_training_args(args: GRPOConfig, loss_types: dict) -> None:
    """Cross-checks between our arguments and TRL's, with errors that name the field to change. `loss_types`: the
    trainer's LOSS_TYPES (each entry's `zero_signal`: what zero_signal_scale rescales, None where it cannot)."""
    if args.loss_type not in loss_types:
        raise ValueError(f"`loss_type: {args.loss_type}` is not a loss of LOSS_TYPES (mt_grpo_trainer.py, section 4): "
                         f"choose one of {list(loss_types)}, or add yours there.")
    if args.use_vllm:
        raise ValueError(
            "`use_vllm` turns on TRL's own single-turn vLLM path. This trainer has its own multi-turn "
            "client: set `use_vllm: false` and `generation_backend: vllm_server`."
        )
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name, instead in REPLACED_GRPO_FIELDS.items():
        if getattr(args, name) != defaults[name]:
            modes = ", ".join(choices_of(args, "advantage_mode"))
            raise ValueError(f"`{name}` ({getattr(args, name)!r}) is not used by this trainer: "
                             f"{instead.format(advantage_modes=modes)}.")
    if args.generation_batch_size % args.num_generations != 0:
        raise ValueError(
            f"The generation batch ({args.generation_batch_size} = per_device_train_batch_size x processes x "
            f"steps_per_generation) must be divisible by `num_generations` ({args.num_generations}): change "
            "`per_device_train_batch_size` or `num_generations`."
        )
    if args.num_generations < 2:
        raise ValueError("`num_generations` must be at least 2: advantages are normalised within each group.")
    steps, iterations = args.max_env_steps, args.max_tool_calling_iterations
    if steps is not None and iterations is not None and steps != iterations:
        raise ValueError(f"`max_env_steps` ({steps}) and TRL's `max_tool_calling_iterations` ({iterations}) are one "
                         "limit and disagree: set one of them.")
    if (args.max_tokens_per_turn or 0) > args.max_completion_length:
        raise ValueError(
            f"`max_tokens_per_turn` ({args.max_tokens_per_turn}) exceeds `max_completion_length` "
            f"({args.max_completion_length}), the budget of the whole multi-turn completion; lower it."
        )
    if args.async_rollout and not args.vllm_importance_sampling_correction:
        raise ValueError("`async_rollout` trains on samples from the weights of the batch before; the "
                         "importance-sampling correction is what corrects for that: set "
                         "`vllm_importance_sampling_correction: true`.")
    known = [name for name, loss in loss_types.items() if loss.zero_signal]  # normalisers masking makes exact
    if args.mask_zero_advantage_groups and args.loss_type == "bnpo":
        raise ValueError("`loss_type: bnpo` divides each micro-batch by its own token count, so with "
                         "`mask_zero_advantage_groups: true` a row's weight would depend on which rows TRL's shuffle "
                         "puts in its micro-batch: use `loss_type: dapo` (bnpo's normaliser taken over the whole "
                         "generation batch), or set `mask_zero_advantage_groups: false`.")
    if args.mask_zero_advantage_groups and args.loss_type not in known:
        raise ValueError(f"`loss_type: {args.loss_type}` has no known normaliser for `mask_zero_advantage_groups`; "
                         f"set `mask_zero_advantage_groups: false`, or use one of {list(known)}.")
    if (args.loss_type == "vespo" and args.vllm_importance_sampling_correction
            and not args.vllm_importance_sampling_mode.startswith("token")):
        raise ValueError("`loss_type: vespo` folds token-level importance weights into its own sequence weight: "
                         "set `vllm_importance_sampling_mode` to token_truncate or token_mask (or turn "
                         "`vllm_importance_sampling_correction` off).")
    if args.padding_free and args.steps_per_generation > 1:
        logger.warning("padding_free shares a prompt only within a micro-batch, and TRL shuffles the generation "
                       "batch's rows across its %d micro-batches: set `gradient_accumulation_steps: 1` and "
                       "`per_device_train_batch_size` to the generation batch (%d), and bound memory with "
                       "`max_tokens_per_microbatch`.", args.steps_per_generation,
                       args.per_device_train_batch_size * args.steps_per_generation)
    if (args.max_tool_response_tokens or 0) >= args.max_completion_length:
        raise ValueError(
            f"`max_tool_response_tokens` ({args.max_tool_response_tokens}) must be below "
            f"`max_completion_length` ({args.max_completion_length}), or no tool result ever fits."
        )


def check_trl(reward_processing_classes=None, rollout_func=None) -> None:
    """The installed TRL must be the tested range: this file overrides and reads TRL's private names
    (listed above). MT_GRPO_ALLOW_UNTESTED_TRL=1 tries another version anyway. Two of GRPOTrainer's arguments
    have no meaning here, and are refused with the fix."""
    if reward_processing_classes is not None:
        raise ValueError("`reward_processing_classes` tokenize for reward models, which this trainer does not load: "
                         "score with a reward function (it may call a model itself), and leave it out.")
    if rollout_func is not None:
        raise ValueError("`rollout_func` would replace the rollout with one that owns generation, whose tokens this "
                         "trainer cannot credit turn by turn: run that code as an agent (`agent=`, the OpenAI-compatible "
                         "endpoint of docs/guide.md 'From an agent program'), or give `tools` or an "
                         "`environment_factory`, and leave it out.")
    # TRL 1.16's unwrap_model_for_generation calls transformers' deprecated `is_gradient_checkpointing`,
    # `gradient_checkpointing_disable` and `..._enable` around every generation: nothing for a user to change
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                            category=FutureWarning)
    import trl
    import trl.trainer.utils
    from packaging.specifiers import SpecifierSet

    missing = [n for n in TRL_PRIVATE_NAMES if not hasattr(GRPOTrainer, n)]
    missing += [f"trl.trainer.utils.{n}" for n in ("_use_triton", "_ChunkedLogProbFunction")
                if not hasattr(trl.trainer.utils, n)]
    if missing:
        raise RuntimeError(f"TRL {trl.__version__} lacks {missing}, which this trainer relies "
                           f"on; install trl{TRL_TESTED_RANGE} (see requirements.txt).")
    if (trl.__version__ not in SpecifierSet(TRL_TESTED_RANGE)
            and os.environ.get("MT_GRPO_ALLOW_UNTESTED_TRL") != "1"):
        raise RuntimeError(
            f"TRL {trl.__version__} is installed; this trainer is tested with trl{TRL_TESTED_RANGE} and "
            "relies on TRL private names (listed at the top of mt_grpo/run/checks.py). Install the pinned "
            "version (pip install -r requirements.txt), or set MT_GRPO_ALLOW_UNTESTED_TRL=1 to try this one "
            "and check that list."
        )


def check_best_metric(args: GRPOConfig, turn_funcs: list[Callable], outcome_funcs: list[Callable],
                      task_metrics: list[str]) -> str | None:
    """`metric_for_best_model` names an eval metric: `exact_match`, `eval_exact_match` or `eval/exact_match`
    (returned in transformers' `eval_` form, which `evaluate` returns beside the logged `eval/` names)."""
    name = args.metric_for_best_model
    if name is None:
        return None
    bare = name.removeprefix("eval/").removeprefix("eval_")
    names = eval_metric_names(args.num_generations_eval or 1, turn_funcs, outcome_funcs, task_metrics)
    if bare not in names:
        raise ValueError(f"`metric_for_best_model` is {name!r}, which evaluation does not log"
                         + (" (there is no eval loss: evaluation runs episodes, not a loss)" if bare == "loss" else "")
                         + f"; choose one of {names}, e.g. `metric_for_best_model: exact_match`.")
    return f"eval_{bare}"


def check_backend(args: GRPOConfig, peft_config, backend) -> None:
    """What the backend (its class before it is built, or the one the run uses: `external`, `can_submit`) must offer
    for the recipe. `peft_config`: the LoRA config, or None."""
    if getattr(args, "vllm_server_urls", None) and not backend.external:  # servers listed, but sampling in-process
        raise ValueError(f"`vllm_server_urls` is set but `generation_backend` is {args.generation_backend!r}: set "
                         "`generation_backend: vllm_server`, or remove `vllm_server_urls`.")
    dropout = getattr(peft_config, "lora_dropout", 0) or 0
    if peft_config is not None and backend.external and dropout > 0 and not args.disable_dropout:
        # the server samples without dropout; a trainer forward with it scores another policy
        name = backend.__name__ if isinstance(backend, type) else type(backend).__name__
        raise ValueError(f"`lora_dropout` is {dropout} with an external sampler ({name}): the trainer's logprobs "
                         "would carry dropout noise that the sampler's have not, so on-policy importance weights would "
                         "not be 1 and the weight-sync probe would fail. Set `lora_dropout: 0` or `disable_dropout: "
                         "true`.")
    if args.async_rollout and not backend.can_submit:
        raise ValueError("`async_rollout` overlaps a server's sampling with training: set "
                         "`generation_backend: vllm_server`, or `async_rollout: false` (an in-process "
                         "model cannot do both at once).")
    if args.rollout_scheduler == "per_episode" and not backend.can_submit:
        raise ValueError("`rollout_scheduler: per_episode` needs a server that takes requests as they "
                         "come (`generation_backend: vllm_server`); in-process generation runs in "
                         "rounds.")
    if peft_config is not None and backend.external and args.lora_sync == "merged" \
            and args.weight_sync == "nccl":
        # the NCCL source walks the PEFT model's parameters, whose names and shapes are not the served model's
        raise ValueError("`lora_sync: merged` goes through the disk sync: set `weight_sync: disk` (or `auto`), "
                         "or `lora_sync: adapter`.")
    check_precision(args, peft_config)


def check_precision(args: GRPOConfig, peft_config) -> None:
    """`fp16: true` (fp16 autocast with accelerate's loss scaler) where it can run: a GPU, and master weights the
    scaler can unscale (docs/guide.md, "Precision")."""
    if not args.fp16:
        return
    dtype = str((args.model_init_kwargs or {}).get("dtype", "auto")).removeprefix("torch.")
    if peft_config is None and dtype in ("float16", "half"):
        raise ValueError("`fp16: true` with `dtype: float16`: the loss scaler cannot unscale float16 gradients "
                         "(torch: 'Attempting to unscale FP16 gradients.'). Set `dtype: float32` (float32 master "
                         "weights, the forward in fp16 under autocast), or train a LoRA adapter (`use_peft: true`).")
    if args.use_cpu or not torch.cuda.is_available():
        raise ValueError("`fp16: true` (fp16 autocast with a loss scaler) needs a GPU: accelerate refuses fp16 mixed "
                         "precision on a CPU. On a CPU set `fp16: false` (float32, or `bf16: true`); a server's "
                         "`--dtype float16` does not need it.")


def check_distributed_generation(backend, accelerator, args: GRPOConfig, env=None) -> None:
    """In-process generation on several processes runs in lock-step rounds (see another_round), and under ZeRO-3 or
    FSDP every rank joins each decoding step and prefill, with a dummy row where it has no live episode
    (TransformersBackend.generate). Two settings are not tested that way: refuse them with the fix. A vision model's
    image batches are forwarded one sample at a time (engine/vision.py), so under ZeRO-3 or FSDP, where every forward
    is a collective, ranks with other sample counts would wait on each other for ever: refused whatever samples."""
    if accelerator.num_processes == 1:
        return
    from trl.distributed import DistributedBackend

    dist = DistributedBackend(accelerator)
    if getattr(getattr(env, "vision", None), "name", None) is not None and (dist.is_zero3 or dist.is_fsdp):
        raise ValueError("A vision-language model under ZeRO-3 or FSDP on several processes is not supported: its "
                         "image batches are forwarded one sample at a time, a count that differs between ranks, and "
                         "each sharded forward is a collective (the ranks would hang). Train it under ZeRO-2 "
                         "(accelerate_configs/zero2.yaml), DDP or on one process.")
    if backend.external:
        return
    from mt_grpo.agents.runner import AgentEnv

    if isinstance(env, AgentEnv):  # each agent calls when it calls: no lock-step rounds (AgentEnv.rollout checks too)
        raise ValueError("An agent run on several processes needs `generation_backend: vllm_server` (in-process "
                         "generation runs in lock-step rounds across processes, which agents' calls do not). Serve "
                         "the policy with vLLM, or train the agent on one process.")
    if dist.is_zero3 and not args.ds3_gather_for_generation:
        raise ValueError("`ds3_gather_for_generation: false` with ZeRO-3 and `generation_backend: "
                         "transformers` on several processes is untested (every decoding step would gather each "
                         "layer's parameters again: slow). Set `ds3_gather_for_generation: true`, or use "
                         "`generation_backend: vllm_server`.")
    if dist.fsdp_version == 2:
        raise ValueError("FSDP2 with `generation_backend: transformers` on several processes is untested "
                         "(every forward is a collective). Use ZeRO-3 "
                         "(accelerate_configs/zero3.yaml) or `generation_backend: vllm_server`.")


# What TRL 1.16 passes every reward function besides the dataset's columns (the trainer's `_score` passes them here);
# `environments` only in a run with an environment_factory, as in TRL; and ours, `stop_reason` (environments.py).
TRL_REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "environments", "trainer_state", "log_extra",
                       "log_metric", "stop_reason")


def required_columns(fn: Callable) -> list[str]:
    """The keyword arguments a reward function needs from the dataset (those without a default, but TRL's)."""
    return [name for name, p in inspect.signature(fn).parameters.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and name not in TRL_REWARD_KEYWORDS]


def check_reward_columns(funcs: list[Callable], columns: list[str], environments: bool = True) -> None:
    """Each reward's required keyword arguments must be dataset columns, or TRL's keywords that the run passes; and
    each reward must take every keyword it will be passed (TRL's signature ends in `**kwargs`)."""
    passed = [c for c in columns if c not in ("prompt", "row")] + [
        k for k in TRL_REWARD_KEYWORDS if environments or k != "environments"]
    for fn in funcs:
        params = inspect.signature(fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            if unknown := [k for k in passed if k not in params]:
                raise ValueError(f"Reward function '{fn.__name__}' takes no `**kwargs`, but every reward receives the "
                                 f"dataset's columns and TRL's keywords as keyword arguments, and it would be passed "
                                 f"{unknown}, which it does not take: end its signature with `**kwargs`, as in TRL: "
                                 f"`def {fn.__name__}(completions, **kwargs)`.")
        for name in required_columns(fn):
            if name not in columns:
                made = " (made from the `answer` column: give one, or set `answer_column`)" \
                    if name == "answer_aliases" else ""
                raise ValueError(f"Reward function '{fn.__name__}' needs the dataset column '{name}'{made}, but "
                                 f"the dataset has only {columns}.")
        needs = inspect.signature(fn).parameters.get("environments")
        if not environments and needs is not None and needs.default is needs.empty:
            raise ValueError(f"Reward function '{fn.__name__}' takes `environments`, which a run passes only with an "
                             "`environment_factory` (as TRL does): give one, or read the completions instead.")


def check_reward_weights(args, kind: str, funcs: list | None) -> None:
    """`<kind>_reward_weights` of the config against the `<kind>_reward_funcs` the run was given, in the config or
    to MTGRPOEnvTrainer(...) (`funcs`; None: given nowhere)."""
    weights = getattr(args, f"{kind}_reward_weights")
    if weights is not None and funcs is None:
        raise ValueError(f"`{kind}_reward_weights` is set but `{kind}_reward_funcs` is not, in the config or to "
                         "MTGRPOEnvTrainer(...): list the functions they weigh (the task's default list takes no "
                         "weights; TRL's `reward_funcs` take `reward_weights`).")
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(f"`{kind}_reward_weights` has {len(weights)} values but `{kind}_reward_funcs` has "
                         f"{len(funcs)} functions; give one weight per function, or leave the weights unset.")


def check_reward_lists_given_once(args, turn_funcs, outcome_funcs) -> None:
    """A reward list given to MTGRPOEnvTrainer(...) and also set in the config: one would silently win."""
    for kind, passed in (("turn", turn_funcs), ("outcome", outcome_funcs)):
        configured = getattr(args, f"{kind}_reward_funcs")
        if passed is not None and configured is not None and list(configured) != list(passed):
            raise ValueError(f"`{kind}_reward_funcs` is given twice: to MTGRPOEnvTrainer(...) ({list(passed)}) and in the "
                             f"config ({list(configured)}). Give it in one place: drop `{kind}_reward_funcs` from the "
                             "config (or the recipe), or from the trainer's arguments.")
