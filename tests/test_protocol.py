"""The tool protocols: parsing model turns, tool schemas, and what Qwen2.5's and Qwen3's real chat templates
render for a tool episode: the prompt, the environment's replies, and the full re-render the env checks.

The rollout is rebuilt here as the env builds it: the prompt rendered with a generation prompt, each sampled
turn's text, and after a tool turn the reply rendered from a fixed base conversation
`[system, user, assistant SENTINEL] + tool messages` (the text after the SENTINEL).
"""

import pytest

from helpers import EMPTY_THINK, chat_template, template_call
from protocol import (ChatTemplateProtocol, Turn, XMLProtocol, get_protocol, tool_call_message,
                      tool_schemas)

CT = ChatTemplateProtocol()
CORPUS = [{"title": "Veltria", "text": "Veltria is a country. Its capital is Morvane."},
          {"title": "Quorvath", "text": "Quorvath is a city founded in 1740."}]
SENTINEL = "<<SENTINEL>>"


@pytest.fixture(scope="module")
def qwen3_style_tokenizer(tiny_model_dir):
    """The tiny tokenizer with Qwen3's chat template (thinking switch, <think> handling, tool branches)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the `chat_template` of Qwen/Qwen3-8B's tokenizer_config.json, copied byte for byte from trl 1.16.0's
    # trl/chat_templates/qwen3.jinja, TRL's copy of the original Qwen3 template, which it compares for identity
    # with a loaded tokenizer's template to recognise Qwen3. (Our Qwen2.5 fixture is likewise identical to TRL's
    # qwen2_5.jinja.)
    tokenizer.chat_template = chat_template("qwen3")
    return tokenizer


@pytest.fixture(scope="module")
def search():
    from tools.search import make_search_tool

    return make_search_tool(CORPUS)


# ------------------------------------------------------------------------------------------------
# parsing
# ------------------------------------------------------------------------------------------------
# (id, text, answer, [(name, arguments, malformed)])
PARSE_CASES = [
    ("one call", "I look it up.\n" + template_call(), None, [("search", {"query": "capital of Veltria"}, False)]),
    ("two calls", template_call() + "\n" + template_call("Quorvath founded"), None,
     [("search", {"query": "capital of Veltria"}, False), ("search", {"query": "Quorvath founded"}, False)]),
    ("arguments as a JSON string", '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"Veltria\\"}"}\n'
     "</tool_call>", None, [("search", {"query": "Veltria"}, False)]),
    ("no arguments", '<tool_call>{"name": "search"}</tool_call>', None, [("search", {}, False)]),
    ("bad JSON", '<tool_call>\n{"name": "search", "arguments": {"query": }}\n</tool_call>', None, [("", {}, True)]),
    ("bad JSON after a good call", template_call() + '\n<tool_call>{"name": "search", </tool_call>', None,
     [("search", {"query": "capital of Veltria"}, False), ("", {}, True)]),
    ("missing name", '<tool_call>\n{"arguments": {"query": "Veltria"}}\n</tool_call>', None, [("", {}, True)]),
    ("arguments not an object", '<tool_call>{"name": "search", "arguments": ["Veltria"]}</tool_call>', None,
     [("search", {}, True)]),
    ("arguments a string of no JSON", '<tool_call>{"name": "search", "arguments": "Veltria"}</tool_call>', None,
     [("search", {}, True)]),
    ("unclosed block", '<tool_call>\n{"name": "search", "arguments": {"query": "Veltria"}}', None,
     [("search", {}, True)]),
    ("unclosed block, then a call", '<tool_call>\n{"name": "sea' + template_call(), None,
     [("", {}, True), ("search", {"query": "capital of Veltria"}, False)]),
    ("closing tag alone", '{"name": "search", "arguments": {}}\n</tool_call>', None, [("", {}, True)]),
    ("answer", "The result says Morvane.\n<answer>Morvane</answer>", "Morvane", []),
    ("answer with calls", template_call() + "\n<answer>Morvane</answer>", "Morvane", []),
    ("unclosed answer", "<answer>Morvane", None, [("", {}, True)]),
    ("plain text", "I do not know.", None, []),
    ("reasoning, then a call", "<think>\nI look it up; the <answer> comes later.\n</think>\n\n" + template_call(), None,
     [("search", {"query": "capital of Veltria"}, False)]),
    ("a call inside the reasoning only", "<think>\nMaybe " + template_call() + "\n</think>\n\nI know it.", None, []),
]
# transformers' response parsing differs on these: it takes an unclosed block at the end as a call, fails the
# whole turn on one block that is not JSON, and leaves a closing tag alone as plain text.
NOT_AS_RESPONSE_TEMPLATE = {"bad JSON after a good call", "unclosed block", "unclosed block, then a call",
                            "closing tag alone"}


def summary(turn: Turn):
    return turn.answer, [(c.name, c.arguments, bool(c.error)) for c in turn.calls]


@pytest.mark.parametrize("text,answer,calls", [c[1:] for c in PARSE_CASES], ids=[c[0] for c in PARSE_CASES])
def test_chat_template_parse(text, answer, calls):
    assert summary(CT.parse(text)) == (answer, calls)


@pytest.fixture(scope="module")
def response_template_tokenizer(tiny_model_dir):
    """A tokenizer that defines transformers' response parsing: TRL's response template for Qwen3."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.response_template = qwen3_template
    return tokenizer


