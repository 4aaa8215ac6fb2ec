"""An agent program as the rollout (mt_grpo/agents/): the openai SDK, sync and async, streaming and not, through the
OpenAI-compatible endpoint; every token recorded as sampled; a clean append one sample, a rewrite a new one; the
episode's own key; refused requests, a hung, a raising and a silent agent; an agent in another process; the
knowledge-base task as an agent against the built-in loop; training 2 steps."""

import asyncio
import json
import math
import sys
import threading

import httpx
import pytest
import torch

from agent_programs.openai_tool_loop import tool_loop
from helpers import VELTRIA, make_env, xml_answer, xml_call
from scripted_policy import ScriptedPolicy, ScriptedServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = "What is the capital of Veltria?"
SCRIPT = {Q: [[xml_call("capital of Veltria"), xml_answer("Morvane")], [xml_answer("Paris")]]}


def agent_env(tokenizer, agent=None, **overrides):
    from mt_grpo.agents.runner import AgentEnv

    keys = ("timeout", "honour", "batch_wait", "max_prompt_length", "command")
    env = make_env(tokenizer, [], **{k: v for k, v in overrides.items() if k not in keys})
    # in process, the calls are sampled once every running agent waits: a group's first calls are one request with n
    # samples (the scripted policy plays variant j for sample j), however slow the machine
    overrides = {"batch_wait": 600.0, **overrides}
    return AgentEnv(env, agent=agent, **{k: v for k, v in overrides.items() if k in keys})


def test_a_sync_and_a_streaming_openai_agent_record_the_built_in_loops_tokens(smollm2_tokenizer):
    """A group of two: the first searches then answers (two calls, one sample: the tool reply is appended, mask 0),
    the second answers at once. Tokens, masks and messages are those the built-in loop records for the same turns."""
    from mt_grpo.rollout.episodes import pad_episodes

    builtin = make_env(smollm2_tokenizer, [_search()])
    expected = builtin.rollout([builtin.prompt(Q)] * 2, ScriptedPolicy(smollm2_tokenizer, SCRIPT))
    for stream in (False, True):  # the agent's own prompt: the built-in's messages (system, examples, question)
        env = agent_env(smollm2_tokenizer, lambda row, client: tool_loop_prompted(row, client, builtin.prompt(Q),
                                                                                  stream))
        rows = [{"question": Q}] * 2
        episodes = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, SCRIPT), rows=rows)
        for ep, want in zip(episodes, expected):
            assert ep.prompt_ids == want.prompt_ids and ep.completion_ids == want.completion_ids
            assert ep.model_mask == want.model_mask and ep.sampler_logprobs == want.sampler_logprobs
            assert ep.messages == want.messages and ep.stop_reason == want.stop_reason == "answer"
            assert ep.agent_stats["calls"] == len([s for s in ep.spans if s.role == "model"])
        assert [len(ep.sample_starts) for ep in episodes] == [0, 0]  # clean appends: one sample each
        a, b = pad_episodes(episodes, 0, False)["token_turns"]
        assert (a >= 0).sum() > 0 and a.max() == 1 and b.max() == 0  # the first episode's two calls: turns 0 and 1


def tool_loop_prompted(row, client, prompt, stream):
    """tool_loop from a prompt of messages (the built-in env's), answering searches with VELTRIA."""
    messages = [{k: v for k, v in m.items() if k in ("role", "content")} for m in prompt]
    for _ in range(4):
        if stream:
            content, calls = "", {}
            for chunk in client.chat.completions.create(model="policy", messages=messages, stream=True):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for c in choice.delta.tool_calls or []:
                        calls.setdefault(c.index, {"id": c.id, "type": "function",
                                                   "function": {"name": c.function.name, "arguments": ""}})
                        calls[c.index]["function"]["arguments"] += c.function.arguments or ""
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = list(calls.values())
            ids = [c["id"] for c in calls.values()]
        else:
            m = client.chat.completions.create(model="policy", messages=messages).choices[0].message
            message, ids = m.model_dump(exclude_none=True), [c.id for c in m.tool_calls or []]
        messages.append(message)
        if not ids:
            return None
        messages += [{"role": "tool", "tool_call_id": i, "content": VELTRIA} for i in ids]


