"""Images in the conversation: a vision-language policy (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) sees images that a dataset's
prompt, a tool, or an environment's reply or reset brings, and is trained on exactly the tokens and images it saw.
The three families share the vision tokens, the image processor (Qwen2-VL's: Qwen3-VL's with 16 px patches, not 14)
and the model's keywords; nothing here reads the patch size: an image's tokens are its processor's grid / merge^2.

The representation (the contract the in-process backend, the vLLM server path and the adapters share):

  - An image is a content block `{"type": "image", "image": PIL.Image}` inside a message's content list, where it
    entered the conversation: the prompt's messages (`Episode.prompt_messages`: TRL's `image`/`images` columns become
    blocks at the start of the first user message), a tool message (a tool returning a PIL image, or TRL's content
    blocks), a user reply (`respond`/`Reply`), or a reset observation. Nothing else holds images: the episode's images
    are `conversation_images(ep.prompt_messages + ep.messages)`, in the order the chat template renders them.
  - Tokens: the chat template renders one `<|image_pad|>` per image block; `Vision.expand` widens the k-th to the k-th
    image's placeholder count (its grid's patches / merge_size^2), as the processor does. Every placeholder, and the
    template's <|vision_start|>/<|vision_end|>, is an environment token (mask 0, never scored). A template that renders
    fewer placeholders than the images given, or fails on a content list, fails naming the template, the roles and
    the fix (`Vision.expand`, DroppedImages); the run's start probes each role apart (run/builders.check_vision). The
    image processor is the one of the processor given as `processing_class` (processor_tokenizer), else the folder's.
  - Which images a token sequence refers to: the first k of the conversation's images, where k is the count of
    <|vision_start|> in it (`images_of`). A sample (an episode, or one of its per-turn samples) holds the placeholders
    of every image before its end, in order: a re-rendered history repeats them all.
  - A backend gets, per prompt, `images=[[ImageFeatures, ...], ...]` (`Vision.generation_images`: the images of that
    prompt's tokens) and passes the processor's `pixel_values` and `image_grid_thw` of each, in order
    (`model_inputs`); the in-process backend left-pads such rows without a shared prefix. The vLLM server client sends
    each image itself beside the prompt's ids (engine/server_images.py: `source` and `image_token_id`), and a server
    that takes no images with ids, or processes them with another image processor than the PIL one `Vision.of`
    loads, is refused at start for a vision model (ServerImages.check_images). Episodes whose first turns go as one
    prompt with n samples share their ids and their pictures (`Images.request_key`), not their ids alone.
  - The forward: the batch's `images` (pad_episodes: a RowImages, each row's ImageFeatures) reach the trainer's
    forwards through PackedForward.row_samples; a batch with images is forwarded one sample at a time
    (packing.sample_logps_and_entropies): its ids unpadded, its own images, and the positions the model computes itself
    (the 3-D rotary `get_rope_index` from the ids, `mm_token_type_ids` and the grids; Qwen3-VL interleaves its
    sections, and its deepstack adds vision features at the image tokens of its first layers), so its log-probs are
    those of the sample alone. padding_free's trie gives each token one position and one row, so packing is off for
    such batches (logged once).

Videos are refused (`image_content`): a video's frames need the video processor (torchvision) and per-frame grids that
no backend here passes."""

import hashlib
import logging
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from mt_grpo.base.protocol import is_image_block

logger = logging.getLogger("mt_grpo")

VISION_START, IMAGE_PAD = "<|vision_start|>", "<|image_pad|>"  # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's


def is_image(value) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def is_video_block(part) -> bool:
    return isinstance(part, dict) and (part.get("type") == "video" or "video" in part and part.get("type") is None)


def content_images(content) -> list:
    """The images of a message's content (a list of blocks), in order."""
    return [part["image"] for part in content if is_image_block(part)] if isinstance(content, list) else []


def conversation_images(messages: list[dict]) -> list:
    """Every image of `messages`, in the order a chat template renders them."""
    return [image for m in messages if isinstance(m, dict) for image in content_images(m.get("content"))]


