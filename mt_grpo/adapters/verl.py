"""verl 0.7.1's tools, interactions and reward functions, trained here unchanged.

    verl_tool_config: tool_config.yaml                  # verl's `multi_turn.tool_config_path`
    verl_interaction_config: interaction_config.yaml    # verl's `multi_turn.interaction_config_path`
    verl_max_assistant_turns: 5                         # verl's `multi_turn.max_assistant_turns` (or not)
    dataset_name: train.parquet                         # verl's parquet: prompt, data_source, reward_model, extra_info
    outcome_reward_funcs: [verl.utils.reward_score.default_compute_score]   # or your `compute_score`

What verl 0.7.1 does (its only multi-turn rollout is ToolAgentLoop, verl/experimental/agent_loop/tool_agent_loop.py;
the older SGLangRollout loop, which created each tool once per episode, is gone) and what it is here:

    verl                                          here
    tools: [{class_name, config, tool_schema}]    `cls(config=config, tool_schema=OpenAIFunctionToolSchema)`, once
                                                  per run (verl: once per rollout worker), shared by the episodes
    tool_schema.model_dump(exclude_unset,         the tool's schema in the chat template, as given: the generated
        exclude_none)                             method carries it as `json_schema` (no schema restated)
    per tool CALL: create(create_kwargs=...),     the same, per call: `create(create_kwargs=row's extra_info.
        execute(id, args, agent_data=...),        tools_kwargs[name].create_kwargs)`, `execute(instance_id, the
        release(id) in a finally                  model's arguments, agent_data=...)`, `release` in a finally
    an exception in create/execute -> "Error      the same text to the model, and a step reward of 0.0
        when executing tool: {e}", reward 0.0
    a worker's calls on one event loop           each episode's on its instance's own loop, bounded by tool_timeout:
                                                  an `execute` that blocks stalls only its episode (an object a tool
                                                  binds to a loop, an asyncio.Lock its calls share, is used from
                                                  several loops here)
    execute's step reward -> tool_rewards         appended to `step_rewards`: the turn's reward R_T (`tool_rewards`
                                                  is that list, for compute_score's extra_info)
    a name no tool has -> "Error when executing   the trainer's error text; 0.0 appended (`unknown_tool_reward`) by
        tool: 'name'", 0.0 in tool_rewards        the Toolset, once toolset.py reads it
    interaction: [{name, class_name, config}]     `cls(config={**config, "name": name})`, once per run; `name`
                                                  defaults to the class name without "Interaction", lowercased
    extra_info.interaction_kwargs (.name picks)   the same (a top-level `interaction_kwargs` column is read too)
    start_interaction(request_id, **kwargs)       in `reset`
    a turn without a tool call ->                 `respond(messages)`: Reply(content=response, done=
        generate_response(request_id, messages,   should_terminate, score=score); the score is the turn's R_T and
        **kwargs) -> (terminate, text, score, _)  goes to `turn_scores`
    (finalize_interaction: never called in 0.7.1) `end_episode`: always, also after an error or a timeout
    multi_turn.max_assistant_turns: after that    `verl_max_assistant_turns`: the class's `max_assistant_turns`, and
        many model turns, the episode ends (no    max_env_steps at most one less (user_turns.last_turn; stop reason
        call run, no interaction reply)           max_assistant_turns); a tool turn after user turns can pass it
                                                  (logged once)
    no per-turn cap: a turn ends at EOS or at     a turn cut by max_tokens_per_turn is answered by the interaction
        the response budget, and any turn that    (`replies_to_cut_turns`); a cut turn with a tool call ends the
        leaves budget is parsed and answered      episode (turn_length), its calls not run (logged once)
    compute_score(data_source, solution_str,      any function with that signature, by name or dotted path, in
        ground_truth, extra_info)                 the reward lists (`verl_reward`); a dict return's "score"

Left out, and why:
    calc_reward         0.7.1's agent loop never calls it (the tool's instance is released after each call).
    max_parallel_calls  verl runs the first call of a turn by default (max_parallel_calls: 1) and drops the rest;
                        here every call of a turn runs, in order (max_env_steps bounds the turns).
    tool response length  verl cuts a response to max_tool_response_length characters (256); here the trainer's
                        max_tool_response_tokens cuts it, with a marker.
    videos              a ToolResponse's video is refused (return its frames as images); its images reach the model
                        (a vision-language policy: engine/vision.py), one block each, then its text.
    OmegaConf           the YAML is read with yaml.safe_load: `${...}` interpolations are refused, naming the key.
    AgentData           a tool that reads `agent_data` gets its request_id, tools_kwargs, interaction_kwargs,
                        tool_rewards, turn_scores, extra_fields and metrics, and `messages`: the prompt and what the
                        episode's last `respond` saw (a tool call does not see the conversation here).
"""

