"""Rewards for TriviaQA-style search agents: did the search work, and is the answer right?

Every function follows TRL's convention `fn(prompts, completions, **dataset_columns)`. `completions[i]`
is the canonical conversation of protocol.py (rewards/conversation.py reads it): assistant messages
whose `tool_calls` hold the calls that parsed, each tool turn answered by one `tool` message per
call, a failed call's content starting with `protocol.ERROR_PREFIX` or, under chat_template, TRL's
`{'error': ...}` (conversation.failed reads both). The keyword `answer_aliases`
holds the accepted aliases (list[str], or one str; tasks/ makes it from the `answer` column, which reaches
rewards as the dataset holds it). Odd content (missing or unclosed tags, empty
turns, no turns) scores 0.0, never raises.

Turn rewards come in two forms. Most return one number per sample and judge the first tool turn:
MT-GRPO gives their advantage A_T to the model tokens before the first tool result, i.e. to the
first tool call and the reasoning that led to it. Those marked `@per_tool_turn` return, per sample, a
list with one value per tool turn (`[]` for an episode without one), for a turn-level advantage.
    tool_execution_reward_func       0.2 * successful calls / calls, whole episode      [0, 0.2]
    answer_in_tool_result            0.5 if the gold answer appears in the tool's reply   {0, 0.5}
                                     (the first tool turn's results; of each, its first 3 documents:
                                     what a default search returns). Any tool, not only a search.
    exist_answer_in_search_results   its old name, kept for recipes and for runs logged under it
    tool_execution_per_turn          per tool turn: 0.2 * successful calls / calls       [0, 0.2]
    answer_in_result_per_turn        per tool turn: 0.5 if an alias is in one of its results  {0, 0.5}
    repeated_query_penalty_per_turn  per tool turn: -0.2 if a call repeats an earlier call  {-0.2, 0}

Outcome rewards judge the final answer and the format of every turn:
    exact_match_reward_func          1.0 if the final answer equals an alias             {0, 1.0}
    exist_answer_reward_func         0.5 if the final answer contains an alias           {0, 0.5}
    grounded_answer_reward_func      0.25 if the final answer is a short span of a search  {0, 0.25}
                                     result that the question does not contain (no gold needed)
    format_reward_func               xml protocol: 0.2 * mean per-turn format score      [0, 0.2]
    chat_format_reward_func          chat_template protocol: 0.2 * mean per-turn score   [0, 0.2]

Matching follows the dataset's optional column `answer_type` (rewards/answers.py): "text" compares
`normalize_answer` text (SQuAD), where "contains" means whole words (the alias "art" is not found in
"party", so a short alias cannot match by accident); "math" compares numbers and expressions with
math_verify (308.0 == 308, 35 != 3.5); "auto", the default, is math for a gold alias that is a number,
a fraction or LaTeX, text for words. An error message is never a tool result, even when it quotes
the answer.

A reward function may return None for "not applicable" (a per-turn one: None in place of a turn's
value): the trainer leaves it out of that sample's weighted sum, and a sample whose functions of
one kind (turn or outcome) are all None gets zero advantage of that kind. The functions here
always return numbers.
"""

import re

from mt_grpo.base.protocol import ANSWER_CLOSE, ANSWER_PATTERN, XMLProtocol
from mt_grpo.rewards.answers import answer_types, contains_answer, contains_words, matches_answer, normalize_answer
from mt_grpo.rewards.conversation import (assistant_turns, calls, completion_answer, content, failed, malformed,
                                          per_tool_turn, question_text, tool_turns, visible_text)

_REASONING = re.compile(re.escape(XMLProtocol.REASONING_OPEN) + ".*?" + re.escape(XMLProtocol.REASONING_CLOSE),
                        re.DOTALL)


# ------------------------------------------------------------------------------------------------
# Turn rewards: what the tool calls did and brought back
# ------------------------------------------------------------------------------------------------
def _execution_score(tools: list[dict]) -> float:
    """0.2 * the share of these calls that ran without error; ratio first: 0.2 * 3 / 3 > 0.2 in floats."""
    return 0.2 * (sum(not failed(t) for t in tools) / len(tools)) if tools else 0.0


# A result is judged on its first JUDGED_DOCUMENTS documents (`search` separates them by a blank line),
# what a call with the default num_results returns: asking for more documents (up to 10) must not raise
# the turn reward, only a better query may. A tool whose output has no blank line is one document.
JUDGED_DOCUMENTS = 3


def _answer_found(tools: list[dict], answer, answer_type: str) -> float:
    """0.5 if one of the first JUDGED_DOCUMENTS documents of a successful result among `tools` holds a gold
    alias (`contains_answer`: whole words, or for a number an equal number), else 0.0."""
    texts = ["\n\n".join(content(t).split("\n\n")[:JUDGED_DOCUMENTS]) for t in tools if not failed(t)]
    return 0.5 if any(contains_answer(text, answer, answer_type) for text in texts) else 0.0