def has_images(messages: list[dict]) -> bool:
    return any(content_images(m.get("content")) for m in messages if isinstance(m, dict))


def image_content(value, source: str):
    """A tool's or an environment's return as message content: a PIL image -> `[{"type": "image", "image": img}]`; a
    list of blocks with images checked (each image block holds a PIL image; a video block refused); anything else as
    it is."""
    if is_image(value):
        return [{"type": "image", "image": value}]
    if isinstance(value, list):
        for part in value:
            if is_video_block(part):
                raise ValueError(f"{source} returned a video block: videos are not supported (their frames need the "
                                 "video processor and per-frame grids that no backend here passes); return frames as "
                                 "images ({'type': 'image', 'image': PIL.Image}).")
            if is_image_block(part) and not is_image(part.get("image")):
                raise ValueError(f"{source} returned an image block whose 'image' is a {type(part.get('image')).__name__}"
                                 "; give a PIL.Image.Image (PIL.Image.open(path) for a file).")
        if any(is_image(part) for part in value):
            return [{"type": "image", "image": part} if is_image(part) else part for part in value]
    return value


def prompt_with_images(prompt: list[dict], images) -> list[dict]:
    """A row's prompt with TRL's `image`/`images` column (a PIL image or a list): as TRL's
    prepare_multimodal_messages, each `{"type": "image"}` block without an image takes the next one, in order; where
    the prompt has no such block, the images go first in its first user message."""
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    if bad := next((im for im in images if not is_image(im)), None):
        raise ValueError(f"A row's image is a {type(bad).__name__}; the `image`/`images` columns take PIL images "
                         "(datasets' Image feature decodes to them).")
    if not images:
        return prompt
    slots = [(k, j) for k, m in enumerate(prompt) if isinstance(m.get("content"), list)
             for j, part in enumerate(m["content"]) if is_image_block(part) and not is_image(part.get("image"))]
    messages = [dict(m, content=list(m["content"])) if isinstance(m.get("content"), list) else dict(m) for m in prompt]
    if slots:
        if len(slots) != len(images):
            raise ValueError(f"A row's prompt has {len(slots)} image blocks but its image column {len(images)} images; "
                             "give one image per {'type': 'image'} block.")
        for (k, j), image in zip(slots, images):
            messages[k]["content"][j] = {"type": "image", "image": image}
        return messages
    k = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if k is None:
        raise ValueError("A row has images (`image`/`images` column) but its prompt has no user message to put them in.")
    content = messages[k]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else content
    messages[k]["content"] = [{"type": "image", "image": image} for image in images] + text
    return messages


def row_image_column(row: dict):
    return row.get("images", row.get("image")) if isinstance(row, dict) else None


@dataclass
class ImageFeatures:
    """One image as the model takes it: the processor's patches (P, D) and grid (3,) (t, h, w in patches), and how
    many placeholder tokens stand for it in the ids; for the vLLM server (engine/server_images.py), the placeholder
    token and a weak reference to the image (the server processes the image itself)."""

    pixel_values: torch.Tensor
    grid: torch.Tensor
    tokens: int
    image_token_id: int | None = None
    source: "weakref.ref | None" = None


_FEATURES: dict[int, ImageFeatures] = {}  # id(image) -> its features, from its first render (Vision.features)


def kept_while_alive(cache: dict, image, compute: Callable):
    """cache[id(image)], computed on the first ask and dropped when the image is (its id may then be reused)."""
    key = id(image)
    if key not in cache:
        cache[key] = compute()
        weakref.finalize(image, cache.pop, key, None)
    return cache[key]


def image_features(image) -> ImageFeatures:
    """The features a Vision computed when it rendered `image` (every image of an episode was rendered)."""
    if id(image) not in _FEATURES:
        raise RuntimeError("An episode's image was never rendered by a vision tokenizer (engine/vision.Vision): it was "
                           "copied after it entered the conversation, or added outside the episode loop.")
    return _FEATURES[id(image)]


