"""ms-swift's multi-turn schedulers and ORM rewards, trained here unchanged (recipe field `multi_turn_scheduler`).

    multi_turn_scheduler: plugin.py:MathTipsMultiTurnScheduler   # a file and its class (or its `multi_turns` name)
    multi_turn_scheduler: my_package.schedulers:MyScheduler      # an importable module and its class
    multi_turn_scheduler: math_tip_trick                         # a name in swift's `multi_turns` registry (its
    external_plugins: [plugin.py]                                #   built-ins, or one a plugin file registers)
    swift_max_turns: 3                                           # swift's --max_turns
    outcome_reward_funcs: [plugin:MathAccuracy]                  # an ORM class (or a name a plugin put in `orms`)

swift drives an episode from `MultiTurnScheduler.run`: after each model turn it calls `on_turn_end`, then
`check_finished` (stop?), then `step`, which returns the next request. Here the trainer drives the episode, and
the scheduler answers through the environment contract's `respond(messages)` (environments.py, user_turns.py):
each model turn without a tool call gives one call of swift's loop body, on a RolloutInferRequest (the whole
conversation, the row's other columns as `data_dict`) and a ChatCompletionResponseChoice (the turn's text):

    on_turn_end -> {'done', 'rollout_infos'}   'done' decides, else check_finished; past swift_max_turns: stop
    stop                                       no reply: the episode ends as it would without respond (the last
                                               turn's step_rewards stay its R_T: Reply(end=True, score=...))
    step appended a user message               Reply(content): a new round (MathTipsMultiTurnScheduler); the images
                                               it added to `infer_request.images` where its `<image>` tags are (text
                                               and image blocks, engine/vision.py: DeepEyes' form); the request holds
                                               the conversation's images, each message's as `<image>` tags
    step rewrote the model's own message       Reply(content=<the text it inserted>, continuation=True,
                                               keep_chars=<the model's characters that stay>): the text sits
                                               inside the model's message with mask 0 and sampling continues in it
                                               (MathTipsScheduler, plugin.py's ToolCallScheduler)
    rollout_infos (on_turn_end's and step's)   kept for the rewards (`rollout_infos`, and 3.x's `multi_turn_infos`)

Turn credit: swift scores no turn; a turn's R_T is what its rollout_infos appended to `step_rewards` (swift's gym
convention), the turn that ends the episode included (gym's final step carries the success reward: Reply(end=True));
a continued turn's several step rewards are summed; a turn that appended none has no R_T (not applicable, never 0).
The episode's rewards are the outcome rewards the recipe lists.

Tool calls: a turn with a tool call the trainer parses runs the recipe's tools (or an environment's) and never
reaches the scheduler, which sees the turns without one, as swift's loop does when its engine parses none. A
scheduler that runs tools itself from the model's text (plugin.py's ReAct ToolCallScheduler) is a continuation or
a new round like any other. A step that appends a `tool` message is refused (give the tools to the recipe).

Datasets: a local JSON/JSONL file in swift's format (`messages`, its reference answer dropped, or `query`) becomes
the prompts (swift_dataset); its other columns are the scheduler's `data_dict` and the rewards' keywords. Its
`images` (paths, `data:` URLs, `{"bytes", "path"}`), tagged `<image>` at the start of the first user message or not
at all, become TRL's `images` column (swift_row_images); a tag elsewhere is refused naming the row.

Not supported, each refused at start-up naming the alternative: a scheduler that overrides `run` (swift's full
customization: it drives swift's inference engine itself, ThinkingModelTipsScheduler among them), swift's
GYMScheduler and OpenEnvScheduler (an environment_factory class, or the `openenv_env` field). Without ms-swift
installed, a plugin's `swift` imports come from adapters/swift_compat.py (a copy of 4.6.0's classes).
"""

import asyncio
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import uuid
from copy import deepcopy
from typing import Callable

from mt_grpo.adapters import Adapted
from mt_grpo.base.protocol import holds_images, is_image_block
from mt_grpo.base.registry import load_file
from mt_grpo.engine.vision import conversation_images
from mt_grpo.base.runtime import ContractBroken, PatientLock

logger = logging.getLogger("mt_grpo")

FIELD = "multi_turn_scheduler"
TRAINER_ARGS = None  # the run's config, given to ORM classes as swift gives its GRPOConfig (`ORM(args=...)`)


