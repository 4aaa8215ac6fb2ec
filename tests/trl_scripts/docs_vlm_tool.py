"""TRL's docs/source/grpo_trainer.md at huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8, "Multimodal Tool
Responses" (a tool that returns a list of content blocks, an image and a text) on "Vision-Language Model (VLM)
Training"'s dataset form (docs/source/dataset_formats.md: a conversational prompt whose user message holds a
`{"type": "image"}` block, and an `images` column of PIL images), written as a TRL user writes it: no argument
but TRL's. The docs' tool opens a screenshot file; here it draws the digit it is asked to zoom into, so that the
script needs no file, and its docstring is the one the tiny vision agent was taught with
(scripts/prepare_models.py: zoom). The model and output folder come from the environment and the settings are CPU-sized.
tests/test_trl_scripts.py runs it under TRL's GRPOTrainer and, with only its import swapped, under mt_grpo_trainer's.
"""
import os

from datasets import Dataset
from PIL import Image, ImageDraw

from trl import GRPOConfig, GRPOTrainer


def digit(n: int) -> Image.Image:
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).text((22, 20), str(n), fill="black")
    return image


def zoom(x: int):
    """Zoom into the picture.

    Args:
        x: Where to zoom, from 1 to 9.
    """
    return [{"type": "image", "image": digit(x)}, {"type": "text", "text": "Here is the zoomed picture."}]


def correct(completions, answer, **kwargs):
    return [1.0 if a in str(c[-1]["content"]) else 0.0 for c, a in zip(completions, answer)]


question = [{"type": "image"}, {"type": "text", "text": "Which number is drawn?"}]
dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": question}] for _ in range(1, 5)],
                             "images": [[digit(i)] for i in range(1, 5)],
                             "answer": [str(i) for i in range(1, 5)]})


if __name__ == "__main__":
    trainer = GRPOTrainer(
        model=os.environ["TRL_SCRIPT_MODEL"],
        args=GRPOConfig(output_dir=os.environ["TRL_SCRIPT_OUTPUT"], max_steps=2, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=160, bf16=False, report_to="none", logging_steps=1),
        train_dataset=dataset,
        reward_funcs=correct,
        tools=[zoom],
    )
    trainer.train()
