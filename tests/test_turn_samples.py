"""Turns as training samples (turn_samples.py, issue 42).

- Exactness: every sample's prompt decodes to the chat template's render of its history with the generation
  prompt, on Qwen3's real template (thinking and non-thinking), Qwen2.5's, and ours (the xml protocol on the tiny
  ChatML template), in per_turn and auto; and where each setting splits.
- The forward: a row split into samples scores each sample in its own context (packed, with or without
  `padding_free`, and the sampler-processed log-probs of an IS-corrected run).
- The loss: on a template whose render extends the rollout, per_turn samples see exactly the interleaved contexts,
  so the loss and its gradient must equal the interleaved ones for every loss type: an episode split into 3
  samples counts once, with its tokens' own weights.
- A run trains with per-turn samples, padded or packed.
"""

import pytest
import torch

import test_chat_template as chat
from helpers import VELTRIA, TEMPLATE_FILES, fake_search, make_env, qwen_tokenizer, smoke_run, xml_answer, xml_call
from scripted_policy import ScriptedPolicy
from test_packing import gradient, scripted_trainer
from test_scoring_path import task_files  # noqa: F401 (a fixture)
from mt_grpo.base.turn_samples import episode_samples, next_sample_prompt, sample_bounds, scored_parts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models, scored and trained in this process

MODES = ("per_model_turn", "auto")


def check_samples(tokenizer, env, episodes) -> None:
    """Every sample's prompt is the render of its history with the generation prompt; the samples' model tokens
    are the episode's, in order, each once."""
    for ep in episodes:
        samples = episode_samples(ep)
        assert len(samples) == 1 + len(ep.sample_starts)
        for s in samples:
            want = env.render(ep.prompt_messages + ep.messages[: s.history], add_generation_prompt=True,
                              toolset=ep.toolset)
            assert tokenizer.decode(s.prompt_ids) == want
            assert s.prompt_ids == env.render_ids(ep.prompt_messages + ep.messages[: s.history], True, ep.toolset)
        model = [t for s in samples for t, m in zip(s.completion_ids, s.model_mask) if m]
        assert model == [t for t, m in zip(ep.completion_ids, ep.model_mask) if m] and len(model) > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(chat.SETUPS))
def test_each_sample_is_the_templates_render_of_its_history(chat_tokenizers, name, mode):
    """Qwen3 in non-thinking mode re-renders earlier turns without the empty think block its generation prompt
    writes: auto starts a new sample after every tool turn, as per_turn does. Qwen2.5's render, and Qwen3's in
    thinking mode with thoughts laid out as the template writes them (the template keeps the thoughts of the turns
    after the last user message), extend the rollout: auto keeps one sample."""
    setup = chat.SETUPS[name]
    tokenizer, env, _, episodes, _ = chat.roll_out(chat_tokenizers, setup, turn_samples=mode)
    check_samples(tokenizer, env, episodes)
    splits = mode == "per_model_turn" or setup.thinking_off
    assert [len(ep.sample_starts) for ep in episodes] == [ep.tool_turns if splits else 0 for ep in episodes]
    assert sum(ep.tool_turns for ep in episodes) == 5  # Q-again's third call is not run
    assert not any(ep.tokenization_mismatch for ep in episodes)  # the last sample is what a re-render gives


@pytest.fixture(scope="module")
def chat_tokenizers(tiny_model_dir):
    return {name: qwen_tokenizer(tiny_model_dir, name) for name in TEMPLATE_FILES}


def test_a_thought_outside_the_templates_layout_starts_a_new_sample_in_auto(chat_tokenizers):
    """Thinking on: a first turn whose thought is not laid out as the template writes it (no newlines) re-renders
    otherwise, so auto splits there, and the next turn is sampled from the template's layout."""
    setup, tokenizer = chat.SETUPS["qwen3-thinking"], chat_tokenizers["qwen3"]
    env = chat.setup_env(tokenizer, setup, [chat.make_search([])], turn_samples="auto")
    script = {"Q-one": ["<think>I look it up.</think>Let me search.\n" + chat.ONE + "<|im_end|>",
                        chat.turn(setup, "Found it.", "<answer>Morvane</answer>")]}
    (ep,) = env.rollout([env.prompt("Q-one")], ScriptedPolicy(tokenizer, script))
    assert len(ep.sample_starts) == 1 and ep.stop_reason == "answer"
    check_samples(tokenizer, env, [ep])
    second = tokenizer.decode(episode_samples(ep)[1].prompt_ids)
    assert "<think>\nI look it up.\n</think>\n\nLet me search." in second  # the template's layout