# ----------------------------------------------------------------------------------------------------------------------
# swift itself, or the copy
# ----------------------------------------------------------------------------------------------------------------------
def swift_modules() -> str:
    """Make `import swift...` work for plugin files: the real ms-swift when it imports (then the plugin's classes are
    swift's own), else adapters/swift_compat.py's copy. Returns which: 'ms-swift' or 'copy'."""
    loaded = sys.modules.get("swift")
    if loaded is not None:
        return "copy" if getattr(loaded, "__mt_grpo_compat__", False) else "ms-swift"
    if importlib.util.find_spec("swift") is not None:
        try:
            importlib.import_module("swift.rollout.multi_turn")
            importlib.import_module("swift.rewards.orm")
            return "ms-swift"
        except Exception as e:  # another package named swift, or ms-swift without its dependencies
            logger.warning("`import swift.rollout.multi_turn` failed (%s: %s); ms-swift plugins run on mt-grpo's copy "
                           "of its classes (mt_grpo/adapters/swift_compat.py).", type(e).__name__, e)
            for name in [m for m in sys.modules if m == "swift" or m.startswith("swift.")]:
                del sys.modules[name]
    from mt_grpo.adapters import swift_compat

    swift_compat.install()
    return "copy"


def registry(name: str) -> dict:
    """swift's `multi_turns` or `orms` dict, as the plugins loaded so far filled it."""
    module = sys.modules["swift.rollout.multi_turn" if name == "multi_turns" else "swift.rewards.orm"]
    return getattr(module, name)


