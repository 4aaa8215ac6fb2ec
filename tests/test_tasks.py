"""Tasks: the fictional knowledge base (deterministic, unique names, answerable by search; two-hop
questions that one search cannot answer and two can), local files with malformed rows skipped and
counted, the errors for missing files and columns, TriviaQA and any hub dataset failing fast and clearly
when the hub cannot be reached; and any dataset: TRL prompt columns (standard and conversational), folders
as the hub serves them or as save_to_disk writes them, column mapping, rows without answers, and a
`datasets.Dataset` built in Python."""

import hashlib
import json
import os
import re
import subprocess
import sys

import datasets
import pytest

from helpers import ROOT, make_env
from mt_grpo.tasks import FEATURES, build_dataset, load_eval_task, load_task, validate_dataset
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, build_fictional_kb, fictional_kb_split, search_examples
from mt_grpo.tasks.triviaqa import to_question_answer
from mt_grpo.tools.search import make_search_tool


def entity_document(question: str, documents: list[dict]) -> dict:
    """The one document whose title the question names, as whole words."""
    named = [d for d in documents if re.search(rf"\b{re.escape(d['title'])}\b", question)]
    assert len(named) == 1, (question, [d["title"] for d in named])
    return named[0]


# ----------------------------------------------------------------------------------------------------------------
# The fictional knowledge base

def test_fictional_kb_is_deterministic_in_its_seed(kb):
    assert build_fictional_kb(seed=0) == kb
    other_documents, other_qa = build_fictional_kb(seed=1)
    assert other_documents != kb[0] and other_qa != kb[1]
    assert [d["title"] for d in other_documents] != [d["title"] for d in kb[0]]


def test_fictional_kb_sizes_and_unique_names(kb):
    documents, qa = kb
    assert len(documents) == 200
    assert len({d["title"] for d in documents}) == 200
    assert len({row["question"] for row in qa}) == len(qa) >= 3 * len(documents)
    assert len(build_fictional_kb(seed=3, num_entities=7)[0]) == 7


def test_fictional_kb_answers_are_short_and_stated_in_their_entitys_document(kb):
    documents, qa = kb
    for row in qa:
        answer = row["answer"]
        assert isinstance(answer, list) and answer and all(isinstance(a, str) and a for a in answer)
        assert 1 <= len(answer[0].split()) <= 2, answer
        assert answer[0] in entity_document(row["question"], documents)["text"], row


def test_fictional_kb_year_answers_are_plain_years(kb):
    years = [row["answer"] for row in kb[1] if row["question"].startswith("In what year")]
    assert years and all(len(a) == 1 and re.fullmatch(r"\d{4}", a[0]) for a in years)


def test_fictional_kb_questions_are_answerable_by_search(kb):
    documents, qa = kb
    search = make_search_tool(documents)
    for row in qa[::7]:
        results = search(row["question"], num_results=3).lower()
        assert any(a.lower() in results for a in row["answer"]), row


@pytest.mark.parametrize("multi_hop", [0.0, 0.3])
def test_fictional_kb_train_and_test_splits_are_disjoint_and_cover_every_question(multi_hop):
    qa = build_fictional_kb(seed=0, multi_hop=multi_hop)[1]
    train = load_task("fictional_kb", "train", multi_hop=multi_hop)
    test = load_task("fictional_kb", "test", multi_hop=multi_hop)
    train_q, test_q = set(train.dataset["question"]), set(test.dataset["question"])
    assert train_q.isdisjoint(test_q)
    assert train_q | test_q == {row["question"] for row in qa}
    assert len(test_q) == len(qa) // 10
    assert list(load_task("fictional_kb", "test", multi_hop=multi_hop).dataset["question"]) == \
        list(test.dataset["question"])


def test_fictional_kb_task_has_question_answer_and_aliases_and_its_corpus(kb):
    """The answer as the documents write it (a string, as a TRL reward reads `answer`), its spellings as aliases."""
    task = load_task("fictional_kb", max_samples=10, seed=0)
    assert task.dataset.features == FEATURES
    assert task.dataset.column_names == ["question", "answer", "answer_aliases"]
    assert task.dataset[2] == {"question": "What is the main river of Ratomora?", "answer": "Tifex River",
                               "answer_aliases": ["Tifex River", "Tifex"]}
    assert len(task.dataset) == 10 and task.num_skipped == 0 and task.skipped == []
    assert task.corpus == kb[0]
    assert load_task("fictional_kb", seed=1).corpus != kb[0]
    assert load_task("fictional_kb", multi_hop=0.3).corpus == build_fictional_kb(seed=0, multi_hop=0.3)[0]


