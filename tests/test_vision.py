"""Images in the conversation (engine/vision.py): tiny random Qwen2-VL and Qwen2.5-VL made at test time (and Qwen3-VL,
in one test of its own), a prompt's image (TRL's `images` column) and a tool that returns one (TRL's docs' script with
only its import changed), generation in process with each conversation's images, every sample's forward with exactly its
images and the model's 3-D positions, packed or not, placeholders mask 0, and what is refused (a video, an image for a
text-only model, and at start a chat template that drops a user's or a tool's images: released Qwen templates from
tests/fixtures)."""

import json
import math
import os
import random
import sys

import pytest
import torch
from PIL import Image, ImageDraw

from conftest import shared_folder
from test_viewer import browser  # noqa: F401 (a fixture: headless Chromium)
from helpers import make_env
from mt_grpo.base.turn_samples import episode_samples
from mt_grpo.engine.vision import TextOnly, Vision, conversation_images, image_content, model_inputs
from mt_grpo.tasks.digits import DigitZoom

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="session", params=FAMILIES)
def vlm_agent_dir(request, tmp_path_factory):
    """make_tiny_vlm_agent's model of each family: it calls zoom after a question with a picture, then answers."""
    from prepare_models import make_tiny_vlm_agent

    return shared_folder(tmp_path_factory, f"tiny-vl-agent-{request.param}",
                         lambda out: make_tiny_vlm_agent(out, request.param))


def digit(n: int) -> Image.Image:
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).text((22, 20), str(n), fill="black")
    return image


def noise(size: int, seed: int) -> Image.Image:
    return Image.frombytes("RGB", (size, size), random.Random(seed).randbytes(size * size * 3))


def zoom(x: int):  # as prepare_models.zoom, which the tiny VLM agent was taught with
    """Zoom into the picture.

    Args:
        x: Where to zoom, from 1 to 9.
    """
    return digit(x)