def tool_execution_reward_func(prompts, completions, **kwargs) -> list[float]:
    """0.2 * (successful tool calls / tool calls) over the whole episode, in [0, 0.2]; 0.0 with no
    call. A call failed when its tool message is a failure's (conversation.failed: ERROR_PREFIX, or TRL's
    `{'error': ...}`; unknown tool, bad JSON, exception, timeout)."""
    return [_execution_score([t for _, tools in tool_turns(c) for t in tools]) for c in completions]


def answer_in_tool_result(prompts, completions, answer_aliases, answer_type=None, **kwargs) -> list[float]:
    """0.5 if the gold answer appears in the tool's reply (the first tool turn's results: any tool, a
    search or another), else 0.0; also with no tool turn, or when its calls failed: an error message is
    not a result. "Appears" follows `answer_type` (rewards/answers.py): whole words, or an equal number."""
    rewards = []
    for completion, aliases, kind in zip(completions, answer_aliases, answer_types(answer_type, len(completions))):
        turns = tool_turns(completion)
        rewards.append(_answer_found(turns[0][1], aliases, kind) if turns else 0.0)
    return rewards


def exist_answer_in_search_results(prompts, completions, answer_aliases, answer_type=None, **kwargs) -> list[float]:
    """`answer_in_tool_result` under its old name: a recipe that names it keeps working, and its metrics keep
    the name they were logged under (`rewards/turn/exist_answer_in_search_results`)."""
    return answer_in_tool_result(prompts, completions, answer_aliases, answer_type=answer_type, **kwargs)


@per_tool_turn
def tool_execution_per_turn(prompts, completions, **kwargs) -> list[list[float]]:
    """Per tool turn: 0.2 * the share of that turn's calls that ran without error, in [0, 0.2]."""
    return [[_execution_score(tools) for _, tools in tool_turns(c)] for c in completions]


@per_tool_turn
def answer_in_result_per_turn(prompts, completions, answer_aliases, answer_type=None, **kwargs) -> list[list[float]]:
    """Per tool turn: 0.5 if one of that turn's successful results holds the gold answer (as
    `answer_in_tool_result` judges it), else 0.0. Rewards the turn whose search found it, not only the first."""
    return [[_answer_found(tools, aliases, kind) for _, tools in tool_turns(c)]
            for c, aliases, kind in zip(completions, answer_aliases, answer_types(answer_type, len(completions)))]


