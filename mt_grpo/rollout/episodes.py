"""The episode records: an `Episode` (one conversation, its tokens, masks, sampler logprobs and turn spans), built
by MultiTurnToolEnv through `Episode.append`; `pad_episodes`, the one place that turns episodes into the trainer's
padded tensors; and the tokenization check, which compares an episode's ids with a fresh render."""

import logging
import re
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from trl.trainer.utils import pad

from mt_grpo.base.protocol import control_strings, outside_emptied, outside_pieces
from mt_grpo.base.turn_samples import episode_samples
from mt_grpo.engine.vision import row_images
from mt_grpo.rewards.conversation import env_replies
from mt_grpo.rollout.toolset import Toolset

logger = logging.getLogger("mt_grpo")


@dataclass
class Span:
    role: str  # "model" | "env" (the environment's reply: tool results or a user turn) | "insert" (continuation text)
    start: int  # offsets into the completion, [start, end)
    end: int


@dataclass
class CallRecord:
    turn: int  # index of the model turn that made the call
    name: str
    args: dict
    ok: bool
    seconds: float
    output: str | list  # the tool message's content: a list where the tool returned one (tool_calls.tool_output)


@dataclass
class Episode:
    """One conversation. `completion_ids`, `model_mask` (1 = sampled by the model) and
    `sampler_logprobs` grow together through `append`, the only way to add tokens. `messages` is the
    completion as canonical chat messages (protocol.py), what reward functions see."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    sampler_kept: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (offset, Sample.kept) per sample
    spans: list[Span] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    stop_reason: str = ""  # answer | no_action | max_env_steps | turn_length | budget | repetition | reset_timeout |
    # env_done | env_error | max_assistant_turns (user_turns.py)
    tokenization_mismatch: bool = False
    policy_version: int = 0  # optimizer steps the sampled weights had taken
    toolset: Toolset | None = None  # what its calls run on: the env's tools, or its environment's (environments.py)
    prompt_messages: list[dict] = field(default_factory=list)  # what `prompt_ids` renders
    # (completion offset, messages its prompt renders) of each sample after the first (turn_samples.py)
    sample_starts: list[tuple[int, int]] = field(default_factory=list)
    user_turns: int = 0  # the environment's replies as the user (user_turns.py), continuations included
    turn_prefix: str = ""  # the last assistant message's text before its last sample (a continued message's)

    def append(self, role: str, ids: list[int], logprobs: list[float] | None = None,
               kept: torch.Tensor | None = None) -> None:
        if logprobs is None:
            logprobs = [0.0] * len(ids)
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(logprobs)} logprobs for a {role} turn")
        start = len(self.completion_ids)
        self.completion_ids += ids
        self.model_mask += [1 if role == "model" else 0] * len(ids)
        self.sampler_logprobs += logprobs
        if kept is not None:
            self.sampler_kept.append((start, kept))
        self.spans.append(Span(role, start, len(self.completion_ids)))
        assert len(self.completion_ids) == len(self.model_mask) == len(self.sampler_logprobs)

    def truncate(self, length: int) -> None:
        """Drop the completion's tokens from `length` on (a continuation that keeps part of the model's last sample:
        user_turns.continue_turn); the sampler's record of the dropped tokens goes with them."""
        del self.completion_ids[length:], self.model_mask[length:], self.sampler_logprobs[length:]
        self.sampler_kept = [(start, kept[: length - start]) for start, kept in self.sampler_kept if start < length]
        self.spans = [replace(s, end=min(s.end, length)) for s in self.spans if s.start < length]

    context_ids = property(lambda self: self.completion_ids[self.sample_starts[-1][0]:] if self.sample_starts
                           else self.prompt_ids + self.completion_ids)  # what the model sees next: its sample

    context_length = property(lambda self: len(self.context_ids) - len(self.prompt_ids))  # max_completion_length's

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def truncated(self) -> bool:
        return self.stop_reason in TRUNCATED_STOP_REASONS

    @property
    def first_result(self) -> int:
        """Offset of the first environment (<result>) turn in the completion; its length when there is none."""
        return result_start(self.spans, len(self.completion_ids))

    @property
    def tool_turns(self) -> int:
        """Model turns the environment answered (environment steps taken)."""
        return sum(s.role == "env" for s in self.spans)

    @property
    def tool_failures(self) -> int:
        return sum(not c.ok for c in self.calls)