def loaded(path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer does
    return model, AutoTokenizer.from_pretrained(path)


def rolled_out(path, turn_samples="interleaved", n=2):
    """Episodes of the tiny VLM agent with a picture in the prompt and the zoom tool, sampled in process."""
    from mt_grpo.engine.sampling import SamplingParams, TransformersBackend

    model, tokenizer = loaded(path)
    env = make_env(tokenizer, [zoom], max_completion_length=200, max_tokens_per_turn=48, turn_samples=turn_samples,
                   tokenization_check="strict", task_prompt=None, examples=None, questions=False)  # a TRL prompt's
    backend = TransformersBackend(tokenizer=tokenizer, params=SamplingParams(temperature=1.0),
                                  eos_token_ids=env.eos_token_ids, stop_strings=env.protocol.stop_strings)

    from accelerate import Accelerator

    backend.sync_weights(model, Accelerator(cpu=True))
    rows = [{"images": [digit(3)]}] * n + [{"images": [digit(5)]}] * n
    prompts = [env.prompt([{"role": "user", "content": "Which number is drawn?"}]) for _ in rows]
    torch.manual_seed(0)
    return model, tokenizer, env, env.rollout(prompts, backend, rows=rows)


def alone_logps(model, vision, ids: list[int], images: list, lead: int) -> torch.Tensor:
    """The log-probs of ids[lead:] with the sample forwarded alone through the plain logits (not the fused head)."""
    x = torch.tensor([ids])
    logits = model(input_ids=x, **model_inputs(x, images, vision.image_token_id)).logits[0].float()
    return logits.log_softmax(-1)[lead - 1 : -1].gather(1, x[0, lead:, None]).squeeze(1)


def each_sample_forwarded(model, vision, episodes, batch):
    """The trainer's forward of a padded batch (pad_episodes), padding_free off then on, against each sample forwarded
    alone with its images: yields (padding_free, row, k, sample, its ids, its images, the columns of its completion in
    the batch, its per-token log-probs in the trainer's forward, alone), having checked that the two are equal on
    the sample's model tokens."""
    from mt_grpo.engine.packing import PackedForward

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    starts = batch["sample_starts"] if batch["sample_starts"].any() else None
    for padding_free in (False, True):
        args = type("Args", (), {"padding_free": padding_free, "max_tokens_per_microbatch": None})()
        packing = PackedForward(args, None, {"train": {}, "eval": {}})
        with torch.no_grad(), packing.row_samples(starts, images=batch["images"]):
            logps, _, _ = packing.logps_and_entropies(None, model, ids, attention, batch["completion_ids"].shape[1])
        for row, ep in enumerate(episodes):
            images, col = conversation_images(ep.prompt_messages + ep.messages), 0
            for k, sample in enumerate(episode_samples(ep)):
                seq = sample.prompt_ids + sample.completion_ids
                own = vision.images_of(seq, images)
                expected = alone_logps(model, vision, seq, own, len(sample.prompt_ids))
                col = col if k == 0 else col + len(sample.prompt_ids)
                cols = slice(col, col + len(sample.completion_ids))
                keep = torch.tensor(sample.model_mask, dtype=torch.bool)
                torch.testing.assert_close(logps[row, cols][keep], expected[keep], atol=1e-5, rtol=1e-5)
                yield padding_free, row, k, sample, seq, own, cols, logps[row, cols], expected
                col += len(sample.completion_ids)


def test_the_tiny_vlms_render_each_image_as_its_placeholder_tokens(tmp_path):
    from prepare_models import make_tiny_vlm
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    for family in [*FAMILIES, "qwen3_vl"]:
        path = make_tiny_vlm(str(tmp_path / family), family)
        model, tokenizer = AutoModelForImageTextToText.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        assert model.config.text_config.head_dim == 64 and model.config.model_type == family
        vision = Vision.of(tokenizer)
        assert isinstance(vision, Vision)
        big, small = Image.new("RGB", (200, 200)), Image.new("RGB", (20, 20))
        messages = [{"role": "user", "content": [{"type": "image", "image": big}, {"type": "text", "text": "and"},
                                                 {"type": "image", "image": small}]}]
        ids = vision.expand(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"],
                            messages)
        # resized to 4 x 4 patches at most (2 x 2 merged: 4 tokens), 2 x 2 at least (1 token): patches of 14 px, of 16
        # px for Qwen3-VL
        assert (vision.features(big).tokens, vision.features(small).tokens) == (4, 1)
        assert ids.count(vision.image_token_id) == 5
        x = torch.tensor([ids])
        inputs = model_inputs(x, [vision.features(big), vision.features(small)], vision.image_token_id)
        assert model(input_ids=x, **inputs).logits.shape == (1, len(ids), len(tokenizer))
        positions, _ = model.model.get_rope_index(x, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
        assert not torch.equal(positions[0, 0], torch.arange(len(ids)))  # 3-D rotary: not a plain arange


def test_generation_sees_each_conversations_images_and_every_sample_scores_alone(vlm_agent_dir):
    """The in-process sampler's log-probs are the trainer's (it generated with the same images and positions: importance
    weights 1), and the trainer's per-token log-probs of every sample equal that sample forwarded alone with its images,
    padding_free on or off; image placeholders are environment tokens."""
    from mt_grpo.rollout.episodes import pad_episodes

    model, tokenizer, env, episodes = rolled_out(vlm_agent_dir, "per_model_turn")  # a row split into samples
    vision = env.vision
    assert any(ep.calls and any(c.ok for c in ep.calls) for ep in episodes), [ep.messages for ep in episodes]
    for ep in episodes:  # placeholders: never model tokens
        assert all(m == 0 for t, m in zip(ep.completion_ids, ep.model_mask) if t in vision.placeholder_ids)
        assert ep.prompt_ids.count(vision.start_token_id) == 1
    batch = pad_episodes(episodes, tokenizer.pad_token_id, mask_truncated=False)
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    for padding_free, row, k, sample, seq, own, cols, logps, expected in each_sample_forwarded(model, vision, episodes,
                                                                                              batch):
        assert len(own) == seq.count(vision.start_token_id) >= 1
        # the sampler's distribution lacks the vision tokens (vision_token_ids), a mass below 1e-3 here
        ratio = torch.exp(logps - batch["sampler_logps"][row, cols])[mask[row, cols]]
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2e-3, rtol=0)
        # other images: other log-probs, by ten times the tolerance above at least
        other = [vision.features(noise(56, j)) for j in range(len(own))]
        assert (alone_logps(model, vision, seq, other, len(sample.prompt_ids)) - expected).abs().max() > 1e-4
    assert any(len(episode_samples(ep)) > 1 for ep in episodes)  # a later sample re-renders the history's images


def test_trls_docs_vlm_tool_script_trains_here_with_only_its_import_changed(vlm_agent_dir, tmp_path, monkeypatch):
    """tests/trl_scripts/docs_vlm_tool.py (TRL's docs: a tool returning an image and a text block, an `images` column
    filling the prompt's {"type": "image"} block), its import line swapped and nothing else, run as `python script.py`
    runs it (in this process): both tiny VLMs train 2 steps, the tool's image in the conversations. Their template is
    Qwen2-VL's own, which writes no tools: `tool_format: auto` takes xml, where TRL 1.16 refuses the script
    (tests/test_trl_scripts.py runs it under both trainers with a template that writes tools)."""
    import math
    import runpy

    from helpers import ROOT

    trl_import = "from trl import GRPOConfig, GRPOTrainer"
    ours = "from mt_grpo_trainer import MTGRPOConfig as GRPOConfig, MTGRPOEnvTrainer as GRPOTrainer"
    with open(os.path.join(ROOT, "tests", "trl_scripts", "docs_vlm_tool.py")) as f:
        text = f.read()
    assert text.count(trl_import) == 1
    script = tmp_path / "docs_vlm_tool_mt_grpo.py"
    script.write_text(text.replace(trl_import, ours))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_SCRIPT_MODEL", vlm_agent_dir)
    monkeypatch.setenv("TRL_SCRIPT_OUTPUT", str(tmp_path / "out"))
    trainer = runpy.run_path(str(script), run_name="__main__")["trainer"]
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 2 and len(steps) == 2 and all(math.isfinite(h["loss"]) for h in steps)
    assert trainer.env.protocol.name == "xml" and all(h["tools/call_frequency"] > 0 for h in steps)
    # every episode holds its prompt's picture; those whose zoom ran, the tool's too
    assert min(h["rollout/images_per_episode"] for h in steps) >= 1
    assert max(h["rollout/images_per_episode"] for h in steps) > 1


@pytest.mark.parametrize("vlm_agent_dir", ["qwen2_vl"], indirect=True)
def test_a_tools_image_is_recorded_and_masked_where_it_entered(vlm_agent_dir, tmp_path):
    """A prompt with an image block filled from the `images` column and a tool returning TRL's content blocks (an
    image and a text), packed forwards asked for (padding_free: images turn packing off): the records keep each image
    where it entered, the console counts them, and every placeholder token is an environment token."""
    out = str(tmp_path / "out")
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from datasets import Dataset
from mt_grpo_trainer import MTGRPOConfig as GRPOConfig, MTGRPOEnvTrainer as GRPOTrainer
from test_vision import digit

def zoom(x: int):
    '''Zoom into the picture.

    Args:
        x: Where to zoom, from 1 to 9.
    '''
    return [{{"type": "image", "image": digit(x)}}, {{"type": "text", "text": "zoomed"}}]  # TRL's content blocks

def correct(completions, answer, **kwargs):
    return [1.0 if a in str(c[-1]["content"]) else 0.0 for c, a in zip(completions, answer)]

question = [{{"type": "image"}}, {{"type": "text", "text": "Which number is drawn?"}}]  # TRL's VLM prompt
dataset = Dataset.from_list([{{"prompt": [{{"role": "user", "content": question}}], "images": [digit(i)],
                               "answer": str(i)}} for i in range(8)])
args = GRPOConfig(output_dir={out!r}, max_steps=2, num_generations=2, per_device_train_batch_size=4,
                  max_completion_length=160, learning_rate=1e-3, bf16=False, logging_steps=1, report_to="none",
                  save_strategy="no", save_rollouts_steps=1, padding_free=True)
trainer = GRPOTrainer(model={vlm_agent_dir!r}, args=args, train_dataset=dataset, tools=[zoom], reward_funcs=correct,
                      turn_reward_funcs=["tool_execution_reward_func"])
trainer.train()
"""
    from helpers import final_metrics, rollout_records, run

    console = run([sys.executable, "-c", code], tmp_path)
    logs = [h for h in final_metrics(out) if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert "img/ep=" in console
    records = rollout_records(out)
    assert all(len(r["prompt_images"]) == 1 and r["prompt_images"][0]["size"] == [56, 56] for r in records)
    tool_images = [t["images"] for r in records for t in r["turns"] if t["role"] == "env" and "images" in t]
    assert tool_images and all(im[0]["thumbnail"].startswith("data:image/png;base64,") for im in tool_images)
    assert any("<|vision_end|>zoomed" in t["text"] for r in records for t in r["turns"] if t.get("images"))
    for r in records:  # every placeholder token is an environment token
        pads = [m for t, m in zip(r["tokens"]["text"], r["tokens"]["model_mask"]) if t == "<|image_pad|>"]
        assert all(m == 0 for m in pads)


def test_what_is_refused_names_the_fix(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    text_env = make_env(AutoTokenizer.from_pretrained(tiny_model_dir), [zoom])
    assert isinstance(text_env.vision, TextOnly)
    prompt = text_env.prompt([{"role": "user", "content": [{"type": "image", "image": digit(1)},
                                                           {"type": "text", "text": "Which?"}]}])
    with pytest.raises(ValueError, match="text-only model .* train a vision-language model"):
        text_env.render_ids(prompt, True)
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "Which?"}], "images": [digit(1)], "answer": "1"}])
    with pytest.raises(ValueError, match="The dataset's images column has images, but .* is a text-only model"):
        MTGRPOEnvTrainer(tiny_model_dir, args=MTGRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False,
                                                           num_generations=2, per_device_train_batch_size=2),
                         train_dataset=rows, reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    with pytest.raises(ValueError, match="videos are not supported"):
        image_content([{"type": "video", "video": "clip.mp4"}], "tool 'film'")
    with pytest.raises(ValueError, match="give a PIL.Image.Image"):
        image_content([{"type": "image", "image": "x.png"}], "tool 'zoom'")


# No released template with Qwen's vision tokens drops a tool's images and renders a user's (Qwen2-VL's and
# Qwen2.5-VL's render both; Qwen2.5's and Qwen3's text templates neither): this one is a user's merge of two releases,
# Qwen2.5-7B-Instruct's tool layout, whose tool message renders `message['content']` only where it is a string, and
# Qwen2-VL's content loop for the other roles. It is the case `tool_images_as_user` fixes.
DROPPING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{{ '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def docs_script():
    """tests/trl_scripts/docs_vlm_tool.py's module (its dataset, zoom tool and reward), without running it."""
    import importlib.util

    from helpers import ROOT

    path = os.path.join(ROOT, "tests", "trl_scripts", "docs_vlm_tool.py")
    spec = importlib.util.spec_from_file_location("docs_vlm_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("vlm_agent_dir", ["qwen2_vl"], indirect=True)
def test_a_template_that_drops_images_is_refused_at_start_naming_it_and_the_fix(vlm_agent_dir, tmp_path):
    """The trainer probes its template at start, before the model loads, each role that may hold an image apart
    (run/builders.check_vision): a template that drops a user's or a tool's images stops the run naming the template,
    the roles and the one fix that works. Released templates (tests/fixtures): Qwen3-8B's drops a content list in
    every role, Qwen2.5-7B-Instruct's fails on one, and Qwen2-VL's and Qwen2.5-VL's own (byte-identical) render images
    in every role and pass. DROPPING_TEMPLATE drops a tool's only: with `tool_images_as_user` the run trains."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from helpers import chat_template, with_template
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
    from scripted_policy import ScriptedPolicy

    docs = docs_script()
    text_only = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Which number is drawn?"}]] * 2,
                                   "answer": ["1", "2"]})
    call = '<tool_call>\n{"name": "zoom", "arguments": {"x": 3}}\n</tool_call><|im_end|>'

    def trainer(template: str, dataset=docs.dataset, **config):
        model = with_template(vlm_agent_dir, str(tmp_path / f"model-{len(os.listdir(tmp_path))}"), template)
        script = {"Which number is drawn?": [call, "3<|im_end|>"]}
        backend = ScriptedPolicy(AutoTokenizer.from_pretrained(model), script)
        args = MTGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                            num_generations=2, max_completion_length=160, bf16=False, report_to="none",
                            save_strategy="no", logging_steps=1, **config)
        return MTGRPOEnvTrainer(model, args=args, train_dataset=dataset, reward_funcs=docs.correct, tools=[docs.zoom],
                                backend=backend)

    named = r"The chat template of .*/model-\d+ "
    every_role = "Give a chat template that renders image blocks in every role's content list"
    with pytest.raises(ValueError, match=named + r"rendered 0 image placeholders for the 1 images of the conversation: "
                       r"the images of user messages would not reach the model.*" + every_role):
        trainer(chat_template("qwen3"))  # the dataset's picture, in the prompt's user message
    dropped_both = (r"renders no placeholder for a tool's image, in its tool message or in a user message after it "
                    r"\(`tool_images_as_user`\): the images of tool/user .*")
    with pytest.raises(ValueError, match=named + dropped_both + every_role):
        trainer(chat_template("qwen3"), text_only)  # no picture in the prompt: a tool's, which the fix cannot help
    with pytest.raises(ValueError, match=named + r"fails on a content list of image and text blocks \(TypeError: can "
                       r"only concatenate str \(not \"list\"\) to str\): the images of user messages"):
        trainer(chat_template("qwen2.5"))
    reply = [{"role": "tool", "name": "zoom", "content": docs.zoom(2)}]
    own = trainer(chat_template("qwen2-vl"), tool_format="chat_template")  # it renders a tool message's image
    assert own.env.tokenizer.decode(own.env.env_reply_ids(reply)) == (
        "<|im_end|>\n<|im_start|>tool\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Here is the zoomed "
        "picture.<|im_end|>\n<|im_start|>assistant\n")
    assert trainer(chat_template("qwen2-vl")).env.protocol.name == "xml"  # auto: it writes no tools
    with pytest.raises(ValueError, match=named + r"rendered 0 image placeholders .* the images of tool messages would "
                       r"not reach the model.* Set `tool_images_as_user: true`"):
        trainer(DROPPING_TEMPLATE, tool_format="chat_template")
    fixed = trainer(DROPPING_TEMPLATE, tool_format="chat_template", tool_images_as_user=True)
    assert fixed.env.tokenizer.decode(fixed.env.env_reply_ids(reply)) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nHere is the zoomed picture.\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n")
    fixed.train()
    step = [h for h in fixed.state.log_history if "loss" in h][0]
    assert step["tools/call_frequency"] == 1.0 and step["rollout/images_per_episode"] == 2.0  # the prompt's, the tool's


def test_the_viewer_shows_each_image_where_it_entered(browser, tmp_path):
    """The prompt's picture above its group, a tool's picture in the environment turn that brought it (thumbnails)."""
    from rollout_records import write_run
    from test_viewer import view
    from mt_grpo.engine.vision import thumbnail

    run_dir = str(tmp_path / "run")
    records = write_run(run_dir, seed=0, train_steps=(1,), eval_steps=())["step-000001.jsonl"]
    prompt, tool = thumbnail(digit(4)), thumbnail(Image.new("RGB", (300, 150), "red"))
    assert json.loads(json.dumps(tool))["size"] == [300, 150]
    for r in records:
        r["prompt_images"] = [prompt]
    env_turn = next(t for t in records[0]["turns"] if t["role"] == "env")
    env_turn["images"] = [tool]
    with open(os.path.join(run_dir, "rollouts", "step-000001.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    view(run_dir)
    for domain in ("Runtime", "Log", "Page"):
        browser.send(f"{domain}.enable")
    browser.send("Page.navigate", url="file://" + os.path.join(run_dir, "page.html"))
    browser.wait_for("Page.loadEventFired")
    groups = len({r["group"] for r in records})
    shown = browser.js("[...document.querySelectorAll('.thumbs img')].map((i) => [i.closest('.turn') ? 'turn' : "
                       "'group', i.src, i.naturalWidth, i.naturalHeight, i.title])")
    assert [s for s in shown if s[0] == "group"] == [["group", prompt["thumbnail"], 56, 56, "image 56 x 56 px"]] * groups
    assert [s for s in shown if s[0] == "turn"] == [["turn", tool["thumbnail"], 96, 48, "image 300 x 150 px"]]
    assert browser.errors() == []


class Lens(DigitZoom):
    """The image recipe's environment (its reset shows a picture after the question, its `zoom` returns one), which
    also replies once with a picture and a line (user_turns.Reply with content blocks)."""

    def reset(self, **kwargs):
        self.replied = False
        return super().reset(**kwargs)

    def respond(self, messages):
        if self.replied:
            return None
        self.replied = True
        return [{"type": "image", "image": Image.new("RGB", (40, 40), "blue")}, {"type": "text", "text": "Look again."}]


def test_an_environments_reset_tool_and_reply_bring_images(vlm_agent_dir, tmp_path):
    """reset's observation and respond's reply each enter where they came, rendered and recorded."""
    from datasets import Dataset

    from helpers import rollout_records
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    out = str(tmp_path / "out")
    args = MTGRPOConfig(output_dir=out, max_steps=1, num_generations=2, per_device_train_batch_size=4,
                        max_completion_length=200, bf16=False, report_to="none", save_strategy="no",
                        save_rollouts_steps=1, tool_format="xml", max_user_turns=1)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": ""}], "seed": k} for k in range(4)])
    trainer = MTGRPOEnvTrainer(vlm_agent_dir, args=args, train_dataset=dataset, environment_factory=Lens,
                               reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    trainer.train()
    records = rollout_records(out)
    assert all([im["size"] for im in r["prompt_images"]] == [[12, 8]] for r in records)
    assert "then answer with the number.<|vision_start|>" in records[0]["prompt_text"]
    brought = [[im["size"] for im in t["images"]] for r in records for t in r["turns"] if t.get("images")]
    assert [[40, 40]] in brought and [[56, 40]] in brought, brought  # respond's reply (a tool's image: test_a_tool_returning_an_image_...)
    reply = next(t for r in records for t in r["turns"] if [im["size"] for im in t.get("images", [])] == [[40, 40]])
    assert reply["text"].count("<|vision_start|>") == 1 and "Look again." in reply["text"]


@pytest.mark.parametrize("vlm_agent_dir", ["qwen2_vl"], indirect=True)
def test_the_image_recipe_trains(vlm_agent_dir, tmp_path):
    """hf_recipes/tiny-qwen2-vl/digits_zoom.yaml, 2 steps of the tiny Qwen2-VL agent: the reset's picture in every
    prompt, drawn from the row's seed (mt_grpo/tasks/digits.py)."""
    from helpers import ROOT, final_metrics, rollout_records, run

    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", os.path.join(ROOT, "hf_recipes", "tiny-qwen2-vl",
         "digits_zoom.yaml"), "--model_name_or_path", vlm_agent_dir, "--output_dir", out], tmp_path)
    assert [h["rollout/images_per_episode"] >= 1 for h in final_metrics(out) if "loss" in h] == [True, True]
    records = rollout_records(out)
    assert all(r["prompt_images"][0]["size"] == [12, 8] for r in records)
    pictures = {}  # a group plays one number (its row's seed), the groups others
    for r in records:
        pictures.setdefault((r["step"], r["group"]), set()).add(r["prompt_images"][0]["thumbnail"])
    assert all(len(p) == 1 for p in pictures.values()) and len(set.union(*pictures.values())) == len(pictures) == 2
    zoomed = [im["size"] for r in records for t in r["turns"] if t["role"] == "env" for im in t.get("images", [])]
    assert [56, 40] in zoomed  # the agent calls zoom, whose picture enters the conversation


