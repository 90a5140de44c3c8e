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
  ``MEMORY_BOUND`` (``memory_flat``);
- the resident memory's slope: the gauges are read at ``SAMPLES`` points of the plan (each once the
  server is idle), and a line fitted to the second half's gives bytes per request
  (``rss_slope_bytes_per_request``); the first point where the prefix cache has evicted marks the pool
  full (``pool_full_at``: until then cached prefixes grow the host's bookkeeping by design, ~240 B per
  block, so a slope fitted after it, ``rss_slope_after_full``, is the leak's). ``plot_memory`` draws it.
"""
import asyncio
import json
import os
import random
import time

import httpx
import numpy as np
from tqdm import tqdm

from dsa.bench.serve import KEEPALIVE_S, sse_data, words
from dsa.report import save_figure

KINDS = ("stream", "plain", "chat", "chat_stream", "disconnect", "bad", "stop", "long")
WEIGHTS = (4, 2, 2, 2, 1, 1, 1, 1)
MEMORY_BOUND = 64 << 20  # bytes of growth from the half-way point to the end (host and GPU each)
GAUGES = ("dsa_requests_running", "dsa_requests_waiting", "dsa_cache_blocks_in_use", "process_resident_memory_bytes",
          "dsa_gpu_memory_allocated_bytes")
SAMPLES = 24  # points of the plan where the gauges are read (the memory slope's)
EXTRA = ("dsa_preemptions_total", "dsa_prefix_cache_evictions_total", "dsa_cache_blocks_cached",
         'dsa_gc_collections_total{generation="2"}', 'dsa_gc_pause_seconds_max{generation="2"}',
         'dsa_gc_pause_seconds_max{generation="0"}', 'dsa_gc_pause_seconds_max{generation="1"}')


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
        if name in GAUGES or name in EXTRA or name.startswith(("dsa_host_structure_entries", "dsa_resident_memory")):
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
            async for data in sse_data(r):
                if data == "[DONE]":
                    continue
                chunks += 1
                if kind == "disconnect" and chunks >= item["cut"]:
                    row["outcome"] = "dropped"
                    return row  # leaving the block closes the connection mid-stream
                for choice in json.loads(data).get("choices", []):
                    row["tokens"] += 1 if (choice.get("text") or choice.get("delta", {}).get("content")) else 0
                    if choice.get("finish_reason") in ("stop", "length"):
                        row["outcome"], row["detail"] = "ok", choice["finish_reason"]
            if kind == "disconnect" and row["outcome"] == "ok":
                row["outcome"] = "dropped"  # it ended before the client dropped it
    except Exception as e:  # noqa: BLE001 - a broken request is a result
        row["outcome"], row["detail"] = "lost", f"{type(e).__name__}: {e}"[:200]
    return row


async def soak_run(url: str, api_key, model: str, plan: list, args) -> tuple:
    """Send the plan burst by burst; returns (rows, the gauges at ``SAMPLES`` points of the plan, each
    with ``requests``: how many had been sent)."""
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
            if len(marks) < SAMPLES - 1 and ids[-1] + 1 >= (len(marks) + 1) * len(plan) // SAMPLES:
                marks.append({**await asyncio.to_thread(settled_gauges, url, api_key), "requests": ids[-1] + 1})
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
    to the end against :data:`MEMORY_BOUND`, the resident memory's slope (module docstring) and
    ``memory_trace``: the gauges at each sample and the end."""
    end = {**end, "requests": len(rows)}
    samples = [*marks, end]
    half = min(marks, key=lambda m: abs(m["requests"] - len(rows) / 2)) if marks else {}
    counts = {k: {} for k in KINDS}
    for r in rows:
        counts[r["kind"]][r["outcome"]] = counts[r["kind"]].get(r["outcome"], 0) + 1
    lost = [r for r in rows if r["outcome"] == "lost"]
    growth = {name: end.get(name, 0) - half.get(name, 0) for name in GAUGES[3:] if name in end}
    leaked = {name: end.get(name, 0) for name in GAUGES[:3]}
    full = next((m["requests"] for m in samples if m.get("dsa_prefix_cache_evictions_total", 0) > 0), None)
    rss = "process_resident_memory_bytes"
    gc_pause = max((end.get(f'dsa_gc_pause_seconds_max{{generation="{g}"}}', 0.0) for g in range(3)), default=0.0)
    return {"requests": len(rows), "by_kind": counts, "preemptions": end.get("dsa_preemptions_total"),
            "lost": len(lost), "lost_details": [r["detail"] for r in lost][:10],
            "leaked": leaked, "leak_free": not any(leaked.values()), "memory_half": half, "memory_end": end,
            "memory_growth_bytes": growth, "memory_bound_bytes": MEMORY_BOUND, "memory_trace": samples,
            "rss_slope_bytes_per_request": slope(samples, rss, len(rows) / 2),
            "pool_full_at": full, "rss_slope_after_full": None if full is None else slope(samples, rss, full),
            "gc_gen2_collections": end.get('dsa_gc_collections_total{generation="2"}'), "gc_longest_pause_s": gc_pause,
            "memory_flat": all(v <= MEMORY_BOUND for v in growth.values()),
            "ok": not lost and not any(leaked.values()) and all(v <= MEMORY_BOUND for v in growth.values())}


def slope(samples: list, gauge: str, start: float) -> float | None:
    """Bytes per request of ``gauge`` by a least-squares line through the samples from ``start``
    requests on; None with fewer than 3 of them."""
    points = [(m["requests"], m[gauge]) for m in samples if m["requests"] >= start and m.get(gauge) is not None]
    if len(points) < 3:
        return None
    x, y = np.array(points, dtype=np.float64).T
    return float(np.polyfit(x, y, 1)[0])


def plot_memory(summary: dict, path: str) -> str:
    """The resident memory against requests sent, the lines fitted over the second half and after the
    pool-full point, and that point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    samples = [m for m in summary["memory_trace"] if m.get("process_resident_memory_bytes") is not None]
    x = [m["requests"] for m in samples]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [m["process_resident_memory_bytes"] / 2**20 for m in samples], "o-", label="resident memory")
    fits = [(summary["requests"] / 2, summary["rss_slope_bytes_per_request"], "--", "fit over the second half"),
            (summary["pool_full_at"], summary["rss_slope_after_full"], "-.", "fit after the pool is full")]
    for start, k, style, name in fits:
        tail = [m for m in samples if start is not None and m["requests"] >= start]
        if k is None or len(tail) < 3:
            continue
        b = np.mean([m["process_resident_memory_bytes"] for m in tail]) - k * np.mean([m["requests"] for m in tail])
        xs = np.array([tail[0]["requests"], tail[-1]["requests"]])
        ax.plot(xs, (b + k * xs) / 2**20, style, label=f"{name}: {k:,.0f} B/request")
    if summary["pool_full_at"] is not None:
        ax.axvline(summary["pool_full_at"], color="gray", linestyle=":", label="prefix cache evicts (pool full)")
    ax.set_xlabel("requests sent")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("dsa serve: resident memory during the soak")
    ax.legend()
    return save_figure(fig, os.path.dirname(path) or ".", os.path.basename(path))
