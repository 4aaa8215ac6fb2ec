"""Reading the canonical conversation (protocol.py) that reward functions receive as `completions[i]`.

    {"role": "assistant", "content": <sampled text>, "tool_calls": [<the calls that parsed>]}
    {"role": "tool", "name": <tool name, "" if the call was malformed>, "content": <output>}  # one per call
    ...
    {"role": "assistant", "content": "...<answer>Morvane</answer>", "tool_calls": []}

A tool message's content is a list where the tool returned one (as TRL passes it; `content` gives its text), and it
has a `reward` where the tool returned (output, reward) (rollout/tool_calls.tool_output; `tool_rewards` sums them per tool turn).

A tool turn is an assistant message with the tool messages that answer it (one per call: XML makes
one call per turn, chat_template may make several), or with the messages an environment replied as the user
(user_turns.py: a user message, or a reply's several user, system and tool messages; a turn the environment
answered, credited the same way). The trainer and the rewards count tool turns with the same `tool_turns`, so a
per-turn reward's list lines up with the turns the trainer sees.

Every helper tolerates any content (missing keys, None, non-dict messages, a None completion):
a reward function must score odd text, never raise on it.
"""

import ast
from typing import Callable

from mt_grpo.base.protocol import ERROR_PREFIX, REPLY_ROLES, THINK_CLOSE, content_text, final_answer


def per_tool_turn(fn: Callable) -> Callable:
    """Mark a turn reward as one value per tool turn: for each sample it returns a list with one value (float or
    None) per tool turn, in order, so `len(values[i]) == count_tool_turns(completions[i])` ([] for a
    sample without a tool turn); or one value more, the final model turn's (the turn no reply answered: gym's final
    step, as an environment's `<Class>_steps` gives it). Without the mark a reward returns one number per sample."""
    fn.per_tool_turn = True
    return fn


def is_per_tool_turn(fn: Callable) -> bool:
    """Whether `fn` returns a value per tool turn (@per_tool_turn): the one test of the mark."""
    return getattr(fn, "per_tool_turn", False) is True


def per_turn(fn: Callable) -> Callable:
    """The mark's old name, refused with the new one (`per_turn` is an advantage mode)."""
    raise TypeError(f"@per_turn (on '{getattr(fn, '__name__', fn)}') is now @per_tool_turn: `from mt_grpo.rewards "
                    "import per_tool_turn` and decorate with it (`advantage_mode: per_turn` is the mode that credits "
                    "each turn).")


def role(message) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


def content(message) -> str:
    """The message's text: its content, a content list's text (protocol.content_text), "" for anything else."""
    text = message.get("content") if isinstance(message, dict) else None
    return text if isinstance(text, str) else content_text(text) if isinstance(text, list) else ""


def visible_text(message) -> str:
    """The content after its last </think>: what the chat_template protocol parses and chat templates
    keep. An <answer> inside the model's thinking is not an answer."""
    return content(message).rpartition(THINK_CLOSE)[2]


def assistant_turns(completion) -> list[tuple[dict, list[dict]]]:
    """Every assistant message with the environment's reply right after it (possibly []): its run of tool messages,
    or the messages of an environment that replied as the user (user_turns.py: one user message, or several user,
    system and tool messages), up to the next assistant message. Only the model writes assistant messages and only the
    environment the others, so the run is one reply."""
    turns: list[tuple[dict, list[dict]]] = []
    answering = False  # do messages here still answer the last assistant message?
    for message in completion or []:
        if role(message) == "assistant":
            turns.append((message, []))
            answering = True
        elif role(message) in REPLY_ROLES and answering:
            turns[-1][1].append(message)
        else:
            answering = False
    return turns


def env_replies(completion) -> list[list[dict]]:
    """The messages of each environment reply, in order (one per turn of `tool_turns`)."""
    return [replies for _, replies in assistant_turns(completion) if replies]


def tool_turns(completion) -> list[tuple[dict, list[dict]]]:
    """The tool turns, in order: each assistant message the environment answered, with its tool messages. A turn
    the environment answered as the user (user_turns.py) is one, with no tool message (unless its Reply.messages
    held one): it is credited as a tool turn is. An answer, a truncated turn or a turn the environment did not answer
    is not one."""
    return [(message, [m for m in replies if role(m) == "tool"]) for message, replies in assistant_turns(completion)
            if replies]


def count_tool_turns(completion) -> int:
    return len(tool_turns(completion))


def calls(message) -> list[tuple[str, object]]:
    """(name, arguments) of each call in an assistant message's `tool_calls` (the calls that parsed)."""
    tool_calls = message.get("tool_calls") if isinstance(message, dict) else None
    found = []
    for call in tool_calls if isinstance(tool_calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found.append((function["name"], function.get("arguments", {})))
    return found


def failed(tool_message) -> bool:
    """The call did not run or raised: the environment's reply starts with ERROR_PREFIX, or is TRL's
    failed-call reply, `str({"error": ...})` (its tool loop's, so that a conversation TRL ran scores as ours)."""
    text = content(tool_message).strip()
    return text.startswith(ERROR_PREFIX) or _trl_error(text)


def _trl_error(text: str) -> bool:
    """`text` is `str({"error": <message>})`: what TRL's GRPOTrainer puts in the tool message of a call that
    raised or named no tool (trl/trainer/grpo_trainer.py, the tool loop). A tool may itself return a dict
    with other keys; only the one-key error dict is TRL's failure."""
    if not text.startswith("{'error': "):
        return False
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    return isinstance(value, dict) and list(value) == ["error"]


def malformed(tool_message) -> bool:
    """The call did not parse, so the environment could not say which tool it was for (name "")."""
    name = tool_message.get("name") if isinstance(tool_message, dict) else None
    return not (isinstance(name, str) and name)


def question_text(prompt, question=None) -> str:
    """A sample's question: the dataset's `question` column (`question`, this sample's value), else the prompt's last
    user message (a string prompt: itself)."""
    if question is not None:
        return str(question)
    users = [m for m in prompt if role(m) == "user"] if isinstance(prompt, list) else []
    return content(users[-1]) if users else str(prompt or "")


def completion_answer(completion) -> str | None:
    """The last complete <answer>...</answer> (outside the thinking and the tool calls: protocol.final_answer) of the
    last assistant message that has one."""
    for message in reversed(completion or []):
        if role(message) == "assistant" and (answer := final_answer(visible_text(message))) is not None:
            return answer
    return None


def step_reward(tool_message) -> float | None:
    """The step reward a tool returned with its output (`(output, reward)`: rollout/tool_calls.tool_output); None if none."""
    value = tool_message.get("reward") if isinstance(tool_message, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