def row_images(episodes) -> "RowImages | None":
    """pad_episodes' `images`: each episode's ImageFeatures, in order; None where no episode has an image."""
    rows = [[image_features(im) for im in conversation_images(ep.prompt_messages + ep.messages)] for ep in episodes]
    return RowImages(rows) if any(rows) else None


class RowImages(list):
    """The batch's `images`: per row, its episode's ImageFeatures (pad_episodes). A list TRL's shuffle and split
    index like its tensors; `to` keeps it (the features move with each forward)."""

    def to(self, device):
        return self


class DroppedImages(ValueError):
    """A chat template that drops the images of some roles' messages (Vision.expand): the template, the roles whose
    messages held images, and what it did. The fix depends on the roles: tool only, `tool_images_as_user` (a user
    message after the tool's reply holds them); a user's, a template that renders image blocks there. The run's
    start probes each role apart (run/builders.check_vision), so that its error names the one fix that works."""

    def __init__(self, template: str, roles: list[str], what: str):
        self.template, self.roles = template, roles
        fix = ("Set `tool_images_as_user: true` to move a tool's images into a user message after its reply, or give "
               "a chat template that renders image blocks in tool messages" if roles == ["tool"] else
               "Give a chat template that renders image blocks in every role's content list (`processing_class`, or "
               "the model folder's chat_template.jinja), as Qwen2-VL's and Qwen2.5-VL's own chat_template.json do (it "
               "writes no tools: `tool_format: auto` then describes them in the system prompt, xml)")
        super().__init__(f"{template} {what}: the images of {'/'.join(roles)} messages would not reach the model, "
                         f"which would be trained on a conversation it never saw. {fix}.")


_GIVEN_IMAGE_PROCESSORS: dict[int, object] = {}  # id(tokenizer) -> the image processor of the processor it came from


def processor_tokenizer(processing_class):
    """The tokenizer of a `processing_class`: a processor's (TRL's form for a vision-language model,
    `AutoProcessor.from_pretrained(...)`), whose image processor its Vision then uses (the processor's
    `min_pixels`/`max_pixels`, as the user set them); a tokenizer as it is."""
    from transformers import ProcessorMixin

    if not isinstance(processing_class, ProcessorMixin):
        return processing_class
    tokenizer = processing_class.tokenizer
    if getattr(processing_class, "image_processor", None) is not None:
        _GIVEN_IMAGE_PROCESSORS[id(tokenizer)] = pil_image_processor(processing_class.image_processor)
        weakref.finalize(tokenizer, _GIVEN_IMAGE_PROCESSORS.pop, id(tokenizer), None)
    return tokenizer


def pil_image_processor(image_processor):
    """The PIL backend of an image processor, its settings kept. Where torchvision imports (any GPU install),
    `AutoProcessor.from_pretrained` gives torchvision's, whose resize makes other pixels than PIL's (the same grid
    and tokens: 1e-3 apart in log-probs on noise, docs/results.md); the trainer's pixels are PIL's, as a vLLM
    server's are held to be (server_images: `use_fast: false`)."""
    if getattr(image_processor, "backend", "pil") == "pil":
        return image_processor
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    name = type(image_processor).__name__
    pil = next((b.get("pil") for b in IMAGE_PROCESSOR_MAPPING_NAMES.values() if isinstance(b, dict) and
                name in b.values()), None)
    if pil is None:
        raise ValueError(f"The processing_class's image processor {name} has no PIL backend that transformers knows, "
                         "and the trainer's pixels are PIL's (a vLLM server is held to them). Pass a processor whose "
                         "image processor is a PIL one (`AutoProcessor.from_pretrained(path, backend='pil')`).")
    return getattr(transformers, pil).from_dict(image_processor.to_dict())


_DIGESTS: dict[int, tuple] = {}  # id(image) -> image_digest, kept while the image lives


