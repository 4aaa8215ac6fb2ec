"""The environment as the user: replies to a model turn without a tool call, an environment that ends its episode,
and text inserted inside the model's own message (continuation). MultiTurnToolEnv (section 6 of the trainer) asks
here what to do after such a turn, and records the reply here.

An environment (environments.py's contract) may define
    respond(messages) -> None | str | list | dict | Reply   sync or async; called after a model turn that made no tool
                               call (an <answer>, or text) and was not cut by a token limit (replies_to_cut_turns),
                               while the episode has had fewer than `max_user_turns` replies. `messages`: the whole
                               conversation, prompt first, the model's last message last (a copy). None: no reply, the
                               episode ends as it would without respond. A string: a user message, and the model takes
                               another turn. A list of messages: Reply(messages=...), several messages with their
                               roles. A Reply (or a dict of its fields): see Reply. Its text is made as a tool's output
                               is (reply_text).
    done                       a plain attribute: set True by a tool (or by respond), it ends the episode after that
                               turn's reply (stop_reason `env_done`). Set it False in `reset`.
    end_episode()              sync or async; called once per episode after its rewards are read, also when it ended
                               on an error or a timeout (verl's release and finalize_interaction, OpenEnv's close).
    replies_to_cut_turns       a plain attribute, False unless set: True asks respond after a turn cut by
                               `max_tokens_per_turn` too (stop_reason turn_length if it gives no reply), as verl's loop,
                               which has no per-turn cap, asks its interaction; a cut turn that holds a tool call still
                               ends the episode, its calls not run (logged once per class).
    max_assistant_turns        a plain attribute, None unless set: the model turns an episode may take (verl's
                               multi_turn.max_assistant_turns). The turn that reaches it is the last: no reply is asked;
                               its tool calls are held back by `max_env_steps` (the verl adapter sets it to one less),
                               so a tool turn after user turns can pass it (logged once per class). stop_reason
                               max_assistant_turns where it ended what would have gone on (a reply, or calls).
A reply's score is its turn's reward R_T, as the step rewards a turn's tools append are (environments.py,
`<Class>_steps`); a turn the environment answered as the user is a turn like a tool turn (rewards.conversation).
The turn that ends the episode keeps its score too: a continuation's scores, and `Reply(end=True, score=...)` (no
message, gym's final step), are that model turn's, summed, whether or not a reply follows.
"""

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable

from mt_grpo.base.protocol import (OUTSIDE_ROLES, REPLY_ROLES, content_text, encode_text, holds_images, is_text_block,
                                   mark_outside)
from mt_grpo.engine.vision import image_content, is_image
from mt_grpo.rollout.tool_calls import clean_text

logger = logging.getLogger("mt_grpo")

_FAILED: set[str] = set()  # classes whose respond failed (logged once each)
_CUT: set[str] = set()  # classes whose reply was cut to max_tool_response_tokens (logged once each)
_DROPPED: set[str] = set()  # classes whose reply did not fit the budget (logged once each)
_HELD: set[str] = set()  # classes that reply to cut turns, one of which held a tool call (logged once each)
_PAST: set[str] = set()  # classes with max_assistant_turns, one of whose episodes passed it (logged once each)


@dataclass
class Reply:
    """An environment's reply to a model turn without a tool call."""

    content: str = ""  # the user message (the chat template renders it; mask 0), or the text a continuation inserts
    done: bool = False  # the reply is appended, then the episode ends (stop_reason env_done), as verl's should_terminate
    score: float | None = None  # the reward R_T of the model turn it answers (a continuation's: of the turn it continues,
    # whether or not a reply follows); None: no score, the turn is not applicable (never an implicit 0.0)
    continuation: bool = False  # the content goes inside the model's open message (plain text), and sampling continues
    keep_tokens: int | None = None  # continuation: tokens of the open assistant message that stay, counted from its
    # start (its samples and inserted texts, as the completion holds them); only the last sample can be cut, never its
    # end-of-turn token kept (None: all of it but that token); the rest leave the episode, as swift's MathTipsScheduler
    # cuts a completion at <answer>
    keep_chars: int | None = None  # or the characters that stay of the message's text as respond sees it
    # (messages[-1]["content"]): the last sample's tokens up to the first whose decoded prefix reaches them (a token
    # across the cut stays, as swift's step counts them)
    end: bool = False  # no message: the episode ends on the model's turn, which `score` credits (gym's final step)
    messages: list[dict] | None = None  # instead of `content`, several messages, in order, as one reply (verifiers'
    # env_response appends each): {"role": "user" | "system" | "tool", "content": str} (a tool message's "name"
    # optional, "" by default), each rendered with its role by the chat template, mask 0; all text from outside


