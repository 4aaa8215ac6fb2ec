"""Shared-prefix packed forwards: each token of a batch forwarded once, however many episodes share it.

A GRPO group is `num_generations` episodes of one prompt, so a padded batch recomputes the prompt (system prompt,
tool schemas, few-shot turns) once per episode and pads every episode to the longest. Here the rows a forward is
given are folded into prefix tries by TRL's `TreeRow` (trl/experimental/async_grpo/packing.py, the packer of TRL's
AsyncGRPO): a token shared by several episodes, in the same place after the same tokens, is one position of the
packed row. Each trie is laid out as one row of unique tokens, with

  - `position_ids`: each token's position in its episode (its depth in the trie), so RoPE sees what it saw;
  - an attention mask in which each token sees exactly the tokens of its own episode before it (its trie path),
    and nothing of the episodes that forked from it;
  - `shift_labels`: the next token at each position that predicts a scored one. TreeRow forks a trie one token
    before episodes diverge, so each position has one next token, and the scored log-probs of every episode are
    read off the packed row (`token_index`) and put back in the padded (B, T) layout the loss takes.

The model scores the row through TRL's fused LM head (`fused_lm_head=True`, which GRPOTrainer adds to the policy and
the reference model): only the labelled positions go through the LM head, in tiles. So the log-probs, the
entropies, and everything TRL's loss makes of them (ratios, clipping, KL, the importance weights) are those of the
padded path, up to float summation order. Tests: tests/test_packing.py.

Attention: one rule, `trie_sees` (a query sees the keys on its root path, and for a sliding-window layer only the
last `window` of them, counted along the path), laid out for the attention the packed forwards run
(packed_attention, which names its choice in the log):
  - on CUDA, with the default SDPA: flex_attention over a BlockMask of the trie (trie_block_mask), built from each
    token's subtree end and depth, O(N) ids and no N x N tensor, so the tiles no token sees are skipped. The model
    switches to `sdpa_packed_flex` (flex for a BlockMask, SDPA for every other forward), and rows are padded to 8
    sizes per doubling (flex_bucket) so the compiled kernel meets few shapes;
  - on CPU, where flex_attention has no backward: SDPA with a dense boolean (1, 1, N, N) mask, N^2 bits (0.6 MB at
    N = 2,300, a study group; 32 MB at 16k);
  - eager: a dense additive float mask (eager attention adds the mask to the scores);
  - layer types with different windows (Qwen2 with use_sliding_window, Gemma 2/3, gpt-oss): one mask per type.
The flash-attention kernels take no such mask and are refused with the fix (check_attention, which reads the model
through DDP, FSDP, DeepSpeed and PEFT). TRL's AsyncGRPO runs the same layout through a varlen FlashAttention-3
kernel (`tree_attention`) that it downloads from the Hub; that needs a Hopper GPU and the Hub, so it is not used
here. Tests: tests/test_packed_attention.py.

Token budget: a trie takes episodes while its unique tokens stay within `budget` (TreeRow.fits); an episode that
does not fit starts a new trie, and each trie is forwarded on its own. With activation checkpointing the autograd
graph keeps only each layer's input per token, so the budget bounds what a forward holds at its peak (one layer's
attention and MLP over at most `budget` tokens), not the batch's row count times its longest episode.
"""

import logging
import os
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from dataclasses import dataclass

import torch

logger = logging.getLogger("mt_grpo")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TreeRow is experimental in TRL; the pinned 1.16 is tested
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from mt_grpo.base.fields import arg  # noqa: E402
from mt_grpo.base.turn_samples import scored_parts  # noqa: E402
from mt_grpo.engine.vision import model_inputs  # noqa: E402


@dataclass
class PackingArguments:
    """The recipe keys of packed forwards; the trainer's config inherits them."""

    padding_free: bool = arg(False, "Forward each micro-batch as shared-prefix tries (engine/packing.py): a group's prompt "
                             "and common turns once, no padding; exact, and faster with whole groups per micro-batch.")
    max_tokens_per_microbatch: int | None = arg(None, "Packed forwards (padding_free, split rows): unique tokens per "
                                                "forward, at most; more start another (None: one per micro-batch).")