def test_ours_xml_protocol_on_chatml(tiny_model_dir):
    """Our xml protocol on the tiny model's ChatML template: its render extends the rollout (auto: one sample),
    and per_turn makes a sample per model turn, each the render of its history."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    search = fake_search(lambda q: VELTRIA)
    script = {"Q-xml": [xml_call("Veltria"), xml_call("capital of Veltria"), xml_answer("Morvane")]}
    for mode, starts in (("auto", 0), ("per_model_turn", 2), ("interleaved", 0)):
        env = make_env(tokenizer, [search], turn_samples=mode)
        (ep,) = env.rollout([env.prompt("Q-xml")], ScriptedPolicy(tokenizer, script))
        assert ep.stop_reason == "answer" and ep.tool_turns == 2 and len(ep.sample_starts) == starts, mode
        check_samples(tokenizer, env, [ep])


def test_the_sample_rule():
    render = lambda: [1, 2, 3, 4]  # noqa: E731
    assert next_sample_prompt("interleaved", [1, 2], [3, 9], render) is None
    assert next_sample_prompt("auto", [1, 2], [3, 4], render) is None  # the render extends the sample
    assert next_sample_prompt("auto", [1, 2], [3, 9], render) == [1, 2, 3, 4]
    assert next_sample_prompt("per_model_turn", [1, 2], [3, 4], render) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"choose one of \['interleaved', 'per_model_turn', 'auto'\]"):
        next_sample_prompt("per_sample", [1, 2], [3, 4], render)  # not taken for per_model_turn
    with pytest.raises(ValueError, match="`turn_samples: per_turn` is now `turn_samples: per_model_turn`"):
        next_sample_prompt("per_turn", [1, 2], [3, 4], render)
    assert sample_bounds([], 5) == [(0, 5)] and sample_bounds([2, 4], 6) == [(0, 2), (2, 4), (4, 6)]
    assert scored_parts([2, 4], 6) == [(0, 0, 2), (2, 3, 4), (4, 5, 6)]  # a later sample's lead token is not scored


# --- the forward --------------------------------------------------------------------------------------------
def split_row(vocab: int, seed: int = 0):
    """Two rows: row 0 is prompt P, turn c1, then sample 2 (its prompt S2, a different history, then turn c2), then
    sample 3 (S3, c3); row 1 is P and a plain completion. Returns ids, attention, T, sample_starts and the
    sequences each sample is, with its completion columns."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(5, vocab, (n,), generator=g).tolist()  # noqa: E731
    P, c1, S2, c2, S3, c3, other = r(9), r(4), r(12), r(5), r(7), r(3), r(10)
    completion = c1 + S2 + c2 + S3 + c3
    T = len(completion)
    ids = torch.tensor([P + completion, P + other + [0] * (T - len(other))])
    att = torch.ones_like(ids)
    att[1, len(P) + len(other):] = 0
    starts = torch.zeros(2, T, dtype=torch.long)
    s2, s3 = len(c1), len(c1) + len(S2) + len(c2)
    starts[0, [s2, s3]] = 1
    alone = [(P + c1, range(0, s2)), (S2 + c2, range(s2 + 1, s3)), (S3 + c3, range(s3 + 1, T))]
    return ids, att, T, starts, alone