def import_plugin(path: str):
    """A plugin file, imported as swift's `external_plugins` does: its folder on sys.path, the file as a module of its
    name (so that `plugin:MathAccuracy` then names its classes too). Registrations (`multi_turns[...] = ...`) happen."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ValueError(f"ms-swift plugin file '{path}' not found ({full}): give the path of the plugin .py file "
                         "(relative to the directory the trainer runs in, or absolute).")
    folder, name = os.path.split(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        return load_file(full, os.path.splitext(name)[0])
    except Exception as e:
        raise ValueError(f"ms-swift plugin file '{path}' failed to import ({type(e).__name__}: {e}).") from e


# ----------------------------------------------------------------------------------------------------------------------
# the scheduler: found, checked, made
# ----------------------------------------------------------------------------------------------------------------------
def find_scheduler(spec):
    """The class (or instance) `multi_turn_scheduler` names: `file.py:Class`, `module:Class`, or a `multi_turns` name
    (a `file.py:name` too)."""
    if not isinstance(spec, str):
        return spec  # the Python API: a class or an instance
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") or os.path.sep in where:
            module = import_plugin(where)
        else:
            try:
                module = importlib.import_module(where)
            except Exception as e:
                raise ValueError(f"multi_turn_scheduler '{spec}': cannot import module '{where}' ({type(e).__name__}: "
                                 f"{e}). Give `path/to/plugin.py:Class` or an importable `module:Class`.") from e
        if hasattr(module, attr):
            return getattr(module, attr)
        if attr in registry("multi_turns"):
            return registry("multi_turns")[attr]
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and hasattr(v, "check_finished")
                       and callable(getattr(v, "step", None)))
        raise ValueError(f"multi_turn_scheduler '{spec}': '{where}' has no class '{attr}', and no scheduler is "
                         f"registered under that name. Its schedulers: {found or 'none'}; registered: "
                         f"{sorted(registry('multi_turns'))}.")
    if spec.endswith(".py"):
        raise ValueError(f"multi_turn_scheduler '{spec}' is a file: name its class too, `{spec}:MyScheduler` (or put "
                         f"the file in `external_plugins` and give the name it registers in `multi_turns`).")
    if spec in registry("multi_turns"):
        return registry("multi_turns")[spec]
    raise ValueError(f"multi_turn_scheduler '{spec}' is not a registered ms-swift scheduler (registered: "
                     f"{sorted(registry('multi_turns'))}). Give `path/to/plugin.py:Class`, `module:Class`, or list the "
                     "plugin file that registers it (`multi_turns['name'] = Class`) in `external_plugins`.")


def _base(cls, name: str):
    return next((c for c in cls.__mro__ if c.__name__ == name), None)


def check_scheduler(cls, spec) -> None:
    """A partial-customization MultiTurnScheduler (step, check_finished, the hooks), or an error naming the fix."""
    what = f"multi_turn_scheduler '{spec}'"
    if not inspect.isclass(cls):
        raise ValueError(f"{what} is a {type(cls).__name__}, not a class: name an ms-swift MultiTurnScheduler "
                         "subclass.")
    base = _base(cls, "MultiTurnScheduler")
    if base is None and not (callable(getattr(cls, "step", None)) and callable(getattr(cls, "check_finished", None))):
        raise ValueError(f"{what} ({cls.__name__}) is not an ms-swift MultiTurnScheduler: subclass "
                         "`swift.rollout.multi_turn.MultiTurnScheduler` and implement `step` (and optionally "
                         "`check_finished`), as swift's plugin.py does.")
    for name in ("OpenEnvScheduler", "GYMScheduler"):
        if _base(cls, name) is not None:
            raise ValueError(f"{what} ({cls.__name__}) is swift's {name}, which steps swift gym environments (`envs`). "
                             "mt-grpo runs such an environment as an environment_factory class: reset(**row) returns "
                             "the first observation, respond(messages) steps it and returns the next one (a "
                             "user_turns.Reply with the step's reward as `score`, `done`); an OpenEnv server takes "
                             "the `openenv_env` field (docs/guide.md).")
    own_run = [c.__name__ for c in cls.__mro__[:cls.__mro__.index(base)] if "run" in vars(c)] if base else []
    if own_run:
        raise ValueError(f"{what} ({cls.__name__}) overrides `run` ({own_run[0]}.run): swift's full customization, "
                         "which drives swift's inference engine itself; here the trainer samples every turn, so only "
                         "the partial customization runs: move the turn logic into `step` (the next request) and "
                         "`check_finished` (stop?), or write an environment_factory class with `respond` "
                         "(docs/guide.md, 'From ms-swift').")
    if base is not None and getattr(cls, "step") is getattr(base, "step"):
        raise ValueError(f"{what} ({cls.__name__}) does not implement `step`: define `step(self, infer_request, "
                         "response_choice, current_turn)` returning {'infer_request': ...}.")


def make_scheduler(cls, max_turns, tokenizer):
    """The scheduler, made as swift's trainer makes it: max_turns, and the tokenizer where its __init__ takes it."""
    params = inspect.signature(cls.__init__).parameters
    kwargs = {"max_turns": max_turns}
    if "tokenizer" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs["tokenizer"] = tokenizer
    try:
        scheduler = cls(**kwargs)
    except Exception as e:
        raise ValueError(f"The ms-swift scheduler {cls.__name__} failed to start ({type(e).__name__}: {e}).") from e
    if max_turns is not None and getattr(scheduler, "max_turns", None) != max_turns:
        # a 3.x scheduler (`__init__(self, max_turns=None, *args, **kwargs)`) hands max_turns to 4.x's base, whose
        # first parameter is infer_engine, by position
        if getattr(scheduler, "infer_engine", None) == max_turns:
            scheduler.infer_engine = None
        scheduler.max_turns = max_turns
    return scheduler


# ----------------------------------------------------------------------------------------------------------------------
# the environment: swift's loop body, once per model turn without a tool call
# ----------------------------------------------------------------------------------------------------------------------
IMAGE_TAG = "<image>"  # where an image sits in a swift message's text; the request's `images` hold them, in order


def swift_message(m: dict) -> dict:
    """A canonical message as swift's requests hold it: role and text content (tool calls, names kept when present);
    a content of text and image blocks (engine/vision.py) as its text with an `<image>` tag where each image is."""
    content = m.get("content") or ""
    if holds_images(content):
        content = "".join(IMAGE_TAG if is_image_block(p) else p["text"] for p in content)
    out = {"role": m["role"], "content": content}
    for key in ("tool_calls", "name", "tool_call_id"):
        if m.get(key):
            out[key] = deepcopy(m[key])
    return out


