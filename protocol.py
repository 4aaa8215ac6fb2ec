"""The tool protocol: how the model asks for a tool or answers, and how the environment replies.

One place for the tags, stop strings, the error prefix and the answer pattern, imported by the
trainer, the rewards and the tests. A protocol turns the model's text into a `Turn` (tool calls
and/or an answer) and maps the canonical conversation onto the messages a chat template renders.

The canonical conversation (what reward functions receive as `completions[i]`) is the same for
every protocol, in the OpenAI / chat-template shape:

    {"role": "assistant", "content": <the sampled text>, "tool_calls": [<well-formed calls>]}
    {"role": "tool", "name": <tool name, "" if the call was malformed>, "content": <output>}  # one per call
    ...
    {"role": "assistant", "content": "...<answer>Morvane</answer>", "tool_calls": []}

`tool_calls` lists the calls that parsed, as {"type": "function", "function": {"name", "arguments"}}.
Every call the environment answers, malformed ones included, gets one `tool` message; a failed
call's content starts with ERROR_PREFIX. A "tool turn" is an assistant message followed by tool
messages; per-turn rewards give one value per tool turn.

    xml             <reasoning>...</reasoning> then <tool>{"name": ..., "args": {...}}</tool> or
                    <answer>...</answer>; the reply is a user message <result>...</result>.
                    Tools are described in the system prompt. One call per turn.
    chat_template   the model's own tool calls, as its chat template writes them (Qwen2.5 / Qwen3):
                    tools go in as JSON schemas through `apply_chat_template(tools=...)`, the model
                    writes <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, several per
                    turn, and each result comes back as a `tool` message.

To add a protocol: subclass Protocol, fill in its methods, and add it to PROTOCOLS.
"""

import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Callable

ERROR_PREFIX = "Error:"  # a tool message whose content starts with this is a failed call
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""  # non-empty: malformed, not run; the environment replies ERROR_PREFIX + error


@dataclass
class Turn:
    """What one model turn asks for: an answer (ends the episode), tool calls, or nothing."""

    answer: str | None = None
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "answer" if self.answer is not None else "tool" if self.calls else "none"


def final_answer(text: str) -> str | None:
    """The last complete <answer>...</answer> of a text, stripped; None if there is none."""
    answers = ANSWER_PATTERN.findall(text or "")
    return answers[-1].strip() if answers else None


def error_text(message: str) -> str:
    return f"{ERROR_PREFIX} {message}"