def test_a_row_split_into_samples_scores_each_in_its_own_context(tiny_model_dir):
    """Packed log-probs of a split row equal each sample forwarded alone (and the unsplit row's, the padded ones);
    a sample's first token (its prompt's, out of the loss) is not scored. A budget that puts the samples in
    different tries changes nothing."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from mt_grpo.engine.packing import packed_logps_and_entropies
    from test_packing import padded

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    ids, att, T, starts, alone = split_row(model.config.vocab_size)
    with torch.no_grad():
        for budget in (None, 32):
            logps, _, _ = packed_logps_and_entropies(model, ids, att, T, budget, sample_starts=starts)
            for seq, cols in alone:
                seq = torch.tensor([seq])
                want, _ = padded(model, seq, torch.ones_like(seq), len(cols))
                assert (logps[0, list(cols)] - want[0]).abs().max() < 1e-4
            assert (logps[0, starts[0].bool()] == 0).all()
            want_other, _ = padded(model, ids[1:], att[1:], T)
            assert ((logps[1] - want_other[0]) * att[1, -T:]).abs().max() < 1e-4
        unsplit, _, _ = packed_logps_and_entropies(model, ids, att, T)
        assert (unsplit[0, alone[1][1]] - logps[0, alone[1][1]]).abs().max() > 1e-3  # the contexts differ


def test_sampler_processed_log_probs_of_a_split_row(tiny_model_dir):
    """policy_sampler_logprobs (the IS correction's pi_trainer under top-k and a repetition penalty) scores each
    sample in its own context, its penalty counting only that sample's tokens."""
    from transformers import AutoModelForCausalLM

    from mt_grpo.engine.sampling import SamplingParams, policy_sampler_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids, att, T, starts, alone = split_row(model.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3)
    P = ids.shape[1] - T
    with torch.no_grad():
        got = policy_sampler_logprobs(model, ids[:, :P], att[:, :P], ids[:, P:], att[:, P:], params, starts)
        for seq, cols in alone:
            seq = torch.tensor(seq)
            n = len(cols)
            want = policy_sampler_logprobs(model, seq[None, :-n], torch.ones(1, len(seq) - n, dtype=torch.long),
                                           seq[None, -n:], torch.ones(1, n, dtype=torch.long), params)
            assert (got[0, list(cols)] - want[0]).abs().max() < 1e-5


# --- the loss -----------------------------------------------------------------------------------------------
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo", "sapo", "cispo", "vespo")


@pytest.fixture(scope="module")
def trainers(tiny_agent_dir, task_files, tmp_path_factory):  # noqa: F811
    """The scripted trainer's batch (QA: one-turn answers; QB: two tool turns then an answer, so 3 samples each in
    per_turn) as interleaved rows and as per-turn samples, with a reference and old log-probs that differ."""
    out = {}
    for mode in ("interleaved", "per_model_turn"):
        trainer, batch = scripted_trainer(tiny_agent_dir, task_files, tmp_path_factory.mktemp(mode), "--beta", "0.1",
                                          "--turn_samples", mode, "--padding_free", "false")
        mask = batch["completion_mask"] * batch["tool_mask"]
        batch["ref_per_token_logps"] = batch["ref_per_token_logps"] - 0.3 * mask
        batch["old_per_token_logps"] = batch["ref_per_token_logps"] + 0.1 * mask
        out[mode] = trainer, batch
    return out


def test_per_turn_rows_hold_three_samples_with_the_same_loss_tokens(trainers):
    (_, inter), (_, split) = trainers["interleaved"], trainers["per_model_turn"]
    samples = 1 + split["sample_starts"].sum(dim=1)
    assert samples.tolist() == [1] * 4 + [3] * 4 and not inter["sample_starts"].any()
    loss_tokens = lambda b: b["completion_ids"][(b["completion_mask"] * b["tool_mask"]).bool()]  # noqa: E731
    assert torch.equal(loss_tokens(inter), loss_tokens(split))
    adv = lambda b: b["advantages"][(b["completion_mask"] * b["tool_mask"]).bool()]  # noqa: E731
    assert torch.allclose(adv(inter), adv(split)) and adv(split).abs().max() > 0
    # the repeated history: per_turn rows are longer
    assert split["completion_mask"].sum() > inter["completion_mask"].sum()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_an_episode_split_into_samples_counts_once_in_every_loss_type(trainers, loss_type):
    """The loss and its gradient of per_turn rows equal the interleaved ones: the same tokens in the same contexts,
    and each episode weighed once (were each of QB's 3 samples a row, grpo's per-row mean would count QB 3 times)."""
    results = {}
    for mode, (trainer, batch) in trainers.items():
        trainer.loss_type = loss_type
        inputs = dict(batch)
        if loss_type == "vespo":
            inputs["importance_sampling_ratio"] = torch.ones_like(batch["advantages"])
        loss = trainer._compute_loss(trainer.model, inputs)
        results[mode] = loss.item(), gradient(trainer.model, loss)
    (loss_i, g_i), (loss_s, g_s) = results["interleaved"], results["per_model_turn"]
    assert loss_s == pytest.approx(loss_i, rel=1e-5, abs=1e-7) and g_i.abs().max() > 0
    assert (g_s - g_i).abs().max() <= 1e-4 * g_i.abs().max()


# --- a run --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, padding_free", [("per_model_turn", "false"), ("interleaved", "true")])
def test_a_run_trains_in_each_setting(tiny_agent_dir, tmp_path, mode, padding_free):
    """The in-process backend (transformers' generate) in each setting (auto, the default, runs in every other
    smoke run): the tiny agent calls tools, so per_turn splits (its split rows are forwarded packed whatever
    `padding_free` says); interleaved never does."""
    _, _, steps = smoke_run(tiny_agent_dir, tmp_path, "--turn_samples", mode, "--padding_free", padding_free,
                            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1")
    assert steps and all(s["grad_norm"] > 0 for s in steps)
    split = [s["rollout/samples_per_episode"] > 1 for s in steps]
    assert any(split) if mode == "per_model_turn" else not any(split)


def test_an_auto_split_is_logged_once_with_its_reason(caplog, monkeypatch):
    """Issue 78, point 7: Qwen3's template (enable_thinking false, as TRL's examples run it) re-renders the history, so
    `auto` splits an episode into samples where TRL keeps one: the run says so once, naming the field that keeps
    one sequence; a reply that continues the sample splits nothing and says nothing."""
    import logging

    from mt_grpo.base import turn_samples

    monkeypatch.setattr(turn_samples, "_SPLIT_LOGGED", [])
    with caplog.at_level(logging.INFO, logger="mt_grpo"):
        assert turn_samples.next_sample_prompt("auto", [1, 2], [3], lambda: [1, 2, 3]) is None
        assert not caplog.records
        for _ in range(3):
            assert turn_samples.next_sample_prompt("auto", [1, 2], [3], lambda: [1, 9, 3]) == [1, 9, 3]
    (record,) = caplog.records
    assert "Qwen3" in record.getMessage() and "turn_samples: interleaved keeps one" in record.getMessage()
