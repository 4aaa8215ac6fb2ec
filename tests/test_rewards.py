"""Reward functions on hand-written canonical conversations (protocol.py), with the exact values each
should give, the per-turn form, and the registry that resolves recipe names and dotted paths."""

import concurrent.futures
import json

import pytest

from helpers import xml_answer, xml_call
from mt_grpo.base.protocol import error_text, tool_call_message
from mt_grpo.rewards import (REWARD_FUNCS, RENAMED_REWARD_FUNCS, answers, count_tool_turns, get_reward_func,
                             is_per_tool_turn, per_tool_turn, per_turn, tool_turns)
from mt_grpo.rewards.answers import ANSWER_TYPES, contains_answer, matches_answer
from mt_grpo.rewards.triviaqa_reward import (OUTCOME_REWARD_FUNCS, TURN_REWARD_FUNCS, answer_in_result_per_turn,
                                             answer_in_tool_result, chat_format_reward_func, exact_match_reward_func,
                                             exist_answer_in_search_results, exist_answer_reward_func,
                                             format_reward_func, grounded_answer_reward_func, normalize_answer,
                                             repeated_query_penalty_per_turn, tool_execution_per_turn,
                                             tool_execution_reward_func)

PROMPT = [{"role": "system", "content": "You answer questions."},
          {"role": "user", "content": "What is the capital of Veltria?"}]
FOUND = "Veltria: Veltria is a country in the north. Its capital is Morvane."
NOT_FOUND = "Veltria: Veltria is a country in the north."


def assistant(text, calls=()):
    """An assistant message; `calls` are (name, query) pairs that parsed."""
    return {"role": "assistant", "content": text,
            "tool_calls": [tool_call_message(name, {"query": query}) for name, query in calls]}


def search(query="Veltria capital", name="search"):
    """An xml turn with one call that parsed."""
    return assistant(xml_call(query, name, why="I should look it up."), [(name, query)])


def chat_calls(*queries):
    """A chat_template turn: one <tool_call> block per search, all of which parsed."""
    blocks = [json.dumps({"name": "search", "arguments": {"query": q}}) for q in queries]
    return assistant("\n".join(f"<tool_call>{b}</tool_call>" for b in blocks), [("search", q) for q in queries])


def tool(text, name="search"):
    return {"role": "tool", "name": name, "content": text}


def malformed_reply(why="the tool call is not valid JSON (Expecting property name at char 1)."):
    """The environment's answer to a call that did not parse: no tool name."""
    return tool(error_text(why), name="")


def answer_turn(text):
    return assistant(xml_answer(text, why="The result says so."))


SEARCH = search()
BAD_JSON = assistant("<reasoning>I look it up.</reasoning>\n<tool>{name: search}</tool>")  # did not parse
UNKNOWN_TOOL = error_text("unknown tool 'lookup'; available tools: ['search']")
TIMED_OUT = error_text("tool 'search' timed out after 10s")

