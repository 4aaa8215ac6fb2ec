"""What an ms-swift plugin file imports from `swift`, without ms-swift: copies of ms-swift 4.6.0's multi-turn scheduler
base, its request and response shapes, and its reward base classes, so that a plugin written for swift (`from
swift.rollout.multi_turn import MultiTurnScheduler, multi_turns`, `from swift.rewards import ORM, orms`, or the 3.x
paths `swift.plugin`, `swift.llm`) imports unchanged. ms-swift itself is not a dependency: it does not import
without modelscope, peft, its templates and much more (checked: `pip install --no-deps ms-swift==4.6.0` then
`import swift.rollout.multi_turn` fails on modelscope). When the real package imports, adapters/swift.py uses it and
this module is not installed.

The copies keep swift's signatures and the behaviour a scheduler's `step` / `check_finished` / hooks and a reward's
`__call__` rely on; what drives swift's inference engine (`run`, `async_infer`, the template's response prefix) is
not copied: mt-grpo's sampler drives the episode (adapters/swift.py). Source: ms-swift 4.6.0,
swift/rollout/multi_turn.py, swift/infer_engine/protocol.py, swift/rewards/orm.py (Apache-2.0, ModelScope).
"""

import json
import logging
import re
import sys
import types
import uuid as _uuid
from abc import ABC
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

Messages = List[Dict[str, Any]]


# -- swift/infer_engine/protocol.py ---------------------------------------------------------------------------------
def random_uuid() -> str:
    return str(_uuid.uuid4().hex)


def remove_response(messages) -> Optional[str]:
    """swift.utils.remove_response: drop a trailing assistant message, returning its content."""
    last_role = messages[-1]['role'] if messages else None
    if last_role == 'assistant':
        return messages.pop()['content']


@dataclass
class RequestConfig:
    """swift's sampling settings; a placeholder here (mt-grpo's sampler has its own)."""
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[List[str]] = field(default_factory=list)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: Optional[int] = None


@dataclass
class InferRequest:
    messages: Messages
    images: List[Any] = field(default_factory=list)
    audios: List[str] = field(default_factory=list)
    videos: List[str] = field(default_factory=list)
    tools: Optional[List[Any]] = None
    objects: Dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for key in ['images', 'audios', 'videos']:
            val = getattr(self, key)
            if isinstance(val, str):
                setattr(self, key, [val])
        assert isinstance(self.messages, list), f'messages: {self.messages}'

    @staticmethod
    def remove_response(messages) -> Optional[str]:
        return remove_response(messages)


@dataclass
class RolloutInferRequest(InferRequest):
    images: List[str] = field(default_factory=list)
    data_dict: Dict = field(default_factory=dict)
    uuid: Optional[str] = None
    add_eos: Optional[Union[bool, Literal['auto']]] = None


@dataclass
class Function:
    name: str
    arguments: Optional[Union[str, Any]]

    def __post_init__(self):
        if not isinstance(self.arguments, str):
            self.arguments = json.dumps(self.arguments, ensure_ascii=False)
        self.name = self.name.strip()
        self.arguments = self.arguments.strip()


@dataclass
class ChatCompletionMessageToolCall:
    function: Function
    type: str = 'function'
    id: str = field(default_factory=lambda: f'toolcall-{random_uuid()}')


@dataclass
class ChatMessage:
    role: Literal['system', 'user', 'assistant']
    content: Union[str, List[Dict[str, Any]], int, float, List[float]]
    tool_calls: Optional[List[ChatCompletionMessageToolCall]] = None
    reasoning_content: Optional[str] = None


@dataclass
class ChatCompletionResponseChoice:
    index: int
    message: ChatMessage
    finish_reason: Literal['stop', 'length', None]
    logprobs: Optional[Dict[str, List[Dict[str, Any]]]] = None
    token_ids: Optional[List[int]] = None
    routed_experts: Optional[Any] = None


RolloutResponseChoice = ChatCompletionResponseChoice  # swift 3.x's name


@dataclass
class ChatCompletionResponse:
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: Any = None
    id: str = field(default_factory=lambda: f'chatcmpl-{random_uuid()}')
    object: str = 'chat.completion'


@dataclass
class RolloutOutput:
    response: Any
    messages: Optional[Messages] = None
    response_token_ids: List[List[int]] = field(default_factory=list)
    response_loss_mask: List[List[int]] = field(default_factory=list)
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    rollout_logprobs: List[List[float]] = field(default_factory=list)


