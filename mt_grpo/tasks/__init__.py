"""Tasks: the questions the agent trains on, their accepted answers, the corpus it searches, and the task's own
part of the prompt.

`load_task(dataset_name, ...)` takes the recipe's `dataset_name`:
    fictional_kb   the embedded, offline knowledge base of invented facts (tasks/fictional_kb.py);
                   brings its own corpus; splits "train" and "test" (a held-out 10% of the questions);
                   `multi_hop` (recipe: `kb_multi_hop`) makes that fraction of the questions two-hop
                   ("In what year was the founder of the city of Rarzogard born?": two searches)
    fictional_kb_entities  the same knowledge base (and `multi_hop`), split by entity: "train", "validation"
                   and "test" (80/10/10 of the entities), so that no held-out entity is named by a training
                   question; evaluation reads "validation" unless `eval_dataset_split: test` (tasks/fictional_kb.py)
    triviaqa       TriviaQA from the Hugging Face hub (tasks/triviaqa.py); no corpus unless
                   `corpus_path` is given (use `wiki_search`, or `search` over that corpus)
    textworld_quest  generated TextWorld games (tasks/textworld_quest.py), one per row's `seed`, played through
                   its environment_factory `mt_grpo.tasks.textworld_quest:TextWorldQuest`; splits "train" and "test"
                   (disjoint seeds); `seed` (recipe: `kb_seed`) draws the games
    a file path    .jsonl / .json / .parquet / .csv (one split, "train"; in a .csv every value is text)
    a folder       as the hub would serve it (data/train-*.parquet, ...: `datasets.load_dataset(folder)`), or
                   one written by `Dataset.save_to_disk` (one split, "train") / `DatasetDict.save_to_disk`
    a hub name     any dataset `datasets.load_dataset(name, dataset_config, split=split)` reads, e.g.
                   openai/gsm8k with dataset_config main; needs the hub, or the dataset in the local cache

The columns (each renamed by `columns`, the recipe's `question_column` / `answer_column` / `prompt_column`):
    question   the question, a string
    answer     the accepted answer: a string or a list of aliases. Needed when a reward compares answers
               (`answer_required`). It reaches the rewards as the dataset holds it (as TRL passes it: a TRL reward's
               `answer.lower()` works on a string column), and its aliases as `answer_aliases`. The datasets are
               used as they are: gsm8k's answer is a worked solution ending in "#### 72", so map another column or
               use a reward that extracts the number.
    answer_aliases  made here: the answer's accepted spellings, `list[str]` (a string answer is a list of one;
               stripped, without duplicates or empty ones; [] for a row without an answer). The rewards that
               compare answers (rewards/answers.py) read this keyword. A dataset may give its own `answer_aliases`
               column beside `answer` (the tasks here do: triviaqa's aliases, the knowledge base's spellings).
    prompt     optional: a TRL prompt, standard (a string) or conversational (a list of {"role", "content"}
               messages ending with a user message). It becomes the episode's prompt (protocol.build_prompt; its
               own system message replaces the task's part of the system prompt), and `question` may then be
               missing: it is filled with the prompt's last user message, for the rewards that read it.
Every other column reaches the reward functions as a keyword argument. A task comes out as a
`datasets.Dataset` with the columns `question: str`, `answer` (as the dataset has it) and `answer_aliases:
list[str]` (when there is an answer), `prompt` (when there is one) and the others. Malformed rows (no question,
an answer that is not a string or a list of strings, an empty one when answers are required, a malformed
prompt) are skipped and counted, not fatal: one bad row in a large file should not stop a run, and
`Task.skipped` says which rows to fix ("row 17: empty question"; rows count from 0, so in a .jsonl file without
blank lines that is line 18). A dataset with no valid row is an error. `validate_dataset` applies the same rules to a `datasets.Dataset` built in Python.
With an environment_factory (`environment`), whose reset gives the prompt, a row may have no prompt and no
question, or an empty one, as in TRL: it becomes EMPTY_PROMPT (a dataset of only an `environment` column routes
each row to its class), and its question is "".

A task may bring the task's part of the system prompt and worked examples (`Task.system_prompt`,
`Task.examples`); the search tasks here bring theirs (tasks/fictional_kb.py). Any other dataset gets the neutral
ones of protocol.py, or the recipe's `system_prompt` and `few_shot_examples`.

To add a task: write a module here that builds its rows (and corpus, prompt, examples), and add its name to
TASK_NAMES and a branch to `load_task`.
"""

