"""Tasks: the questions the agent trains on, with their accepted answers, and the corpus it searches.

`load_task(dataset_name, ...)` takes the recipe's `dataset_name`:
    fictional_kb   the embedded, offline knowledge base of invented facts (tasks/fictional_kb.py);
                   brings its own corpus; splits "train" and "test" (a held-out 10% of the questions);
                   `multi_hop` (recipe: `kb_multi_hop`) makes that fraction of the questions two-hop
                   ("In what year was the founder of the city of Rarzogard born?": two searches)
    triviaqa       TriviaQA from the Hugging Face hub (tasks/triviaqa.py); no corpus unless
                   `corpus_path` is given (use `wiki_search`, or `search` over that corpus)
    a file path    .jsonl / .json / .parquet / .csv with a `question` and an `answer` column (answer:
                   one string or a list of accepted aliases; in a .csv, one string per row)

Every task comes out as a `datasets.Dataset` with exactly the columns `question: str` and
`answer: list[str]`. Malformed rows (no question, an empty answer, an answer that is not a string
or a list of strings) are skipped and counted, not fatal: one bad row in a large file should not
stop a run, and `Task.skipped` says which rows to fix ("row 17: empty question"; rows count from 0,
so in a .jsonl file without blank lines that is line 18). A dataset with no valid row is an error.
"""

import csv
import json
import logging
import os
from dataclasses import dataclass, field

import datasets

logger = logging.getLogger("mt_grpo")

TASK_NAMES = ["fictional_kb", "triviaqa"]
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_SKIP_REASONS = 5
# What evaluation reports on a question-answer task (every task here is one): `eval/<name>` is the share of
# episodes on which the reward function (a name from rewards/) is above 0.
QA_EVAL_METRICS = {"exact_match": "exact_match_reward_func", "first_search_hit": "exist_answer_in_search_results"}
FEATURES = datasets.Features({"question": datasets.Value("string"), "answer": datasets.List(datasets.Value("string"))})


@dataclass
class Task:
    dataset: datasets.Dataset  # columns: question (str), answer (list[str], the accepted aliases)
    corpus: list[dict] | None  # {"title", "text"} documents for the `search` tool; None: no corpus
    num_skipped: int = 0  # malformed rows left out
    skipped: list[str] = field(default_factory=list)  # why, for the first MAX_SKIP_REASONS of them
    eval_metrics: dict[str, str] = field(default_factory=lambda: dict(QA_EVAL_METRICS))  # eval/<name>: reward function


def load_task(dataset_name: str, split: str = "train", max_samples: int | None = None,
              corpus_path: str | None = None, seed: int = 0, multi_hop: float = 0.0) -> Task:
    """The task named by the recipe's `dataset_name` (see the module docstring). `max_samples` keeps
    the first that many valid rows; `corpus_path` (.jsonl of {title, text}) replaces the task's
    corpus; `seed` picks the fictional knowledge base and its test split; `multi_hop` is the
    fictional knowledge base's fraction of two-hop questions (0.0 to 1.0)."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 (or None for all rows), got {max_samples}.")
    if multi_hop and dataset_name != "fictional_kb":
        raise ValueError(f"kb_multi_hop={multi_hop} applies to dataset_name: fictional_kb only, not "
                         f"{dataset_name!r}. Set kb_multi_hop: 0.0, or use the fictional_kb task.")
    # The corpus first: a wrong corpus_path should fail before a long dataset download.
    corpus_override = load_corpus(corpus_path) if corpus_path is not None else None
    if dataset_name == "fictional_kb":
        from tasks.fictional_kb import build_fictional_kb, fictional_kb_split

        documents, qa = build_fictional_kb(seed, multi_hop=multi_hop)
        qa = fictional_kb_split(qa, split, seed)
        raw, corpus = {"question": [r["question"] for r in qa], "answer": [r["answer"] for r in qa]}, documents
    elif dataset_name == "triviaqa":
        from tasks.triviaqa import load_triviaqa

        ds = load_triviaqa(split)
        raw, corpus = {"question": list(ds["question"]), "answer": list(ds["answer"])}, None
    else:
        raw, corpus = _read_file(dataset_name, split), None
    task = _validated(raw, max_samples, source=dataset_name)
    task.corpus = corpus_override if corpus_override is not None else corpus
    return task


# The split each task holds out for evaluation (a local file has one split: another file is held out whole).
HELD_OUT_SPLITS = {"fictional_kb": "test", "triviaqa": "validation"}


def load_eval_task(script_args) -> Task:
    """The eval task of a recipe (MTGRPOScriptArguments `script_args`): `eval_dataset_name` (default: the
    training dataset) at `eval_dataset_split` (default: the task's held-out split). It must not be the training
    split of the training set."""
    name = script_args.eval_dataset_name or script_args.dataset_name
    # a local file has one split, "train": another file is held out as a whole
    split = (script_args.eval_dataset_split or HELD_OUT_SPLITS.get(name)
             or ("train" if name != script_args.dataset_name else None))
    if split is None:
        raise ValueError(f"Evaluation needs a held-out set, and {name!r} has no known one: set "
                         "`eval_dataset_name` to another file (and `eval_dataset_split`), or turn evaluation "
                         "off (`eval_strategy: no`).")
    if name == script_args.dataset_name and split == script_args.dataset_split:
        raise ValueError(f"The eval set is the training set ({name!r}, split {split!r}): set "
                         "`eval_dataset_split` (or `eval_dataset_name`) to held-out data.")
    return load_task(name, split, script_args.eval_max_samples, script_args.corpus_path, script_args.kb_seed,
                     script_args.kb_multi_hop)


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


def _read_file(path: str, split: str) -> dict[str, list]:
    """The columns of a local file (`question` and `answer` required), unvalidated."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset_name {path!r} is neither a task ({', '.join(TASK_NAMES)}) nor an existing "
                                f"file (cwd: {os.getcwd()}). Set dataset_name to a task name or to the path of a "
                                f"{'/'.join(FILE_FORMATS)} file.")
    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_FORMATS or not os.path.isfile(path):
        raise ValueError(f"dataset_name {path!r}: can only read {', '.join(FILE_FORMATS)} files.")
    if split != "train":
        raise ValueError(f"A local dataset file has a single split, 'train'; got dataset_split={split!r}. "
                         "Set dataset_split: train, and put another split in a file of its own.")
    builder = FILE_FORMATS[extension]
    options = {"features": _all_text(path)} if builder == "csv" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train", **options)
    except Exception as e:  # pyarrow / pandas / json errors: say which file
        raise ValueError(f"Could not read {path!r} as {builder} ({type(e).__name__}: {e}).") from e
    missing = [c for c in ("question", "answer") if c not in ds.column_names]
    if missing:
        raise ValueError(f"{path!r} has no {' and no '.join(repr(c) for c in missing)} column; its columns are "
                         f"{ds.column_names}. Each row needs a `question` and an `answer` (a string or a list of "
                         "accepted aliases).")
    return {c: list(ds[c]) for c in ds.column_names}  # other columns reach the reward functions


