"""``dsa bench serve --soak``: a seeded mix of traffic against a server, then checks by counts that
nothing was lost and nothing leaked.

The mix (each request draws one kind): streamed and plain completions, streamed and plain chats,
streams the client drops after a few chunks, bad requests (negative ``max_tokens``, an unknown
model, malformed JSON), stop strings, and large ``max_tokens``; requests come in bursts of up to
twice ``--concurrency`` at once (above what the pool holds when the server was started small, so
requests wait and are preempted). Afterwards:

- every request got tokens and a finish reason, or a clean error (an HTTP 4xx with a message), or
  was dropped by the client on purpose: ``lost`` counts the rest (timeouts, broken streams, 5xx);
- once the server is idle: no running or waiting request and no cache block held
  (``leaked``: ``dsa_requests_running``, ``dsa_requests_waiting``, ``dsa_cache_blocks_in_use``);
- the server's resident memory and GPU memory (``process_resident_memory_bytes``,
  ``dsa_gpu_memory_allocated_bytes``) at the end against the half-way point: growth within
  ``MEMORY_BOUND`` (``memory_flat``).
"""
import asyncio
import json
import random
import time

import httpx
from tqdm import tqdm

from dsa.bench.serve import KEEPALIVE_S, words

KINDS = ("stream", "plain", "chat", "chat_stream", "disconnect", "bad", "stop", "long")
WEIGHTS = (4, 2, 2, 2, 1, 1, 1, 1)
MEMORY_BOUND = 64 << 20  # bytes of growth from the half-way point to the end (host and GPU each)
GAUGES = ("dsa_requests_running", "dsa_requests_waiting", "dsa_cache_blocks_in_use", "process_resident_memory_bytes",
          "dsa_gpu_memory_allocated_bytes")


def soak_plan(args, tok) -> list:
    """``[{"kind", "prompt", "max_tokens", "burst"}]``, seeded by ``--seed``."""
    rng = random.Random(args.seed)
    plan, burst, left = [], 0, 0
    for i in range(args.num_requests):
        if left == 0:
            burst, left = burst + 1, rng.randint(1, 2 * args.concurrency)
        left -= 1
        kind = rng.choices(KINDS, WEIGHTS)[0]
        n = rng.randint(*args.input_len_range) if args.input_len_range else args.input_len
        m = rng.randint(*args.max_tokens_range) if args.max_tokens_range else args.max_tokens
        plan.append({"kind": kind, "prompt": words(tok, rng, n, f"{i}. "), "text": f"{i}. tell me about the sea",
                     "max_tokens": 4 * m if kind == "long" else m, "burst": burst,
                     "cut": rng.randint(1, 3), "bad": rng.choice(("negative", "model", "json"))})
    return plan


def gauges(client, url: str) -> dict:
    values = {}
    for line in client.get(url + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES or name == "dsa_preemptions_total":
            values[name] = float(value)
    return values


async def soak_one(client, url: str, model: str, item: dict) -> dict:
    """One request of the mix; ``outcome``: ok, clean_error, dropped (by the client) or lost."""
    kind = item["kind"]
    row = {"kind": kind, "outcome": "lost", "detail": None, "tokens": 0}
    chat = kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": item["max_tokens"], "temperature": 0.0,
            "stream": kind in ("stream", "chat_stream", "disconnect", "stop", "long")}
    if chat:
        body["messages"] = [{"role": "user", "content": item["text"]}]
    else:
        body["prompt"] = item["prompt"]
    if kind == "stop":
        body["stop"] = ["e", " the"]
    content = None
    if kind == "bad":
        if item["bad"] == "negative":
            body["max_tokens"] = -1
        elif item["bad"] == "model":
            body["model"] = "no-such-model"
        else:
            content = b'{"model": "x", "prompt": [1, 2'
    try:
        if not body["stream"]:
            r = await client.post(url + path, json=body) if content is None else \
                await client.post(url + path, content=content, headers={"Content-Type": "application/json"})
            if 400 <= r.status_code < 500 and r.json().get("error", {}).get("message"):
                row["outcome"], row["detail"] = "clean_error", r.status_code
            elif r.status_code == 200:
                choice = r.json()["choices"][0]
                row["tokens"] = r.json()["usage"]["completion_tokens"]
                row["outcome"] = "ok" if choice.get("finish_reason") in ("stop", "length") else "lost"
                row["detail"] = choice.get("finish_reason")
            else:
                row["detail"] = f"HTTP {r.status_code}"
            return row
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                row["outcome"] = "clean_error" if 400 <= r.status_code < 500 else "lost"
                row["detail"] = r.status_code
                return row
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if kind == "disconnect" and chunks >= item["cut"]:
                    row["outcome"] = "dropped"
                    return row  # leaving the block closes the connection mid-stream
                for choice in json.loads(line[6:]).get("choices", []):
                    row["tokens"] += 1 if (choice.get("text") or choice.get("delta", {}).get("content")) else 0
                    if choice.get("finish_reason") in ("stop", "length"):
                        row["outcome"], row["detail"] = "ok", choice["finish_reason"]
            if kind == "disconnect" and row["outcome"] == "ok":
                row["outcome"] = "dropped"  # it ended before the client dropped it
    except Exception as e:  # noqa: BLE001 - a broken request is a result
        row["outcome"], row["detail"] = "lost", f"{type(e).__name__}: {e}"[:200]
    return row


