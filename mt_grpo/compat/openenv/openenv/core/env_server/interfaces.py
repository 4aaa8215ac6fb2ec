# SPDX-License-Identifier: BSD-3-Clause
# Copied from openenv 0.10.0 (openenv-core 0.3.0), BSD-3-Clause: mt_grpo/compat/openenv/LICENSE.
from abc import ABC, abstractmethod
from typing import Any, Generic, Optional, TypeVar

ActT = TypeVar("ActT")
ObsT = TypeVar("ObsT")
StateT = TypeVar("StateT")


class Environment(ABC, Generic[ActT, ObsT, StateT]):
    """Base class for all environment servers following Gym/Gymnasium API."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = False

    def __init__(self, transform=None, rubric=None):
        self.transform = transform
        self.rubric = rubric

    @abstractmethod
    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ObsT:
        """Reset the environment and return initial observation."""

    async def reset_async(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ObsT:
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    @abstractmethod
    def step(self, action: ActT, timeout_s: Optional[float] = None, **kwargs: Any) -> ObsT:
        """Take a step in the environment."""

    async def step_async(self, action: ActT, timeout_s: Optional[float] = None, **kwargs: Any) -> ObsT:
        return self.step(action, timeout_s=timeout_s, **kwargs)

    @property
    @abstractmethod
    def state(self) -> StateT:
        """Get the current environment state."""

    def close(self) -> None:
        """Clean up resources used by the environment."""