def _search():
    from helpers import fake_search

    return fake_search(lambda query: VELTRIA)


def test_recorded_ids_and_logprobs_are_the_samplers_and_agent_text_has_mask_0(agent):
    """Real sampling in process (the tiny agent model): every model token's id and logprob is what generate returned
    for that call; every token the agent sent (its messages' tail) has mask 0; batched calls (two agents at once)."""
    from accelerate import Accelerator

    from mt_grpo.base.protocol import XMLProtocol
    from mt_grpo.engine.sampling import SamplingParams, TransformersBackend

    model, tokenizer, _ = agent

    class Recording(TransformersBackend):
        def generate(self, prompts, max_tokens, n=1, params=None):
            samples = super().generate(prompts, max_tokens, n, params)
            self.seen += [(list(p), s) for p, s in zip(prompts, samples)]
            self.batches.append(len(prompts))
            return samples

    backend = Recording(tokenizer=tokenizer, params=SamplingParams(temperature=1.0), eos_token_ids=[
        tokenizer.eos_token_id], stop_strings=XMLProtocol.stop_strings)
    backend.seen, backend.batches = [], []
    backend.sync_weights(model, Accelerator(cpu=True))

    def two_calls(row, client):
        messages = [{"role": "user", "content": row["question"]}]
        for _ in range(2):
            r = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, temperature=0.3)
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Go on. <|im_end|> (not a control token)"}]

    env = agent_env(tokenizer, two_calls, max_tokens_per_turn=12, tokenization_check="off")
    torch.manual_seed(0)
    episodes = env.rollout(None, backend, rows=[{"question": Q}, {"question": "Who founded Quorvath?"}])
    assert backend.batches == [2, 2]  # both agents waited: one generate per round of calls
    for ep in episodes:
        assert ep.stop_reason in ("no_action", "answer", "turn_length", "agent_done")
        assert ep.agent_stats["sampling_overridden"] == 2  # temperature 0.3 asked, the run's 1.0 applied
        model_spans = [s for s in ep.spans if s.role == "model"]
        assert len(model_spans) == 2
        for span in model_spans:
            context = ep.prompt_ids + ep.completion_ids[: span.start]
            prompt, sample = next((p, s) for p, s in backend.seen if p == context)
            assert ep.completion_ids[span.start : span.end] == sample.token_ids
            assert ep.sampler_logprobs[span.start : span.end] == sample.logprobs
            assert set(ep.model_mask[span.start : span.end]) == {1}
        env_span = next(s for s in ep.spans if s.role == "env")
        assert set(ep.model_mask[env_span.start : env_span.end]) == {0}
        reply = ep.completion_ids[env_span.start : env_span.end]
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert reply.count(im_end) == (2 if ep.completion_ids[env_span.start - 1] != im_end else 1)  # the template's


def test_a_scripted_two_call_episode_gets_the_hand_computed_advantages(smollm2_tokenizer):
    """Two episodes of one group: A calls twice (scores 0.5, 1.0 per call, reward 1), B once (score 0.0, reward 0).
    R_T (mt_grpo: the first call's score) = (0.5, 0.0), R_O = (1, 0): A_T = (+0.7071, -0.7071), A_O likewise; A's
    first call's tokens get A_O + A_T = 1.4142, its second call's A_O = 0.7071; B's one call -1.4142."""
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table, \
        weighted_reward
    from mt_grpo.rollout.episodes import pad_episodes

    def agent(row, client):
        messages = [{"role": "user", "content": row["question"]}]
        m = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        if not m.tool_calls:
            return {"reward": 0.0, "call_scores": [0.0]}
        messages += [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": VELTRIA}]
        client.chat.completions.create(model="policy", messages=messages)
        return {"reward": 1.0, "call_scores": [0.5, 1.0]}

    env = agent_env(smollm2_tokenizer, agent)
    a, b = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, SCRIPT), rows=[{"question": Q}] * 2)
    turns = [a.tool_turns, b.tool_turns]
    assert turns == [1, 0]
    completions = [a.messages, b.messages]
    turn = compute_rewards_per_func([env.agent_call_scores], ["p"] * 2, completions, {}, turns, 1)
    outcome = compute_rewards_per_func([env.agent_reward], ["p"] * 2, completions, {})
    R_T = turn_reward_table(turn, torch.ones(1), torch.tensor(turns), [True])
    R_O = weighted_reward(outcome, torch.ones(1))
    assert R_T[:, 0].tolist() == [0.5, 0.0] and R_O.tolist() == [1.0, 0.0]
    token_turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, R_O, token_turns, AdvantageSettings.of("mt_grpo", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][token_turns[0] == 0], torch.tensor(1.4142), atol=1e-4)
    assert torch.allclose(adv.tokens[0][token_turns[0] == 1], torch.tensor(0.7071), atol=1e-4)
    assert torch.allclose(adv.tokens[1][token_turns[1] == 0], torch.tensor(-1.4142), atol=1e-4)
    env.release([a, b])
    assert env.results == {}


