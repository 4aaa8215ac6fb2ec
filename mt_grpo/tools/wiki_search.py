"""`wiki_search`: search English Wikipedia and return the summary of the top page(s), with the
`wikipedia` package. Needs the network; offline, use the `search` tool over a local corpus.

The `wikipedia` package calls `requests.get` with no timeout, so on a network that drops packets a
call could wait forever (the trainer's `tool_timeout` gives up on it, but its thread stays blocked).
We give that call a timeout of REQUEST_TIMEOUT_S per connect and per read. Name resolution (DNS) is
outside what `requests` can bound; on a machine with no resolver it fails at once.
"""

import importlib

REQUEST_TIMEOUT_S = 10.0  # seconds per connect and per read of each HTTP request
SUMMARY_SENTENCES = 5  # per page, so that several pages fit in the trainer's tool response budget
MAX_RESULTS = 5


def wiki_search(query: str, num_results: int = 1) -> str:
    """Search Wikipedia and return the summary of the top page(s).

    Args:
        query: what to look up, e.g. "capital of France".
        num_results: how many pages to summarise, from 1 to 5.
    """
    import requests
    import wikipedia

    if not isinstance(query, str) or not query.strip():
        raise ValueError("wiki_search: the query is empty; pass the words to look up, e.g. "
                         '{"query": "capital of France"}.')
    try:
        n = max(1, min(MAX_RESULTS, int(num_results)))
    except (TypeError, ValueError):
        raise ValueError(f"wiki_search: num_results must be a whole number from 1 to {MAX_RESULTS}, "
                         f"got {num_results!r}.") from None
    _bound_request_time()
    try:
        titles = wikipedia.search(query, results=n)
        if not titles:
            raise ValueError(f"wiki_search: no Wikipedia page matches {query!r}; try other words.")
        summaries, problems = [], []
        for title in titles:
            try:
                # auto_suggest=False: the title comes from the search, and "suggesting" a different one
                # would summarise the wrong page.
                summary = wikipedia.summary(title, sentences=SUMMARY_SENTENCES, auto_suggest=False)
                summaries.append(f"{title}: {summary}")
            except wikipedia.DisambiguationError as e:
                problems.append(f"{title!r} is ambiguous; it may refer to: {', '.join(e.options[:5])}.")
            except wikipedia.PageError:
                problems.append(f"no Wikipedia page is titled {title!r}.")
    except (requests.exceptions.RequestException, wikipedia.exceptions.HTTPTimeoutError) as e:
        raise RuntimeError(f"wiki_search: Wikipedia could not be reached ({type(e).__name__}); this machine seems "
                           "offline. Use the offline `search` tool with a local corpus instead (tools: [search] "
                           "and `corpus_path`, or the fictional_kb task).") from e
    if not summaries:
        raise ValueError(f"wiki_search: {' '.join(problems)} Search for a more specific title.")
    return "\n\n".join(summaries)


class _RequestsWithTimeout:
    """Stands in for `requests` inside `wikipedia.wikipedia`, whose one HTTP call is
    `requests.get(url, params=..., headers=...)`: the same call, with a timeout."""

    @staticmethod
    def get(url, **kwargs):
        import requests

        kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
        return requests.get(url, **kwargs)


def _bound_request_time() -> None:
    # Installed on first use rather than at import, so that `import tools` touches nothing.
    module = importlib.import_module("wikipedia.wikipedia")
    if not isinstance(module.requests, _RequestsWithTimeout):
        module.requests = _RequestsWithTimeout()