@dataclass
class PackedRow:
    """One trie laid out as one row of N unique tokens, and where its M scored log-probs go in the (B, T) layout."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N): each token's depth in the trie, its position in its episodes
    shift_labels: torch.Tensor  # (1, N): the next token of each position that predicts a scored one, else -100
    subtree_end: torch.Tensor  # (N,): the packed position after the last token that sees each token (trie_sees)
    token_index: torch.Tensor  # (M,): the packed position whose prediction is each scored token
    rows: torch.Tensor  # (M,): the batch row of each scored token
    cols: torch.Tensor  # (M,): its completion column


def episode_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   sample_starts: torch.Tensor | None = None):
    """Each row's sequences: (row, tokens, how many lead the scored ones, their completion columns). A row is its
    real tokens (the left-padded prompt and the right-padded completion without their padding), scored at every
    attended completion position as the padded path is; a row split into samples (`sample_starts`, (B, T): 1
    where a sample's prompt starts, turn_samples.py) is one sequence per sample, each seeing only itself, and
    a later sample's first token is not scored (nothing before it in its sample predicts it; an environment token)."""
    prompt_len = input_ids.shape[1] - logits_to_keep
    for row, (ids, att) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
        prompt = [t for t, a in zip(ids[:prompt_len], att[:prompt_len]) if a]
        cols = [c for c, a in enumerate(att[prompt_len:]) if a]
        starts = [] if sample_starts is None else sample_starts[row].nonzero().flatten().tolist()
        for a, first, b in scored_parts(starts, len(cols)):
            lead = prompt if a == 0 else [ids[prompt_len + cols[a]]]
            part = cols[first:b]
            if part:
                yield row, lead + [ids[prompt_len + c] for c in part], len(lead), part


def plan_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              budget: int | None, sample_starts: torch.Tensor | None = None) -> tuple[list[TreeRow], list[list[int]]]:
    """Fold the batch's episodes (or their samples) into tries of at most `budget` unique tokens (None: one trie).
    A sequence goes to the open trie that shares most of it, else starts one. Returns the tries and, per trie,
    each sequence's (batch row, [its scored completion columns])."""
    tries, placed = [], []
    for row, tokens, prompt_len, cols in episode_tokens(input_ids, attention_mask, logits_to_keep, sample_starts):
        scored = torch.zeros(len(tokens), dtype=torch.long)
        scored[prompt_len:] = 1  # the sequence's tokens after its lead are its columns `cols`, in order
        sample = {"input_ids": torch.tensor(tokens), "completion_mask": scored, "group_id": row,
                  "old_log_probs": torch.zeros(len(tokens)), "advantage": 0.0}
        if budget is not None and len(tokens) > budget:
            raise ValueError(f"An episode of {len(tokens)} tokens does not fit `max_tokens_per_microbatch: {budget}`"
                             ". Raise it to at least max_prompt_length + max_completion_length, or leave it unset "
                             "(null) to pack each micro-batch whole.")
        fitting = [i for i, t in enumerate(tries) if budget is None or t.fits(sample, budget)]
        if fitting:
            i = max(fitting, key=lambda i: (shared_prefix(tries[i], tokens), -i))
        else:
            tries.append(TreeRow())
            placed.append([])
            i = len(tries) - 1
        tries[i].add(sample)
        placed[i].append((row, cols))
    return tries, placed


def shared_prefix(trie: TreeRow, tokens: list[int]) -> int:
    """How many leading tokens of `tokens` the trie already holds (the tokens a new episode would not add)."""
    children, shared = trie.roots, 0
    for key in zip(tokens, [*tokens[1:], None]):
        if key not in children:
            break
        children, shared = trie.children[children[key]], shared + 1
    return shared


def layout(trie: TreeRow, placed: list[tuple[int, list[int]]], device) -> PackedRow:
    """TreeRow's pre-order layout of the trie, where each token's subtree ends, and each scored token's (row, column).

    In a pre-order layout a token's descendants (the tokens that see it) follow it contiguously, up to the end of the
    last segment whose root path holds it: TreeRow lists those paths (`tree_kv_index`), so one scatter over them gives
    every token's `subtree_end`, O(total path length) work and O(N) memory."""
    p = trie.pack()
    cu_q, cu_k, kv = p["tree_cu_seqlens_q"].long(), p["tree_cu_seqlens_k"].long(), p["tree_kv_index"]
    segment_end = torch.repeat_interleave(cu_q[1:], cu_k[1:] - cu_k[:-1])  # (K,): the end of each path's segment
    end = torch.zeros(len(p["input_ids"]), dtype=torch.long).scatter_reduce_(0, kv, segment_end, "amax")
    # TreeRow.pack lists the scored tokens episode by episode, each in order: the same order as `placed`
    rows = [row for row, cols in placed for _ in cols]
    cols = [c for _, cs in placed for c in cs]
    return PackedRow(input_ids=p["input_ids"][None].to(device), position_ids=p["position_ids"][None].to(device),
                     shift_labels=p["shift_labels"][None].to(device), subtree_end=end.to(device),
                     token_index=p["token_index"].to(device), rows=torch.tensor(rows, device=device),
                     cols=torch.tensor(cols, device=device))


