"""Reward functions on hand-written conversations, with the exact values each should give, and the
registry that resolves recipe names and dotted paths."""

import pytest

from rewards import REWARD_FUNCS, get_reward_func
from rewards.triviaqa_reward import (
    OUTCOME_REWARD_FUNCS,
    TURN_REWARD_FUNCS,
    exact_match_reward_func,
    exist_answer_in_search_results,
    exist_answer_reward_func,
    format_reward_func,
    normalize_answer,
    tool_execution_reward_func,
)

PROMPT = [{"role": "system", "content": "You answer questions."},
          {"role": "user", "content": "What is the capital of Veltria?"}]
SEARCH = ('<reasoning>I should look it up.</reasoning>\n'
          '<tool>{"name": "search", "args": {"query": "Veltria capital"}}</tool>')
FOUND = "Veltria: Veltria is a country in the north. Its capital is Morvane."
NOT_FOUND = "Veltria: Veltria is a country in the north."


def assistant(text):
    return {"role": "assistant", "content": text}


def result(text):
    return {"role": "user", "content": f"<result>\n{text}\n</result>"}


def answer_turn(text):
    return assistant(f"<reasoning>The result says so.</reasoning>\n<answer>{text}</answer>")


# (id, completion, answer column, expected: tool_execution, exist_in_search, exact_match, exist_answer, format)
CASES = [
    ("clean_search_then_answer", [assistant(SEARCH), result(FOUND), answer_turn("Morvane")], ["Morvane"],
     (0.2, 0.5, 1.0, 0.5, 0.2)),
    ("failed_tool_call", [assistant(SEARCH), result("Error: unknown tool 'serch'; available tools: ['search']"),
                          answer_turn("Morvane")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2)),
    ("two_calls_first_fails", [assistant(SEARCH), result("Error: tool 'search' timed out after 10s"), assistant(SEARCH),
                               result(FOUND), answer_turn("Paris")], ["Morvane"],
     (0.1, 0.0, 0.0, 0.0, 0.2)),
    # 0.2 * 3 / 3 rounds above 0.2 in floats; the reward must not
    ("three_successful_calls", [assistant(SEARCH), result(FOUND), assistant(SEARCH), result(FOUND), assistant(SEARCH),
                                result(FOUND), answer_turn("Morvane")], ["Morvane"],
     (0.2, 0.5, 1.0, 0.5, 0.2)),
    ("alias_only_in_second_result", [assistant(SEARCH), result(NOT_FOUND), assistant(SEARCH), result(FOUND),
                                     answer_turn("Morvane")], ["Morvane"],
     (0.2, 0.0, 1.0, 0.5, 0.2)),
    ("no_tool_call", [answer_turn("Morvane")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2)),
    ("case_punctuation_articles", [answer_turn("  the BEATLES!! ")], ["The Beatles"],
     (0.0, 0.0, 1.0, 0.5, 0.2)),
    ("answer_contains_alias", [assistant(SEARCH), result(FOUND), answer_turn("the city of Morvane")], ["Morvane"],
     (0.2, 0.5, 0.0, 0.5, 0.2)),
    ("alias_inside_a_longer_word_is_not_found", [answer_turn("party")], ["art"],
     (0.0, 0.0, 0.0, 0.0, 0.2)),
    ("second_alias_matches", [answer_turn("JFK")], ["John F. Kennedy", "jfk"],
     (0.0, 0.0, 1.0, 0.5, 0.2)),
    # second turn: no fields (0), starts with <reasoning> (0.3), no closing action (0) -> mean (1 + 0.3) / 2
    ("truncated_last_turn", [assistant(SEARCH), result(FOUND), assistant("<reasoning>The result says the cap")],
     ["Morvane"], (0.2, 0.5, 0.0, 0.0, 0.2 * 0.65)),
    # each turn only starts with <reasoning>: 0.3; the env answered the unclosed tool tag with an error
    ("malformed_tags", [assistant('<reasoning>look it up<tool>{"name": "search"'),
                        result("Error: unbalanced <tool>: write <tool>{...}</tool> or <answer>...</answer>"),
                        assistant("<reasoning>so <answer>Morvane")], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.2 * 0.3)),
    ("mismatched_tags", [assistant("<answer>Morvane</reasoning></answer>")], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.2 * 0.5)),  # the answer field (0.2) and the closing tag (0.3)
    # a malformed call (bad JSON) is a tool call the env ran and failed: 1 of 2 succeeded
    ("good_call_then_bad_json", [assistant(SEARCH), result(FOUND),
                                 assistant("<reasoning>more</reasoning>\n<tool>{name: x}</tool>"),
                                 result("Error: the text inside <tool></tool> is not valid JSON"),
                                 answer_turn("Morvane")],
     ["Morvane"], (0.1, 0.5, 1.0, 0.5, 0.2)),
    ("last_answer_in_turn_counts",
     [assistant("<reasoning>r</reasoning><answer>Paris</answer><answer>Morvane</answer>")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2)),
    ("answer_from_last_turn_that_has_one", [answer_turn("Morvane"), assistant("<reasoning>hm")], ["Morvane"],
     (0.0, 0.0, 1.0, 0.5, 0.2 * 0.65)),
    ("plain_text_no_tags", [assistant("Morvane")], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.0)),
    ("empty_and_none_content", [assistant(""), {"role": "assistant", "content": None}, {"role": "user"}], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.0)),
    ("empty_completion", [], ["Morvane"],
     (0.0, 0.0, 0.0, 0.0, 0.0)),
    ("answer_column_is_a_string", [assistant(SEARCH), result(FOUND), answer_turn("Morvane")], "Morvane",
     (0.2, 0.5, 1.0, 0.5, 0.2)),
    # an empty alias must not match every text, nor an empty answer
    ("empty_alias_ignored", [assistant(SEARCH), result(NOT_FOUND), answer_turn("Paris")], ["", "Morvane"],
     (0.2, 0.0, 0.0, 0.0, 0.2)),
    ("empty_answer_and_only_empty_alias", [assistant(SEARCH), result(FOUND), answer_turn("")], ["", " "],
     (0.2, 0.0, 0.0, 0.0, 0.2)),
    # the answer hidden in an error message (here a tool name) is not a search result
    ("alias_in_error_message", [assistant(SEARCH), result("Error: unknown tool 'Morvane'"), answer_turn("x")],
     ["Morvane"], (0.0, 0.0, 0.0, 0.0, 0.2)),
]
FUNCS = [tool_execution_reward_func, exist_answer_in_search_results, exact_match_reward_func, exist_answer_reward_func,
         format_reward_func]


