"""`search`: offline BM25 search over a local corpus of `{"title", "text"}` documents (the `bm25s` library).

Each document is indexed as its title followed by its text, lower-cased, with English stopwords
removed and no stemming. The tool returns the best documents as `Title: text`, separated by blank
lines; documents that share no word with the query are never returned, so a query with no match
says so instead of listing arbitrary documents.

    search = make_search_tool([{"title": "Veltria", "text": "Veltria is a country. Its capital is Morvane."}])
    search(query="capital of Veltria")   # -> "Veltria: Veltria is a country. Its capital is Morvane."
"""

import sys
from typing import Callable

from mt_grpo.tools import corpus_tool

MAX_RESULTS = 10


class BM25Search:
    """A BM25 index over `corpus`, built once; `search` is read-only, so threads may share it."""

    def __init__(self, corpus: list[dict]):
        import logging

        bm25s = import_bm25s()  # here, not at the top, so that importing this module stays cheap
        # bm25s sets its own logger to DEBUG at import, so every index build printed a DEBUG line
        logging.getLogger("bm25s").setLevel(logging.WARNING)

        self.documents = _check_corpus(corpus)
        texts = [f"{d['title']}\n{d['text']}" for d in self.documents]
        self.tokenize = bm25s.tokenize  # the function, not the module: the index stays copyable and picklable
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, num_results: int = 3) -> str:
        if not isinstance(query, str):
            raise ValueError(f"search: the query must be a string, got {type(query).__name__}; "
                             'call it as {"query": "capital of Veltria"}.')
        if not query.strip():
            raise ValueError("search: the query is empty; pass the words to look up, e.g. "
                             '{"query": "capital of Veltria"}.')
        k = min(_clamp_num_results(num_results), len(self.documents))
        # Tokens as strings, not ids: the retriever maps them through the corpus vocabulary and drops
        # words the corpus never uses (ids from a fresh tokenizer would not match the index's).
        query_tokens = self.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        hits = self.retriever.retrieve(query_tokens, k=k, show_progress=False, backend_selection="numpy")
        ranked = [self.documents[int(i)] for i, score in zip(hits.documents[0], hits.scores[0]) if score > 0]
        if not ranked:
            return f"No documents match the query {query!r}. Try other words, such as a name from the question."
        return "\n\n".join(f"{d['title']}: {d['text']}" if d["title"] else d["text"] for d in ranked)


_ABSENT = object()


def import_bm25s():
    """bm25s, kept away from JAX. Where JAX is installed, `import bm25s` imports it and runs a top-k to start its
    backend; on a GPU, JAX then reserves 75% of the card (its XLA_PYTHON_CLIENT_PREALLOCATE default) inside the
    trainer's process: 105 of an H200's 140 GiB, so two learning-study runs could not share one (docs/results.md,
    "GPU memory"). The `tools` package now turns that preallocation off unless the user turned it on, but JAX
    would still be imported, start a CUDA context and run every search's top-k on the GPU. With `jax` (or
    `jax.lax`, where the user imported jax already) hidden during the import, bm25s takes its numpy top-k, and
    `search` asks for that backend in any case; the user's own JAX is untouched."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hidden = "jax.lax" if "jax" in sys.modules else "jax"
    saved = sys.modules.get(hidden, _ABSENT)
    sys.modules[hidden] = None  # `import jax.lax` now raises ImportError, which bm25s catches
    try:
        import bm25s
    finally:
        if saved is _ABSENT:
            del sys.modules[hidden]
        else:
            sys.modules[hidden] = saved
    return bm25s


@corpus_tool
def make_search_tool(corpus: list[dict]) -> Callable[..., str]:
    """The `search` tool over `corpus`: a function named `search` whose signature and docstring the
    trainer renders into the system prompt. A corpus tool: `build_tools` passes the task's corpus."""
    return _search_tool(corpus, default_results=3)


@corpus_tool
def make_search_top1_tool(corpus: list[dict]) -> Callable[..., str]:
    """The same `search`, returning one document unless the call asks for more (`tools:
    [mt_grpo.tools.search:make_search_top1_tool]`). A 135M model copies facts out of the document after the right
    one (docs/results.md, the ablation): a lone document leaves it only the right facts to pick from."""
    return _search_tool(corpus, default_results=1)


def _search_tool(corpus: list[dict], default_results: int) -> Callable[..., str]:
    index = BM25Search(corpus)

    def search(query: str, num_results: int = default_results) -> str:
        """Search the knowledge base and return the best-matching documents.

        Args:
            query: words to look up, e.g. "capital of Veltria".
            num_results: how many documents to return, from 1 to 10.
        """
        return index.search(query, num_results)

    return search


def _clamp_num_results(num_results) -> int:
    """The model writes the arguments as JSON, so accept 3, 3.0 and "3"; clamp to [1, MAX_RESULTS]."""
    try:
        if isinstance(num_results, bool):
            raise ValueError
        n = int(float(num_results))
    except (TypeError, ValueError):
        raise ValueError(f"search: num_results must be a whole number from 1 to {MAX_RESULTS}, "
                         f"got {num_results!r}.") from None
    return max(1, min(MAX_RESULTS, n))


def _check_corpus(corpus: list[dict]) -> list[dict]:
    """Documents as `{"title": str, "text": str}` (a missing title becomes ""); errors name the document."""
    if not corpus:
        raise ValueError("search: the corpus is empty; pass a list of {'title': ..., 'text': ...} documents "
                         "(set `corpus_path` in the recipe, or use the fictional_kb task).")
    documents = []
    for i, d in enumerate(corpus):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str) or not d["text"].strip():
            raise ValueError(f"search: corpus document {i} has no text; each document must be a dict "
                             f"{{'title': str, 'text': str}} with non-empty text, got {d!r:.200}.")
        title = d.get("title") or ""
        if not isinstance(title, str):
            raise ValueError(f"search: corpus document {i} has a title of type {type(title).__name__}; "
                             "it must be a string.")
        documents.append({"title": title.strip(), "text": d["text"].strip()})
    return documents
