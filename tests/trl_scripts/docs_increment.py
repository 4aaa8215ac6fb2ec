"""TRL's docs/source/grpo_trainer.md at huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8, "Agent Training":
the "Providing an external dataset" example (IncrementEnv: a strict-ish `reset(self, target, **kwargs) -> None` fed by
the row's `target` column, an environment-owned `get_reward`, no `reward_funcs`), with `increment`'s full docstring
from the "Environments" example (the external-dataset snippet points to it), and the "Tools" example's standalone
tools (`multiply`, and `async_add`, an async tool) passed beside it, as "They compose" says. The code is the docs',
verbatim; the model and output folder come from the environment and the settings are CPU-sized (the docs':
Qwen/Qwen3-0.6B, defaults). tests/test_trl_scripts.py runs it under TRL's GRPOTrainer and, with only its import
swapped, under mt_grpo_trainer's.
"""
import os

from datasets import Dataset

from trl import GRPOConfig, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


# Each row carries the prompt and the task data (here, the counter target to reach).
dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
        "target": list(range(1, 7)),
    }
)


class IncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


if __name__ == "__main__":
    trainer = GRPOTrainer(
        model=os.environ["TRL_SCRIPT_MODEL"],
        args=GRPOConfig(output_dir=os.environ["TRL_SCRIPT_OUTPUT"], max_steps=1, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=256, bf16=False, report_to="none"),
        train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
        environment_factory=IncrementEnv,
        tools=[multiply, async_add],
    )
    trainer.train()