def test_fictional_kb_unknown_split():
    with pytest.raises(ValueError, match=re.escape("fictional_kb has the splits train, test, not 'validation'")):
        load_task("fictional_kb", "validation")


# ----------------------------------------------------------------------------------------------------------------
# Multi-hop questions in the fictional knowledge base

# Seed 0's documents, questions and test split as they were before multi-hop questions existed: the
# default knowledge base must not change under the runs and evaluations made with it.
ONE_HOP_SEED_0_SHA256 = "f45a94cebc0cc2aef4df16b2c33f28d5aa95ff40c084d2921dcda2c55ee8b0a1"


@pytest.fixture(scope="module")
def two_hop_kb():
    """Seed 0 with every question two-hop; the corpus is the same for every multi_hop above 0."""
    return build_fictional_kb(seed=0, multi_hop=1.0)


def test_multi_hop_zero_is_exactly_the_one_hop_knowledge_base(kb):
    documents, qa = build_fictional_kb(seed=0, multi_hop=0.0)
    blob = json.dumps([documents, qa, fictional_kb_split(qa, "test", seed=0)])
    assert hashlib.sha256(blob.encode()).hexdigest() == ONE_HOP_SEED_0_SHA256
    assert (documents, qa) == kb


def test_multi_hop_kb_is_deterministic_and_adds_a_document_per_founder_and_inventor(kb, two_hop_kb):
    documents, qa = build_fictional_kb(seed=0, multi_hop=0.3)
    assert build_fictional_kb(seed=0, multi_hop=0.3) == (documents, qa)
    assert build_fictional_kb(seed=1, multi_hop=0.3)[1] != qa
    assert documents == two_hop_kb[0]
    assert [d for d in documents if d in kb[0]] == kb[0]  # the entities are the same ones, in the same order
    assert len(documents) == len({d["title"] for d in documents}) == 300  # + 50 founders, + 50 inventors


# (multi_hop, number of questions, number of them that are two-hop)
SHARES = [(0.1, 1389, 139), (0.19, 1543, 293), (0.3, 1000, 300), (0.5, 600, 300), (1.0, 300, 300)]


@pytest.mark.parametrize("multi_hop, size, num_two_hop", SHARES)
def test_multi_hop_is_the_fraction_of_two_hop_questions(kb, two_hop_kb, multi_hop, size, num_two_hop):
    questions = [row["question"] for row in build_fictional_kb(seed=0, multi_hop=multi_hop)[1]]
    two_hop = {row["question"] for row in two_hop_kb[1]}
    assert len(questions) == size and sum(q in two_hop for q in questions) == num_two_hop
    assert num_two_hop == round(multi_hop * size)
    if multi_hop < 0.19:  # enough two-hop questions: every one-hop question is kept
        assert {row["question"] for row in kb[1]} <= set(questions)


def test_two_hop_answer_is_not_in_the_top_document_but_in_the_linked_persons(two_hop_kb):
    documents, qa = two_hop_kb
    search = make_search_tool(documents)
    assert len(qa) == 300
    for row in qa:
        top = search(row["question"], num_results=1)
        assert not any(a.lower() in top.lower() for a in row["answer"]), (row, top)
        # The top document names the person the question asks about; searching that name finds theirs.
        top_document = next(d for d in documents if top == f"{d['title']}: {d['text']}")
        linked = [d["title"] for d in documents if d is not top_document and d["title"] in top_document["text"]]
        assert len(linked) == 1, (row, linked)
        second = search(linked[0], num_results=1)
        assert second.startswith(f"{linked[0]}:") and row["answer"][0] in second, (row, second)