SHARED_CASES = [c for c in PARSE_CASES if c[0] not in NOT_AS_RESPONSE_TEMPLATE]


@pytest.mark.parametrize("text,answer,calls", [c[1:] for c in SHARED_CASES], ids=[c[0] for c in SHARED_CASES])
def test_parse_with_response_template_agrees(response_template_tokenizer, text, answer, calls):
    protocol = get_protocol("chat_template", tokenizer=response_template_tokenizer)
    assert protocol.response_parser is response_template_tokenizer
    assert summary(protocol.parse(text)) == (answer, calls)


MALFORMED = {
    XMLProtocol: [
        '<tool>{"name": "search", "args": {"query": </tool>',
        '<tool>["search"]</tool>',
        '<tool>{"name": "search", "args": "Veltria"}</tool>',
        '<reasoning>x</reasoning>\n<tool>{"name": "search", "args": {"query": "Veltria"}}',
        '{"name": "search", "args": {}}</tool>',
        "<answer>Morvane",
        "Morvane</answer>",
    ],
    ChatTemplateProtocol: [c[1] for c in PARSE_CASES if any(malformed for *_, malformed in c[3])],
}


@pytest.mark.parametrize("cls", [XMLProtocol, ChatTemplateProtocol])
def test_error_messages_never_quote_a_tag(cls):
    """A small model copies the error text into its next turn, where a copied tag would act."""
    tags = XMLProtocol.TAGS + ChatTemplateProtocol.TAGS
    for text in MALFORMED[cls]:
        errors = [c.error for c in cls().parse(text).calls if c.error]
        assert errors, text
        for error in errors:
            assert not [tag for tag in tags if tag in error], (text, error)


def test_registry_and_stop_strings():
    protocol = get_protocol("chat_template")
    assert isinstance(protocol, ChatTemplateProtocol) and protocol.stop_strings == []
    assert protocol.response_parser is None  # no tokenizer: the hermes parser
    with pytest.raises(ValueError, match="chat_template"):
        get_protocol("json")


# ------------------------------------------------------------------------------------------------
# tool schemas
# ------------------------------------------------------------------------------------------------
def test_repo_tools_give_schemas(search):
    from tools.wiki_search import wiki_search

    schemas = CT.template_tools([search, wiki_search])
    assert [s["function"]["name"] for s in schemas] == ["search", "wiki_search"]
    for s in schemas:
        parameters = s["function"]["parameters"]
        assert parameters["properties"]["query"]["type"] == "string"
        assert parameters["properties"]["num_results"]["type"] == "integer"
        assert parameters["required"] == ["query"]
        assert s["function"]["description"] and all(p["description"] for p in parameters["properties"].values())


def no_docstring(query: str) -> str:
    return query


def untyped(query):
    """Look something up.

    Args:
        query: words to look up.
    """


def undocumented_argument(query: str, limit: int = 3) -> str:
    """Look something up.

    Args:
        query: words to look up.
    """


@pytest.mark.parametrize("tool,problem", [(no_docstring, "no docstring"), (untyped, "missing a type hint"),
                                          (undocumented_argument, "no description for the argument 'limit'")])
def test_a_tool_that_gives_no_schema_fails_naming_it(search, tool, problem):
    with pytest.raises(ValueError, match=f"Tool '{tool.__name__}'") as e:
        tool_schemas([search, tool])
    assert problem in str(e.value) and "type hint" in str(e.value) and "Args:" in str(e.value)