import csv
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import datasets

from mt_grpo.base.fields import arg
from mt_grpo.base.protocol import content_text, holds_images, prompt_problem, prompt_question


@dataclass
class TaskArguments:
    """The recipe keys of the task: its data, columns and held-out split; the trainer's config inherits them."""

    dataset_name: str | None = arg("fictional_kb", "fictional_kb (embedded, offline) | triviaqa | any `datasets."
                                   "load_dataset` name or local folder | a .jsonl/.json/.parquet/.csv file (see "
                                   "*_column) | None: `environment_factory`'s reset gives the prompt (set max_steps).")
    dataset_config: str | None = arg(None, "Configuration name for `datasets.load_dataset` (e.g. `main` of gsm8k).")
    question_column: str = arg("question", "The dataset's column holding the question.")
    answer_column: str = arg("answer", "The dataset's column holding the answer (a string or a list of aliases), "
                             "which rewards get as `answer`, as given, and as a list as `answer_aliases`; may be "
                             "missing when no reward needs it.")
    prompt_column: str = arg("prompt", "The dataset's column holding a TRL prompt (text, or chat messages), used "
                             "instead of the question when present.")
    dataset_split: str = arg("train", "Split of the dataset to train on.")
    max_samples: int | None = arg(None, "Keep at most this many questions (None: all).", minimum=1)
    kb_seed: int = arg(0, "Seed of the fictional knowledge base, apart from `seed`: every training seed sees one task.")
    kb_multi_hop: float = arg(0.0, "Share of fictional_kb questions that need two searches (0 to 1).")
    corpus_path: str | None = arg(None, ".jsonl of {title, text} documents for `search` (fictional_kb brings its own).")
    # evaluation runs with TRL's eval_strategy / eval_steps (and once before the first step)
    eval_dataset_name: str | None = arg(None, "Dataset to evaluate on, as `dataset_name` (None: the training one).")
    eval_dataset_split: str | None = arg(None, "Split to evaluate on (None: the task's held-out one); never the "
                                         "training split.")
    eval_max_samples: int | None = arg(None, "Evaluate on at most this many questions (None: all).", minimum=1)


logger = logging.getLogger("mt_grpo")

TASK_NAMES = ["fictional_kb", "fictional_kb_entities", "triviaqa", "textworld_quest"]
KB_TASKS = ("fictional_kb", "fictional_kb_entities")  # the fictional knowledge base, split by question or entity
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROLES = ("question", "answer", "prompt")  # the columns the trainer reads; `columns` maps each to the dataset's
ALIASES = "answer_aliases"  # the answer's aliases, list[str]: the column this module makes (or the dataset gives)
MAX_SKIP_REASONS = 5
# What evaluation reports on a question-answer task (every task here is one): `eval/<name>` is the share of
# episodes on which the reward function (a name from mt_grpo/rewards) is above 0.
QA_EVAL_METRICS = {"exact_match": "exact_match_reward_func", "first_search_hit": "exist_answer_in_search_results"}
FEATURES = datasets.Features({"question": datasets.Value("string"), "answer": datasets.Value("string"),
                              ALIASES: datasets.List(datasets.Value("string"))})
MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})  # a chat prompt
EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt of a row without one: the environment's reset fills it