def test_multi_hop_one_hop_questions_are_stated_in_their_entitys_document_and_found_first(two_hop_kb):
    documents, qa = build_fictional_kb(seed=0, multi_hop=0.3)
    search = make_search_tool(documents)
    two_hop = {row["question"] for row in two_hop_kb[1]}
    for row in qa:
        if row["question"] not in two_hop:
            document = entity_document(row["question"], documents)
            assert row["answer"][0] in document["text"], row
            assert search(row["question"], num_results=1) == f"{document['title']}: {document['text']}", row


@pytest.mark.parametrize("call, message", [
    (lambda: build_fictional_kb(multi_hop=1.5), "multi_hop is the fraction of two-hop questions, from 0.0 to 1.0"),
    (lambda: build_fictional_kb(multi_hop=-0.1), "multi_hop is the fraction of two-hop questions, from 0.0 to 1.0"),
    (lambda: build_fictional_kb(num_entities=1, multi_hop=0.5), "num_entities=1 has none. Use num_entities >= 2"),
    (lambda: load_task(os.path.join(ROOT, "no_such.jsonl"), multi_hop=0.3),
     "kb_multi_hop=0.3 applies to dataset_name: fictional_kb or fictional_kb_entities only"),
])
def test_multi_hop_errors_say_what_to_change(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ----------------------------------------------------------------------------------------------------------------
# Local files

GOOD = [{"question": "What is the capital of Veltria?", "answer": ["Morvane"]},
        {"question": "Who built the sky loom?", "answer": ["Pella Rusk", "Rusk"]}]
# GOOD as a task holds it: the answer as given, and its aliases
GOOD_TASK = [{"question": "What is the capital of Veltria?", "answer": ["Morvane"], "answer_aliases": ["Morvane"]},
             {"question": "Who built the sky loom?", "answer": ["Pella Rusk", "Rusk"],
              "answer_aliases": ["Pella Rusk", "Rusk"]}]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


# (id, the malformed row put between the two good ones, the reason recorded for it)
MALFORMED = [
    ("no_answer_key", {"question": "Where?"}, "row 1: no answer"),
    ("null_answer", {"question": "Where?", "answer": None}, "row 1: no answer"),
    ("empty_answer_string", {"question": "Where?", "answer": ""}, "row 1: empty answer"),
    ("empty_answer_list", {"question": "Where?", "answer": []}, "row 1: empty answer"),
    ("blank_aliases", {"question": "Where?", "answer": ["", "  "]}, "row 1: empty answer"),
    ("int_answer", {"question": "When?", "answer": 1742}, "row 1: answer is a int, not a string or a list of strings (write 1742 as \"1742\")"),
    ("dict_answer", {"question": "When?", "answer": {"value": "x"}}, "row 1: answer is a dict, not a string or a list"),
    ("list_with_int", {"question": "When?", "answer": ["x", 3]}, "row 1: answer list holds a int, not only strings (write 3 as \"3\")"),
    ("no_question_key", {"answer": ["x"]}, "row 1: no question"),
    ("empty_question", {"question": "", "answer": ["x"]}, "row 1: empty question"),
    ("blank_question", {"question": "  \n", "answer": ["x"]}, "row 1: empty question"),
    ("int_question", {"question": 7, "answer": ["x"]}, "row 1: question is a int, not a string"),
]


@pytest.mark.parametrize("bad_row, reason", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_jsonl_malformed_row_is_skipped_and_counted(tmp_path, bad_row, reason):
    path = write_jsonl(tmp_path / "qa.jsonl", [GOOD[0], bad_row, GOOD[1]])
    task = load_task(path)
    assert task.num_skipped == 1
    assert len(task.skipped) == 1 and task.skipped[0].startswith(reason), task.skipped
    assert task.dataset.to_list() == GOOD_TASK
    assert task.corpus is None


def test_jsonl_string_answer_arrives_as_given_and_its_alias_is_trimmed(tmp_path):
    """`answer` as the file holds it (what a TRL reward is passed); `answer_aliases` a trimmed list of one."""
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": " Who? ", "answer": " Rusk "}, GOOD[0]])
    task = load_task(path)
    assert task.num_skipped == 0
    assert task.dataset.to_list() == [{"question": "Who?", "answer": " Rusk ", "answer_aliases": ["Rusk"]},
                                      GOOD_TASK[0]]
    assert task.dataset.features["answer_aliases"] == FEATURES["answer_aliases"]


def test_extra_columns_are_kept_for_the_reward_functions(tmp_path):
    rows = [{"question": "", "answer": "x", "id": 99}] + [{**row, "id": i} for i, row in enumerate(GOOD)]
    dataset = load_task(write_jsonl(tmp_path / "qa.jsonl", rows)).dataset
    assert dataset.column_names == ["question", "answer", "answer_aliases", "id"]
    assert dataset["id"] == list(range(len(GOOD)))  # aligned with the valid rows; the skipped row's id is gone


def test_max_samples_counts_valid_rows_and_reasons_are_capped_at_five(tmp_path):
    rows = [{"question": "", "answer": ["x"]}] * 8 + GOOD * 3
    task = load_task(write_jsonl(tmp_path / "qa.jsonl", rows), max_samples=4)
    assert task.num_skipped == 8
    assert task.skipped == [f"row {i}: empty question" for i in range(5)]
    assert task.dataset.to_list() == GOOD_TASK * 2


def test_every_row_malformed_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "", "answer": "x"}, {"question": "q", "answer": []}])
    with pytest.raises(ValueError, match=re.escape("has no valid row (2 malformed, e.g. row 0: empty question; "
                                                   "row 1: empty answer)")):
        load_task(path)