# ------------------------------------------------------------------------------------------------
# The trie's attention: one rule (trie_sees), laid out as each attention implementation takes it
# ------------------------------------------------------------------------------------------------
def trie_sees(q, k, end: torch.Tensor, depth: torch.Tensor, window: int | None):
    """Whether packed position `q` (a query) sees packed position `k` (a key): k is on q's root path, i.e. q lies in
    k's subtree (k <= q < end[k], the pre-order layout), and, for a sliding-window layer, fewer than `window` tokens
    back along that path (depth[q] - depth[k] < window: transformers' `kv_idx > q_idx - sliding_window`, counted in
    the episode, not in the packed row). Broadcasts over tensors of positions; flex_attention's mask_mod is this."""
    seen = (k <= q) & (q < end[k])
    return seen if window is None else seen & (depth[q] - depth[k] < window)


def layer_windows(config) -> dict[str | None, int | None]:
    """Each attention layer type's sliding window (None: full causal attention), the way transformers reads them:
    `layer_types` (Qwen2 with use_sliding_window, Gemma 2/3, gpt-oss: {"full_attention": None, "sliding_attention":
    W}), else one `sliding_window` for every layer (Mistral, Mixtral, Phi-3), keyed None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if not types:
        return {None: getattr(text, "sliding_window", None)}
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"Packed forwards (`padding_free: true`, and rows split into per-turn samples by "
                         f"`turn_samples`) support full and sliding-window attention layers; this model has layers of "
                         f"type {unknown}. Set `padding_free: false` and `turn_samples: interleaved`.")
    return {t: text.sliding_window if t == "sliding_attention" else None for t in sorted(set(types))}


def dense_trie_mask(row: PackedRow, window: int | None, additive_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(1, 1, N, N): True where a query (row) sees a key (column), for SDPA; or, with `additive_dtype`, 0 there and
    the dtype's minimum elsewhere, for eager attention, which adds the mask to the scores (a boolean mask added
    would be +1 and 0: nothing masked). N^2 entries: 0.6 MB as booleans at N = 2,300 (a study group), 32 MB at 16k."""
    n, device = row.input_ids.shape[1], row.input_ids.device
    positions = torch.arange(n, device=device)
    sees = trie_sees(positions[:, None], positions[None, :], row.subtree_end, row.position_ids[0], window)
    if additive_dtype is None:
        return sees[None, None]
    return torch.zeros(n, n, dtype=additive_dtype, device=device).masked_fill_(
        ~sees, torch.finfo(additive_dtype).min)[None, None]


FLEX_BLOCK = 128  # flex_attention's tile (its default): a BlockMask says which tiles of queries x keys to compute