@dataclass
class Task:
    dataset: datasets.Dataset  # columns: question (str), answer (as given), answer_aliases (list[str]), prompt, others
    corpus: list[dict] | None  # {"title", "text"} documents for the `search` tool; None: no corpus
    num_skipped: int = 0  # malformed rows left out
    skipped: list[str] = field(default_factory=list)  # why, for the first MAX_SKIP_REASONS of them
    eval_metrics: dict[str, str] = field(default_factory=lambda: dict(QA_EVAL_METRICS))  # eval/<name>: reward function
    system_prompt: str | None = None  # the system prompt's task part (None: protocol.DEFAULT_TASK_PROMPT)
    # worked examples (protocol.check_examples), or a function of the run's tools that gives them; None: none
    examples: list[dict] | Callable[[list], list[dict]] | None = None
    # what the task brings for the config's fields left unset (None): `tools`, `turn_reward_funcs`,
    # `outcome_reward_funcs` (task_defaults); a dataset of your own brings none
    defaults: dict = field(default_factory=dict)


# The search tasks' defaults (the knowledge base, TriviaQA): a search tool, turn rewards for a call that ran and
# brought back the answer, outcome rewards for the answer. No other task gets them: with your own data or an
# environment, the run has the tools and rewards you give, as in TRL.
SEARCH_QA_DEFAULTS = {"tools": ["search"],
                      "turn_reward_funcs": ["tool_execution_reward_func", "answer_in_tool_result"],
                      "outcome_reward_funcs": ["exact_match_reward_func", "exist_answer_reward_func",
                                               "format_reward_func"]}


def task_keyword(name: str):
    """The default and help of TaskArguments' field `name`, for a config that takes it as a constructor keyword
    (an InitVar) rather than a field: MTGRPOConfig, whose `dataset_name` and `dataset_config` TRL's
    ScriptArguments also declares (mt_grpo_trainer.py)."""
    declared = TaskArguments.__dataclass_fields__[name]
    return field(default=declared.default, metadata=declared.metadata)


def task_defaults(dataset_name: str | None, corpus_path: str | None = None) -> dict:
    """The defaults of a task named by `dataset_name` (Task.defaults): the search tasks' for the knowledge base and
    TriviaQA (which searches Wikipedia unless given a corpus); none for any other dataset."""
    if dataset_name in KB_TASKS:
        return dict(SEARCH_QA_DEFAULTS)
    if dataset_name == "triviaqa":
        return {**SEARCH_QA_DEFAULTS, "tools": ["search" if corpus_path else "wiki_search"]}
    return {}


