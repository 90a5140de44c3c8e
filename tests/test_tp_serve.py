"""Serving under tensor parallelism on CPU: 2 gloo ranks, rank 0's EngineLoop driven by a scripted
sequence of requests and aborts (no HTTP), rank 1 following its broadcast commands. Every request
that runs to its end gets the single-process tokens, aborted ones a prefix of them, and both ranks
produce the same tokens for every request; a rank that dies stops rank 0 with one line."""
import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dsa import DSAModel, Engine, SamplingParams
from dsa.serve.engine_loop import EngineLoop, Submission
from dsa.serve.tp_commands import TPCommands, follow
from test_parallel import TIMEOUT_S, _config, _free_port, spawn

WAIT_S = 60  # the longest rank 0 waits for one delta (a hang fails the script instead of the spawn deadline)


def _prompts(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {name: torch.randint(0, vocab, (n,), generator=g).tolist()
            for name, n in (("a", 37), ("b", 9), ("c", 25), ("d", 30), ("g", 12), ("h", 20))}


def _sampling(stop_token=None) -> dict:
    greedy = dict(temperature=0.0)
    return {"a": SamplingParams(max_tokens=8, **greedy), "b": SamplingParams(max_tokens=8, temperature=1.0, seed=7),
            "c": SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),  # unseeded: the ranks' shared seed
            "d": SamplingParams(max_tokens=20, **greedy), "g": SamplingParams(max_tokens=40, **greedy),
            "h": SamplingParams(max_tokens=40, **greedy),
            "e": SamplingParams(max_tokens=8, stop_token_ids=() if stop_token is None else (stop_token,), **greedy)}


class _Reader:
    """One submitted request as rank 0 sees it: its tokens, finish reason and error."""

    def __init__(self, loop: EngineLoop, ids: list, sampling: SamplingParams):
        self.sub = Submission(ids, sampling, asyncio.Queue())
        self.tokens, self.reason = [], None
        loop.submit(self.sub)

    async def read(self, until: int | None = None) -> "_Reader":
        """Deltas until it finished (or has ``until`` tokens)."""
        while self.reason is None and (until is None or len(self.tokens) < until):
            d = await asyncio.wait_for(self.sub.deltas.get(), WAIT_S)
            self.tokens += d.token_ids
            self.reason = d.finish_reason
        return self

    def result(self) -> dict:
        return {"rid": self.sub.rid, "tokens": self.tokens, "reason": self.reason, "error": self.sub.error}


async def _script(loop: EngineLoop, vocab: int) -> dict:
    p, sp = _prompts(vocab), _sampling()
    r = {name: _Reader(loop, p[name], sp[name]) for name in "abc"}
    r["d"] = _Reader(loop, p["d"], sp["d"])
    loop.abort(r["d"].sub)  # at once: before or after its first steps, the same on both ranks
    await r["a"].read()
    loop.abort(r["a"].sub)  # already finished: a no-op on every rank
    # the same prompt as a (its blocks cached) stopping at a's 4th token
    r["e"] = _Reader(loop, p["a"], _sampling(stop_token=r["a"].tokens[3])["e"])
    r["f"] = _Reader(loop, [vocab], sp["a"])  # out of range: refused on rank 0, never broadcast
    r["g"] = _Reader(loop, p["g"], sp["g"])
    await r["g"].read(until=3)
    loop.abort(r["g"].sub)
    r["h"] = _Reader(loop, p["h"], sp["h"])
    await r["h"].read(until=1)
    await asyncio.to_thread(loop.stop)  # h in flight: aborted, and rank 1 told to stop
    for reader in r.values():
        await reader.read()
    return {name: reader.result() for name, reader in r.items()}


def _setup(rank: int, world: int, port: int):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = DSAModel.random(_config("v32"), seed=0, dtype=torch.float32, device="cpu", tp_size=world)
    engine = Engine(model, num_blocks=64, max_batch_tokens=32)
    return engine, TPCommands(model.tp, timeout_s=60, heartbeat_s=0.2)


