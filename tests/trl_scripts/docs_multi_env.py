"""TRL's docs/source/grpo_trainer.md at huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8, "Agent Training",
the "Multiple environments" example: `environment_factory={"coding": CodingEnv, "game": GameEnv}`, a dataset that
only routes (an `environment` column, no `prompt`: each `reset` returns the prompt), only the row's environment's
tools shown to the model. The classes and the dataset are the docs', verbatim, their tools' `...` bodies included
(each returns None, which the model reads as `None`); the docs leave `reward_func` out (`reward_kwargs
["environments"]` lets it "branch on the environment type"): the one here does that. The model and output folder
come from the environment and the settings are CPU-sized (the docs': Qwen/Qwen3-0.6B, defaults).
tests/test_trl_scripts.py runs it under TRL's GRPOTrainer and, with only its import swapped, under mt_grpo_trainer's.
"""
import os
import random

from datasets import Dataset

from trl import GRPOConfig, GRPOTrainer


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        ...

class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        ...

# The dataset only routes: each row picks the environment for that rollout
dataset = Dataset.from_dict({"environment": ["coding", "game"] * 500})


def reward_func(completions, environments, **kwargs):
    """Not in the docs: 1.0 for a coding rollout that called a tool, 0.5 for a game rollout that did, else 0.0."""
    called = [any(turn.get("tool_calls") for turn in completion) for completion in completions]
    return [float(c) * (1.0 if isinstance(env, CodingEnv) else 0.5) for c, env in zip(called, environments)]


if __name__ == "__main__":
    trainer = GRPOTrainer(
        model=os.environ["TRL_SCRIPT_MODEL"],
        args=GRPOConfig(output_dir=os.environ["TRL_SCRIPT_OUTPUT"], max_steps=1, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=256, bf16=False, report_to="none",
                        chat_template_kwargs={"enable_thinking": False}),
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    trainer.train()
