"""``dsa bench serve`` against ``dsa serve --preset tiny`` on the CPU, and the server's latency histograms.

Only loopback traffic; every run sends a fixed number of requests; the asserts are on counts and
structure, never on times.
"""
import argparse
import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")  # in the `test` extra; the GPU machine lacks it and skips these
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dsa.bench.serve import build_plan, load_tokenizer, sse_data
from dsa.cli import main
from dsa.commands.bench_serve import check_args
from dsa.serve.metrics import Histogram

KEY = "bench-key"
HISTOGRAMS = ("dsa_time_to_first_token_seconds", "dsa_inter_token_latency_seconds", "dsa_e2e_request_latency_seconds",
              "dsa_request_queue_time_seconds")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("bench-serve") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dsa", "serve", "--preset", "tiny", "--device", "cpu", "--port",
                             str(port), "--num-blocks", "256", "--api-key", KEY],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"dsa serve --preset tiny did not become healthy:\n{log.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(60)
    log.close()


def bench(tmp_path, *argv, url=None) -> tuple:
    """Run ``dsa bench serve``; returns (exit code, the result document)."""
    path = tmp_path / f"serve-{len(list(tmp_path.iterdir()))}.json"
    target = ["--url", url, "--api-key", KEY] if url else []
    rc = main(["bench", "serve", *target, "--json", str(path), *map(str, argv)])
    return rc, json.loads(path.read_text())


def histograms(url: str) -> dict:
    """name -> {"buckets": [(le, count)], "sum": s, "count": n} from /metrics."""
    out = {name: {"buckets": []} for name in HISTOGRAMS}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in HISTOGRAMS:
            if line.startswith(name + "_bucket{"):
                le = line.split('le="')[1].split('"')[0]
                out[name]["buckets"].append((float(le), int(line.rsplit(" ", 1)[1])))
            elif line.startswith(name + "_sum "):
                out[name]["sum"] = float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count "):
                out[name]["count"] = int(line.rsplit(" ", 1)[1])
    return out