@pytest.mark.parametrize("name, write", [
    ("qa.json", lambda p: p.write_text(json.dumps(GOOD))),
    ("qa.parquet", lambda p: datasets.Dataset.from_list(GOOD).to_parquet(str(p))),
    ("qa.csv", lambda p: p.write_text('question,answer\n"What is the capital of Veltria?",Morvane\n'
                                      'Who built the sky loom?,"Pella Rusk"\nWhen?,1742\nEmpty?,\n')),
])
def test_other_file_formats(tmp_path, name, write):
    path = tmp_path / name
    write(path)
    task = load_task(str(path))
    if name.endswith(".csv"):  # one alias per row; a number stays text; an empty cell is no answer
        assert task.dataset.to_list() == [
            {"question": "What is the capital of Veltria?", "answer": "Morvane", "answer_aliases": ["Morvane"]},
            {"question": "Who built the sky loom?", "answer": "Pella Rusk", "answer_aliases": ["Pella Rusk"]},
            {"question": "When?", "answer": "1742", "answer_aliases": ["1742"]}]
        assert task.skipped == ["row 3: no answer"]
    else:
        assert task.dataset.to_list() == GOOD_TASK


@pytest.mark.parametrize("rows, missing", [
    ([{"question": "q", "answers": ["a"]}], "has no 'answer' column; its columns are ['question', 'answers']"),
    ([{"problem": "q", "answer": ["a"]}], "has no 'question' column; its columns are ['problem', 'answer']"),
    ([{"text": "q"}], "has no 'question' and no 'answer' column; its columns are ['text']"),
])
def test_missing_column_names_it_and_the_columns_found(tmp_path, rows, missing):
    with pytest.raises(ValueError, match=re.escape(missing)):
        load_task(write_jsonl(tmp_path / "qa.jsonl", rows))


def test_missing_file_names_the_path_and_the_task_names(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError) as error:
        load_task(path)
    assert repr(path) in str(error.value) and "fictional_kb, fictional_kb_entities, triviaqa" in str(error.value)


@pytest.mark.parametrize("name, split, message", [
    ("qa.txt", "train", "can only read .jsonl, .json, .parquet, .csv files"),
    ("qa.jsonl", "test", "A local dataset file has a single split, 'train'; got dataset_split='test'"),
])
def test_unreadable_file_requests(tmp_path, name, split, message):
    path = write_jsonl(tmp_path / name, GOOD)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_task(path, split)


def test_max_samples_must_be_positive():
    with pytest.raises(ValueError, match="max_samples must be at least 1"):
        load_task("fictional_kb", max_samples=0)


# ----------------------------------------------------------------------------------------------------------------
# corpus_path

def test_corpus_path_replaces_the_tasks_corpus(tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"title": "Veltria", "text": "Its capital is Morvane."},
                                                    {"text": "An untitled page."}])
    task = load_task("fictional_kb", corpus_path=path)
    assert task.corpus == [{"title": "Veltria", "text": "Its capital is Morvane."},
                           {"title": "", "text": "An untitled page."}]


