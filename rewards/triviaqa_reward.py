"""Rewards for TriviaQA-style search agents: did the search work, and is the answer right?

Every function follows TRL's convention `fn(prompts, completions, **dataset_columns) -> list[float | None]`,
one value per sample. `completions[i]` is the multi-turn completion as chat messages: assistant turns
(`<reasoning>...</reasoning>` then `<tool>{json}</tool>` or `<answer>...</answer>`) alternating with
environment turns `{"role": "user", "content": "<result>\\n...\\n</result>"}`; a failed tool call's
result text starts with `Error:`. The dataset column `answer` holds the accepted aliases (list[str],
or one str). Odd content (missing or unclosed tags, empty turns, no turns) scores 0.0, never raises.

Turn rewards judge the first turn: MT-GRPO gives their advantage A_T to the model tokens before the
first `<result>`, i.e. to the first tool call and the reasoning that led to it.
    tool_execution_reward_func      0.2 * successful tool calls / tool calls            [0, 0.2]
    exist_answer_in_search_results  0.5 if an alias is in the first tool result         {0, 0.5}

Outcome rewards judge the final answer and the format of every turn:
    exact_match_reward_func         1.0 if the final answer equals an alias             {0, 1.0}
    exist_answer_reward_func        0.5 if the final answer contains an alias           {0, 0.5}
    format_reward_func              0.2 * mean per-turn format score                    [0, 0.2]

Matching is on `normalize_answer` text (SQuAD). "Contains" means as whole words: the alias "art"
is not found in "party", so a short alias cannot match by accident.

A reward function may return None for "not applicable": the trainer leaves that function out of
that sample's weighted sum, and a sample whose functions of one kind (turn or outcome) are all None
gets zero advantage of that kind. The functions here always return a number.
"""

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_REASONING = re.compile(r"<reasoning>.*?</reasoning>", re.DOTALL)
_ACTION = re.compile(r"<tool>.*?</tool>|<answer>.*?</answer>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop the articles a/an/the, collapse spaces."""
    s = s.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


# ------------------------------------------------------------------------------------------------
# Reading a conversation (every helper tolerates any content: missing keys, None, non-dicts)
# ------------------------------------------------------------------------------------------------
def _content(message) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else ""


def _role(message) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


def _assistant_texts(completion) -> list[str]:
    return [_content(m) for m in completion or [] if _role(m) == "assistant"]


def _tool_results(completion) -> list[str]:
    """The text inside each `<result>` that answers an assistant turn, in order: one per tool call.
    The environment answers every tool call it runs, malformed ones included (with `Error: ...`),
    so this counts the same calls as the trainer's `rollout/` tool metrics."""
    messages = list(completion or [])
    results = []
    for turn, reply in zip(messages, messages[1:]):
        text = _content(reply).strip()
        if _role(turn) == "assistant" and _role(reply) == "user" and text.startswith("<result>"):
            text = text[len("<result>"):]
            results.append(text[: text.rfind("</result>")] if "</result>" in text else text)
    return [r.strip() for r in results]


def _final_answer(completion) -> str | None:
    """The last complete `<answer>...</answer>` of the last assistant turn that has one."""
    for text in reversed(_assistant_texts(completion)):
        if answers := _ANSWER.findall(text):
            return answers[-1]
    return None


def _aliases(answer) -> list[str]:
    """Normalised, non-empty aliases: an empty alias would be found in every text."""
    aliases = [answer] if isinstance(answer, str) else list(answer or [])
    return [a for a in (normalize_answer(str(x)) for x in aliases) if a]


def _contains(text: str, alias: str) -> bool:
    """Whole-word containment of normalised strings (which are single-space separated)."""
    return f" {alias} " in f" {text} "


# ------------------------------------------------------------------------------------------------
# Turn rewards: the first tool call and what it brought back
# ------------------------------------------------------------------------------------------------
def tool_execution_reward_func(prompts, completions, **kwargs) -> list[float]:
    """0.2 * (successful tool calls / tool calls), in [0, 0.2]; 0.0 with no tool call. A tool call
    failed when its result starts with `Error:` (unknown tool, bad JSON, exception, timeout)."""
    rewards = []
    for completion in completions:
        results = _tool_results(completion)
        ok = sum(not r.startswith("Error:") for r in results)
        rewards.append(0.2 * (ok / len(results)) if results else 0.0)  # ratio first: 0.2 * 3 / 3 > 0.2
    return rewards


def exist_answer_in_search_results(prompts, completions, answer, **kwargs) -> list[float]:
    """0.5 if an alias appears (whole words) in the first tool result, else 0.0 (also with no call, or when
    that call failed: an error message is not a search result)."""
    rewards = []
    for completion, aliases in zip(completions, answer):
        results = _tool_results(completion)
        first = results[0] if results and not results[0].startswith("Error:") else ""
        text = normalize_answer(first)
        rewards.append(0.5 if any(_contains(text, a) for a in _aliases(aliases)) else 0.0)
    return rewards


# ------------------------------------------------------------------------------------------------
# Outcome rewards: the final answer and the format of every turn
# ------------------------------------------------------------------------------------------------
def exact_match_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 if the final `<answer>` equals an alias after normalisation, else 0.0."""
    rewards = []
    for completion, aliases in zip(completions, answer):
        final = _final_answer(completion)
        hit = final is not None and normalize_answer(final) in _aliases(aliases)
        rewards.append(1.0 if hit else 0.0)
    return rewards


def exist_answer_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    """0.5 if the final `<answer>` contains an alias (whole words, after normalisation), else 0.0.
    Partial credit for "the city of Paris" when the alias is "Paris"."""
    rewards = []
    for completion, aliases in zip(completions, answer):
        final = normalize_answer(_final_answer(completion) or "")
        rewards.append(0.5 if any(_contains(final, a) for a in _aliases(aliases)) else 0.0)
    return rewards


def _format_score(text: str) -> float:
    """One assistant turn's format, in [0, 1]: 0.4 * (share of the two fields present: a complete
    <reasoning>...</reasoning>, and a complete <tool>...</tool> or <answer>...</answer>), + 0.3 if it
    starts with <reasoning>, + 0.3 if it ends with </tool> or </answer>."""
    text = text.strip()
    fields = bool(_REASONING.search(text)) + bool(_ACTION.search(text))
    return 0.4 * fields / 2 + 0.3 * text.startswith("<reasoning>") + 0.3 * text.endswith(("</tool>", "</answer>"))


def format_reward_func(prompts, completions, **kwargs) -> list[float]:
    """0.2 * the mean `_format_score` over the assistant turns: bounded in [0, 0.2], exactly 0.2 when
    every turn is `<reasoning>...</reasoning>` then `<tool>...</tool>` or `<answer>...</answer>` and
    nothing after it; 0.0 with no assistant turn."""
    rewards = []
    for completion in completions:
        scores = [_format_score(t) for t in _assistant_texts(completion)]
        rewards.append(0.2 * (sum(scores) / len(scores)) if scores else 0.0)  # mean first: 0.2 * 3 / 3 > 0.2
    return rewards


TURN_REWARD_FUNCS = [tool_execution_reward_func, exist_answer_in_search_results]
OUTCOME_REWARD_FUNCS = [exact_match_reward_func, exist_answer_reward_func, format_reward_func]
