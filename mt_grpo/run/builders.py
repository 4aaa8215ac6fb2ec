"""What `MTGRPOEnvTrainer(...)` builds from its config when it is handed names and data rather than an env: the
tokenizer, the tools, the reward functions and the task, and the prompts of a dataset. Plumbing only; the trainer
file keeps the classes (`MultiTurnToolEnv`, the backends) and calls these.

The trainer takes what TRL's GRPOTrainer takes, and more loosely:
    tools                functions, or names of mt_grpo/tools (and dotted paths), or both; None: the config's `tools`
    turn/outcome rewards functions or names of mt_grpo/rewards; None: the config's lists
    train/eval_dataset   a `datasets.Dataset` with `question` and `answer` columns, or TRL's `prompt` column
                         (standard text or conversational messages), renamed by the config's `*_column` fields;
                         or a `tasks.Task`; None: the config's `dataset_name` (and the task's held-out split
                         when evaluation is on)
"""

import logging
import os
import random
from dataclasses import dataclass, field
from typing import Callable

from transformers import AutoTokenizer

import torch

from mt_grpo.adapters import adapt, fields_set, resolve_reward
from mt_grpo.run.checks import check_environment_args, required_columns
from mt_grpo.base.protocol import end_of_turn_ids
from mt_grpo.tasks import (EMPTY_PROMPT, Task, TaskArguments, build_dataset, load_eval_task, load_task, recipe_columns,
                           task_defaults, validate_dataset)

logger = logging.getLogger("mt_grpo")
DEFAULT_DATASET = TaskArguments.__dataclass_fields__["dataset_name"].default  # the knowledge base


@dataclass
class Parts:
    """Everything the trainer needs besides the model, the env and the backend."""

    tokenizer: object
    eos_token_ids: list[int]  # every id that ends a model turn
    tools: list[Callable]
    turn_funcs: list[Callable]
    outcome_funcs: list[Callable]
    train: Task | None
    eval: Task | None
    task_prompt: str | None  # the system prompt's task part (the config's, else the task's; None: neutral)
    # worked examples: the config's, else the task's (a list, or a function of the tools that gives them)
    examples: list[dict] | Callable[[list], list[dict]] | None = None
    eval_metrics: dict[str, Callable] = field(default_factory=dict)
    environments: object = None  # environments.EnvironmentPool of TRL's environment_factory; None: stateless tools
    # (turn, outcome) weights of the functions the caller listed (reward_lists); the environment's weigh 1
    weights: tuple[list[float], list[float]] = ([], [])
    questions: bool = True  # the rows are questions, answered in <answer> (not TRL prompts, not an environment's)
    step_rewards: bool = False  # an environment's `step_rewards` reward every turn (advantage_mode auto: per_turn)
    group_seeds: bool = False  # the environment draws its game from reset's `seed`: seed_rows gives each row one
    placeholder: bool = False  # no dataset: `train` is placeholder_task's rows, which reset fills
    agent: object = None  # the trainer's `agent` keyword: an agent program's episodes (agents/, make_env)


