"""Shared-prefix packed forwards (packing.py) against TRL's padded path: the same log-probs, entropies, losses and
gradients, on multi-turn episodes whose environment tokens are attended but masked from the loss; a token budget
that splits a batch into several tries changes nothing; and a whole run trains with it. Shared-prefix generation
(prefilled_inputs): the in-process backend's greedy tokens are those of each prompt generated alone."""

import pytest
import torch

from helpers import RECIPE, smoke_run
from mt_grpo.engine.packing import common_prefix_length
from test_scoring_path import QA, QB, SCRIPT, task_files  # noqa: F401 (task_files is a fixture)


def padded(model, ids, att, T):
    """TRL's padded path (GRPOTrainer._get_per_token_logps_and_entropies, one chunk)."""
    labels = ids.masked_fill(att == 0, -100)
    labels[:, :-T] = -100
    out = model(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -T:], out.entropy[:, -T:]


def shared_prompt_batch(vocab: int, prompt_len: int, lengths: list[int], seed: int = 0):
    """Rows of one prompt (the last one two tokens shorter: left padding) and random completions of `lengths`
    (right padding); rows 0 and 1 share their first three completion tokens, as episodes that agree on a turn."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, vocab, (prompt_len,), generator=g).tolist()
    completions = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]
    completions[1][:3] = completions[0][:3]
    T = max(lengths)
    ids = torch.zeros(len(lengths), prompt_len + T, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, c in enumerate(completions):
        p = prompt if i < len(lengths) - 1 else prompt[2:]
        ids[i, prompt_len - len(p):prompt_len], att[i, prompt_len - len(p):prompt_len] = torch.tensor(p), 1
        ids[i, prompt_len:prompt_len + len(c)], att[i, prompt_len:prompt_len + len(c)] = torch.tensor(c), 1
    return ids, att, T


def gradient(model, loss) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("budget", [None, 30])
def test_packed_log_probs_entropies_and_gradients_equal_the_padded_ones(tiny_model_dir, budget):
    """A tiny Qwen2: 4 rows, 85 real tokens. One trie forwards 56: rows 0-2's prompt once (13 tokens, and its last
    token once per different next token: 2), the turn rows 0 and 1 share once (2, and 8 + 5 after the fork), row 2's
    4, and row 3 (a prompt two tokens shorter: another root) whole, 22. A budget of 30 splits them into three tries
    (row 2 forwards the prompt again), each forwarded on its own. Padding positions are 0 in both paths."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from mt_grpo.engine.packing import packed_logps_and_entropies, plan_rows

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids, att, T = shared_prompt_batch(model.config.vocab_size, 14, [10, 7, 4, 10])
    ref_logps, ref_entropy = padded(model, ids, att, T)
    logps, entropy, (raw, forwarded) = packed_logps_and_entropies(model, ids, att, T, budget, compute_entropy=True)
    tries = [len(t.tokens) for t in plan_rows(ids, att, T, budget)[0]]
    assert raw == 85 and tries == ([56] if budget is None else [29, 18, 22]) and forwarded == sum(tries)
    assert torch.allclose(logps, ref_logps, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert logps[2, 4:].eq(0).all() and logps.ne(0).sum() == att[:, -T:].sum()
    weights = torch.rand(ids.shape[0], T, generator=torch.Generator().manual_seed(1))  # any loss of the log-probs
    g_padded = gradient(model, (ref_logps * weights + 0.1 * ref_entropy).sum())
    g_packed = gradient(model, (logps * weights + 0.1 * entropy).sum())
    assert (g_packed - g_padded).abs().max() <= 1e-5 * g_padded.abs().max()


def test_an_episode_longer_than_the_budget_is_refused_with_the_fix(tiny_model_dir):
    from mt_grpo.engine.packing import plan_rows

    ids, att, T = shared_prompt_batch(1000, 14, [10, 7, 4, 10])
    with pytest.raises(ValueError) as info:
        plan_rows(ids, att, T, budget=20)
    assert "`max_tokens_per_microbatch: 20`" in str(info.value) and "24 tokens" in str(info.value)


def test_micro_batches_that_split_groups_are_warned_about(tiny_agent_dir, tmp_path, caplog):
    """TRL shuffles a generation batch's rows over its micro-batches: with several, groups share less."""
    import logging

    from mt_grpo_trainer import build_trainer, end_processes

    with caplog.at_level(logging.WARNING, logger="mt_grpo"):
        trainer = build_trainer(["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir",
                                 str(tmp_path), "--padding_free", "true", "--per_device_train_batch_size", "4",
                                 "--gradient_accumulation_steps", "2"])
    end_processes(trainer)
    assert "across its 2 micro-batches" in caplog.text and "`gradient_accumulation_steps: 1`" in caplog.text


def test_packed_equals_padded_on_smollm2(smollm2_dir):
    """The real model (30 layers, GQA, tied embeddings), 8 episodes of one 120-token prompt, as a study group
    (shorter than a study's, which changes nothing the packing does and costs a third of the time)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from mt_grpo.engine.packing import packed_logps_and_entropies

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids, att, T = shared_prompt_batch(model.config.vocab_size, 120, [30, 22, 6, 30, 17, 25, 10, 21], seed=3)
    ref_logps, ref_entropy = padded(model, ids, att, T)
    logps, entropy, (raw, forwarded) = packed_logps_and_entropies(model, ids, att, T, compute_entropy=True)
    assert raw / forwarded > 2.5  # the prompt twice (the last row has its own) instead of 8 times
    assert (logps - ref_logps).abs().max() < 1e-4 and (entropy - ref_entropy).abs().max() < 1e-4
    g_padded = gradient(model, ref_logps.sum())
    g_packed = gradient(model, logps.sum())
    assert (g_packed - g_padded).abs().max() <= 1e-4 * g_padded.abs().max()


# --- the trainer: scripted multi-turn episodes (QB: two tool calls, so environment tokens in the completion) ---
def scripted_trainer(tiny_agent_dir, task_files, tmp_path, *flags):  # noqa: F811
    from mt_grpo_trainer import build_trainer
    from scripted_policy import ScriptedTransformersBackend

    trainer = build_trainer(
        ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path / "out"),
         "--dataset_name", str(task_files / "data.jsonl"), "--corpus_path", str(task_files / "corpus.jsonl"),
         "--turn_reward_funcs", "tool_execution_reward_func", "--outcome_reward_funcs", "exact_match_reward_func",
         "--max_completion_length", "512", "--max_tokens_per_turn", "128", "--per_device_train_batch_size", "8",
         "--gradient_accumulation_steps", "1", "--padding_free", "true", *flags],
        backend_factory=lambda env: ScriptedTransformersBackend(env.tokenizer, SCRIPT))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the test calls the loss directly
    batch = trainer._generate_and_score_completions([dict(trainer.train_dataset[i]) for i in (0, 1) for _ in range(4)])
    return trainer, batch


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_the_trainers_loss_kl_and_gradient_are_the_padded_ones(tiny_agent_dir, task_files, tmp_path, loss_type):
    """The whole loss (TRL's _compute_loss: ratios, clipping, the KL to a reference that differs, the entropy
    metric) and its gradient, packed against padded, on QA's one-turn and QB's three-turn episodes."""
    flags = ["--loss_type", loss_type, "--beta", "0.1"]
    if loss_type == "bnpo":
        flags += ["--mask_zero_advantage_groups", "false"]
    trainer, batch = scripted_trainer(tiny_agent_dir, task_files, tmp_path, *flags)
    mask = batch["completion_mask"] * batch["tool_mask"]
    assert (batch["completion_mask"] - batch["tool_mask"]).sum() > 0  # environment tokens: attended, not trained
    batch["ref_per_token_logps"] = batch["ref_per_token_logps"] - 0.3 * mask  # a reference that differs
    batch["old_per_token_logps"] = batch["ref_per_token_logps"] + 0.1 * mask  # ratios != 1, some clipped

    def loss_and_gradient(padding_free: bool):
        trainer.args.padding_free = padding_free
        for values in trainer._metrics["train"].values():
            values.clear()
        loss = trainer._compute_loss(trainer.model, dict(batch))
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
        return loss.item(), gradient(trainer.model, loss), metrics

    loss_padded, g_padded, m_padded = loss_and_gradient(False)
    loss_packed, g_packed, m_packed = loss_and_gradient(True)
    # Packed and padded log-probs differ by float32 summation order: a few ulps of each log-prob, far below a
    # relative 1e-5 (tests above). The loss sums terms of both signs (A * ratio, and the KL's), each moving by its
    # sensitivity to its log-prob (|A| * ratio) times that difference, so its error scales with the terms' size, not
    # with what is left after they cancel (here a loss of 0.017 from terms of about 1, which a faster CPU's
    # summation order moved by 1.8e-7). The bound: 1e-5 x the largest |log-prob| x the same loss with |A| (its
    # terms, none cancelling), hundreds of times below what a mask error makes (log-probs off by 1e-1).
    with torch.no_grad():
        size = trainer._compute_loss(trainer.model, {**batch, "advantages": batch["advantages"].abs()}).item()
    tolerance = 1e-5 * (batch["old_per_token_logps"] * mask).abs().max().item() * abs(size)
    assert abs(loss_packed - loss_padded) <= tolerance and g_padded.abs().max() > 0
    assert (g_packed - g_padded).abs().max() <= 1e-5 * g_padded.abs().max()
    assert m_packed["packing/ratio"] > 1.5  # each group's prompt once
    for key in ("kl", "entropy", "clip_ratio/region_mean"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-4, abs=1e-7), key


def test_old_and_reference_log_probs_come_from_the_packed_forward(tiny_agent_dir, task_files, tmp_path):
    """num_iterations 2 needs the old log-probs, beta > 0 the reference ones: both are computed when the batch is
    made, and packed they equal the padded ones."""
    trainer, batch = scripted_trainer(tiny_agent_dir, task_files, tmp_path, "--num_iterations", "2", "--beta", "0.1")
    packed = {k: batch[k].clone() for k in ("old_per_token_logps", "ref_per_token_logps")}
    trainer.args.padding_free = False
    trainer._add_old_and_ref_logps(batch)
    mask = batch["completion_mask"]
    for key, value in packed.items():
        assert ((value - batch[key]) * mask).abs().max() < 1e-4, key  # float32 summation order


def test_a_padding_free_run_trains_and_logs_its_packing_ratio(tiny_agent_dir, tmp_path):
    _, _, steps = smoke_run(tiny_agent_dir, tmp_path, "--padding_free", "true", "--max_tokens_per_microbatch",
                            "4096", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1")
    assert steps and all(s["packing/ratio"] > 1.0 and s["grad_norm"] > 0 for s in steps)


def test_common_prefix_leaves_each_row_a_token_of_its_own():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # a group of one prompt: all but its last token
    assert common_prefix_length([[1, 2, 3], [1]]) == 0
    assert common_prefix_length([[7, 2], [1, 2]]) == 0


@pytest.mark.parametrize("n", [1, 3])
def test_shared_prefix_generation_gives_each_prompts_own_greedy_tokens(tiny_agent_dir, n, monkeypatch):
    """Prompts of one system prompt and questions of different lengths (so the middle padding varies), n samples
    each: the backend prefills their common prefix once, and every row's greedy tokens and log-probs are those of its
    prompt generated alone, unpadded, by plain model.generate."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from mt_grpo.engine import sampling
    from mt_grpo.engine.sampling import SamplingParams, TransformersBackend
    from mt_grpo.base.protocol import XMLProtocol

    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    backend = TransformersBackend(tokenizer=tokenizer, params=SamplingParams(temperature=0.0),
                                  eos_token_ids=[tokenizer.eos_token_id], stop_strings=XMLProtocol.stop_strings)
    backend.sync_weights(model, Accelerator(cpu=True))
    questions = ["What is the capital of Veltria?", "Who invented the Brenloom, and in which year was it made?",
                 "Which river?"]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": "You answer questions. " * 8},
                                              {"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    prompts = [list(p["input_ids"]) for p in prompts]
    shared = []
    prefilled = sampling.prefilled_inputs
    monkeypatch.setattr(sampling, "prefilled_inputs",
                        lambda *a, **k: (out := prefilled(*a, **k), shared.append(out[2].get_seq_length()))[0])
    samples = backend.generate(prompts, [24] * len(prompts), n=n)
    assert shared == [common_prefix_length(prompts)] and shared[0] > 20  # the system prompt, prefilled once
    model.generation_config = GenerationConfig()  # the tiny agent's own (hostile) defaults would merge in
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            alone = model.generate(input_ids=torch.tensor([prompt]), generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=24, eos_token_id=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id), output_scores=True, return_dict_in_generate=True)
        tokens = alone.sequences[0, len(prompt):].tolist()
        logps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(alone.scores, tokens)]
        for sample in samples[i * n : (i + 1) * n]:
            # plain generate runs to 24 tokens; the backend cuts a row at its EOS or stop string
            assert sample.token_ids == tokens[: len(sample.token_ids)] and sample.token_ids
            assert max(abs(a - b) for a, b in zip(sample.logprobs, logps)) < 1e-4