TRUNCATED_STOP_REASONS = ("turn_length", "budget", "repetition")


_BUDGET_CALL_LOGGED: list = []  # the difference below was logged


def length_stop(ep: Episode, turn, max_completion_length: int) -> str:
    """The stop reason of a model turn cut by a token limit: `budget` when the episode's completion is full, else
    `turn_length`. Its calls are not run: a call the budget cut is never answered, so its result could not reach
    the model. TRL's tool loop runs such a call all the same and drops its result, so an environment's state (a game
    board) differs from TRL's after it: logged once."""
    if ep.context_length < max_completion_length:
        return "turn_length"
    if not _BUDGET_CALL_LOGGED and any(not c.error for c in turn.calls):
        _BUDGET_CALL_LOGGED.append(True)
        logger.info("A turn that the completion budget (max_completion_length) cut holds a whole tool call, which is "
                    "not run: its result could not reach the model. TRL runs it and drops the result, so an "
                    "environment's state differs from TRL's after such a turn (raise max_completion_length to let "
                    "the call be answered).")
    return "budget"


def result_start(spans: list[Span], length: int) -> int:
    """Offset of the first environment (<result>) turn in the completion; `length` when there is none."""
    return next((s.start for s in spans if s.role == "env"), length)


def token_turn_index(spans: list[Span], length: int) -> torch.Tensor:
    """(length,) index of the model turn each completion token belongs to; -1 for environment tokens
    and padding. Model turn k is the one the environment's k-th reply (tool results, or a user turn) answers; a
    continuation (an "insert" span) leaves the model in its turn."""
    index = torch.full((length,), -1, dtype=torch.long)
    k = 0
    for span in spans:
        if span.role == "model":
            index[span.start : span.end] = k
        k += span.role == "env"
    return index