import asyncio
import importlib
import inspect
import logging
import os
import threading
import types
import uuid
from typing import Callable

from mt_grpo.adapters import Adapted
from mt_grpo.compat import provide
from mt_grpo.base.runtime import own_event_loop, run_async

logger = logging.getLogger("mt_grpo")

VERL_VERSION = "0.7.1"  # the release whose contracts this module follows (tool_agent_loop.py, reward_loop)
TOOL_ERROR = "Error when executing tool: {}"  # 0.7.1's ToolAgentLoop._call_tool, shown to the model


# ------------------------------------------------------------------------------------------------
# The recipe fields -> an Adapted
# ------------------------------------------------------------------------------------------------
def adapt(args) -> Adapted:
    """verl's tool and/or interaction configs as one environment class (its methods the native tools) and the MCP
    tools the tool config names (stateless functions)."""
    cap = max_assistant_turns(args)
    provide("verl")  # before the configs' classes import: the installed verl, else the copy in mt_grpo/compat
    timeout = float(getattr(args, "tool_timeout", 30.0) or 30.0)
    tools, served = load_tools(args.verl_tool_config, timeout) if args.verl_tool_config else ([], [])
    interactions = load_interactions(args.verl_interaction_config) if args.verl_interaction_config else {}
    factory = environment_class(tools, interactions, cap) if tools or interactions else None
    # the cap's turn holds its calls back: max_env_steps stops a tool turn (the trainer's record_model_turn), exactly
    # where the episode had no user turn (user_turns.last_turn)
    settings = {"max_env_steps": cap - 1} if cap is not None and (tools or served) else {}
    train = verl_image_dataset(getattr(args, "dataset_name", None), getattr(args, "max_samples", None))
    return Adapted(environment_factory=factory, tools=served, settings=settings, train_dataset=train,
                   read_dataset_name=train is not None)


IMAGE_TAG = "<image>"  # where verl's rows mark an image in a prompt's text


def verl_image_dataset(name, max_samples=None):
    """A recipe's dataset when it is a local parquet file of verl's multimodal rows (an `images` column, each image
    marked `<image>` in the prompt's text, as verl's geo3k preprocessing writes them): as a datasets.Dataset whose
    prompts hold the text without its tags, the row's `images` going where they stood: first in the first user message
    (engine/vision.prompt_with_images, TRL's `images` column), which is where geo3k's tags are. A tag elsewhere (later
    in the text, in another message), a count of tags other than the row's images, or a `<video>` is refused, naming
    the row. None for any other dataset (the trainer loads it as usual)."""
    if not isinstance(name, str) or not name.endswith(".parquet") or not os.path.isfile(name):
        return None
    import datasets

    data = datasets.load_dataset("parquet", data_files=name, split="train")
    if "images" not in data.column_names or "prompt" not in data.column_names:
        return None

    def untagged(row, index):
        messages, images = [dict(m) for m in row["prompt"]], row["images"] or []
        first = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
        text = messages[first]["content"] if first is not None else ""
        tags = 0
        while text.startswith(IMAGE_TAG, tags * len(IMAGE_TAG)):
            tags += 1
        rest = text[tags * len(IMAGE_TAG):]
        elsewhere = IMAGE_TAG in rest or any(IMAGE_TAG in (m["content"] or "") for k, m in enumerate(messages)
                                             if k != first)
        if "<video>" in str(row["prompt"]) or elsewhere or tags != len(images):
            raise ValueError(f"Row {index} of {name}: its prompt has {tags} `<image>` tags at the start of its first "
                             f"user message for its {len(images)} images" + (", and more elsewhere" if elsewhere else "")
                             + (" and a <video> (videos are not supported)" if "<video>" in str(row["prompt"]) else "")
                             + ": put one `<image>` per image at the start of the first user message, as geo3k does.")
        messages[first]["content"] = rest
        return {"prompt": messages}

    data = data.map(untagged, with_indices=True)
    return data.select(range(min(max_samples, len(data)))) if max_samples is not None else data