class UserTurn(list):
    """What MultiTurnToolEnv.record_model_turn hands the tool runners for a turn the environment answers as the user:
    no tool call (an empty list, so that every count of calls sees none), the conversation `respond` reads, and the
    stop reason the episode takes if it gets no reply."""

    def __init__(self, messages: list[dict], stop_reason: str):
        super().__init__()
        self.messages, self.stop_reason = messages, stop_reason


def responds(environment) -> bool:
    return callable(getattr(environment, "respond", None))


def add_model_message(ep, text: str, calls: list[dict]) -> None:
    """The model's turn (its sample, the episode's last span) as an assistant message, or, after a continuation,
    joined to the message it continues."""
    if continued(ep.spans, len(ep.spans) - 1):
        ep.turn_prefix = ep.messages[-1]["content"]
        ep.messages[-1].update(content=ep.turn_prefix + text, tool_calls=ep.messages[-1]["tool_calls"] + calls)
    else:
        ep.turn_prefix = ""
        ep.messages.append({"role": "assistant", "content": text, "tool_calls": calls})


def continued(spans: list, k: int) -> bool:
    """Whether span k is a model sample that goes on with its turn after a continuation's text (an "insert" span):
    one turn with the sample before it, for the credit (episodes.token_turn_index) and the counts (reporting.py)."""
    return k > 0 and spans[k - 1].role == "insert"


def ask_user(env, ep) -> "UserTurn | None":
    """After a model turn that ended the episode (`ep.stop_reason`), the turn the environment replies to as the user,
    if it may reply: a model turn without a tool call (answer, no_action; turn_length where the environment
    `replies_to_cut_turns`), an environment with `respond`, user turns left, and model turns left (its
    `max_assistant_turns`). The episode is live again until the reply is recorded (record_reply)."""
    environment = getattr(ep.toolset, "environment", None)
    cut = ep.stop_reason == "turn_length" and getattr(environment, "replies_to_cut_turns", False) is True
    replies = (ep.stop_reason in ("answer", "no_action") or cut) and responds(environment) \
        and not ep.toolset.stuck and ep.user_turns < env.max_user_turns
    if last_turn(ep, environment):  # nothing follows it; a cut turn stays turn_length (truncated)
        if replies and not cut or ep.stop_reason == "max_env_steps":  # it ended a reply, or calls held back
            ep.stop_reason = "max_assistant_turns"
        return None
    if not replies or cut and holds_call(ep, environment):
        return None
    # a copy: respond may edit it in place, and the rewards read the episode's own messages
    turn, ep.stop_reason = UserTurn(copy.deepcopy(ep.prompt_messages + ep.messages), ep.stop_reason), ""
    return turn


def last_turn(ep, environment) -> bool:
    """Whether the model turn just taken is the last the environment allows (its `max_assistant_turns`, verl's): the
    turns it answered (tool or user turns: ep.tool_turns) and this one reach it. One past it (a tool turn that
    max_env_steps let through after user turns, where verl ends the episode) is logged once per class."""
    cap = getattr(environment, "max_assistant_turns", None)
    if cap is None:
        return False
    turns = ep.tool_turns + 1  # a continuation's later samples stay in their turn (no "env" span)
    label = type(environment).__name__
    if turns > cap and label not in _PAST:
        _PAST.add(label)
        logger.warning("%s: an episode took %d model turns, past max_assistant_turns (%d): a tool turn after a user "
                       "turn is held back only by max_env_steps, so its calls ran where verl would have ended the "
                       "episode (first time only).", label, turns, cap)
    return turns >= cap


