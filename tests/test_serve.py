"""``dsa serve`` in a subprocess on a free loopback port, driven by the ``openai`` client.

The checkpoint is a tiny random DeepseekV32ForCausalLM saved by transformers with a BPE
tokenizer trained in the test (the ``text_checkpoint`` fixture). Every load is bounded: a fixed
number of requests, each with a timeout.
"""
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

# in the `test` extra (CI installs them); the GPU machine lacks them, and its run skips these CPU tests
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import dsa
from dsa import SamplingParams

KEY = "test-key"
MODEL = "tiny"
TIMEOUT = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, checkpoint, log_path, *extra):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsa", "serve", "--checkpoint", str(checkpoint), "--port", str(self.port),
             "--device", "cpu", "--served-model-name", MODEL, "--num-blocks", "64", "--api-key", KEY, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"dsa serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"dsa serve did not become healthy:\n{self.output()}")

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def client(self, key=KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)

    def post(self, path, body=None, content=None, key=KEY):
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"} if key else {}
        return httpx.post(self.url + path, json=body, content=content, headers=headers, timeout=TIMEOUT)

    def metrics(self) -> dict:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=TIMEOUT).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(text_checkpoint, tmp_path_factory):
    s = Server(text_checkpoint, tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(text_checkpoint):
    return dsa.LLM(text_checkpoint, device="cpu", num_blocks=64)


def _concat(stream, chat: bool) -> tuple:
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return text, reasons


def test_completions_streamed_equal_non_streamed(server, llm):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    expected = llm.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == expected.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected.prompt_token_ids),
                                                                  len(expected.token_ids))
    stream = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, stream=True)
    assert _concat(stream, chat=False) == (r.choices[0].text, [r.choices[0].finish_reason])
    ids = llm.tokenizer.encode("Hello world")  # a prompt of token ids
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0).choices[0].text == \
        r.choices[0].text


def test_chat_streamed_equal_non_streamed(server, llm):
    client = server.client()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "naïve café 🎉"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7, temperature=0, stop=["zzz"])
    expected = llm.chat(msgs, SamplingParams(max_tokens=7, temperature=0))[0]
    assert r.choices[0].message.content == expected.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7, temperature=0, stop=["zzz"],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == \
        r.usage.completion_tokens
    assert _concat(chunks, chat=True) == (r.choices[0].message.content, [r.choices[0].finish_reason])


def test_seeded_sampling_is_reproducible_and_logprobs(server):
    client = server.client()

    def ask(seed):
        return client.completions.create(model=MODEL, prompt="one two three", max_tokens=8, temperature=1.0,
                                         top_p=0.95, seed=seed, logprobs=2).choices[0]
    a, b, c = ask(7), ask(7), ask(8)
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens and a.logprobs.tokens != c.logprobs.tokens
    assert len(a.logprobs.token_logprobs) == 8 and all(len(t) <= 2 for t in a.logprobs.top_logprobs)
    assert all(x <= 0 for x in a.logprobs.token_logprobs)


def test_16_concurrent_streams_each_get_their_own_text(server, llm):
    prompts = [f"{w} {i}" for i, w in enumerate(["one", "two", "three", "four", "the", "lazy", "dog", "café"] * 2)]
    expected = [c.text for c in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]
    assert len(set(expected)) > 8  # the prompts' texts differ: a mix-up would show
    client = server.client()

    def stream(prompt):
        return _concat(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                 stream=True), chat=False)[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, prompts, timeout=120))
    assert got == expected
    m = server.metrics()
    assert m["dsa_requests_running"] == 0 and m["dsa_cache_blocks_in_use"] == 0 and m["dsa_cache_blocks_free"] == 64


BAD = [  # (body or raw bytes, status, param, words in the message)
    (b"{not json", 400, None, "malformed JSON"),
    (b"[1, 2]", 400, None, "malformed JSON"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"model": MODEL, "prompt": 3}, 400, "prompt", ""),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ({"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k", ""),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", ""),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "max_position_embeddings"),
    ({"model": MODEL, "prompt": [5] * 600, "max_tokens": 4}, 400, "prompt", "limit of 512"),
    ({"model": MODEL, "prompt": [5, 10 ** 6]}, 400, "prompt", "token ids"),
    ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n", "n=1"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs", ""),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("body,status,param,words", BAD, ids=[
    "malformed", "not-an-object", "type", "prompt-type", "top_p", "top_k", "max_tokens-0", "max_tokens-limit",
    "prompt-limit", "token-id", "n", "logprobs", "model"])
def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(server, body, status, param, words):
    r = server.post("/v1/completions", content=body) if isinstance(body, bytes) else \
        server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and words in err["message"]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_bad_chat_requests(server):
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and "unknown role tool" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             "max_completion_tokens": 0, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_api_key_is_enforced_on_v1_routes(server):
    for key in (None, "wrong"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key=key).status_code == 401
        assert server.post("/v1/chat/completions", {"model": MODEL, "messages": []}, key=key).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert httpx.get(server.url + "/health").status_code == 200


def _wait_for(server, condition, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if condition(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_a_client_disconnect_frees_its_blocks(server, llm):
    blocks = -(-(len(llm.tokenizer.encode("the lazy dog")) + 400) // llm.model.config.block_size)
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "the lazy dog", "max_tokens": 400, "temperature": 0,
                            "stream": True, "ignore_eos": True}, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        during = server.metrics()
        # blocks on demand: those of the tokens computed so far, at most the request's worst case
        assert during["dsa_requests_running"] == 1 and 1 <= during["dsa_cache_blocks_in_use"] <= blocks
    after = _wait_for(server, lambda m: m["dsa_cache_blocks_in_use"] == 0)
    assert after["dsa_requests_running"] == 0 and after["dsa_cache_blocks_free"] == 64
    assert after['dsa_requests_finished_total{finish_reason="abort"}'] >= 1
    assert after["dsa_generated_tokens_total"] < during["dsa_generated_tokens_total"] + 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_shuts_down_cleanly(text_checkpoint, tmp_path):
    s = Server(text_checkpoint, tmp_path / "server.log", "--shutdown-timeout", "2")
    received = []

    def long_stream():  # a request in flight during the shutdown
        try:
            for chunk in s.client().completions.create(model=MODEL, prompt="one", max_tokens=400, stream=True,
                                                       extra_body={"ignore_eos": True}):
                received.append(chunk)
        except (openai.APIError, httpx.HTTPError):
            received.append(None)

    t = threading.Thread(target=long_stream)
    t.start()
    deadline = time.monotonic() + TIMEOUT
    while not received and time.monotonic() < deadline:
        time.sleep(0.1)
    assert received
    # uvicorn shuts down (in-flight requests get --shutdown-timeout, then are cancelled), then re-raises the
    # signal so that the exit status says SIGTERM
    assert s.stop(signal.SIGTERM, timeout=60) in (0, -signal.SIGTERM)
    t.join(TIMEOUT)
    assert not t.is_alive() and received[-1] is None  # the client saw its stream cut, it did not hang
    out = s.output()
    assert "Application shutdown complete" in out and "Finished server process" in out and "Traceback" not in out
