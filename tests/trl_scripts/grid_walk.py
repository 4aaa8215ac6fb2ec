"""A game script in the shape of TRL 1.16's environment_factory examples, written for the tests: a walk on a
5 x 5 grid to a treasure 8 steps away (at least 5 moves are needed), a `prompt`-only dataset, one `reward_funcs`
callable that requires `environments`, and LoRA through `peft_config`. It imports TRL's GRPOTrainer;
tests/test_trl_scripts.py runs it as it is and with only its import line swapped for mt_grpo_trainer's. The model
and the output folder come from the environment (a CPU-sized model), and the log history is written at the end."""
import json
import os

from datasets import Dataset
from peft import LoraConfig

from trl import GRPOConfig, GRPOTrainer


PROMPT = "Walk to the treasure on the grid. Use the tool `step` with one of: up, down, left, right."
SIZE = 5
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


class GridWalkEnv:
    def reset(self, **kwargs) -> str:
        self.position = (0, 0)
        self.treasure = (SIZE - 1, SIZE - 1)
        self.steps = 0
        return self._observe()

    def step(self, direction: str) -> str:
        """
        Take one step on the grid.

        Args:
            direction: One of "up", "down", "left", "right".

        Returns:
            Where you stand after the step.
        """
        if self.position == self.treasure:
            raise ValueError("The treasure is found: the walk is over.")
        if direction.strip().lower() not in MOVES:
            raise ValueError(f"Unknown direction {direction!r}.")
        dr, dc = MOVES[direction.strip().lower()]
        row, col = self.position
        self.position = (min(max(row + dr, 0), SIZE - 1), min(max(col + dc, 0), SIZE - 1))
        self.steps += 1
        return self._observe()

    def _distance(self) -> int:
        return abs(self.position[0] - self.treasure[0]) + abs(self.position[1] - self.treasure[1])

    def _observe(self) -> str:
        found = self.position == self.treasure
        return f"You stand at row {self.position[0]}, column {self.position[1]}. " + (
            "You found the treasure!" if found else f"The treasure is {self._distance()} steps away.")


def reward_walk(environments, **kwargs):
    return [1.0 - env._distance() / (2 * (SIZE - 1)) for env in environments]


def main() -> None:
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}] for _ in range(64)]})

    trainer = GRPOTrainer(
        model=os.environ["TRL_SCRIPT_MODEL"],
        train_dataset=dataset,
        reward_funcs=reward_walk,
        args=GRPOConfig(
            output_dir=os.environ["TRL_SCRIPT_OUTPUT"],
            chat_template_kwargs={"enable_thinking": False},
            logging_steps=1,
            log_completions=True,
            num_completions_to_print=2,
            report_to="none",
            max_completion_length=96,
            per_device_train_batch_size=4,
            num_generations=4,
            max_steps=1,
            bf16=False,
        ),
        environment_factory=GridWalkEnv,
        peft_config=LoraConfig(),
    )
    trainer.train()
    with open(os.path.join(os.environ["TRL_SCRIPT_OUTPUT"], "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
