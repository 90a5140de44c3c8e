"""``dsa serve`` in a subprocess on a free loopback port, driven by the ``openai`` client.

The checkpoint is a tiny random DeepseekV32ForCausalLM saved by transformers with a BPE
tokenizer trained in the test (the ``text_checkpoint`` fixture). Every load is bounded: a fixed
number of requests, each with a timeout. A request that must still be running when the test acts
(a disconnect, a timeout, a shutdown) asks for LONG tokens with ignore_eos on ``long_checkpoint``
(the same model with a 64K context): minutes of work on any machine, so no test races a
generation; the tests end such requests themselves.
"""
import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

# in the `test` extra (CI installs them); the GPU machine lacks them, and its run skips these CPU tests
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import dsa
from dsa import SamplingParams
from dsa.serve.engine_loop import EngineLoop, Submission

KEY = "test-key"
MODEL = "tiny"
TIMEOUT = 60.0
LONG = 60000  # tokens no machine generates during a test (about 4 ms a token on a laptop core)
LONG_BLOCKS = 1024  # 65536 tokens: one LONG request holds most of them, a second one waits


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

    def stream(self, max_tokens=LONG, path="/v1/completions"):
        """A streamed completion (an httpx stream context) of ``max_tokens`` tokens, ignore_eos."""
        return httpx.stream("POST", self.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT,
                            json={"model": MODEL, "prompt": "the lazy dog", "max_tokens": max_tokens,
                                  "temperature": 0, "stream": True, "ignore_eos": True})

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
def long_checkpoint(text_checkpoint, tmp_path_factory):
    """text_checkpoint with max_position_embeddings 65536: room for LONG tokens."""
    folder = tmp_path_factory.mktemp("long_checkpoint")
    for f in text_checkpoint.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config = json.loads((text_checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    return folder


@pytest.fixture(scope="module")
def long_server(long_checkpoint, tmp_path_factory):
    s = Server(long_checkpoint, tmp_path_factory.mktemp("serve") / "server.log", "--num-blocks", str(LONG_BLOCKS),
               "--max-queued", "1", "--max-num-seqs", "1")
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


def test_chat_logprob_bytes_are_the_tokens_bytes(server, llm):
    """A token holding part of a character reports its own bytes, not U+FFFD's UTF-8 (239, 191, 189)."""
    msgs = [{"role": "user", "content": "東京 🎉"}]
    expected = llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0, logprobs=5))[0]
    r = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                logprobs=True, top_logprobs=5)
    got = [[e.bytes] + [t.bytes for t in e.top_logprobs] for e in r.choices[0].logprobs.content]
    ids = [[lp.token_id] + [i for i, _ in lp.top] for lp in expected.logprobs]
    assert any("\ufffd" in llm.tokenizer.token_text(i) for row in ids for i in row), "no partial-character token"
    assert got == [[list(llm.tokenizer.token_bytes(i)) for i in row] for row in ids], f"{got} for ids {ids}"


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


