"""The ``/metrics`` text (Prometheus' exposition format): the engine loop's counters and gauges
(:func:`prometheus_text`) and the request latency histograms (``_bucket{le}``, ``_sum``, ``_count``).

The histograms are measured by the HTTP handlers on the server's event loop (no lock needed): a
request's clock starts when its handler starts the response (the body parsed, the prompt tokenized
and checked), each token is timed when the handler passes it on (sent as a stream chunk, or held
back while its text is an incomplete character), and the histograms are observed when the request
finishes (stop or length; aborted and disconnected requests are not counted). The queue time runs
from that start to the start of the engine step that first admitted the request (it got its blocks).
"""
import bisect
import time

from dsa.model.plan import PATHS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bucket (+Inf only)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def lines(self) -> list:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, n in zip([*(f"{b:g}" for b in self.buckets), "+Inf"], self.counts):
            total += n
            out.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        out += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {total}"]
        return out


class LatencyMetrics:
    """The four histograms; :meth:`timer` gives one request's :class:`RequestTimer`."""

    def __init__(self):
        self.ttft = Histogram("dsa_time_to_first_token_seconds",
                              "From the request's start to its first token, per finished request.", LATENCY_BUCKETS)
        self.itl = Histogram("dsa_inter_token_latency_seconds",
                             "Between consecutive tokens of a request, per token gap.", TOKEN_BUCKETS)
        self.e2e = Histogram("dsa_e2e_request_latency_seconds",
                             "From the request's start to its last token, per finished request.", LATENCY_BUCKETS)
        self.queue = Histogram("dsa_request_queue_time_seconds",
                               "From the request's start to the engine step that admitted it, per finished request.",
                               LATENCY_BUCKETS)

    def timer(self, start: float) -> "RequestTimer":
        return RequestTimer(self, start)

    def text(self) -> str:
        return "\n".join(line for h in (self.ttft, self.itl, self.e2e, self.queue) for line in h.lines()) + "\n"


class RequestTimer:
    """One request's token times (``time.perf_counter`` clock); observed into the histograms at its finish."""

    def __init__(self, metrics: LatencyMetrics, start: float):
        self.metrics, self.start = metrics, start
        self.first = self.last = None
        self.gaps = []

    def token(self, delta, admitted: float | None) -> None:
        """Call with each delta as the handler passes it on; ``admitted``: the submission's admission time."""
        if delta.token_ids:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now
        if delta.finished and delta.finish_reason != "abort" and self.first is not None:
            m = self.metrics
            m.ttft.observe(self.first - self.start)
            m.e2e.observe(self.last - self.start)
            for gap in self.gaps:
                m.itl.observe(gap)
            if admitted is not None:
                m.queue.observe(max(0.0, admitted - self.start))