def assemble(model, args, *, train_dataset, eval_dataset, tools, turn_reward_funcs,
             outcome_reward_funcs, processing_class, corpus, environment_factory=None, reward_funcs=None,
             agent=None) -> Parts:
    """Resolve every name of the config and load what is missing (see the module docstring)."""
    from mt_grpo.base.protocol import load_examples, load_text
    from mt_grpo.run.reporting import show_log
    from mt_grpo.tools import build_tools

    show_log()  # a Python script's run says what it chose, as a recipe's does
    factory = environment_factory if environment_factory is not None else args.environment_factory
    adapted = adapted_parts(args, factory)  # another framework's environment (adapters/), one at most
    if adapted is not None:
        factory = adapted.environment_factory if adapted.environment_factory is not None else factory
        train_dataset = train_dataset if train_dataset is not None else adapted.train_dataset
        eval_dataset = eval_dataset if eval_dataset is not None else adapted.eval_dataset
        apply_settings(args, adapted.settings)
    if factory is not None:
        no_dataset_by_default(args, train_dataset)
        check_environment_args(args, train_dataset)
    environment = factory is not None  # its reset gives the prompt: a row may have none (tasks.validate_dataset)
    # the task's own tools and rewards fill what the caller and the config leave unset (tasks.task_defaults)
    defaults = train_dataset.defaults if isinstance(train_dataset, Task) else \
        task_defaults(args.dataset_name, args.corpus_path) if train_dataset is None else {}
    turn, outcome, weights = reward_lists(args, defaults, turn_reward_funcs, outcome_reward_funcs, reward_funcs)
    needs_answer = [fn.__name__ for fn in turn + outcome  # [] when none; answer_aliases is made from `answer`
                    if {"answer", "answer_aliases"} & set(required_columns(fn))]
    placeholder = train_dataset is None and args.dataset_name is None  # no dataset: reset gives every prompt
    train = placeholder_task(args) if placeholder else _task(train_dataset, args, needs_answer, "train_dataset",
                                                             environment)
    evaluation = eval_dataset is not None or args.eval_strategy != "no"
    if eval_dataset is None and evaluation:
        if isinstance(train_dataset, (Task, type(None))):  # a recipe's task: its held-out split
            eval_dataset = load_recipe_task(args, needs_answer, held_out=True, environment=environment)
        else:
            raise ValueError(f"`eval_strategy: {args.eval_strategy}` needs held-out data: pass `eval_dataset`, "
                             "or set `eval_strategy: no`.")
    held_out = _task(eval_dataset, args, needs_answer, "eval_dataset", environment) if evaluation else None
    source = train or held_out
    tokenizer, eos_ids = load_tokenizer(model, processing_class, revision=_revision(args),
                                        trust_remote_code=args.trust_remote_code)
    if args.tool_format == "auto":  # the format this run uses, from here on (the trainer's copy of the config)
        from mt_grpo.base.protocol import auto_tool_format

        # an ms-swift scheduler reads the model's tool text itself (ReAct `Action:`, `<tool_call>`): xml leaves it so
        args.tool_format = "xml" if args.multi_turn_scheduler else auto_tool_format(tokenizer)
        logger.info("tool_format: auto: %s (%s).", args.tool_format, "an ms-swift scheduler reads the tool text" if
                    args.multi_turn_scheduler else "the chat template writes tools: the model's own calls, as TRL runs "
                    "them" if args.tool_format == "chat_template" else "the chat template writes no tools")
    if adapted is not None and adapted.use_tokenizer is not None:  # the adapter counts tokens with the run's own
        adapted.use_tokenizer(tokenizer)
    # the task's eval metrics whose columns the data has (a question without answers gets no exact match)
    metrics = {name: fn for name, fn in (source.eval_metrics if source is not None else {}).items()
               if all(c in source.dataset.column_names for c in required_columns(resolve_reward(fn)))}
    tools = next(t for t in (tools, args.tools, defaults.get("tools"), []) if t is not None)
    tools = _join_tools(build_tools(tools if isinstance(tools, (list, tuple)) else [tools], corpus if corpus is not
                                    None else getattr(source, "corpus", None)), _mcp_tools(args))
    if adapted is not None:
        tools, outcome, turn = _join_tools(tools, adapted.tools), outcome + adapted.outcome_funcs, turn + adapted.turn_funcs
    for fn in turn + outcome:  # verl's compute_score reads the response as verl decodes it (adapters/verl.py)
        if hasattr(fn, "verl_compute_score"):
            fn.tokenizer = tokenizer
    pool = None
    if factory is not None:  # an instance per episode; its methods join the tools, its rewards the rewards
        from mt_grpo.rollout.environments import EnvironmentPool, load_factory
        from mt_grpo.base.protocol import get_protocol

        pool = EnvironmentPool(load_factory(factory), tools, get_protocol(args.tool_format, tokenizer=tokenizer))
        tools, outcome, turn = pool.all_tools(), outcome + pool.reward_funcs[0], turn + pool.reward_funcs[1]
    return Parts(
        tokenizer=tokenizer, eos_token_ids=eos_ids, tools=tools, environments=pool, weights=weights,
        turn_funcs=turn, outcome_funcs=outcome, train=train, eval=held_out, questions=_questions(source), agent=agent,
        task_prompt=load_text(args.system_prompt) or getattr(adapted, "system_prompt", None)
        or getattr(source, "system_prompt", None),
        examples=load_examples(args.few_shot_examples) if args.few_shot_examples is not None
        else getattr(source, "examples", None),
        eval_metrics={name: resolve_reward(f) for name, f in metrics.items()},
        step_rewards=pool is not None and bool(pool.reward_funcs[1]),
        group_seeds=adapted is not None and adapted.group_seeds or pool is not None and pool.seeded,
        placeholder=placeholder,
    )


