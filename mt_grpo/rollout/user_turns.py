"""The environment as the user: replies to a model turn without a tool call, an environment that ends its episode,
and text inserted inside the model's own message (continuation). MultiTurnToolEnv (section 6 of the trainer) asks
here what to do after such a turn, and records the reply here.

An environment (environments.py's contract) may define
    respond(messages) -> None | str | dict | Reply   sync or async; called after a model turn that made no tool call
                               (an <answer>, or text) and was not cut by a token limit, while the episode has had
                               fewer than `max_user_turns` replies. `messages`: the whole conversation, prompt first, the
                               model's last message last. None: no reply, the episode ends as it would without respond.
                               A string: a user message, and the model takes another turn. A Reply (or a dict of its
                               fields): see Reply.
    done                       a plain attribute: set True by a tool (or by respond), it ends the episode after that
                               turn's reply (stop_reason `env_done`). Set it False in `reset`.
    end_episode()              sync or async; called once per episode after its rewards are read, also when it ended
                               on an error or a timeout (verl's release and finalize_interaction, OpenEnv's close).
A reply's score is its turn's reward R_T, as the step rewards a turn's tools append are (environments.py,
`<Class>_steps`); a turn the environment answered as the user is a turn like a tool turn (rewards.conversation).
"""

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("mt_grpo")

_FAILED: set[str] = set()  # classes whose respond failed (logged once each)


@dataclass
class Reply:
    """An environment's reply to a model turn without a tool call."""

    content: str = ""  # the user message (the chat template renders it; mask 0), or the text a continuation inserts
    done: bool = False  # the reply is appended, then the episode ends (stop_reason env_done), as verl's should_terminate
    score: float | None = None  # the reward R_T of the model turn it answers (a continuation's: of the turn it continues)
    continuation: bool = False  # the content goes inside the model's open message (plain text), and sampling continues
    keep_tokens: int | None = None  # continuation: tokens of the model's last sample that stay (None: all but a final
    # end-of-turn token); the rest leave the episode, as swift's MathTipsScheduler cuts a completion at <answer>
    keep_chars: int | None = None  # or the characters of its text that stay: the tokens up to the first whose decoded
    # prefix reaches them (a token across the cut stays, as swift's step counts them)


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
    if it may reply: a model turn without a tool call (answer, no_action), an environment with `respond`, user turns
    left. The episode is live again until the reply is recorded (record_reply)."""
    environment = getattr(ep.toolset, "environment", None)
    if ep.stop_reason not in ("answer", "no_action") or not responds(environment) or ep.toolset.stuck \
            or ep.user_turns >= env.max_user_turns:
        return None
    turn, ep.stop_reason = UserTurn(ep.prompt_messages + ep.messages, ep.stop_reason), ""
    return turn


def as_reply(value, label: str) -> Reply | None:
    """What respond returned, as a Reply (None: no reply); anything else fails naming the class and the fix."""
    if value is None or isinstance(value, Reply):
        return value
    if isinstance(value, str):
        return Reply(value)
    if isinstance(value, dict) and set(value) <= {f.name for f in dataclasses.fields(Reply)}:
        return Reply(**value)
    raise ValueError(f"{label}.respond returned {type(value).__name__} {str(value)[:80]!r}; return None (no reply), a "
                     "string (the user message), or a user_turns.Reply / dict with content, done, score, continuation, "
                     "keep_tokens, keep_chars.")


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
    if reply is None:
        ep.stop_reason = turn.stop_reason
        return
    score = [] if reply.score is None else [number(reply.score, label)]
    ep.user_turns += 1
    if reply.continuation:
        toolset.carry += score  # the turn goes on: its score joins the turn's rewards when the turn is answered
        continue_turn(env, ep, reply)
    else:
        toolset.turn_rewards.append(toolset.carry + score)
        toolset.carry = []
        env.append_reply(ep, [{"role": "user", "content": reply.content}], last=reply.done)
    if reply.done or environment_done(toolset.environment):
        ep.stop_reason = ep.stop_reason or "env_done"


def continue_turn(env, ep, reply: Reply) -> None:
    """Insert the reply's text inside the model's open message (plain text, mask 0), after the tokens of its last
    sample that stay (`keep_tokens`; None: all but a final end-of-turn id, which would close the message); sampling
    continues in the same message, and in the same turn (episodes.token_turn_index)."""
    from mt_grpo.base.protocol import encode_text

    model = ep.spans[-1]
    sampled, ids = model.end - model.start, ep.completion_ids[model.start:model.end]
    if reply.keep_tokens is not None and reply.keep_chars is not None:
        raise ValueError(f"{type(ep.toolset.environment).__name__}.respond gave keep_tokens and keep_chars: give one.")
    kept = sampled if reply.keep_tokens is None else max(0, min(reply.keep_tokens, sampled))
    if reply.keep_chars is not None:
        decode = lambda n: env.tokenizer.decode(ids[:n], skip_special_tokens=True)  # noqa: E731
        kept = next((n for n in range(sampled + 1) if len(decode(n)) >= reply.keep_chars), sampled)
    elif reply.keep_tokens is None and kept and ids[-1] in env.eos_token_ids:
        kept -= 1
    ep.truncate(model.start + kept)
    ids = encode_text(env.tokenizer, reply.content)
    if ep.context_length + len(ids) >= env.max_completion_length:  # no room for the text and a token after it
        ep.stop_reason = "budget"
        return
    ep.append("insert", ids)
    message = ep.messages[-1]
    message["content"] = ep.turn_prefix + env.tokenizer.decode(ep.completion_ids[model.start:model.start + kept],
                                                               skip_special_tokens=True) + reply.content


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