def test_a_history_rewrite_starts_a_new_sample_and_is_counted(smollm2_tokenizer):
    """An agent that drops its earlier tool result (and its call) before the second call: a new sample, its prompt
    the render of the messages sent (mask 0), counted in new_samples/rewrite; changed tools: new_samples/tools."""
    from mt_grpo.base.turn_samples import episode_samples

    def dropping(row, client):
        messages = [{"role": "user", "content": row["question"]}]
        m = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        client.chat.completions.create(model="policy", messages=messages + [
            {"role": "user", "content": "Summary: the search said Morvane."}])

    env = agent_env(smollm2_tokenizer, dropping)
    (ep,) = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, {Q: [xml_call("x"), xml_answer("Morvane")]}),
                        rows=[{"question": Q}])
    assert ep.agent_stats["new_samples/rewrite"] == 1 and len(ep.sample_starts) == 1
    first, second = episode_samples(ep)
    want = env.render_ids([{"role": "user", "content": Q}, {"role": "user", "content":
                           "Summary: the search said Morvane."}], add_generation_prompt=True)
    assert second.prompt_ids == want and second.model_mask and set(second.model_mask) == {1}
    start = ep.sample_starts[0][0]
    assert set(ep.model_mask[start : start + len(want)]) == {0}
    from mt_grpo.agents import agent_metrics

    metrics = agent_metrics([ep])
    assert metrics["agent/new_samples/rewrite"] == 1.0 and metrics["agent/new_samples/tools"] == 0.0


def serve_one(tokenizer, script, body_of, **overrides):
    """One episode whose agent posts raw requests (httpx) built by `body_of(row, base_url, key, post)`."""
    out = {}

    def agent(row, base_url, api_key):
        def post(body, key=api_key, url=base_url, raw=None):
            r = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           **({"content": raw} if raw is not None else {"json": body}), timeout=30)
            return r.status_code, r.json()

        out.update(body_of(row, base_url, api_key, post))

    env = agent_env(tokenizer, agent, **overrides)
    episodes = env.rollout(None, ScriptedPolicy(tokenizer, script), rows=[{"question": Q}])
    return out, episodes[0], env