def adapted_parts(args, factory):
    """What the adapter the config names adds (adapters/): None when it names none. Two frameworks in one run, or
    an adapter's environment beside `environment_factory`, fail naming both."""
    named = fields_set(args)
    if not named:
        return None
    parts = adapt(args)
    if len(parts) > 1:
        raise ValueError(f"{named} name environments of two frameworks; a run trains one: keep one of them.")
    if factory is not None and parts[0].environment_factory is not None:
        raise ValueError(f"{named} brings its own environment, and `environment_factory` is set too: keep one.")
    if parts[0].train_dataset is not None and args.dataset_name not in (None, DEFAULT_DATASET) \
            and not parts[0].read_dataset_name:  # swift's adapter reads dataset_name itself
        raise ValueError(f"{named} brings its own dataset, so `dataset_name: {args.dataset_name}` would not be read: "
                         "remove `dataset_name`, or pass your rows as `train_dataset`, which replaces the environment's.")
    return parts[0]


def apply_settings(args, settings: dict) -> None:
    """The limits an adapted environment brings (Adapted.settings), on the trainer's copy of the config: a field
    left None takes the environment's value; one the recipe set keeps the smaller of the two (both are limits)."""
    for name, value in settings.items():
        mine = getattr(args, name, None)
        if mine is None or value < mine:
            if mine is not None:
                logger.info("%s: %s from the environment (the recipe's %s is larger).", name, value, mine)
            setattr(args, name, value)


def reward_lists(args, defaults: dict, turn_funcs, outcome_funcs, reward_funcs) -> tuple[list, list, tuple]:
    """(turn functions, outcome functions, (turn weights, outcome weights)). TRL's `reward_funcs` (a function, a
    name, or a list; weighted by TRL's `reward_weights`) join the outcome rewards, and those marked @per_tool_turn the
    turn rewards. A list left unset (None, as argument and in the config) is the task's default, unless
    `reward_funcs` is given: then, as in TRL, the run has only the rewards it was given."""
    from mt_grpo.run.checks import check_reward_lists_given_once, check_reward_weights
    from mt_grpo.rewards import is_per_tool_turn
    from mt_grpo.rewards.judge import build_judge_rewards

    check_reward_lists_given_once(args, turn_funcs, outcome_funcs)
    given = as_list(reward_funcs) or []
    trl_weights = list(args.reward_weights) if args.reward_weights is not None else [1.0] * len(given)
    if len(trl_weights) != len(given):
        raise ValueError(f"`reward_weights` has {len(trl_weights)} values but `reward_funcs` has {len(given)} "
                         "functions: give one weight per function of `reward_funcs`.")
    lists = {}
    for kind, passed in (("turn", turn_funcs), ("outcome", outcome_funcs)):
        names = next((x for x in (as_list(passed), getattr(args, f"{kind}_reward_funcs")) if x is not None), None)
        check_reward_weights(args, kind, names)  # the config's weights, for the functions of either place
        weights = getattr(args, f"{kind}_reward_weights")
        names = names if names is not None else [] if reward_funcs is not None else \
            defaults.get(f"{kind}_reward_funcs", [])
        lists[kind] = (list(names), list(weights) if weights is not None else [1.0] * len(names))
    judge = None  # judge rewards (rewards/judge.py) share one client, checked once at start-up
    resolved = {}
    for kind, (names, weights) in lists.items():
        funcs, judge = build_judge_rewards(names, args, judge)
        resolved[kind] = [resolve_reward(f) for f in funcs], weights
    extra, judge = build_judge_rewards(given, args, judge)
    for fn, w in zip(extra, trl_weights):
        fn = resolve_reward(fn)
        kind = "turn" if is_per_tool_turn(fn) else "outcome"
        resolved[kind] = resolved[kind][0] + [fn], resolved[kind][1] + [w]
    for fn in resolved["turn"][0] + resolved["outcome"][0]:
        if isinstance(fn, torch.nn.Module) or not callable(fn):
            raise ValueError(f"Reward {fn!r} is a {type(fn).__name__}: give a function (prompts, completions, "
                             "**kwargs) -> list[float | None], a name from mt_grpo/rewards, or a dotted path `module:fn`. A "
                             "reward model goes inside a function that scores the completions with it.")
    return resolved["turn"][0], resolved["outcome"][0], (resolved["turn"][1], resolved["outcome"][1])