def load_task(dataset_name: str, split: str = "train", max_samples: int | None = None,
              corpus_path: str | None = None, seed: int = 0, multi_hop: float = 0.0, *,
              dataset_config: str | None = None, columns: dict[str, str] | None = None,
              answer_required: bool | list[str] = True, environment: bool = False) -> Task:
    """The task named by the recipe's `dataset_name` (see the module docstring). `max_samples` keeps
    the first that many valid rows; `corpus_path` (.jsonl of {title, text}) replaces the task's
    corpus; `seed` picks the fictional knowledge base and its test split; `multi_hop` is the
    fictional knowledge base's fraction of two-hop questions (0.0 to 1.0); `dataset_config` is a hub
    dataset's (or folder's) configuration; `columns` maps question / answer / prompt to the dataset's
    columns; `answer_required` False keeps rows without an answer (for rewards that need none); `environment`: an
    environment_factory's reset gives the prompt (validate_dataset)."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 (or None for all rows), got {max_samples}.")
    if multi_hop and dataset_name not in KB_TASKS:
        raise ValueError(f"kb_multi_hop={multi_hop} applies to dataset_name: {' or '.join(KB_TASKS)} only, not "
                         f"{dataset_name!r}. Set kb_multi_hop: 0.0, or use the fictional_kb task.")
    if dataset_config is not None and (dataset_name in TASK_NAMES or os.path.isfile(dataset_name)):
        raise ValueError(f"dataset_config={dataset_config!r} applies to hub datasets and dataset folders, not "
                         f"{dataset_name!r}. Remove dataset_config.")
    # The corpus first: a wrong corpus_path should fail before a long dataset download.
    corpus_override = load_corpus(corpus_path) if corpus_path is not None else None
    corpus = task_prompt = examples = None
    eval_metrics = dict(QA_EVAL_METRICS)
    if dataset_name in (*KB_TASKS, "triviaqa"):
        from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples

        task_prompt, examples = SEARCH_TASK_PROMPT, search_examples
    if dataset_name in KB_TASKS:
        from mt_grpo.tasks.fictional_kb import build_fictional_kb, build_fictional_kb_entities, fictional_kb_split

        if dataset_name == "fictional_kb":
            corpus, qa = build_fictional_kb(seed, multi_hop=multi_hop)
            qa = fictional_kb_split(qa, split, seed)
        else:
            corpus, qa = build_fictional_kb_entities(seed, split, multi_hop)
        # the answer as the documents write it (a string), and its other spellings as aliases
        data = datasets.Dataset.from_dict({"question": [r["question"] for r in qa],
                                           "answer": [r["answer"][0] for r in qa],
                                           ALIASES: [r["answer"] for r in qa]}, features=FEATURES)
    elif dataset_name == "triviaqa":
        from mt_grpo.tasks.triviaqa import load_triviaqa

        data = load_triviaqa(split)
    elif dataset_name == "textworld_quest":  # games, played through its environment_factory (environments.py)
        from mt_grpo.tasks.textworld_quest import GAME_TASK_PROMPT, TASK_EVAL_METRICS, game_examples, load

        data, task_prompt, examples = load(split, max_samples, seed), GAME_TASK_PROMPT, game_examples
        eval_metrics = dict(TASK_EVAL_METRICS)
    else:
        data = read_dataset(dataset_name, split, dataset_config)
    task = validate_dataset(data, columns, answer_required, source=dataset_name, max_samples=max_samples,
                            environment=environment)
    task.corpus = corpus_override if corpus_override is not None else corpus
    task.system_prompt, task.examples, task.eval_metrics = task_prompt, examples, eval_metrics
    task.defaults = task_defaults(dataset_name, corpus_path)
    return task


# The split each task holds out for evaluation (a local file has one split: another file is held out whole).
# fictional_kb_entities holds out "validation": choices are made on it, and "test" is read only when asked for.
HELD_OUT_SPLITS = {"fictional_kb": "test", "fictional_kb_entities": "validation", "triviaqa": "validation",
                   "textworld_quest": "test"}


def load_eval_task(args, answer_required: bool | list[str] = True, environment: bool = False) -> Task:
    """The eval task of a recipe (MTGRPOScriptArguments `args`): `eval_dataset_name` (default: the
    training dataset) at `eval_dataset_split` (default: the task's held-out split), read with the recipe's
    columns (and its `dataset_config`, for the training dataset). It must not be the training split of the
    training set."""
    name = args.eval_dataset_name or args.dataset_name
    # a local file has one split, "train": another file is held out as a whole
    split = (args.eval_dataset_split or HELD_OUT_SPLITS.get(name)
             or ("train" if name != args.dataset_name else None))
    if split is None:
        raise ValueError(f"Evaluation needs a held-out set, and {name!r} has no known one: set "
                         "`eval_dataset_split` (e.g. test, for a hub dataset that has one), or `eval_dataset_name` "
                         "to another file, or turn evaluation off (`eval_strategy: no`).")
    if name == args.dataset_name and split == args.dataset_split:
        raise ValueError(f"The eval set is the training set ({name!r}, split {split!r}): set "
                         "`eval_dataset_split` (or `eval_dataset_name`) to held-out data.")
    config = getattr(args, "dataset_config", None) if name == args.dataset_name else None
    return load_task(name, split, args.eval_max_samples, args.corpus_path, args.kb_seed,
                     args.kb_multi_hop, dataset_config=config, columns=recipe_columns(args),
                     answer_required=answer_required, environment=environment)


def recipe_columns(args) -> dict[str, str]:
    """The recipe's column mapping (`question_column`, ...): role -> the dataset's column."""
    return {role: getattr(args, f"{role}_column", role) for role in ROLES}


def load_corpus(path: str) -> list[dict]:
    """A .jsonl file with one `{"title": str, "text": str}` document per line (title optional)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus_path {path!r} does not exist (cwd: {os.getcwd()}). Point it at a .jsonl "
                                "file of {\"title\": ..., \"text\": ...} documents, or remove it.")
    documents = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {line_number}: not valid JSON ({e.msg}).") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str) or not doc["text"].strip():
                raise ValueError(f"{path}, line {line_number}: a document needs a non-empty \"text\" string; "
                                 f"got {line.strip()[:200]}")
            title = doc.get("title")
            documents.append({"title": title if isinstance(title, str) else "", "text": doc["text"]})
    if not documents:
        raise ValueError(f"corpus_path {path!r} holds no documents; write one {{\"title\", \"text\"}} JSON per line.")
    return documents