def test_keys_ended_episodes_and_requests_that_cannot_be_honoured_get_openai_errors(smollm2_tokenizer):
    user = [{"role": "user", "content": Q}]

    def calls(row, base_url, key, post):
        out = {"made_up": post({"messages": user}, key="sk-made-up"),
               "bad_json": post(None, raw="{not json"),
               "n": post({"messages": user, "n": 2}),
               "logit_bias": post({"messages": user, "logit_bias": {"5": 10}}),
               "format": post({"messages": user, "response_format": {"type": "json_object"}}),
               "choice": post({"messages": user, "tool_choice": "sometimes"}),  # required: accepted, unenforced
               "long": post({"messages": [{"role": "user", "content": "word " * 600}]}),
               "models": httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"}).json()}
        out["ok"] = post({"messages": user, "max_tokens": 3, "seed": 1, "user": "u", "store": True})
        out["next"] = post({"messages": user + [out["ok"][1]["choices"][0]["message"], {"role": "user",
                             "content": "More."}]})
        return out

    out, ep, env = serve_one(smollm2_tokenizer, {Q: [xml_answer("Morvane " * 20)]}, calls, max_prompt_length=300,
                             max_completion_length=40)
    for name, param in (("n", "n"), ("logit_bias", "logit_bias"), ("format", "response_format"),
                        ("choice", "tool_choice"), ("long", "messages"), ("bad_json", "body")):
        status, body = out[name]
        assert status == 400 and body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert out["made_up"][0] == 401 and out["made_up"][1]["error"]["code"] == "invalid_api_key"
    assert out["models"]["data"][0]["id"] == "policy"
    status, body = out["ok"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    status, body = out["next"]  # the reply was cut by max_tokens, not the budget: the episode goes on
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    # after the episode: its key gets 409, another episode's key 401
    session = next(iter(env.endpoint.sessions.values()))
    r = httpx.post(f"{env.endpoint.base_url(session)}/chat/completions", json={"messages": user},
                   headers={"Authorization": f"Bearer {session.key}"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "episode_ended"
    assert ep.agent_stats["refused"] == 5 and ep.agent_stats["calls"] == 7  # the refused requests that were calls


def test_a_reply_cut_by_the_budget_ends_with_length_and_later_calls_say_the_budget_is_spent(smollm2_tokenizer):
    user = [{"role": "user", "content": Q}]

    def calls(row, base_url, key, post):
        first = post({"messages": user})
        second = post({"messages": user + [first[1]["choices"][0]["message"], {"role": "user", "content": "And?"}]})
        return {"first": first, "second": second}

    out, ep, _ = serve_one(smollm2_tokenizer, {Q: [xml_answer("Morvane " * 60)]}, calls, max_completion_length=30,
                           max_tokens_per_turn=64)
    assert out["first"][0] == 200 and out["first"][1]["choices"][0]["finish_reason"] == "length"
    assert out["second"][0] == 400 and out["second"][1]["error"]["code"] == "budget_spent"
    assert ep.stop_reason == "budget" and sum(ep.model_mask) == 30


def test_another_episodes_key_is_refused(smollm2_tokenizer):
    """Two episodes at once: each posts with the other's key to its own address (401), then with its own (200)."""
    keys, barrier, status = {}, threading.Barrier(2), {}

    def agent(row, base_url, api_key):
        keys[row["question"]] = (base_url, api_key)
        barrier.wait(10)
        other = next(k for q, (u, k) in keys.items() if q != row["question"])
        body = {"messages": [{"role": "user", "content": row["question"]}]}
        status[row["question"]] = [httpx.post(f"{base_url}/chat/completions", json=body, timeout=30,
                                              headers={"Authorization": f"Bearer {k}"}).status_code
                                   for k in (other, api_key)]

    env = agent_env(smollm2_tokenizer, agent)
    script = {Q: [xml_answer("Morvane")], "Who founded Quorvath?": [xml_answer("Ada")]}
    env.rollout(None, ScriptedPolicy(smollm2_tokenizer, script), rows=[{"question": q} for q in script])
    assert status == {q: [401, 200] for q in script}


def test_a_raising_a_hung_and_a_silent_agent(smollm2_tokenizer, caplog):
    """A raising agent ends agent_error with its call kept; a hung one (it waits for ever after its first call, its
    second call never answered) ends at agent_timeout; one that makes no call: no model tokens, counted."""
    from mt_grpo.agents import agent_metrics

    release = threading.Event()
    answers = {}

    def agent(row, client):
        messages = [{"role": "user", "content": row["question"]}]
        if row["kind"] == "silent":
            return None
        r = client.chat.completions.create(model="policy", messages=messages)
        if row["kind"] == "raise":
            raise KeyError("the agent's own bug")
        release.wait(60)  # hung: never returns before the timeout
        try:
            client.chat.completions.create(model="policy", messages=messages)
        except Exception as e:  # the episode has ended: 409
            answers["late"] = type(e).__name__
        return 1.0

    env = agent_env(smollm2_tokenizer, agent, timeout=2.0)
    rows = [{"question": Q, "kind": k} for k in ("raise", "hang", "silent")]
    raised, hung, silent = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, {Q: [xml_answer("Morvane")]}),
                                       rows=rows)
    release.set()
    assert raised.stop_reason == "agent_error" and sum(raised.model_mask) > 0 and len(raised.messages) == 1
    assert hung.stop_reason == "agent_timeout" and sum(hung.model_mask) > 0
    assert silent.stop_reason == "no_call" and silent.completion_ids == [] and silent.prompt_ids == []
    assert "KeyError" in caplog.text and "agent_error" in caplog.text
    assert agent_metrics([raised, hung, silent])["agent/no_call_ratio"] == pytest.approx(1 / 3)
    assert env.results[id(hung.messages)] == {}  # a timed-out agent's late result is not read


def test_64_concurrent_episodes_through_a_server_backend(smollm2_tokenizer):
    """64 async agents at once against a backend that takes requests one at a time (a server's submit): each gets
    its own two calls recorded, none another's."""
    questions = [f"Question number {k}?" for k in range(64)]
    script = {q: [xml_call(f"query {k}"), xml_answer(str(k))] for k, q in enumerate(questions)}

    async def agent(row, client):
        messages = [{"role": "user", "content": row["question"]}]
        for _ in range(3):
            m = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
            messages.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                return float(m.content.endswith(f"<answer>{row['k']}</answer>"))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "found"} for c in m.tool_calls]

    env = agent_env(smollm2_tokenizer, agent)
    server = ScriptedServer(smollm2_tokenizer, script, max_concurrent_requests=8)
    episodes = env.rollout(None, server, rows=[{"question": q, "k": k} for k, q in enumerate(questions)])
    assert [ep.stop_reason for ep in episodes] == ["answer"] * 64
    assert [env.results[id(ep.messages)] for ep in episodes] == [{"reward": 1.0}] * 64
    assert all(ep.messages[-1]["content"].endswith(f"<answer>{k}</answer>") for k, ep in enumerate(episodes))
    assert server.most_in_flight > 1