def image_digest(image) -> tuple:
    """What tells two images apart: their mode, size and pixels (two PIL objects of one picture are the same). Hashed
    once per image (a large screenshot takes milliseconds, and each episode's key is asked for more than once)."""
    return kept_while_alive(_DIGESTS, image, lambda: (image.mode, image.size,
                                                      hashlib.blake2b(image.tobytes(), digest_size=16).digest()))


class Images:
    """What TextOnly and Vision share: the rows' image columns put in their prompts, and which episodes are one
    request."""

    def request_key(self, ep) -> tuple:
        """What makes episodes' next turns one prompt (a group's first turns: one request of n samples): the same ids
        and the same images. Ids alone are not enough: two rows may ask one question of two pictures, whose
        placeholders are the same tokens."""
        return tuple(ep.context_ids), tuple(image_digest(im) for im in conversation_images(ep.prompt_messages +
                                                                                           ep.messages))

    def with_row_images(self, prompts: list[list[dict]], rows: list[dict] | None) -> list[list[dict]]:
        """Each prompt with its row's `image`/`images` column (prompt_with_images); the prompts where none has one."""
        if not rows or all(row_image_column(row) is None for row in rows):
            return prompts
        return [prompt_with_images(p, row_image_column(row)) for p, row in zip(prompts, rows)]


class TextOnly(Images):
    """A tokenizer without an image token: any image is refused, naming the fix."""

    name = None
    placeholder_ids = ()

    def __init__(self, tokenizer):
        self.model = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__

    def expand(self, render: Callable[[], list[int]], messages: list[dict]) -> list[int]:
        """`render()`, the ids of `messages`; an image among them is refused before the template sees it."""
        if has_images(messages):
            self.refuse("An image reached the conversation")
        return render()

    def refuse(self, what: str):
        raise ValueError(f"{what}, but {self.model} is a text-only model (no image token or no preprocessor_config.json "
                         "beside its tokenizer): train a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), or "
                         "have the tool, environment or dataset give text.")

    def generation_images(self, episodes) -> dict:
        return {}