# ------------------------------------------------------------------------------------------------
# Reading a dataset: a file, a folder, or the hub
# ------------------------------------------------------------------------------------------------
def read_dataset(name: str, split: str = "train", config: str | None = None) -> datasets.Dataset:
    """The rows of a local file, a dataset folder or a hub dataset (module docstring), unvalidated."""
    name = os.path.expanduser(name)
    if os.path.isdir(name):
        return _read_folder(name, split, config)
    if os.path.exists(name) or _is_local_path(name):
        return _read_file(name, split)
    return load_hub_dataset(name, config, split)


def _is_local_path(name: str) -> bool:
    """A name that can only be a path (a hub name is `name` or `owner/name`): a missing file, not a hub lookup."""
    return (os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1
            or os.path.splitext(name)[1].lower() in FILE_FORMATS)


def _read_file(path: str, split: str) -> datasets.Dataset:
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset_name {path!r} is neither a task ({', '.join(TASK_NAMES)}) nor an existing "
                                f"file or folder (cwd: {os.getcwd()}). Set dataset_name to a task name, the path of a "
                                f"{'/'.join(FILE_FORMATS)} file or of a dataset folder, or a hub name (owner/name).")
    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_FORMATS or not os.path.isfile(path):
        raise ValueError(f"dataset_name {path!r}: can only read {', '.join(FILE_FORMATS)} files, and dataset "
                         "folders.")
    if split != "train":
        raise ValueError(f"A local dataset file has a single split, 'train'; got dataset_split={split!r}. "
                         "Set dataset_split: train, and put another split in a file of its own.")
    builder = FILE_FORMATS[extension]
    options = {"features": _all_text(path)} if builder == "csv" else {}
    try:
        return datasets.load_dataset(builder, data_files=path, split="train", **options)
    except Exception as e:  # pyarrow / pandas / json errors: say which file
        raise ValueError(f"Could not read {path!r} as {builder} ({type(e).__name__}: {e}).") from e


def _all_text(csv_path: str) -> datasets.Features:
    """CSV has no types: read every column as text, so that a year like 1742 stays the answer "1742"."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _read_folder(path: str, split: str, config: str | None) -> datasets.Dataset:
    """A folder written by save_to_disk (load_from_disk reads it), else one of data files (load_dataset)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json")):
        saved = datasets.load_from_disk(path)
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ValueError(f"{path!r} has the splits {list(saved)}, not {split!r}: set dataset_split (or "
                                 "eval_dataset_split) to one of them.")
            return saved[split]
        if split != "train":
            raise ValueError(f"{path!r} holds one Dataset (save_to_disk), read as the split 'train'; got "
                             f"dataset_split={split!r}. Set dataset_split: train, or save a DatasetDict of splits.")
        return saved
    try:
        return datasets.load_dataset(path, config, split=split)
    except ValueError as e:  # an unknown split or config
        raise ValueError(f"Dataset folder {path!r}, config {config!r}, split {split!r}: {e} Set dataset_config and "
                         "dataset_split (or eval_dataset_split) to ones it has.") from e
    except Exception as e:
        raise ValueError(f"Could not read the dataset folder {path!r} ({type(e).__name__}: {e}). A dataset folder "
                         "holds data files (data/train-00000-of-00001.parquet) or was written by save_to_disk.") from e