def max_assistant_turns(args) -> int | None:
    """The recipe's `verl_max_assistant_turns` (at least 1: its field's minimum), with a config whose episodes it
    bounds."""
    cap = getattr(args, "verl_max_assistant_turns", None)
    if cap is None:
        return None
    if not (getattr(args, "verl_tool_config", None) or getattr(args, "verl_interaction_config", None)):
        raise ValueError("`verl_max_assistant_turns` is set but neither `verl_tool_config` nor "
                         "`verl_interaction_config` is: it bounds their episodes; name one, or drop it.")
    return cap


# ------------------------------------------------------------------------------------------------
# Reading verl's YAML files
# ------------------------------------------------------------------------------------------------
def read_yaml(path: str, field: str, key: str) -> list:
    """The list under `key` of the YAML file at `path` (the recipe's `field`)."""
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"`{field}: {path}` is not a file: give the path of verl's YAML (relative to the directory "
                         "the trainer runs in, or absolute).")
    with open(path) as f:
        try:
            config = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"`{field}: {path}` is not valid YAML: {e}") from None
    entries = config.get(key) if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"`{field}: {path}` has no `{key}:` list; verl's file is `{key}:` followed by a list of "
                         f"entries, each with a `class_name` ({'tools' if key == 'tools' else 'interaction'} "
                         "example in docs/guide.md, 'From verl').")
    _refuse_interpolation(entries, f"{path}: {key}")
    return entries


