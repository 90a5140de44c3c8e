"""``dsa bench long``: one long prompt per length through the Engine, on a random-weight preset.

For each ``--lengths`` entry (default 128K, 256K, 512K and 1M tokens) one request of that many
random token ids is prefilled in chunks of ``--max-batch-tokens`` rows and then decodes
``--new-tokens`` tokens (greedy, ``ignore_eos``), on an engine whose ``max_model_len`` is the
longest length plus the new tokens (``--max-model-len`` to give another), its pool that one
request, warmed up first on CUDA (every kernel compiled, the decode graphs of one row captured for
every context bucket: nothing compiles or captures while a request is timed). A row:

- ``ttft_s``: queuing the request to its first token on the host; ``prefill_tokens_per_s`` = the
  prompt over it;
- ``indexer_s``: the device time of the indexer modules in the prefill steps (CUDA events around
  each call: projections, key writes, logits and top-k; on CPU the wall clock), ``indexer_flops``
  the logits' useful FLOPs (``2 x index_n_heads x index_head_dim`` per query-key pair, each sparse
  row ``p >= index_topk`` against its ``p + 1`` keys, every indexer layer), ``indexer_tflops``
  their rate over ``indexer_s`` and ``indexer_frac_fp8`` that rate over the same-run FP8 ceiling
  (:func:`dsa.bench.harness.measure_ceilings`); ``indexer_floor_s``: the FLOPs at the ceiling;
- ``decode_tokens_per_s``: the tokens after the first over the time from the first to the last
  (graph replays on CUDA, ``graph_steps``);
- ``peak_allocated_bytes`` (CUDA): the most allocated during the request, the pool included
  (``cache_bytes``);
- ``chunks``: ``[first position, rows, ms]`` of each prefill step (the engine's
  :attr:`~dsa.engine.engine.EngineStats.prefill_steps`): a long prompt's cost by position, to
  choose ``--max-batch-tokens`` by;
- ``ragged_logits_kernel``: the kernel that scores the prefill rows (``hopper``: the Gluon kernel on
  sm_90, ``triton``: the portable one, ``torch`` on CPU).

``dense`` rows run the same weights without the indexer (dense attention over the whole context)
for the lengths up to ``--dense-up-to`` (default 128K). The figure (``<result>.png``): time to
first token against prompt length with the indexer's floor, and each chunk's milliseconds per 1K
rows against its position.
"""
import time

import torch

from dsa.config import bytes_per_token, indexer_layers
from dsa.engine import Engine, SamplingParams
from dsa.engine.runner import decode_graph_estimate
from dsa.kernels import indexer_logits_ragged_hopper as ragged_hopper
from dsa.kernels.common import cdiv
from dsa.model.presets import preset_model

from .engine import without_indexer
from .harness import result_row
from .targets import LONG_TTFT_S

DEFAULT_LENGTHS = (131072, 262144, 524288, 1048576)


def parse_lengths(text: str) -> list:
    """``"131072,262144"`` -> ``[131072, 262144]``; ValueError naming ``--lengths`` otherwise."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths: expected comma-separated positive token counts, got {text!r}")
    return lengths


def indexer_flops(config, length: int) -> int:
    """The useful FLOPs of a ``length``-token prefill's indexer logits over every indexer layer."""
    k = config.index_topk
    if k is None or length <= k:
        return 0
    pairs = length * (length + 1) // 2 - k * (k + 1) // 2  # row p >= k sees p + 1 keys
    return 2 * config.index_n_heads * config.index_head_dim * pairs * len(indexer_layers(config))


class IndexerClock:
    """Times every indexer call of a prefill step (one with prefill rows) while installed: CUDA
    events on the stream (no sync until :meth:`seconds`), the wall clock on CPU."""

    def __init__(self, model):
        self.cuda = model.device.type == "cuda"
        self.spans, self._open = [], None
        self.handles = []
        for layer in model.layers:
            indexer = layer.self_attn.indexer
            if indexer is not None:
                self.handles.append(indexer.register_forward_pre_hook(self._before))
                self.handles.append(indexer.register_forward_hook(self._after))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _before(self, module, args):
        self._open = self._mark() if args[2].prefill else None  # args: x, qr, batch, cache, rot

    def _after(self, module, args, output):
        if self._open is not None:
            self.spans.append((self._open, self._mark()))
            self._open = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        return sum(b - a for a, b in self.spans)