def load_hub_dataset(name: str, config: str | None, split: str, label: str | None = None) -> datasets.Dataset:
    """`datasets.load_dataset(name, config, split=split)`, with errors that say what to do. Raises RuntimeError, at
    once under HF_HUB_OFFLINE=1, when the hub cannot be reached and the dataset is not cached."""
    # a name of the user's (no label of a task's own): say first what else it could have been, for a misspelled task
    unknown = "" if label else (f" it is not a task ({', '.join(TASK_NAMES)}) nor a local file or folder (cwd: "
                                f"{os.getcwd()}), and as a hub name,")
    label = label or f"The hub dataset {name!r}"
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(name, config, split=split)
    except DatasetNotFoundError as e:  # reached the hub: no such dataset, or not ours to read
        raise ValueError(f"{label} is neither a task ({', '.join(TASK_NAMES)}), a local file or folder (cwd: "
                         f"{os.getcwd()}), nor a dataset on the hub that this login can read ({e}). Check the name "
                         "(owner/name, as on huggingface.co/datasets), or log in (`hf auth login`) for a gated "
                         "or private one.") from e
    # What load_dataset raises when it cannot get the files: ConnectionError (also for offline mode,
    # huggingface_hub's OfflineModeIsEnabled), FileNotFoundError ("not cached"), TimeoutError. Without
    # HF_HUB_OFFLINE=1, huggingface_hub retries an unreachable hub for about 25 s before it gives up.
    except (ConnectionError, TimeoutError, FileNotFoundError) as e:
        raise RuntimeError(
            f"{label} could not be loaded:{unknown} the dataset hub could not be reached and the dataset is not in "
            f"the local cache ({type(e).__name__}: {e}). Download it once where the hub can be reached, train on the "
            "embedded task instead (dataset_name: fictional_kb), or set dataset_name to a local "
            ".jsonl/.json/.parquet/.csv file or a dataset folder."
        ) from e
    except ValueError as e:  # an unknown split or config
        raise ValueError(f"{label}, config {config!r}, split {split!r}: {e} Set dataset_config and dataset_split "
                         "(or eval_dataset_split) to ones it has.") from e


# ------------------------------------------------------------------------------------------------
# Validating the rows
# ------------------------------------------------------------------------------------------------
def validate_dataset(dataset: datasets.Dataset, columns: dict[str, str] | None = None,
                     answer_required: bool | list[str] = True, source: str = "train_dataset",
                     max_samples: int | None = None, environment: bool = False) -> Task:
    """A Task of the valid rows of `dataset` (the module docstring's columns and rules): `columns` maps
    question / answer / prompt to the dataset's columns (missing: the same name); `max_samples` keeps the first
    that many valid rows; `source` names the dataset in errors; `environment`: an environment_factory's reset
    gives the prompt, so a row may have none, or an empty one."""
    if not isinstance(dataset, datasets.Dataset):
        hint = (" (a DatasetDict: pick a split, e.g. dataset['train'])" if isinstance(dataset, datasets.DatasetDict)
                else "")
        raise ValueError(f"{source} is a {type(dataset).__name__}{hint}; pass a datasets.Dataset.")
    roles = _resolve_columns(dataset.column_names, columns or {}, answer_required, source, environment)
    given_aliases = ALIASES in dataset.column_names and roles["answer"] is not None
    extras = [c for c in dataset.column_names if c not in roles.values() and c not in ROLES
              and not (c == ALIASES and given_aliases)]
    prompts = roles["prompt"] or environment and not roles["question"]  # none given: EMPTY_PROMPT, reset fills it
    out = {role: [] for role in ROLES if role == "question" or roles[role] or role == "prompt" and prompts} | \
        ({ALIASES: []} if roles["answer"] else {}) | {c: [] for c in extras}
    reasons, num_skipped = [], 0
    # in batches: a row at a time from Arrow is slow, and the whole table as Python lists is large
    rows = ({c: batch[c][k] for c in batch} for batch in dataset.iter(batch_size=1000)
            for k in range(len(batch[dataset.column_names[0]])))
    for i, row in enumerate(rows):
        values, problem = _valid_row(row, roles, answer_required, environment, given_aliases)
        if problem:
            num_skipped += 1
            if len(reasons) < MAX_SKIP_REASONS:
                reasons.append(f"row {i}: {problem}")
            continue
        for column in out:
            out[column].append(values[column] if column in values else row[column])
        if max_samples is not None and len(out["question"]) >= max_samples:
            break  # the first max_samples valid rows: the rest is not read
    if num_skipped == 0 and not out["question"]:
        raise ValueError(f"{source!r} has no rows; it needs a `question` (or `prompt`) and an `answer` column with at "
                         "least one row.")
    if not out["question"]:
        raise ValueError(f"{source!r} has no valid row ({num_skipped} malformed, e.g. {'; '.join(reasons) or 'none'}). "
                         "Each row needs a non-empty `question` string (or a TRL `prompt`) and an `answer` string or "
                         "list of strings.")
    features = {**FEATURES, **{c: dataset.features[c] for c in extras}}
    if roles["answer"]:  # the dataset's own type: the answer reaches the rewards unchanged
        features["answer"] = dataset.features[roles["answer"]]
    if "prompt" in out:
        features["prompt"] = datasets.Value("string") if isinstance(out["prompt"][0], str) else MESSAGES
    dataset = datasets.Dataset.from_dict(out, features=datasets.Features({c: features[c] for c in out}))
    return Task(dataset=dataset, corpus=None, num_skipped=num_skipped, skipped=reasons)