def _refuse_interpolation(value, where: str) -> None:
    """verl reads these files with OmegaConf, which resolves `${...}`; yaml does not, so one is refused by name."""
    if isinstance(value, str) and "${" in value:
        raise ValueError(f"{where} holds the OmegaConf interpolation {value!r}, which is not resolved here: write "
                         "the value itself.")
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_interpolation(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_interpolation(v, f"{where}[{i}]")


def import_class(dotted: str, where: str) -> type:
    """`package.module.Class` as verl's get_tool_class / get_interaction_class import it (a `module:Class` too)."""
    if not isinstance(dotted, str) or not dotted.strip():
        raise ValueError(f"{where} has no `class_name`: give the class's dotted path, e.g. "
                         "`verl.tools.gsm8k_tool.Gsm8kTool`.")
    module_name, _, name = dotted.replace(":", ".").rpartition(".")
    try:
        module = importlib.import_module(module_name) if module_name else None
    except ImportError as e:
        raise ValueError(f"{where}: `class_name: {dotted}`: module {module_name!r} does not import ({e}). Check the "
                         "path, and that its package is installed or its folder is on PYTHONPATH (the trainer runs "
                         "from its own directory).") from None
    cls = getattr(module, name, None) if module is not None else None
    if not isinstance(cls, type):
        raise ValueError(f"{where}: `class_name: {dotted}`: {module_name or dotted!r} has no class {name!r}. Give "
                         "`package.module.ClassName`.")
    return cls


def schema_model():
    """verl's OpenAIFunctionToolSchema (pydantic): the installed verl's, else the copy's (mt_grpo/compat)."""
    provide("verl")
    return importlib.import_module("verl.tools.schemas").OpenAIFunctionToolSchema


# ------------------------------------------------------------------------------------------------
# Tools
# ------------------------------------------------------------------------------------------------
def load_tools(path: str, timeout: float) -> tuple[list, list[Callable]]:
    """(verl's native tool objects, the MCP tools as functions) of the tool config at `path`, each native tool built
    as 0.7.1's initialize_tools_from_config builds it. Two tools of one name fail."""
    native, served = [], []
    for i, entry in enumerate(read_yaml(path, "verl_tool_config", "tools")):
        where = f"verl_tool_config {path}, tools[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a mapping: each entry has `class_name`, `config` and `tool_schema`.")
        config = entry.get("config") or {}
        kind = config.get("type", "native")  # 0.7.1 requires it; older examples wrote `config: {}` for native
        if kind == "mcp":
            served += mcp_entry_tools(entry, where, timeout)
            continue
        if kind != "native":
            raise ValueError(f"{where}: `config.type: {kind}` is not a verl tool type: use `native` (a BaseTool "
                             "class) or `mcp` (the tools of an mcpServers JSON).")
        cls = import_class(entry.get("class_name"), where)
        if entry.get("tool_schema") is None:
            raise ValueError(f"{where} ({entry['class_name']}) has no `tool_schema`: write the tool's OpenAI function "
                             "schema under `tool_schema:` ({type: function, function: {name, description, "
                             "parameters}}), as verl's gsm8k_tool_config.yaml does.")
        try:
            schema = schema_model().model_validate(entry["tool_schema"])
        except Exception as e:  # pydantic's ValidationError, listing the bad fields
            raise ValueError(f"{where}: `tool_schema` is not an OpenAI function schema: {e}") from None
        native.append(cls(config=config, tool_schema=schema))
    names = [tool_name(t) for t in native] + [fn.__name__ for fn in served]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"verl_tool_config {path} gives two tools the name(s) {twice}, and the model calls a tool by "
                         "its name: rename one (`tool_schema.function.name`).")
    return native, served


def tool_name(tool) -> str:
    return getattr(tool, "name", None) or tool.tool_schema.function.name


def tool_json_schema(tool) -> dict:
    """What verl gives the chat template for the tool: `tool.tool_schema.model_dump(exclude_unset=True,
    exclude_none=True)`."""
    schema = tool.tool_schema
    return schema.model_dump(exclude_unset=True, exclude_none=True) if hasattr(schema, "model_dump") else dict(schema)


def mcp_entry_tools(entry: dict, where: str, timeout: float) -> list[Callable]:
    """An `mcp` entry's tools: the servers of its mcpServers JSON (`mcp.mcp_servers_config_path`), filtered by
    `mcp.tool_selected_list`, as functions (tools.mcp.mcp_tools_from_map). verl wraps each in the entry's class
    (MCPBaseTool subclasses that post-process the text); here the server's text reaches the model as is."""
    import json

    mcp = entry.get("mcp") or {}
    config_path = mcp.get("mcp_servers_config_path")
    if not config_path or not os.path.isfile(config_path):
        raise ValueError(f"{where}: an `mcp` tool needs `mcp: {{mcp_servers_config_path: servers.json}}`, the path of "
                         f"an existing mcpServers JSON; got {config_path!r}.")
    with open(config_path) as f:
        servers = json.load(f)
    servers = servers.get("mcpServers", servers) if isinstance(servers, dict) else servers
    from mt_grpo.tools.mcp import mcp_tools_from_map

    if entry.get("class_name") and not str(entry["class_name"]).startswith("verl.tools.mcp"):
        logger.warning("%s: class_name %s is not used: the MCP server's tool text reaches the model as is.", where,
                       entry["class_name"])
    return mcp_tools_from_map(servers, mcp.get("tool_selected_list"), timeout, source=f"{where} mcp_servers_config_path",
                              filter_field=f"{where} tool_selected_list")  # its errors name verl's own keys


