"""Tools used by tests through dotted paths (`tool_examples:make_count_tool`)."""

from typing import Callable

from mt_grpo.tools import corpus_tool

NOT_A_FUNCTION = ["search"]


@corpus_tool
def make_count_tool(corpus: list[dict]) -> Callable[..., str]:
    """A corpus tool: `count_documents` over `corpus`."""
    texts = [d["text"].lower() for d in corpus]

    def count_documents(word: str) -> str:
        """Count the documents whose text mentions a word.

        Args:
            word: the word to look for, e.g. "Kalosh".
        """
        return str(sum(word.lower() in text for text in texts))

    return count_documents


def search(query: str) -> str:
    """A second function named `search`: listed with the registry's `search`, the model could not tell them apart.

    Args:
        query: anything.
    """
    return query
