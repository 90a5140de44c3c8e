"""The load generator of ``dsa bench serve`` (in the spirit of ``vllm bench serve``): prompts, the
started server, the requests and their statistics; the command (options, run, report) is
:mod:`dsa.commands.bench_serve`, the soak mix :mod:`dsa.bench.soak`.

It starts ``dsa serve`` in a subprocess on a free loopback port (``--preset``, ``--checkpoint``,
``--device``, ``--max-batch-tokens``, ``--num-blocks``, ``--max-model-len`` pass through) and times
it to a healthy ``/health``, or targets a running server (``--url``). Then it streams ``/v1/completions``
requests: prompts are token ids (exact lengths), random words from a fixed word list (seeded; each
prompt starts with its own number, so no two share a cached block), spans of ``--dataset FILE``, or
with ``--shared-prefix N`` groups of N questions on one document. Requests go out with at most
``--concurrency`` in flight, at Poisson arrivals (``--request-rate``), or in bursts of
``--concurrency-range A B`` requests; ``--input-len-range`` and ``--max-tokens-range`` draw each
request's lengths uniformly.

Per request: TTFT (to the first chunk carrying text or a finish), ITL (between such chunks), TPOT
((end-to-end - TTFT) / (output tokens - 1)) and end-to-end latency. Output tokens are the stream's
``usage`` (``stream_options.include_usage``), else its chunks. Kernel compiles after ready: the
server's ``dsa_kernel_compiles_total`` before and after the run (null when it does not export it).
"""
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from tqdm import tqdm

from dsa.errors import DSAError
from dsa.serve.tokenizer import ByteTokenizer, Tokenizer

# a fixed word list: prompts are seeded draws from it
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education "
         "foot boy age policy music market sense nation plan college interest death experience effect class control "
         "care field development role effort rate heart drug show leader light voice wife police mind price report "
         "decision son view relationship town road arm difference value building action model season society tax "
         "director position player record paper space ground form event official matter center couple site project "
         "activity star table need court oil situation cost industry figure street image phone data picture").split()
COMPILES = "dsa_kernel_compiles_total"
# An idle connection is dropped by the client before uvicorn's 5 s keep-alive timeout closes it: a
# request sent on a connection the server is closing fails with a ReadError (one did, in a soak).
KEEPALIVE_S = 2.0


# ---- prompts --------------------------------------------------------------------------------
def load_tokenizer(args):
    """``--tokenizer``, else the checkpoint's tokenizer.json, else the byte-level tokenizer."""
    folder = args.tokenizer or (args.checkpoint if args.checkpoint and
                                os.path.exists(os.path.join(args.checkpoint, "tokenizer.json")) else None)
    return Tokenizer.from_pretrained(folder) if folder else ByteTokenizer()


def words(tok, rng: random.Random, n: int, head: str = "", special: bool = True) -> list:
    """``n`` token ids of ``head`` then random words."""
    count = n
    while True:
        ids = tok.encode(head + " ".join(rng.choice(WORDS) for _ in range(count)), add_special_tokens=special)
        if len(ids) >= n:
            return ids[:n]
        count *= 2


def build_plan(args, tok) -> list:
    """``[{"prompt": ids, "max_tokens": n, "burst": k}]``: ``burst`` groups requests sent at once (None: the
    --concurrency / --request-rate schedule)."""
    rng = random.Random(args.seed)
    n = args.num_requests
    input_lens = [rng.randint(*args.input_len_range) if args.input_len_range else args.input_len for _ in range(n)]
    max_tokens = [rng.randint(*args.max_tokens_range) if args.max_tokens_range else args.max_tokens for _ in range(n)]
    if args.shared_prefix:
        plan, doc = [], None
        for i in range(n):
            group = i // args.shared_prefix
            if i % args.shared_prefix == 0:
                doc = words(tok, rng, args.input_len, f"Document {group}: ")
            question = words(tok, rng, 16, f"\nQuestion {i % args.shared_prefix}: ", special=False) + \
                tok.encode("?", add_special_tokens=False)
            plan.append({"prompt": doc + question, "max_tokens": max_tokens[i], "burst": group})
        return plan
    if args.dataset:
        with open(args.dataset, encoding="utf-8", errors="replace") as f:
            corpus = tok.encode(f.read(), add_special_tokens=False)
        bos = [] if getattr(tok, "bos_token_id", None) is None else [tok.bos_token_id]
        if len(corpus) + len(bos) < max(input_lens):
            raise DSAError(f"dsa bench serve: --dataset: {args.dataset} has {len(corpus)} tokens, fewer than the "
                             f"prompt length {max(input_lens)}")
        prompts = []
        for length in input_lens:
            start = rng.randrange(len(corpus) - (length - len(bos)) + 1)
            prompts.append(bos + corpus[start:start + length - len(bos)])
    else:
        prompts = [words(tok, rng, length, f"{i}. ") for i, length in enumerate(input_lens)]
    bursts = [None] * n
    if args.concurrency_range:
        i, burst = 0, 0
        while i < n:
            size = rng.randint(*args.concurrency_range)
            bursts[i:i + size] = [burst] * len(bursts[i:i + size])
            i, burst = i + size, burst + 1
    return [{"prompt": p, "max_tokens": m, "burst": b} for p, m, b in zip(prompts, max_tokens, bursts)]