def tagged_blocks(text: str, images: list, label: str):
    """The text of a message `step` appended, with the images it added to the request: each `<image>` tag the next
    image, as swift's templates place them (text blocks and image blocks, engine/vision.py); no image: the text."""
    if not images:
        return text
    pieces = text.split(IMAGE_TAG)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"{label}.step added {len(images)} images to the request and {len(pieces) - 1} `<image>` tags "
                         "to the message it appended: put one `<image>` in the message where each image goes, as "
                         "swift's DeepEyes scheduler writes it.")
    blocks = []
    for k, piece in enumerate(pieces):
        blocks += ([{"type": "image", "image": swift_image(images[k - 1], label)}] if k else []) + (
            [{"type": "text", "text": piece}] if piece else [])
    return blocks


def swift_image(image, label: str):
    """A PIL image of what a swift request's `images` hold: a PIL image, or a local file's path."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, str) and os.path.isfile(image):
        return Image.open(image)
    raise ValueError(f"{label}.step added an image of type {type(image).__name__} ({str(image)[:60]!r}); give a PIL "
                     "image or a local file's path.")


def step_result(ret, label: str) -> tuple:
    """(request, extras) from what step returned: 4.x's dict {'infer_request', 'rollout_infos', ...}, or 3.x's request
    or (request, extra_dict) (3.x's extra dict is the rewards' `multi_turn_infos`). Anything else is a bug in the
    scheduler, which stops the run naming it (ContractBroken), as a `respond` of the wrong type does."""
    if isinstance(ret, dict):
        if "infer_request" not in ret:
            raise ContractBroken(f"{label}.step returned a dict without 'infer_request': return "
                             "{'infer_request': infer_request, ...} (ms-swift 4.x).")
        return ret["infer_request"], ret
    if isinstance(ret, tuple) and len(ret) == 2:
        return ret[0], {"rollout_infos": ret[1] or {}}
    if hasattr(ret, "messages"):
        return ret, {}
    raise ContractBroken(f"{label}.step returned {type(ret).__name__}: return {{'infer_request': infer_request}} (4.x), or "
                     "the request, or (request, extra_dict) (3.x).")


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class SwiftEpisode:
    """One episode of an ms-swift scheduler (environment_factory contract, extended with respond). The generated
    subclass (make_environment) holds the scheduler, shared by every episode as in swift (state per trajectory is
    the scheduler's, by `infer_request.uuid`)."""

    scheduler = None
    tokenizer = None
    max_turns = None
    _lock = None  # the scheduler's PatientLock: its check_finished and step run one at a time, as in swift, but a step
    # still running after half tool_timeout is no longer waited for: one that never returns ends only its own episode

    def reset(self, **row) -> str | None:
        self.done = False
        self.rollout_infos = {}
        self.multi_turn_infos = self.rollout_infos  # ms-swift 3.x's name for the same dict
        self._row = {k: v for k, v in row.items() if k != "prompt"}
        self._uuid = uuid.uuid4().hex
        self._turn = 0  # swift's current_turn: the model turns the scheduler has seen
        self._message = None  # the model's message after a continuation: where its next sample starts
        self._at = None  # its index in the conversation (a tool turn since then starts a new message)
        self._inserted = ""
        self._step_rewards = 0  # how many step_rewards the rollout_infos held (the gym convention's turn rewards)
        return self._trajectory_start(row.get("prompt"))

    def _trajectory_start(self, prompt) -> str | None:
        """swift's on_trajectory_start, when the scheduler defines one: it may add to the last user message (that
        text is reset's observation); any other change to the prompt is refused."""
        hook = getattr(type(self.scheduler), "on_trajectory_start", None)
        defined_by = getattr(hook, "__qualname__", "").split(".")[0]
        if hook is None or defined_by in ("RolloutScheduler", "MultiTurnScheduler"):  # swift's no-op
            return None
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else deepcopy(list(prompt or []))
        request = self._request(messages)
        started = self.scheduler.on_trajectory_start([request])
        if inspect.isawaitable(started):  # swift's hooks are async; a sync override is taken too
            run_coroutine(started)
        new = request.messages
        before = [swift_message(m) for m in messages]
        if new == before:
            return None
        last = new[-1] if new else {}
        if len(new) == len(before) and new[:-1] == before[:-1] and last.get("role") == "user" \
                and last["content"].startswith(before[-1]["content"]):
            return last["content"][len(before[-1]["content"]):]
        raise ValueError(f"{type(self.scheduler).__name__}.on_trajectory_start rewrote the prompt; here a reset may "
                         "only add text to the last user message: put the observation in the dataset's prompt, or "
                         "write an environment_factory class whose reset returns it.")

    def _request(self, messages: list[dict]):
        from swift.infer_engine.protocol import RolloutInferRequest

        return RolloutInferRequest(messages=[swift_message(m) for m in messages], data_dict=deepcopy(self._row),
                                   uuid=self._uuid, images=conversation_images(messages))

    def _sample(self, content: str, at: int) -> str:
        """This turn's sampled text: the model's message after what the last continuation left in it."""
        if self._message is None or at != self._at:
            return content
        if content.startswith(self._message):
            return content[len(self._message):]
        start = common_prefix(content, self._message)  # the kept tokens decoded a little differently: find the insert
        inserted = self._inserted
        at = content.find(inserted, max(0, start - len(inserted))) if inserted else -1
        return content[at + len(inserted):] if at >= 0 else content[start:]

    def _infos(self, infos) -> float | None:
        """Merge a turn's rollout_infos; the rewards its `step_rewards` gained (swift's gym convention) are R_T."""
        if not infos:
            return None
        self.rollout_infos.update(infos)
        steps = infos.get("step_rewards")
        if isinstance(steps, (list, tuple)) and len(steps) > self._step_rewards:
            gained, self._step_rewards = steps[self._step_rewards:], len(steps)
            return float(sum(gained))
        return None

    async def respond(self, messages: list[dict]):
        from swift.infer_engine.protocol import ChatCompletionResponseChoice, ChatMessage
        from mt_grpo.rollout.user_turns import Reply

        scheduler, label = self.scheduler, type(self.scheduler).__name__
        self._turn += 1
        turn = self._turn
        content = messages[-1].get("content") or ""
        sample = self._sample(content, len(messages) - 1)
        request = self._request(messages)
        ids = None if self.tokenizer is None else self.tokenizer.encode(sample, add_special_tokens=False)
        choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=sample),
                                              finish_reason="stop",  # a turn cut by a token limit is never answered
                                              token_ids=ids)  # the sample's text re-encoded (respond sees text)
        result = scheduler.on_turn_end(request, choice, turn)
        result = (await result if inspect.isawaitable(result) else result) or {}
        score = self._infos(result.get("rollout_infos"))
        with self._lock.held():  # swift runs the sync methods of its one scheduler one at a time (one event loop)
            stop = result["done"] if "done" in result else scheduler.check_finished(request, choice, turn)
        self.rollout_infos["num_turns"] = turn
        if stop or (self.max_turns and turn >= self.max_turns):  # no reply; the final step keeps its reward
            return None if score is None else Reply(end=True, score=score)
        before, images = deepcopy(request.messages), len(request.images or [])
        with self._lock.held():
            request, extras = step_result(scheduler.step(request, choice, turn), label)
        added = list(getattr(request, "images", None) or [])[images:]  # images step added: its new message's
        gained = self._infos(extras.get("rollout_infos"))
        score = gained if score is None else score + (gained or 0.0)
        self.rollout_infos["num_turns"] = turn
        return self._reply(before, request.messages, sample, score, label, Reply, len(messages) - 1, added)

    def _reply(self, before: list[dict], after: list[dict], sample: str, score, label: str, Reply, at: int,
               images: list):
        """What step did to the conversation, as a Reply: a new user message (with the images step added), or text
        inserted in the model's."""
        n = len(before)
        if len(after) < n or [swift_message(m) for m in after[:n - 1]] != before[:n - 1] \
                or after[n - 1].get("role") != "assistant":
            raise ValueError(f"{label}.step rewrote the conversation before the model's last message; here the "
                             "history is what was sampled: append a user message (a new round) or change only the "
                             "model's last message (a continuation).")
        old, new = before[-1]["content"], after[n - 1].get("content") or ""
        if len(after) > n:  # a new round
            added = after[n:]
            if new != old:
                raise ValueError(f"{label}.step both changed the model's message and appended messages; do one.")
            if len(added) != 1 or added[0].get("role") != "user":
                roles = [m.get("role") for m in added]
                raise ValueError(f"{label}.step appended {roles}; here a reply is one user message. Tool calls are "
                                 "run by the recipe's `tools` (or an environment_factory class), before the scheduler "
                                 "sees the turn: give the tools there, and let step append only the user's reply.")
            self._message = None
            return Reply(content=tagged_blocks(added[0].get("content") or "", images, label), score=score)
        if images:
            raise ValueError(f"{label}.step added images and continued the model's message; here an image enters in a "
                             "new round: append a user message with an `<image>` tag where each goes.")
        prefix = old[:len(old) - len(sample)]  # the message before this turn's sample
        if not new.startswith(prefix):
            raise ValueError(f"{label}.step changed text of the model's message before its last sample; a "
                             "continuation may cut the last sample and add text after it.")
        rest = new[len(prefix):]
        kept = common_prefix(rest, sample)
        inserted = rest[kept:]
        self._message, self._inserted, self._at = new, inserted, at
        # the characters of the message that stay (Reply.keep_chars counts from its start, as respond sees it): the
        # trainer cuts the sample's tokens there, as swift's step does
        return Reply(content=inserted, continuation=True, keep_chars=None if kept == len(sample) else len(prefix) + kept,
                     score=score)