def _events(lines) -> list:
    """The JSON of each ``data:`` line of a server-sent event stream, up to ``[DONE]`` (included as None)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(None if line == "data: [DONE]" else json.loads(line[6:]))
            if out[-1] is None:
                break
    return out


def test_a_client_disconnect_frees_its_blocks(long_server, llm):
    server = long_server
    blocks = -(-(len(llm.tokenizer.encode("the lazy dog")) + LONG) // llm.model.config.block_size)
    with server.stream() as r:
        lines = r.iter_lines()  # held: a dropped iterator would close the connection
        assert next(line for line in lines if line.startswith("data:"))
        during = server.metrics()
        # blocks on demand: those of the tokens computed so far, at most the request's worst case
        assert during["dsa_requests_running"] == 1 and 1 <= during["dsa_cache_blocks_in_use"] <= blocks
    after = _wait_for(server, lambda m: m["dsa_cache_blocks_in_use"] == 0)
    assert after["dsa_requests_running"] == 0 and after["dsa_cache_blocks_free"] == LONG_BLOCKS
    assert after['dsa_requests_finished_total{finish_reason="abort"}'] >= 1
    assert httpx.get(server.url + "/health").status_code == 200
    assert re.search(r"prompt_tokens=\d+ completion_tokens=\d+ time=\S+ finish=abort \(client disconnected\)",
                     server.output())


def test_max_queued_refuses_with_retry_after(long_server):
    """--max-queued 1 --max-num-seqs 1: a LONG request runs, a second one waits, a third is refused."""
    server = long_server
    with server.stream() as running:
        lines = running.iter_lines()  # held: a dropped iterator would close the connection
        assert next(line for line in lines if line.startswith("data:"))
        with server.stream() as waiting:
            assert waiting.status_code == 200
            assert _wait_for(server, lambda m: m["dsa_requests_waiting"] == 1)["dsa_requests_waiting"] == 1
            r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "--max-queued 1" in r.json()["error"]["message"]
    m = _wait_for(server, lambda m: m["dsa_cache_blocks_in_use"] == 0 and m["dsa_requests_waiting"] == 0)
    assert m["dsa_cache_blocks_in_use"] == 0 and m["dsa_requests_running"] == 0
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_request_timeout_aborts_streamed_and_non_streamed(long_checkpoint, tmp_path):
    s = Server(long_checkpoint, tmp_path / "server.log", "--num-blocks", str(LONG_BLOCKS), "--request-timeout", "1")
    try:
        with s.stream() as r:
            events = _events(r.iter_lines())
        assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "abort"
        r = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True})
        assert r.status_code == 504 and "request timeout (1 s)" in r.json()["error"]["message"]
        r = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"  # (sampled: EOS may come)
    finally:
        assert s.stop() == 0
    assert len(re.findall(r"finish=abort \(request timeout\)", s.output())) == 2


def test_stats_line_while_busy(llm, caplog):
    """A clock that advances 5 s per reading (one before the first step, one after each) and an
    interval of 10 s: one request of 8 tokens (8 steps) logs a line every second step, then none."""
    ticks = itertools.count(step=5.0)
    loop = EngineLoop(llm.engine, stats_interval=10.0, clock=lambda: next(ticks))

    async def one_request():
        sub = Submission([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), asyncio.Queue())
        loop.submit(sub)
        while not (await sub.deltas.get()).finished:
            pass

    with caplog.at_level(logging.INFO, logger="dsa.serve"):
        loop.start()
        try:
            asyncio.run(one_request())
        finally:
            loop.stop()  # joins the thread: the line of the last step is logged by then
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert len(lines) == 4, lines
    pattern = (r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
               r"Running: [01] reqs, Waiting: 0 reqs, Preemptions: 0, Cache usage: [\d.]+%, "
               r"Prefix cache hit rate: [\d.]+%")
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    # the first 10 s: the prompt's 3 rows and 1 token (overlapped scheduling reads a step's token in
    # the step after)
    assert lines[0].startswith("Avg prompt throughput: 0.3 tokens/s, Avg generation throughput: 0.1 tokens/s, "
                               "Running: 1 reqs, Waiting: 0 reqs, Preemptions: 0, Cache usage: 1.6%")
    assert "Avg prompt throughput: 0.0 tokens/s" in lines[1]


def test_the_rate_window_forgets_old_steps_without_a_scrape(llm, monkeypatch):
    """The per-step records behind dsa_generation_tokens_per_second are trimmed by the loop itself:
    with a clock that advances 1 s per reading, 40 steps that nobody scrapes leave only the last
    10 s of records (before, a server never scraped kept one record per step forever)."""
    from dsa.serve import engine_loop
    ticks = itertools.count(step=1.0)
    monkeypatch.setattr(engine_loop, "time", types.SimpleNamespace(monotonic=lambda: next(ticks),
                                                                   perf_counter=time.perf_counter))
    loop = EngineLoop(llm.engine)

    async def one_request():
        sub = Submission([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), asyncio.Queue())
        loop.submit(sub)
        while not (await sub.deltas.get()).finished:
            pass

    loop.start()
    try:
        asyncio.run(one_request())
    finally:
        loop.stop()
    assert 1 <= len(loop._steps) <= engine_loop.RATE_WINDOW_S + 1, len(loop._steps)


def _in_flight(server) -> tuple:
    """A LONG stream in a thread; returns the thread and its list of events, once the first came."""
    events, started = [], threading.Event()

    def read():
        try:
            with server.stream() as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
                        started.set()
        except httpx.HTTPError as e:
            events.append(e)
        started.set()

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(TIMEOUT)
    return t, events


def _exit_code(server, timeout) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.stop(signal.SIGKILL)
        pytest.fail(f"dsa serve did not exit within {timeout} s:\n{server.output()}")


def _wait_for_output(server, words: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while words not in server.output() and server.proc.poll() is None:
        assert time.monotonic() < deadline, f"no {words!r} in the log:\n{server.output()}"
        time.sleep(0.05)


def _wait_for_draining(server) -> None:
    deadline = time.monotonic() + TIMEOUT
    while httpx.get(server.url + "/health", timeout=TIMEOUT).status_code != 503:
        assert time.monotonic() < deadline, "/health never said 503 while draining"
        time.sleep(0.05)


def _clean(out: str) -> None:
    for words in ("Traceback", "CancelledError", "ERROR"):
        assert words not in out, f"{words} in the server's log:\n{out}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_shutdown_when_idle_exits_0(text_checkpoint, tmp_path, sig):
    s = Server(text_checkpoint, tmp_path / "server.log")
    s.proc.send_signal(sig)
    assert _exit_code(s, TIMEOUT) == 0, s.output()
    s.stop()
    out = s.output()
    assert "Application shutdown complete" in out
    _clean(out)


def test_a_second_ctrl_c_ends_every_request_at_once(long_checkpoint, tmp_path):
    """Draining with --shutdown-timeout 600: a second Ctrl-C ends the running stream with an abort
    chunk and [DONE], the waiting non-streamed request with a 503, and the server exits 0; more, once
    it has stopped serving, change nothing (Python's default handlers, restored while the interpreter
    tears down, would kill it: exit -2)."""
    s = Server(long_checkpoint, tmp_path / "server.log", "--num-blocks", str(LONG_BLOCKS), "--shutdown-timeout", "600",
               "--max-num-seqs", "1")
    t, events = _in_flight(s)
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
        s.post, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True})
    assert _wait_for(s, lambda m: m["dsa_requests_waiting"] == 1)["dsa_requests_waiting"] == 1
    s.proc.send_signal(signal.SIGINT)
    _wait_for_draining(s)
    assert s.proc.poll() is None and t.is_alive()  # draining: the stream goes on
    s.proc.send_signal(signal.SIGINT)
    _wait_for_output(s, "Finished server process")
    deadline = time.monotonic() + TIMEOUT
    while s.proc.poll() is None and time.monotonic() < deadline:  # Ctrl-C held down while it exits
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    assert _exit_code(s, TIMEOUT) == 0, s.output()
    t.join(TIMEOUT)
    s.stop()
    assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
    r = waiting.result(TIMEOUT)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    out = s.output()
    assert "shutting down now: ending 2 requests" in out and len(re.findall(r"finish=abort \(shutdown\)", out)) == 2
    _clean(out)


def test_shutdown_aborts_requests_past_the_timeout(long_checkpoint, tmp_path):
    s = Server(long_checkpoint, tmp_path / "server.log", "--num-blocks", str(LONG_BLOCKS), "--shutdown-timeout", "1")
    t, events = _in_flight(s)
    sent = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert _exit_code(s, TIMEOUT) == 0
    assert time.monotonic() - sent < 1 + 5  # --shutdown-timeout, then the abort and the exit
    t.join(TIMEOUT)
    s.stop()
    assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "abort"  # a clean end, then [DONE]
    out = s.output()
    assert re.search(r"finish=abort \(shutdown\)", out) and "Application shutdown complete" in out
    assert "Traceback" not in out and "ERROR" not in out


def test_shutdown_refuses_new_requests_and_lets_those_in_flight_finish(long_checkpoint, tmp_path):
    s = Server(long_checkpoint, tmp_path / "server.log", "--num-blocks", str(LONG_BLOCKS), "--shutdown-timeout", "600")
    with s.stream() as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        s.proc.send_signal(signal.SIGTERM)
        _wait_for_draining(s)
        refused = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert s.proc.poll() is None  # still draining: the stream is in flight
    # the client ends its stream: nothing is left in flight, the server exits long before 600 s
    assert _exit_code(s, TIMEOUT) == 0
    s.stop()
    assert "Traceback" not in s.output()


def test_a_request_leaves_out_what_the_checkpoint_defaults():
    """temperature / top_p / top_k / min_p a request does not give come from the checkpoint's
    generation_config.json (the embedded default's 0.7 / 0.9); what it gives wins."""
    from dsa.model.presets import DEFAULT_CHECKPOINT
    from dsa.serve.llm import generation_defaults
    from dsa.serve.openai_server import CompletionRequest, _sampling
    defaults = generation_defaults(DEFAULT_CHECKPOINT)
    assert defaults == {"temperature": 0.7, "top_p": 0.9}
    left_out = _sampling(CompletionRequest(model="m", prompt="x", max_tokens=3), 3, None, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.7, 0.9, 0)
    given = _sampling(CompletionRequest(model="m", prompt="x", max_tokens=3, temperature=0.0), 3, None, defaults)
    assert (given.temperature, given.top_p) == (0.0, 0.9)
    assert _sampling(CompletionRequest(model="m", prompt="x", max_tokens=3), 3, None, {}).temperature == 1.0