# -- swift/rollout/multi_turn.py ------------------------------------------------------------------------------------
class RolloutScheduler(ABC):

    def __init__(self, infer_engine=None, max_turns: Optional[int] = None, *args, **kwargs):
        self.infer_engine = infer_engine
        self._tokenizer = kwargs.get('tokenizer', None)
        self._template = kwargs.get('template', None)
        self.max_turns = max_turns

    def prepare_response_continuation(self, response_choice):
        token_ids = list(response_choice.token_ids or [])
        if response_choice.logprobs is None:
            rollout_logprobs = []
        elif 'content' in response_choice.logprobs:
            rollout_logprobs = [item['logprob'] for item in response_choice.logprobs['content']]
        else:
            rollout_logprobs = []
        if rollout_logprobs and len(rollout_logprobs) != len(token_ids):
            raise ValueError(f'rollout_logprobs length ({len(rollout_logprobs)}) must match sampled token_ids '
                             f'length ({len(token_ids)})')
        return token_ids, [1] * len(token_ids), rollout_logprobs

    def append_assistant_completion(self, infer_request, completion: str) -> bool:
        messages = infer_request.messages
        if messages[-1]['role'] != 'assistant':
            messages.append({'role': 'assistant', 'content': completion})
            return False
        messages[-1]['content'] += completion
        return True

    async def on_trajectory_start(self, requests) -> None:
        pass

    async def on_turn_end(self, infer_request, response_choice, current_turn: int) -> Dict[str, Any]:
        return {}

    def __getattr__(self, key: str):
        try:
            return object.__getattribute__(self, key)
        except AttributeError:
            pass
        try:
            infer_engine = object.__getattribute__(self, 'infer_engine')
            if hasattr(infer_engine, key):
                return getattr(infer_engine, key)
            if hasattr(infer_engine.engine, key):
                return getattr(infer_engine.engine, key)
        except AttributeError:
            raise AttributeError(f'{type(self).__name__} object has no attribute {key}')

    @property
    def engine(self):
        return self.infer_engine

    @property
    def tokenizer(self):
        if self._tokenizer is not None:
            return self._tokenizer
        if self.infer_engine is not None:
            return self.infer_engine.tokenizer
        return None


class MultiTurnScheduler(RolloutScheduler, ABC):
    """swift's base for partial customization: `step` (required) and `check_finished` (optional), and the hooks
    `on_trajectory_start` / `on_turn_end`. Full customization (overriding `run`) is refused by adapters/swift.py."""

    def step(self, infer_request, response_choice, current_turn: int) -> Dict:
        raise NotImplementedError(
            'Please implement the `step` method in your MultiTurnScheduler subclass, or override the `run` method.')

    def check_finished(self, infer_request, response_choice, current_turn: int) -> bool:
        if response_choice.finish_reason == 'length':
            return True
        if self.max_turns and current_turn >= self.max_turns:
            return True
        return False

    @staticmethod
    def _extract_logprobs_from_choice(response_choice) -> List[float]:
        if response_choice.logprobs is None:
            return []
        if 'content' in response_choice.logprobs:
            return [item['logprob'] for item in response_choice.logprobs['content']]
        return []


# -- swift/rewards/orm.py -------------------------------------------------------------------------------------------
class ORM:
    """Base class for synchronous outcome reward models (ORM): `__call__(self, completions, **kwargs)`."""

    def __init__(self, args=None, **kwargs):
        self.args = args

    def __call__(self, **kwargs) -> List[float]:
        raise NotImplementedError


class AsyncORM:
    """Base class for asynchronous outcome reward models: `async __call__(self, completions, **kwargs)`."""

    def __init__(self, args=None, **kwargs):
        self.args = args

    async def __call__(self, **kwargs) -> List[float]:
        raise NotImplementedError


class MathAccuracy(ORM):

    def __init__(self, args=None, **kwargs):
        super().__init__(args, **kwargs)
        import importlib.util
        assert importlib.util.find_spec('math_verify') is not None, (
            'The math_verify package is required but not installed. '
            "Please install it using 'pip install math_verify'.")

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
        rewards = []
        for content, sol in zip(completions, solution):
            content_match = re.search(r'<answer>(.*?)</answer>', content, re.DOTALL)
            content_to_parse = content_match.group(1).strip() if content_match else content
            has_answer_tag = content_match is not None

            sol_match = re.search(r'<answer>(.*?)</answer>', sol, re.DOTALL)
            sol_to_parse = sol_match.group(1).strip() if sol_match else sol

            gold_parsed = parse(sol_to_parse, extraction_mode='first_match')
            if len(gold_parsed) != 0:
                if has_answer_tag:
                    answer_parsed = parse(content_to_parse, extraction_mode='first_match')
                else:
                    answer_parsed = parse(
                        content_to_parse,
                        extraction_config=[
                            LatexExtractionConfig(
                                normalization_config=NormalizationConfig(
                                    nits=False, malformed_operators=False, basic_latex=True, boxed=True, units=True),
                                boxed_match_priority=0,
                                try_extract_without_anchor=False,
                            )
                        ],
                        extraction_mode='first_match',
                    )
                try:
                    reward = float(verify(gold_parsed, answer_parsed))
                except Exception:
                    reward = 0.0
            else:
                reward = 0.0
            rewards.append(reward)
        return rewards