@pytest.mark.parametrize("lines, error, message", [
    (None, FileNotFoundError, "does not exist"),
    (['{"title": "A", "text": "ok"}', '{"title": "B"}'], ValueError, "line 2: a document needs a non-empty \"text\""),
    (['{"title": "A", "text": ""}'], ValueError, "line 1: a document needs a non-empty \"text\""),
    (['{"title": "A", "text": "ok"}', "", "not json"], ValueError, "line 3: not valid JSON"),
    ([""], ValueError, "holds no documents"),
])
def test_corpus_path_errors(tmp_path, lines, error, message):
    path = tmp_path / "corpus.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    with pytest.raises(error, match=re.escape(message)):
        load_task("fictional_kb", corpus_path=str(path))


# ----------------------------------------------------------------------------------------------------------------
# TriviaQA without the hub

OFFLINE = {  # a call, and what its error says
    "load_task('triviaqa')": ["RuntimeError: TriviaQA (mandarjoshi/trivia_qa) could not be loaded: the dataset hub "
                              "could not be reached", "dataset_name: fictional_kb", ".jsonl"],
    "load_task('mt-grpo-tests/no-such-dataset', dataset_config='main')":
        ["RuntimeError: The hub dataset 'mt-grpo-tests/no-such-dataset' could not be loaded: it is not a task "
         "(fictional_kb, fictional_kb_entities, triviaqa, textworld_quest) nor a local file or folder (cwd: ",
         "), and as a hub name, the dataset hub could not be reached and the dataset is not in the local cache"],
    # a misspelled task, a bare name that is no file: the same error, with the task names first
    "load_task('fictional_kb_entity')": ["RuntimeError: The hub dataset 'fictional_kb_entity' could not be loaded: it "
                                         "is not a task (fictional_kb, fictional_kb_entities, triviaqa"],
}


@pytest.mark.timeout(120)
def test_a_hub_dataset_offline_fails_with_a_clear_error():
    """Offline, a hub dataset fails at once with what to do instead (the subprocess's timeout catches a hang:
    huggingface_hub would retry an unreachable hub). `datasets` reads HF_HUB_OFFLINE / HF_DATASETS_OFFLINE when
    it is imported, not when load_dataset runs, and this process imported it long ago: so a fresh interpreter,
    one for all the calls of OFFLINE (each prints its error after a line of its own)."""
    code = "from mt_grpo.tasks import load_task\n" + "".join(
        f"print('--- {i}')\ntry:\n    {call}\nexcept RuntimeError as e:\n    print('RuntimeError:', e)\n"
        for i, call in enumerate(OFFLINE))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.split("--- ")[1:]
    assert len(printed) == len(OFFLINE), done.stdout
    for out, (call, expected) in zip(printed, OFFLINE.items()):
        assert all(text in out for text in expected), (call, done.stdout + done.stderr[-2000:])


@pytest.mark.parametrize("answer, aliases", [
    ({"value": "Paris", "aliases": ["Paris", "City of Light"]}, ["Paris", "City of Light"]),
    ({"value": "Mars", "aliases": []}, ["Mars"]),
    ({"value": "", "aliases": ["Ganymede"]}, ["Ganymede"]),
])
def test_triviaqa_row_becomes_question_and_aliases(answer, aliases):
    row = {"question": "Q?", "question_id": "tc_1", "answer": {**answer, "normalized_value": "x"}}
    assert to_question_answer(row) == {"question": "Q?", "answer": answer["value"], "answer_aliases": aliases}


# ----------------------------------------------------------------------------------------------------------------
# Any dataset: TRL prompts, hub-style folders, column mapping, rows without answers, a datasets.Dataset