def holds_call(ep, environment) -> bool:
    """Whether a cut turn (turn_length) the environment would answer holds a tool call: a cut turn's calls are never
    run, so the episode ends on it (verl, which has no per-turn cap, would run them; logged once per class)."""
    if not ep.messages[-1].get("tool_calls"):
        return False
    label = type(environment).__name__
    if label not in _HELD:
        _HELD.add(label)
        logger.warning("%s replies to turns cut by max_tokens_per_turn (replies_to_cut_turns), but a cut turn held a "
                       "tool call, which a cut turn never runs: the episode ends there (turn_length; first time "
                       "only). Raise max_tokens_per_turn, or leave it unset (verl has no per-turn cap).", label)
    return True


def as_reply(value, label: str) -> Reply | None:
    """What respond returned, as a Reply (None: no reply); anything else fails naming the class and the fix."""
    if value is None or isinstance(value, Reply):
        return value if value is None else checked(value, label)
    if isinstance(value, str):
        return Reply(value)
    if is_image(value) or isinstance(value, list) and value and all(isinstance(p, dict) and "type" in p and
                                                                    "role" not in p for p in value):
        return checked(Reply(image_content(value, f"{label}.respond")), label)  # an image, or content blocks
    if isinstance(value, list):
        return checked(Reply(messages=value), label)
    if isinstance(value, dict) and set(value) <= {f.name for f in dataclasses.fields(Reply)}:
        return checked(Reply(**value), label)
    raise ValueError(f"{label}.respond returned {type(value).__name__} {str(value)[:80]!r}; return None (no reply), a "
                     "string (the user message), a list of {role, content} messages, or a user_turns.Reply / dict "
                     "with content, done, score, continuation, keep_tokens, keep_chars, end, messages.")


def checked(reply: Reply, label: str) -> Reply:
    """`reply`, its fields checked: one of the wrong type, a negative count, keep_* without a continuation or both
    given fail naming the class and the field."""
    def fail(name: str, want: str):
        value = getattr(reply, name)
        raise ValueError(f"{label}.respond gave Reply.{name} = {str(value)[:80]!r} ({type(value).__name__}); "
                         f"give {want}.")

    if isinstance(reply.content, list) or is_image(reply.content):  # a user message with images (engine/vision.py)
        reply.content = image_content(reply.content, f"{label}.respond")
    if not isinstance(reply.content, str) and (reply.continuation or not holds_images(reply.content)):
        fail("content", "a string (the user message, or the text a continuation inserts; \"\" for none), or a user "
                        "message's content blocks with images ({'type': 'image', 'image': PIL.Image})")
    for name in ("done", "continuation", "end"):
        if not isinstance(getattr(reply, name, False), bool):
            fail(name, "True or False")
    for name in ("keep_tokens", "keep_chars"):
        value = getattr(reply, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            fail(name, "a count >= 0 from the start of the model's message, or None (keep all of its last sample)")
        if value is not None and not reply.continuation:
            fail(name, "None, or continuation=True: it says where a continuation cuts the model's message")
    if reply.keep_tokens is not None and reply.keep_chars is not None:
        raise ValueError(f"{label}.respond gave Reply.keep_tokens and Reply.keep_chars: give one.")
    if reply.messages is not None:
        checked_messages(reply, label)
    return reply


def checked_messages(reply: Reply, label: str) -> None:
    """Reply.messages: a non-empty list of {role, content} (a tool message's name too), alone (no content, no
    continuation, no end); an assistant message is refused, naming the fix: only the model writes them (the rewards
    and the credit read every assistant message as a model turn)."""
    messages, where = reply.messages, f"{label}.respond gave Reply.messages"
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} = {str(messages)[:80]!r} ({type(messages).__name__}); give a non-empty list of "
                         '{"role", "content"} messages, or None (the reply is `content`).')
    if other := [n for n in ("content", "continuation", "end") if getattr(reply, n)]:
        raise ValueError(f"{where} and Reply.{other[0]}: the messages are the whole reply, appended after the model's "
                         "turn; give them alone (with done and score), or that field without messages.")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{k}] = {str(m)[:80]!r} ({type(m).__name__}); give a dict "
                             '{"role": "user", "content": "..."}.')
        if m.get("role") == "assistant":
            raise ValueError(f"{where}[{k}] with the role 'assistant': only the model's sampled turns are assistant "
                             "messages here (the rewards and the per-turn credit read each one as a model turn). Give "
                             "its text as a user or system message.")
        if m.get("role") not in REPLY_ROLES:
            raise ValueError(f"{where}[{k}] with the role {m.get('role')!r}; give one of {', '.join(REPLY_ROLES)}.")
        if isinstance(m.get("content"), list) or is_image(m.get("content")):  # images: engine/vision.py
            m["content"] = image_content(m["content"], f"{label}.respond")
        if not isinstance(m.get("content"), str) and not (m.get("role") != "system" and holds_images(m.get("content"))):
            raise ValueError(f"{where}[{k}][\"content\"] = {str(m.get('content'))[:80]!r} "
                             f"({type(m.get('content')).__name__}); give a string, or a user or tool message's "
                             "content blocks with images.")
        if unknown := sorted(set(m) - {"role", "content", "name"}):
            raise ValueError(f"{where}[{k}] with the key(s) {unknown}; a message is {{role, content}}, and a tool "
                             "message's name.")
        if not isinstance(m.get("name", ""), str):
            raise ValueError(f"{where}[{k}][\"name\"] = {m['name']!r}; give a string (a tool message's name).")


