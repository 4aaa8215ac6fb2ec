"""TriviaQA (Joshi et al., 2017), the paper's task: trivia questions with the accepted answer aliases,
from the Hugging Face hub (`mandarjoshi/trivia_qa`, config `rc.nocontext`: questions without their
evidence documents). Needs the hub, or the dataset in the local `datasets` cache; the agent answers
with `wiki_search`, or with `search` over a local corpus (`corpus_path`). A search task: its prompt and
worked examples are the knowledge base's (tasks/fictional_kb.py: SEARCH_TASK_PROMPT, search_examples).
"""

import datasets

from mt_grpo.tasks import load_hub_dataset

HUB_NAME, HUB_CONFIG = "mandarjoshi/trivia_qa", "rc.nocontext"


def load_triviaqa(split: str = "train", max_samples: int | None = None) -> datasets.Dataset:
    """TriviaQA rows as `question: str`, `answer: str` (the canonical answer) and `answer_aliases: list[str]` (the
    canonical answer first, then its aliases, without duplicates). Raises RuntimeError, at once under
    HF_HUB_OFFLINE=1, when the hub cannot be reached and the dataset is not cached."""
    raw = load_hub_dataset(HUB_NAME, HUB_CONFIG, split, label=f"TriviaQA ({HUB_NAME})")
    if max_samples is not None:
        raw = raw.select(range(min(max_samples, len(raw))))
    return raw.map(to_question_answer, remove_columns=raw.column_names)


def to_question_answer(row: dict) -> dict:
    """A TriviaQA row -> {"question", "answer": value, "answer_aliases": [value, *aliases]}, the aliases without
    duplicates or empty strings."""
    answer = row["answer"]
    aliases = [answer["value"], *answer["aliases"]]
    return {"question": row["question"], "answer": answer["value"],
            "answer_aliases": list(dict.fromkeys(a for a in aliases if a))}