def tool_call_message(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def describe_tools(tools: list[Callable]) -> str:
    """One line per tool from its signature and the first line of its docstring."""
    lines = []
    for fn in tools:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        lines.append(f"- {fn.__name__}{inspect.signature(fn)}: {doc[0] if doc else ''}")
    return "\n".join(lines)


def example_arguments(tools: list[Callable]) -> tuple[str, dict]:
    """The example call shown to the model: the first tool with its first argument, e.g. search(query=...)."""
    if not tools:
        return "search", {"query": "capital of Veltria"}
    first_arg = next(iter(inspect.signature(tools[0]).parameters), "query")
    return tools[0].__name__, {first_arg: "capital of Veltria"}


class Protocol:
    """The interface every protocol implements. Messages in and out are canonical (module docstring)."""

    name: str = ""
    stop_strings: list[str] = []  # sampling stops at these as well as at EOS

    def __init__(self, tokenizer=None):
        """`tokenizer`: the policy's tokenizer, for a protocol that parses with it (chat_template); others
        ignore it."""

    def system_prompt(self, tools: list[Callable], with_example: bool = True) -> str:
        """The system prompt. `with_example` False: the few-shot exchange is shown as real turns, so the
        prompt need not describe one in text (about 100 tokens less in every episode)."""
        raise NotImplementedError

    def few_shot(self, tools: list[Callable]) -> list[dict]:
        """Worked search-then-answer exchanges as canonical messages (after the system prompt)."""
        raise NotImplementedError

    def template_tools(self, tools: list[Callable]) -> list[dict] | None:
        """JSON schemas for `apply_chat_template(tools=...)`, or None when the template gets no tools."""
        return None

    def parse(self, text: str) -> Turn:
        raise NotImplementedError

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """Canonical messages -> the messages the chat template renders."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------
# xml: the MT-GRPO paper's protocol
# ------------------------------------------------------------------------------------------------
XML_SYSTEM_PROMPT = """You answer questions. You may call tools to look things up.

Tools:
{tools}

Always think first inside <reasoning> </reasoning>. Then either call one tool, writing a JSON object
inside <tool> </tool>, or give the final answer inside <answer> </answer>, in a few words.

Example:
<reasoning>I do not know the capital of Veltria, so I look it up.</reasoning>
<tool>{example_call}</tool>

The tool's output comes back inside <result> </result>. Then:
<reasoning>The result says the capital of Veltria is Morvane.</reasoning>
<answer>Morvane</answer>"""

FEW_SHOT_RESULT = "Veltria: Veltria is a country in the north. Its capital is Morvane."
FEW_SHOT_RESULT_2 = "Brenloom: The Brenloom is an invention. It was invented by Tessa Varn in 1702."


class XMLProtocol(Protocol):
    name = "xml"
    TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
    RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
    REASONING_OPEN, REASONING_CLOSE = "<reasoning>", "</reasoning>"
    TAGS = (TOOL_OPEN, TOOL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, RESULT_OPEN, RESULT_CLOSE,
            REASONING_OPEN, REASONING_CLOSE)
    stop_strings = [TOOL_CLOSE, ANSWER_CLOSE]
    _TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)

    def example_call(self, tools: list[Callable]) -> str:
        name, arguments = example_arguments(tools)
        return json.dumps({"name": name, "args": arguments})

    def system_prompt(self, tools: list[Callable], with_example: bool = True) -> str:
        text = XML_SYSTEM_PROMPT.format(tools=describe_tools(tools), example_call=self.example_call(tools))
        return text if with_example else text[: text.index("\n\nExample:")]

    def few_shot(self, tools: list[Callable]) -> list[dict]:
        """Two worked exchanges. Measured on SmolLM2-135M (64 sampled episodes of training questions,
        temperature 0.7): with one exchange 8 episodes called a tool and 2 found the answer; with two,
        22 called, 17 calls ran and 13 found the answer, in 5 of 8 groups. RL needs that many."""
        name, arguments = example_arguments(tools)
        first_arg = next(iter(arguments))
        shots = [("What is the capital of Veltria?", "the capital of Veltria", arguments, FEW_SHOT_RESULT,
                  "the capital of Veltria is Morvane", "Morvane"),
                 ("Who invented the Brenloom?", "who invented the Brenloom",
                  {first_arg: "Brenloom inventor"}, FEW_SHOT_RESULT_2,
                  "Tessa Varn invented the Brenloom", "Tessa Varn")]
        messages = []
        for question, unknown, args, result, found, answer in shots:
            call = json.dumps({"name": name, "args": args})
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant",
                 "content": f"<reasoning>I do not know {unknown}, so I look it up.</reasoning>\n"
                            f"<tool>{call}</tool>",
                 "tool_calls": [tool_call_message(name, args)]},
                {"role": "tool", "name": name, "content": result},
                {"role": "assistant",
                 "content": f"<reasoning>The result says {found}.</reasoning>\n<answer>{answer}</answer>",
                 "tool_calls": []},
            ]
        return messages

    def parse(self, text: str) -> Turn:
        """Sampling stops at </tool> or </answer>, so a turn holds at most one closing tag, at its end.
        Error messages never quote the protocol's tags: a small model copies them into its next turn,
        where sampling would stop at the copied closing tag."""
        if (answer := final_answer(text)) is not None:
            return Turn(answer=answer)
        if m := self._TOOL.search(text):
            try:
                call = json.loads(m.group(1))
            except json.JSONDecodeError as e:
                return Turn(calls=[ToolCall(
                    "", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos}).")])
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return Turn(calls=[ToolCall(
                    "", error='a tool call must be a JSON object {"name": ..., "args": {...}}.')])
            args = call.get("args", {})
            if not isinstance(args, dict):
                return Turn(calls=[ToolCall(
                    call["name"], error='"args" must be a JSON object of keyword arguments.')])
            return Turn(calls=[ToolCall(call["name"], args)])
        if any(tag in text for tag in (self.TOOL_OPEN, self.TOOL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)):
            return Turn(calls=[ToolCall(
                "", error="a tool call or answer was opened but not closed, or closed but not opened.")])
        return Turn()

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """Assistant turns render as sampled (their calls are in the text); each run of tool messages
        becomes one user message <result>...</result>."""
        out: list[dict] = []
        for m in messages:
            if m["role"] == "tool":
                if out and out[-1].get("_results"):
                    out[-1]["_results"].append(m["content"])
                else:
                    out.append({"role": "user", "_results": [m["content"]]})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        for m in out:
            if "_results" in m:
                m["content"] = (f"{self.RESULT_OPEN}\n" + "\n\n".join(m.pop("_results"))
                                + f"\n{self.RESULT_CLOSE}")
        return out


# ------------------------------------------------------------------------------------------------
# chat_template: the model's own tool calls (the hermes format of Qwen2.5 and Qwen3)
# ------------------------------------------------------------------------------------------------
# The template describes the tools and the call format; the system prompt adds only the task.
CHAT_TEMPLATE_SYSTEM_PROMPT = ("You answer questions. You may call tools to look things up. "
                               "Give the final answer inside <answer> </answer>, in a few words.")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TOOL_CALL_TAG = re.compile(f"({re.escape(TOOL_CALL_OPEN)}|{re.escape(TOOL_CALL_CLOSE)})")


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """The tools as JSON schemas for `apply_chat_template(tools=...)`, made by transformers from each
    tool's type hints and Google-style docstring. Call it at start-up: a tool that cannot be described
    fails here."""
    # Imported here, not at the top, so that the rewards can import this module without transformers.
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    schemas = []
    for fn in tools:
        try:
            schemas.append(get_json_schema(fn))
        except (TypeHintParsingException, DocstringParsingException) as e:
            raise ValueError(
                f"Tool {getattr(fn, '__name__', fn)!r} cannot be described to the model as a JSON schema: "
                f"{e}. Give every argument a type hint, and write a Google-style docstring: a one-line "
                "description, then an `Args:` section with one `name: description` line per argument "
                "(see tools/search.py)."
            ) from None
    return schemas


def tool_call_from_object(call) -> ToolCall:
    """{"name": str, "arguments": {...}} -> ToolCall; `arguments` may also be a JSON string of an
    object."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall("", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}.')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # reported just below
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error='"arguments" must be a JSON object of keyword arguments.')
    return ToolCall(call["name"], arguments)


