"""Environment classes the tests train on, as a user writes them for TRL's `environment_factory` (environments.py),
importable by dotted path (`tests.env_examples:Lock`)."""

import asyncio
import threading


class Lock:
    """A combination lock: the row's `code` (digits) opens it, one digit at a time, in order. A right digit moves
    on (+1 step reward), a wrong one resets the lock to its first digit (-0.5): a mistake has consequences."""

    def __init__(self):
        self.code, self.position, self.step_rewards, self.tries = "", 0, [], 0

    def reset(self, code: str = "12", **kwargs) -> str:
        self.code, self.position, self.step_rewards, self.tries = code, 0, [], 0
        return f" The lock has {len(code)} digits."

    def press(self, digit: int) -> str:
        """Press the next digit of the combination.

        Args:
            digit: the digit to press, 0 to 9.
        """
        self.tries += 1
        if self.position < len(self.code) and str(digit) == self.code[self.position]:
            self.position += 1
            self.step_rewards.append(1.0)
            return "Open!" if self.position == len(self.code) else f"Click. {self.position} right so far."
        self.position = 0
        self.step_rewards.append(-0.5)
        return "Wrong: the lock resets."

    def get_reward(self) -> float:
        return 1.0 if self.position == len(self.code) else 0.0


class AsyncLock(Lock):
    """The lock with an async tool and an async get_reward, as TRL allows."""

    async def press(self, digit: int) -> str:
        """Press the next digit of the combination.

        Args:
            digit: the digit to press, 0 to 9.
        """
        await asyncio.sleep(0)
        return Lock.press(self, digit)

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return Lock.get_reward(self)


class Counter:
    """A counter with no reward of its own and no step rewards: the recipe's rewards score it."""

    def __init__(self):
        self.value = 0

    def reset(self, **kwargs) -> None:
        self.value = 0

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much to add.
        """
        self.value += amount
        return f"The counter is {self.value}."


def counter_value(prompts, completions, environments, **kwargs) -> list[float]:
    """A reward that reads each episode's environment's final state (TRL's `environments=`)."""
    return [float(env.value) if isinstance(env, Counter) else None for env in environments]


class NoReset:
    def press(self, digit: int) -> str:
        """Press.

        Args:
            digit: a digit.
        """
        return "ok"


class NoHints:
    def reset(self, **kwargs):
        return None

    def press(self, digit) -> str:
        """Press.

        Args:
            digit: a digit.
        """
        return "ok"


class NoDocstring:
    def reset(self, **kwargs):
        return None

    def press(self, digit: int) -> str:
        return "ok"


class Clashing(Lock):
    def search(self, query: str) -> str:
        """Search.

        Args:
            query: words.
        """
        return "nothing"


class BadReward(Lock):
    def get_reward(self) -> str:
        return "high"


class Gated:
    """Step rewards created only in `reset`, and an action held at a gate the test opens: `act(worth)` waits for
    `gate`, then appends `worth`. `events` records when each action starts and ends, in order, across instances."""

    gate = threading.Event()
    events: list[str] = []

    def reset(self, **kwargs) -> None:
        self.step_rewards, self.done = [], []

    def act(self, worth: float) -> str:
        """Do something worth `worth`, once the gate is open.

        Args:
            worth: the step reward it earns.
        """
        Gated.events.append(f"start {worth:g}")
        Gated.gate.wait()
        self.step_rewards.append(worth)
        self.done.append(worth)
        Gated.events.append(f"end {worth:g}")
        return f"done {worth:g}"

    def quick(self, worth: float) -> str:
        """Do something worth `worth` at once.

        Args:
            worth: the step reward it earns.
        """
        Gated.events.append(f"start quick {worth:g}")
        self.step_rewards.append(worth)
        self.done.append(worth)
        Gated.events.append(f"end quick {worth:g}")
        return f"done {worth:g}"

    def get_reward(self) -> float:
        return float(sum(self.done))


class TupleSteps(Counter):
    """step_rewards as a tuple, replaced by a longer one at each step."""

    def reset(self, **kwargs) -> None:
        self.value, self.step_rewards = 0, ()

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much to add.
        """
        self.value += amount
        self.step_rewards = self.step_rewards + (float(amount),)
        return f"The counter is {self.value}."


class DictSteps(Counter):
    def __init__(self):
        super().__init__()
        self.step_rewards = {}


class ResetDictSteps(Counter):
    def reset(self, **kwargs) -> None:
        self.value, self.step_rewards = 0, {"turn": 0}


class MissingColumn(Counter):
    """A reset that reads a column the dataset lacks."""

    def reset(self, **kwargs) -> None:
        self.value = int(kwargs["missing_column"])


class FailingTool(Counter):
    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much to add.
        """
        raise ValueError(f"unknown amount {amount}; use 1 to 9")