class Vision(Images):
    """A vision-language tokenizer and its image processor: the placeholders of each image (`expand`) and its
    features, computed once per image (kept while the image lives)."""

    name = "vision"

    def __init__(self, tokenizer, image_processor, template_name: str = "The chat template"):
        self.tokenizer, self.image_processor, self.template_name = tokenizer, image_processor, template_name
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.start_token_id = tokenizer.convert_tokens_to_ids(VISION_START)
        self.merge = getattr(image_processor, "merge_size", 2) ** 2
        vocab = tokenizer.get_vocab()  # the tokens only the template writes around an image: never text
        self.placeholder_ids = tuple(vocab[t] for t in ("<|vision_start|>", "<|vision_end|>", IMAGE_PAD, "<|video_pad|>")
                                     if t in vocab)

    @classmethod
    def of(cls, tokenizer) -> "Vision | TextOnly":
        """The tokenizer's Vision, where it has an image token and an image processor: the one of the processor it came
        from (processor_tokenizer), else its folder's (preprocessor_config.json); else TextOnly (Qwen2.5's text
        tokenizers have the image token, and no processor)."""
        import os

        path = getattr(tokenizer, "name_or_path", None) or ""
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        given = _GIVEN_IMAGE_PROCESSORS.get(id(tokenizer))
        folder = os.path.isfile(os.path.join(path, "preprocessor_config.json"))
        if IMAGE_PAD not in vocab or given is None and not folder:
            return TextOnly(tokenizer)
        name = f"The chat template of {path}" if path else "The processing_class's chat template"
        if given is not None:
            return cls(tokenizer, given, name)
        from transformers import AutoImageProcessor

        # PIL's, wherever torchvision imports too (transformers 5 then picks torchvision's, whose resize gives other
        # pixels): the processor the folder names in transformers 4's sense, and the one a vLLM server is held to
        # (engine/server_images.py: --mm-processor-kwargs '{"use_fast": false}')
        return cls(tokenizer, AutoImageProcessor.from_pretrained(path, backend="pil"), name)

    def features(self, image) -> ImageFeatures:
        """The image's features, processed on its first render and kept while it lives (image_features reads them)."""
        def compute() -> ImageFeatures:
            out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
            grid = out["image_grid_thw"][0]
            return ImageFeatures(out["pixel_values"], grid, int(grid.prod()) // self.merge, self.image_token_id,
                                 weakref.ref(image))

        return kept_while_alive(_FEATURES, image, compute)

    def expand(self, render: Callable[[], list[int]], messages: list[dict]) -> list[int]:
        """`render()` (the ids of `messages`) with the k-th image placeholder widened to the k-th image's tokens.
        A template that fails on a content list, or renders fewer placeholders than images, drops them: an error
        naming it, the roles that held images, and the fix (DroppedImages)."""
        images = conversation_images(messages)
        roles = sorted({m["role"] for m in messages if isinstance(m, dict) and content_images(m.get("content"))})
        try:
            ids = render()
        except TypeError as e:  # Qwen2.5's text template: '...' + message.content, a string and a list
            if not images:
                raise
            raise DroppedImages(self.template_name, roles, "fails on a content list of image and text blocks "
                                f"({type(e).__name__}: {e})") from e
        found = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(found) != len(images):
            raise DroppedImages(self.template_name, roles, f"rendered {len(found)} image placeholders for the "
                                f"{len(images)} images of the conversation")
        out, last = [], 0
        for i, image in zip(found, images):
            out += ids[last:i] + [self.image_token_id] * self.features(image).tokens
            last = i + 1
        return out + ids[last:]

    def images_of(self, ids: list[int], images: list) -> list[ImageFeatures]:
        """The features of the images `ids` refers to: the first k of the conversation's `images`, k its
        <|vision_start|> count."""
        k = sum(t == self.start_token_id for t in ids)
        if k > len(images):
            raise RuntimeError(f"{k} images in a sample's tokens but {len(images)} in its conversation")
        return [self.features(image) for image in images[:k]]

    def generation_images(self, episodes) -> dict:
        """The backend's `images` keyword for the episodes' next turns (none where no episode has an image)."""
        per = [self.images_of(ep.context_ids, conversation_images(ep.prompt_messages + ep.messages))
               for ep in episodes]
        return {"images": per} if any(per) else {}


THUMBNAIL_PIXELS = 96  # the longest side of a recorded image (rollout records, the viewer)


def thumbnail(image) -> dict:
    """A recorded image: its size and a PNG thumbnail of at most THUMBNAIL_PIXELS a side, as a data URL that the
    viewer's <img> shows."""
    import base64
    import io

    small = image.convert("RGB")
    small.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return {"type": "image", "size": list(image.size),
            "thumbnail": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}


def json_image(value):
    """json.dumps' `default` for records: an image as its thumbnail; anything else is refused as json refuses it."""
    if is_image(value):
        return thumbnail(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def vision_token_ids(config) -> list[int]:
    """A vision model's image and video placeholders and their brackets: tokens only an image may hold, so the
    in-process sampler never draws them (a sampled placeholder would have no image: the forward would fail, as it
    does where vLLM draws one). Its logprobs are those of the distribution without them; [] for a text model."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [i for i in (getattr(config, n, None) for n in names) if isinstance(i, int)] if hasattr(
        config, "vision_config") else []


def model_inputs(input_ids: torch.Tensor, images: list[ImageFeatures], image_token_id: int) -> dict:
    """The keywords a Qwen2-VL-style model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) takes beside `input_ids` (R, L) whose
    rows hold `images` in order: `pixel_values` (patches of every image, concatenated), `image_grid_thw` (one row per
    image), `mm_token_type_ids` (1 at image placeholders), from which the model computes its 3-D rotary positions."""
    if not images:
        return {}
    device = input_ids.device
    return {"pixel_values": torch.cat([f.pixel_values for f in images]).to(device),
            "image_grid_thw": torch.stack([f.grid for f in images]).to(device),
            "mm_token_type_ids": (input_ids == image_token_id).int()}