def make_environment(scheduler, tokenizer, max_turns, tool_timeout: float = 10.0) -> type:
    """A SwiftEpisode subclass named after the scheduler (its rewards log under that name: `<Class>_steps`). Its lock
    gives up on a holder after half `tool_timeout` (respond's bound), so that an episode queued behind a stuck step
    still has half its own bound to run in."""
    name = type(scheduler).__name__
    return type(name, (SwiftEpisode,), {"scheduler": scheduler, "tokenizer": tokenizer, "max_turns": max_turns,
                                       "_lock": PatientLock(tool_timeout / 2),
                                       "__module__": __name__, "__doc__": f"ms-swift scheduler {name}, as an "
                                       "environment (adapters/swift.py)."})


# ----------------------------------------------------------------------------------------------------------------------
# rewards: swift's ORM classes as reward functions
# ----------------------------------------------------------------------------------------------------------------------
def is_swift_reward(obj) -> bool:
    """An ms-swift ORM: a class (or an instance of one) deriving from swift's ORM / AsyncORM, or whose `__call__`
    takes `completions` first (swift calls `reward(completions, **kwargs)`; a plain function is TRL's form)."""
    cls = obj if inspect.isclass(obj) else type(obj)
    if inspect.isfunction(obj) or inspect.ismethod(obj) or not callable(obj):
        return False
    if _base(cls, "ORM") is not None or _base(cls, "AsyncORM") is not None:
        return True
    call = getattr(cls, "__call__", None)
    if call is None or call is type.__call__ or not inspect.isfunction(call):
        return False
    params = list(inspect.signature(call).parameters)
    return len(params) > 1 and params[1] == "completions"


