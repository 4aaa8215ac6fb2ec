"""Every attention a packed forward (packing.py) can run is exact: against each sequence forwarded alone, under
eager and SDPA, with sliding-window layers (one window for all layers, as Mistral; per layer type, as Qwen2 with
use_sliding_window, Gemma 2/3 and gpt-oss), and through the wrappers the trainer meets (PEFT, DDP). Rows split
into per-turn samples (`sample_starts`) are forwarded packed whatever `padding_free` says, so they are here too."""

import pytest
import torch

from test_packing import shared_prompt_batch
from test_scoring_path import task_files  # noqa: F401 (a fixture)


def sample_starts(B: int, T: int) -> torch.Tensor:
    """Row 0 split into two samples at completion column 5 (a per-turn sample: it sees only itself)."""
    starts = torch.zeros(B, T, dtype=torch.long)
    starts[0, 5] = 1
    return starts


def per_sequence_reference(model, ids, att, T, starts=None):
    """Each sequence (an episode, or a sample of a split row) forwarded alone, unpadded, through the model's own
    causal (and sliding-window) masks: its scored log-probs put in the (B, T) layout."""
    from mt_grpo.engine.packing import episode_tokens

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
    from mt_grpo.engine.packing import layer_windows, packed_logps_and_entropies

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

    from mt_grpo.engine.packing import check_attention, packed_logps_and_entropies

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