def test_an_agent_command_in_another_process(smollm2_tokenizer, tmp_path):
    """agent_command: the row in MT_GRPO_ROW, the address and key in OPENAI_BASE_URL / OPENAI_API_KEY (the openai
    client reads them itself); its stdout's last line is its result."""
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os\nimport openai\n"
        "row = json.loads(os.environ['MT_GRPO_ROW'])\n"
        "r = openai.OpenAI().chat.completions.create(model='policy', messages=[{'role': 'user', 'content': "
        "row['question']}])\n"
        "print('some log line')\nprint(json.dumps({'reward': float('Morvane' in r.choices[0].message.content)}))\n")
    env = agent_env(smollm2_tokenizer, command=f"{sys.executable} {script}")
    (ep,) = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, {Q: [xml_answer("Morvane")]}),
                        rows=[{"question": Q}])
    assert ep.stop_reason == "answer" and env.results[id(ep.messages)] == {"reward": 1.0}


def test_the_knowledge_base_task_as_an_agent_gives_the_built_in_loops_episodes(smollm2_tokenizer):
    """fictional_kb's search tool run by an agent against the endpoint, under a scripted policy: the same tokens,
    masks, logprobs, messages, rewards and advantages as the built-in loop's episodes (a group of 4)."""
    from mt_grpo_trainer import AdvantageSettings, compute_rewards_per_func, mt_grpo_advantages, turn_reward_table, \
        weighted_reward
    from mt_grpo.adapters import resolve_reward
    from mt_grpo.rewards import is_per_tool_turn
    from mt_grpo.rollout.episodes import pad_episodes
    from mt_grpo.tasks.fictional_kb import build_fictional_kb
    from mt_grpo.tools.search import make_search_tool

    docs, rows = build_fictional_kb(seed=0)
    search = make_search_tool(docs)
    row = rows[0]
    question, answer = row["question"], row["answer"]
    query = question.removeprefix("What is the ").rstrip("?")  # not the question itself: the script finds its turn
    script = {question: [[xml_call(query), xml_answer(answer)], [xml_answer("nothing")],  # after the question's
                         [xml_call("nothing at all"), xml_answer(answer)], [xml_call(query), xml_answer("no")]]}
    builtin = make_env(smollm2_tokenizer, [search])
    prompt = builtin.prompt(question)
    expected = builtin.rollout([prompt] * 4, ScriptedPolicy(smollm2_tokenizer, script))

    env = agent_env(smollm2_tokenizer, tool_loop(search))  # the same turns, as an openai-SDK tool loop
    episodes = env.rollout(None, ScriptedPolicy(smollm2_tokenizer, script),
                           rows=[{"prompt": prompt, "answer": answer}] * 4)
    for ep, want in zip(episodes, expected):
        for name in ("prompt_ids", "completion_ids", "model_mask", "sampler_logprobs", "messages", "stop_reason",
                     "spans"):
            assert getattr(ep, name) == getattr(want, name), name
    funcs = [resolve_reward(n) for n in ("exact_match_reward_func", "exist_answer_reward_func", "format_reward_func")]
    turn_funcs = [resolve_reward(n) for n in ("tool_execution_reward_func", "exist_answer_in_search_results")]
    scored = []
    for eps in (expected, episodes):
        columns = {"answer": [answer] * 4, "answer_aliases": [row.get("answer_aliases") or [answer]] * 4,
                   "stop_reason": [ep.stop_reason for ep in eps]}
        completions, turns = [ep.messages for ep in eps], [ep.tool_turns for ep in eps]
        R_O = weighted_reward(compute_rewards_per_func(funcs, ["p"] * 4, completions, columns), torch.ones(3))
        R_T = turn_reward_table(compute_rewards_per_func(turn_funcs, ["p"] * 4, completions, columns, turns, 1),
                                torch.ones(2), torch.tensor(turns), [is_per_tool_turn(f) for f in turn_funcs])
        adv = mt_grpo_advantages(R_T, R_O, pad_episodes(eps, 0, False)["token_turns"],
                                 AdvantageSettings.of("mt_grpo", 4, turn_advantage_coef=1.0))
        scored.append((R_T, R_O, adv.tokens))
    (t1, o1, a1), (t2, o2, a2) = scored
    assert torch.equal(t1, t2) and torch.equal(o1, o2) and torch.equal(a1, a2) and a1.abs().sum() > 0