def swift_reward(obj) -> Callable:
    """A reward function of the trainer's signature around an ms-swift ORM (a class is made as swift makes it, with
    the run's config as `args`). It is called as swift calls it: `completions` the final assistant message's text,
    and as keywords the dataset's columns, `messages` (the whole conversation), `is_truncated`, `finish_reason`,
    `rollout_infos` (and 3.x's `multi_turn_infos`), `trainer_state`."""
    if inspect.isclass(obj):
        params = inspect.signature(obj.__init__).parameters
        takes_args = "args" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        try:
            orm = obj(args=TRAINER_ARGS) if takes_args else obj()
        except Exception as e:
            raise ValueError(f"The ms-swift reward {obj.__name__} failed to start ({type(e).__name__}: {e}).") from e
    else:
        orm = obj
    name = type(orm).__name__
    from mt_grpo.rollout.episodes import (TRUNCATED_STOP_REASONS)  # a turn cut by a token limit: swift's finish_reason 'length'

    def reward(prompts, completions, **kwargs):
        n = len(completions)
        environments = kwargs.get("environments") or [None] * n
        infos = [dict(getattr(e, "rollout_infos", None) or {}) for e in environments]
        stops = kwargs.get("stop_reason") or [None] * n  # each episode's (environments.episode_columns)
        messages = [prompt_messages(p) + list(c) for p, c in zip(prompts, completions)]
        swift_kwargs = {k: v for k, v in kwargs.items() if k not in ("log_extra", "log_metric")}
        swift_kwargs.update(
            messages=messages, rollout_infos=infos, multi_turn_infos=infos,
            is_truncated=[s in TRUNCATED_STOP_REASONS for s in stops],
            finish_reason=["length" if s in TRUNCATED_STOP_REASONS else "stop" for s in stops])
        texts = [final_text(c) for c in completions]
        values = orm(texts, **swift_kwargs)
        if inspect.isawaitable(values):
            values = run_coroutine(values)
        return list(values)

    reward.__name__ = reward.__qualname__ = name
    reward.swift_orm = orm
    return reward