def _check_rows(doc: dict, n: int) -> list:
    s = doc["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (n, n, 0, [])
    assert s["tokens_from"] == "usage"
    rows = doc["rows"]
    assert [r["index"] for r in rows] == list(range(n))
    for r in rows:
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: every output runs to max_tokens
        assert r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"]
        assert len(r["itl_s"]) == r["chunks"] - 1 and 1 <= r["chunks"] <= r["output_tokens"]
    assert s["output_tokens"] == sum(r["max_tokens"] for r in rows)
    assert s["short_outputs"] == 0
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(s[name]) == {"mean", "p50", "p90", "p99"}
    assert "kernel_compiles_after_ready" in doc["server"]
    return rows


def test_8_concurrent_streams_and_the_histograms(server, tmp_path):
    before = histograms(server)
    rc, doc = bench(tmp_path, "--num-requests", 16, "--concurrency", 8, "--input-len", 48, "--max-tokens", 6,
                    "--ignore-eos", url=server)
    assert rc == 0
    rows = _check_rows(doc, 16)
    assert all(r["input_tokens"] == 48 and r["burst"] is None for r in rows)
    assert doc["server"]["started"] is False and doc["server"]["ready_s"] is None
    assert doc["server"]["model"] == "dsa-tiny"
    after = histograms(server)
    for name in HISTOGRAMS:
        counts = [n for _, n in after[name]["buckets"]]
        les = [le for le, _ in after[name]["buckets"]]
        assert les == sorted(les) and les[-1] == float("inf")
        assert counts == sorted(counts) and counts[-1] == after[name]["count"]  # cumulative buckets
        assert after[name]["sum"] > before[name]["sum"]
    per_request = {n: after[n]["count"] - before[n]["count"] for n in HISTOGRAMS}
    assert per_request == {"dsa_time_to_first_token_seconds": 16, "dsa_e2e_request_latency_seconds": 16,
                           "dsa_request_queue_time_seconds": 16, "dsa_inter_token_latency_seconds": 16 * 5}


def test_randomized_lengths_and_bursts(server, tmp_path):
    rc, doc = bench(tmp_path, "--num-requests", 12, "--input-len-range", 4, 80, "--max-tokens-range", 1, 5,
                    "--concurrency-range", 1, 5, "--ignore-eos", "--seed", 3, url=server)
    assert rc == 0
    rows = _check_rows(doc, 12)
    assert all(4 <= r["input_tokens"] <= 80 and 1 <= r["max_tokens"] <= 5 for r in rows)
    assert len({r["input_tokens"] for r in rows}) > 1 and len({r["max_tokens"] for r in rows}) > 1
    bursts = [r["burst"] for r in rows]
    assert bursts == sorted(bursts) and bursts[0] == 0
    sizes = [bursts.count(b) for b in sorted(set(bursts))]
    assert all(1 <= k <= 5 for k in sizes) and sum(sizes) == 12


def test_shared_prefix_groups(server, tmp_path):
    rc, doc = bench(tmp_path, "--num-requests", 6, "--shared-prefix", 3, "--input-len", 64, "--max-tokens", 2,
                    "--ignore-eos", url=server)
    assert rc == 0
    rows = _check_rows(doc, 6)
    assert [r["burst"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert all(r["input_tokens"] > 64 for r in rows)


def test_poisson_arrivals_and_a_dataset(server, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rc, doc = bench(tmp_path, "--num-requests", 5, "--request-rate", 200, "--dataset", text, "--input-len", 32,
                    "--max-tokens", 3, "--ignore-eos", url=server)
    assert rc == 0
    assert all(r["input_tokens"] == 32 for r in _check_rows(doc, 5))


def test_failures_are_counted_with_their_message(server, tmp_path):
    rc, doc = bench(tmp_path, "--num-requests", 3, "--input-len", 5000, "--max-tokens", 2, url=server)
    s = doc["summary"]
    assert rc == 1 and (s["completed"], s["failed"]) == (0, 3)
    assert len(s["errors"]) == 1 and s["errors"][0].startswith("HTTP 400") and "exceed" in s["errors"][0]


def test_bench_starts_its_own_server(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("DSA_API_KEY", raising=False)
    assert main(["bench", "serve", "--preset", "tiny", "--device", "cpu", "--num-blocks", "64", "--out",
                 str(tmp_path), "--num-requests", "4", "--concurrency", "4", "--input-len", "16", "--max-tokens",
                 "3", "--ignore-eos"]) == 0
    paths = glob.glob(str(tmp_path / "serve-*.json"))
    assert len(paths) == 1
    doc = json.loads(open(paths[0]).read())
    assert doc["op"] == "serve" and "ceilings" not in doc  # `dsa bench render` skips it
    assert doc["server"]["started"] is True and doc["server"]["ready_s"] > 0
    assert doc["server"]["model"] == "dsa-tiny"
    _check_rows(doc, 4)


def _args(**given):
    args = argparse.Namespace(url=None, preset=None, checkpoint=None, tokenizer=None, num_requests=8, concurrency=8,
                              request_rate=float("inf"), concurrency_range=None, input_len=32, input_len_range=None,
                              max_tokens=4, max_tokens_range=None, ignore_eos=False, dataset=None, shared_prefix=None,
                              seed=0)
    for k, v in given.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("given, words", [
    (dict(input_len_range=[5, 2]), "--input-len-range"),
    (dict(concurrency=0), "--concurrency"),
    (dict(request_rate=0.0), "--request-rate"),
    (dict(url="http://127.0.0.1:1", preset="tiny"), "--url"),
    (dict(shared_prefix=4, concurrency_range=[1, 2]), "--shared-prefix"),
    (dict(dataset="/nonexistent/corpus.txt"), "--dataset"),
    (dict(request_rate=2.0, concurrency_range=[1, 2]), "--request-rate"),
])
def test_bad_arguments_get_one_line_errors(given, words):
    with pytest.raises(SystemExit) as e:
        check_args(_args(**given))
    message = str(e.value)
    assert words in message and "\n" not in message


def test_a_dataset_shorter_than_a_prompt_is_one_line_before_any_server(tmp_path, monkeypatch):
    import dsa.bench.serve
    monkeypatch.setattr(dsa.bench.serve, "StartedServer", lambda args: pytest.fail("started a server"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("too short")
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--preset", "tiny", "--device", "cpu", "--dataset", str(corpus), "--input-len", "64",
              "--json", str(tmp_path / "serve.json")])
    assert e.value.code == (f"dsa bench serve: --dataset: {corpus} has 9 tokens, fewer than the prompt length 64"), \
        e.value.code
    assert not (tmp_path / "serve.json").exists()


def test_plans_are_seeded_and_share_no_prefix_unless_asked():
    tok = load_tokenizer(_args())
    a, b = build_plan(_args(seed=1), tok), build_plan(_args(seed=1), tok)
    assert a == b and build_plan(_args(seed=2), tok) != a
    assert all(len(p["prompt"]) == 32 for p in a)
    heads = {tuple(p["prompt"][:16]) for p in a}  # no two share a 16-token block (the tiny preset's block)
    assert len(heads) == len(a)
    shared = build_plan(_args(shared_prefix=4), tok)
    assert all(p["prompt"][:32] == shared[0]["prompt"][:32] for p in shared[:4])
    assert shared[4]["prompt"][:32] != shared[0]["prompt"][:32]
    assert len({tuple(p["prompt"]) for p in shared}) == 8


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.lines()[2:] == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1"} 3',
                             'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 2.650000", "x_seconds_count 4"]


def test_serve_refuses_a_preset_and_a_checkpoint():
    with pytest.raises(SystemExit, match="--preset: give --checkpoint or --preset, not both"):
        main(["serve", "--preset", "tiny", "--checkpoint", "some/folder", "--device", "cpu"])


@pytest.mark.slow
def test_a_soak_of_500_requests_loses_and_leaks_nothing(tmp_path, monkeypatch):
    """~500 requests at concurrency 32 against a pool that holds a few of them: streamed, plain,
    chats, client drops, bad requests, stop strings, large max_tokens. Every request ends with
    tokens and a finish reason, a clean 4xx or the client's drop; no request or block is held
    after; memory stays within the bound; requests were preempted on the way."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("DSA_API_KEY", raising=False)
    path = tmp_path / "soak.json"
    rc = main(["bench", "serve", "--preset", "tiny", "--device", "cpu", "--num-blocks", "48", "--soak",
               "--num-requests", "500", "--concurrency", "32", "--input-len-range", "4", "60", "--max-tokens-range",
               "1", "16", "--json", str(path)])
    s = json.loads(path.read_text())["summary"]
    assert rc == 0 and s["ok"], s
    assert s["requests"] == 500 and s["lost"] == 0 and s["leak_free"] and s["memory_flat"]
    assert all(s["by_kind"][k].get("ok", 0) > 0 for k in ("stream", "plain", "chat", "chat_stream", "stop", "long"))
    assert s["by_kind"]["bad"].get("clean_error", 0) == sum(s["by_kind"]["bad"].values()) > 0
    assert s["by_kind"]["disconnect"].get("dropped", 0) > 0 and s["preemptions"] > 0


class _Chunks:
    """A response whose text arrives one character at a time."""

    def __init__(self, text):
        self.text = text

    async def aiter_text(self):
        for ch in self.text:
            yield ch


async def _collect(response) -> list:
    return [d async for d in sse_data(response)]


@pytest.mark.parametrize("text", ["a\u2028b", "x\x85y", "\u2029", "\u00e9\r\nz\x1c"],
                         ids=["line-separator", "next-line", "paragraph-separator", "crlf-and-file-separator"])
def test_a_streamed_text_holding_unicode_line_ends_is_one_event(text):
    """The H200 soak lost 2 of 1,128 chat streams to this: U+2028 and the like, raw in the server's JSON,
    split an event for httpx's aiter_lines (str.splitlines)."""
    from dsa.serve.openai_server import _sse
    event = _sse({"choices": [{"text": text}]})
    first = event.splitlines()[0]  # what aiter_lines yields first
    assert json.loads(first[6:])["choices"][0]["text"] == text, f"the event split: {event!r}"
    raw = f"data: {json.dumps({'choices': [{'text': text}]}, ensure_ascii=False)}\n\n"  # another server's
    got = asyncio.run(_collect(_Chunks(event + raw + "data: [DONE]\n\n")))
    assert [json.loads(d)["choices"][0]["text"] for d in got[:2]] == [text, text] and got[2] == "[DONE]", got
