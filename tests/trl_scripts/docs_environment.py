"""TRL's docs/source/grpo_trainer.md at huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8, "Agent Training",
the "Environments" example: an IncrementEnv that self-samples its target in `reset(self, **kwargs) -> str`, whose
string becomes the prompt (no `train_dataset`: `max_steps` sets the length), an environment-owned `get_reward`, no
`reward_funcs`. The code is the docs', verbatim; the model and output folder come from the environment and the
settings are CPU-sized (the docs': Qwen/Qwen3-0.6B, max_steps 1000). tests/test_trl_scripts.py runs it under TRL's
GRPOTrainer and, with only its import swapped, under mt_grpo_trainer's.
"""
import os
import random

from trl import GRPOConfig, GRPOTrainer


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
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
                        num_generations=2, max_completion_length=256, bf16=False, report_to="none",
                        chat_template_kwargs={"enable_thinking": False}),
        environment_factory=IncrementEnv,
    )
    trainer.train()