def flex_bucket(n: int, block: int = FLEX_BLOCK) -> int:
    """N rounded up to one of 8 sizes per doubling (multiples of the tile), so the compiled flex kernel meets a few
    shapes, not one per step; the padding is at most 1/8 of the row (pad_row)."""
    step = max(block, 1 << max((n - 1).bit_length() - 4, 0))
    return -(-n // step) * step


def pad_row(row: PackedRow, n: int) -> PackedRow:
    """The row with padding tokens up to length `n`: each sees only itself (its subtree ends after it) and no real
    token sees it (it comes after them all), predicts nothing, and is never read (token_index)."""
    extra = n - row.input_ids.shape[1]
    device = row.input_ids.device
    tail = lambda value: torch.full((1, extra), value, dtype=torch.long, device=device)  # noqa: E731
    end = torch.arange(row.input_ids.shape[1] + 1, n + 1, device=device)
    return PackedRow(input_ids=torch.cat([row.input_ids, tail(0)], 1), position_ids=torch.cat([row.position_ids,
                     tail(0)], 1), shift_labels=torch.cat([row.shift_labels, tail(-100)], 1),
                     subtree_end=torch.cat([row.subtree_end, end]), token_index=row.token_index, rows=row.rows,
                     cols=row.cols)


def trie_block_mask(row: PackedRow, window: int | None, block: int = FLEX_BLOCK):
    """flex_attention's BlockMask of trie_sees over a row of N (a multiple of `block`) tokens, built from the O(N)
    per-token ids with no N x N tensor: per tile of `block` queries x `block` keys, how many pairs are seen is the
    overlap of each key's subtree [k, end[k]) with the query block, summed over the keys. A tile none of whose pairs
    is seen is skipped, one where all are (and the window cuts none) is computed without the mask_mod, the others
    apply trie_sees per pair. Work O(N^2 / block), memory at most 4M counts at a time."""
    from torch.nn.attention.flex_attention import BlockMask

    n, device = row.input_ids.shape[1], row.input_ids.device
    nb, end, depth = n // block, row.subtree_end, row.position_ids[0]
    keys = torch.arange(n, device=device)
    seen, step = [], max(1, (1 << 22) // n)
    for first in range(0, nb, step):  # query blocks, `step` at a time
        q0 = torch.arange(first, min(nb, first + step), device=device)[:, None] * block
        overlap = (torch.minimum(end[None], q0 + block) - torch.maximum(keys[None], q0)).clamp(min=0)
        seen.append(overlap.view(len(q0), nb, block).sum(-1))
    seen = torch.cat(seen)  # (nb, nb): the pairs of each tile that are seen, the window aside
    full = seen == block * block
    partial = seen > 0
    if window is not None:
        tiles = depth.view(nb, block)
        lowest, deepest = tiles.min(-1).values, tiles.max(-1).values
        full &= deepest[:, None] - lowest[None, :] < window  # every pair of the tile within the window
        partial &= ~(lowest[:, None] - deepest[None, :] >= window)  # some pair within it
    partial &= ~full

    def ordered(tiles):  # per query block: how many key blocks, and which (the chosen ones first)
        order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return tiles.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block, seq_lengths=(n, n),
                                    mask_mod=lambda b, h, q, k: trie_sees(q, k, end, depth, window))


def trie_attention_mask(row: PackedRow, attention: str, windows: dict[str | None, int | None], dtype: torch.dtype):
    """The row's mask as the `attention` packed forwards run (packed_attention) takes it: one mask, or, where layer
    types have different windows, {layer type: mask} (the models with per-layer mask types read a dict as theirs)."""
    if attention == "flex":
        build = lambda window: trie_block_mask(row, window)  # noqa: E731
    else:
        build = lambda window: dense_trie_mask(row, window, dtype if attention == "eager" else None)  # noqa: E731
    if len(set(windows.values())) == 1:  # one window for every layer: one mask, which every model takes
        return build(next(iter(windows.values())))
    return {t: build(w) for t, w in windows.items()}


def packed_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                  budget: int | None = None, sample_starts: torch.Tensor | None = None, plan=None):
    """Each trie of the batch as `model` takes it: (its PackedRow, its attention mask, its unique tokens), the row
    padded to a bucket for flex (flex_bucket). `plan`: plan_rows' result, where the caller has it already."""
    attention = packed_attention(model, input_ids.device)
    inner = unwrapped(model)
    windows = layer_windows(inner.config)
    for trie, episodes in zip(*(plan or plan_rows(input_ids, attention_mask, logits_to_keep, budget, sample_starts))):
        row = layout(trie, episodes, input_ids.device)
        if attention == "flex":
            row = pad_row(row, flex_bucket(len(trie.tokens)))
        yield row, trie_attention_mask(row, attention, windows, inner.dtype), len(trie.tokens)


