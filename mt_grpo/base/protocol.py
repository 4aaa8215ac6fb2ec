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
call's content starts with ERROR_PREFIX, or under chat_template reads as TRL's (`{'error': ...}`:
`tool_reply`). A "tool turn" is an assistant message followed by tool messages; per-turn rewards
give one value per tool turn.

    xml             <reasoning>...</reasoning> then <tool>{"name": ..., "args": {...}}</tool> or
                    <answer>...</answer>; the reply is a user message <result>...</result>.
                    Tools are described in the system prompt. One call per turn.
    chat_template   the model's own tool calls, as its chat template writes them (Qwen2.5 / Qwen3):
                    tools go in as JSON schemas through `apply_chat_template(tools=...)`, the model
                    writes <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, several per
                    turn, and each result comes back as a `tool` message.

The prompt (`build_prompt`) is a system message, the task's worked examples as real turns, then the
question or the user's TRL prompt. The system message is the task's part (what to do: the task's or the
recipe's `system_prompt`, else the neutral DEFAULT_TASK_PROMPT) followed by the protocol's part (how to call a
tool and how to answer). Worked examples are protocol-neutral dicts (`check_examples` gives their shape) that
each protocol renders in its own format. Nothing here is written for one task: the knowledge base's prompt and
examples live in mt_grpo/tasks/fictional_kb.py.

To add a protocol: subclass Protocol, fill in its methods, and add it to PROTOCOLS.
"""

import contextlib
import functools
import inspect
import json
import logging
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Callable, Literal, Union

ERROR_PREFIX = "Error:"  # a failed call's tool message starts with this (chat_template: TRL's text, tool_reply)
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
    """The last complete <answer>...</answer> of a text outside its tool calls (`outside_calls`), stripped; None if
    there is none. An answer inside a call's arguments is part of the call."""
    answers = ANSWER_PATTERN.findall(outside_calls(text or ""))
    return answers[-1].strip() if answers else None


_CALL_OPEN = re.compile(r"<(tool|tool_call)>")  # either protocol's call block: xml's <tool>, the templates' <tool_call>


def outside_calls(text: str) -> str:
    """`text` without its tool-call blocks (either protocol's): each from its opening tag to its closing tag. A block
    left open ends with the JSON object after its tag, or, when that JSON is unfinished, at the end of the text (xml's
    sampling stops at an answer's closing tag, also inside a call's arguments: XMLProtocol.parse)."""
    kept, pos = [], 0
    while m := _CALL_OPEN.search(text, pos):
        kept.append(text[pos : m.start()])
        close = text.find(f"</{m.group(1)}>", m.end())
        if close >= 0:
            pos = close + len(m.group(1)) + 3
            continue
        body = text[m.end():]
        try:
            pos = len(text) - len(body.lstrip()) + json.JSONDecoder().raw_decode(body.lstrip())[1]
        except ValueError:  # unfinished: the rest of the turn is the call's
            pos = len(text)
    return "".join(kept) + text[pos:]


def json_text(value) -> str:
    """A tool's non-string value as the model reads it: `str()`, as TRL's tool loop makes the tool message's content
    (`str(result)`: `{'city': 'Morvane'}`, `True`, `None`), and as a chat template renders a list it is given (Jinja's
    `{{ content }}`: `[('counter', 1)]`), so that a TRL script's prompts are byte for byte TRL's. (It was JSON
    here; a tool that wants JSON returns `json.dumps(...)`.)"""
    return str(value)


def is_text_block(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def is_image_block(part) -> bool:  # {"type": "image", "image": PIL.Image} (engine/vision.py)
    return isinstance(part, dict) and part.get("type") == "image"


def holds_images(content) -> bool:
    """A content list of text and image blocks with at least one image (engine/vision.py's representation)."""
    return isinstance(content, list) and any(is_image_block(p) for p in content) and \
        all(is_text_block(p) or is_image_block(p) for p in content)


def content_text(content) -> str:
    """A message's content as the text a chat template renders: a string as it is; a content list of text blocks
    (`[{"type": "text", "text": ...}]`, what TRL passes through from a tool that returns a list) their texts, one
    a line (and of text and image blocks, the texts: template_content keeps the images); any other value (a list of
    anything else) as `str()` (`json_text`), as TRL's template renders it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and (all(is_text_block(part) for part in content) or holds_images(content)):
        return "\n".join(part["text"] for part in content if is_text_block(part))
    return json_text(content)


def template_content(content):
    """What a chat template is given for a message's content: its text (content_text), or, where it holds images, its
    text and image blocks, each image where it entered (the template renders its placeholder)."""
    return list(content) if holds_images(content) else content_text(content)


def joined_blocks(parts: list, sep: str, before: str = "", after: str = ""):
    """`before + sep.join(parts) + after` for parts that are text or block lists: a string where no part holds an
    image, else one block list (adjacent texts merged)."""
    if all(isinstance(p, str) for p in parts):
        return before + sep.join(parts) + after
    blocks: list[dict] = []
    for piece in [before, *[q for k, p in enumerate(parts) for q in ([sep] if k else []) + (
            [p] if isinstance(p, str) else [b["text"] if is_text_block(b) else b for b in p])], after]:
        if isinstance(piece, str) and blocks and is_text_block(blocks[-1]):
            blocks[-1] = {"type": "text", "text": blocks[-1]["text"] + piece}
        elif not isinstance(piece, str) or piece:
            blocks.append({"type": "text", "text": piece} if isinstance(piece, str) else piece)
    return blocks


def error_text(message: str) -> str:
    return f"{ERROR_PREFIX} {message}"


def tool_call_message(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def describe_tools(tools: list[Callable]) -> str:
    """Per tool, its signature and what TRL's JSON schema tells the model (tool_schemas): the description, then
    a line per argument with its description (and its choices, for an enum). A tool whose docstring gives no
    schema falls back to the docstring's first line (the xml format needs no schema)."""
    return "\n".join(_described(fn) for fn in tools)


def _described(fn: Callable) -> str:
    """describe_tools' text of one tool, made once per tool: every row's prompt lists the same tools, and a schema
    takes about 4 ms to build from a docstring (4 s of start-up for a thousand rows). An unhashable callable is
    described each time."""
    try:
        return _described_once(fn)
    except TypeError:
        if getattr(type(fn), "__hash__", None) is not None:
            raise
        return _describe_tool(fn)


@functools.lru_cache(maxsize=1024)
def _described_once(fn: Callable) -> str:
    return _describe_tool(fn)


def _describe_tool(fn: Callable) -> str:
    try:
        schema = tool_schemas([fn])[0]
        schema = schema.get("function", schema)
    except ValueError:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        schema = {"description": doc[0] if doc else "", "parameters": {}}
    # an MCP server's description is the whole docstring, and its arguments' text is in the Args section
    description, *sections = re.split(r"\n\s*(?:Args|Arguments|Returns|Raises):", schema.get("description") or "")
    documented = dict(re.findall(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", sections[0], re.M)) if sections else {}
    lines = [f"- {fn.__name__}{inspect.signature(fn)}: {description.strip()}".rstrip()]
    for name, p in (schema.get("parameters") or {}).get("properties", {}).items():
        text = p.get("description", documented.get(name, "")) + \
            (f" (one of {', '.join(map(str, p['enum']))})" if "enum" in p else "")
        if text:
            lines.append(f"    {name}: {text}")
    return "\n".join(lines)


DEFAULT_TASK_PROMPT = "You answer questions. You may call tools."  # questions of a task with no system prompt of its own


class Protocol:
    """The interface every protocol implements. Messages in and out are canonical (module docstring)."""

    name: str = ""
    stop_strings: list[str] = []  # sampling stops at these as well as at EOS
    tool_images_as_user = False  # a tool's images rendered in a user message after its reply (`tool_images_as_user`)

    def __init__(self, tokenizer=None):
        """`tokenizer`: the policy's tokenizer, for a protocol that parses with it (chat_template); others
        ignore it."""

    def system_prompt(self, tools: list[Callable], task_prompt: str | None = None, with_example: bool = True,
                      example: dict | None = None, questions: bool = True) -> str:
        """The task's part (`task_prompt`; for `questions` without one, DEFAULT_TASK_PROMPT), then the protocol's
        tool part, which asks for an <answer> only for `questions` (a TRL prompt or an environment's episode ends
        at a turn without a call, as in TRL). `with_example`: show one call (and its answer) in text, from
        `example` (a worked example, see `check_examples`; its first tool step) or else a neutral call of the first
        tool. False when worked examples are shown as real turns: the prompt need not describe one (about 100
        tokens less in every episode). "" means no system message."""
        raise NotImplementedError

    def few_shot(self, tools: list[Callable], examples: list[dict]) -> list[dict]:
        """Worked examples (`check_examples`) as canonical messages, to follow the system prompt: per example
        the question, per step an assistant turn and a tool message (a tool step), or an answer turn and the
        environment's reply as a user message (a reply step: what an episode appends after `respond`), then the
        answer turn. A reply is a user message, so its text is from outside in every render (OUTSIDE_ROLES)."""
        messages = []
        for example in examples:
            messages.append({"role": "user", "content": example["question"]})
            for step in example.get("steps", []):
                if "reply" in step:
                    messages += [{"role": "assistant", "content": self.answer_text(step), "tool_calls": []},
                                 {"role": "user", "content": step["reply"]}]
                    continue
                args = step.get("args", {})
                messages += [{"role": "assistant", "content": self.call_text(step),
                              "tool_calls": [tool_call_message(step["tool"], args)]},
                             {"role": "tool", "name": step["tool"], "content": step["result"]}]
            messages.append({"role": "assistant", "content": self.answer_text(example), "tool_calls": []})
        return messages

    def call_text(self, step: dict) -> str:
        """The text of a worked example's tool turn: its step's call, as the model would write it."""
        raise NotImplementedError

    def answer_text(self, example: dict) -> str:
        """The text of a worked example's answer turn, or of a reply step's (its `thought`, then <answer>)."""
        raise NotImplementedError

    def template_tools(self, tools: list[Callable]) -> list[dict] | None:
        """JSON schemas for `apply_chat_template(tools=...)`, or None when the template gets no tools."""
        return None

    def parse(self, text: str) -> Turn:
        raise NotImplementedError

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """Canonical messages -> the messages the chat template renders."""
        raise NotImplementedError

    def tool_reply(self, result) -> str | list:
        """The content of a call's tool message, from its result (rollout/tool_calls.ToolResult): the tool's output,
        or the failure as `Error: ...` (ERROR_PREFIX)."""
        return result.output


# ------------------------------------------------------------------------------------------------
# xml: the MT-GRPO paper's protocol
# ------------------------------------------------------------------------------------------------
# The system prompt's tool part, after the task's part and a blank line; then, with_example, XML_EXAMPLE.
XML_TOOL_PROMPT = """Tools:
{tools}

Always think first inside <reasoning> </reasoning>. Then either call one tool, writing a JSON object
inside <tool> </tool>, or {end}"""
XML_END = {True: "give the final answer inside <answer> </answer>, in a few words.",  # questions
           False: "reply without a tool call when you are done."}  # a TRL prompt, an environment's episode

XML_NO_TOOLS = {True: "Always think first inside <reasoning> </reasoning>. Then give the final answer inside <answer> "
                      "</answer>, in a few words.", False: ""}
XML_EXAMPLE = """Example:
{call}

The tool's output comes back inside <result> </result>."""
XML_EXAMPLE_ANSWER = " Then:\n{answer}"


class XMLProtocol(Protocol):
    name = "xml"
    TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
    RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
    REASONING_OPEN, REASONING_CLOSE = "<reasoning>", "</reasoning>"
    TAGS = (TOOL_OPEN, TOOL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, RESULT_OPEN, RESULT_CLOSE,
            REASONING_OPEN, REASONING_CLOSE)
    stop_strings = [TOOL_CLOSE, ANSWER_CLOSE]
    _TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)

    def system_prompt(self, tools: list[Callable], task_prompt: str | None = None, with_example: bool = True,
                      example: dict | None = None, questions: bool = True) -> str:
        if not tools:  # an environment that only replies as the user (user_turns.py): no call format to show
            return "\n\n".join(p for p in [task_text(task_prompt, questions), XML_NO_TOOLS[questions]] if p)
        parts = [task_text(task_prompt, questions), XML_TOOL_PROMPT.format(tools=describe_tools(tools),
                                                                           end=XML_END[questions])]
        example = example if example and tool_steps(example) else neutral_example(tools)
        if with_example and example is not None:  # no tools: nothing to show a call of
            answer = XML_EXAMPLE_ANSWER.format(answer=self.answer_text(example)) if questions else ""
            parts.append(XML_EXAMPLE.format(call=self.call_text(tool_steps(example)[0])) + answer)
        return "\n\n".join(p for p in parts if p)

    def call_text(self, step: dict) -> str:
        call = json.dumps({"name": step["tool"], "args": step.get("args", {})})
        return f"{self.reasoning(step)}<tool>{call}</tool>"

    def answer_text(self, example: dict) -> str:
        return f"{self.reasoning(example)}<answer>{example['answer']}</answer>"

    def reasoning(self, part: dict) -> str:
        """The <reasoning> block of a step or answer, and a newline; nothing when the example gives no
        thought (but the system prompt asks for one, and format_reward_func pays for it: give thoughts)."""
        thought = part.get("thought")
        return f"{self.REASONING_OPEN}{thought}{self.REASONING_CLOSE}\n" if thought else ""

    def parse(self, text: str) -> Turn:
        """Sampling stops at </tool> or </answer>, so a turn holds at most one closing tag, at its end. An
        <answer> inside a call's arguments is part of the call (`final_answer`); since sampling stops at its
        </answer> there too, such a call arrives cut off, unclosed, and fails with an error that says so (the
        stop string is the backend's: sampling cannot go on past it exactly). Error messages never quote the
        protocol's tags: a small model copies them into its next turn, where sampling would stop at the copied
        closing tag."""
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
        if ANSWER_CLOSE in (text.rpartition(self.TOOL_OPEN)[2] if self.TOOL_OPEN in text else ""):
            return Turn(calls=[ToolCall("", error="the tool call was cut off: an answer closed inside its arguments, "
                                        "which ends the turn. Write the arguments without answer tags.")])
        if any(tag in text for tag in (self.TOOL_OPEN, self.TOOL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)):
            return Turn(calls=[ToolCall(
                "", error="a tool call or answer was opened but not closed, or closed but not opened.")])
        unparsed_markup(text, self.name)
        return Turn()

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """Assistant turns render as sampled (their calls are in the text); each run of tool messages
        becomes one user message <result>...</result> of their texts (content_text)."""
        out: list[dict] = []
        for m in messages:
            if m["role"] == "tool":
                if out and out[-1].get("_results"):
                    out[-1]["_results"].append(template_content(m["content"]))
                else:
                    out.append({"role": "user", "_results": [template_content(m["content"])]})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        for m in out:
            if "_results" in m:  # a tool's images stay where they entered, inside the <result> text
                m["content"] = joined_blocks(m.pop("_results"), "\n\n", f"{self.RESULT_OPEN}\n", f"\n{self.RESULT_CLOSE}")
        return out


# ------------------------------------------------------------------------------------------------
# chat_template: the model's own tool calls (the hermes format of Qwen2.5 and Qwen3)
# ------------------------------------------------------------------------------------------------
# The template describes the tools and the call format; the system prompt adds only how to answer.
CHAT_TEMPLATE_TOOL_PROMPT = "Give the final answer inside <answer> </answer>, in a few words."
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TOOL_CALL_TAG = re.compile(f"({re.escape(TOOL_CALL_OPEN)}|{re.escape(TOOL_CALL_CLOSE)})")


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """The tools as JSON schemas for `apply_chat_template(tools=...)`: a tool's own `json_schema` if it has one
    (an MCP tool's, tools/mcp.py), else made by transformers from its type hints and Google-style docstring.
    Call it at start-up: a tool that cannot be described fails here."""
    # Imported here, not at the top, so that the rewards can import this module without transformers.
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    schemas = []
    for fn in tools:
        if getattr(fn, "json_schema", None) is not None:
            schemas.append(fn.json_schema)
            continue
        try:
            schemas.append(get_json_schema(fn))
        except (TypeHintParsingException, DocstringParsingException) as e:
            raise ValueError(
                f"Tool {getattr(fn, '__name__', fn)!r} cannot be described to the model as a JSON schema: "
                f"{e}. Give every argument a type hint, and write a Google-style docstring: a one-line "
                "description, then an `Args:` section with one `name: description` line per argument "
                "(see mt_grpo/tools/search.py)."
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
        # Kept only if it defines transformers' response parsing. The Hub's Qwen2.5 and Qwen3 tokenizers do not, and
        # their <tool_call> blocks are parsed here (parse_hermes_calls); another template TRL knows (Llama 3.1's
        # and 3.2's JSON calls, gpt-oss, GLM-4, Gemma 4, LFM2, DeepSeek-R1) gets TRL's parser, as GRPOTrainer sets it
        # (trl.chat_template_utils.add_response_schema), so that its calls parse as they do under TRL.
        if tokenizer is not None and not getattr(tokenizer, "response_template", None) \
                and TOOL_CALL_OPEN not in str(getattr(tokenizer, "chat_template", None) or ""):
            with contextlib.suppress(Exception):  # a template TRL does not know: <tool_call> blocks, as Qwen's
                from trl.chat_template_utils import add_response_schema

                add_response_schema(tokenizer)
        self.response_parser = tokenizer if getattr(tokenizer, "response_template", None) else None

    def format_call(self, name: str, arguments: dict) -> str:
        """A call as Qwen's templates render one: `{"name": "` + name + `", "arguments": ` + tojson +
        `}`."""
        # ensure_ascii as tojson
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"

    def system_prompt(self, tools: list[Callable], task_prompt: str | None = None, with_example: bool = True,
                      example: dict | None = None, questions: bool = True) -> str:
        """The task's part and, for `questions`, the answer format. No example in text, whatever `with_example`:
        the template already tells the model how to write a call. A TRL prompt or an environment without a task
        part gets no system message: the template's own, as in TRL."""
        task = task_text(task_prompt, questions)
        if not questions:
            return task
        # a one-line task part takes the answer format on its line (the knowledge base's prompt as it always was);
        # one of several lines, after a blank line
        return task + ("\n\n" if "\n" in task else " ") + CHAT_TEMPLATE_TOOL_PROMPT

    def call_text(self, step: dict) -> str:
        """Only the call, as the template writes it from `tool_calls`: a step's thought is not shown, so the
        worked turn is the same text whether the template renders its content or its calls (a thinking model's
        reasoning is the template's <think>, which it drops from earlier turns anyway)."""
        return self.format_call(step["tool"], step.get("args", {}))

    def answer_text(self, example: dict) -> str:
        thought = example.get("thought")
        return (f"{thought}\n" if thought else "") + f"{ANSWER_OPEN}{example['answer']}{ANSWER_CLOSE}"

    def template_tools(self, tools: list[Callable]) -> list[dict] | None:
        return tool_schemas(tools)

    def parse(self, text: str) -> Turn:
        """An <answer> ends the episode (calls beside it are not run), unless it is inside a call's arguments,
        where it is part of the call (`final_answer`); else the turn's calls, in order.
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
        if not calls:
            unparsed_markup(content, self.name)
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
        template would write them a second time. Tool messages pass through (Qwen needs no tool_call_id), a content
        list as its text (content_text: a text-only template would render a list's repr, or nothing)."""
        out, moved = [], []
        for k, m in enumerate(messages):
            if m["role"] == "tool":
                content = template_content(m["content"])
                if self.tool_images_as_user and isinstance(content, list):  # the text stays, the images follow
                    moved += [p for p in content if is_image_block(p)]
                    content = content_text(content)
                out.append({"role": "tool", "name": m["name"], "content": content})
            else:
                out.append({"role": m["role"], "content": m["content"]})
            if moved and (k + 1 == len(messages) or messages[k + 1]["role"] != "tool"):
                out.append({"role": "user", "content": moved})  # after the run of tool messages
                moved = []
        return out

    def tool_reply(self, result) -> str | list:
        """As TRL's tool loop replies, so that a TRL script's model reads TRL's text: a tool that raised, arguments
        that do not fit, a name no tool has, each `str({"error": message})` with TRL's message (`Tool x not
        found.`, Python's TypeError, str(e)); the output otherwise. Failures TRL never has (a timeout, a call that
        did not parse) keep `Error: ...`. The rewards read both forms (rewards/conversation.failed)."""
        return str({"error": result.trl_error}) if result.trl_error else result.output


PROTOCOLS: dict[str, type[Protocol]] = {"xml": XMLProtocol, "chat_template": ChatTemplateProtocol}


def get_protocol(name: str, tokenizer=None) -> Protocol:
    name = auto_tool_format(tokenizer) if name == "auto" else name
    if name not in PROTOCOLS:
        raise ValueError(f"Unknown tool_format {name!r}; choose one of {['auto', *sorted(PROTOCOLS)]}.")
    return PROTOCOLS[name](tokenizer)


PROBE_TOOL = {"type": "function", "function": {"name": "mt_grpo_probe_tool", "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {}}}}


def auto_tool_format(tokenizer) -> str:
    """`tool_format: auto` (the default): chat_template where the tokenizer's chat template writes the tools it is
    given (a probe tool's name in its render), as TRL's GRPOTrainer runs a model's own tool calls; xml otherwise
    (SmolLM2's template has no tool section) and without a tokenizer."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return "xml"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], tools=[PROBE_TOOL], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that fails on tools takes none
        return "xml"
    return "chat_template" if PROBE_TOOL["function"]["name"] in str(text) else "xml"


# Tool-call markup of the other format: a model writing it gets no call run, which looked like a model that never
# calls (an episode `no_action`, `tools/call_frequency` 0); the run says so once, naming the field.
OTHER_MARKUP = {"xml": ("<tool_call>", "<|python_tag|>", '{"name"'), "chat_template": ("<tool>",)}
_MARKUP_LOGGED: set[str] = set()


def unparsed_markup(text: str, name: str) -> None:
    """Log once a run that the model wrote the other format's tool-call markup, which `tool_format: name` does not
    parse."""
    seen = next((m for m in OTHER_MARKUP[name] if m in text), None)
    if seen is None or name in _MARKUP_LOGGED:
        return
    _MARKUP_LOGGED.add(name)
    other = "chat_template" if name == "xml" else "xml"
    logging.getLogger("mt_grpo").warning(
        "The model wrote %r, tool-call markup that tool_format: %s does not parse, so no call of it runs (the "
        "episode ends as an answer). If that is how this model calls tools, set tool_format: %s (auto picks "
        "chat_template where the chat template writes tools).", seen, name, other)


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


# ------------------------------------------------------------------------------------------------
# Text from outside as tokens: a tool's output, an environment's observation, a user turn, a dataset's question,
# system or assistant message, a continuation's text inside the model's message is data. Its
# `<|im_end|><|im_start|>user` must stay those characters, never become the template's control tokens (which would
# forge a turn in the training data), in every render: the episode's prompt, its replies, each re-rendered sample.
# ------------------------------------------------------------------------------------------------
OUTSIDE_ROLES = ("tool", "user")  # the messages whose whole text comes from outside the model and the recipe
REPLY_ROLES = ("user", "system", "tool")  # an environment's reply as the user (user_turns.Reply.messages): only the
# model writes the completion's assistant messages (a reply's system message is marked outside: mark_outside)
# In any other message (system, assistant), the [start, end) character ranges of its content that came from outside
# (mark_outside): a dataset's system text inside our system prompt, a dataset's assistant message, a continuation's
# text inside the model's own message. The model's sampled text and the recipe's are not marked.
OUTSIDE_TEXT = "outside_text"
_MARK = "\x00MT_GRPO_TEXT_{}\x00"


def mark_outside(message: dict, start: int = 0, end: int | None = None) -> dict:
    """Mark `message["content"][start:end]` (to its end by default) as text from outside (OUTSIDE_TEXT): every
    render keeps it plain text (template_ids), the rest of the message renders as the template writes it. Returns
    `message`, changed in place."""
    end = len(message["content"]) if end is None else end
    if end > start:
        message[OUTSIDE_TEXT] = [*(message.get(OUTSIDE_TEXT) or []), [start, end]]
    return message


def with_outside_text(message, replace: Callable[[str], str]):
    """`message` with each piece of its text from outside (an OUTSIDE_ROLES message's whole text, another's
    OUTSIDE_TEXT ranges) replaced by `replace(piece)` (and its ranges gone); the message itself where nothing
    changes. Ranges that no longer fit the content (it was edited after it was marked) count the whole content as
    from outside."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (str, list)):
        return message
    if holds_images(content):  # text and image blocks: each text block's text (an image is no text)
        new = [dict(p, text=replace(p["text"])) if is_text_block(p) else p for p in content]
        same = all(not is_text_block(p) or p["text"] == q["text"] for p, q in zip(content, new))
        return message if same else dict(message, content=new)
    if message.get("role") in OUTSIDE_ROLES:  # a tool's content list renders as its text (content_text)
        text = content_text(content)
        return message if (new := replace(text)) == text else dict(message, content=new)
    ranges = sorted(tuple(r) for r in message.get(OUTSIDE_TEXT) or [])
    if not ranges or not isinstance(content, str):
        return message
    ends = [0, *(b for _, b in ranges)]
    if not all(ends[k] <= a <= b <= len(content) for k, (a, b) in enumerate(ranges)):
        ranges, ends = [(0, len(content))], [0, len(content)]
    new = "".join(content[ends[k]:a] + replace(content[a:b]) for k, (a, b) in enumerate(ranges)) + content[ends[-1]:]
    # the ranges belong to the old content
    return message if new == content else {**{k: v for k, v in message.items() if k != OUTSIDE_TEXT}, "content": new}


def outside_emptied(messages: list[dict]) -> list[dict]:
    """`messages` without their text from outside: what the template writes around it (the forged-control check)."""
    return [with_outside_text(m, lambda text: "") for m in messages]


def outside_pieces(messages: list[dict]) -> list[str]:
    """Every piece of text from outside in `messages` (with_outside_text's), in order."""
    pieces: list[str] = []
    for m in messages:
        with_outside_text(m, lambda text: pieces.append(text) or text)
    return pieces


def control_strings(tokenizer) -> list[str]:
    """Every added token's text (ChatML's `<|im_start|>`, Qwen's `<tool_call>`...), longest first: what a tokenizer
    matches whole in raw text."""
    cached = getattr(tokenizer, "_mt_grpo_control", None)
    if cached is None:
        cached = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content}, key=len,
                        reverse=True)
        try:
            tokenizer._mt_grpo_control = cached
        except AttributeError:  # a tokenizer that takes no attributes: recomputed each time
            pass
    return cached


def encode_text(tokenizer, text: str) -> list[int]:
    """`text` as plain text: special tokens split (`split_special_tokens`), and every other added token's string
    encoded in two pieces, so that no control token can come out of it."""
    control = control_strings(tokenizer)
    if not any(c in text for c in control):
        return tokenizer.encode(text, add_special_tokens=False)
    pattern = "(" + "|".join(re.escape(c) for c in control) + ")"
    ids = []
    for k, piece in enumerate(re.split(pattern, text)):
        if k % 2:  # a control string: its first character apart, so the tokenizer never sees it whole
            ids += tokenizer.encode(piece[0], add_special_tokens=False, split_special_tokens=True)
            piece = piece[1:]
        ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True) if piece else []
    return ids


def template_ids(tokenizer, render: Callable[[list[dict]], str], messages: list[dict]) -> list[int]:
    """Token ids of `render(messages)` (a chat template's text) with each message's text from outside (OUTSIDE_ROLES'
    whole text, the OUTSIDE_TEXT ranges of the others) as plain text (encode_text): the template's own tokens and
    the model's text stay as the template writes them, the outside text cannot become a control token. Only pieces
    holding a control string are encoded apart, so everything else tokenizes as one render does."""
    control, texts = control_strings(tokenizer), []

    def hide(text: str) -> str:  # a piece holding a control string -> a placeholder, encoded apart below
        if not any(c in text for c in control):
            return text
        texts.append(text)
        return _MARK.format(len(texts) - 1)

    marked = [with_outside_text(m, hide) for m in messages]
    if not texts:
        return tokenizer.encode(render(messages), add_special_tokens=False)
    pieces = re.split(_MARK.format("(\\d+)").replace("\x00", "\\x00"), render(marked))
    ids = []
    for k, piece in enumerate(pieces):
        ids += encode_text(tokenizer, texts[int(piece)]) if k % 2 else tokenizer.encode(piece, add_special_tokens=False)
    return ids


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


# ------------------------------------------------------------------------------------------------
# Prompts: the system prompt's parts, worked examples, and the user's prompt (TRL's formats)
# ------------------------------------------------------------------------------------------------
EXAMPLE_FIELDS = {"question", "steps", "thought", "answer", "tool_formats"}
STEP_FIELDS = {"thought", "tool", "args", "result"}  # a tool step: the model's call and the tool's output
REPLY_STEP_FIELDS = {"thought", "answer", "reply"}  # a reply step: the model's answer and the environment's reply
EXAMPLE_SHAPE = ('{"question": str, "steps": [{"thought": str (optional), "tool": str, "args": {...}, "result": str}'
                 ' or {"thought": str (optional), "answer": str, "reply": str}, ...], "thought": str (optional), '
                 '"answer": str}')
EXAMPLE_FILES = (".json", ".jsonl", ".yaml", ".yml")
TEXT_FILES = (".txt", ".md")
PROMPT_ROLES = ("system", "user", "assistant")
PLACEHOLDERS = {str: "...", int: 1, float: 1.5, bool: True}  # a neutral value of each argument type


def task_text(task_prompt: str | None, questions: bool = True) -> str:
    return (task_prompt or (DEFAULT_TASK_PROMPT if questions else "")).strip()


def neutral_example(tools: list[Callable]) -> dict | None:
    """The call a system prompt shows when the task gives no worked example: the first tool with placeholder
    arguments, and a placeholder answer, so that no task's wording reaches another. None without tools."""
    if not tools:
        return None
    name = tools[0].__name__
    return {"question": "...", "steps": [{"thought": f"I call {name} for this.", "tool": name,
                                          "args": neutral_arguments(tools[0]), "result": "..."}],
            "thought": "The result gives the answer.", "answer": "..."}


def neutral_arguments(fn: Callable) -> dict:
    """The required arguments of `fn` (else its first), each with a placeholder of its type hint: a string
    "...", an integer 1, a number 1.5, a boolean true, a list of one placeholder."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # a hint that does not resolve: the signature's annotation, else a string
        hints = {}
    required = [p for p in params if p.default is p.empty] or params[:1]
    # A callable with a `__signature__` (an MCP tool) may carry its types there only.
    return {p.name: _placeholder(hints.get(p.name, str if p.annotation is p.empty else p.annotation))
            for p in required}


def _placeholder(hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return args[0]
    if origin in (Union, types.UnionType):  # Optional[X], X | None: X
        return _placeholder(next((a for a in args if a is not type(None)), str))
    if hint in PLACEHOLDERS:
        return PLACEHOLDERS[hint]
    if origin in (list, tuple, set) or hint in (list, tuple, set):
        return [_placeholder(args[0])] if args else []
    if origin is dict or hint is dict:
        return {}
    return "..."


def check_examples(examples, tools: list[Callable] | None = None, source: str = "few_shot_examples") -> list[dict]:
    """`examples` if they are worked examples of this run's `tools` (None: only their shape is checked), else a
    ValueError naming the example, the field and the fix. A worked example:

        {"question": "What is 17 * 23?",
         "steps": [{"thought": "I multiply.", "tool": "calculator", "args": {"expression": "17 * 23"},
                    "result": "391"}],
         "thought": "The result is 391.", "answer": "391"}

    `steps` may be empty (an answer without a call); the thoughts are optional (the xml protocol shows them as
    <reasoning>, chat_template only the answer's). A step is a tool call, as above, or a reply step: an answer and
    the environment's reply to it as the user (what `respond` gives, rollout/user_turns.py), for a game with
    feedback; the model's turn renders as the example's answer turn does, the reply as a user message:

        {"question": "Guess my number, from 1 to 10.",
         "steps": [{"thought": "The middle.", "answer": "5", "reply": "Higher."}],
         "thought": "Above 5: I try 7.", "answer": "7"}

    `tool_formats` (optional, a list of protocol names) shows the example only with those protocols."""
    if not isinstance(examples, list):
        raise ValueError(f"{source} must be a list of worked examples, each {EXAMPLE_SHAPE}; got a "
                         f"{type(examples).__name__}.")
    names = [fn.__name__ for fn in tools] if tools is not None else None
    for i, example in enumerate(examples):
        where = f"{source}[{i}]"
        if not isinstance(example, dict):
            raise ValueError(f"{where} is a {type(example).__name__}; write each example as {EXAMPLE_SHAPE}.")
        _check_fields(example, EXAMPLE_FIELDS, where)
        for key in ("question", "answer"):
            _check_text(example.get(key), f"{where}.{key}")
        if "thought" in example:
            _check_text(example["thought"], f"{where}.thought")
        formats = example.get("tool_formats", list(PROTOCOLS))
        if not isinstance(formats, list) or not formats or not set(formats) <= set(PROTOCOLS):
            raise ValueError(f"{where}.tool_formats is {formats!r}; list some of {sorted(PROTOCOLS)}, or leave it "
                             "out to show the example with every tool format.")
        steps = example.get("steps", [])
        if not isinstance(steps, list):
            raise ValueError(f"{where}.steps must be a list of tool calls {{tool, args, result}} and replies "
                             f"{{answer, reply}}; got a {type(steps).__name__}.")
        for j, step in enumerate(steps):
            _check_step(step, f"{where}.steps[{j}]", dict(zip(names, tools)) if names is not None else None)
    return examples


def _check_fields(part: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(part) - allowed)
    if unknown:
        raise ValueError(f"{where} has the unknown field(s) {unknown}; its fields are {sorted(allowed)}.")


def _check_text(value, where: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a non-empty string; got {value!r}.")


def _check_step(step, where: str, tools: dict[str, Callable] | None) -> None:
    if not isinstance(step, dict):
        raise ValueError(f"{where} is a {type(step).__name__}; write each step as a tool call "
                         '{"thought": ..., "tool": ..., "args": {...}, "result": ...} or a reply '
                         '{"thought": ..., "answer": ..., "reply": ...}.')
    if "thought" in step:
        _check_text(step["thought"], f"{where}.thought")
    if set(step) & {"answer", "reply"}:
        _check_reply_step(step, where)
        return
    if unknown := sorted(set(step) - STEP_FIELDS):
        raise ValueError(f"{where} has the unknown field(s) {unknown}; a tool step's fields are {sorted(STEP_FIELDS)}"
                         f", a reply step's {sorted(REPLY_STEP_FIELDS)}.")
    for key in ("tool", "result"):
        _check_text(step.get(key), f"{where}.{key}")
    args = step.get("args", {})
    if not isinstance(args, dict):
        raise ValueError(f"{where}.args must be an object of keyword arguments; got {args!r}.")
    if tools is None:
        return
    if step["tool"] not in tools:
        raise ValueError(f"{where}.tool is {step['tool']!r}, not one of this run's tools "
                         f"({', '.join(tools) or 'none'}). Call one of them in the example, or add it to `tools`.")
    params = inspect.signature(tools[step["tool"]]).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    unknown = [a for a in args if a not in params]
    missing = [n for n, p in params.items() if p.default is p.empty and p.kind != p.VAR_POSITIONAL and n not in args]
    if unknown or missing:
        raise ValueError(f"{where}.args {args} do not fit {step['tool']}{inspect.signature(tools[step['tool']])}: "
                         + "; ".join([f"no argument {a!r}" for a in unknown] + [f"{m!r} is required" for m in missing])
                         + ". Use the tool's argument names.")


def _check_reply_step(step: dict, where: str) -> None:
    """A reply step: the model's answer turn and the environment's reply to it as the user (respond's), one of each."""
    if mixed := sorted(set(step) & (STEP_FIELDS - {"thought"})):
        raise ValueError(f"{where} mixes a reply step (answer, reply) and a tool step ({', '.join(mixed)}); a step is "
                         "one model turn, a tool call {tool, args, result} or an answer the environment replies to "
                         "{answer, reply}: split it into two steps.")
    if unknown := sorted(set(step) - REPLY_STEP_FIELDS):
        raise ValueError(f"{where} has the unknown field(s) {unknown}; a reply step's fields are "
                         f"{sorted(REPLY_STEP_FIELDS)}.")
    if "answer" not in step:
        raise ValueError(f"{where} has a reply but no answer; a reply answers the model's answer turn: give the "
                         "step's `answer` (what the model wrote before the reply).")
    if "reply" not in step:
        raise ValueError(f"{where} has an answer but no reply; give `reply` (the environment's message to that "
                         "answer), or, if the example ends on this answer, make it the example's own `answer`.")
    for key in ("answer", "reply"):
        _check_text(step[key], f"{where}.{key}")


def tool_steps(example: dict) -> list[dict]:
    """A worked example's tool steps, without its reply steps (check_examples)."""
    return [step for step in example.get("steps", []) if "reply" not in step]


def load_examples(value, source: str = "few_shot_examples") -> list[dict] | None:
    """Worked examples from a recipe: None, a list of them (inline YAML), or the path of a .json (a list),
    .jsonl (one example per line) or .yaml file (a list). Their shape is checked here, their tools by
    `build_prompt` (which knows the run's tools)."""
    if value is None or isinstance(value, list):
        return None if value is None else check_examples(value, source=source)
    if not isinstance(value, str):
        raise ValueError(f"{source} is a {type(value).__name__}; give a list of examples, or the path of a "
                         f"{'/'.join(EXAMPLE_FILES)} file of them.")
    extension = os.path.splitext(value)[1].lower()
    if extension not in EXAMPLE_FILES:
        raise ValueError(f"{source} {value!r} is not a {'/'.join(EXAMPLE_FILES)} file; give such a file of worked "
                         "examples, or write them inline in the recipe as a YAML list.")
    if not os.path.isfile(value):
        raise FileNotFoundError(f"{source} file {value!r} does not exist (cwd: {os.getcwd()}). Fix the path, or "
                                "write the examples inline in the recipe as a YAML list.")
    with open(value, encoding="utf-8") as f:
        text = f.read()
    try:
        if extension == ".jsonl":
            examples = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif extension == ".json":
            examples = json.loads(text)
        else:
            import yaml  # a dependency of TRL's recipe parser

            examples = yaml.safe_load(text)
    except ValueError as e:  # json.JSONDecodeError
        raise ValueError(f"{source} file {value!r} is not valid JSON ({e}).") from None
    except Exception as e:  # yaml.YAMLError
        raise ValueError(f"{source} file {value!r} is not valid YAML ({e}).") from None
    return check_examples(examples, source=value)


def load_text(value, source: str = "system_prompt") -> str | None:
    """Text from a recipe: None, the text inline, or the path of an existing .txt / .md file of it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{source} is a {type(value).__name__}; give the text, or the path of a "
                         f"{'/'.join(TEXT_FILES)} file of it.")
    text = value
    if value.lower().endswith(TEXT_FILES) and "\n" not in value:
        if not os.path.isfile(value):
            raise FileNotFoundError(f"{source} {value!r} names no existing file (cwd: {os.getcwd()}). Fix the path, "
                                    "or write the text itself.")
        with open(value, encoding="utf-8") as f:
            text = f.read()
    if not text.strip():
        raise ValueError(f"{source} {value!r} is empty; write the text, or leave {source} out.")
    return text.strip()


def prompt_problem(prompt) -> str:
    """What is wrong with a TRL prompt: a string (standard format) or a list of {"role", "content"} messages
    ending with a user message (conversational format); "" when nothing is."""
    if isinstance(prompt, str):
        return "" if prompt.strip() else "empty prompt"
    if not isinstance(prompt, list):
        return f"prompt is a {type(prompt).__name__}, not a string or a list of messages"
    if not prompt:
        return "prompt has no messages"
    for k, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"prompt message {k} is a {type(m).__name__}, not a {{\"role\", \"content\"}} object"
        if m.get("role") not in PROMPT_ROLES:
            return f"prompt message {k} has the role {m.get('role')!r}, not one of {', '.join(PROMPT_ROLES)}"
        if not isinstance(m.get("content"), str) and not (m["role"] == "user" and holds_images(m.get("content"))):
            return f"prompt message {k} has no text `content` (a {type(m.get('content')).__name__})"
        if m["role"] == "system" and k > 0:
            return f"prompt message {k} is a system message; only the first may be"
    if prompt[-1]["role"] != "user":
        return f"prompt ends with a {prompt[-1]['role']} message, not a user one"
    return ""


def prompt_messages(prompt) -> list[dict]:
    """A TRL prompt as chat messages: a string is one user message. Raises ValueError for a malformed one."""
    if problem := prompt_problem(prompt):
        raise ValueError(f"{problem}. A prompt is a string, or a list of {{\"role\", \"content\"}} messages "
                         "(roles system, user, assistant) that ends with a user message.")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def prompt_question(prompt) -> str:
    """The question of a TRL prompt: the text, or the last user message's (for rewards that read `question`)."""
    return prompt if isinstance(prompt, str) else next(content_text(m["content"]) for m in reversed(prompt)
                                                       if m["role"] == "user")  # a message with images: its text


def run_examples(protocol: Protocol, tools: list[Callable], examples) -> list[dict]:
    """The worked examples this protocol shows for these tools: `examples` is a list, None, or a function of
    the tools (a task's default examples that adapt to the run's tools)."""
    examples = examples(tools) if callable(examples) else examples or []
    check_examples(examples, tools)
    return [e for e in examples if protocol.name in e.get("tool_formats", [protocol.name])]


def build_prompt(protocol: Protocol, tools: list[Callable], prompt: str | list[dict], task_prompt: str | None = None,
                 examples=None, few_shot: bool = True, questions: bool = True) -> list[dict]:
    """The canonical chat prompt of an episode: [system, *worked examples as turns (with `few_shot`), *the
    user's turns]. `prompt`: a question (TRL's standard format) or chat messages (conversational). A
    conversational prompt's own system message replaces `task_prompt`, the task's part of the system message;
    the protocol's tool part follows either, so the model always sees the call format. The system message
    shows a call in text only when no worked example is shown as turns."""
    messages, outside = prompt_messages(prompt), None
    if messages[0]["role"] == "system":
        task_prompt, messages = messages[0]["content"], messages[1:]
        outside = task_prompt.strip()  # the prompt's own system text: from outside, as its other messages are
    examples = run_examples(protocol, tools, examples)
    shots = protocol.few_shot(tools, examples) if few_shot else []
    example = next((e for e in examples if tool_steps(e)), None)  # the first with a call, for the text example
    system = protocol.system_prompt(tools, task_prompt, with_example=not shots, example=example, questions=questions)
    system = [{"role": "system", "content": system}] if system else []
    if system and outside:  # where the protocol wrote it; the whole message if it rewrote it
        at = system[0]["content"].find(outside)
        mark_outside(system[0], *((at, at + len(outside)) if at >= 0 else (0,)))
    # the prompt's assistant messages are text from outside (user ones are, by their role); the model's own turns
    # follow the prompt as its sampled ids
    return [*system, *shots, *(mark_outside(m) if m["role"] == "assistant" else m for m in messages)]