async def call_tool(tool, name: str, parameters: dict, tools_kwargs: dict, agent_data) -> tuple[str, float | None]:
    """(the text the model sees, the step reward) of one call, as 0.7.1's ToolAgentLoop._call_tool makes it: a
    new instance per call, released in a finally; an exception in create or execute is the model's error text.
    Awaited on the calling episode's own loop (VerlEnvironment)."""
    instance_id = None
    try:
        created = await _awaited(tool.create(create_kwargs=(tools_kwargs.get(name) or {}).get("create_kwargs") or {}))
        instance_id = created[0] if isinstance(created, tuple) else created  # 0.7.1: (id, ToolResponse)
        extra = {"agent_data": agent_data} if _takes(tool.execute, "agent_data") else {}
        response, reward, _metrics = await _awaited(tool.execute(instance_id, parameters, **extra))
    except Exception as e:
        _log_once(f"{type(tool).__name__}.execute", "%s (tool %r) raised %s: %s; the model sees verl's error "
                  "text (first time only).", type(tool).__name__, name, type(e).__name__, e)
        return TOOL_ERROR.format(e), 0.0
    finally:
        if instance_id:
            await _awaited(tool.release(instance_id))
    return response_content(response, name), reward


def response_content(response, name: str):
    """What the model sees of what execute returned: a ToolResponse's `text`, or, where it has images, 0.7.1's
    multimodal tool message: its images, then its text, as blocks (engine/vision.py: each image a block, where verl
    writes one placeholder for the list); a string or dict as verl before 0.5. A video is refused, naming the fix."""
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return str(response.get("text") or "")
    text = getattr(response, "text", None) or ""
    if getattr(response, "video", None):
        raise ValueError(f"Tool {name!r} returned a ToolResponse with a video: videos are not supported (their frames "
                         "need the video processor and per-frame grids); return the frames as ToolResponse(image=[...]).")
    images = getattr(response, "image", None) or []
    return [*({"type": "image", "image": image} for image in images), *([{"type": "text", "text": text}] if text else [])
            ] if images else text


# ------------------------------------------------------------------------------------------------
# Interactions
# ------------------------------------------------------------------------------------------------
def load_interactions(path: str) -> dict:
    """{name: interaction object} as 0.7.1's initialize_interactions_from_config builds them."""
    interactions = {}
    for i, entry in enumerate(read_yaml(path, "verl_interaction_config", "interaction")):
        where = f"verl_interaction_config {path}, interaction[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a mapping: each entry has `name`, `class_name` and `config`.")
        cls = import_class(entry.get("class_name"), where)
        name = entry.get("name")
        if name is None:  # verl's default: the class name without its "Interaction" suffix, lowercased
            simple = entry["class_name"].replace(":", ".").split(".")[-1]
            name = (simple[:-11] if simple.endswith("Interaction") else simple).lower()
        if name in interactions:
            raise ValueError(f"{where}: the interaction name {name!r} is used twice; give each entry its own `name`.")
        interactions[name] = cls(config={**(entry.get("config") or {}), "name": name})
    return interactions