def as_list(x) -> list | None:
    """TRL takes one item or a list (a reward function, a tool): None stays None."""
    return None if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _questions(task: Task | None) -> bool:
    """Whether a task's rows are questions (answered in <answer>), rather than TRL prompts or an environment's."""
    return task is not None and "prompt" not in task.dataset.column_names


def _task(data, args, needs_answer: list[str], name: str, environment: bool = False) -> Task | None:
    """A Task from what the caller passed: a Task as is, a datasets.Dataset validated, None for the train set: the
    config's `dataset_name`. `environment`: an environment_factory's reset gives the prompts."""
    if isinstance(data, Task):
        return data
    if data is None:
        return load_recipe_task(args, needs_answer, environment=environment) if name == "train_dataset" else None
    import datasets

    if not isinstance(data, datasets.Dataset):
        raise ValueError(f"`{name}` is a {type(data).__name__}; pass a datasets.Dataset (e.g. "
                         "`Dataset.from_list([{'question': ..., 'answer': ...}])`), or leave it out to load the "
                         "config's `dataset_name`.")
    task = validate_dataset(data, columns=recipe_columns(args), answer_required=needs_answer, source=name,
                            environment=environment)
    _report_skipped(task, name)
    return task


def load_recipe_task(args, answer_required: bool | list[str] = True, held_out: bool = False,
                     environment: bool = False) -> Task:
    """The recipe's training task (`dataset_name` and the fields beside it), or its held-out one (`eval_*`).
    `environment`: an environment_factory's reset gives the prompts (tasks.validate_dataset)."""
    if held_out:
        task = load_eval_task(args, answer_required=answer_required, environment=environment)
    else:
        task = load_task(args.dataset_name, args.dataset_split, args.max_samples, args.corpus_path, args.kb_seed,
                         args.kb_multi_hop, dataset_config=args.dataset_config, columns=recipe_columns(args),
                         answer_required=answer_required, environment=environment)
    _report_skipped(task, args.eval_dataset_name or args.dataset_name if held_out else args.dataset_name)
    return task


def _report_skipped(task: Task, source: str) -> None:
    if task.num_skipped:
        logger.warning("Skipped %d malformed rows of %s, e.g. %s", task.num_skipped, source, "; ".join(task.skipped))


def _mcp_tools(args) -> list[Callable]:
    """The tools of the recipe's `mcp_servers` and `mcp_servers_config` that `mcp_tool_filter` keeps (tools/mcp.py),
    connected at start-up."""
    config, selected = getattr(args, "mcp_servers_config", None), getattr(args, "mcp_tool_filter", None)
    if not args.mcp_servers and config is None and not selected:
        return []
    from mt_grpo.tools.mcp import mcp_tools

    return mcp_tools(args.mcp_servers, args.tool_timeout, getattr(args, "mcp_startup_timeout", None), config=config,
                     selected=selected)


def _join_tools(tools: list[Callable], served: list[Callable]) -> list[Callable]:
    clash = sorted({t.__name__ for t in tools} & {t.__name__ for t in served})
    if clash:
        raise ValueError(f"MCP servers (mcp_servers, mcp_servers_config) give tool(s) {clash}, which `tools` already "
                         "has, and the model calls a tool by its name. Remove one from `tools`, or leave it out with "
                         "mcp_tool_filter.")
    return tools + served


def no_dataset_by_default(args, train_dataset) -> None:
    """TRL's environment_factory without a train_dataset: the environment's reset gives each prompt, and TRL needs no
    dataset. A `dataset_name` left at its default (the knowledge base, surely not meant for your environment) then
    means none, as in TRL; another `dataset_name` is loaded. On the trainer's copy of the config."""
    if train_dataset is None and args.dataset_name == DEFAULT_DATASET:
        logger.info("environment_factory without a train_dataset: the environment's reset gives each prompt, as in "
                    "TRL (`dataset_name` %r, its default, is not loaded: set it to your data, or pass train_dataset).",
                    DEFAULT_DATASET)
        args.dataset_name = None


