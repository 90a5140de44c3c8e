"""Where a server's host memory goes, for ``/metrics``: the sizes of the host structures that grow
with cached blocks, requests or steps, the process's resident memory by kind, and the garbage
collector's pauses.

Each structure has a bound (entries, and bytes per entry as ``benchmarks/host_bookkeeping_memory.py``
measures them on CPU):

- the prefix cache's names (``BlockManager.by_name``, ``name_of``): at most one entry per
  cache block, 160-215 B per cached block in all as the dicts' tables grow in steps; once the pool
  is full and evictions begin, each table is rebuilt once at 3x its entries (~40 MiB of resident memory
  at the H200's 340K-block pool), then flat (docs/serving.md, "Memory over a long run");
- the block references and in-flight names (``refs``, ``in_flight``): the blocks of the running requests;
- the free block stack and the eviction order (``free_ids``, ``evictable``): int arrays over ``num_blocks``,
  allocated once (17 B per block), which the garbage collector never walks;
- the engine's and the loop's request maps (``Engine._requests``, ``EngineLoop._live``), the scheduler's
  ``waiting`` and ``running``: the requests waiting or running, none after they finish;
- the runner's ``InputBatch``: ``max_num_seqs`` rows, allocated once;
- the rate window (``EngineLoop._steps``): the steps of the last ``RATE_WINDOW_S`` seconds;
- the latency histograms: fixed buckets;
- the row counts the eager steps' GEMMs ran at (``ModelRunner.gemm_row_counts``): the steps' tokens
  padded to a multiple of 64 (:func:`dsa.model.route.gemm_rows`), so at most ``max_batch_tokens / 64``;
  W_UV's too, at each attention path's rows: the sparse prefill rows padded the same way, a dense
  segment's (at most ``index_topk``), a decode batch's (at most ``max_num_seqs x next_n``).
  cuBLASLt plans each once per weight shape (~10 in a DSA layer) and keeps it in its heuristics cache,
  an LRU of 8,192 entries (~7 kB of C heap each on the H200, ``benchmarks/gemm_host_memory.py``): the one
  growing structure outside the project's code, full after ~128 x 10 entries.

``gc.freeze()`` after the warm-up (as vLLM and SGLang do) moves the objects alive then (the model's
modules, the tokenizer, the kernels' caches) out of the collector's generations, so a full collection
walks only what the server allocated since; :class:`GCPauses` counts the collections of each generation
and times them (``gc.callbacks``).
"""
import ctypes
import gc
import time


def structure_sizes(engine, loop=None) -> dict:
    """Entries of each growing host structure (module docstring), named as in ``/metrics``; the
    loop's (``loop_requests``, ``rate_window_steps``) only with a ``loop``."""
    bm, s = engine.scheduler.blocks, engine.scheduler
    sizes = {"prefix_names": len(bm.by_name), "prefix_blocks": len(bm.name_of), "prefix_evictable": len(bm.evictable),
             "block_refs": len(bm.refs), "in_flight_names": len(bm.in_flight), "free_blocks": len(bm.free_ids),
             "engine_requests": len(engine._requests), "scheduler_waiting": len(s.waiting),
             "scheduler_running": len(s.running), "gemm_row_counts": len(engine.runner.gemm_row_counts)}
    if loop is not None:
        sizes.update(loop_requests=len(loop._live), rate_window_steps=len(loop._steps))
    return sizes


def resident_by_kind() -> dict | None:
    """Resident bytes by kind (Linux ``/proc/self/status``: anonymous (heaps, Python's arenas, pinned
    buffers), file-backed (libraries), shared memory), and the C heap glibc holds (``mallinfo2``: in use and
    free inside it); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile", "RssShmem")))
    except OSError:
        return None
    out = {k.lower().replace("rss", "resident_"): int(v.split()[0]) * 1024 for k, v in fields.items()}
    info = _mallinfo2()
    if info is not None:
        out["malloc_in_use"] = info.uordblks + info.hblkhd
        out["malloc_free"] = info.fordblks
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    """glibc's ``mallinfo2()`` (2.33 and later), None elsewhere."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn()


class GCPauses:
    """Collections per generation and their pauses, from ``gc.callbacks`` (``install`` once; the callback
    runs in whichever thread collects)."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._start = None

    def install(self) -> "GCPauses":
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        """Stop counting (a no-op when not installed)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            g, pause = info["generation"], time.perf_counter() - self._start
            self.collections[g] += 1
            self.seconds[g] += pause
            self.longest[g] = max(self.longest[g], pause)
            self._start = None

    def snapshot(self) -> dict:
        return {"collections": list(self.collections), "seconds": list(self.seconds), "longest": list(self.longest),
                "frozen": gc.get_freeze_count()}


def freeze_after_warmup() -> int:
    """Collect once, then freeze what is alive (module docstring); returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
