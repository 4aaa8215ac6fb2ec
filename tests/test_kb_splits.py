"""fictional_kb_entities: the knowledge base split by entity. No validation or test entity is named by a
training question (read from the question texts, one-hop and two-hop), the splits are disjoint, cover every
question and are fixed by the seed, the test split is large enough, the answers the held-out splits share with
training are measured, a recipe loads it and evaluates on validation unless told test, and the old
fictional_kb keeps its rows."""

import hashlib
import json
import re

import pytest

from mt_grpo.run.builders import load_recipe_task
from mt_grpo.tasks import load_task
from mt_grpo.tasks.fictional_kb import (ENTITY_KINDS, SEARCH_TASK_PROMPT, answer_overlap, build_fictional_kb,
                                        build_fictional_kb_entities, entity_splits, fictional_kb_split, search_examples)

SPLITS = ("train", "validation", "test")


def named_entities(questions: list[str], documents: list[dict]) -> set[str]:
    """The titles of the documents (entities and linked people) that the questions name, as whole words."""
    titles = sorted((d["title"] for d in documents), key=len, reverse=True)  # "Ab Cd" before "Ab"
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, titles)) + r")\b")
    return {title for question in questions for title in pattern.findall(question)}


@pytest.fixture(scope="module", params=[0.0, 0.3], ids=["one-hop", "multi-hop-0.3"])
def split_kb(request):
    """(multi_hop, documents, {split: questions}) of seed 0."""
    built = {split: build_fictional_kb_entities(seed=0, split=split, multi_hop=request.param) for split in SPLITS}
    return request.param, built["train"][0], {split: qa for split, (_, qa) in built.items()}


def test_no_held_out_entity_is_named_by_a_training_question(split_kb):
    _, documents, qa = split_kb
    two_hop = {r["question"] for r in build_fictional_kb(seed=0, multi_hop=1.0)[1]}
    text_of = {d["title"]: d["text"] for d in documents}
    about = {}  # split -> the entities its questions are about
    for split, rows in qa.items():
        about[split] = named_entities([r["question"] for r in rows], documents)
        # a two-hop question is also about the person its entity's document names (the founder, the inventor)
        for row in rows:
            if row["question"] in two_hop:
                (entity,) = named_entities([row["question"]], documents)
                about[split] |= named_entities([text_of[entity]], documents) - {entity}
    assert all(about.values())
    assert about["train"].isdisjoint(about["validation"] | about["test"])
    assert about["validation"].isdisjoint(about["test"])
    for rows in qa.values():  # every question names an entity, so the check above sees every question
        assert all(named_entities([r["question"]], documents) for r in rows)
    # nor is a held-out entity's name an answer to learn in training (a founder's name goes with the city)
    train_answers = {a for r in qa["train"] for a in r["answer"]}
    assert train_answers.isdisjoint(about["validation"] | about["test"])


def test_entity_splits_are_disjoint_cover_every_question_and_share_the_corpus(split_kb):
    multi_hop, documents, qa = split_kb
    every_document, every_row = build_fictional_kb(seed=0, multi_hop=multi_hop)
    questions = {split: [r["question"] for r in rows] for split, rows in qa.items()}
    assert sum(map(len, questions.values())) == len(set().union(*questions.values())) == len(every_row)
    assert set().union(*questions.values()) == {r["question"] for r in every_row}
    assert all(row in every_row for rows in qa.values() for row in rows)  # with their answers
    assert all(build_fictional_kb_entities(seed=0, split=s, multi_hop=multi_hop)[0] == every_document for s in SPLITS)
    assert documents == every_document


def test_entity_splits_are_fixed_by_the_seed():
    assert build_fictional_kb_entities(seed=0, split="test") == build_fictional_kb_entities(seed=0, split="test")
    assert entity_splits(200, seed=0) == entity_splits(200, seed=0) != entity_splits(200, seed=1)
    assert build_fictional_kb_entities(seed=1, split="test")[1] != build_fictional_kb_entities(seed=0, split="test")[1]


def test_entity_split_sizes_are_fixed_fractions_of_each_kind():
    splits = entity_splits(200, seed=0)
    for kind in range(len(ENTITY_KINDS)):
        of_kind = splits[kind::len(ENTITY_KINDS)]
        assert (of_kind.count("train"), of_kind.count("validation"), of_kind.count("test")) == (40, 5, 5)
    sizes = [len(build_fictional_kb_entities(seed=seed, split=s)[1]) for seed in (0, 1) for s in SPLITS]
    assert sizes == [760, 95, 95] * 2  # 5 entities of each kind: 5 * (6 + 5 + 4 + 4) questions
    with pytest.raises(ValueError, match=re.escape("num_entities=7 is too few")):
        build_fictional_kb_entities(num_entities=7)