def interaction_kwargs(row: dict, names: list[str]) -> dict:
    """The row's interaction_kwargs (0.7.1 reads extra_info.interaction_kwargs; its dataset also copies them to a
    top-level column), checked: `name` must pick a configured interaction."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    kwargs = extra.get("interaction_kwargs") or row.get("interaction_kwargs")
    if not isinstance(kwargs, dict) or "name" not in kwargs or kwargs["name"] is None:
        raise ValueError(f"A row has no interaction name (extra_info.interaction_kwargs = {kwargs!r}); verl 0.7.1 "
                         "requires one: give each row `extra_info.interaction_kwargs.name`, one of "
                         f"{names}, beside the keywords its start_interaction takes (e.g. ground_truth).")
    if kwargs["name"] not in names:
        raise ValueError(f"A row's interaction_kwargs.name is {kwargs['name']!r}, which verl_interaction_config does "
                         f"not define (its interactions: {names}): fix the row, or add the interaction.")
    return dict(kwargs)


def verl_messages(messages: list[dict]) -> list[dict]:
    """The conversation as generate_response reads it: copies (an interaction may edit them), each with its role and
    content (a content list as its text), the assistant's tool_calls kept."""
    from mt_grpo.base.protocol import content_text

    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = content_text(m["content"])
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------------
# The environment class
# ------------------------------------------------------------------------------------------------
def environment_class(tools: list, interactions: dict, max_assistant_turns: int | None = None) -> type:
    """One environment_factory class for the configs: VerlEnvironment with a method per native tool (named after
    it, carrying its `json_schema`), `respond` when there are interactions, and verl's `max_assistant_turns`."""
    from mt_grpo.tools.mcp import tool_signature

    namespace = {"__doc__": VerlEnvironment.__doc__, "__module__": __name__, "max_assistant_turns": max_assistant_turns,
                 "_verl_tools": {tool_name(t): t for t in tools}, "_verl_interactions": dict(interactions)}
    for tool in tools:
        name, schema = tool_name(tool), tool_json_schema(tool)
        if name.startswith("_") or name in RESERVED:
            raise ValueError(f"verl tool {name!r} ({type(tool).__name__}): a tool's name here is a method's name of "
                             f"the environment, so it must not start with `_` nor be one of {sorted(RESERVED)}: "
                             "rename it in `tool_schema.function.name`.")
        namespace[name] = _tool_method(name, schema, tool_signature(schema["function"].get("parameters") or {}))
    bases = (VerlEnvironment, UserTurns) if interactions else (VerlEnvironment,)
    return type("VerlEnvironment", bases, namespace)


# the contract's names, and the attributes a VerlEnvironment keeps
RESERVED = ("reset", "respond", "end_episode", "get_reward", "step_rewards", "done", "tool_rewards", "turn_scores",
            "tools_kwargs", "interaction", "interaction_kwargs", "request_id", "agent_data", "max_assistant_turns",
            "replies_to_cut_turns", "unknown_tool_reward")


def _tool_method(name: str, schema: dict, signature: inspect.Signature) -> Callable:
    async def method(self, **parameters):
        text, reward = await call_tool(self._verl_tools[name], name, parameters, self.tools_kwargs, self.agent_data)
        if reward is not None:  # as verl appends it to tool_rewards, which is step_rewards: the turn's step reward
            self.step_rewards.append(float(reward))
        return text

    method.__name__ = method.__qualname__ = name
    method.__doc__ = schema["function"].get("description") or name
    method.__signature__ = signature.replace(parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                                                         *signature.parameters.values()],
                                             return_annotation=inspect.Signature.empty)
    # no return annotation: a ToolResponse is text, or images and text (response_content)
    method.__annotations__ = {p.name: p.annotation for p in signature.parameters.values() if p.annotation is not p.empty}
    method.json_schema = schema
    return method


