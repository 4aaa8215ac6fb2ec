"""A small image task: read a two-digit number drawn in a picture. The episode's picture (from `reset`) is a
thumbnail too small to read; the `zoom` tool returns the number drawn large. A vision-language policy learns to call
zoom before it answers (docs/guide.md, "Images in the conversation"; recipe: hf_recipes/tiny-qwen2-vl/
digits_zoom.yaml). The pictures are drawn with PIL at run time, from each row's seed: no data files."""

import random

from PIL import Image, ImageDraw

from mt_grpo.rewards.conversation import role, visible_text


def picture(number: int, size: int) -> Image.Image:
    """`number` drawn in black on white, PIL's default font scaled to a `size` x `size` picture."""
    text = Image.new("L", (14, 10), 255)
    ImageDraw.Draw(text).text((1, -1), str(number), fill=0)
    return text.resize((size, size * 10 // 14), Image.NEAREST).convert("RGB")


class DigitZoom:
    """An environment_factory class: `reset(seed)` picks the row's number (10-99) and shows it as a 12-pixel
    thumbnail; `zoom` shows it at 56 pixels."""

    def reset(self, seed: int | None = None, **kwargs) -> list[dict]:
        self.number = random.Random(seed).randint(10, 99)
        return [{"type": "text", "text": "\nWhich number is drawn? Zoom in to read it, then answer with the number."},
                {"type": "image", "image": picture(self.number, 12)}]

    def zoom(self, x: int):  # as the tiny VLM agent was taught (scripts/prepare_models.zoom)
        """Zoom into the picture.

        Args:
            x: Where to zoom, from 1 to 9.
        """
        return picture(self.number, 56)


def read_number(completions, environments, **kwargs) -> list[float]:
    """1 when the model's last message holds the episode's number (an outcome reward, TRL's signature)."""
    last = lambda c: next((visible_text(m) for m in reversed(c) if role(m) == "assistant"), "")  # noqa: E731
    return [float(str(env.number) in last(c)) for c, env in zip(completions, environments)]