def identical_runs(items: list, key: Callable = lambda ep: ep.prompt_ids) -> list[list]:
    """Consecutive items with the same key, as lists (a GRPO group of episodes arrives as one run)."""
    runs: list[list] = []
    for item in items:
        if runs and key(runs[-1][0]) == key(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def run_length(seqs: list[list[int]]) -> int:
    """Length of the runs of identical consecutive sequences, if all runs have one length; else 1."""
    lengths = {len(run) for run in identical_runs(seqs, key=lambda seq: seq)}
    return lengths.pop() if len(lengths) == 1 else 1


def pad_episodes(episodes: list[Episode], pad_id: int, mask_truncated: bool,
                 pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Episodes -> the padded tensors the trainer consumes. `tool_mask` is the loss mask (1 = a
    model token); with `mask_truncated` an episode that ended on a token limit leaves the loss.
    `token_turns` (model turn of each token) is ours, not TRL's: the trainer pops it."""
    t = lambda key, dtype=torch.long: [torch.tensor(getattr(ep, key), dtype=dtype)  # noqa: E731
                                       for ep in episodes]
    ones = lambda key: [torch.ones(len(getattr(ep, key)), dtype=torch.long) for ep in episodes]  # noqa: E731
    right = dict(padding_side="right", pad_to_multiple_of=pad_to_multiple_of)
    batch = {
        "prompt_ids": pad(t("prompt_ids"), padding_value=pad_id, padding_side="left",
                          pad_to_multiple_of=pad_to_multiple_of),
        "prompt_mask": pad(ones("prompt_ids"), padding_value=0, padding_side="left",
                           pad_to_multiple_of=pad_to_multiple_of),
        "completion_ids": pad(t("completion_ids"), padding_value=pad_id, **right),  # (B, T)
        "completion_mask": pad(ones("completion_ids"), padding_value=0, **right),  # (B, T)
        "tool_mask": pad(t("model_mask"), padding_value=0, **right),  # (B, T)
        "sampler_logps": pad(t("sampler_logprobs", torch.float32), padding_value=0.0, **right),  # (B, T)
    }
    if episodes and batch["completion_ids"].shape[1] == 0:  # no episode has a completion token (agents that made
        # no model call): one padding column, out of the loss, since a forward that keeps no position keeps them all
        fill = {"completion_ids": pad_id}
        batch.update({k: torch.full((len(episodes), 1), fill.get(k, 0), dtype=batch[k].dtype)
                      for k in ("completion_ids", "completion_mask", "tool_mask", "sampler_logps")})
    T = batch["completion_ids"].shape[1]
    batch["sample_starts"] = torch.zeros(len(episodes), T, dtype=torch.long)  # 1: a sample's prompt starts here
    for row, ep in enumerate(episodes):
        batch["sample_starts"][row, [s for s, _ in ep.sample_starts]] = 1
    batch["token_turns"] = torch.stack([token_turn_index(ep.spans, T) for ep in episodes]) if episodes else \
        torch.zeros(0, T, dtype=torch.long)
    if any(ep.sampler_kept for ep in episodes):  # (B, T, K) the sampler's kept sets, -1 where none was reported
        K = max(kept.shape[1] for ep in episodes for _, kept in ep.sampler_kept)
        batch["sampler_kept"] = torch.full((len(episodes), T, K), -1, dtype=torch.int32)  # int32: half the memory
        for row, ep in enumerate(episodes):
            for start, kept in ep.sampler_kept:
                batch["sampler_kept"][row, start : start + len(kept), : kept.shape[1]] = kept
    if (images := row_images(episodes)) is not None:  # each row's images, for its forwards (engine/vision.py)
        batch["images"] = images
    if mask_truncated:
        keep = torch.tensor([not ep.truncated for ep in episodes], dtype=torch.long)
        batch["tool_mask"] = batch["tool_mask"] * keep[:, None]
    return batch


def loss_mask(batch: dict) -> torch.Tensor:
    """(B, T) 1 where a token is in the loss: a model token (not padding, not the environment's),
    of an episode the loss keeps. TRL builds the same product inside its `_compute_loss`."""
    return batch["completion_mask"] * batch["tool_mask"]


def check_tokenization(env, prompts: list[list[dict]], episodes: list, mode: str) -> None:
    """Compare each rollout's ids with a full re-render (`tokenization_check`: strict | ignore_whitespace | off);
    log how many differ, and the first difference; and whether text from outside became a control token anywhere
    in a rollout (forged_controls)."""
    if mode == "off":
        return
    diffs = [tokenization_difference(env, p, ep, mode) for ep, p in zip(episodes, prompts)]
    if bad := [d for d in diffs if d]:
        logger.warning("Tokenization check (%s): %d of %d rollouts differ from a full re-render; first: %s",
                       mode, len(bad), len(episodes), bad[0])
    cache: dict = {}  # the template's reply to emptied messages, by their roles and names; prompts' counts by ids
    if forged := [f for f in (forged_controls(env, ep, cache) for ep in episodes) if f]:
        logger.error("Tokenization check: %d of %d rollouts hold a control token inside text from outside (a reply, "
                     "a continuation's text, a prompt's message), which only the chat template may put there; "
                     "first: %s", len(forged), len(episodes), forged[0])


def forged_controls(env, ep, cache: dict | None = None) -> str:
    """Where the episode holds more control tokens (added tokens: `<|im_end|>`...) than the chat template writes
    around its text from outside: that text became a control token. Read: each environment reply appended after a
    model turn (against the template's reply to the same messages, emptied), each continuation's text (an "insert"
    span: none at all), and every rendered prompt, the episode's and each re-rendered sample's (turn_samples.py:
    against the render of the same history without its text from outside, protocol.outside_emptied). "" when none
    did (protocol.template_ids keeps such text plain)."""
    # an image's placeholders are the template's, from the image, not text (engine/vision.py)
    control = set(env.tokenizer.added_tokens_decoder) - set(getattr(getattr(env, "vision", None), "placeholder_ids", ()))
    cache = {} if cache is None else cache
    count = lambda ids: sum(t in control for t in ids)  # noqa: E731
    text = lambda ids: env.tokenizer.decode(ids)[:200]  # noqa: E731
    groups = env_replies(ep.messages)  # the messages of each environment reply, in order
    resampled = {start for start, _ in ep.sample_starts}
    replies = [s for s in ep.spans if s.role == "env"]
    for k, (span, messages) in enumerate(zip(replies, groups)):
        if span.start in resampled:  # a sample's prompt: read below
            continue
        have = count(ep.completion_ids[span.start : span.end])
        key = tuple((m.get("role"), m.get("name", "")) for m in messages)
        if key not in cache:
            cache[key] = count(env.env_reply_ids([{**m, "content": ""} for m in messages]))
        skeleton = cache[key]
        if have > skeleton:
            return (f"environment reply {k} has {have} control tokens, the template's {skeleton}: "
                    f"{text(ep.completion_ids[span.start : span.end])!r}")
    for k, span in enumerate(s for s in ep.spans if s.role == "insert"):
        if have := count(ep.completion_ids[span.start : span.end]):
            return (f"continuation text {k} has {have} control tokens: "
                    f"{text(ep.completion_ids[span.start : span.end])!r}")
    strings = control_strings(env.tokenizer)
    for k, sample in enumerate(episode_samples(ep) if ep.prompt_messages else []):
        history = ep.prompt_messages + ep.messages[: sample.history]
        if not any(c in piece for piece in outside_pieces(history) for c in strings):
            continue  # no text from outside that could have become one (and no render to pay for)
        have, key = count(sample.prompt_ids), ("prompt", tuple(sample.prompt_ids))  # a group shares its prompt
        if key not in cache:
            emptied = outside_emptied(history)
            cache[key] = count(env.render_ids(emptied, add_generation_prompt=True, toolset=ep.toolset))
        if have > cache[key]:
            where = "the episode's prompt" if k == 0 else f"the prompt of sample {k + 1} (a re-render)"
            return f"{where} has {have} control tokens, the template's {cache[key]}: {text(sample.prompt_ids)!r}"
    return ""


def tokenization_difference(env, prompt: list[dict], ep, mode: str) -> str:
    """Compare the rollout's ids with a full render of the final conversation. Returns "" when they
    agree, else the differing text. A mismatch (e.g. a BPE merge across a turn boundary, or special
    tokens the model sampled inside a turn) means training sees other tokens than a fresh render
    would; it is reported, not fixed: the sampled ids are the truth. An episode split into samples
    (turn_samples.py) is compared in its last sample: the earlier samples' prompts are renders themselves."""
    tokenizer = env.tokenizer
    ids = ep.context_ids
    full = env.render_ids(prompt + ep.messages, toolset=ep.toolset)
    if mode == "strict":
        same = full[: len(ids)] == ids
    else:
        squash = lambda s: re.sub(r"\s+", "", s)  # noqa: E731
        same = squash(tokenizer.decode(full)).startswith(squash(tokenizer.decode(ids)))
    ep.tokenization_mismatch = not same
    if same:
        return ""
    k = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
    where = (f"in sample {len(ep.sample_starts) + 1}, at token {k}" if ep.sample_starts
             else f"at completion token {k - len(ep.prompt_ids)}" if k >= len(ep.prompt_ids)
             else f"in the prompt, at token {k}")
    return (f"{where} the rollout has {tokenizer.decode(ids[max(0, k - 8) : k + 8])!r}, "
            f"a re-render {tokenizer.decode(full[max(0, k - 8) : k + 8])!r}")