def reply_text(env, content: str | list, label: str) -> str | list:
    """A reply's text (a user message or a continuation's) made as a tool's output is: repaired
    (tool_calls.clean_text: lone surrogates, NUL and other C0 controls as U+FFFD, warned once per class) and cut to
    `max_tool_response_tokens` (cut_tool_output: by characters before it is tokenized, so that 10 MB cost what
    16 KB do), with a warning once per class. Content blocks with images: each text block repaired, the images kept."""
    text = [dict(p, text=clean_text(p["text"], f"{label}.respond")) if is_text_block(p) else p for p in content] \
        if isinstance(content, list) else clean_text(content, f"{label}.respond")
    cut = env.truncate_tool_output(text)
    if cut != text and label not in _CUT:
        _CUT.add(label)
        logger.warning("%s.respond gave a reply of %d characters, more than max_tool_response_tokens (%d): cut, with "
                       "a marker the model sees (first time only).", label, len(content_text(text)),
                       env.max_tool_response_tokens)
    return cut


def dropped(label: str) -> None:
    """A reply that does not fit the episode's budget: the episode ends (stop_reason budget), warned once per class."""
    if label not in _DROPPED:
        _DROPPED.add(label)
        logger.warning("%s.respond gave a reply that does not fit the rest of the episode's max_completion_length: the "
                       "episode ends at the budget without it (first time only); a lower max_tool_response_tokens cuts "
                       "replies to fit.", label)


def reply_messages(env, reply: Reply, label: str) -> list[dict]:
    """The canonical messages (protocol.py) a reply as the user appends: its `content` as one user message, or each of
    its `messages` with its role (a tool message with its name), each text made as a tool's output is (reply_text: a
    long one cut on its own, as each tool result is). All of it is text from outside: a user or tool message by its
    role, a system message marked (mark_outside), so that no render makes a control token of it."""
    given = reply.messages if reply.messages is not None else [{"role": "user", "content": reply.content}]
    out = []
    for m in given:
        message = {"role": m["role"], **({"name": m.get("name", "")} if m["role"] == "tool" else {}),
                   "content": reply_text(env, m["content"], label)}
        out.append(message if m["role"] in OUTSIDE_ROLES else mark_outside(message))
    return out


def message_start(spans: list) -> int:
    """Completion offset of the open assistant message: where the model's first sample after the last environment
    reply starts (a continuation's inserted text and later samples are inside it)."""
    return next((s.end for s in reversed(spans) if s.role == "env"), 0)