def rank_max(n: int, device: torch.device) -> int:
    """The largest `n` over the ranks (one small all-reduce); `n` on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return n
    count = torch.tensor([n], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def matched_forwards(items, device: torch.device, count: int | None = None):
    """This rank's `items` (one forward each; a list, or an iterator of `count` items built one at a time), then None
    until every rank has had as many: the one rule that keeps
    the collectives of a step matched across ranks. Under ZeRO-3 and FSDP every forward gathers each layer's
    parameters (and its backward reduces their gradients), a collective that all ranks must make the same number of
    times; but how many forwards a rank makes depends on its own episodes (one per trie under
    `max_tokens_per_microbatch`, one per sample in policy_sampler_logprobs). So the count is reduced to its maximum
    over ranks (rank_max), and at each None the caller runs an empty forward: a small input through the same model,
    whose output adds nothing to any result or gradient. On one process, nothing is added. Which path a
    batch takes (packed or padded) is chosen the same way on every rank (PackedForward.row_samples)."""
    most = rank_max(len(items) if count is None else count, device)
    made = 0
    for item in items:
        made += 1
        yield item
    yield from [None] * (most - made)


def packed_logps_and_entropies(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                               budget: int | None = None, compute_entropy: bool = False, autocast=None,
                               sample_starts: torch.Tensor | None = None):
    """GRPOTrainer._get_per_token_logps_and_entropies on packed tries: (B, T) log-probs of the completion tokens
    (0 at padding), and their entropies when `compute_entropy`. Also returns the packing's token counts
    (raw real tokens, unique tokens forwarded). `model` carries TRL's fused LM head (add_fused_lm_head). Every rank
    makes as many forwards (matched_forwards): an empty one is a trie of two tokens, one scored, times 0."""
    B, T = input_ids.shape[0], logits_to_keep
    logps = torch.zeros(B, T, device=input_ids.device)
    entropies = torch.zeros(B, T, device=input_ids.device) if compute_entropy else None
    forwarded = 0
    plan = plan_rows(input_ids, attention_mask, logits_to_keep, budget, sample_starts)
    tries = packed_inputs(model, input_ids, attention_mask, logits_to_keep, plan=plan)  # one trie's mask at a time
    # at least one forward: a batch with no completion token (agents that made no call) still has a loss in the graph
    for packed in matched_forwards(tries, input_ids.device, count=max(1, len(plan[0]))):
        empty = packed is None
        if empty:  # the batch's first token twice, the second scored: through every layer and the LM head
            one = input_ids[:1, :1].expand(1, 2)
            packed = next(packed_inputs(model, one, torch.ones_like(one), 1))
        row, mask, unique = packed
        forwarded += 0 if empty else unique
        with autocast() if autocast is not None else nullcontext():
            out = model(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=mask,
                        shift_labels=row.shift_labels, fused_lm_head=True)
        if empty:  # in the graph, so that its backward (another collective) runs too; 0 in every value
            logps = logps + 0.0 * out.log_probs.float().sum()
            continue
        # index_put, not in-place assignment on a leaf: the gradient flows back through the packed positions
        logps = logps.index_put((row.rows, row.cols), out.log_probs[0, row.token_index].float())
        if compute_entropy:
            entropies = entropies.index_put((row.rows, row.cols), out.entropy[0, row.token_index].float())
    raw = int(attention_mask.sum())
    return logps, entropies, (raw, forwarded)


_UNPACKED_LOGGED: list = []


def sample_logps_and_entropies(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                               sample_starts: torch.Tensor | None, images: list, compute_entropy: bool = False,
                               autocast=None):
    """(B, T) log-probs (and entropies) of the completion tokens, each sample forwarded alone: its tokens unpadded,
    the images its tokens refer to (the first k of its row's `images`), the model's own positions (no position_ids:
    the Qwen-VL models compute their 3-D rotary ones). Through TRL's fused LM head, as the padded path. `model` may
    be wrapped."""
    if not _UNPACKED_LOGGED:
        _UNPACKED_LOGGED.append(True)
        logger.info("A batch holds images: each sample is forwarded alone with its images and the positions the model "
                    "computes (the Qwen-VL models' 3-D rotary ones), without padding_free's shared-prefix packing, "
                    "whose trie gives each token one position and one row.")
    config = unwrapped(model).config
    B, T = input_ids.shape[0], logits_to_keep
    logps = torch.zeros(B, T, device=input_ids.device)
    entropies = torch.zeros(B, T, device=input_ids.device) if compute_entropy else None
    for row, tokens, lead, cols in episode_tokens(input_ids, attention_mask, logits_to_keep, sample_starts):
        ids = torch.tensor([tokens], device=input_ids.device)
        k = sum(t == config.vision_start_token_id for t in tokens)  # its images: the first k of its row's
        labels = ids.clone()
        labels[:, :lead] = -100
        with autocast() if autocast is not None else nullcontext():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True,
                        **model_inputs(ids, images[row][:k], config.image_token_id))
        # log_probs[t] is the logprob of token t + 1 (the fused head scores each position's next token)
        where = (torch.full((len(cols),), row, device=ids.device), torch.tensor(cols, device=ids.device))
        logps = logps.index_put(where, out.log_probs[0, lead - 1:].float())
        if compute_entropy:
            entropies = entropies.index_put(where, out.entropy[0, lead - 1:].float())
    return logps, entropies


PACKED_FLEX = "sdpa_packed_flex"  # SDPA, but flex_attention for a BlockMask: registered in transformers by use_flex
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", PACKED_FLEX)  # the implementations that take a trie's mask


def unwrapped(model):
    """The transformers model inside DDP, FSDP, a DeepSpeed engine or torch.compile (accelerate's unwrapping), and
    inside PEFT: the one whose config says which attention runs."""
    try:
        from accelerate.utils import extract_model_from_parallel
    except ImportError:  # studies/packed_forward.py runs on torch and transformers alone, and wraps nothing
        extract_model_from_parallel = lambda model: model  # noqa: E731
    model = extract_model_from_parallel(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_attention(model) -> str:
    """The attention implementation packed forwards run on `model` (through its wrappers), refused with the fix
    where it takes no mask of the trie (the flash-attention kernels), or where its layer types are not all full or
    sliding-window attention (layer_windows)."""
    config = getattr(unwrapped(model), "config", None)
    if config is None:
        raise ValueError(f"Packed forwards need a transformers model (one with a `config`); got "
                         f"{type(unwrapped(model)).__name__}.")
    found = getattr(config, "_attn_implementation", None)
    if found not in PACKED_ATTENTION:
        raise ValueError(f"Packed forwards (`padding_free: true`, and rows split into per-turn samples by "
                         f"`turn_samples`) need an attention implementation that takes a mask of the trie "
                         f"({' or '.join(PACKED_ATTENTION[:3])}); the model runs {found!r}. Set "
                         "`attn_implementation: sdpa`, or `padding_free: false` and `turn_samples: interleaved`.")
    layer_windows(config)
    return found


def sdpa_or_flex(module, query, key, value, attention_mask, **kwargs):
    """PACKED_FLEX: flex_attention where the mask is a BlockMask (the packed forwards), SDPA for every other forward
    (generation, padded forwards, whose masks transformers builds as SDPA's)."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    forward = flex_attention_forward if isinstance(attention_mask, BlockMask) else sdpa_attention_forward
    return forward(module, query, key, value, attention_mask, **kwargs)


def use_flex(model) -> None:
    """Switch `model` (unwrapped) from SDPA to PACKED_FLEX: the packed forwards then run flex_attention, which
    computes only the tiles of the trie that some token sees, and everything else runs SDPA as before."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_FLEX, sdpa_or_flex)
    AttentionMaskInterface.register(PACKED_FLEX, sdpa_mask)
    model.set_attn_implementation(PACKED_FLEX)


def packed_attention(model, device: torch.device) -> str:
    """How the packed forwards of `model` attend, chosen once per model and named in the log: "flex" (a BlockMask
    of the trie; by default on CUDA, where flex_attention has a fused forward and backward), "sdpa" (the dense
    boolean mask: on CPU, where flex_attention has no backward) or "eager" (the dense additive mask)."""
    found = check_attention(model)
    inner = unwrapped(model)
    if found == "sdpa" and device.type == "cuda":
        use_flex(inner)
        found = PACKED_FLEX
    if found == "flex_attention" and device.type == "cpu" and torch.is_grad_enabled():
        raise ValueError("`attn_implementation: flex_attention` has no backward on CPU; set `attn_implementation: "
                         "sdpa` (packed forwards then run flex_attention on CUDA, and a dense mask on CPU).")
    chosen = "flex" if found in ("flex_attention", PACKED_FLEX) else found
    if getattr(inner, "_packed_attention", None) != chosen:
        inner._packed_attention = chosen
        logger.info("Packed forwards of %s attend with %s.", type(inner).__name__, {
            "flex": f"flex_attention, a BlockMask of the trie (rows padded to {FLEX_BLOCK}-token tiles, 8 sizes per "
                    "doubling); the other forwards with SDPA",
            "sdpa": "SDPA and a dense boolean mask of the trie" + (" (flex_attention has no backward on CPU)"
                                                                    if device.type == "cpu" else ""),
            "eager": "eager attention and a dense additive mask of the trie"}[chosen])
    return chosen


class PackedForward:
    """The trainer's forwards that score completions (the loss's, the old and the reference log-probs): with
    `padding_free` they run on packed tries; MoE aux losses and TRL's own multimodal inputs keep TRL's padded path; rows
    with images (engine/vision.py: `images`, given to row_samples) are forwarded one sample at a time with their
    images (sample_logps_and_entropies). Rows
    split into samples (turn_samples.py) are forwarded packed whatever `padding_free` says: the padded path would
    let a sample see the samples before it. MTGRPOEnvTrainer holds one (`self.packing`) and routes its
    `_get_per_token_logps_and_entropies` and `get_high_entropy_mask` through it. `args`: the trainer's config
    (`padding_free`, `max_tokens_per_microbatch`, read at each forward); `metrics`: the trainer's `_metrics` (train /
    eval), which get `packing/ratio`."""

    def __init__(self, args, autocast, metrics: dict):
        self.args, self.autocast, self.metrics = args, autocast, metrics
        self._sample_starts: torch.Tensor | None = None
        self._row_signal: torch.Tensor | None = None
        self._images: list | None = None

    @contextmanager
    def row_samples(self, sample_starts: torch.Tensor | None, advantages: torch.Tensor | None = None,
                    images: list | None = None):
        """The forwards inside score rows whose samples start where `sample_starts` (B, T) is 1. TRL's loss calls
        the forward with ids and masks only, so the layout reaches it here; so do the rows' `advantages` (B, ...),
        for the entropy quantile (signal_mask), and their `images` (engine/vision.RowImages: each row's). Packed on
        every rank if any rank's rows are split (rank_max): a rank on the padded path would make other forwards, and
        other collectives."""
        split = sample_starts is not None and rank_max(int(sample_starts.any()), sample_starts.device)
        self._sample_starts = sample_starts if split else None
        self._row_signal = None if advantages is None else advantages.reshape(len(advantages), -1).ne(0).any(1)
        self._images = images if images is not None and any(images) else None
        try:
            yield
        finally:
            self._sample_starts = self._row_signal = self._images = None

    def signal_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """TRL's `top_entropy_quantile` mask taken over the tokens of rows with signal (an advantage other than 0)
        only: a zero-signal group's tokens carry no policy gradient, yet counted they would move the threshold.
        Those rows leave the mask (their policy term is 0; the entropy bonus, which follows the mask, acts on the
        rows with signal)."""
        return mask if self._row_signal is None else mask * self._row_signal[:, None]

    def logps_and_entropies(self, padded_forward, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                            compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's `_get_per_token_logps_and_entropies` (`padded_forward`), packed where it should be."""
        starts = self._sample_starts
        if starts is not None and tuple(starts.shape) != (input_ids.shape[0], logits_to_keep):
            raise RuntimeError(f"sample_starts of shape {tuple(starts.shape)} for a forward of "
                               f"{(input_ids.shape[0], logits_to_keep)} completion tokens")
        if self._images is not None:  # each sample alone, with its images and the model's 3-D positions
            if len(self._images) != input_ids.shape[0]:
                raise RuntimeError(f"images of {len(self._images)} rows for a forward of {input_ids.shape[0]}")
            logps, entropies = sample_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, starts,
                                                          self._images, compute_entropy, self.autocast)
            return logps, entropies, None
        padded = compute_aux_loss or any(v is not None for v in extra.values())
        if starts is not None and padded:
            raise ValueError("Rows split into per-turn samples (`turn_samples`) are forwarded packed, which takes no "
                             "multimodal inputs or MoE auxiliary loss; set `turn_samples: interleaved`.")
        if (not self.args.padding_free and starts is None) or padded:
            return padded_forward(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                  compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        logps, entropies, (raw, forwarded) = packed_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, self.args.max_tokens_per_microbatch, compute_entropy,
            self.autocast, starts)
        if torch.is_grad_enabled():  # once per trained micro-batch, not for the old / reference log-probs
            self.metrics["train" if model.training else "eval"]["packing/ratio"].append(raw / max(forwarded, 1))
        return logps, entropies, None


# ------------------------------------------------------------------------------------------------
# TRL's fused LM head, which every scoring forward goes through (the one patch of TRL's internals)
# ------------------------------------------------------------------------------------------------
# Vocabulary columns per tile of TRL's fused LM head on CPU. TRL's 32,768 suits its GPU kernel; on CPU its torch
# fallback holds about 8 tile-sized float32 temporaries at once: 1.5 GiB above the process for the ~1,200
# completion tokens of a demo step, the peak of its backward, against 0.16 GiB at 2,048 columns, in the same time
# and with the same values (studies/lm_head_tiles.py).
CPU_LM_HEAD_TILE = 2048


def score_labelled_tokens_only() -> None:
    """TRL's fused LM head (trl.trainer.utils) scores only the labelled positions (the completion) where
    Triton runs, and every position elsewhere, so that Neuron need not recompile for each new count. On CPU
    a new count costs nothing, and every position is 6x the labelled ones in the study (408-token prompts,
    left padding): there too, score the labelled ones only (TRL's own compact path). Same values. On CPU its
    tiles are also narrowed to `CPU_LM_HEAD_TILE` vocabulary columns (the memory of a step; same values)."""
    import trl.trainer.utils as trl_utils

    compact = trl_utils._use_triton
    if not getattr(compact, "cpu_too", False):
        trl_utils._use_triton = lambda device: compact(device) or device.type == "cpu"
        trl_utils._use_triton.cpu_too = True
    kernel = getattr(trl_utils, "_ChunkedLogProbFunction", None)  # None: check_trl names it as missing
    if kernel is not None and not getattr(kernel, "cpu_tiles", False):
        def apply(hidden, weight, bias, targets, temperature, chunk_size, *rest):
            if hidden.device.type == "cpu":
                chunk_size = min(chunk_size, CPU_LM_HEAD_TILE)
            return kernel.apply(hidden, weight, bias, targets, temperature, chunk_size, *rest)

        trl_utils._ChunkedLogProbFunction = SimpleNamespace(apply=apply, cpu_tiles=True)


# ------------------------------------------------------------------------------------------------
# Shared-prefix generation: the in-process backend's prompts, their common prefix prefilled once
# ------------------------------------------------------------------------------------------------
def common_prefix_length(rows: list[list[int]]) -> int:
    """How many leading tokens all `rows` share, leaving each row at least one token of its own: generate
    forwards a row's last prompt token itself, for the logits of its first new token."""
    shortest = min(len(row) for row in rows) - 1
    return next((i for i in range(shortest) if any(row[i] != rows[0][i] for row in rows)), shortest)


def prefilled_inputs(model, rows: list[list[int]], pad_id: int, device, share: bool = True, matched: bool = False):
    """(input_ids, attention_mask, past_key_values) for `model.generate` over `rows` (token lists).

    A GRPO group is one prompt sampled `num_generations` times, and every prompt of a task starts with the same
    system prompt, tool schemas and worked examples, so plain left-padded generate prefills that prefix once per
    row. Here the rows' common prefix (common_prefix_length) is forwarded once, as a batch of one, and its KV cache
    repeated for every row; generate then prefills only each row's own tokens. The layout is [prefix][left padding]
    [row's own tokens]: generate reads positions off the attention mask (its cumulative sum), so a row's tokens get
    the positions they have unpadded, and the padding in the middle is masked like padding on the left. Same
    tokens, up to float summation order (tests/test_packing.py checks greedy generations are identical).
    `share=False` (a fixed cache_implementation, which generate builds itself), a single row or no common prefix:
    the plain left-padded layout and no cache. `matched` (generation is a collective: TransformersBackend.synced): when
    any rank prefills a prefix, a rank without one runs a forward of one token, its output dropped, so that under
    FSDP every rank makes the prefill's parameter gathers (rank_max)."""
    from transformers import DynamicCache
    from trl.trainer.utils import pad

    prefix = common_prefix_length(rows) if share and len(rows) > 1 else 0
    own = [torch.tensor(row[prefix:], device=device) for row in rows]
    input_ids = pad(own, padding_value=pad_id, padding_side="left")
    attention_mask = pad([torch.ones_like(row) for row in own], padding_value=0, padding_side="left")
    if matched and rank_max(int(prefix > 0), device) and not prefix:
        model(input_ids=input_ids[:1, -1:])  # (1, 1): joins the other ranks' prefill forward
    if not prefix:
        return input_ids, attention_mask, None
    shared = torch.tensor([rows[0][:prefix]], device=device)
    cache = DynamicCache(config=model.config)
    model(input_ids=shared, past_key_values=cache, use_cache=True)  # (1, P): the prefix's KV, once
    cache.batch_repeat_interleave(len(rows))
    return (torch.cat([shared.expand(len(rows), -1), input_ids], dim=1),
            torch.cat([torch.ones(len(rows), prefix, dtype=torch.long, device=device), attention_mask], dim=1), cache)