class Format(ORM):

    def __call__(self, completions, **kwargs) -> List[float]:
        pattern = r'^<think>.*?</think>\s*<answer>.*?</answer>(?![\s\S])'
        matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completions]
        return [1.0 if match else 0.0 for match in matches]


class ReActFormat(ORM):

    def __call__(self, completions, **kwargs) -> List[float]:
        pattern = r'^<think>.*?</think>\s*Action:.*?Action Input:.*?$'
        matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completions]
        return [1.0 if match else 0.0 for match in matches]


orms = {'accuracy': MathAccuracy, 'format': Format, 'react_format': ReActFormat}


# -- swift's built-in continuation scheduler (swift/rollout/multi_turn.py, MathTipsScheduler) ------------------------
class MathTipsScheduler(MultiTurnScheduler):
    tips_prompt = 'But wait... It seems I made a mistake,'

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_func = kwargs.get('acc_function', MathAccuracy())
        self._tips_token_ids = None

    def _get_tips_token_ids(self, tokenizer) -> List[int]:
        if self._tips_token_ids is None:
            self._tips_token_ids = tokenizer.encode(self.tips_prompt, add_special_tokens=False)
        return self._tips_token_ids

    def check_finished(self, infer_request, response_choice, current_turn: int) -> bool:
        last_completion = infer_request.messages[-1]['content']
        if self.tips_prompt in last_completion:  # we only give tips once
            return True
        solution = infer_request.data_dict['solution']
        acc = self.acc_func([last_completion], [solution])[0]
        if acc == 1:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn: int) -> Dict:
        completion = response_choice.message.content
        response_token_ids = list(response_choice.token_ids) if response_choice.token_ids else []
        rollout_logprobs = self._extract_logprobs_from_choice(response_choice)
        truncate_idx = len(completion)
        if '<answer>' in completion:
            truncate_idx = min(truncate_idx, completion.index('<answer>'))
        if '</think>' in completion:
            truncate_idx = min(truncate_idx, completion.index('</think>'))
        if truncate_idx < len(completion):
            truncated_completion = completion[:truncate_idx]
            if response_token_ids and self.tokenizer is not None:
                token_truncate_idx = len(response_token_ids)
                for i in range(1, len(response_token_ids) + 1):
                    decoded = self.tokenizer.decode(response_token_ids[:i], skip_special_tokens=False)
                    if len(decoded) >= truncate_idx:
                        token_truncate_idx = i
                        break
                response_token_ids = response_token_ids[:token_truncate_idx]
                if rollout_logprobs:
                    rollout_logprobs = rollout_logprobs[:token_truncate_idx]
            completion = truncated_completion
        completion += self.tips_prompt
        if response_token_ids and self.tokenizer is not None:
            tips_token_ids = self._get_tips_token_ids(self.tokenizer)
            response_loss_mask = [1] * len(response_token_ids) + [0] * len(tips_token_ids)
            response_token_ids = response_token_ids + tips_token_ids
        else:
            response_loss_mask = []
        if infer_request.messages[-1]['role'] == 'assistant':
            if not infer_request.messages[-1]['content']:
                infer_request.messages.pop(-1)
            infer_request.messages[-1]['content'] = completion
        else:
            infer_request.messages.append({'role': 'assistant', 'content': completion})
        result = {'infer_request': infer_request}
        if response_token_ids:
            result['response_token_ids'] = response_token_ids
            result['response_loss_mask'] = response_loss_mask
            if rollout_logprobs:
                result['rollout_logprobs'] = rollout_logprobs
        return result


class GYMScheduler(MultiTurnScheduler):
    """A stand-in: a plugin that subclasses swift's gym scheduler imports, and adapters/swift.py refuses it, naming
    what to write instead (swift's code is not copied)."""

    def step(self, infer_request, response_choice, current_turn: int) -> Dict:
        return {'infer_request': infer_request}


class OpenEnvScheduler(GYMScheduler):
    """A stand-in, as GYMScheduler (an OpenEnv server trains through the `openenv_env` field)."""


multi_turns = {'math_tip_trick': MathTipsScheduler, 'gym_scheduler': GYMScheduler,
               'openenv_scheduler': OpenEnvScheduler}


def get_logger():
    return logging.getLogger('swift')