# ------------------------------------------------------------------------------------------------
# rendering through Qwen2.5's and Qwen3's real templates
# ------------------------------------------------------------------------------------------------
def render(tokenizer, messages, tools, add_generation_prompt, **chat_template_kwargs) -> str:
    return tokenizer.apply_chat_template(CT.template_messages(messages), tools=CT.template_tools(tools),
                                         tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **chat_template_kwargs)


def reply_text(tokenizer, tool_messages, tools, **chat_template_kwargs) -> str:
    """What follows a tool turn: the text after the SENTINEL of a fixed base conversation."""
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": SENTINEL}]
    text = render(tokenizer, base + tool_messages, tools, add_generation_prompt=True, **chat_template_kwargs)
    return text.split(SENTINEL, 1)[1]


def rollout_segments(tokenizer, prompt, completion, tools, **chat_template_kwargs) -> list[str]:
    """The episode's texts as the env builds them: the prompt, then each sampled turn and what follows it.
    The <|im_end|> the model samples to end a turn is counted here as the first text of what follows."""
    segments = [render(tokenizer, prompt, tools, add_generation_prompt=True, **chat_template_kwargs)]
    for i, m in enumerate(completion):
        if m["role"] == "assistant":
            segments.append(m["content"])
            tool_messages = []
            for later in completion[i + 1:]:
                if later["role"] != "tool":
                    break
                tool_messages.append(later)
            segments.append(reply_text(tokenizer, tool_messages, tools, **chat_template_kwargs)
                            if tool_messages else "<|im_end|>\n")
    return segments


def episode(tools, tool_turn: str, answer_turn: str | None):
    """A prompt with the few-shot exchange, and a completion: one turn with two calls, two results, an answer.
    With no `answer_turn` the episode stops at the tool turn (max_env_steps: its calls are not run)."""
    prompt = [{"role": "system", "content": CT.system_prompt(tools)}, *CT.few_shot(tools),
              {"role": "user", "content": "In which year was Quorvath founded, and what is the capital of Veltria?"}]
    completion = [
        {"role": "assistant", "content": tool_turn, "tool_calls": [
            tool_call_message(c.name, c.arguments) for c in CT.parse(tool_turn).calls]},
        {"role": "tool", "name": "search", "content": CORPUS[1]["title"] + ": " + CORPUS[1]["text"]},
        {"role": "tool", "name": "search", "content": CORPUS[0]["title"] + ": " + CORPUS[0]["text"]},
        {"role": "assistant", "content": answer_turn, "tool_calls": []},
    ]
    return prompt, completion if answer_turn is not None else completion[:1]


TOOL_TURN = "I look up both.\n" + template_call("Quorvath founded") + "\n" + template_call()
ANSWER_TURN = "Quorvath was founded in 1740; the capital of Veltria is Morvane.\n<answer>1740, Morvane</answer>"


def test_qwen25_episode_re_renders_as_sampled(qwen_style_tokenizer, search):
    tokenizer = qwen_style_tokenizer
    prompt, completion = episode([search], TOOL_TURN, ANSWER_TURN)
    assert len(CT.parse(TOOL_TURN).calls) == 2
    segments = rollout_segments(tokenizer, prompt, completion, [search])
    full = render(tokenizer, prompt + completion, [search], add_generation_prompt=False)
    assert TOOL_TURN in full and ANSWER_TURN in full
    # the few-shot call and the two sampled ones, each written once
    assert full.count('<tool_call>\n{"name": "search"') == 3
    assert full == "".join(segments)
    # The token ids match as well: each sampled text sits between special tokens or a newline.
    assert tokenizer.encode(full) == [i for text in segments for i in tokenizer.encode(text)]


REPLY = ("<|im_end|>\n<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n"
         "</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template,kwargs,expected", [
    ("qwen2.5", {}, REPLY),
    ("qwen3", {}, REPLY),
    ("qwen3", {"enable_thinking": True}, REPLY),
    ("qwen3", {"enable_thinking": False}, REPLY + EMPTY_THINK),
])
def test_reply_after_a_tool_turn(request, search, template, kwargs, expected):
    tokenizer = request.getfixturevalue("qwen_style_tokenizer" if template == "qwen2.5" else "qwen3_style_tokenizer")
    tool_messages = [{"role": "tool", "name": "search", "content": "R1"}, {"role": "tool", "name": "", "content": "R2"}]
    assert reply_text(tokenizer, tool_messages, [search], **kwargs) == expected