def test_an_openai_agent_trains_two_steps(tiny_agent_dir, tmp_path):
    """The trainer's `agent` keyword: a sync openai agent, sampled in process by the tiny model, trains 2 steps; its
    reward is R_O, its per-call scores R_T; one question's agent makes no call (no model tokens); the agent's
    metrics are logged."""
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in (Q, "Who founded Quorvath?")])
    args = MTGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2,
                        per_device_train_batch_size=4, max_completion_length=96, max_tokens_per_turn=12,
                        learning_rate=1e-3, bf16=False, use_cpu=True, report_to="none", logging_steps=1,
                        save_strategy="no", disable_tqdm=True, agent_batch_wait=1.0, agent_call_scores=True,
                        advantage_mode="mt_grpo", tokenization_check="off")
    trainer = MTGRPOEnvTrainer(model=tiny_agent_dir, args=args, train_dataset=dataset, agent=_tiny_loop)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)
    assert all(s["agent/calls_per_episode"] >= 1 for s in steps), steps[0]
    assert {"rewards/outcome/agent_reward", "rewards/turn/agent_call_scores"} <= set(steps[0])
    assert all(s["agent/no_call_ratio"] in (0.0, 0.5, 1.0) for s in steps) and sum(s["agent/no_call_ratio"]
                                                                                   for s in steps) > 0


def _tiny_loop(row, client):
    messages = [dict(m) for m in row["prompt"]]
    if "Quorvath" in messages[-1]["content"]:
        return None  # no call at all: an episode without model tokens, which trains nothing
    scores = []
    for _ in range(2):
        m = client.chat.completions.create(model="policy", messages=messages, max_tokens=12).choices[0].message
        scores.append(float(bool(m.tool_calls)))
        messages += [m.model_dump(exclude_none=True), {"role": "user", "content": "Answer now."}]
    return {"reward": float("Morvane" in (m.content or "")), "call_scores": scores}