def placeholder_task(args) -> Task:
    """No dataset: a generation batch of empty user messages, cycled, which the environment's reset fills (TRL's
    placeholder rows). An environment that plays reset's `seed` gets them repeated to one a group, each its own seed
    (prompt_dataset)."""
    import datasets

    rows = max(1, args.generation_batch_size // args.num_generations)
    return Task(datasets.Dataset.from_dict({"prompt": [EMPTY_PROMPT] * rows}), corpus=None,
                eval_metrics={})


def run_groups(args) -> int | None:
    """The groups a run of `max_steps` plays: a generation batch of generation_batch_size / num_generations of them
    every steps_per_generation x num_iterations micro-steps, gradient_accumulation_steps a step (TRL's
    RepeatSampler takes a new row for each); None for a run of epochs (`max_steps` unset, -1: TRL's default), whose
    epochs replay the placeholder rows' seeds."""
    if args.max_steps <= 0:
        return None
    batches = -(-args.max_steps * args.gradient_accumulation_steps // (args.steps_per_generation * args.num_iterations))
    return batches * (args.generation_batch_size // args.num_generations)


def seed_rows(dataset, seed: int, split: str):
    """The rows, each with the `seed` its environment's reset plays: the row's own, else one drawn for it with the
    run's `seed` (distinct across the rows; `split` train | eval draws apart). The G episodes of a row are one
    group, so a group plays one game and each row another; a row's seed is the same in every process, in a re-run
    and on a resume."""
    own = dataset["seed"] if "seed" in dataset.column_names else [None] * len(dataset)
    if all(s is not None for s in own):
        return dataset
    drawn = random.Random(f"{split}-{seed}").sample(range(2**31), len(dataset))  # str: the same in every process
    seeds = [d if s is None else s for s, d in zip(own, drawn)]
    logger.info("%d of %d %s rows have no `seed`: each gets one drawn with seed=%d, so that a group plays one game.",
                sum(s is None for s in own), len(own), split, seed)
    return (dataset.remove_columns("seed") if "seed" in dataset.column_names else dataset).add_column("seed", seeds)


def _revision(args) -> str | None:
    return (args.model_init_kwargs or {}).get("revision")


def load_tokenizer(model, processing_class=None, revision: str | None = None,
                   trust_remote_code: bool = False) -> tuple[object, list[int]]:
    """(tokenizer, every id that ends a model turn) for a model name or a loaded model. A given tokenizer is
    used, padded on the left (generation appends on the right); a given processor (TRL's form for a vision-language
    model), its tokenizer, with its image processor for the images (engine/vision.processor_tokenizer)."""
    from mt_grpo.engine.vision import processor_tokenizer

    name = model if isinstance(model, str) else getattr(model, "name_or_path", None)
    tokenizer = processor_tokenizer(processing_class)
    if tokenizer is None:
        if not name:
            raise ValueError("The model has no `name_or_path` to load its tokenizer from: pass `processing_class`.")

        if not os.path.isdir(name) and local_model_path(name):
            raise model_not_found(name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, padding_side="left",
                                                      trust_remote_code=trust_remote_code)
        except OSError as e:
            raise (e if os.path.isdir(name) else model_not_found(name, e)) from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if isinstance(model, str):
        return tokenizer, end_of_turn_ids(model, tokenizer, revision)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return tokenizer, [tokenizer.eos_token_id] + [i for i in ids if i != tokenizer.eos_token_id]


def check_vision(env, dataset_images: bool = False) -> None:
    """A vision model's chat template renders the images of every role that may hold one in this run, or the run stops
    at start naming the template and the fix that works (engine/vision.DroppedImages): a user message (the dataset's
    image columns, an environment's reset and replies), and a tool reply (tools, an environment's methods), probed
    apart. A tool reply it drops, with the user message rendered, is fixed by `tool_images_as_user`: the error says
    so only where that fix renders. The vLLM server's own check is the client's (engine/server_images.ServerImages)."""
    from PIL import Image

    from mt_grpo.engine.vision import DroppedImages, Vision

    tools = bool(env.tools) or env.environments is not None
    if not isinstance(env.vision, Vision) or not (tools or dataset_images):
        return
    blocks = [{"type": "image", "image": Image.new("RGB", (28, 28))}, {"type": "text", "text": "."}]
    if dataset_images or env.environments is not None:  # a prompt's, a reset's or a reply's image: a user message
        env.render_ids([{"role": "user", "content": blocks}], True)  # its DroppedImages names a template's fix
    if not tools:
        return
    reply = [{"role": "tool", "name": next(iter(env.tools), "probe"), "content": blocks}]
    try:
        env.env_reply_ids(reply)
        return
    except DroppedImages as dropped:
        first = dropped
    if not env.protocol.tool_images_as_user:  # would the fix render it? Then the error names the fix
        env.protocol.tool_images_as_user = True
        try:
            env.env_reply_ids(reply)
        except DroppedImages:
            pass
        else:
            raise first
        finally:
            env.protocol.tool_images_as_user = False
    raise DroppedImages(first.template, ["tool", "user"], "renders no placeholder for a tool's image, in its tool "
                        "message or in a user message after it (`tool_images_as_user`)") from first


def build_from_config(model, args, make_env: Callable, **given) -> tuple[Parts, object, object, object]:
    """(the parts, the env that `make_env(args, parts)` makes of them, the train and eval prompt datasets): what the
    trainer builds when it is given no env. `given`: `assemble`'s keywords (the trainer's arguments). Every eval curve
    starts at the untrained model (`eval_on_start`), unless the run resumes (it evaluated it before it stopped)."""
    parts = assemble(model, args, **given)
    env = make_env(args, parts)
    env.protocol.tool_images_as_user = args.tool_images_as_user  # how a tool's images render (engine/vision.py)
    seeded = parts.group_seeds  # each row a seed, so that a group plays one game (seed_rows)
    train = prompt_dataset(parts.train, args, env, parts.turn_funcs + parts.outcome_funcs, "train" if seeded else None,
                           run_groups(args) if seeded and parts.placeholder else None)
    held_out = prompt_dataset(parts.eval, args, env, parts.turn_funcs + parts.outcome_funcs, "eval" if seeded else None)
    images = [d for d in (train, held_out) if d is not None and {"image", "images"} & set(d.column_names)]
    if images and env.vision.name is None:  # a text-only model with TRL's image columns: refused now, not at step 1
        env.vision.refuse(f"The dataset's {'/'.join(sorted({'image', 'images'} & set(images[0].column_names)))} "
                          "column has images")
    check_vision(env, bool(images))  # a template that drops images fails here, not at the first that reaches it
    args.eval_on_start = held_out is not None and args.eval_strategy != "no" and not args.resume_from_checkpoint
    return parts, env, train, held_out


def prompt_dataset(task: Task | None, args, env, funcs: list[Callable], seeds: str | None = None,
                   rows: int | None = None):
    """The task's rows with the prompts the env renders (tasks.build_dataset), checked against the rewards'
    columns, and the recipe's `answer_type` for the rewards that compare answers. `seeds` (train | eval): each row
    a `seed` (seed_rows), the rows first repeated to `rows` (no dataset: run_groups)."""
    if task is None:
        return None
    from mt_grpo.run.checks import check_reward_columns

    dataset = build_dataset(args, env, task, tools_of=env.environments.tools if env.environments is not None else None)
    if seeds is not None:  # after the prompts are rendered: the placeholder's few, not one per group of the run
        dataset = seed_rows(dataset.select([i % len(dataset) for i in range(rows)]) if rows else dataset,
                            args.seed, seeds)
    if args.answer_type != "auto" and "answer_type" not in dataset.column_names:
        dataset = dataset.add_column("answer_type", [args.answer_type] * len(dataset))
    check_reward_columns(funcs, dataset.column_names, environments=env.environments is not None)
    return dataset


def local_model_path(name: str) -> bool:
    """Whether a model name can only be a local folder: absolute, relative (./, ~), deeper than a hub id's
    `org/name`, or under a folder that exists here (`models/...`)."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or ("/" in name and os.path.isdir(name.split("/")[0])))


def model_not_found(name: str, error: OSError | None = None) -> OSError:
    """The error for a model folder that does not exist, raised before transformers tries the hub with a mistyped
    local path (its retries take a minute offline, and its error never names the folder); with `error`, what
    loading a hub-shaped name raised."""
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(name)))
    near = sorted(d for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d)) and not d.startswith(".")
                  )[:12] if os.path.isdir(parent) else []
    tried = f" and could not be loaded as a hub name ({str(error).splitlines()[0]})" if error is not None else ""
    return OSError(f"Model '{name}' is not a local folder (no {os.path.abspath(os.path.expanduser(name))}){tried}. Fix "
                   "the path" + (f" ({os.path.dirname(name) or '.'} holds {near})" if near else "")
                   + ", or make the demo's model with `python scripts/prepare_models.py smollm2 "
                   "models/SmolLM2-135M-Instruct`.")