def record_reply(env, ep, turn: UserTurn, result) -> None:
    """Record what `respond` gave for `turn` (a tool_calls.ToolResult whose output is the Reply, None, or the error):
    the user message (or the continuation), its score as the turn's reward, `done`; the episode's stop reason."""
    toolset, label = ep.toolset, type(ep.toolset.environment).__name__
    if not result.ok:  # respond raised or timed out: the episode ends; end_episode still runs
        ep.stop_reason = "env_error"
        if label not in _FAILED:
            _FAILED.add(label)
            logger.warning("%s.respond failed (the episode ends; first failure of the class): %s", label, result.output)
        return
    reply = result.output
    score = [] if reply is None or reply.score is None else [number(reply.score, label)]
    if reply is None or reply.end:  # no reply; an end's score joins the turn's (EnvironmentPool.turn_rewards)
        if reply is not None and (reply.content or reply.continuation):
            raise ValueError(f"{label}.respond gave a Reply with end=True and content or continuation; end is no "
                             "message: give end=True with a score, or a reply without end.")
        toolset.carry += score
        ep.stop_reason = turn.stop_reason
        return
    ep.user_turns += 1
    if reply.continuation:
        toolset.carry += score  # the turn goes on: its score joins the turn's, answered or the episode's last
        continue_turn(env, ep, dataclasses.replace(reply, content=reply_text(env, reply.content, label)))
    else:
        toolset.turn_rewards.append(toolset.carry + score)
        toolset.carry = []
        if not env.append_reply(ep, reply_messages(env, reply, label), last=reply.done):
            dropped(label)
    if reply.done or environment_done(toolset.environment):
        ep.stop_reason = ep.stop_reason or "env_done"


def continue_turn(env, ep, reply: Reply) -> None:
    """Insert the reply's text inside the model's open message (plain text, mask 0), after the tokens of its last
    sample that stay (`keep_tokens` / `keep_chars`, counted from the message's start; None: all); a final end-of-turn
    id never stays, as it would close the message. Sampling continues in the same message, and in the same turn
    (episodes.token_turn_index)."""
    model, label = ep.spans[-1], type(ep.toolset.environment).__name__
    ids = ep.completion_ids[model.start:model.end]
    limit = len(ids) - bool(ids and ids[-1] in env.eos_token_ids)  # the sample, without its end-of-turn token
    # the message before its last sample (an earlier continuation's samples and text) stays whole
    fixed = {"keep_tokens": model.start - message_start(ep.spans), "keep_chars": len(ep.turn_prefix)}
    name = next((n for n in fixed if getattr(reply, n) is not None), None)
    if name is not None and getattr(reply, name) < fixed[name]:
        unit = name.removeprefix("keep_").replace("chars", "characters")
        raise ValueError(f"{label}.respond gave Reply.{name} = {getattr(reply, name)}, which cuts the model's message "
                         f"before its last sample: its first {fixed[name]} {unit} were fixed by an earlier continuation."
                         f" {name} counts from the start of the message (respond's messages[-1]); give at least "
                         f"{fixed[name]}.")
    if name == "keep_tokens":
        kept = reply.keep_tokens - fixed[name]
    elif name == "keep_chars":
        decode = lambda n: env.tokenizer.decode(ids[:n], skip_special_tokens=True)  # noqa: E731
        kept = next((n for n in range(limit + 1) if len(decode(n)) >= reply.keep_chars - fixed[name]), limit)
    else:
        kept = limit
    kept = min(kept, limit)  # bounded to the sample: past its end, all of it but the end-of-turn token
    ep.truncate(model.start + kept)
    ids = encode_text(env.tokenizer, reply.content)
    if ep.context_length + len(ids) >= env.max_completion_length:  # no room for the text and a token after it
        ep.stop_reason = "budget"
        dropped(label)
        return
    ep.append("insert", ids)
    message = ep.messages[-1]
    message["content"] = ep.turn_prefix + env.tokenizer.decode(ep.completion_ids[model.start:model.start + kept],
                                                               skip_special_tokens=True) + reply.content
    mark_outside(message, len(message["content"]) - len(reply.content))  # plain text in every later render too


def environment_done(environment) -> bool:
    """The environment's `done` attribute (a plain value, not a method: a tool may be called `done`)."""
    value = getattr(environment, "done", False)
    return not callable(value) and bool(value)


def number(value, label: str) -> float:
    score = environment_number(value, lambda: f"{label}.respond gave score {value!r}; give a number or None.")
    if math.isnan(score):
        raise ValueError(f"{label}.respond gave a NaN score; give a number, or None for no score.")
    return score


def environment_number(value, error: Callable[[], str]) -> float:
    """A reward an environment reported, as a float: a Python, numpy or one-element torch number (as reward
    functions may return, and TRL takes); a bool, text or anything else fails with `error()`."""
    if not isinstance(value, (bool, str, bytes)) and type(value).__name__ not in ("bool_", "bool"):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise ValueError(error())
