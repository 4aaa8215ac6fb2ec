"""What is sampled and optimised is what the recipe says: explicit sampling parameters in-process
(the model's generation_config.json must not change the distribution), the PEFT reference model,
and chat_template_kwargs on every render."""

import shutil

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import RECIPE, chat_template
from mt_grpo_trainer import build_trainer
from mt_grpo.engine.sampling import SamplingParams, TransformersBackend
from prepare_models import HOSTILE_GENERATION_DEFAULTS
from mt_grpo.base.protocol import XMLProtocol

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models, scored and trained in this process


def test_in_process_samples_follow_the_recipe_not_the_generation_config(tiny_agent_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    assert {k: getattr(model.generation_config, k) for k in HOSTILE_GENERATION_DEFAULTS} == HOSTILE_GENERATION_DEFAULTS
    backend = TransformersBackend(tokenizer=tokenizer, params=SamplingParams(temperature=0.8),
                                  eos_token_ids=[tokenizer.eos_token_id], stop_strings=XMLProtocol.stop_strings)
    backend.sync_weights(model, Accelerator(cpu=True))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Veltria?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    torch.manual_seed(0)
    samples = backend.generate([ids], [40], n=4)
    assert model.generation_config.repetition_penalty == 1.5  # restored after generation
    for sample in samples:
        x = torch.tensor([ids + sample.token_ids])
        with torch.no_grad():
            logps = (model(x).logits[0, len(ids) - 1 : -1] / 0.8).log_softmax(-1)
        ours = logps.gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
        # with repetition_penalty 1.5 or top_k 5 applied, repeated or low-ranked tokens would differ by far more
        assert (ours - torch.tensor(sample.logprobs)).abs().max() < 1e-4


def test_peft_reference_is_the_base_model_and_kl_is_not_zero(tiny_agent_dir, tmp_path):
    trainer = build_trainer(["--config", RECIPE, "--model_name_or_path", tiny_agent_dir,
                             "--output_dir", str(tmp_path / "out"), "--use_peft", "true", "--lora_r", "8",
                             "--lora_target_modules", "q_proj", "v_proj", "--beta", "0.1", "--learning_rate", "0.05",
                             "--max_steps", "1", "--mask_zero_advantage_groups", "false"])
    trainer.train()  # one LoRA step: the adapter (initialised to 0) now changes the policy
    trainer.model.train()
    inputs = [dict(trainer.train_dataset[0])] * trainer.num_generations * 2
    batch = trainer._generate_and_score_completions(inputs)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    T = batch["completion_ids"].shape[1]
    # every model token (groups without signal stay in the mask: the flag above keeps them)
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert mask.any()
    with torch.no_grad():
        policy = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, T)[0]
        with trainer.accelerator.unwrap_model(trainer.model).disable_adapter():
            base = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, T)[0]
    ref = batch["ref_per_token_logps"]
    assert torch.allclose(ref[mask], base[mask], atol=1e-5)
    kl = torch.exp(ref - policy) - (ref - policy) - 1
    assert kl[mask].mean() > 1e-6


def test_chat_template_kwargs_reach_every_render(tiny_agent_dir, tmp_path):
    """Qwen3's template with enable_thinking false: the generation prompt carries an empty think block,
    in the prompt, in every environment reply, and in the tokenization check's full render."""
    model_dir = str(tmp_path / "qwen3-style")
    shutil.copytree(tiny_agent_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = chat_template("qwen3")
    tokenizer.save_pretrained(model_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(open(RECIPE).read() + "chat_template_kwargs: {enable_thinking: false}\ntool_format: chat_template\n"
                      "outcome_reward_funcs: [exact_match_reward_func, chat_format_reward_func]\n")
    trainer = build_trainer(["--config", str(recipe), "--model_name_or_path", model_dir, "--output_dir",
                             str(tmp_path / "out")])
    env = trainer.env
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prompt = env.render(trainer.train_dataset[0]["prompt"], add_generation_prompt=True)
    assert prompt.endswith(empty_think)
    reply = tokenizer.decode(env.env_reply_ids([{"role": "tool", "name": "search", "content": "R"}]))
    assert reply.endswith(empty_think) and "<tool_response>\nR\n</tool_response>" in reply
    without = env.tokenizer.apply_chat_template(env.protocol.template_messages(trainer.train_dataset[0]["prompt"]),
                                                tools=env.template_tools, tokenize=False, add_generation_prompt=True)
    assert not without.endswith(empty_think)  # the default (thinking on) differs: the kwargs made the difference


def test_every_backend_has_the_generation_backend_interface():
    """The real backends and the tests' scripted ones share one interface (GenerationBackend), with the same
    parameter names, so that a scripted run exercises the env as a real one does; a backend that can_submit
    has the per-episode scheduler's part too, shaped like the real client's."""
    import inspect

    from mt_grpo_trainer import VLLMServerClient
    from mt_grpo.engine.sampling import GenerationBackend
    from scripted_policy import ScriptedPolicy, ScriptedServer, ScriptedTransformersBackend

    def parameters(cls, name):
        return list(inspect.signature(getattr(cls, name)).parameters)

    methods = [n for n in vars(GenerationBackend) if not n.startswith("_") and callable(vars(GenerationBackend)[n])]
    assert set(methods) == {"generate", "another_round", "sync_weights"}
    for cls in (TransformersBackend, VLLMServerClient, ScriptedPolicy, ScriptedTransformersBackend, ScriptedServer):
        assert {cls.external, cls.can_submit} <= {True, False}, cls
        for name in methods:
            assert parameters(cls, name) == parameters(GenerationBackend, name), (cls, name)
    for cls in (VLLMServerClient, ScriptedServer):
        assert cls.can_submit and parameters(cls, "submit") == parameters(VLLMServerClient, "submit")
    assert "max_concurrent_requests" in parameters(ScriptedServer, "__init__")
    assert "prompts_per_request" in parameters(ScriptedServer, "__init__")
    assert not TransformersBackend.can_submit and not hasattr(TransformersBackend, "submit")


def test_an_external_sampler_passed_in_is_refused_with_lora_dropout(tiny_agent_dir, tmp_path):
    """check_backend judges the backend the run uses, not the recipe's: under `generation_backend: transformers`, a
    scripted external sampler passed to build_trainer with `use_peft` and TRL's default `lora_dropout` (0.05) is
    refused, as a vLLM server is."""
    from scripted_policy import ScriptedSampler

    with pytest.raises(ValueError, match=r"`lora_dropout` is 0.05 with an external sampler \(ScriptedSampler\)"):
        build_trainer(["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", str(tmp_path),
                       "--use_peft", "true"],
                      backend_factory=lambda env: ScriptedSampler(env.tokenizer, {}, SamplingParams()))
