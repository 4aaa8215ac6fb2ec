"""An OpenEnv environment trained unchanged: the recipe names its Environment class, `openenv_env:
my_env:MyEnvironment` (its Action class from `step`'s type hint, or `openenv_action: my_env:MyAction`), or the URL
of a server that serves one, `openenv_env: http://127.0.0.1:8000`. OpenEnv's contract, mapped:

    OpenEnv                                      here
    Environment()                                one per episode instance, made once and reset for each episode
    reset(seed=, episode_id=, ...) -> Obs        reset(**row): the row's columns that reset names (seed, ...); the
                                                 observation's text is the first observation (appended to the
                                                 prompt's last user message; with no dataset, the whole prompt).
                                                 A row without a seed (no dataset: every row) gets one drawn with
                                                 the run's `seed`, so a group's G episodes play one game
                                                 (run/builders.seed_rows)
    the Action pydantic model                    one tool, named after the class (GuessAction -> `guess`; a class
                                                 named just `Action` -> `step`), its JSON schema the tool's
                                                 parameters (less the framework's `metadata`), its docstring the
                                                 tool's description; a call that does not validate is an error the
                                                 model reads (pydantic's message)
    step(action) -> Observation                  the tool's result: the observation's text; a field that holds an
                                                 image (a PIL image, a data URL, (H, W, 3) pixels) is an image block
                                                 before the text, for a vision-language policy (engine/vision.py)
    Observation.reward                           step_rewards: that tool turn's R_T (`<Class>_steps`)
    Observation.done                             done: the episode ends after that turn
    an Observation as text                       its own fields (not done, reward, metadata): one field's value as
                                                 is; several as `name: value` lines (JSON for non-text values)

Over the network: `openenv_env: ws://host:port` speaks OpenEnv's WebSocket sessions (`/ws`, what its EnvClient
speaks: one session, one environment on the server, per episode instance); `openenv_env: http://host:port` its
HTTP endpoints with httpx: GET /schema (the action's JSON schema; a server without it needs `openenv_action`),
POST /reset {"episode_id", "seed"?} and POST /step {"action": {...}, "episode_id"} -> {"observation": {...},
"reward", "done"}. Each HTTP episode sends its own `episode_id` (ResetRequest's field; StepRequest takes extra
fields), so a server that keeps an environment per episode id runs concurrent episodes; OpenEnv's own server runs
each HTTP request on a fresh environment, so over HTTP it serves stateless environments only. See
docs/guide.md, 'From OpenEnv'.
"""

import inspect
import json
import re
import typing
import uuid
from typing import Callable

from mt_grpo.adapters import Adapted
from mt_grpo.compat import provide

OWN_FIELDS = ("done", "reward", "metadata")  # Observation's framework fields: not the observation's text
HTTP_TIMEOUT = 30.0  # seconds an HTTP reset or step may take
HTTP_RETRIES = 3  # retries of a /reset that fails (as the vLLM client's vllm_max_retries): 1, 2, 4 s apart


def adapt(args) -> Adapted:
    provide("openenv")  # before the user's module imports: the installed openenv, else the copy in mt_grpo/compat
    target = args.openenv_env
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"`openenv_env` is {target!r}; give the Environment class `module:Class` or its server's URL "
                         "(`ws://host:port` for its sessions, `http://host:port`).")
    action = load_action(args.openenv_action) if args.openenv_action else None
    if target.startswith(("ws://", "wss://")):
        factory = remote_class(target.rstrip("/"), action, SessionEpisode)
    elif target.startswith(("http://", "https://")):
        factory = remote_class(target.rstrip("/"), action)
    else:
        factory = local_class(load_environment_class(target), action)
    return Adapted(environment_factory=factory, group_seeds=True)  # a group plays one game: builders.seed_rows


# ------------------------------------------------------------------------------------------------
# The Environment and Action classes
# ------------------------------------------------------------------------------------------------
def load_environment_class(path: str) -> type:
    from mt_grpo.base.registry import resolve

    cls = resolve(path, {}, "OpenEnv environment (openenv_env)")
    if not (isinstance(cls, type) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"`openenv_env: {path}` is {cls!r}, not an OpenEnv Environment class (one with reset() and "
                         "step(action)): name the class, `module:MyEnvironment`.")
    return cls


def load_action(path: str) -> type:
    from mt_grpo.base.registry import resolve

    cls = resolve(path, {}, "OpenEnv action class (openenv_action)")
    if not (isinstance(cls, type) and callable(getattr(cls, "model_json_schema", None))):
        raise ValueError(f"`openenv_action: {path}` is {cls!r}, not an OpenEnv Action (a pydantic model): name the "
                         "class that `step` takes, `module:MyAction`.")
    return cls