class VerlEnvironment:
    """verl's tools and interactions (adapters/verl.py), one instance per episode; the objects verl built are
    shared by all instances (`_verl_tools`, `_verl_interactions`, set on the generated subclass). Every method is
    async, so that the trainer awaits it on the instance's own event loop, each call bounded on its own (verl runs a
    worker's calls on one loop; here an `execute` that blocks, a `time.sleep` or a synchronous HTTP call, stalls
    only its own episode, which times out and leaves the pool)."""

    _verl_tools: dict = {}
    _verl_interactions: dict = {}
    max_assistant_turns: int | None = None  # verl's multi_turn.max_assistant_turns (user_turns.last_turn)
    # verl's _call_tool gives a name it does not know (a KeyError) 0.0 in tool_rewards; the trainer's Toolset, which
    # answers such a call itself, appends this to step_rewards (toolset.py)
    unknown_tool_reward: float | None = 0.0

    def __init__(self):
        self.step_rewards = self.tool_rewards = []  # one list: verl's tool_rewards are the turns' step rewards
        self.turn_scores = []
        self.tools_kwargs, self.interaction, self.interaction_kwargs, self.request_id = {}, None, {}, None
        self.agent_data = None

    async def reset(self, **row):
        """A new episode: verl's request id, the row's tools_kwargs, and the row's interaction started."""
        self.step_rewards = self.tool_rewards = []
        self.turn_scores = []
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        self.tools_kwargs = dict(extra.get("tools_kwargs") or row.get("tools_kwargs") or {})
        self.request_id, self.interaction, self.interaction_kwargs = uuid.uuid4().hex, None, {}
        if self._verl_interactions:
            self.interaction_kwargs = interaction_kwargs(row, list(self._verl_interactions))
            interaction = self._verl_interactions[self.interaction_kwargs["name"]]
            await _awaited(interaction.start_interaction(self.request_id, **self.interaction_kwargs))
            self.interaction = interaction  # started: end_episode finalizes it
        self.agent_data = types.SimpleNamespace(
            messages=list(row.get("prompt") or []), request_id=self.request_id, tools_kwargs=self.tools_kwargs,
            interaction=self.interaction, interaction_kwargs=self.interaction_kwargs, tool_rewards=self.tool_rewards,
            turn_scores=self.turn_scores, extra_fields={}, metrics={}, image_data=None, video_data=None)
        return None

    async def end_episode(self):
        """finalize_interaction, for every episode that started one (0.7.1 never calls it; its docs ask for it)."""
        interaction, self.interaction = self.interaction, None
        if interaction is None:
            return
        finalize = interaction.finalize_interaction
        try:  # BaseInteraction's takes nothing; the shipped ones take (instance_id, **kwargs)
            await _awaited(finalize(self.request_id) if _positional(finalize) else finalize())
        except Exception as e:
            _log_once(f"{type(interaction).__name__}.finalize_interaction", "%s.finalize_interaction raised %s: %s "
                      "(first time only).", type(interaction).__name__, type(e).__name__, e)


class UserTurns:
    """`respond` of a run with interactions: the user's turns come from the row's interaction."""

    # verl has no per-turn cap: its loop parses and answers every turn that leaves budget, so a turn cut by
    # max_tokens_per_turn gets the interaction's reply too (user_turns.ask_user)
    replies_to_cut_turns = True

    async def respond(self, messages: list[dict]):
        """A model turn without a tool call: the interaction's generate_response, as the user's reply."""
        if self.interaction is None:
            return None
        conversation = verl_messages(messages)
        self.agent_data.messages = conversation
        terminate, content, score, _metadata = await _awaited(self.interaction.generate_response(
            self.request_id, conversation, **self.interaction_kwargs))
        if score is not None:
            self.turn_scores.append(score)
        return {"content": "" if content is None else str(content), "done": bool(terminate),
                "score": None if score is None else float(score)}


# ------------------------------------------------------------------------------------------------
# verl's compute_score as a reward function
# ------------------------------------------------------------------------------------------------
VERL_REWARD_PARAMS = ("data_source", "solution_str", "ground_truth")