async def soak_run(url: str, api_key, model: str, plan: list, args) -> tuple:
    """Send the plan burst by burst; returns (rows, the gauges at each quarter of the plan: the
    half-way ones are the memory baseline)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rows, marks = [None] * len(plan), []
    bursts = {}
    for i, item in enumerate(plan):
        bursts.setdefault(item["burst"], []).append(i)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(headers=headers, timeout=args.request_timeout, limits=limits) as client:
        bar = tqdm(total=len(plan), desc="dsa bench serve --soak", unit="req")

        async def one(i):
            rows[i] = await soak_one(client, url, model, plan[i])
            bar.update(1)
        for ids in bursts.values():
            await asyncio.gather(*(one(i) for i in ids))
            if len(marks) < 3 and ids[-1] >= (len(marks) + 1) * len(plan) // 4:
                marks.append(await asyncio.to_thread(settled_gauges, url, api_key))
        bar.close()
    return rows, marks


def settled_gauges(url: str, api_key, timeout: float = 600.0) -> dict:
    """The gauges once no request runs or waits (dropped streams are aborted asynchronously); a
    generous bound, so a slow machine is waited for rather than reported as leaking."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    with httpx.Client(headers=headers, timeout=30.0) as client:
        while True:
            g = gauges(client, url)
            idle = g.get("dsa_requests_running", 0) == 0 and g.get("dsa_requests_waiting", 0) == 0
            if idle or time.monotonic() > deadline:
                return g
            time.sleep(0.1)


def soak_summary(rows: list, marks: list, end: dict) -> dict:
    """Counts by kind and outcome, what is held after, and memory: growth from the half-way point
    to the end against :data:`MEMORY_BOUND` (``memory_trace``: resident and GPU bytes at each quarter)."""
    half = marks[min(1, len(marks) - 1)] if marks else {}
    counts = {k: {} for k in KINDS}
    for r in rows:
        counts[r["kind"]][r["outcome"]] = counts[r["kind"]].get(r["outcome"], 0) + 1
    lost = [r for r in rows if r["outcome"] == "lost"]
    growth = {name: end.get(name, 0) - half.get(name, 0) for name in GAUGES[3:] if name in end}
    leaked = {name: end.get(name, 0) for name in GAUGES[:3]}
    return {"requests": len(rows), "by_kind": counts, "preemptions": end.get("dsa_preemptions_total"), "lost": len(lost), "lost_details": [r["detail"] for r in lost][:10],
            "leaked": leaked, "leak_free": not any(leaked.values()), "memory_half": half, "memory_end": end,
            "memory_growth_bytes": growth, "memory_bound_bytes": MEMORY_BOUND,
            "memory_trace": [{k: m.get(k) for k in GAUGES[3:]} for m in [*marks, end]],
            "memory_flat": all(v <= MEMORY_BOUND for v in growth.values()),
            "ok": not lost and not any(leaked.values()) and all(v <= MEMORY_BOUND for v in growth.values())}