def action_of(env_cls: type) -> type:
    """The Action class `step` takes, from its type hint: one pydantic model (a Union of several needs
    `openenv_action`)."""
    try:
        hint = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # a hint that does not resolve
        hint = None
    options = [a for a in typing.get_args(hint) if isinstance(a, type)] if typing.get_args(hint) else [hint]
    models = [a for a in options if isinstance(a, type) and callable(getattr(a, "model_json_schema", None))]
    if len(models) != 1:
        found = "no type hint" if hint is None else f"the type hint {hint!r}"
        raise ValueError(f"{env_cls.__name__}.step(action) has {found}, which names no single Action class: set "
                         "`openenv_action: module:MyAction`, the action the model takes.")
    return models[0]


def tool_name(class_name: str) -> str:
    """GuessAction -> guess, MoveTileAction -> move_tile, Action -> step."""
    stem = class_name[:-len("Action")] if class_name.endswith("Action") else class_name
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", stem).lower()
    return snake if snake.isidentifier() else "step"


def action_schema(schema: dict, class_name: str) -> dict:
    """The tool's JSON schema from the Action's: its fields but `metadata` (the framework's), its docstring as the
    description."""
    parameters = {k: v for k, v in schema.items() if k not in ("title", "description")}
    parameters["properties"] = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    parameters["required"] = [k for k in schema.get("required") or [] if k != "metadata"]
    parameters.setdefault("type", "object")
    description = " ".join((schema.get("description") or f"Take a {class_name} in the environment.").split())
    return {"type": "function", "function": {"name": tool_name(class_name), "description": description,
                                             "parameters": parameters}}


# ------------------------------------------------------------------------------------------------
# Observations as text
# ------------------------------------------------------------------------------------------------
def observation_fields(observation) -> dict:
    """An Observation (model or the HTTP reply's dict) as {field: value}, without done, reward and metadata."""
    data = observation.model_dump() if callable(getattr(observation, "model_dump", None)) else dict(observation)
    return {k: v for k, v in data.items() if k not in OWN_FIELDS}


def observation_text(observation) -> str:
    fields = observation_fields(observation)
    as_text = {k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in fields.items()}
    if len(as_text) == 1:
        return next(iter(as_text.values()))
    return "\n".join(f"{k}: {v}" for k, v in as_text.items())


def observation_image(value):
    """The image an observation's field holds, or None: a PIL image (a local environment's), a `data:image/...;base64`
    URL, or pixels as OpenEnv's environments send them over JSON, an (H, W, 3 or 4) array or nested list of 0-255
    integers (BrowserGym's `screenshot`)."""
    import base64
    import io

    from mt_grpo.engine.vision import is_image

    if is_image(value):
        return value
    if isinstance(value, str) and value.startswith("data:image/") and ";base64," in value:
        from PIL import Image

        return Image.open(io.BytesIO(base64.b64decode(value.split(",", 1)[1])))
    if isinstance(value, list) and value and isinstance(value[0], list) and value[0] and isinstance(value[0][0], list) \
            or type(value).__name__ == "ndarray":
        import numpy as np
        from PIL import Image

        pixels = np.asarray(value)
        if pixels.ndim == 3 and pixels.shape[-1] in (3, 4) and pixels.dtype.kind in "iu" and pixels.size and \
                pixels.min() >= 0 and pixels.max() <= 255:
            return Image.fromarray(pixels.astype(np.uint8))
    return None


def observation_content(observation):
    """What the model reads of an observation: its text (observation_text), or, where fields hold images
    (observation_image), the images, then the other fields' text, as engine/vision.py's blocks."""
    fields = observation_fields(observation)
    images = {k: image for k, v in fields.items() if (image := observation_image(v)) is not None}
    if not images:
        return observation_text(observation)
    text = observation_text({k: v for k, v in fields.items() if k not in images}) if len(images) < len(fields) else ""
    return [*({"type": "image", "image": image} for image in images.values()),
            *([{"type": "text", "text": text}] if text else [])]


def first_observation(prompt: list[dict] | None, observation):
    """The reset observation, after the prompt's last user message (a blank line between them when it has text); one
    that holds an image as blocks (observation_content), which join that message (environments.py)."""
    content = observation_content(observation)
    last = (prompt or [{}])[-1].get("content") or ""
    gap = "\n\n" if isinstance(last, str) and last.strip() else ""
    if isinstance(content, str):
        return gap + content
    return ([{"type": "text", "text": gap}] if gap else []) + content


def accepted(func: Callable, values: dict) -> dict:
    """The entries of `values` that `func` names (OpenEnv's server passes a request's fields so)."""
    params = inspect.signature(func).parameters
    return {k: v for k, v in values.items() if k in params and k not in ("self", "action")}