def test_a_vision_model_under_zero3_on_two_processes_is_refused_at_start(tmp_path):
    """Image batches are forwarded one sample at a time (engine/vision.py); under ZeRO-3 every forward is a collective,
    so ranks whose counts differ would hang: the image recipe under the shipped zero3.yaml on 2 CPU processes stops at
    start naming the configs that work (run/checks.check_distributed_generation)."""
    pytest.importorskip("deepspeed")
    import socket
    import subprocess

    import yaml

    from helpers import ROOT
    from prepare_models import make_tiny_vlm

    model = make_tiny_vlm(str(tmp_path / "vlm"), "qwen2_vl")
    config = yaml.safe_load(open(os.path.join(ROOT, "accelerate_configs", "zero3.yaml")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config.update(num_processes=2, mixed_precision="no", main_process_port=port)
    (tmp_path / "zero3.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "zero3.yaml"),
         "mt_grpo_trainer.py", "--config", os.path.join(ROOT, "hf_recipes", "tiny-qwen2-vl", "digits_zoom.yaml"),
         "--model_name_or_path", model, "--output_dir", str(tmp_path / "out"), "--bf16", "false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode != 0
    assert "A vision-language model under ZeRO-3 or FSDP on several processes is not supported" in proc.stderr, \
        proc.stderr[-4000:]
    assert "accelerate_configs/zero2.yaml" in proc.stderr


def test_a_given_processors_torchvision_image_processor_becomes_its_pil_twin(tmp_path):
    """TRL's `processing_class=AutoProcessor.from_pretrained(...)` gives torchvision's image processor wherever
    torchvision imports (a GPU install), whose resize makes other pixels than PIL's: the trainer keeps its settings
    (here max_pixels) on the PIL backend, the one a vLLM server is held to. (torchvision is not in this venv: a
    stand-in carries the torchvision class's name and a PIL processor's settings.)"""
    from prepare_models import make_tiny_vlm
    from transformers import AutoImageProcessor

    from mt_grpo.engine.vision import pil_image_processor

    path = make_tiny_vlm(str(tmp_path / "vl"), "qwen2_vl")
    own = AutoImageProcessor.from_pretrained(path, backend="pil", max_pixels=28 * 28 * 2)
    assert pil_image_processor(own) is own
    torchvision_one = type("Qwen2VLImageProcessor", (), {"backend": "torchvision", "to_dict": lambda self: own.to_dict()})
    twin = pil_image_processor(torchvision_one())
    assert type(twin).__name__ == "Qwen2VLImageProcessorPil" and twin.to_dict() == own.to_dict()
    big = Image.new("RGB", (200, 200))
    pixels = twin(big, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, own(big, return_tensors="pt")["pixel_values"]) and len(pixels) == 4  # max_pixels kept
    unknown = type("SomeImageProcessor", (), {"backend": "torchvision", "to_dict": dict})
    with pytest.raises(ValueError, match="has no PIL backend.*backend='pil'"):
        pil_image_processor(unknown())


def test_a_tiny_qwen3_vl_sees_its_images_and_every_sample_scores_alone(tmp_path):
    """Qwen3-VL, a third family (not in FAMILIES, for the suite's time: one test of its own): 16 px patches, the
    interleaved 3-D rotary and the deepstack (its vision block's features added at the placeholders of the first text
    layer). Each image renders as its placeholders; generation in process sees each conversation's images (its
    log-probs are those of the model alone, without the vision tokens, for prompts of unequal length, left-padded);
    an environment's reply brings an image and a second sample, and every sample's per-token log-probs through the
    trainer's forward equal it forwarded alone with its images; a training step runs."""
    from datasets import Dataset

    from accelerate import Accelerator

    from mt_grpo.engine.sampling import SamplingParams, TransformersBackend
    from mt_grpo.engine.vision import vision_token_ids
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
    from prepare_models import make_tiny_vlm

    path = make_tiny_vlm(str(tmp_path / "qwen3_vl"), "qwen3_vl")
    model, tokenizer = loaded(path)
    config = model.config
    assert config.model_type == "qwen3_vl" and config.vision_config.patch_size == 16
    assert config.vision_config.deepstack_visual_indexes == [0] and config.text_config.head_dim == 64
    vision = Vision.of(tokenizer)
    assert isinstance(vision, Vision) and vision.image_processor.patch_size == 16  # its placeholders: the test above

    out = str(tmp_path / "out")
    args = MTGRPOConfig(output_dir=out, max_steps=1, num_generations=2, per_device_train_batch_size=4,
                        max_completion_length=120, bf16=False, report_to="none", save_strategy="no", tool_format="xml",
                        max_user_turns=1, turn_samples="per_model_turn", max_tokens_per_turn=24, logging_steps=1)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": ""}], "seed": k} for k in range(4)])
    # a random model's turn is cut at max_tokens_per_turn: the environment replies to it all the same
    trainer = MTGRPOEnvTrainer(path, args=args, train_dataset=dataset,
                               environment_factory=type("CutLens", (Lens,), {"replies_to_cut_turns": True}),
                               reward_funcs=lambda completions, **kw: [float(len(str(c))) for c in completions])
    env = trainer.env
    backend = TransformersBackend(tokenizer=tokenizer, params=SamplingParams(temperature=1.0),
                                  eos_token_ids=env.eos_token_ids, stop_strings=env.protocol.stop_strings)
    backend.sync_weights(model, Accelerator(cpu=True))
    # a row with a picture of its own (TRL's `images` column) before the reset's: prompts of unequal length
    question = [{"role": "user", "content": ""}]
    rows = [{"prompt": question, "seed": 1, "images": [noise(60, 0)]}, {"prompt": question, "seed": 2}]
    torch.manual_seed(0)
    episodes = env.rollout([row["prompt"] for row in rows], backend, rows=rows)
    drop = vision_token_ids(config)
    for ep, k in zip(episodes, (2, 1)):  # placeholders: never model tokens
        assert all(m == 0 for t, m in zip(ep.completion_ids, ep.model_mask) if t in vision.placeholder_ids)
        assert ep.prompt_ids.count(vision.start_token_id) == k
    assert len(episodes[0].prompt_ids) != len(episodes[1].prompt_ids)
    assert all(len(episode_samples(ep)) == 2 for ep in episodes), [ep.messages for ep in episodes]  # respond's image
    batch = pad_episodes(episodes, tokenizer.pad_token_id, mask_truncated=False)
    for padding_free, row, k, sample, seq, own, cols, logps, expected in each_sample_forwarded(model, vision, episodes,
                                                                                              batch):
        assert len(own) == seq.count(vision.start_token_id) == len(conversation_images(
            episodes[row].prompt_messages + episodes[row].messages)) - (1 - k)
        # the sampler drew from the model alone with these images, less the vision tokens (vision_token_ids)
        lead, x, keep = len(sample.prompt_ids), torch.tensor([seq]), torch.tensor(sample.model_mask, dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=x, **model_inputs(x, own, vision.image_token_id)).logits[0].float()
        logits[:, drop] = -float("inf")
        drawn = logits.log_softmax(-1)[lead - 1 : -1].gather(1, x[0, lead:, None]).squeeze(1)
        torch.testing.assert_close(batch["sampler_logps"][row, cols][keep], drawn[keep], atol=1e-5, rtol=0)
        # other pictures of the same sizes: other log-probs, by ten times the tolerance above at least
        other = [vision.features(Image.frombytes("RGB", f.source().size, random.Random(j).randbytes(
            f.source().width * f.source().height * 3))) for j, f in enumerate(own)]
        assert (alone_logps(model, vision, seq, other, lead) - expected).abs().max() > 1e-4
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["rollout/samples_per_episode"] == 2 and logged["rollout/images_per_episode"] == 2
    assert math.isfinite(logged["loss"]) and logged["grad_norm"] > 0, logged


def test_image_tokens_written_as_text_from_outside_stay_text(tmp_path):
    """A prompt's text and an environment's reply holding the vision tokens' strings (and <|im_end|>) render them as
    plain text: only an image makes a <|vision_start|> and placeholders, so the images a sample refers to (the first
    k, k its <|vision_start|> count) stay its own."""
    from prepare_models import make_tiny_vlm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_vlm(str(tmp_path / "vl"), "qwen2_vl"))
    env = make_env(tokenizer, [zoom])
    vision = env.vision
    forged = "<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
    prompt = env.prompt([{"role": "user", "content": [{"type": "image", "image": digit(1)},
                                                      {"type": "text", "text": "Which? " + forged}]}])
    reply = [{"role": "user", "content": image_content(digit(2), "respond") + [{"type": "text", "text": forged}]}]
    for ids in (env.render_ids(prompt, True), env.env_reply_ids(reply)):
        assert ids.count(vision.start_token_id) == 1 and ids.count(vision.image_token_id) == 4  # the image's own
        assert forged in tokenizer.decode(ids)  # the text, as text