def tool_call_from_json(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos}).")
    return tool_call_from_object(call)


def parse_hermes_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>JSON</tool_call> block of `text`, in order. A block that does not parse, one left
    open, and a closing tag with no opening one each become a ToolCall with an error (with the name if
    known)."""
    pieces = _TOOL_CALL_TAG.split(text)  # [text, tag, text, tag, text, ...]
    calls, body = [], None  # body: the text after the last opening tag, None outside a block
    for tag, after in zip(pieces[1::2], pieces[2::2]):
        if tag == TOOL_CALL_OPEN:
            if body is not None:
                calls.append(ToolCall(tool_call_from_json(body).name,
                                      error="a tool call was opened but not closed."))
            body = after
        else:
            calls.append(tool_call_from_json(body) if body is not None
                         else ToolCall("", error="a tool call was closed but not opened."))
            body = None
    if body is not None:
        calls.append(ToolCall(tool_call_from_json(body).name,
                              error="a tool call was opened but not closed."))
    return calls


class ChatTemplateProtocol(Protocol):
    """The model calls tools the way its chat template writes calls. For Qwen2.5 and Qwen3 that is

        <tool_call>
        {"name": "search", "arguments": {"query": "capital of Veltria"}}
        </tool_call>

    any number of times in one turn, with the tools given to the template as JSON schemas
    (`template_tools`), and each result given back as a `tool` message, which both templates render as
    `<tool_response>\\n...\\n</tool_response>` inside one user turn per run of tool messages.

    Parsing: with a tokenizer that defines a `response_template` (transformers' response parsing), the
    turn is parsed with `tokenizer.parse_response`; otherwise, as with Qwen2.5's and Qwen3's tokenizers on
    the Hub, which define none, with `parse_hermes_calls`. Both give their calls to
    `tool_call_from_object`.

    Re-rendering (the env's tokenization check renders prompt + completion in one go). Qwen2.5 gives back
    the rollout's text exactly. Qwen3 rewrites every assistant turn after the last user message, so every
    sampled turn T (the tool replies are `tool` messages, not user ones):
      - T with `</think>`: R = the text before the first `</think>`, after the last `<think>` there, stripped
        of newlines; C = the text after the last `</think>`, stripped of leading newlines. It becomes
        `<think>\\n` + R + `\\n</think>\\n\\n` + C if R is non-empty or T is the episode's last turn, else C
        alone (the last turn: the answer, or whatever turn the episode stopped at);
      - T without `</think>` stays T, except as the last turn: `<think>\\n\\n</think>\\n\\n` +
        T.lstrip("\\n").
    So with `enable_thinking=False`, whose generation prompts pre-write `<think>\\n\\n</think>\\n\\n` before
    every sampled turn, every episode with a tool turn differs: the re-render lacks that empty block before
    each turn but the last (which keeps it). With thinking on (the default) an episode re-renders as sampled
    iff each turn but the last has no `</think>` or is exactly `<think>\\n` + R + `\\n</think>\\n\\n` + C with
    R non-empty and R, C as above, and the last turn is exactly that with R possibly empty.
    """

    name = "chat_template"
    TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, THINK_OPEN, THINK_CLOSE,
            "<tool_response>", "</tool_response>", "<tools>", "</tools>")
    # No stop string: a turn may hold several calls, so it ends where the template ends an assistant turn,
    # at <|im_end|>, which is an EOS token of Qwen's chat models. Stopping at </tool_call> would cut off
    # the second call.
    stop_strings = []

    def __init__(self, tokenizer=None):
        # Kept only if it defines transformers' response parsing; the Hub's Qwen2.5 and Qwen3 tokenizers
        # do not.
        self.response_parser = tokenizer if getattr(tokenizer, "response_template", None) else None

    def format_call(self, name: str, arguments: dict) -> str:
        """A call as Qwen's templates render one: `{"name": "` + name + `", "arguments": ` + tojson +
        `}`."""
        # ensure_ascii as tojson
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"

    def system_prompt(self, tools: list[Callable], with_example: bool = True) -> str:
        return CHAT_TEMPLATE_SYSTEM_PROMPT

    def few_shot(self, tools: list[Callable]) -> list[dict]:
        name, arguments = example_arguments(tools)
        return [
            {"role": "user", "content": "What is the capital of Veltria?"},
            {"role": "assistant", "content": self.format_call(name, arguments),
             "tool_calls": [tool_call_message(name, arguments)]},
            {"role": "tool", "name": name, "content": FEW_SHOT_RESULT},
            {"role": "assistant", "content": "The result says the capital of Veltria is Morvane.\n"
                                             "<answer>Morvane</answer>", "tool_calls": []},
        ]

    def template_tools(self, tools: list[Callable]) -> list[dict] | None:
        return tool_schemas(tools)

    def parse(self, text: str) -> Turn:
        """An <answer> ends the episode (calls beside it are not run); else the turn's calls, in order.
        Only the text after the last </think> counts, as in the templates, which keep only that as the
        turn's content. Error messages never quote the protocol's tags: a small model copies them into its
        next turn."""
        if self.response_parser is not None:
            content, calls = self.parse_with_tokenizer(text)
        else:
            content = text.rpartition(THINK_CLOSE)[2]
            calls = parse_hermes_calls(content)
        if (answer := final_answer(content)) is not None:
            return Turn(answer=answer)
        if not calls and (ANSWER_OPEN in content or ANSWER_CLOSE in content):
            return Turn(calls=[ToolCall(
                "", error="an answer was opened but not closed, or closed but not opened.")])
        return Turn(calls=calls)

    def parse_with_tokenizer(self, text: str) -> tuple[str, list[ToolCall]]:
        """transformers' response parsing -> (the turn's content without its reasoning, its calls)."""
        try:
            # prefix "": Qwen's generation prompts pre-write nothing a call or an answer depends on (thinking
            # off pre-writes an empty think block). A template that opens <think> in the prompt would need it.
            message = self.response_parser.parse_response(text, prefix="")
        except ValueError:  # one block that is not JSON fails the whole turn
            return text, [ToolCall("", error="a tool call is not valid JSON.")]
        calls = [tool_call_from_object(c.get("function")) for c in message.get("tool_calls") or []]
        return message.get("content") or "", calls

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """Assistant turns render as sampled, without `tool_calls`: their calls are in the text, and the
        template would write them a second time. Tool messages pass through (Qwen needs no tool_call_id)."""
        out = []
        for m in messages:
            if m["role"] == "tool":
                out.append({"role": "tool", "name": m["name"], "content": m["content"]})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return out


PROTOCOLS: dict[str, type[Protocol]] = {"xml": XMLProtocol, "chat_template": ChatTemplateProtocol}


def get_protocol(name: str, tokenizer=None) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"Unknown tool_format {name!r}; choose one of {sorted(PROTOCOLS)}.")
    return PROTOCOLS[name](tokenizer)


class StopStringMatcher:
    """Whether token i completes one of `stop_strings`. Only tokens that contain a stop string's last
    character can (found once over the vocabulary); a short window is decoded just for those."""

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        last_chars = {s[-1] for s in stop_strings}
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))]) if stop_strings else []
        self.candidates = {i for i, piece in enumerate(pieces) if any(c in piece for c in last_chars)}
        # tokens: a stop string is never longer
        self.window = max((len(s) for s in stop_strings), default=0) + 4

    def completes(self, ids: list[int], i: int) -> bool:
        return ids[i] in self.candidates and any(
            s in self.tokenizer.decode(ids[max(0, i - self.window + 1) : i + 1]) for s in self.stop_strings)


def end_of_turn_ids(model_name_or_path: str, tokenizer, revision: str | None = None) -> list[int]:
    """Every id that ends a model turn: the tokenizer's EOS and the generation config's (Qwen2.5-Instruct
    lists <|im_end|> and <|endoftext|>), as TRL collects them."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_name_or_path, revision=revision).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return [tokenizer.eos_token_id] + [i for i in ids if i != tokenizer.eos_token_id]