@pytest.mark.parametrize("completion, answer, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_reward_values(completion, answer, expected):
    got = [fn(prompts=[PROMPT], completions=[completion], answer=[answer])[0] for fn in FUNCS]
    assert got == pytest.approx(list(expected))


def test_whole_table_as_one_batch_gives_the_same_values_and_ignores_unknown_columns():
    completions, answers = [c[1] for c in CASES], [c[2] for c in CASES]
    for f, fn in enumerate(FUNCS):
        got = fn(prompts=[PROMPT] * len(CASES), completions=completions, answer=answers,
                 question=["What is the capital of Veltria?"] * len(CASES), task=["triviaqa"] * len(CASES))
        assert got == pytest.approx([c[3][f] for c in CASES]), fn.__name__
        assert all(type(v) is float for v in got), fn.__name__


@pytest.mark.parametrize("fn, high", [(tool_execution_reward_func, 0.2), (exist_answer_in_search_results, 0.5),
                                      (exact_match_reward_func, 1.0), (exist_answer_reward_func, 0.5),
                                      (format_reward_func, 0.2)])
def test_rewards_stay_within_their_documented_range(fn, high):
    got = fn(prompts=[PROMPT] * len(CASES), completions=[c[1] for c in CASES], answer=[c[2] for c in CASES])
    assert all(0.0 <= v <= high for v in got)


def test_format_reward_is_exactly_its_bound_for_perfect_turns():
    perfect = [assistant(SEARCH), result(FOUND), assistant(SEARCH), result(NOT_FOUND), answer_turn("Morvane")]
    assert format_reward_func(prompts=[PROMPT], completions=[perfect]) == [0.2]  # exactly, not approx


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
# Registry
# ------------------------------------------------------------------------------------------------
def test_registry_holds_the_default_turn_and_outcome_functions():
    assert list(REWARD_FUNCS.values()) == TURN_REWARD_FUNCS + OUTCOME_REWARD_FUNCS


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


@pytest.mark.parametrize("path", ["rewards.triviaqa_reward:exact_match_reward_func",
                                  "rewards.triviaqa_reward.exact_match_reward_func"])
def test_dotted_paths_resolve(path):
    assert get_reward_func(path) is exact_match_reward_func


@pytest.mark.parametrize("path, why", [
    ("no_such_package.rewards:my_reward", "cannot import module 'no_such_package.rewards'"),
    ("no_such_package.rewards.my_reward", "cannot import module 'no_such_package.rewards'"),
    ("rewards.triviaqa_reward:no_such_reward", "has no attribute 'no_such_reward'"),
    ("rewards.triviaqa_reward.no_such_reward", "has no attribute 'no_such_reward'"),
    ("rewards.triviaqa_reward:TURN_REWARD_FUNCS", "is a list, not a function"),
    ("rewards.triviaqa_reward:", "must look like `module:function`"),
    (":exact_match_reward_func", "must look like `module:function`"),
])
def test_bad_dotted_path_says_what_is_wrong(path, why):
    with pytest.raises(ValueError) as e:
        get_reward_func(path)
    assert why in str(e.value) and path in str(e.value)