def long_engine(model, max_model_len: int, chunk: int, say) -> tuple:
    """``(engine, warm-up report)``: one request of up to ``max_model_len`` tokens, chunks of
    ``chunk`` rows; warmed up on CUDA (None elsewhere)."""
    p = model.config.block_size
    engine = Engine(model, num_blocks=cdiv(max_model_len, p), max_batch_tokens=chunk, max_num_seqs=1,
                    prefix_caching=False, max_model_len=max_model_len)
    if model.device.type != "cuda":  # no warm-up there (its prefill shapes go to max_batch_tokens): one short
        k = model.config.index_topk or 1  # request through the sparse and the decode paths instead
        engine.generate([[0] * min(max_model_len - 2, 2 * k + 1)], 2)
        return engine, None
    report = engine.warmup(progress=False)
    report["estimate"] = decode_graph_estimate(model.config, min(max_model_len, engine.capacity_tokens), 1)
    say(f"warm-up ({max_model_len} tokens): {report['seconds']} s, {report['graphs_captured']} CUDA graphs "
        f"({report['graph_pool_bytes'] / 2**20:.0f} MiB), {report['prefill_steps']} prefill shapes", flush=True)
    return engine, report


def one_request(engine, length: int, new_tokens: int, seed: int = 0) -> dict:
    """Prefill and decode one request of ``length`` random ids; what it measured."""
    model, cuda = engine.model, engine.model.device.type == "cuda"
    prompt = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(model.device)
    graph_steps, clock, stamps = engine.stats.graph_steps, IndexerClock(model), []
    t0 = time.perf_counter()
    try:
        for delta in engine.stream([prompt.tolist()], sampling=sampling):
            if not stamps:
                clock.remove()  # the prefill is over
                rid = delta.request_id
            stamps += [time.perf_counter()] * len(delta.token_ids)
    finally:
        clock.remove()
    if cuda:
        torch.cuda.synchronize()
    steps = [s for s in engine.stats.prefill_steps if any(c[0] == rid for c in s.chunks)]
    decode_s = stamps[-1] - stamps[0]
    return {"ttft_s": stamps[0] - t0, "decode_s": decode_s, "tokens": len(stamps),
            "decode_tokens_per_s": (len(stamps) - 1) / decode_s if len(stamps) > 1 and decode_s > 0 else None,
            "graph_steps": engine.stats.graph_steps - graph_steps, "indexer_s": clock.seconds(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(model.device) if cuda else None,
            "chunks": [[c[1], c[2], round(s.ms, 3)] for s in steps for c in s.chunks if c[0] == rid]}


def long_row(impl: str, engine, length: int, new_tokens: int, ceilings: dict, warm) -> dict:
    m, c = one_request(engine, length, new_tokens), engine.model.config
    flops = indexer_flops(c, length)
    fp8 = ceilings.get("fp8_tflops")
    rate = flops / m["indexer_s"] / 1e12 if flops and m["indexer_s"] else None
    cache = bytes_per_token(c, engine.model.dtype) * engine.capacity_tokens
    shape = dict(L=length, chunk=engine.max_batch_tokens, layers=c.num_hidden_layers, new_tokens=new_tokens)
    target = LONG_TTFT_S.get(length) if impl == "dsa" and c.hidden_size == 7168 else None
    return result_row("long_prefill", impl, shape, dict(median_us=m["ttft_s"] * 1e6, reps=1), ceilings,
                      target_us=None if target is None else target * 1e6, ttft_s=m["ttft_s"],
                      prefill_tokens_per_s=length / m["ttft_s"], indexer_s=m["indexer_s"], indexer_flops=flops,
                      indexer_tflops=rate, indexer_frac_fp8=None if rate is None or not fp8 else rate / fp8,
                      indexer_floor_s=flops / (fp8 * 1e12) if fp8 else None,
                      indexer_share_of_ttft=m["indexer_s"] / m["ttft_s"], decode_tokens_per_s=m["decode_tokens_per_s"],
                      decode_tokens=m["tokens"] - 1, graph_steps=m["graph_steps"],
                      peak_allocated_bytes=m["peak_allocated_bytes"], cache_bytes=cache,
                      max_model_len=engine.max_model_len, warmup=warm, chunks=m["chunks"],
                      ragged_logits_kernel=ragged_logits_kernel(engine.model) if impl == "dsa" else None)


def ragged_logits_kernel(model) -> str:
    """Which kernel scores the FP8 prefill rows (``indexer_logits_ragged``'s ``"auto"``): ``"hopper"`` (the
    Gluon kernel), ``"triton"`` (the portable one) or ``"torch"`` (CPU, or exact precision)."""
    c = model.config
    if model.device.type != "cuda" or c.indexer_precision == "exact":
        return "torch"
    return "hopper" if ragged_hopper.use_hopper("auto", model.device, c.index_n_heads, c.index_head_dim) else "triton"


def say_row(say, r: dict) -> None:
    s = r["shape"]
    rate = "" if r["decode_tokens_per_s"] is None else f", decode {r['decode_tokens_per_s']:.1f} tokens/s"
    frac = "" if r["indexer_frac_fp8"] is None else f" = {100 * r['indexer_frac_fp8']:.0f}% of the FP8 ceiling"
    peak = "" if r["peak_allocated_bytes"] is None else f", peak {r['peak_allocated_bytes'] / 2**30:.1f} GiB"
    say(f"{r['impl']} {s['L']} tokens: first token after {r['ttft_s']:.2f} s ({r['prefill_tokens_per_s']:.0f} "
        f"tokens/s), indexer {r['indexer_s']:.2f} s{frac}{rate}{peak}", flush=True)


def run(device, timer, ceilings, args) -> list:
    """The rows: every length on the preset (``--preset``, default demo-gpu on CUDA, tiny
    elsewhere), then the dense twin at the lengths up to ``--dense-up-to``."""
    lengths = parse_lengths(args.lengths) if isinstance(args.lengths, str) else list(args.lengths)
    say = print
    preset = args.preset or ("demo-gpu" if device.type == "cuda" else "tiny")
    model = preset_model(preset, device)
    longest = args.max_model_len or max(lengths) + args.new_tokens
    rows = []
    engine, warm = long_engine(model, longest, args.max_batch_tokens, say)
    for length in lengths:
        rows.append(long_row("dsa", engine, length, args.new_tokens, ceilings, warm))
        say_row(say, rows[-1])
    del engine
    _free(device)
    dense_lengths = [n for n in lengths if n <= args.dense_up_to]
    if dense_lengths and model.config.index_topk is not None:
        dense = without_indexer(model)
        engine, warm = long_engine(dense, max(dense_lengths) + args.new_tokens, args.max_batch_tokens, say)
        for length in dense_lengths:
            rows.append(long_row("dense", engine, length, args.new_tokens, ceilings, warm))
            say_row(say, rows[-1])
        del engine, dense
        _free(device)
    by = {(r["impl"], r["shape"]["L"]): r for r in rows}
    for r in rows:  # decode at each length against the shortest's (issue #38: >= 0.85x of 128K at 1M)
        first = by[(r["impl"], min(n for i, n in by if i == r["impl"]))]
        if r["decode_tokens_per_s"] and first["decode_tokens_per_s"]:
            r["decode_ratio_to_shortest"] = r["decode_tokens_per_s"] / first["decode_tokens_per_s"]
    for r in rows:
        r["preset"] = preset
    return rows


def _free(device) -> None:
    """Give the memory of the engine just dropped (caches, graphs) back, so the next peak is its own."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def write_figure(json_path: str, rows: list, env: dict) -> str:
    """``<json_path minus .json>.png``: time to first token by prompt length (the indexer's floor
    at the FP8 ceiling dashed), and each prefill chunk's ms per 1K rows by position."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsa.report import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl, marker in (("dsa", "o-"), ("dense", "s--")):
        pts = sorted((r["shape"]["L"], r) for r in rows if r["impl"] == impl)
        if not pts:
            continue
        left.plot([n for n, _ in pts], [r["ttft_s"] for _, r in pts], marker, label=f"{impl}: time to first token")
        if impl == "dsa" and all(r["indexer_floor_s"] for _, r in pts):
            left.plot([n for n, _ in pts], [r["indexer_floor_s"] for _, r in pts], ":",
                      label="indexer logits at the same-run FP8 ceiling")
        for n, r in pts:
            if r["chunks"]:
                right.plot([c[0] for c in r["chunks"]], [1e3 * c[2] / c[1] for c in r["chunks"]], "o-",
                           label=f"{impl} {_tokens(n)}", markersize=3)
    left.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds",
             title="time to first token (one request)")
    right.set(xlabel="chunk's first position (tokens)", ylabel="ms per 1K rows",
              title=f"prefill chunks of {rows[0]['shape']['chunk']} rows: cost by position")
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    where = env.get("gpu", "CPU")
    fig.suptitle(f"dsa bench long: {rows[0]['preset']}, {rows[0]['shape']['layers']} layers, on {where} "
                 f"(git {env.get('git_sha', '')[:10]})")
    folder, name = os.path.split(os.path.splitext(json_path)[0] + ".png")
    return save_figure(fig, folder or ".", name)