def prometheus_text(m: dict) -> str:
    """The metrics in Prometheus' text exposition format."""
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP dsa_{name} {help_}")
        lines.append(f"# TYPE dsa_{name} {kind}")
        for labels, value in samples:
            lines.append(f"dsa_{name}{labels} {value}")

    metric("requests_running", "gauge", "Requests being generated.", [("", m["running"])])
    metric("requests_waiting", "gauge", "Requests waiting for cache blocks.", [("", m["waiting"])])
    metric("requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(m["finished"].items())])
    metric("prompt_tokens_total", "counter", "Prompt tokens of the requests added.", [("", m["prompt_tokens"])])
    metric("generated_tokens_total", "counter", "Tokens generated.", [("", m["generated_tokens"])])
    metric("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
           [("", f"{m['tokens_per_second']:.3f}")])
    metric("cache_blocks_in_use", "gauge", "Cache blocks held by requests.", [("", m["blocks_in_use"])])
    metric("cache_blocks_free", "gauge", "Cache blocks a new request can get (cached prefixes included).",
           [("", m["blocks_free"])])
    metric("cache_blocks_cached", "gauge", "Blocks holding a named prompt prefix (in use or not).",
           [("", m["blocks_cached"])])
    metric("rows_served_total", "counter", "Rows (tokens) served per attention path.",
           [(f'{{path="{p}"}}', m["rows"].get(p, 0)) for p in PATHS])
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [("", m["prefix"].prompt_tokens)])
    metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           [("", m["prefix"].hit_tokens)])
    metric("prefix_cache_evictions_total", "counter", "Cached blocks given to new requests.",
           [("", m["prefix"].evictions)])
    metric("preemptions_total", "counter", "Running requests that gave their blocks back to recompute later.",
           [("", m["preemptions"])])
    metric("kernel_compiles_total", "counter", "Triton/Gluon kernel variants built in this process.",
           [("", m["kernel_compiles"])])
    spec = m.get("spec")
    if spec is not None and spec.speculative_tokens:  # speculative decoding (dsa serve --speculative-tokens N)
        metric("spec_verify_steps_total", "counter", "Steps that verified draft tokens.", [("", spec.verify_steps)])
        metric("spec_draft_tokens_total", "counter", "Draft tokens proposed.", [("", spec.drafts)])
        metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", spec.accepted)])
        metric("spec_accepted_by_position_total", "counter", "Draft tokens accepted, by draft position (0-based).",
               [(f'{{position="{j}"}}', a) for j, a in enumerate(spec.by_position)])
        metric("spec_proposed_by_position_total", "counter", "Draft tokens proposed, by draft position (0-based).",
               [(f'{{position="{j}"}}', a) for j, a in enumerate(spec.proposed_by_position)])
        metric("spec_tokens_per_step", "gauge", "Tokens a drafting request gets per verify step.",
               [("", f"{spec.tokens_per_step:.4f}")])
        metric("spec_draft_seconds_total", "counter", "Seconds drafting.", [("", f"{spec.draft_s:.6f}")])
        metric("spec_verify_seconds_total", "counter", "Seconds verifying (target pass and rejection sampler).",
               [("", f"{spec.verify_s:.6f}")])
    if m["rss_bytes"] is not None:  # Prometheus' process collector's name
        lines += ["# HELP process_resident_memory_bytes Resident memory size in bytes.",
                  "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {m['rss_bytes']}"]
    if m["gpu_bytes"] is not None:
        metric("gpu_memory_allocated_bytes", "gauge", "GPU memory held by tensors (torch.cuda.memory_allocated).",
               [("", m["gpu_bytes"])])
    metric("host_structure_entries", "gauge", "Entries of each host structure that grows with cached blocks, "
           "requests or steps (dsa.serve.host_memory states their bounds).",
           [(f'{{structure="{k}"}}', v) for k, v in m["structures"].items()])
    if m["resident"] is not None:
        metric("resident_memory_bytes", "gauge", "Resident memory by kind (anon, file, shmem) and the C heap "
               "(malloc_in_use, malloc_free).", [(f'{{kind="{k}"}}', v) for k, v in m["resident"].items()])
    g = m["gc"]
    metric("gc_collections_total", "counter", "Garbage collections per generation since the server started.",
           [(f'{{generation="{i}"}}', n) for i, n in enumerate(g["collections"])])
    metric("gc_pause_seconds_total", "counter", "Seconds spent in garbage collections, per generation.",
           [(f'{{generation="{i}"}}', f"{t:.6f}") for i, t in enumerate(g["seconds"])])
    metric("gc_pause_seconds_max", "gauge", "The longest garbage collection pause, per generation.",
           [(f'{{generation="{i}"}}', f"{t:.6f}") for i, t in enumerate(g["longest"])])
    metric("gc_frozen_objects", "gauge", "Objects frozen by gc.freeze() after the warm-up.", [("", g["frozen"])])
    if m["compiles_after_warmup"] is not None:
        metric("kernel_compiles_after_warmup_total", "counter", "Kernel variants built after the warm-up.",
               [("", m["compiles_after_warmup"])])
    return "\n".join(lines) + "\n"