def is_verl_reward(fn) -> bool:
    """Whether `fn` has verl's reward signature `(data_source, solution_str, ground_truth, extra_info=None, ...)`
    rather than TRL's `(prompts, completions, **kwargs)`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(p in params for p in VERL_REWARD_PARAMS) and "completions" not in params


def verl_reward(fn: Callable) -> Callable:
    """verl's `compute_score` as an outcome reward: per episode, `data_source` and `reward_model.ground_truth` from
    the row, `solution_str` the whole response as 0.7.1's reward loop decodes it (the completion's tokens, tool and
    user turns included, without special tokens), and `extra_info` the row's plus, as 0.7.1's agent loop adds them,
    `turn_scores`, `tool_rewards`, `num_turns` and `rollout_reward_scores` ({}). A dict's "score" is the reward; its
    other keys are logged as columns of the completions table. An async compute_score is awaited."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    name = getattr(fn, "__name__", "compute_score")

    def reward(prompts=None, completions=None, *, data_source, reward_model, extra_info=None, completion_ids=None,
               environments=None, log_extra=None, **kwargs):
        scores, extras = [], {}
        for i, completion in enumerate(completions):
            truth = reward_model[i].get("ground_truth") if isinstance(reward_model[i], dict) else None
            env = environments[i] if environments else None
            info = {**(extra_info[i] if extra_info and isinstance(extra_info[i], dict) else {}),
                    **episode_fields(completion, env)}
            ids = completion_ids[i] if completion_ids else None
            given = {"data_source": data_source[i], "solution_str": solution_text(completion, ids, reward.tokenizer),
                     "ground_truth": truth, "extra_info": info}
            result = fn(**{k: v for k, v in given.items() if takes_all or k in params})
            result = _run(result)
            if isinstance(result, dict):
                for key, value in result.items():
                    if key != "score":
                        extras.setdefault(key, [None] * len(completions))[i] = value
                result = result["score"]
            scores.append(result)
        if log_extra is not None:
            for key, values in extras.items():
                log_extra(f"{name}/{key}", values)
        return scores

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"verl's {name}(data_source, solution_str, ground_truth, extra_info) (adapters/verl.py)."
    reward.tokenizer = None  # builders.assemble sets the run's: solution_str is then exactly verl's
    reward.verl_compute_score = fn
    return reward


def solution_text(completion: list[dict], ids, tokenizer) -> str:
    """verl's solution_str: the completion's tokens decoded without special tokens. Without a tokenizer (a reward
    called outside the trainer), the messages' contents joined by newlines, which differs from it by the role
    headers the template writes."""
    if tokenizer is not None and ids is not None:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    from mt_grpo.base.protocol import content_text

    return "\n".join(c if isinstance(c := m.get("content"), str) else content_text(c or [])
                     for m in completion or [] if isinstance(m, dict))


def episode_fields(completion: list[dict], env) -> dict:
    """What 0.7.1 adds to extra_info for the reward: the episode's turn_scores and tool_rewards (from its verl
    environment, else the tool messages' step rewards), num_turns (assistant turns + the turns answered + 1, as
    ToolAgentLoop counts them) and rollout_reward_scores ({} without a reward model in the rollout)."""
    from mt_grpo.rewards.conversation import step_reward

    messages = [m for m in completion or [] if isinstance(m, dict)]
    if env is not None and hasattr(env, "turn_scores") and hasattr(env, "tool_rewards"):
        turn_scores, tool_rewards = list(env.turn_scores), list(env.tool_rewards)
    else:
        turn_scores, tool_rewards = [], [r for m in messages if (r := step_reward(m)) is not None]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    answered = [i for i in assistant if i + 1 < len(messages) and messages[i + 1].get("role") in ("tool", "user")]
    return {"turn_scores": turn_scores, "tool_rewards": tool_rewards, "num_turns": len(assistant) + len(answered) + 1,
            "rollout_reward_scores": {}}


# ------------------------------------------------------------------------------------------------
# Plumbing: an async compute_score's loop
# ------------------------------------------------------------------------------------------------
# verl runs a worker's tools and interactions on one event loop, shared by its concurrent requests (told apart by
# their instance ids); here each episode's calls run on its instance's own loop (VerlEnvironment), and only an async
# compute_score, which the rewards call one at a time, runs on this module's loop.
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()
_LOGGED: set[str] = set()


def _run(value):
    """`value` (a coroutine, or a sync method's return) awaited on the verl loop (started on first use), from any
    thread but the loop's own."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = own_event_loop("verl")
    return run_async(value, _LOOP)


async def _awaited(value):
    """verl awaits every method; a user's synchronous one returns its value as is."""
    return await value if inspect.isawaitable(value) else value


def _takes(method, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _positional(method) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _log_once(key: str, message: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(message, *args)