# ---- the server -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartedServer:
    """``dsa serve`` in a subprocess on a free loopback port; its output in a log file."""

    def __init__(self, args):
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "dsa", "serve", "--port", str(port), "--max-batch-tokens",
               str(args.max_batch_tokens)]
        for flag in ("preset", "checkpoint", "device", "dtype", "num_blocks", "max_model_len"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dsa-bench-serve-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = t0 + args.ready_timeout
        while True:
            if self.proc.poll() is not None:
                self.fail(f"the server exited with code {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                self.fail(f"--ready-timeout: the server did not answer /health within {args.ready_timeout:g} s")
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - t0

    def tail(self, lines: int = 20) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    def fail(self, message: str):
        raise DSAError(f"dsa bench serve: {message}; the end of its log ({self.log.name}):\n{self.tail()}")

    def stop(self, keep_log: bool = True) -> None:
        """End the server (SIGTERM, then SIGKILL after 60 s); the log stays unless ``keep_log`` is false."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep_log:
            os.remove(self.log.name)


async def sse_data(response):
    """The ``data:`` payloads of a server-sent event stream, lines split at ``\\n`` only, as the SSE
    format says (httpx's ``aiter_lines`` also splits at U+2028, U+0085 and the like, which a JSON
    string may hold raw)."""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            if line.startswith("data: "):
                yield line[6:].rstrip("\r")
    if rest.startswith("data: "):
        yield rest[6:].rstrip("\r")


def read_compiles(client, url: str):
    """The sum of ``dsa_kernel_compiles_total`` samples in ``/metrics``; None when absent."""
    try:
        text = client.get(url + "/metrics").text
    except Exception:  # noqa: BLE001 - the metric is optional
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(COMPILES) and line[len(COMPILES):len(COMPILES) + 1] in (" ", "{")]
    return sum(values) if values else None


# ---- requests -------------------------------------------------------------------------------
async def send(client, url: str, model: str, item: dict, ignore_eos: bool) -> dict:
    """One streamed completion: its timings and counts (``error`` set when it failed)."""
    body = {"model": model, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    row = {"input_tokens": len(item["prompt"]), "max_tokens": item["max_tokens"], "output_tokens": 0, "chunks": 0,
           "ttft_s": None, "e2e_s": None, "itl_s": [], "finish_reason": None, "usage": None, "error": None}
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                row["error"] = f"HTTP {r.status_code}: {text}"[:300]
                return row
            async for data in sse_data(r):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    row["error"] = str(chunk["error"].get("message"))[:300]
                    return row
                if chunk.get("usage"):
                    row["usage"] = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if not choice.get("text") and choice.get("finish_reason") is None:
                        continue
                    now = time.perf_counter()
                    if row["ttft_s"] is None:
                        row["ttft_s"] = now - t0
                    else:
                        row["itl_s"].append(now - last)
                    last = now
                    row["chunks"] += 1
                    row["finish_reason"] = choice.get("finish_reason") or row["finish_reason"]
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        row["error"] = f"{type(e).__name__}: {e}"[:300]
        return row
    row["e2e_s"] = last - t0
    if row["finish_reason"] is None:
        row["error"] = "the stream ended without a finish_reason"
    usage = row["usage"]
    row["output_tokens"] = usage["completion_tokens"] if usage else row["chunks"]
    if usage:
        row["input_tokens"] = usage["prompt_tokens"]
    return row


async def run_plan(url: str, api_key, model: str, plan: list, args) -> tuple:
    """Send the plan; returns (rows in plan order, seconds from the first send to the last finish)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S)
    rows = [None] * len(plan)
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(headers=headers, timeout=args.request_timeout, limits=limits) as client:
        bar = tqdm(total=len(plan), desc="dsa bench serve", unit="req")

        async def one(i):
            rows[i] = await send(client, url, model, plan[i], args.ignore_eos)
            bar.update(1)

        t0 = time.perf_counter()
        if plan[0]["burst"] is not None:  # bursts: each sent at once, after the last finished
            bursts = {}
            for i, item in enumerate(plan):
                bursts.setdefault(item["burst"], []).append(i)
            for ids in bursts.values():
                await asyncio.gather(*(one(i) for i in ids))
        else:
            slots, tasks = asyncio.Semaphore(args.concurrency), []

            async def held(i):
                try:
                    await one(i)
                finally:
                    slots.release()
            for i in range(len(plan)):
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
                await slots.acquire()
                tasks.append(asyncio.create_task(held(i)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return rows, duration


# ---- the report -----------------------------------------------------------------------------
def stats(values: list) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def summarize(rows: list, duration: float, args) -> dict:
    done = [r for r in rows if r["error"] is None]
    output = sum(r["output_tokens"] for r in done)
    total = output + sum(r["input_tokens"] for r in done)
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in done if r["output_tokens"] > 1]
    errors = sorted({r["error"] for r in rows if r["error"] is not None})
    return {
        "requests": len(rows), "completed": len(done), "failed": len(rows) - len(done), "errors": errors[:5],
        "duration_s": duration, "requests_per_s": len(done) / duration if duration else None,
        "input_tokens": total - output, "output_tokens": output,
        "output_tokens_per_s": output / duration if duration else None,
        "total_tokens_per_s": total / duration if duration else None,
        "tokens_from": "usage" if done and all(r["usage"] for r in done) else "chunks",
        "short_outputs": sum(r["output_tokens"] < r["max_tokens"] for r in done) if args.ignore_eos else None,
        "ttft_s": stats([r["ttft_s"] for r in done]), "tpot_s": stats(tpot),
        "itl_s": stats([x for r in done for x in r["itl_s"]]), "e2e_s": stats([r["e2e_s"] for r in done]),
    }