def _record(tokens: dict):
    def on_output(d):
        tokens.setdefault(d.request_id, []).extend(d.token_ids)
    return on_output


def _serve_worker(rank, world, port, out):
    engine, commands = _setup(rank, world, port)
    try:
        if rank == 0:
            loop = EngineLoop(engine, tp=commands)
            loop.start()
            got = asyncio.run(_script(loop, engine.config.vocab_size))
        else:
            got = {}
            follow(engine, commands, on_output=_record(got))
        torch.save(got, os.path.join(out, f"serve-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("tpserve")
    spawn(_serve_worker, 2, str(out))
    return [torch.load(out / f"serve-rank{r}.pt") for r in range(2)]


def test_two_ranks_serve_the_single_process_tokens(served):
    got, follower = served
    model = DSAModel.random(_config("v32"), seed=0, dtype=torch.float32, device="cpu")
    p, sp = _prompts(model.config.vocab_size), _sampling(stop_token=got["a"]["tokens"][3])
    names = ["a", "b", "d", "g", "h", "e"]
    one = dict(zip(names, Engine(model, num_blocks=64).generate([p[n] if n != "e" else p["a"] for n in names],
                                                                 sampling=[sp[n] for n in names])))
    for name in "abe":
        assert got[name]["tokens"] == one[name] and got[name]["error"] is None, name
    assert got["a"]["reason"] == "length" and got["e"]["reason"] == "stop" and len(got["e"]["tokens"]) <= 4
    assert len(got["c"]["tokens"]) == 6 and got["c"]["reason"] == "length"
    for name, at_least in (("d", 0), ("g", 3), ("h", 1)):  # aborted: a prefix of the tokens
        t = got[name]["tokens"]
        assert got[name]["reason"] == "abort" and len(t) >= at_least and t == one[name][:len(t)], name
    assert len(got["g"]["tokens"]) < 40 and len(got["h"]["tokens"]) < 40
    assert "shutting down" in got["h"]["error"]
    assert got["f"]["rid"] is None and "prompt_ids" in got["f"]["error"]
    # rank 1 produced the same tokens for every request, aborted ones included, and saw no other request
    assert {r["rid"] for r in got.values() if r["rid"] is not None} >= set(follower)
    for name, r in got.items():
        if r["rid"] is not None:
            assert follower.get(r["rid"], []) == r["tokens"], name


def _crash_worker(rank, world, port, out):
    """Rank 1 dies in the middle of a request; rank 0 stops serving with one line."""
    engine, commands = _setup(rank, world, port)
    if rank == 1:
        def die(d):
            if d.token_ids:
                os._exit(3)  # a crash: no goodbye to the group
        follow(engine, commands, on_output=die)
        return
    loop = EngineLoop(engine, tp=commands)
    told = []
    loop.on_fatal = told.append
    loop.start()

    async def script():
        first = await _Reader(loop, list(range(1, 30)), SamplingParams(max_tokens=40, temperature=0)).read()
        late = await _Reader(loop, [1, 2, 3], SamplingParams(max_tokens=4)).read()  # after the failure
        return first.result(), late.result()

    first, late = asyncio.run(script())
    torch.save({"first": first, "late": late, "told": told, "fatal": loop.fatal}, os.path.join(out, "crash.pt"))
    # As dsa serve does after a fatal loss (commands/serve.py: _die): leave without tearing the gloo
    # group down; its teardown with a dead peer can abort the process (SIGABRT in CI).
    os._exit(0)


def test_a_rank_that_dies_stops_rank_0_with_one_line(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_crash_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung after its peer died"
    assert [p.exitcode for p in procs] == [0, 3]
    got = torch.load(tmp_path / "crash.pt")
    fatal = got["fatal"]
    # gloo says "Connection closed by peer" or "Connection reset by peer", in a broadcast or in the step
    assert re.fullmatch(r"tensor-parallel rank 0: (lost the other ranks|the engine step failed): \w+: [^\n]+", fatal)
    assert got["told"] == [fatal]
    first, late = got["first"], got["late"]
    assert first["reason"] == "abort" and first["error"] == fatal and len(first["tokens"]) < 40
    assert late["reason"] == "abort" and late["error"] == fatal and late["rid"] is None


@pytest.mark.parametrize("argv, words", [
    (["--tp", "0"], "--tp must be positive, got 0"),
    (["--tp", "2"], "--tp 2: tp_size 2: start one process per rank with torchrun")])
def test_serve_tp_errors_are_one_line(argv, words, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from dsa.cli import main
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--preset", "tiny", "--device", "cpu", *argv])
    message = str(e.value.code)
    assert message.startswith("dsa serve: ") and words in message and "\n" not in message, message


def _children(pid: int) -> list:
    """The processes whose parent is ``pid`` (Linux: /proc/PID/stat, the parent after the name)."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            pass
    return out


def _torchrun_serve(tmp_path, *extra) -> tuple:
    """``torchrun --nproc-per-node 2 -m dsa serve --tp 2`` (tiny preset) in its own session, once
    /health answers: (the process, its HTTP port, its log's path)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    port, log_path = _free_port(), tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(_free_port()), "-m", "dsa", "serve", "--tp", "2", "--preset",
                                 "tiny", "--device", "cpu", "--num-blocks", "1024", "--port", str(port), *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port, log_path
        except httpx.HTTPError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pytest.fail(f"torchrun ... dsa serve --tp 2 did not become healthy:\n{log_path.read_text()}")


def _workers(proc) -> dict:
    """LOCAL_RANK -> pid of the workers torchrun started."""
    out = {}
    for pid in _children(proc.pid):
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        out.update({int(e[11:]): pid for e in environ if e.startswith(b"LOCAL_RANK=")})
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc (Linux)")
def test_dsa_serve_tp_2_under_torchrun(tmp_path):
    """The real command: 2 ranks under torchrun answer a completion with the single-process text;
    killing rank 1 stops rank 0 (and torchrun) with one line, not a hang."""
    httpx = pytest.importorskip("httpx")
    from dsa.model.presets import preset_model
    from dsa.serve.llm import LLM
    from dsa.serve.tokenizer import ByteTokenizer
    proc, port, log_path = _torchrun_serve(tmp_path)
    try:
        body = {"prompt": "The capital", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=WAIT_S).json()
        one = LLM.from_model(preset_model("tiny", "cpu"), ByteTokenizer(), num_blocks=64).generate(
            "The capital", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert got["choices"][0]["text"] == one.text
        workers = _workers(proc)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        assert proc.wait(WAIT_S) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("dsa serve: ")]
    assert len(lines) == 1 and lines[0].startswith("dsa serve: tensor-parallel rank 0: "), log_path.read_text()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc (Linux)")
def test_sigterm_to_the_workers_drains_every_rank_and_each_exits_0(tmp_path):
    """SIGTERM to the workers (not to torchrun, whose agent raises SignalException and exits 1):
    rank 0 drains (--shutdown-timeout 0: its stream is aborted at once and ends with an abort chunk
    and [DONE]) and tells rank 1 to stop; both exit 0, so torchrun exits 0, with no traceback."""
    httpx = pytest.importorskip("httpx")
    proc, port, log_path = _torchrun_serve(tmp_path, "--shutdown-timeout", "0")
    events = []
    try:
        body = {"prompt": "The capital", "max_tokens": 16000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=WAIT_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
                if len(events) == 1:  # the stream is in flight: stop the workers
                    workers = _workers(proc)
                    assert sorted(workers) == [0, 1], workers
                    for pid in workers.values():
                        os.kill(pid, signal.SIGTERM)
        code = proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log_path.read_text()
    assert code == 0, out
    assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
    assert "finish=abort (shutdown)" in out and "Traceback" not in out and "ERROR" not in out, out