def test_an_async_streaming_agent_trains_two_steps_with_a_scripted_policy(tiny_agent_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    async def agent(row, client):
        messages = [dict(m) for m in row["prompt"]]
        for _ in range(3):
            content, ids = "", []
            async for chunk in await client.chat.completions.create(model="policy", messages=messages, stream=True):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    ids += [(c.id, c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
            message = {"role": "assistant", "content": content or None}
            if ids:
                message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                         for i, n, a in ids]
            messages.append(message)
            if not ids:
                return float("Morvane" in content)
            messages += [{"role": "tool", "tool_call_id": i, "content": VELTRIA} for i, _, _ in ids]
            await asyncio.sleep(0)

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": Q}]}] * 2)
    args = MTGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2,
                        per_device_train_batch_size=2, max_completion_length=128, learning_rate=1e-3, bf16=False,
                        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
                        tool_format="xml")
    trainer = MTGRPOEnvTrainer(model=tiny_agent_dir, args=args, train_dataset=dataset, agent=agent,
                               backend=ScriptedPolicy(tokenizer, SCRIPT))
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and steps[0]["agent/calls_per_episode"] == 1.5  # 2 calls and 1
    assert steps[0]["rollout/stop/answer"] == 1.0 and steps[0]["rewards/outcome/agent_reward"] == 0.5


def test_sigterm_while_an_agent_hangs_ends_the_agents_and_saves(tiny_agent_dir, tmp_path):
    """Step 1's four agents return; in step 2 they hang (agent_timeout 600 s). A SIGTERM ends the rollout, its agents'
    episodes, and the run with the checkpoint of step 1, exit status 0 (as test_faults' SIGTERM tests)."""
    import os
    import signal
    import subprocess

    from helpers import ROOT
    from test_environments import env_recipe, write_jsonl
    from test_faults import SCRIPTED_TRAIN

    data = write_jsonl(tmp_path / "ping.jsonl", [{"prompt": "Ping."}] * 4)
    flag, out = tmp_path / "hung", str(tmp_path / "out")
    recipe = env_recipe(tmp_path, dataset_name=data, environment_factory=None, agent="tests.env_faults:hanging_agent",
                        agent_timeout=600, stop_timeout=300, save_strategy="no", advantage_mode="auto", max_steps=3)
    env = {**os.environ, "MT_GRPO_TEST_FREE": "4", "MT_GRPO_TEST_FLAG": str(flag), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPTED_TRAIN, json.dumps({"Ping.": [xml_answer("pong")]}),
                             "--config", recipe, "--model_name_or_path", tiny_agent_dir, "--output_dir", out],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    waited = threading.Event()
    while not flag.exists() and proc.poll() is None and not waited.wait(0.2):
        pass
    assert flag.exists(), proc.communicate()[0][-4000:]
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=280)[0]
    assert proc.returncode == 0, log[-4000:]
    assert "SIGTERM received" in log and "the rollout of step 2 stopped; saving a checkpoint at step 1" in log
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-1"]


def test_chat_template_tools_come_back_as_tool_calls_and_the_echo_is_a_clean_append(qwen_style_tokenizer):
    """tool_format chat_template (Qwen2.5's template): the agent's `tools` reach the template, the model's
    <tool_call> block comes back as `tool_calls` (content without it), and the SDK's echo of that message with the
    tool's result appends to the sample (one sample: the tool message rendered as <tool_response>, mask 0)."""
    from helpers import template_call
    from mt_grpo.base.protocol import ChatTemplateProtocol

    tools = [{"type": "function", "function": {"name": "search", "description": "Search the knowledge base.",
                                               "parameters": {"type": "object", "properties": {
                                                   "query": {"type": "string", "description": "words"}},
                                                   "required": ["query"]}}}]
    seen = {}

    def agent(row, client):
        messages = [{"role": "user", "content": Q}]
        r = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        m = r.choices[0].message
        seen.update(finish=r.choices[0].finish_reason, content=m.content,
                    call=(m.tool_calls[0].function.name, json.loads(m.tool_calls[0].function.arguments)))
        messages += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                       "content": VELTRIA}]
        seen["answer"] = client.chat.completions.create(model="policy", messages=messages,
                                                        tools=tools).choices[0].message.content

    env = agent_env(qwen_style_tokenizer, agent, protocol=ChatTemplateProtocol(qwen_style_tokenizer))
    script = {Q: ["Let me look.\n" + template_call("capital of Veltria"), "<answer>Morvane</answer>"]}
    (ep,) = env.rollout(None, ScriptedPolicy(qwen_style_tokenizer, script), rows=[{"question": Q}])
    assert seen == {"finish": "tool_calls", "content": "Let me look.", "answer": "<answer>Morvane</answer>",
                    "call": ("search", {"query": "capital of Veltria"})}
    assert ep.sample_starts == [] and ep.stop_reason == "answer" and ep.agent_stats.get("new_samples/rewrite", 0) == 0
    text = qwen_style_tokenizer.decode(ep.completion_ids)
    assert '"name": "search"' in qwen_style_tokenizer.decode(ep.prompt_ids)  # the tools, in the template's system part
    assert f"<tool_response>\n{VELTRIA}\n</tool_response>" in text
    env_span = next(s for s in ep.spans if s.role == "env")
    assert set(ep.model_mask[env_span.start : env_span.end]) == {0}
    assert ep.messages[1] == {"role": "tool", "name": "search", "content": VELTRIA}