def test_qwen3_thinking_off_re_render_drops_the_empty_think_blocks_of_tool_turns(qwen3_style_tokenizer, search):
    prompt, completion = episode([search], TOOL_TURN, ANSWER_TURN)
    segments = rollout_segments(qwen3_style_tokenizer, prompt, completion, [search], enable_thinking=False)
    rollout = "".join(segments)
    full = render(qwen3_style_tokenizer, prompt + completion, [search], add_generation_prompt=False,
                  enable_thinking=False)
    assert rollout.count(EMPTY_THINK) == 2  # pre-written before each sampled turn
    assert full != rollout
    # Exactly the block before the tool turn is gone; the last turn keeps its block.
    assert full == rollout.replace(EMPTY_THINK, "", 1)


THOUGHT = "<think>\nI need two facts.\n</think>\n\n"
ANSWER_THOUGHT = "<think>\nThe results give both.\n</think>\n\n"


@pytest.mark.parametrize("tool_turn,answer_turn,same", [
    (THOUGHT + TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, True),
    (TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, True),  # a tool turn without a think block stays so
    (TOOL_TURN, EMPTY_THINK + ANSWER_TURN, True),  # the last turn: an empty block stays
    (THOUGHT + TOOL_TURN, ANSWER_TURN, False),  # the last turn gets an empty block it did not sample
    (EMPTY_THINK + TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, False),  # a tool turn's empty block is dropped
    ("<think>I need two facts.</think>" + TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, False),  # newlines added
    (THOUGHT.replace("</think>\n\n", "</think>\n") + TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, False),
    (THOUGHT.replace("\n</think>", "\n\n</think>") + TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, False),
    ("Hmm. " + THOUGHT + TOOL_TURN, ANSWER_THOUGHT + ANSWER_TURN, False),  # text before <think> is dropped
    (THOUGHT + TOOL_TURN, None, True),  # stopped at the tool turn, which is then the last turn
    (TOOL_TURN, None, False),
], ids=["thought everywhere", "no thought in the tool turn", "empty thought in the last turn",
        "no thought in the last turn", "empty thought in a tool turn", "thought without newlines",
        "one newline after the thought", "two newlines before its end", "text before the thought",
        "stopped at a tool turn with a thought",
        "stopped at a tool turn without one"])
def test_qwen3_thinking_on_re_render(qwen3_style_tokenizer, search, tool_turn, answer_turn, same):
    """With thinking on, a re-render equals the rollout iff each sampled turn is in the layout the template
    writes (docstring of protocol.ChatTemplateProtocol)."""
    prompt, completion = episode([search], tool_turn, answer_turn)
    assert len(CT.parse(tool_turn).calls) == 2
    assert answer_turn is None or CT.parse(answer_turn).answer == "1740, Morvane"
    for kwargs in ({}, {"enable_thinking": True}):
        segments = rollout_segments(qwen3_style_tokenizer, prompt, completion, [search], **kwargs)
        full = render(qwen3_style_tokenizer, prompt + completion, [search], add_generation_prompt=False, **kwargs)
        assert (full == "".join(segments)) is same


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
def test_few_shot_turns_are_what_the_template_writes_for_their_calls(request, search, template):
    """Rendered from `tool_calls` (the template writes the call) or from `content` (the text the model would
    write), the few-shot exchange is the same text; and parsing each turn gives back its calls and answer."""
    tokenizer = request.getfixturevalue("qwen_style_tokenizer" if template == "qwen2.5" else "qwen3_style_tokenizer")
    shots = CT.few_shot([search])
    from_calls = [{**m, "content": ""} if m.get("tool_calls") else m for m in shots]
    tools = CT.template_tools([search])
    assert (tokenizer.apply_chat_template(from_calls, tools=tools, tokenize=False)
            == tokenizer.apply_chat_template(CT.template_messages(shots), tools=tools, tokenize=False))
    assistant = [m for m in shots if m["role"] == "assistant"]
    assert [tool_call_message(c.name, c.arguments) for c in CT.parse(assistant[0]["content"]).calls] \
        == assistant[0]["tool_calls"]
    assert CT.parse(assistant[1]["content"]).answer == "Morvane"


def test_few_shot_tool_turn_is_the_hermes_block(search):
    assert CT.few_shot([search])[1]["content"] == (
        '<tool_call>\n{"name": "search", "arguments": {"query": "capital of Veltria"}}\n</tool_call>')
    assert "<answer> </answer>" in CT.system_prompt([search])