def _normalized(value):
    """A hashable form of tool arguments in which strings compare as `normalize_answer` text, so
    "Veltria capital" and "veltria capital?" are the same query."""
    if isinstance(value, str):
        return normalize_answer(value)
    if isinstance(value, dict):
        return tuple(sorted(((str(k), _normalized(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    if isinstance(value, (list, tuple)):
        return tuple(_normalized(v) for v in value)
    return repr(value)  # numbers, booleans, None, anything else: hashable whatever it is


@per_tool_turn
def repeated_query_penalty_per_turn(prompts, completions, **kwargs) -> list[list[float]]:
    """Per tool turn: -0.2 if one of its parsed calls repeats an earlier call of the episode (an
    earlier turn's, or one before it in the same turn): same tool name and the same arguments after
    normalising strings; else 0.0. Asking again what was already answered gains nothing."""
    rewards = []
    for completion in completions:
        seen, values = set(), []
        for message, _ in tool_turns(completion):
            repeated = False
            for name, arguments in calls(message):
                key = (name, _normalized(arguments))
                repeated = repeated or key in seen
                seen.add(key)
            values.append(-0.2 if repeated else 0.0)
        rewards.append(values)
    return rewards


# ------------------------------------------------------------------------------------------------
# Outcome rewards: the final answer and the format of every turn
# ------------------------------------------------------------------------------------------------
def exact_match_reward_func(prompts, completions, answer_aliases, answer_type=None, **kwargs) -> list[float]:
    """1.0 if the final `<answer>` equals an alias (`matches_answer`: normalised text, or an equal number
    under `answer_type`), else 0.0."""
    kinds = answer_types(answer_type, len(completions))
    return [1.0 if matches_answer(completion_answer(completion), aliases, kind) else 0.0
            for completion, aliases, kind in zip(completions, answer_aliases, kinds)]


def exist_answer_reward_func(prompts, completions, answer_aliases, answer_type=None, **kwargs) -> list[float]:
    """0.5 if the final `<answer>` holds an alias (`contains_answer`: whole words, or an equal number under
    `answer_type`), else 0.0. Partial credit for "the city of Paris" when the alias is "Paris"."""
    kinds = answer_types(answer_type, len(completions))
    return [0.5 if contains_answer(completion_answer(completion) or "", aliases, kind) else 0.0
            for completion, aliases, kind in zip(completions, answer_aliases, kinds)]


# A grounded answer is a fact, not a passage: at most this many words (the fictional KB's answers have 1 to 3)
GROUNDED_MAX_WORDS = 4


def grounded_answer_reward_func(prompts, completions, question=None, **kwargs) -> list[float]:
    """0.25 if the final `<answer>` (1 to GROUNDED_MAX_WORDS words after normalisation) appears, whole
    words, in a successful tool result of the episode and not in the question; else 0.0.

    It needs no gold answer: it pays for copying a fact out of the evidence, the step a small model
    misses once it has learned to search (docs/results.md, the ablation of issue 22), and leaves it to
    the exact-match reward to say which fact. Not in the question: every result names the question's
    entity, and answering with it would otherwise earn the reward. Short: a copied passage is not an
    answer. Worth a quarter of an exact match, so a wrong fact copied from the result stays far below
    the right one."""
    questions = question if question is not None else [None] * len(completions)
    rewards = []
    for prompt, completion, q in zip(prompts, completions, questions):
        final = normalize_answer(completion_answer(completion) or "")
        results = [normalize_answer(content(t)) for _, tools in tool_turns(completion) for t in tools if not failed(t)]
        grounded = (0 < len(final.split()) <= GROUNDED_MAX_WORDS and any(contains_words(r, final) for r in results)
                    and not contains_words(normalize_answer(question_text(prompt, q)), final))
        rewards.append(0.25 if grounded else 0.0)
    return rewards


def _calls_parsed(message: dict, tools: list[dict]) -> bool:
    """The turn made tool calls and every one of them parsed (none answered as malformed)."""
    return bool(calls(message)) and not any(malformed(t) for t in tools)


def _xml_turn_format(message: dict, tools: list[dict]) -> float:
    """One assistant turn's XML format, in [0, 1]:
        0.2  a complete <reasoning>...</reasoning>
        0.3  the turn starts with <reasoning>
        0.2  an action: a tool call that parsed, or a complete <answer>...</answer>
        0.3  the turn ends with that action's closing tag (</tool> or </answer>)
    A closed <tool>...</tool> whose call did not parse is no action: such a turn scores at most 0.5,
    so a policy cannot hold the format reward at its maximum while every tool call fails."""
    text = content(message).strip()
    parsed, answered = _calls_parsed(message, tools), ANSWER_PATTERN.search(text) is not None
    closed = ((parsed and text.endswith(XMLProtocol.TOOL_CLOSE))
              or (answered and text.endswith(ANSWER_CLOSE)))
    return (0.2 * bool(_REASONING.search(text)) + 0.3 * text.startswith(XMLProtocol.REASONING_OPEN)
            + 0.2 * (parsed or answered) + 0.3 * closed)


def _chat_turn_format(message: dict, tools: list[dict]) -> float:
    """One assistant turn's chat_template format, in [0, 1]: 1.0 with a complete <answer>...</answer>
    after the thinking; else the share of its tool calls that parsed, parsed / (parsed + malformed);
    0.0 with neither."""
    if ANSWER_PATTERN.search(visible_text(message)):
        return 1.0
    parsed, bad = len(calls(message)), sum(malformed(t) for t in tools)
    return parsed / (parsed + bad) if parsed + bad else 0.0


def _mean_format(completion, turn_format) -> float:
    """0.2 * the mean turn format over the assistant turns; mean first: 0.2 * 3 / 3 > 0.2 in floats."""
    scores = [turn_format(message, tools) for message, tools in assistant_turns(completion)]
    return 0.2 * (sum(scores) / len(scores)) if scores else 0.0


def format_reward_func(prompts, completions, **kwargs) -> list[float]:
    """The xml protocol's format: 0.2 * the mean `_xml_turn_format` over the assistant turns, in [0, 0.2];
    exactly 0.2 when every turn is <reasoning>...</reasoning> then a tool call that parsed or an
    <answer>...</answer>, and nothing after it; 0.0 with no assistant turn."""
    return [_mean_format(c, _xml_turn_format) for c in completions]


def chat_format_reward_func(prompts, completions, **kwargs) -> list[float]:
    """The chat_template protocol's format: 0.2 * the mean `_chat_turn_format` over the assistant
    turns, in [0, 0.2]; exactly 0.2 when every turn's calls all parsed or it gives a complete answer.
    No reasoning tags are asked for: the chat template has its own."""
    return [_mean_format(c, _chat_turn_format) for c in completions]


TURN_REWARD_FUNCS = [tool_execution_reward_func, answer_in_tool_result, tool_execution_per_turn,
                     answer_in_result_per_turn, repeated_query_penalty_per_turn]
OUTCOME_REWARD_FUNCS = [exact_match_reward_func, exist_answer_reward_func, grounded_answer_reward_func,
                        format_reward_func, chat_format_reward_func]
