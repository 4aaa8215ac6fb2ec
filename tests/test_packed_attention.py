"""Every attention a packed forward (packing.py) can run is exact: against each sequence forwarded alone, under
eager and SDPA, with sliding-window layers (one window for all layers, as Mistral; per layer type, as Qwen2 with
use_sliding_window, Gemma 2/3 and gpt-oss), and through the wrappers the trainer meets (PEFT, DDP). Rows split
into per-turn samples (`sample_starts`) are forwarded packed whatever `padding_free` says, so they are here too."""

import pytest
import torch

from test_packing import shared_prompt_batch


def sample_starts(B: int, T: int) -> torch.Tensor:
    """Row 0 split into two samples at completion column 5 (a per-turn sample: it sees only itself)."""
    starts = torch.zeros(B, T, dtype=torch.long)
    starts[0, 5] = 1
    return starts


def per_sequence_reference(model, ids, att, T, starts=None):
    """Each sequence (an episode, or a sample of a split row) forwarded alone, unpadded, through the model's own
    causal (and sliding-window) masks: its scored log-probs put in the (B, T) layout."""
    from packing import episode_tokens

    logps = torch.zeros(ids.shape[0], T)
    for row, tokens, lead, cols in episode_tokens(ids, att, T, starts):
        labels = torch.tensor(tokens[1:] + [-100])
        labels[: lead - 1] = -100
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), shift_labels=labels[None], fused_lm_head=True)
        logps[row, cols] = out.log_probs[0, lead - 1 : len(tokens) - 1]
    return logps


def load(tiny_model_dir, attention: str, window: str | None = None):
    """The tiny Qwen2 under `attention`; `window`: None, "per_layer" (layer 0 full, layer 1 a window of 6: Qwen2's
    use_sliding_window) or "all" (a tiny Mistral, one window of 6 for every layer, no layer_types)."""
    from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig
    from trl.trainer.utils import add_fused_lm_head

    if window == "all":
        torch.manual_seed(0)
        config = MistralConfig(vocab_size=AutoConfig.from_pretrained(tiny_model_dir).vocab_size, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=32, sliding_window=6)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(tiny_model_dir)
        if window == "per_layer":
            config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 6, 1
            config.layer_types = ["full_attention", "sliding_attention"]
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config, attn_implementation=attention,
                                                     dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model.eval()


@pytest.mark.parametrize("window", [None, "per_layer", "all"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_equals_each_sequence_forwarded_alone(tiny_model_dir, attention, window):
    """Sequences of 14 to 24 tokens, so a window of 6 cuts most of what a token would see; one row split into two
    samples. The packed forward's log-probs equal the reference's to float summation order (the values are about
    -7; 1e-5 relative is far below the 1e-1 that a leak or a lost window makes)."""
    from packing import layer_windows, packed_logps_and_entropies

    model = load(tiny_model_dir, attention, window)
    windows = set(layer_windows(model.config).values())
    assert windows == ({None} if window is None else {6} if window == "all" else {None, 6})
    ids, att, T = shared_prompt_batch(model.config.vocab_size, 14, [10, 7, 4, 10])
    starts = sample_starts(ids.shape[0], T)
    reference = per_sequence_reference(model, ids, att, T, starts)
    with torch.no_grad():
        logps, _, _ = packed_logps_and_entropies(model, ids, att, T, sample_starts=starts)
    scored = reference != 0
    assert scored.sum() == att[:, -T:].sum() - 1  # every attended completion token but the second sample's first
    torch.testing.assert_close(logps[scored], reference[scored], rtol=1e-5, atol=0)
    assert logps[~scored].eq(0).all()


def wrapped(model, wrapper: str, tmp_path):
    """`model` inside PEFT (a LoRA adapter, zero at start: the same function) or DDP (one gloo process)."""
    if wrapper == "peft":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    return torch.nn.parallel.DistributedDataParallel(model)


@pytest.mark.parametrize("wrapper", ["peft", "ddp"])
def test_the_attention_is_read_and_refused_through_the_wrappers(tiny_model_dir, tmp_path, wrapper):
    """Eager with a per-layer window, wrapped: the check reads the model's config (a DDP module has none of its own,
    so it was skipped), the packed forward is the reference's, and a flash kernel or a layer type the trie mask
    cannot express is refused with the fix, through the wrapper."""
    import torch.distributed as dist

    from packing import check_attention, packed_logps_and_entropies

    model = load(tiny_model_dir, "eager", "per_layer")
    ids, att, T = shared_prompt_batch(model.config.vocab_size, 14, [10, 7, 4, 10])
    reference = per_sequence_reference(model, ids, att, T)
    outer = wrapped(model, wrapper, tmp_path)
    try:
        assert check_attention(outer) == "eager"
        with torch.no_grad():
            logps, _, _ = packed_logps_and_entropies(outer, ids, att, T)
        torch.testing.assert_close(logps, reference, rtol=1e-5, atol=0)
        model.config._attn_implementation_internal = "flash_attention_2"
        with pytest.raises(ValueError) as info:
            check_attention(outer)
        assert "'flash_attention_2'" in str(info.value) and "`attn_implementation: sdpa`" in str(info.value)
        model.config._attn_implementation_internal = "sdpa"
        model.config.layer_types = ["full_attention", "chunked_attention"]
        with pytest.raises(ValueError) as info:
            check_attention(outer)
        assert "['chunked_attention']" in str(info.value) and "`padding_free: false`" in str(info.value)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