def to_device(data, device, non_blocking: bool = False):
    """swift.utils.to_device: move the tensors of a nested structure to `device`."""
    import torch
    if isinstance(data, dict):
        return type(data)({k: to_device(v, device, non_blocking) for k, v in data.items()})
    if isinstance(data, (tuple, list)):
        return type(data)(to_device(v, device, non_blocking) for v in data)
    if isinstance(data, torch.Tensor):
        return data.to(device=device, non_blocking=non_blocking)
    return data


# -- swift/rollout/gym_env.py: the gym environment base (swift's GYMScheduler, which steps it, is refused) ------------
class Env(ABC):
    """Base environment interface for GRPO training: async reset(config) -> (observation, info, system_message),
    async step(messages) -> (next_observation, reward, done, info), async close()."""

    def __init__(self, env_config):
        self.env_config = env_config

    async def reset(self, config):
        raise NotImplementedError

    async def step(self, action):
        raise NotImplementedError

    async def close(self):
        raise NotImplementedError


envs = {}
rm_plugins = {}


# -- what a plugin file names but mt-grpo does not run: importable (a plugin may subclass it), refused when made ------
def _not_here(name: str, instead: str):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{name} is ms-swift's, and mt-grpo's copy of swift (mt_grpo/adapters/swift_compat.py) does not "
                           f"run it: {instead}, or install ms-swift.")
    return type(name, (), {'__init__': __init__, '__doc__': f'A stand-in for swift\'s {name} ({instead}).'})


TransformersEngine = _not_here('TransformersEngine', "mt-grpo's sampler generates every turn")
Template = _not_here('Template', "mt-grpo renders conversations with the model's chat template")
DefaultRMPlugin = _not_here('DefaultRMPlugin', 'a reward model goes inside a reward function here')


# -- the `swift` modules a plugin file imports from -------------------------------------------------------------------
_PROTOCOL = ['InferRequest', 'RolloutInferRequest', 'RequestConfig', 'ChatMessage', 'ChatCompletionResponse',
             'ChatCompletionResponseChoice', 'RolloutResponseChoice', 'RolloutOutput', 'Function',
             'ChatCompletionMessageToolCall', 'random_uuid']
_SCHEDULERS = ['RolloutScheduler', 'MultiTurnScheduler', 'MathTipsScheduler', 'GYMScheduler', 'OpenEnvScheduler',
               'multi_turns']
_REWARDS = ['ORM', 'AsyncORM', 'MathAccuracy', 'Format', 'ReActFormat', 'orms']
MODULES = {  # module name -> the names it offers (ms-swift 4.x paths, then 3.x's)
    'swift': [], 'swift.utils': ['get_logger', 'remove_response', 'to_device'],
    'swift.template': ['Messages', 'Template'],
    'swift.infer_engine': _PROTOCOL + ['TransformersEngine'], 'swift.infer_engine.protocol': _PROTOCOL,
    'swift.rollout': _SCHEDULERS + ['Env', 'envs'], 'swift.rollout.multi_turn': _SCHEDULERS + _PROTOCOL + ['Messages'],
    'swift.rollout.gym_env': ['Env', 'envs', 'Messages'],
    'swift.rewards': _REWARDS + ['rm_plugins'], 'swift.rewards.orm': _REWARDS,
    'swift.rewards.rm_plugin': ['DefaultRMPlugin', 'rm_plugins'],
    'swift.plugin': _SCHEDULERS + _REWARDS, 'swift.plugin.multi_turn': _SCHEDULERS + _PROTOCOL,
    'swift.plugin.orm': _REWARDS,
    'swift.llm': _PROTOCOL, 'swift.llm.infer': _PROTOCOL, 'swift.llm.infer.protocol': _PROTOCOL,
}


def _missing(module: str):
    def __getattr__(name: str):
        if name.startswith('__'):
            raise AttributeError(name)
        raise ImportError(
            f"`from {module} import {name}`: mt-grpo runs ms-swift plugins without ms-swift, through a copy of "
            f"swift's scheduler and reward classes (mt_grpo/adapters/swift_compat.py), which has no `{name}`. Install "
            "ms-swift (`pip install ms-swift`) so that the plugin imports the real one, or drop that import from "
            "the plugin (swift's inference engines, templates and gym environments are not used by mt-grpo).")
    return __getattr__


def install() -> None:
    """Make `swift` and the modules MODULES lists importable from this copy (only when ms-swift does not import)."""
    this = sys.modules[__name__]
    for name, names in MODULES.items():
        module = types.ModuleType(name, f'mt-grpo copy of ms-swift 4.6.0 ({__name__})')
        module.__path__ = []  # a package: its submodules import
        module.__mt_grpo_compat__ = True
        for attr in names:
            setattr(module, attr, getattr(this, attr))
        module.__getattr__ = _missing(name)
        sys.modules[name] = module
    for name in MODULES:  # `import swift.rollout` binds the submodule on its parent
        parent, _, child = name.rpartition('.')
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