CHAT = [{"role": "system", "content": "You are a careful calculator."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Four. Anything else?"}, {"role": "user", "content": "And 17 * 23?"}]


def test_a_standard_prompt_column_is_kept_and_stands_in_for_the_question(tmp_path):
    rows = [{"prompt": "What is 17 * 23?", "answer": "391", "level": 2}, {"prompt": "  ", "answer": "0", "level": 1}]
    task = load_task(write_jsonl(tmp_path / "math.jsonl", rows))
    assert task.dataset.to_list() == [{"question": "What is 17 * 23?", "answer": "391", "answer_aliases": ["391"],
                                       "prompt": "What is 17 * 23?", "level": 2}]
    assert task.skipped == ["row 1: empty prompt"]
    assert (task.system_prompt, task.examples) == (None, None)  # no search task's wording for a new task


def test_a_conversational_prompt_column_is_kept_and_its_last_user_message_is_the_question(tmp_path):
    rows = [{"prompt": CHAT, "answer": ["391"], "question": ""},
            {"prompt": CHAT[1:2], "question": "2 + 2?", "answer": ["4"]}]
    dataset = load_task(write_jsonl(tmp_path / "chat.jsonl", rows)).dataset
    assert dataset["prompt"] == [CHAT, CHAT[1:2]]
    assert dataset["question"] == ["And 17 * 23?", "2 + 2?"]  # a question column, where there is one, wins


# (id, the malformed prompt, the reason recorded for its row)
BAD_PROMPTS = [
    ("ends_with_assistant", CHAT[:3], "row 1: prompt ends with a assistant message, not a user one"),
    ("no_content", [{"role": "user"}], "row 1: prompt message 0 has no text `content` (a NoneType)"),
    ("unknown_role", [{"role": "tool", "content": "391"}], "row 1: prompt message 0 has the role 'tool'"),
    ("late_system", CHAT[1:2] + CHAT[:2], "row 1: prompt message 1 is a system message; only the first may be"),
    ("no_messages", [], "row 1: prompt has no messages"),
]


@pytest.mark.parametrize("prompt, reason", [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_a_malformed_conversational_prompt_is_skipped_and_counted(tmp_path, prompt, reason):
    good = {"prompt": CHAT, "answer": ["391"]}
    task = validate_dataset(datasets.Dataset.from_list([good, {"prompt": prompt, "answer": ["4"]}, good]))
    assert task.dataset["question"] == ["And 17 * 23?"] * 2
    assert task.num_skipped == 1 and task.skipped[0].startswith(reason), task.skipped


def write_hub_folder(folder) -> str:
    """A dataset folder as the hub serves one: data/<split>-00000-of-00001.parquet."""
    os.makedirs(folder / "data")
    for split, rows in (("train", GOOD), ("test", [{"question": "Who rang the Tessbell?", "answer": ["Orla Venn"]}])):
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return str(folder)


def test_a_hub_style_folder_is_read_by_split(tmp_path):
    folder = write_hub_folder(tmp_path / "qa")
    assert load_task(folder).dataset.to_list() == GOOD_TASK
    assert load_task(folder, "test").dataset.to_list() == [
        {"question": "Who rang the Tessbell?", "answer": ["Orla Venn"], "answer_aliases": ["Orla Venn"]}]
    with pytest.raises(ValueError, match=r"Unknown split \"validation\".*Set dataset_config and dataset_split"):
        load_task(folder, "validation")


def test_a_folder_written_by_save_to_disk_is_read(tmp_path):
    test_rows = [{"question": "Who rang the Tessbell?", "answer": ["Orla Venn"]}]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(GOOD),
                                   "test": datasets.Dataset.from_list(test_rows)})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_task(str(tmp_path / "dict"), "test").dataset.to_list() == [{**test_rows[0],
                                                                             "answer_aliases": ["Orla Venn"]}]
    with pytest.raises(ValueError, match=re.escape("has the splits ['train', 'test'], not 'dev': set dataset_split")):
        load_task(str(tmp_path / "dict"), "dev")
    datasets.Dataset.from_list(GOOD).save_to_disk(str(tmp_path / "one"))
    assert load_task(str(tmp_path / "one")).dataset.to_list() == GOOD_TASK
    with pytest.raises(ValueError, match=re.escape("holds one Dataset (save_to_disk), read as the split 'train'")):
        load_task(str(tmp_path / "one"), "test")


def test_columns_map_the_datasets_own_names(tmp_path):
    rows = [{"problem": "What is 17 * 23?", "solution": "391", "messages": CHAT, "id": 7}]
    task = load_task(write_jsonl(tmp_path / "math.jsonl", rows),
                     columns={"question": "problem", "answer": "solution", "prompt": "messages"})
    assert task.dataset.to_list() == [{"question": "What is 17 * 23?", "answer": "391", "prompt": CHAT,
                                       "answer_aliases": ["391"], "id": 7}]


@pytest.mark.parametrize("columns, message", [
    ({"question": "problme"}, "has no column 'problme' (the question: `question_column`); its columns are "
                              "['problem', 'solution']. Set `question_column` to one of them."),
    ({"question": "problem", "answer": "answer"}, "has no 'answer' column; its columns are ['problem', 'solution']"),
    ({"questions": "problem"}, "columns maps ['questions'], which the trainer does not read"),
])
def test_a_column_the_dataset_lacks_is_named_with_the_columns_it_has(columns, message):
    data = datasets.Dataset.from_list([{"problem": "What is 17 * 23?", "solution": "391"}])
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_dataset(data, columns=columns, source="math.jsonl")


def test_rows_without_an_answer_are_kept_only_when_no_reward_needs_one(tmp_path):
    rows = [GOOD[0], {"question": "Where?"}, {"question": "When?", "answer": None}, {"question": "Who?", "answer": []},
            {"question": "How many?", "answer": 3}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    loose = load_task(path, answer_required=False)
    assert loose.dataset.to_list() == [GOOD_TASK[0], {"question": "Where?", "answer": None, "answer_aliases": []},
                                       {"question": "When?", "answer": None, "answer_aliases": []},
                                       {"question": "Who?", "answer": [], "answer_aliases": []}]
    assert loose.skipped == ['row 4: answer is a int, not a string or a list of strings (write 3 as "3")']  # malformed, not missing
    strict = load_task(path)
    assert strict.dataset.to_list() == [GOOD_TASK[0]] and strict.num_skipped == 4


def test_a_dataset_without_an_answer_column_has_none_unless_one_is_required(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Write a haiku about tools."}])
    assert load_task(path, answer_required=False).dataset.to_list() == [
        {"question": "Write a haiku about tools.", "prompt": "Write a haiku about tools."}]
    with pytest.raises(ValueError, match=re.escape("has no 'answer' column; its columns are ['prompt']")):
        load_task(path)
    with pytest.raises(ValueError, match=re.escape("(exact_match_reward_func read it: give the column, or take "
                                                   "them out of the recipe's reward functions)")):
        load_task(path, answer_required=["exact_match_reward_func"])  # the trainer names the rewards that read it


def test_validate_dataset_checks_a_dataset_built_in_python():
    data = datasets.Dataset.from_list([{"problem": " What is 17 * 23? ", "solution": "391", "id": 1},
                                       {"problem": "", "solution": "0", "id": 2}])
    task = validate_dataset(data, columns={"question": "problem", "answer": "solution"}, source="train_dataset")
    assert task.dataset.to_list() == [{"question": "What is 17 * 23?", "answer": "391", "answer_aliases": ["391"],
                                       "id": 1}]
    assert task.dataset.features["id"] == data.features["id"] and task.skipped == ["row 1: empty question"]
    with pytest.raises(ValueError, match=re.escape("train_dataset is a DatasetDict (a DatasetDict: pick a split")):
        validate_dataset(datasets.DatasetDict({"train": data}))


def test_the_search_tasks_bring_their_prompt_and_examples_and_config_is_for_hub_datasets():
    task = load_task("fictional_kb", max_samples=1)
    assert (task.system_prompt, task.examples) == (SEARCH_TASK_PROMPT, search_examples)
    with pytest.raises(ValueError, match=re.escape("dataset_config='main' applies to hub datasets and dataset fold")):
        load_task("fictional_kb", dataset_config="main")


def test_a_path_that_does_not_exist_is_not_looked_up_on_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="is neither a task .* nor an existing file or folder"):
        load_task("data/math/train")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "17 * 23".
    """
    return str(eval(expression, {"__builtins__": {}}))


def test_build_dataset_renders_the_rows_prompt_else_its_question(qwen_style_tokenizer, tmp_path):
    rows = [{"prompt": CHAT, "answer": "391"}, {"prompt": "What is 2 + 2?", "answer": "4"}]
    env = make_env(qwen_style_tokenizer, [calculator])
    for row in rows:
        task = load_task(write_jsonl(tmp_path / "math.jsonl", [row]))
        (prompt,) = build_dataset(type("Args", (), {"max_prompt_length": 4096}), env, task)["prompt"]
        # a column holds every message with every key (None where it has none: a prompt's user message has no
        # `outside_text`, the marks of its system and assistant text, protocol.mark_outside)
        assert [{k: v for k, v in m.items() if v is not None} for m in prompt] == env.prompt(row["prompt"])
    (prompt,) = build_dataset(type("Args", (), {"max_prompt_length": 4096}), env,
                              load_task(write_jsonl(tmp_path / "qa.jsonl", GOOD[:1])))["prompt"]
    assert prompt[-1] == {"role": "user", "content": GOOD[0]["question"]}
    assert prompt[0]["role"] == "system" and "You are a careful calculator." in env.prompt(CHAT)[0]["content"]


def test_the_eval_task_of_a_hub_style_folder_uses_the_recipes_columns(tmp_path):
    from mt_grpo_trainer import MTGRPOScriptArguments

    os.makedirs(tmp_path / "math" / "data")
    for split, rows in (("train", [{"problem": "1 + 1?", "solution": "2"}]),
                        ("test", [{"problem": "2 + 3?", "solution": "5"}, {"problem": "7 - 7?", "solution": ""}])):
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "math" / "data" / f"{split}-00000-of-00001.parquet"))
    recipe = MTGRPOScriptArguments(dataset_name=str(tmp_path / "math"), question_column="problem",
                                   answer_column="solution", eval_dataset_split="test")
    assert load_eval_task(recipe).dataset.to_list() == [{"question": "2 + 3?", "answer": "5", "answer_aliases": ["5"]}]
    assert load_eval_task(recipe, answer_required=False).dataset["answer_aliases"] == [["5"], []]


# ----------------------------------------------------------------------------------------------------------------
# What the rewards receive: `answer` as TRL passes it, the aliases as `answer_aliases`

def trl_style_reward(completions, answer, **kwargs):
    """A reward written for TRL: `answer` is the dataset's string."""
    return [float(a.lower() in c[-1]["content"].lower()) for c, a in zip(completions, answer)]


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": f"<reasoning>Found it.</reasoning>\n<answer>{text}</answer>"}]


def test_a_trl_reward_reads_the_answer_string_and_exact_match_reads_every_alias():
    """Through the trainer's scoring (rewards.reward_columns -> compute_rewards_per_func), on a dataset of string
    answers and on the knowledge base, whose second alias of "Tifex River" is "Tifex"."""
    from mt_grpo.run.checks import check_reward_columns
    from mt_grpo_trainer import compute_rewards_per_func
    from mt_grpo.rewards import reward_columns
    from mt_grpo.rewards.triviaqa_reward import exact_match_reward_func

    funcs = [trl_style_reward, exact_match_reward_func]
    strings = validate_dataset(datasets.Dataset.from_list([{"question": "Capital of Veltria?", "answer": "Morvane"},
                                                           {"question": "2 + 2?", "answer": " 4"}]))
    check_reward_columns(funcs, strings.dataset.column_names)  # a TRL reward's `answer` is a column
    rows = strings.dataset.to_list()
    columns = reward_columns(rows)
    assert columns["answer"] == ["Morvane", " 4"] and columns["answer_aliases"] == [["Morvane"], ["4"]]
    scores = compute_rewards_per_func(funcs, [None] * 2, [said("It is morvane."), said("4")], columns)
    assert scores.tolist() == [[1.0, 0.0], [0.0, 1.0]]  # " 4" is not in "4" as TRL's reward reads it; exact match is
    kb = load_task("fictional_kb", max_samples=3, seed=0).dataset.to_list()[2:]  # the main river of Ratomora
    scores = compute_rewards_per_func(funcs, [None] * 2, [said("Tifex"), said("the Tifex River")],
                                      reward_columns(kb * 2))
    assert scores.tolist() == [[0.0, 1.0], [1.0, 1.0]]