def _resolve_columns(names: list[str], columns: dict[str, str], answer_required: bool | list[str], source: str,
                     environment: bool = False) -> dict:
    """role -> the dataset's column holding it, or None when the dataset has none (and may lack it)."""
    unknown = sorted(set(columns) - set(ROLES))
    if unknown:
        raise ValueError(f"columns maps {unknown}, which the trainer does not read; map some of {list(ROLES)} to the "
                         "dataset's columns, e.g. {'question': 'problem'}.")
    roles = {}
    for role in ROLES:
        column = columns.get(role) or role
        if column not in names and column != role:  # renamed on purpose: it must be there
            raise ValueError(f"{source!r} has no column {column!r} (the {role}: `{role}_column`); its columns are "
                             f"{names}. Set `{role}_column` to one of them.")
        roles[role] = column if column in names else None
    missing = [role for role in ("question", "answer") if roles[role] is None
               and (roles["prompt"] is None and not environment if role == "question" else answer_required)]
    if missing:
        # answer_required may name the rewards that read the answer: say which, so the fix is clear
        needing = (f" ({', '.join(answer_required)} read it: give the column, or take them out of the recipe's "
                   "reward functions)") if "answer" in missing and isinstance(answer_required, list) else ""
        raise ValueError(f"{source!r} has no {' and no '.join(repr(c) for c in missing)} column; its columns are "
                         f"{names}. Each row needs a question (a `question` or a TRL `prompt` column) and, for the "
                         f"rewards that compare answers, an `answer` (a string or a list of accepted aliases){needing}"
                         "; `question_column` / `answer_column` / `prompt_column` name the dataset's own columns.")
    return roles