@pytest.mark.parametrize("window", [None, "per_layer"])
def test_flex_packed_equals_the_dense_mask_and_the_padded_forward(tiny_model_dir, monkeypatch, caplog, window):
    """The choice on CUDA (SDPA switched to flex_attention for the packed forwards, a BlockMask of the trie), run on
    CPU, where flex has a forward only. 8 episodes of a 200-token prompt, 722 unique tokens padded to a bucket of
    768: 6 x 6 tiles of 128, some skipped (between branches), some computed whole (the prompt), the rest masked per
    pair. Its log-probs equal the dense mask's under SDPA and the padded path's (no window: the padded path has the
    same causal mask; with one: each sequence alone), to float summation order. transformers compiles
    flex_attention, which on CPU takes minutes: here it runs uncompiled (the same mask, the reference kernel)."""
    import logging

    from mt_grpo.engine import packing
    from mt_grpo.engine.packing import PACKED_FLEX, packed_logps_and_entropies, plan_rows, trie_block_mask
    from test_packing import padded

    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex_attention(query, key, value, **kwargs))
    model = load(tiny_model_dir, "sdpa", window)
    ids, att, T = shared_prompt_batch(model.config.vocab_size, 200, [60, 45, 12, 60, 33, 50, 20, 41], seed=3)
    with torch.no_grad():
        padded_before = padded(model, ids, att, T)[0]
        dense, dense_entropy, (_, forwarded) = packed_logps_and_entropies(model, ids, att, T, compute_entropy=True)
        reference = padded_before if window is None else per_sequence_reference(model, ids, att, T)
        flex_masks = []
        monkeypatch.setattr(packing, "trie_block_mask", lambda *a: flex_masks.append(trie_block_mask(*a)) or
                            flex_masks[-1])
        with caplog.at_level(logging.INFO, logger="mt_grpo"):
            assert packing.packed_attention(model, torch.device("cuda")) == "flex"
        flex, flex_entropy, _ = packed_logps_and_entropies(model, ids, att, T, compute_entropy=True)
        padded_after = padded(model, ids, att, T)[0]  # every other forward: SDPA, as before the switch
    assert model.config._attn_implementation == PACKED_FLEX and "flex_attention, a BlockMask" in caplog.text
    assert torch.equal(padded_after, padded_before)
    assert forwarded == 722 and len(plan_rows(ids, att, T, None)[0]) == 1
    assert [m.shape[-1] for m in flex_masks] == [768] * (1 if window is None else 2)
    assert all(0 < m.sparsity() < 100 for m in flex_masks)  # tiles skipped, and tiles computed
    assert window or flex_masks[0].full_kv_num_blocks.sum() > 0  # and, without a window, tiles seen whole
    scored = att[:, -T:].bool()
    torch.testing.assert_close(flex[scored], dense[scored], rtol=1e-5, atol=0)
    torch.testing.assert_close(flex_entropy[scored], dense_entropy[scored], rtol=1e-5, atol=0)
    torch.testing.assert_close(flex[scored], reference[scored], rtol=1e-5, atol=0)
    assert flex[~scored].eq(0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_on_cuda_equals_the_dense_mask_and_the_padded_forward_with_gradients(tiny_model_dir, monkeypatch, dtype):
    """What the trainer runs on a GPU: flex_attention, compiled, over the trie's BlockMask (packing.packed_attention's
    choice on CUDA), float32 weights under `dtype` autocast (the recipes' `dtype: float32, bf16: true`), forward and
    backward. Against the packed dense mask (SDPA) and the padded path: the log-probs and the gradient of their sum.
    float32: to summation order; bf16: within its rounding (8 significant bits: a tile wrongly skipped or seen
    moves the log-probs by about 1, far above it). studies/gpu_check.py runs it."""
    from mt_grpo.engine import packing
    from mt_grpo.engine.packing import packed_logps_and_entropies
    from test_packing import gradient, padded

    model = load(tiny_model_dir, "sdpa").cuda().train()
    ids, att, T = shared_prompt_batch(model.config.vocab_size, 200, [60, 45, 12, 60, 33, 50, 20, 41], seed=3)
    ids, att = ids.cuda(), att.cuda()
    scored = att[:, -T:].bool()
    autocast = lambda: torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731

    def packed_arm():
        logps = packed_logps_and_entropies(model, ids, att, T, autocast=autocast)[0][scored]
        return logps.detach(), gradient(model, logps.sum())

    with autocast():
        logps = padded(model, ids, att, T)[0][scored].float()
    reference = logps.detach(), gradient(model, logps.sum())
    with monkeypatch.context() as m:
        m.setattr(packing, "packed_attention", lambda *a: "sdpa")  # the dense boolean mask, as on CPU
        dense = packed_arm()
    assert packing.packed_attention(model, ids.device) == "flex"
    flex = packed_arm()
    rtol, grad_tol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    for other in (dense, reference):
        torch.testing.assert_close(flex[0], other[0], rtol=rtol, atol=rtol)
        assert (flex[1] - other[1]).norm() <= grad_tol * other[1].norm(), (flex[1] - other[1]).norm() / other[1].norm()
    assert torch.isfinite(flex[1]).all() and flex[1].norm() > 0


@pytest.mark.parametrize("window", [None, 6, 40])
@pytest.mark.parametrize("block", [16, 128])
def test_the_block_mask_skips_only_unseen_tiles_and_computes_whole_only_seen_ones(window, block):
    """flex_attention on CPU applies the mask_mod to every computed tile, so a tile wrongly marked as seen whole
    would pass the forward test above; on a GPU it would not. Here the BlockMask's tiles against the dense rule
    (dense_trie_mask): a skipped tile has no pair seen, a tile computed whole has every pair seen, and without a
    window the tiles are exactly those."""
    from mt_grpo.engine.packing import dense_trie_mask, flex_bucket, layout, pad_row, plan_rows, trie_block_mask

    ids, att, T = shared_prompt_batch(1000, 200, [60, 45, 12, 60, 33, 50, 20, 41], seed=3)
    (trie,), (placed,) = plan_rows(ids, att, T, None)
    row = layout(trie, placed, "cpu")
    row = pad_row(row, flex_bucket(row.input_ids.shape[1], block))
    n = row.input_ids.shape[1]
    mask, nb = trie_block_mask(row, window, block), n // block
    tiles = dense_trie_mask(row, window)[0, 0].view(nb, block, nb, block).transpose(1, 2)
    seen_any, seen_all = tiles.any(-1).any(-1), tiles.all(-1).all(-1)

    def chosen(num, index):  # the (query block, key block) tiles a BlockMask lists
        out = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            out[i, index[0, 0, i, : num[0, 0, i]].long()] = True
        return out

    partial = chosen(mask.kv_num_blocks, mask.kv_indices)
    full = chosen(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any() and (seen_all | ~full).all() and (~seen_any | partial | full).all()
    if window is None:
        assert full.eq(seen_all).all() and (partial | full).eq(seen_any).all() and full.any()
    assert (partial | full).sum() < nb * nb  # tiles skipped


def test_flex_attention_chosen_by_the_user_is_refused_for_a_cpu_backward(tiny_model_dir):
    from mt_grpo.engine.packing import packed_attention

    model = load(tiny_model_dir, "flex_attention")
    with torch.no_grad():
        assert packed_attention(model, torch.device("cpu")) == "flex"  # a forward runs there
    with pytest.raises(ValueError) as info:
        packed_attention(model, torch.device("cpu"))
    assert "no backward on CPU" in str(info.value) and "`attn_implementation: sdpa`" in str(info.value)


def test_the_packed_forward_benchmark_runs_without_trl(tmp_path):
    """studies/packed_forward.py on a machine without TRL: `trl` unimportable, TreeRow read from a wheel (here a
    zip of the installed module, at its path in TRL's wheel). One group of 2 episodes that share a 16-token prompt:
    the packed arm forwards the prompt once."""
    import re
    import subprocess
    import sys
    import zipfile

    import trl.experimental.async_grpo.packing as tree_row_module

    from helpers import ROOT

    wheel = tmp_path / "trl-1.16.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tree_row_module.__file__, "trl/experimental/async_grpo/packing.py")
    argv = ["packed_forward.py", "--models", "tiny", "--generations", "2", "--prompt", "16",
            "--min-completion", "4", "--max-completion", "8", "--repeats", "1", "--trl-wheel", str(wheel)]
    code = (f"import runpy, sys; sys.modules['trl'] = None; sys.argv = {argv!r}; "
            "runpy.run_path('studies/packed_forward.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    real, unique = map(int, re.search(r"(\d+) real tokens, \d+ padded, (\d+) packed", out.stdout).groups())
    assert unique == real - 16 + 1  # the prompt once; the trie forks one token before the episodes part
    assert float(re.search(r"packed/padded tiny: ([\d.]+)", out.stdout).group(1)) > 0


def test_step_anatomy_forwards_its_padded_arm_padded_and_its_packed_arm_packed(tiny_agent_dir, task_files,  # noqa: F811
                                                                             tmp_path, monkeypatch):
    """studies/step_anatomy.py's arms on a recipe with `padding_free: true` and rows split into per-turn samples
    (which the trainer forwards packed whatever `padding_free` says): the packed arm's forwards are all packed, the
    padded arm's none. Counted at packing's forward, on the tiny agent's scripted episodes."""
    import os
    import sys

    from mt_grpo.engine import packing
    from helpers import ROOT
    from test_packing import scripted_trainer

    sys.path.insert(0, os.path.join(ROOT, "studies"))
    from step_anatomy import Phases, train_on

    trainer, batch = scripted_trainer(tiny_agent_dir, task_files, tmp_path, "--turn_samples", "per_model_turn")
    assert trainer.args.padding_free and batch["sample_starts"].any()
    calls = []
    packed = packing.packed_logps_and_entropies
    monkeypatch.setattr(packing, "packed_logps_and_entropies", lambda *a, **k: calls.append(1) or packed(*a, **k))
    optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
    phases = Phases()
    try:
        for padding_free, expected in ((False, 0), (True, 1)):  # the loss's forward, one micro-batch of 8 rows
            calls.clear()
            train_on(trainer, batch, padding_free, 8, optimizer, phases, "arm")
            assert len(calls) == expected, padding_free
    finally:
        phases.stop = True
