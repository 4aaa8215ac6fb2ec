"""How an episode's turns become training samples (`turn_samples`), where a chat template rewrites the history.

The trainer trains on exactly the ids the model sampled, with the environment's replies between them. While each
turn's prompt, as the chat template renders it, extends the last one, that interleaved sequence is what the model
sees at inference. Some templates rewrite the history instead: Qwen3's drops the empty think block of non-thinking
mode from earlier turns (and the thoughts of turns before the last user message); any template's re-render
retokenizes the model's text the canonical way. Then later turns were sampled, and are trained, in a context the
deployed model never meets.

    interleaved  one sample per episode: the sampled ids and the replies (the behaviour before `turn_samples`)
    per_model_turn  every model turn is its own sample: after each tool turn the next turn is sampled from the
                 template's render of the history, as inference renders it
    auto         prime-rl's "best-effort interleaving": one sample while the render of the history extends the
                 sample token for token, a new one where it does not (the default: interleaved where exact)

A sample is sampled from its own prompt and trained on it, so generation and training agree by construction, and
`decode(prompt)` is the template's render of that history (tests/test_turn_samples.py, on Qwen3's and Qwen2.5's
real templates and ours).

Layout. An episode stays one row of the batch. A new sample starts inside the row's completion: its prompt (the
render) is appended where the environment's reply would go, as environment tokens (mask 0), and `sample_starts`
records where. So the row's loss tokens are the episode's model tokens, once each, and every loss type weighs an
episode exactly as it weighs an interleaved one, however many samples it was split into: the per-row means
(grpo, sapo), sums (luspo), the fixed normaliser (dr_grpo) and the token counts (dapo, bnpo, cispo, vespo) see the
same tokens in the same rows; only their contexts differ. The advantages are per token as always (turn k's
tokens carry turn k's advantage, whichever sample holds them). The forward must keep the samples of a row apart:
packing.py lays each sample out as its own path of the prefix trie (a sample's prompt shares its prefix with the
earlier samples' in the trie, so the repeated history is forwarded once where it is unchanged); a row holding
several samples is always forwarded packed, also with `padding_free: false`.
"""

import logging
from dataclasses import dataclass
from typing import Callable

TURN_SAMPLES = ("interleaved", "per_model_turn", "auto")
RENAMED_TURN_SAMPLES = {"per_turn": "per_model_turn"}  # an old value -> its name now (`per_turn` is an advantage mode)


_SPLIT_LOGGED: list = []  # the first split of an `auto` run was logged


def check_turn_samples(mode: str) -> None:
    """`mode` is one of TURN_SAMPLES; else an error that names the choices (and a renamed value's new name)."""
    if mode in TURN_SAMPLES:
        return
    if mode in RENAMED_TURN_SAMPLES:
        raise ValueError(f"`turn_samples: {mode}` is now `turn_samples: {RENAMED_TURN_SAMPLES[mode]}`: rename it.")
    raise ValueError(f"`turn_samples` is {mode!r}; choose one of {list(TURN_SAMPLES)}.")


def next_sample_prompt(mode: str, context_ids: list[int], reply_ids: list[int],
                       render: Callable[[], list[int]]) -> list[int] | None:
    """After a tool turn: None when the environment's reply continues the current sample, else the prompt of
    the next sample (the render of the history with the generation prompt). `context_ids`: the current sample's
    ids; `reply_ids`: the reply as the interleaved sequence would append it; `render`: the history's render."""
    if mode == "interleaved":
        return None
    if mode == "per_model_turn":
        return render()
    if mode == "auto":
        fresh = render()
        if fresh == context_ids + reply_ids:
            return None
        if not _SPLIT_LOGGED:  # once a run: where TRL keeps one sequence an episode, this run trains several
            _SPLIT_LOGGED.append(True)
            logging.getLogger("mt_grpo").info(
                "turn_samples: auto: the chat template renders the history otherwise than the tokens sampled so far "
                "(Qwen3's drops earlier turns' <think> blocks, with enable_thinking false too), so the turn after a "
                "reply starts a sample of its own, prompted as the template renders it (TRL keeps one sequence an "
                "episode, which the template would never show the model). turn_samples: interleaved keeps one "
                "(docs/guide.md, 'Per-turn samples').")
        return fresh
    check_turn_samples(mode)  # raises: every value of TURN_SAMPLES is handled above
    raise AssertionError(f"turn_samples {mode!r} is in TURN_SAMPLES but not handled here")


def sample_bounds(starts: list[int], length: int) -> list[tuple[int, int]]:
    """[start, end) completion columns of each sample of a row of `length` completion tokens: the first holds the
    episode's prompt before it (column 0 on), each later one begins at its own prompt (`starts`)."""
    cuts = [0, *[s for s in starts if 0 < s < length], length]
    return list(zip(cuts[:-1], cuts[1:]))


def scored_parts(starts: list[int], length: int) -> list[tuple[int, int, int]]:
    """(start, first scored, end) completion columns of each sample, for a forward that scores each sample in its
    own context: the first sample is led by the episode's prompt and scored from column 0; a later one is led by
    its own first token (its prompt's, an environment token), which nothing before it in its sample predicts."""
    return [(a, a + (a > 0), b) for a, b in sample_bounds(starts, length)]


@dataclass
class TurnSample:
    """One training sample of an episode, as the model saw it: `prompt_ids` (the episode's prompt, or a render of
    the history) and what followed until the next sample (model turns, mask 1, and replies, mask 0)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    model_mask: list[int]
    history: int  # how many of the episode's messages its prompt renders (0: the episode's prompt)


def episode_samples(ep) -> list[TurnSample]:
    """The samples `ep` (an Episode) was split into, in order; one when it was not."""
    out = []
    histories = [0, *[h for _, h in ep.sample_starts]]
    for (a, b), history in zip(sample_bounds([s for s, _ in ep.sample_starts], len(ep.completion_ids)), histories):
        if a == 0:
            out.append(TurnSample(list(ep.prompt_ids), ep.completion_ids[a:b], ep.model_mask[a:b], history))
        else:  # the render: the sample's first environment span
            n = next(s.end for s in ep.spans if s.start == a) - a
            out.append(TurnSample(ep.completion_ids[a : a + n], ep.completion_ids[a + n : b],
                                  ep.model_mask[a + n : b], history))
    return out