# ------------------------------------------------------------------------------------------------
# The episode classes
# ------------------------------------------------------------------------------------------------
class OpenEnvEpisode:
    """One episode of a local OpenEnv Environment (local_class makes a subclass per environment, with the action
    tool). The Environment instance is made once and reset for each episode, as OpenEnv's server reuses one."""

    env_cls: type = None
    action_cls: type = None

    def __init__(self):
        self.env = self.env_cls()
        self.step_rewards, self.done = [], False

    async def reset(self, prompt: list[dict] | None = None, **row):
        self.step_rewards, self.done = [], False
        is_async = getattr(type(self.env), "reset_async", None) is not _base_method(self.env, "reset_async")
        reset = self.env.reset_async if is_async else self.env.reset
        observation = reset(**accepted(reset, row))
        observation = await observation if inspect.isawaitable(observation) else observation
        return first_observation(prompt, observation)

    async def _act(self, arguments: dict) -> str:
        from pydantic import ValidationError

        try:
            action = self.action_cls(**arguments)
        except ValidationError as e:  # the model's call, refused: it reads why
            raise ValueError(_validation_text(e)) from None
        is_async = getattr(type(self.env), "step_async", None) is not _base_method(self.env, "step_async")
        observation = self.env.step_async(action) if is_async else self.env.step(action)
        observation = await observation if inspect.isawaitable(observation) else observation
        return self._observed(observation.reward, observation.done, observation)

    def _observed(self, reward, done, observation) -> str:
        if reward is not None:
            self.step_rewards.append(float(reward))
        self.done = bool(done)
        return observation_content(observation)


def _base_method(env, name: str):
    """OpenEnv's default `name` (reset_async calls reset): the one an Environment that defines no own keeps."""
    for klass in type(env).__mro__:
        if klass.__name__ == "Environment" and name in vars(klass):
            return vars(klass)[name]
    return None


def _validation_text(error) -> str:
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ()))) or 'action'}: {e.get('msg')}" for e in error.errors())


def _tool(schema: dict) -> Callable:
    """The action tool: a method with the schema's name, description and signature (tools/mcp.py builds one so),
    and the schema itself as json_schema."""
    from mt_grpo.tools.mcp import tool_signature

    function = schema["function"]
    signature = tool_signature(function["parameters"])
    keywords_only = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())

    async def act(self, *args, **kwargs):
        arguments = kwargs if keywords_only and not args else signature.bind(*args, **kwargs).arguments
        return await self._act(dict(arguments))

    act.__name__ = act.__qualname__ = function["name"]
    act.__doc__ = function["description"]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    act.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    act.__annotations__ = {**{p.name: p.annotation for p in signature.parameters.values()
                              if p.annotation is not p.empty}, "return": str}
    act.json_schema = schema
    return act


def local_class(env_cls: type, action_cls: type | None = None) -> type:
    action_cls = action_cls or action_of(env_cls)
    schema = action_schema(action_cls.model_json_schema(), action_cls.__name__)
    name = schema["function"]["name"]
    cls = type(env_cls.__name__, (OpenEnvEpisode,), {"env_cls": env_cls, "action_cls": action_cls,
                                                     name: _tool(schema)})
    cls.__module__ = __name__
    return cls


class RemoteEpisode:
    """One episode of an OpenEnv server over HTTP (remote_class makes a subclass per URL, with the action tool):
    POST /reset, then POST /step per call, both carrying the episode's own episode_id."""

    url: str = ""
    action_cls: type | None = None  # openenv_action, when given: calls are validated here first

    def __init__(self):
        import httpx

        self.http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
        self.episode_id, self.step_rewards, self.done = None, [], False

    def _post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            response = self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise ConnectionError(f"OpenEnv server {self.url}{path}: {type(e).__name__}: {e}") from None
        if response.status_code == 422:  # the action does not fit the schema: the model reads why
            raise ValueError(f"the server refused the action: {response.json().get('detail')}")
        if response.status_code != 200:
            raise ConnectionError(f"OpenEnv server {self.url}{path} answered {response.status_code}: "
                                  f"{response.text[:300]}")
        return response.json()

    def reset(self, prompt: list[dict] | None = None, **row) -> str:
        """POST /reset, retried as the vLLM client retries (a connection error, a 5xx, an answer that is not a JSON
        object: 1, 2, 4 s apart, within reset_timeout); then a ConnectionError naming the server. A step is not
        retried: it may have been applied."""
        from mt_grpo.base.completions import post_with_retries

        self.episode_id, self.step_rewards, self.done = uuid.uuid4().hex, [], False
        body = {"episode_id": self.episode_id, **({"seed": row["seed"]} if row.get("seed") is not None else {})}
        reply = post_with_retries(self.http, self.url, "/reset", body, _json_object, HTTP_RETRIES, "OpenEnv server")
        return first_observation(prompt, reply.get("observation") or {})

    def _step(self, action: dict) -> dict:
        return self._post("/step", {"action": action, "episode_id": self.episode_id})

    def _act(self, arguments: dict) -> str:
        if self.action_cls is not None:
            from pydantic import ValidationError

            try:
                arguments = self.action_cls(**arguments).model_dump(exclude={"metadata"})
            except ValidationError as e:
                raise ValueError(_validation_text(e)) from None
        reply = self._step(arguments)
        if reply.get("reward") is not None:
            self.step_rewards.append(float(reply["reward"]))
        self.done = bool(reply.get("done"))
        return observation_content(reply.get("observation") or {})