def test_answer_overlap_is_the_share_of_held_out_rows_with_a_training_answer():
    train = [{"question": "q", "answer": ["The Tifex River", "Tifex"]}, {"question": "q", "answer": ["copper"]}]
    held_out = [{"question": "q", "answer": ["tifex"]}, {"question": "q", "answer": ["1583"]},
                {"question": "q", "answer": ["Copper."]}, {"question": "q", "answer": ["Zorn River", "Zorn"]}]
    assert answer_overlap(train, held_out) == 0.5
    assert answer_overlap(train, []) == 0.0
    # seed 0, one-hop: the values the module docstring states (list-based answers, and some years and populations)
    qa = {split: build_fictional_kb_entities(seed=0, split=split)[1] for split in SPLITS}
    assert answer_overlap(qa["train"], qa["validation"]) == 30 / 95
    assert answer_overlap(qa["train"], qa["test"]) == 33 / 95
    exports = [r for r in qa["test"] if "export" in r["question"]]
    assert exports and answer_overlap(qa["train"], exports) == 1.0


def as_task_rows(qa: list[dict]) -> list[dict]:
    """The builder's rows as the task holds them: the answer as the documents write it (the first spelling), and
    every spelling as `answer_aliases`."""
    return [{"question": r["question"], "answer": r["answer"][0], "answer_aliases": r["answer"]} for r in qa]


def recipe(**fields):
    from mt_grpo_trainer import MTGRPOScriptArguments

    return MTGRPOScriptArguments(dataset_name="fictional_kb_entities", **fields)


@pytest.mark.parametrize("multi_hop", [0.0, 0.3])
def test_a_recipe_trains_on_train_and_evaluates_on_validation_unless_told_test(multi_hop):
    expected = {s: build_fictional_kb_entities(seed=0, split=s, multi_hop=multi_hop) for s in SPLITS}
    train = load_recipe_task(recipe(kb_multi_hop=multi_hop))
    assert train.dataset.to_list() == as_task_rows(expected["train"][1]) and train.corpus == expected["train"][0]
    assert (train.system_prompt, train.examples) == (SEARCH_TASK_PROMPT, search_examples)
    held_out = load_recipe_task(recipe(kb_multi_hop=multi_hop), held_out=True)
    assert held_out.dataset.to_list() == as_task_rows(expected["validation"][1])
    test = load_recipe_task(recipe(kb_multi_hop=multi_hop, eval_dataset_split="test"), held_out=True)
    assert test.dataset.to_list() == as_task_rows(expected["test"][1])


@pytest.mark.parametrize("load", [lambda: load_task("fictional_kb_entities", "dev"),
                                  lambda: load_recipe_task(recipe(dataset_split="dev")),
                                  lambda: load_recipe_task(recipe(eval_dataset_split="dev"), held_out=True)])
def test_an_unknown_split_is_refused_with_the_field_and_the_valid_splits(load):
    with pytest.raises(ValueError, match=re.escape("fictional_kb_entities has the splits train, validation, test, "
                                                   "not 'dev'; set `dataset_split`")):
        load()


# Seeds 0 and 1 of fictional_kb, one-hop and multi_hop 0.3: documents, questions, and the train and test splits,
# recorded before fictional_kb_entities was added, so that committed results can be redrawn.
OLD_FICTIONAL_KB_SHA256 = {
    (0.0, 0): "9ea3f0cb343c4cabe45509f2ebcd9a8ae268682782267493383cad2a12f5aa62",
    (0.0, 1): "825b27be00b2a63c2720b85d0ed267733744909edadcedb14d8e9d5401c270bc",
    (0.3, 0): "0dfdccca08a8f13f63b92344cbf887db4898a06b0345501b8ea9c5d5813491ea",
    (0.3, 1): "5b0097a343f9de109eda9041aa3f8fd821ea0f696fd017aa23d41e91bbb6e82f",
}


@pytest.mark.parametrize("multi_hop, seed", list(OLD_FICTIONAL_KB_SHA256))
def test_fictional_kb_rows_are_unchanged(multi_hop, seed):
    documents, qa = build_fictional_kb(seed=seed, multi_hop=multi_hop)
    blob = json.dumps([documents, qa, fictional_kb_split(qa, "train", seed), fictional_kb_split(qa, "test", seed)])
    assert hashlib.sha256(blob.encode()).hexdigest() == OLD_FICTIONAL_KB_SHA256[multi_hop, seed]
    held_out = load_task("fictional_kb", "test", seed=seed, multi_hop=multi_hop).dataset.to_list()
    assert held_out == as_task_rows(fictional_kb_split(qa, "test", seed))