# (id, completion, answer column,
#  expected: tool_execution, exist_in_search, exact_match, exist_answer, format (xml), chat_format)
CASES = [
    ("clean_search_then_answer", [SEARCH, tool(FOUND), answer_turn("Morvane")], ["Morvane"],
     (0.2, 0.5, 1.0, 0.5, 0.2, 0.2)),
    # the call parsed, so its format is fine; the turn reward is what sees that it failed
    ("valid_call_to_unknown_tool", [search(name="lookup"), tool(UNKNOWN_TOOL, name="lookup"), answer_turn("Morvane")],
     ["Morvane"], (0.0, 0.0, 1.0, 0.5, 0.2, 0.2)),
    ("two_calls_first_fails", [SEARCH, tool(TIMED_OUT), SEARCH, tool(FOUND), answer_turn("Paris")], ["Morvane"],
     (0.1, 0.0, 0.0, 0.0, 0.2, 0.2)),
    # 0.2 * 3 / 3 rounds above 0.2 in floats; the reward must not
    ("three_successful_calls", [SEARCH, tool(FOUND), SEARCH, tool(FOUND), SEARCH, tool(FOUND), answer_turn("Morvane")],
     ["Morvane"], (0.2, 0.5, 1.0, 0.5, 0.2, 0.2)),
    ("alias_only_in_second_result", [SEARCH, tool(NOT_FOUND), SEARCH, tool(FOUND), answer_turn("Morvane")],
     ["Morvane"], (0.2, 0.0, 1.0, 0.5, 0.2, 0.2)),
    ("no_tool_call", [answer_turn("Morvane")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2, 0.2)),
    ("case_punctuation_articles", [answer_turn("  the BEATLES!! ")], ["The Beatles"],
     (0.0, 0.0, 1.0, 0.5, 0.2, 0.2)),
    ("answer_contains_alias", [SEARCH, tool(FOUND), answer_turn("the city of Morvane")], ["Morvane"],
     (0.2, 0.5, 0.0, 0.5, 0.2, 0.2)),
    ("alias_inside_a_longer_word_is_not_found", [answer_turn("party")], ["art"],
     (0.0, 0.0, 0.0, 0.0, 0.2, 0.2)),
    ("second_alias_matches", [answer_turn("JFK")], ["John F. Kennedy", "jfk"],
     (0.0, 0.0, 1.0, 0.5, 0.2, 0.2)),
    # xml: the second turn only starts with <reasoning> (0.3): mean (1 + 0.3) / 2. chat: (1 + 0) / 2
    ("truncated_last_turn", [SEARCH, tool(FOUND), assistant("<reasoning>The result says the cap")],
     ["Morvane"], (0.2, 0.5, 0.0, 0.0, 0.2 * 0.65, 0.1)),
    # each turn only starts with <reasoning>: 0.3; the env answered the unclosed tool tag as malformed
    ("unclosed_tags", [assistant('<reasoning>look it up<tool>{"name": "search"'),
                       malformed_reply("a tool call or answer was opened but not closed, or closed but not opened."),
                       assistant("<reasoning>so <answer>Morvane")], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.2 * 0.3, 0.0)),
    # reasoning (0.2) and start (0.3); a <tool> never closed is no action: (0.5 + 1) / 2
    ("unclosed_tool_tag_then_answer", [assistant('<reasoning>look it up</reasoning>\n<tool>{"name": "search"'),
                                       malformed_reply("a tool call or answer was opened but not closed."),
                                       answer_turn("Morvane")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2 * 0.75, 0.1)),
    ("mismatched_tags", [assistant("<answer>Morvane</reasoning></answer>")], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.2 * 0.5, 0.2)),  # xml: the answer (0.2) and the closing tag (0.3)
    # xml: an action (0.2) that ends the turn (0.3), but no reasoning; chat asks for none
    ("answer_only", [assistant("<answer>Morvane</answer>")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2 * 0.5, 0.2)),
    # A malformed call (bad JSON) is a call the env ran and failed: 1 of 2 succeeded. Its turn is
    # well tagged but has no action: 0.5, mean (1 + 0.5 + 1) / 3 (was 0.2 before issue 10)
    ("good_call_then_bad_json", [SEARCH, tool(FOUND), BAD_JSON, malformed_reply(), answer_turn("Morvane")],
     ["Morvane"], (0.1, 0.5, 1.0, 0.5, 0.2 * 2.5 / 3, 0.2 * 2 / 3)),
    # the collapse of issue 10: every turn perfectly tagged, every call broken JSON; xml format was 0.2
    ("bad_json_every_turn", [BAD_JSON, malformed_reply(), BAD_JSON, malformed_reply(), BAD_JSON], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.2 * 0.5, 0.0)),
    # xml: no closing action at the end of the first turn: 0.7, mean (0.7 + 1) / 2
    ("text_after_the_call", [assistant(SEARCH["content"] + "\nThen I answer.", [("search", "Veltria capital")]),
                             tool(FOUND), answer_turn("Morvane")], ["Morvane"],
     (0.2, 0.5, 1.0, 0.5, 0.2 * 0.85, 0.2)),
    ("last_answer_in_turn_counts",
     [assistant("<reasoning>r</reasoning><answer>Paris</answer><answer>Morvane</answer>")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2, 0.2)),
    ("answer_from_last_turn_that_has_one", [answer_turn("Morvane"), assistant("<reasoning>hm")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2 * 0.65, 0.1)),
    # chat_template shape: two calls in one turn; the first tool turn's results hold the answer.
    # xml: turn 1 has an action (0.2) only, the answer turn 0.5: (0.2 + 0.5) / 2
    ("chat_two_calls_in_one_turn", [chat_calls("Veltria", "Morvane"), tool(NOT_FOUND), tool(FOUND),
                                    assistant("<answer>Morvane</answer>")], ["Morvane"],
     (0.2, 0.5, 1.0, 0.5, 0.2 * 0.35, 0.2)),
    # one of the turn's two calls did not parse: chat format 0.5 for that turn; xml: no action
    ("chat_one_of_two_calls_malformed",
     [assistant('<tool_call>{"name": "search", "arguments": {"query": "Veltria"}}</tool_call>\n'
                '<tool_call>{"name": search}</tool_call>', [("search", "Veltria")]),
      tool(FOUND), malformed_reply(), assistant("<answer>Morvane</answer>")], ["Morvane"],
     (0.1, 0.5, 1.0, 0.5, 0.2 * 0.25, 0.2 * 0.75)),
    ("chat_bad_json_call", [assistant('<tool_call>{"name": search}</tool_call>'), malformed_reply(),
                            assistant("<answer>Morvane</answer>")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2 * 0.25, 0.1)),
    # chat_template with thinking (Qwen3): only the text after the last </think> is the turn's answer
    ("answer_after_thinking", [assistant("<think>\nI know it.\n</think>\n\n<answer>Morvane</answer>")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2 * 0.5, 0.2)),
    ("answer_only_inside_thinking", [assistant("<think>\nMaybe <answer>Morvane</answer>?\n</think>\n\nNo idea.")],
     ["Morvane"], (0.0, 0.0, 0.0, 0.0, 0.2 * 0.2, 0.0)),  # xml reads the whole turn: an answer (0.2), not at the end
    ("plain_text_no_tags", [assistant("Morvane")], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
    ("empty_and_none_content", [assistant(""), {"role": "assistant", "content": None}, {"role": "user"}], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
    # tool_calls of the wrong shape count as no call; the env's reply still counts as a call that ran
    ("odd_tool_calls_and_messages", [None, "junk", {**SEARCH, "tool_calls": "oops"}, tool(FOUND),
                                     {"role": "assistant", "content": "<answer>Morvane</answer>",
                                      "tool_calls": [None, {"function": None}, {"function": {"name": 3}}]}],
     ["Morvane"], (0.2, 0.5, 1.0, 0.5, 0.2 * 0.5, 0.1)),
    ("empty_completion", [], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
    ("answer_column_is_a_string", [SEARCH, tool(FOUND), answer_turn("Morvane")], "Morvane",
     (0.2, 0.5, 1.0, 0.5, 0.2, 0.2)),
    # an empty alias must not match every text, nor an empty answer
    ("empty_alias_ignored", [SEARCH, tool(NOT_FOUND), answer_turn("Paris")], ["", "Morvane"],
     (0.2, 0.0, 0.0, 0.0, 0.2, 0.2)),
    ("empty_answer_and_only_empty_alias", [SEARCH, tool(FOUND), answer_turn("")], ["", " "],
     (0.2, 0.0, 0.0, 0.0, 0.2, 0.2)),
    # the answer hidden in an error message (here a tool name) is not a search result
    ("alias_in_error_message", [search(name="Morvane"), tool(error_text("unknown tool 'Morvane'"), name="Morvane"),
                                answer_turn("x")], ["Morvane"], (0.0, 0.0, 0.0, 0.0, 0.2, 0.2)),
]
FUNCS = [tool_execution_reward_func, exist_answer_in_search_results, exact_match_reward_func, exist_answer_reward_func,
         format_reward_func, chat_format_reward_func]


@pytest.mark.parametrize("completion, answer, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_reward_values(completion, answer, expected):
    got = [fn(prompts=[PROMPT], completions=[completion], answer_aliases=[answer])[0] for fn in FUNCS]
    assert got == pytest.approx(list(expected))


def test_whole_table_as_one_batch_gives_the_same_values_and_ignores_unknown_columns():
    completions, answers = [c[1] for c in CASES], [c[2] for c in CASES]
    for f, fn in enumerate(FUNCS):
        got = fn(prompts=[PROMPT] * len(CASES), completions=completions, answer_aliases=answers,
                 question=["What is the capital of Veltria?"] * len(CASES), task=["triviaqa"] * len(CASES))
        assert got == pytest.approx([c[3][f] for c in CASES]), fn.__name__
        assert all(type(v) is float for v in got), fn.__name__


@pytest.mark.parametrize("fn, high", [(tool_execution_reward_func, 0.2), (exist_answer_in_search_results, 0.5),
                                      (exact_match_reward_func, 1.0), (exist_answer_reward_func, 0.5),
                                      (grounded_answer_reward_func, 0.25),
                                      (format_reward_func, 0.2), (chat_format_reward_func, 0.2)])
def test_rewards_stay_within_their_documented_range(fn, high):
    got = fn(prompts=[PROMPT] * len(CASES), completions=[c[1] for c in CASES], answer_aliases=[c[2] for c in CASES])
    assert all(0.0 <= v <= high for v in got)


GROUNDED_CASES = [  # (id, completion, expected) for the question "What is the capital of Veltria?"
    ("the_right_fact_copied", [SEARCH, tool(FOUND), answer_turn("Morvane")], 0.25),
    ("a_wrong_fact_copied_still_earns_it", [SEARCH, tool(FOUND), answer_turn("The north.")], 0.25),
    ("copied_from_the_second_result", [SEARCH, tool(NOT_FOUND), SEARCH, tool(FOUND), answer_turn("morvane")], 0.25),
    ("invented", [SEARCH, tool(FOUND), answer_turn("Paris")], 0.0),
    ("the_questions_own_entity", [SEARCH, tool(FOUND), answer_turn("Veltria")], 0.0),
    ("a_passage_is_not_an_answer", [SEARCH, tool(FOUND), answer_turn("Veltria is a country in the north")], 0.0),
    ("part_of_a_word", [SEARCH, tool(FOUND), answer_turn("Morv")], 0.0),
    ("no_search", [answer_turn("Morvane")], 0.0),
    ("only_in_an_error_message", [search(name="Morvane"), tool(error_text("unknown tool 'Morvane'"), name="Morvane"),
                                  answer_turn("Morvane")], 0.0),
    ("no_answer", [SEARCH, tool(FOUND)], 0.0),
    ("empty_answer", [SEARCH, tool(FOUND), answer_turn("  ")], 0.0),
    ("empty_completion", [], 0.0),
]


@pytest.mark.parametrize("completion, expected", [c[1:] for c in GROUNDED_CASES], ids=[c[0] for c in GROUNDED_CASES])
def test_grounded_answer_pays_for_a_short_fact_copied_from_a_result_that_the_question_does_not_name(completion,
                                                                                                    expected):
    question = PROMPT[-1]["content"]
    assert grounded_answer_reward_func(prompts=[PROMPT], completions=[completion], question=[question]) == [expected]
    # without the dataset's question column, the prompt's last user message is the question
    assert grounded_answer_reward_func(prompts=[PROMPT], completions=[completion], answer_aliases=["x"]) == [expected]


def test_grounded_answer_needs_no_gold_and_is_registered_for_recipes():
    completions = [c[1] for c in GROUNDED_CASES]
    got = get_reward_func("grounded_answer_reward_func")(prompts=[PROMPT] * len(completions), completions=completions)
    assert got == [c[2] for c in GROUNDED_CASES] and all(type(v) is float for v in got)


@pytest.mark.parametrize("fn, perfect", [
    (format_reward_func, [SEARCH, tool(FOUND), SEARCH, tool(NOT_FOUND), answer_turn("Morvane")]),
    (chat_format_reward_func, [chat_calls("Veltria", "Morvane"), tool(NOT_FOUND), tool(FOUND), chat_calls("Tifex"),
                               tool(NOT_FOUND), assistant("<answer>Morvane</answer>")]),
])
def test_format_reward_is_exactly_its_bound_for_perfect_turns(fn, perfect):
    assert fn(prompts=[PROMPT], completions=[perfect]) == [0.2]  # exactly, not approx


@pytest.mark.parametrize("text, expected", [
    ("The Cat!", "cat"),
    ("  A   quick\tbrown fox. ", "quick brown fox"),
    ("an apple a day", "apple day"),
    ("theater atheist", "theater atheist"),  # articles only as whole words
    ("Rock-n-Roll", "rocknroll"),  # SQuAD deletes punctuation, it does not split on it
    ("U.S.A.", "usa"),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# ------------------------------------------------------------------------------------------------
# Per-turn rewards: one value per tool turn
# ------------------------------------------------------------------------------------------------
# (id, completion, answer column,
#  expected: tool_execution_per_turn, answer_in_result_per_turn, repeated_query_penalty_per_turn)
PER_TURN_CASES = [
    ("no_tool_turn", [answer_turn("Morvane")], ["Morvane"], ([], [], [])),
    ("empty_completion", [], ["Morvane"], ([], [], [])),
    ("clean_search_then_answer", [SEARCH, tool(FOUND), answer_turn("Morvane")], ["Morvane"], ([0.2], [0.5], [0.0])),
    # the second query is the first one after normalisation (case, punctuation)
    ("repeated_query", [search("Veltria capital"), tool(NOT_FOUND), search("veltria Capital?"), tool(NOT_FOUND),
                        search("Morvane"), tool(FOUND), answer_turn("Morvane")], ["Morvane"],
     ([0.2, 0.2, 0.2], [0.0, 0.0, 0.5], [0.0, -0.2, 0.0])),
    # chat_template shape: one assistant message answered by two tool messages; the second turn repeats
    # the call that timed out
    ("two_calls_in_one_turn", [chat_calls("Veltria", "Morvane"), tool(NOT_FOUND), tool(TIMED_OUT),
                               chat_calls("Morvane"), tool(FOUND), assistant("<answer>Morvane</answer>")],
     ["Morvane"], ([0.1, 0.2], [0.0, 0.5], [0.0, -0.2])),
    ("same_call_twice_in_one_turn", [chat_calls("Veltria", "Veltria"), tool(FOUND), tool(FOUND)], ["Morvane"],
     ([0.2], [0.5], [-0.2])),
    ("same_query_other_tool_is_not_a_repeat", [search("Veltria"), tool(NOT_FOUND), search("Veltria", "wiki_search"),
                                               tool(FOUND, "wiki_search")], ["Morvane"],
     ([0.2, 0.2], [0.0, 0.5], [0.0, 0.0])),
    # a call that did not parse is a failed turn, and no query to repeat
    ("bad_json_turn", [SEARCH, tool(FOUND), BAD_JSON, malformed_reply(), BAD_JSON, malformed_reply(),
                       answer_turn("Morvane")], ["Morvane"], ([0.2, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0])),
    ("alias_in_error_message", [search(name="Morvane"), tool(error_text("unknown tool 'Morvane'"), name="Morvane")],
     ["Morvane"], ([0.0], [0.0], [0.0])),
    # the last call got no reply (the episode ran out of steps): not a tool turn
    ("unanswered_last_call", [SEARCH, tool(FOUND), SEARCH], ["Morvane"], ([0.2], [0.5], [0.0])),
    # a tool message before any assistant message answers nothing; None content is no error
    ("odd_messages", [None, "junk", tool(FOUND), SEARCH, {"role": "tool", "name": "search", "content": None}],
     ["Morvane"], ([0.2], [0.0], [0.0])),
]
PER_TURN_FUNCS = [tool_execution_per_turn, answer_in_result_per_turn, repeated_query_penalty_per_turn]


@pytest.mark.parametrize("completion, answer, expected", [c[1:] for c in PER_TURN_CASES],
                         ids=[c[0] for c in PER_TURN_CASES])
def test_per_turn_reward_values(completion, answer, expected):
    got = [fn(prompts=[PROMPT], completions=[completion], answer_aliases=[answer])[0] for fn in PER_TURN_FUNCS]
    assert got == [pytest.approx(values) for values in expected]


@pytest.mark.parametrize("fn, low, high", [(tool_execution_per_turn, 0.0, 0.2), (answer_in_result_per_turn, 0.0, 0.5),
                                           (repeated_query_penalty_per_turn, -0.2, 0.0)])
def test_per_turn_rewards_give_one_float_per_tool_turn_in_range(fn, low, high):
    cases = CASES + PER_TURN_CASES
    completions = [c[1] for c in cases]
    got = fn(prompts=[PROMPT] * len(cases), completions=completions, answer_aliases=[c[2] for c in cases])
    assert [len(values) for values in got] == [count_tool_turns(c) for c in completions]
    assert all(type(v) is float and low <= v <= high for values in got for v in values)


def test_per_turn_values_of_the_first_turn_are_the_first_turn_rewards():
    """exist_answer_in_search_results judges the first tool turn, as answer_in_result_per_turn does."""
    completions, answers = [c[1] for c in CASES], [c[2] for c in CASES]
    first = [values[0] if values else 0.0 for values in answer_in_result_per_turn(None, completions, answers)]
    assert first == exist_answer_in_search_results(None, completions, answers)


def test_tool_turns_pair_each_assistant_message_with_the_tool_messages_that_answer_it():
    two_calls = chat_calls("Veltria", "Morvane")
    completion = [two_calls, tool(NOT_FOUND), tool(FOUND), SEARCH, {"role": "user", "content": "hint"},
                  tool(FOUND), answer_turn("Morvane")]
    # the user message answers SEARCH (an environment's reply as the user), and so does the tool message after it:
    # every message up to the next assistant one is that reply (user_turns.Reply.messages may hold several)
    assert tool_turns(completion) == [(two_calls, [tool(NOT_FOUND), tool(FOUND)]), (SEARCH, [tool(FOUND)])]
    assert tool_turns([SEARCH, {"role": "system", "content": "round 2"}, {"role": "user", "content": "hint"}]) == \
        [(SEARCH, [])]  # a reply of a system and a user message: one turn, no tool message
    assert count_tool_turns(completion) == 2
    assert tool_turns(None) == [] and count_tool_turns([answer_turn("Morvane")]) == 0


def test_per_turn_marks_a_function_and_the_registry_keeps_the_mark():
    def plain(prompts, completions, **kwargs):
        return [0.0 for _ in completions]

    marked = per_tool_turn(lambda prompts, completions, **kwargs: [[] for _ in completions])
    assert marked.per_tool_turn is True and is_per_tool_turn(marked) and not is_per_tool_turn(plain)
    with pytest.raises(TypeError, match="now @per_tool_turn"):  # the old name of the mark
        per_turn(plain)
    assert {name for name, fn in REWARD_FUNCS.items() if is_per_tool_turn(fn)} == {
        "tool_execution_per_turn", "answer_in_result_per_turn", "repeated_query_penalty_per_turn", "tool_rewards"}
    assert is_per_tool_turn(get_reward_func("mt_grpo.rewards.triviaqa_reward:repeated_query_penalty_per_turn"))
    assert is_per_tool_turn(get_reward_func("reward_examples:one_per_tool_turn"))


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------
def test_registry_holds_the_default_turn_and_outcome_functions_and_the_old_names():
    assert list(REWARD_FUNCS.values()) == TURN_REWARD_FUNCS + OUTCOME_REWARD_FUNCS + RENAMED_REWARD_FUNCS + [
        REWARD_FUNCS["tool_rewards"]]  # any task's: a tool's (output, reward) step rewards (tools.tool_output)


def test_answer_in_tool_result_keeps_its_old_name():
    """Both names resolve; the old one is its own function so that a recipe naming it logs the metric names
    it always did (`rewards/turn/exist_answer_in_search_results`), with the same values."""
    new, old = get_reward_func("answer_in_tool_result"), get_reward_func("exist_answer_in_search_results")
    assert new is answer_in_tool_result and old is exist_answer_in_search_results
    assert (new.__name__, old.__name__) == ("answer_in_tool_result", "exist_answer_in_search_results")
    completions, answers_ = [c[1] for c in CASES], [c[2] for c in CASES]
    expected = [c[3][1] for c in CASES]
    assert new(None, completions, answers_) == old(None, completions, answers_) == expected
    # the answer_type column reaches the new function through the old name: "text" compares SQuAD text
    in_reply = [[SEARCH, tool("There were 35 apples."), answer_turn("35")]]
    assert old(None, in_reply, [["3.5"]]) == [0.0] and old(None, in_reply, [["3.5"]], answer_type=["text"]) == [0.5]


@pytest.mark.parametrize("name", sorted(REWARD_FUNCS))
def test_every_registry_name_resolves_to_its_function(name):
    fn = get_reward_func(name)
    assert fn is REWARD_FUNCS[name] and fn.__name__ == name


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError) as e:
        get_reward_func("exact_match")
    message = str(e.value)
    assert "'exact_match'" in message and "module:function" in message
    assert all(name in message for name in REWARD_FUNCS)


def test_importing_the_adapters_changes_no_other_module():
    """Other frameworks' reward names and forms are the adapters' own lookup (adapters.resolve_reward): importing
    the adapters rebinds, adds to or removes from no global of a module loaded before them (rewards/ included)."""
    import subprocess
    import sys

    from helpers import ROOT

    code = """
import sys
import mt_grpo.base.registry, mt_grpo.rewards, mt_grpo.rewards.judge, mt_grpo.tasks, mt_grpo.tools

def state():
    sized = (list, dict, set, tuple)
    return {(name, key): (id(value), len(value) if isinstance(value, sized) else None)
            for name, module in list(sys.modules.items()) if name.startswith("mt_grpo")
            for key, value in vars(module).items()}

before = state()
import mt_grpo.adapters, mt_grpo.adapters.swift, mt_grpo.adapters.verl
after = state()
print(sorted(f"{name}.{key}" for name, key in before if after.get((name, key)) != before[name, key]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_adapters_lookup_adds_another_frameworks_form():
    """rewards.get_reward_func gives a function as it is found; adapters.resolve_reward gives it as the trainer
    calls it: a verl compute_score wrapped, a function of ours, by name or as is, unchanged."""
    from mt_grpo.adapters import resolve_reward

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    wrapped = resolve_reward(compute_score)
    assert wrapped is not compute_score and wrapped.verl_compute_score is compute_score
    assert resolve_reward("exact_match_reward_func") is exact_match_reward_func is get_reward_func(
        "exact_match_reward_func")
    assert resolve_reward(exact_match_reward_func) is exact_match_reward_func
    with pytest.raises(ValueError, match="Unknown reward function 'exact_match'"):
        resolve_reward("exact_match")


@pytest.mark.parametrize("path", ["mt_grpo.rewards.triviaqa_reward:exact_match_reward_func",
                                  "mt_grpo.rewards.triviaqa_reward.exact_match_reward_func",
                                  # the path of before mt_grpo/, with a warning (tests/test_tools.py: the old paths)
                                  "rewards.triviaqa_reward:exact_match_reward_func"])
def test_dotted_paths_resolve(path):
    assert get_reward_func(path) is exact_match_reward_func


@pytest.mark.parametrize("path, why", [
    ("no_such_package.rewards:my_reward", "cannot import module 'no_such_package.rewards'"),
    ("no_such_package.rewards.my_reward", "cannot import module 'no_such_package.rewards'"),
    ("mt_grpo.rewards.triviaqa_reward:no_such_reward", "has no attribute 'no_such_reward'"),
    ("mt_grpo.rewards.triviaqa_reward.no_such_reward", "has no attribute 'no_such_reward'"),
    ("mt_grpo.rewards.triviaqa_reward:TURN_REWARD_FUNCS", "is a list, not a function"),
    ("mt_grpo.rewards.triviaqa_reward:", "must look like `module:function`"),
    (":exact_match_reward_func", "must look like `module:function`"),
])
def test_bad_dotted_path_says_what_is_wrong(path, why):
    with pytest.raises(ValueError) as e:
        get_reward_func(path)
    assert why in str(e.value) and path in str(e.value)


def test_asking_for_more_documents_does_not_raise_the_turn_reward():
    """The answer in the 4th document (a search with num_results 4 or more) earns nothing: the turn
    rewards judge what a default search (3 documents) returns, so only a better query pays."""
    docs = ["Aland: a place.", "Borva: a river.", "Cendra: a town.", "Veltria: its capital is Morvane."]
    fourth = [SEARCH, tool("\n\n".join(docs)), answer_turn("Morvane")]
    third = [SEARCH, tool("\n\n".join(docs[1:])), answer_turn("Morvane")]
    for fn in (exist_answer_in_search_results, lambda p, c, a: [v[0] for v in answer_in_result_per_turn(p, c, a)]):
        assert fn(None, [fourth, third], [["Morvane"], ["Morvane"]]) == [0.0, 0.5]


def test_trls_failed_call_reply_is_a_failed_call():
    """TRL's tool loop answers a call that raised with `str({"error": ...})`, not our ERROR_PREFIX: the rewards
    judge TRL's conversations (studies/peer_trl.py) as ours, so such a call earns no execution credit and its
    message is no search result, while a tool that returns a dict of its own still ran."""
    from mt_grpo.rewards.conversation import failed

    raised = tool(str({"error": "search() got an unexpected keyword argument 'q'"}))
    quoted = tool(str({"error": "Morvane isn't a query"}))  # repr switches to double quotes
    assert failed(raised) and failed(quoted)
    assert not failed(tool(str({"error": "x", "hits": 3}))) and not failed(tool("{'error': broken"))
    assert not failed(tool(FOUND))
    found_then_raised = [[SEARCH, tool(FOUND), SEARCH, raised, answer_turn("Morvane")]]
    assert tool_execution_reward_func(None, found_then_raised) == [pytest.approx(0.1)]
    assert exist_answer_in_search_results(None, [[SEARCH, tool(str({"error": FOUND})), answer_turn("Morvane")]],
                                          answer_aliases=[["Morvane"]]) == [0.0]


# ------------------------------------------------------------------------------------------------
# Answer matching: the answer_type column (rewards/answers.py)
# ------------------------------------------------------------------------------------------------
# (id, final answer, answer column, answer_type, expected: exact_match, exist_answer)
ANSWER_TYPE_CASES = [
    # SQuAD normalisation deletes the "." and the "-": "35" was exactly "3.5", and "-4" was "4"
    ("a_decimal_point_matters", "35", ["3.5"], "auto", (0.0, 0.0)),
    ("the_sign_matters", "-4", ["4"], "auto", (0.0, 0.0)),
    ("the_sign_matters_the_other_way", "4", ["-4"], None, (0.0, 0.0)),
    ("typographic_minus", "\u22124", ["-4"], "auto", (1.0, 0.5)),
    ("a_float_equals_its_integer", "308.0", ["308"], "auto", (1.0, 0.5)),
    ("thousands_separator", "1,000", ["1000"], "auto", (1.0, 0.5)),
    ("thousands_separator_in_the_gold", "1000", ["1,000"], "auto", (1.0, 0.5)),
    ("a_final_full_stop", "308.", ["308"], "auto", (1.0, 0.5)),
    ("fraction_and_decimal", "1/2", ["0.5"], "auto", (1.0, 0.5)),
    ("latex_fraction_and_decimal", r"\frac{1}{2}", ["0.5"], "auto", (1.0, 0.5)),
    ("decimal_and_latex_gold", "0.5", [r"\frac{1}{2}"], "auto", (1.0, 0.5)),
    ("delimited_latex_and_fraction", r"$\frac{1}{2}$", ["1/2"], "auto", (1.0, 0.5)),
    ("three_quarters", "3/4", ["0.75"], "auto", (1.0, 0.5)),
    ("three_quarters_the_other_way", "0.75", ["3/4"], "math", (1.0, 0.5)),
    ("boxed", r"\boxed{7}", ["7"], "auto", (1.0, 0.5)),
    ("a_number_among_words_is_contained_not_exact", "about 1,000 apples", ["1000"], "auto", (0.0, 0.5)),
    ("a_year_with_an_era_is_not_exactly_the_year", "1289 BC", ["1289"], "auto", (0.0, 0.5)),
    ("leading_zeros_are_a_code_not_a_number", "7", ["007"], "auto", (0.0, 0.0)),
    # words stay text under auto, exactly as before
    ("text_answer_unchanged", "the Tifex River", ["Tifex River", "Tifex"], "auto", (1.0, 0.5)),
    ("text_answer_unchanged_by_default", "Tifex River", ["the Tifex River"], None, (1.0, 0.5)),
    ("text_answer_contained", "the Tifex River", ["Tifex"], "auto", (0.0, 0.5)),
    ("text_and_number_aliases", "73,000,000", ["73 million", "73000000"], "auto", (1.0, 0.5)),
    ("a_backslash_among_words_is_text", "ACDC", [r"AC\DC"], "auto", (1.0, 0.5)),
    ("latex_words_are_text", r"$\text{12 apples}$", [r"$\text{12 apples}$"], "auto", (1.0, 0.5)),
    # "text" keeps the old behaviour, numbers included
    ("text_mode_float_is_not_its_integer", "308.0", ["308"], "text", (0.0, 0.0)),
    ("text_mode_keeps_the_old_decimal_point", "35", ["3.5"], "text", (1.0, 0.5)),
    ("text_mode_words", "the Tifex River", ["Tifex River"], "text", (1.0, 0.5)),
    # "math" parses every alias with math_verify, words and all
    ("math_mode_parses_a_gold_with_words", "12", ["12 apples"], "math", (1.0, 0.5)),
    ("auto_keeps_that_gold_as_text", "12", ["12 apples"], "auto", (0.0, 0.0)),
    ("math_mode_gold_that_does_not_parse_is_text", "Paris", ["Paris"], "math", (1.0, 0.5)),
    # a gold alias (trusted) may hold a power; a prediction may not: sympy would compute 10^(10^10) for minutes
    ("a_power_in_the_gold", "1024", ["$2^{10}$"], "auto", (1.0, 0.5)),
    ("no_power_in_the_prediction", "$2^{10}$", ["1024"], "auto", (0.0, 0.0)),
    ("a_huge_power_is_not_computed", r"$10^{10^{10}}$", ["5"], "auto", (0.0, 0.0)),
]


@pytest.mark.parametrize("final, answer, answer_type, expected", [c[1:] for c in ANSWER_TYPE_CASES],
                         ids=[c[0] for c in ANSWER_TYPE_CASES])
def test_answer_type_decides_how_the_final_answer_compares(final, answer, answer_type, expected):
    completion, column = [answer_turn(final)], [answer_type]
    got = [fn(prompts=[PROMPT], completions=[completion], answer_aliases=[answer], answer_type=column)[0]
           for fn in (exact_match_reward_func, exist_answer_reward_func)]
    assert got == list(expected)
    assert matches_answer(final, answer, answer_type) is (expected[0] == 1.0)


# (id, tool reply, answer column, answer_type, expected: answer_in_tool_result, answer_in_result_per_turn)
TOOL_REPLY_CASES = [
    ("a_number_with_a_separator_in_a_sentence", "The total is 1,000 apples.", ["1000"], "auto", 0.5),
    ("35_does_not_hold_3_5", "There were 35 apples.", ["3.5"], "auto", 0.0),
    ("35_held_3_5_as_text", "There were 35 apples.", ["3.5"], "text", 0.5),
    ("a_decimal_among_other_numbers", "Of 12 trials, 3.5 hours each, 7 failed.", ["3.5"], None, 0.5),
    ("a_version_or_a_date_is_no_number", "Version 3.5.1 came out on 1/2/2020.", ["3.5"], "auto", 0.0),
    ("a_date_is_no_fraction", "Version 3.5.1 came out on 1/2/2020.", ["0.5"], "auto", 0.0),
    ("a_negative_number", "It fell to -4 degrees.", ["-4"], "auto", 0.5),
    ("a_negative_number_does_not_hold_its_value", "It fell to -4 degrees.", ["4"], "auto", 0.0),
    ("a_range_holds_its_ends", "Pages 10-14 tell it.", ["14"], "auto", 0.5),
    ("a_decade_is_not_its_year", "It was built in the 1990s.", ["1990"], "auto", 0.0),
    ("latex_in_the_reply", r"Exactly half: $\frac{1}{2}$ of them.", ["0.5"], "auto", 0.5),
    ("money_is_not_latex", "It cost $5 and $10.", ["5"], "auto", 0.5),
    ("a_year", "Tessa Varn was born in 1289 in Veltria.", ["1289"], "auto", 0.5),
    ("words_as_before", FOUND, ["Morvane"], "auto", 0.5),
]


@pytest.mark.parametrize("reply, answer, answer_type, expected", [c[1:] for c in TOOL_REPLY_CASES],
                         ids=[c[0] for c in TOOL_REPLY_CASES])
def test_answer_type_decides_whether_the_tool_reply_holds_the_answer(reply, answer, answer_type, expected):
    completion = [SEARCH, tool(reply), SEARCH, tool(NOT_FOUND), answer_turn("x")]
    kwargs = dict(prompts=[PROMPT], completions=[completion], answer_aliases=[answer], answer_type=[answer_type])
    assert answer_in_tool_result(**kwargs) == [expected]
    assert answer_in_result_per_turn(**kwargs) == [[expected, 0.0]]
    assert contains_answer(reply, answer, answer_type) is (expected == 0.5)


def test_answer_type_is_read_per_row():
    completions = [[answer_turn("35")]] * 3
    got = exact_match_reward_func(None, completions, [["3.5"]] * 3, answer_type=["text", "auto", None])
    assert got == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("fn", [exact_match_reward_func, exist_answer_reward_func, answer_in_tool_result,
                                exist_answer_in_search_results, answer_in_result_per_turn])
def test_an_unknown_answer_type_names_the_allowed_ones(fn):
    with pytest.raises(ValueError) as e:
        fn(None, [[SEARCH, tool(FOUND), answer_turn("Morvane")]], [["Morvane"]], answer_type=["number"])
    assert "'number'" in str(e.value) and all(repr(t) in str(e.value) for t in ANSWER_TYPES)
    with pytest.raises(ValueError, match="2 values for 1 samples"):
        fn(None, [[answer_turn("Morvane")]], [["Morvane"]], answer_type=["auto", "text"])


def test_math_answers_compare_in_a_worker_thread():
    """math_verify's default timeouts use signal.alarm, which fails outside the main thread; the async
    rollout thread scores rewards. The caches are emptied so that math_verify really runs in the thread."""
    answers._parse.cache_clear()
    answers._equal.cache_clear()
    answers._gold_is_math.cache_clear()

    def score():
        finals = [[answer_turn("2.25")], [answer_turn("9/4 of it")], [answer_turn("22.5")], [answer_turn("Tifex")]]
        golds = [["9/4"], [r"\frac{9}{4}"], ["2.25"], ["Tifex River", "Tifex"]]
        return (exact_match_reward_func(None, finals, golds), exist_answer_reward_func(None, finals, golds),
                answer_in_tool_result(None, [[SEARCH, tool("It weighs 4,096 kg."), answer_turn("x")]], [["4096"]]))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        exact, exist, found = pool.submit(score).result(timeout=300)
    assert exact == [1.0, 0.0, 0.0, 1.0] and exist == [0.5, 0.5, 0.0, 0.5] and found == [0.5]


def test_a_log_rows_three_turn_averages_are_the_guides():
    """Issue 78, point 14 (docs/guide.md, "What a log row's turn averages are"): one turn function `steps` of weight
    0.5, episode A scored on three turns (1, 0, 0.5), B on one (1). `rewards/turn/steps` is its mean over the
    (episode, turn) pairs, 2.5 / 4; `rewards/turn/mean` the mean of R_T (the weighted sum) over the same pairs,
    1.25 / 4; TRL's `rewards/steps/mean` the mean over episodes of each one's own mean, (0.5 + 1) / 2."""
    import torch

    from mt_grpo.run.reporting import EPISODE_STATS, per_sample_rewards, reward_metrics, trl_metrics
    from mt_grpo_trainer import Scores

    def steps(prompts, completions, **kwargs):
        return None

    nan = float("nan")
    per_turn = torch.tensor([[[1.0, 0.0, 0.5]], [[1.0, nan, nan]]])  # (B, F_turn, K)
    scores = Scores(turn_per_func=per_turn, outcome_per_func=torch.zeros(2, 0), R_T=0.5 * per_turn[:, 0],
                    R_O=torch.zeros(2))
    ours = reward_metrics(scores, torch.tensor([True]), [steps], [])
    trl = trl_metrics(torch.zeros(2, len(EPISODE_STATS)), per_sample_rewards(scores), torch.tensor([0.5]), ["steps"],
                      group_size=2, scale_rewards="group", tools=False)
    assert ours["rewards/turn/steps"] == pytest.approx(0.625) and ours["rewards/turn/mean"] == pytest.approx(0.3125)
    assert trl["rewards/steps/mean"] == pytest.approx(0.75) and trl["reward"] == pytest.approx(0.375)