def _valid_row(row: dict, roles: dict, answer_required: bool, environment: bool = False,
               given_aliases: bool = False) -> tuple[dict, str]:
    """(the row's question, answer, its aliases and prompt, "") if it is usable, else ({}, why not). The aliases
    are the row's `answer_aliases` when the dataset gives them (`given_aliases`), else made from its answer. With
    an `environment`, a row without a prompt or question, or with an empty one, is usable: the environment's reset
    gives the prompt."""
    values, problem = {}, ""
    if roles["prompt"] or environment and not roles["question"]:
        prompt = row[roles["prompt"]] if roles["prompt"] else None
        if environment and not prompt:  # None, [] or "": TRL's empty user message (a string stays a string)
            prompt = "" if isinstance(prompt, str) else EMPTY_PROMPT
        if prompt != "" and (problem := prompt_problem(prompt)):
            return {}, problem
        # a user message of text and image blocks keeps its text: the images come from the row's image/images column
        # at rollout, first in the first user message (engine/vision.prompt_with_images; a table column holds text)
        values["prompt"] = prompt if isinstance(prompt, str) else [
            {"role": m["role"], "content": content_text(m["content"]) if holds_images(m["content"]) else m["content"]}
            for m in prompt]
    if roles["answer"]:
        values["answer"] = row[roles["answer"]]
        values[ALIASES], problem = _answer_aliases(row[ALIASES] if given_aliases else values["answer"])
        if problem in ("no answer", "empty answer") and not answer_required:
            problem = ""
        elif problem and given_aliases:
            problem = f"{ALIASES}: {problem}"
    question = row[roles["question"]] if roles["question"] else None
    if "prompt" in values and not (isinstance(question, str) and question.strip()):
        question = prompt_question(values["prompt"])  # the prompt stands in for a missing question
    if not isinstance(question, str):
        problem = "no question" if question is None else f"question is a {type(question).__name__}, not a string"
    elif not question.strip() and not environment:
        problem = "empty question"
    values["question"] = question.strip() if isinstance(question, str) else question
    return ({}, problem) if problem else (values, "")


def _as_text(value) -> str:
    """The fix for a number given as an answer: the same as text, which `answer_type` still compares as a number."""
    return f' (write {value!r} as "{value}")' if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _answer_aliases(answer) -> tuple[list[str], str]:
    """(aliases, "") for a usable answer, else ([], why not). A string becomes a one-alias list."""
    if answer is None:
        return [], "no answer"
    if isinstance(answer, str):
        answer = [answer]
    if not isinstance(answer, (list, tuple)):
        return [], f"answer is a {type(answer).__name__}, not a string or a list of strings{_as_text(answer)}"
    if not all(isinstance(a, str) for a in answer):
        bad = next(a for a in answer if not isinstance(a, str))
        return [], f"answer list holds a {type(bad).__name__}, not only strings{_as_text(bad)}"
    aliases = list(dict.fromkeys(a.strip() for a in answer if a.strip()))
    return (aliases, "") if aliases else ([], "empty answer")


def build_dataset(args, env, task, tools_of: Callable | None = None):
    """The task's rows with chat prompts (`env.prompt`: the trainer's MultiTurnToolEnv) of their TRL `prompt`, or
    else of their question, in the column `prompt`; prompts longer than `args.max_prompt_length` tokens are
    dropped, with a count. `tools_of(environment)`: the tools a row's prompt lists, by its `environment` column
    (several environment classes, environments.py); None: the env's."""
    has_prompt = "prompt" in task.dataset.column_names
    sources = task.dataset["prompt"] if has_prompt else task.dataset["question"]
    names = task.dataset["environment"] if "environment" in task.dataset.column_names else [None] * len(sources)
    # a column, not datasets.map: map hashes its function for the cache, and a closure over the env cannot be
    # pickled (dill warned at every start, and the cache never worked)
    rest = task.dataset.remove_columns(["prompt"]) if has_prompt else task.dataset
    prompts = [env.prompt(p if p else EMPTY_PROMPT, tools_of(name) if tools_of else None)  # "": an environment's
               for p, name in zip(sources, names)]
    # a table without columns has no rows: the placeholder rows of an environment's run are prompts only
    dataset = rest.add_column("prompt", prompts) if rest.column_names else datasets.Dataset.from_dict({"prompt": prompts})
    if args.max_prompt_length is None:  # no cap, as TRL's
        return dataset
    lengths = [len(env.render_ids(p, add_generation_prompt=True)) for p in dataset["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= args.max_prompt_length]
    if len(keep) < len(dataset):
        logger.warning("Dropped %d of %d prompts longer than max_prompt_length=%d tokens.",
                       len(dataset) - len(keep), len(dataset), args.max_prompt_length)
        if not keep:
            raise ValueError(f"Every prompt is longer than `max_prompt_length` "
                             f"({args.max_prompt_length}); raise it.")
        dataset = dataset.select(keep)
    return dataset
