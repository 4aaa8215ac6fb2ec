"""The TRL peer benchmark (studies/peer_trl.py): its mask check, on rows rendered by Qwen2.5's template,
and one real step of each trainer on the tiny chat-template agent, through the benchmark's own workers."""

import json
import os
import sys

import pytest
import yaml
from helpers import RECIPE, ROOT, VELTRIA, make_chat_template_agent, run, template_call

sys.path.insert(0, os.path.join(ROOT, "studies"))

from peer_trl import collect, command, mask_problems  # noqa: E402


def episode_row(tokenizer):
    """(ids, loss mask) of a completion as both trainers build one with Qwen2.5's template: a call ending at
    <|im_end|>, the template's tool-reply block, then the answer."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Capital of Veltria?"}]
    call, answer = template_call(), "<answer>Morvane</answer>"
    before = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": call}, {"role": "tool", "name": "search", "content": VELTRIA}],
        tokenize=False, add_generation_prompt=True)
    assert after.startswith(before + call + "<|im_end|>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    model_1, env, model_2 = encode(call + "<|im_end|>"), encode(after[len(before + call + "<|im_end|>"):]), \
        encode(answer + "<|im_end|>")
    return model_1 + env + model_2, [1] * len(model_1) + [0] * len(env) + [1] * len(model_2), len(model_1), len(env)


def test_the_mask_check_passes_a_correct_row_and_names_each_leak(qwen_style_tokenizer):
    tok = qwen_style_tokenizer
    ids, mask, n_call, n_env = episode_row(tok)
    check = lambda m: mask_problems(tok, ids, m, tok.eos_token_id)  # noqa: E731
    assert check(mask) == []
    # the environment's whole reply trained as if the model wrote it
    assert any("past its end of turn" in p for p in check([1] * len(ids)))
    # its first tokens trained
    partly = mask[:n_call] + [1] * 3 + [0] * (n_env - 3) + mask[n_call + n_env:]
    assert any("past its end of turn" in p for p in check(partly))
    assert any("not one tool-reply block" in p for p in check(partly))
    # a model token of the answer left out of the loss
    dropped = mask[:]
    dropped[n_call + n_env] = 0
    assert any("not one tool-reply block" in p for p in check(dropped))
    # the call's last tokens left out: the turn no longer ends at <|im_end|> before the reply
    cut = mask[: n_call - 2] + [0] * (n_env + 2) + mask[n_call + n_env:]
    assert any("not one tool-reply block" in p for p in check(cut))


@pytest.fixture(scope="module")
def chat_template_agent_dir(tiny_agent_dir, tmp_path_factory):
    return make_chat_template_agent(tiny_agent_dir, str(tmp_path_factory.mktemp("tiny-agent-chat-template")))


@pytest.mark.parametrize("trainer", ["trl", "mt_grpo"])
def test_one_step_of_each_trainer_is_measured_and_its_masks_checked(trainer, chat_template_agent_dir, tmp_path):
    out = str(tmp_path / f"{trainer}-s1")
    flags = ["--max_steps", "1", "--eval_steps", "1", "--eval_max_samples", "4", "--per_device_eval_batch_size", "4",
             "--num_generations", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
             "--max_completion_length", "96", "--max_samples", "8"]
    run(command(trainer, 1, out, flags, chat_template_agent_dir, RECIPE), tmp_path)
    with open(os.path.join(out, "peer.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["kind"] for r in records] == ["eval", "step", "eval", "end"]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 1]
    assert records[1]["seconds"] > records[1]["rollout_seconds"] > 0
    # every trained row was checked (whether this tiny model's few rows hold a tool reply is chance: the
    # scripted test below makes sure TRL's loop is checked on replies, test_chat_template ours)
    assert records[-1]["mask_rows"] == 4 and records[-1]["mask_problems"] == [], records[-1]
    assert records[-1]["peak_rss_train"] > 0 and os.path.isfile(os.path.join(out, "eval-step-000001.jsonl"))
    evals, runs = collect([(trainer, 1, out)])
    assert [e["step"] for e in evals] == [0, 1] and evals[0]["minutes"] == 0 < evals[1]["minutes"]
    assert evals[0]["mode"] == trainer and "eval/exact_match" in evals[0]
    assert runs[0]["steps"] == 1 and runs[0]["mask_problems"] == 0
    # model tokens per episode, read from the trainer's own log, where both trainers put them under one name
    assert runs[0]["model_tokens_per_episode"] > 0


def test_trls_tool_loop_leaves_exactly_the_tool_replies_out_of_the_loss_here(chat_template_agent_dir, tmp_path):
    """TRL's real `_generate` and tool loop, in this setup (Qwen2.5's template, our `search`), with the model's
    turns scripted so that every row makes a valid call and then answers: the mask check passes and saw a
    reply in every row. (What the benchmark's runs add: the same check on every row they train.)"""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mt_grpo.tools.search import make_search_tool

    tok = AutoTokenizer.from_pretrained(chat_template_agent_dir)
    turns = [tok.encode(text, add_special_tokens=False)
             for text in (template_call() + "<|im_end|>", "<answer>Morvane</answer><|im_end|>")]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=200, max_tool_calling_iterations=2, report_to="none")
    trainer = GRPOTrainer(model=chat_template_agent_dir, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Capital?"}]]}),
                          tools=[make_search_tool([{"title": "Veltria", "text": VELTRIA}])])
    generated = []

    def scripted(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turn = turns[min(len(generated), 1)]
        generated.append(len(prompt_ids))
        return [list(turn) for _ in prompt_ids], None

    trainer._generate_single_turn = scripted
    prompts = [[{"role": "user", "content": "What is the capital of Veltria?"}]] * 2
    # what _generate_and_score_completions sets before it calls _generate: each rollout's tools
    trainer._sync_tool_dicts = [{tool.__name__: tool for tool in trainer.tools} for _ in prompts]
    trainer._async_tool_dicts = [{} for _ in prompts]
    _, completion_ids, tool_mask, completions, *_ = trainer._generate(prompts)
    assert generated == [2, 2]  # the call turn, then the answer after the tool's reply
    for ids, mask, messages in zip(completion_ids, tool_mask, completions):
        assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"] and "Morvane" in messages[1]["content"]
        assert mask_problems(tok, list(ids), list(mask), tok.eos_token_id) == []
        assert sum(1 for a, b in zip([1] + list(mask), mask) if a == 1 and b == 0) == 1


def test_the_warm_start_teaches_only_the_call_turn_and_is_made_once(chat_template_agent_dir, tmp_path):
    from peer_trl import call_example, warm_start
    from safetensors.torch import load_file

    from mt_grpo_trainer import build_trainer

    env = build_trainer(["--config", RECIPE, "--tool_format", "chat_template", "--model_name_or_path",
                         chat_template_agent_dir, "--output_dir", str(tmp_path / "x")]).env
    prompt = env.prompt("Who founded Veltria?")
    ids, labels = call_example(env, prompt)
    taught = [i for i, label in zip(ids, labels) if label != -100]
    assert ids[: len(ids) - len(taught)] == env.render_ids(prompt, add_generation_prompt=True)
    assert env.tokenizer.decode(taught) == (
        '<tool_call>\n{"name": "search", "arguments": {"query": "Who founded Veltria?"}}\n</tool_call><|im_end|>\n')

    out = str(tmp_path / "warm")
    with open(RECIPE) as f:  # the tiny recipe with short episodes, and the 32 held-out questions and 2 more
        config = {**yaml.safe_load(f), "max_completion_length": 48, "max_samples": 34}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    assert warm_start(out, chat_template_agent_dir, str(recipe), demos=2) == out
    with open(os.path.join(out, "warm_start.json")) as f:
        record = json.load(f)
    assert record["demos"] == 2 and set(record["after"]) == {
        "eval/tool_calls_per_episode", "eval/first_search_hit", "eval/exact_match", "eval/answered_ratio"}
    before, after = load_file(os.path.join(chat_template_agent_dir, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before)
    made = os.path.getmtime(os.path.join(out, "model.safetensors"))
    warm_start(out, chat_template_agent_dir, str(recipe), demos=2)  # made once
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == made


def test_trl_gets_the_tool_output_cut_as_our_env_cuts_it():
    """TRL passes a whole output on (and drops a result that overflows the completion), ours cuts it to
    `max_tool_response_tokens`: the benchmark gives TRL the cut output, with the tool's schema unchanged."""
    from peer_trl import cut_as_ours
    from transformers.utils import get_json_schema

    class Env:
        def truncate_tool_output(self, text: str) -> str:
            return text[:5] + "[cut]"

    def search(query: str, num_results: int = 3) -> str:
        """Search the knowledge base.

        Args:
            query: what to look for
            num_results: how many documents
        """
        return query * num_results

    cut = cut_as_ours(Env(), search)
    assert cut(query="abcdefgh") == "abcde[cut]" and cut("xy", num_results=1) == "xy[cut]"
    assert get_json_schema(cut) == get_json_schema(search)