def _all_text(csv_path: str) -> datasets.Features:
    """CSV has no types: read every column as text, so that a year like 1742 stays the answer "1742"."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _validated(raw: dict[str, list], max_samples: int | None, source: str) -> Task:
    """Keep the rows with a question and at least one answer alias; count and explain the others."""
    questions, answers, reasons, kept = [], [], [], []
    num_skipped = 0
    for i, (question, answer) in enumerate(zip(raw["question"], raw["answer"])):
        aliases, problem = _answer_aliases(answer)
        if not isinstance(question, str):
            problem = "no question" if question is None else f"question is a {type(question).__name__}, not a string"
        elif not question.strip():
            problem = "empty question"
        if problem:
            num_skipped += 1
            if len(reasons) < MAX_SKIP_REASONS:
                reasons.append(f"row {i}: {problem}")
            continue
        questions.append(question.strip())
        answers.append(aliases)
        kept.append(i)
    if num_skipped == 0 and not questions:
        raise ValueError(f"{source!r} has no rows; it needs `question` and `answer` columns with at least one row.")
    if not questions:
        raise ValueError(f"{source!r} has no valid row ({num_skipped} malformed, e.g. {'; '.join(reasons) or 'none'}). "
                         "Each row needs a non-empty `question` string and an `answer` string or list of strings.")
    if max_samples is not None:
        questions, answers, kept = questions[:max_samples], answers[:max_samples], kept[:max_samples]
    dataset = datasets.Dataset.from_dict({"question": questions, "answer": answers}, features=FEATURES)
    for column in raw:  # extra columns of the valid rows, for reward functions that need them
        if column not in ("question", "answer", "prompt"):
            dataset = dataset.add_column(column, [raw[column][i] for i in kept])
    return Task(dataset=dataset, corpus=None, num_skipped=num_skipped, skipped=reasons)


def _answer_aliases(answer) -> tuple[list[str], str]:
    """(aliases, "") for a usable answer, else ([], why not). A string becomes a one-alias list."""
    if answer is None:
        return [], "no answer"
    if isinstance(answer, str):
        answer = [answer]
    if not isinstance(answer, (list, tuple)):
        return [], f"answer is a {type(answer).__name__}, not a string or a list of strings"
    if not all(isinstance(a, str) for a in answer):
        bad = next(a for a in answer if not isinstance(a, str))
        return [], f"answer list holds a {type(bad).__name__}, not only strings"
    aliases = list(dict.fromkeys(a.strip() for a in answer if a.strip()))
    return (aliases, "") if aliases else ([], "empty answer")


def build_dataset(script_args, env, task):
    """The task's questions -> chat prompts (`env.prompt`: the trainer's MultiTurnToolEnv); prompts longer than
    `script_args.max_prompt_length` tokens are dropped, with a count."""
    # a column, not datasets.map: map hashes its function for the cache, and a closure over the env cannot be
    # pickled (dill warned at every start, and the cache never worked)
    dataset = task.dataset.add_column("prompt", [env.prompt(q) for q in task.dataset["question"]])
    lengths = [len(env.render_ids(p, add_generation_prompt=True)) for p in dataset["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= script_args.max_prompt_length]
    if len(keep) < len(dataset):
        logger.warning("Dropped %d of %d prompts longer than max_prompt_length=%d tokens.",
                       len(dataset) - len(keep), len(dataset), script_args.max_prompt_length)
        if not keep:
            raise ValueError(f"Every prompt is longer than `max_prompt_length` "
                             f"({script_args.max_prompt_length}); raise it.")
        dataset = dataset.select(keep)
    return dataset