def prompt_messages(prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])


def final_text(completion) -> str:
    """swift's `completions[i]`: the final model message's text (here the last assistant message: an episode may end
    on an environment's reply)."""
    if isinstance(completion, str):
        return completion
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


def run_coroutine(coroutine):
    """An AsyncORM's result: on a loop of its own (on a thread when the caller's thread already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def lookup_reward(name: str):
    """A name from swift's `orms` registry (its built-ins, or what a plugin registered), when swift's modules are
    loaded (a run with `multi_turn_scheduler`); None otherwise."""
    module = sys.modules.get("swift.rewards.orm")
    found = getattr(module, "orms", {}).get(name) if module is not None else None
    return swift_reward(found) if found is not None else None


# ----------------------------------------------------------------------------------------------------------------------
# the adapter
# ----------------------------------------------------------------------------------------------------------------------
def load_tokenizer(args):
    """The model's tokenizer when the config carries the model (a script's merged config); in a recipe run the model
    is the model config's, and the trainer hands its tokenizer over through Adapted.use_tokenizer."""
    name = getattr(args, "model_name_or_path", None)
    if not name:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, revision=getattr(args, "model_revision", None))


def swift_dataset(name, max_samples=None):
    """A recipe's dataset when it is a local JSON/JSONL file in swift's format: a `messages` column (the reference
    answer, a trailing assistant message, is dropped, as swift's remove_response does) or `query` (with `system`),
    and no `prompt`; as a datasets.Dataset whose `prompt` is those messages, its other columns kept (`solution`...).
    A row's `images` (or `image`), as swift writes them, become TRL's `images` column (swift_row_images). None for
    any other dataset (the trainer loads it as usual)."""
    if not isinstance(name, str) or not name.endswith((".json", ".jsonl")) or not os.path.isfile(name):
        return None
    import datasets

    data = datasets.load_dataset("json", data_files=name, split="train")
    columns = set(data.column_names)
    if "prompt" in columns or not columns & {"messages", "query"}:
        return None
    pictures = next((c for c in ("images", "image") if c in columns), None)

    def prompt(row, index) -> dict:
        if row.get("messages"):
            messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
            messages = messages[:-1] if messages[-1]["role"] == "assistant" else messages
        else:
            system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
            messages = system + [{"role": "user", "content": row["query"]}]
        if pictures is None:
            return {"prompt": messages}
        return swift_row_images(messages, row[pictures], f"Row {index} of {name}")

    data = data.map(prompt, with_indices=True,
                    remove_columns=sorted(columns & {"messages", "query", "system", "response", "image"}))
    if pictures is not None:
        data = data.cast_column("images", datasets.Sequence(datasets.Image()))  # decoded to PIL images when read
    return data.select(range(min(max_samples, len(data)))) if max_samples is not None else data