def _json_object(reply) -> dict:
    """A /reset answer: a JSON object, else retried (RetryableResponse)."""
    from mt_grpo.base.completions import RetryableResponse

    if not isinstance(reply, dict):
        raise RetryableResponse(f"answered a JSON {type(reply).__name__}, not an object: {str(reply)[:200]}")
    return reply


class SessionEpisode(RemoteEpisode):
    """One episode of an OpenEnv server over its WebSocket session route (`/ws`, what OpenEnv's EnvClient speaks):
    the instance keeps one session (one environment on the server) for all its episodes; {"type": "reset"} starts
    each, {"type": "step", "data": action} per call. Sessions keep state on OpenEnv's own server, unlike HTTP."""

    def __init__(self):
        self.ws, self.episode_id, self.step_rewards, self.done = None, None, [], False

    def _send(self, message: dict) -> dict:
        import websocket  # websocket-client

        try:
            if self.ws is None:
                self.ws = websocket.create_connection(f"{self.url}/ws", timeout=HTTP_TIMEOUT)
            self.ws.send(json.dumps(message))
            reply = json.loads(self.ws.recv())
        except (OSError, websocket.WebSocketException) as e:
            self.ws = None  # the next call connects again
            raise ConnectionError(f"OpenEnv session {self.url}/ws: {type(e).__name__}: {e}") from None
        if reply.get("type") == "error":
            data = reply.get("data") or {}
            error = ValueError if data.get("code") == "VALIDATION_ERROR" else RuntimeError  # the model's call, or not
            raise error(f"the server refused it ({data.get('code')}): {data.get('message')}")
        return reply.get("data") or {}

    def reset(self, prompt: list[dict] | None = None, **row) -> str:
        self.step_rewards, self.done = [], False
        data = self._send({"type": "reset", "data": {"seed": row["seed"]} if row.get("seed") is not None else {}})
        return first_observation(prompt, data.get("observation") or {})

    def _step(self, action: dict) -> dict:
        return self._send({"type": "step", "data": action})


def remote_class(url: str, action_cls: type | None = None, base: type | None = None) -> type:
    """The episode class of the server at `url` (HTTP, or its WebSocket sessions with `base=SessionEpisode`): its
    action schema from GET /schema (or `openenv_action`)."""
    import httpx

    base = base or RemoteEpisode
    http_url = "http" + url[len("ws"):] if url.startswith("ws") else url
    try:
        reply = httpx.get(f"{http_url}/schema", timeout=HTTP_TIMEOUT)
    except httpx.HTTPError as e:
        raise ValueError(f"`openenv_env: {url}`: no OpenEnv server answers there ({type(e).__name__}: {e}). Start it "
                         "first (e.g. `uvicorn my_env.server.app:app --port 8000`), or fix the URL.") from None
    if action_cls is not None:
        schema = action_schema(action_cls.model_json_schema(), action_cls.__name__)
    elif reply.status_code == 200 and isinstance(reply.json().get("action"), dict):
        action = reply.json()["action"]
        schema = action_schema(action, action.get("title") or "Action")
    else:
        raise ValueError(f"`openenv_env: {url}`: the server has no GET /schema with the action's JSON schema "
                         f"({reply.status_code}); set `openenv_action: module:MyAction`, the Action class it takes.")
    methods = {schema["function"]["name"]: _remote_tool(schema)}
    cls = type("OpenEnvServer", (base,), {"url": url, "action_cls": action_cls, **methods})
    cls.__module__ = __name__
    return cls


def _remote_tool(schema: dict) -> Callable:
    tool = _tool(schema)

    def act(self, *args, **kwargs):
        arguments = tool.__signature__.bind(self, *args, **kwargs).arguments
        arguments.pop("self")
        return self._act(dict(arguments))

    for attribute in ("__name__", "__qualname__", "__doc__", "__signature__", "__annotations__", "json_schema"):
        setattr(act, attribute, getattr(tool, attribute))
    return act