def test_agent_sampling_exact_refuses_another_temperature_and_takes_the_runs(smollm2_tokenizer):
    from mt_grpo.engine.sampling import SamplingParams

    user = [{"role": "user", "content": Q}]

    def calls(row, base_url, key, post):
        return {"other": post({"messages": user, "temperature": 0.2}), "same": post({"messages": user,
                                                                                    "temperature": 1.0, "top_p": 1})}

    out = {}

    def agent(row, base_url, api_key):
        def post(body):
            r = httpx.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"})
            return r.status_code, r.json()

        out.update(calls(row, base_url, api_key, post))

    env = agent_env(smollm2_tokenizer, agent, honour="exact")
    env.rollout(None, ScriptedPolicy(smollm2_tokenizer, {Q: [xml_answer("Morvane")]}), SamplingParams(temperature=1.0),
                rows=[{"question": Q}])
    assert out["other"][0] == 400 and out["other"][1]["error"]["param"] == "temperature"
    assert out["same"][0] == 200


def test_trls_rollout_func_is_refused_naming_the_endpoint():
    from mt_grpo.run.checks import check_trl

    with pytest.raises(ValueError, match=r"rollout_func.*as an agent \(`agent=`"):
        check_trl(rollout_func=lambda prompts, trainer: {})


def test_a_second_call_while_one_is_in_flight_gets_409(smollm2_tokenizer):
    """An episode's calls run one at a time: a call made while the episode's first waits for its sample gets 409
    call_in_flight; the first is answered once the backend answers (a backend held by an event, not a sleep)."""
    import concurrent.futures

    class Held(ScriptedPolicy):
        can_submit, max_concurrent_requests, prompts_per_request = True, 4, 1

        def __init__(self, *args):
            super().__init__(*args)
            self.submitted, self.gate = threading.Event(), threading.Event()

        def submit(self, prompts, max_tokens, n=1, params=None):
            future = concurrent.futures.Future()

            def answer():
                self.gate.wait(60)
                future.set_result(self.generate(prompts, [max_tokens] * len(prompts), n, params))

            threading.Thread(target=answer, daemon=True).start()
            self.submitted.set()
            return future

    backend = Held(smollm2_tokenizer, {Q: [xml_answer("Morvane")]})
    out = {}

    async def agent(row, base_url, api_key):
        body = {"messages": [{"role": "user", "content": Q}]}
        headers = {"Authorization": f"Bearer {api_key}"}
        async with httpx.AsyncClient(timeout=60) as http:
            first = asyncio.create_task(http.post(f"{base_url}/chat/completions", json=body, headers=headers))
            await asyncio.get_running_loop().run_in_executor(None, backend.submitted.wait, 60)
            again = {"messages": [{"role": "user", "content": Q + " Say it again."}]}  # not a retry of the first
            second = await http.post(f"{base_url}/chat/completions", json=again, headers=headers)
            backend.gate.set()
            out.update(first=(await first).status_code, second=(second.status_code, second.json()["error"]["code"]))

    env = agent_env(smollm2_tokenizer, agent)
    (ep,) = env.rollout(None, backend, rows=[{"question": Q}])
    assert out == {"first": 200, "second": (409, "call_in_flight")}
    assert ep.stop_reason == "answer" and len([s for s in ep.spans if s.role == "model"]) == 1