def swift_row_images(messages: list[dict], images, label: str) -> dict:
    """A swift row's prompt and images as TRL's `prompt` and `images` columns. swift's rows name their images by
    local path (absolute, from the directory the run starts in, or under $ROOT_IMAGE_DIR, as swift resolves them),
    a base64 `data:` URL, or `{"bytes", "path"}`, and mark each with an `<image>` tag in the text; an untagged image
    goes at the start of the first user message (swift's _add_default_tags), which is where the trainer puts a row's
    images (engine/vision.prompt_with_images). So the tags at the start of the first user message leave its text; a
    tag elsewhere, more tags than images, an http(s) URL, a missing file or a `<video>` is refused naming the row."""
    import base64

    images = [] if images is None else [images] if isinstance(images, (str, dict)) else list(images)
    if any("<video>" in (m["content"] or "") for m in messages):
        raise ValueError(f"{label}: its text has a `<video>`: videos are not supported; give frames as images.")
    first = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        if images:
            raise ValueError(f"{label}: it has images but no user message to put them in.")
        return {"prompt": messages, "images": []}
    text, tags = messages[first]["content"] or "", 0
    while text.startswith(IMAGE_TAG, tags * len(IMAGE_TAG)):
        tags += 1
    messages[first]["content"] = text[tags * len(IMAGE_TAG):]
    elsewhere = any(IMAGE_TAG in (m["content"] or "") for m in messages)
    if elsewhere or tags > len(images):
        where = "inside the text or in another message" if elsewhere else f"for {tags} images, and it has {len(images)}"
        raise ValueError(f"{label}: its prompt has `<image>` tags {where}: here a row's images go at the start of its "
                         "first user message, where swift puts untagged ones: put the tags there, one per image, or "
                         "leave them out.")
    out = []
    for image in images:
        image = dict(image) if isinstance(image, dict) else {"bytes": None, "path": image}
        path = image.get("path")
        if image.get("bytes") is None and isinstance(path, str) and path.startswith("data:"):
            image = {"bytes": base64.b64decode(path.partition(",")[2]), "path": None}
        elif image.get("bytes") is None:
            image["path"] = local_image(path, label)
        out.append(image)
    return {"prompt": messages, "images": out}


def local_image(path, label: str) -> str:
    """The file an image path of a swift row names, as swift's _check_path finds it."""
    if isinstance(path, str) and path.startswith(("http://", "https://")):
        raise ValueError(f"{label}: its image {path!r} is a URL; download it and give its local path.")
    root = os.environ.get("ROOT_IMAGE_DIR")
    found = next((p for p in ([path] + ([os.path.join(root, path)] if root else [])) if isinstance(path, str)
                  and os.path.isfile(os.path.expanduser(p))), None)
    if found is None:
        raise ValueError(f"{label}: its image {str(path)[:80]!r} is not a file (a path is read from the directory the "
                         "run starts in, or under $ROOT_IMAGE_DIR, as swift reads it).")
    return os.path.abspath(os.path.expanduser(found))


def adapt(args) -> Adapted:
    global TRAINER_ARGS
    TRAINER_ARGS = args
    swift_modules()
    for path in getattr(args, "external_plugins", None) or []:
        import_plugin(path)
    spec = getattr(args, FIELD, None)
    if spec is None:  # plugin files alone: their `orms` serve the reward lists
        if getattr(args, "swift_max_turns", None) is not None:
            raise ValueError("`swift_max_turns` is set but `multi_turn_scheduler` is not: name the scheduler, or drop "
                             "swift_max_turns.")
        return Adapted()
    found = find_scheduler(spec)
    cls = found if inspect.isclass(found) else type(found)
    check_scheduler(cls, spec)
    max_turns = getattr(args, "swift_max_turns", None)
    tokenizer = load_tokenizer(args)
    scheduler = found if not inspect.isclass(found) else make_scheduler(cls, max_turns, tokenizer)
    if not inspect.isclass(found) and max_turns is not None:
        scheduler.max_turns = max_turns
    environment = make_environment(scheduler, tokenizer, max_turns, float(getattr(args, "tool_timeout", None) or 10.0))

    def use_tokenizer(run_tokenizer) -> None:
        """The run's tokenizer (the model's, or the processing_class given): it counts the sampled tokens a
        continuation keeps, and is the scheduler's `self.tokenizer` where swift would have given it one."""
        environment.tokenizer = run_tokenizer
        if getattr(scheduler, "_tokenizer", None) is None and "_tokenizer" in vars(scheduler):
            scheduler._tokenizer = run_tokenizer

    # swift-format files (`messages`) become prompts; the held-out one too when the run evaluates (a given train
    # set needs a given eval set: builders.assemble)
    train = swift_dataset(getattr(args, "dataset_name", None), getattr(args, "max_samples", None))
    held_out = getattr(args, "eval_dataset_name", None)
    evaluates = train is not None and held_out and getattr(args, "eval_strategy", "no") != "no"
    return Adapted(environment_factory=environment, use_tokenizer=use_tokenizer, train_dataset=train,
                   read_dataset_name=train is not None,
                   eval_dataset=swift_dataset(held_out, getattr(args, "eval_max_samples", None)) if evaluates else None)
