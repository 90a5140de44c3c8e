"""The server's host structures stay bounded (dsa.serve.host_memory): on the stub model (a step in
a millisecond), requests of unique prompts fill a small pool; tracemalloc measures the bytes the
prefix cache's bookkeeping takes per cached block while the pool fills, then the bytes per finished
request once it is full (evicting), which must be about nothing. ``/metrics`` exports each
structure's entries and the collector's pauses."""
import gc
import random
import tracemalloc

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dsa.engine.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.model.route import GEMM_ROW_ALIGN
from dsa.serve.engine_loop import EngineLoop
from dsa.serve.host_memory import GCPauses, freeze_after_warmup, resident_by_kind, structure_sizes
from dsa.serve.metrics import prometheus_text
from model_utils import tiny_model
from stub_model import VOCAB, StubModel

# Bytes of prefix-cache bookkeeping per cached block: ~240 on a 360K-block pool, up to ~2x that on a small
# one (its dicts grow by doubling, and this measures a fraction of a doubling).
PER_CACHED_BLOCK = 640
PER_FINISHED_REQUEST = 64  # bytes left behind per finished request once the pool is full (dict churn: 8-30)


def _traffic(engine, rng, requests: int, wave: int = 16) -> None:
    """``requests`` requests of unique prompts (1-9 blocks of 16), some sampled, some stopping early."""
    for _ in range(requests // wave):
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 150))] for _ in range(wave)]
        sampling = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice((0.0, 0.8)),
                                   stop_token_ids=[rng.randrange(VOCAB)]) for _ in prompts]
        engine.generate(prompts, sampling=sampling)


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.parametrize("num_blocks", [301, 997], ids=["301-blocks", "997-blocks"])
def test_host_bookkeeping_is_bounded_per_cached_block_and_per_finished_request(num_blocks):
    engine = Engine(StubModel(), num_blocks=num_blocks, max_num_seqs=16)
    loop = EngineLoop(engine)
    rng = random.Random(num_blocks)
    _traffic(engine, rng, 32)  # warm: the first steps' one-time allocations
    tracemalloc.start()
    try:
        before, cached0 = _traced(), engine.stats.prefix.cached_blocks
        while engine.stats.prefix.cached_blocks < num_blocks * 3 // 4:
            _traffic(engine, rng, 16)
        filling = (_traced() - before) / (engine.stats.prefix.cached_blocks - cached0)
        while engine.stats.prefix.evictions < num_blocks:  # full, and turned over once
            _traffic(engine, rng, 16)
        full = _traced()
        _traffic(engine, rng, 640)
        per_request = (_traced() - full) / 640
    finally:
        tracemalloc.stop()
    sizes = structure_sizes(engine, loop)
    print(f"{num_blocks} blocks: {filling:.0f} B per cached block while filling, {per_request:.1f} B per finished "
          f"request when full; {sizes}")
    assert filling <= PER_CACHED_BLOCK, f"{filling:.0f} B per cached block > {PER_CACHED_BLOCK}"
    assert per_request <= PER_FINISHED_REQUEST, f"{per_request:.1f} B per finished request > {PER_FINISHED_REQUEST}"
    assert sizes["prefix_names"] == sizes["prefix_blocks"] <= num_blocks, sizes
    assert sizes["free_blocks"] + sizes["prefix_evictable"] == num_blocks, sizes
    idle = ("block_refs", "in_flight_names", "engine_requests", "scheduler_waiting", "scheduler_running",
            "loop_requests")
    assert all(sizes[k] == 0 for k in idle), f"held by an idle engine: {sizes}"
    assert 0 < sizes["gemm_row_counts"] <= engine.scheduler.max_batch_tokens // GEMM_ROW_ALIGN, sizes


def test_metrics_export_the_structures_resident_memory_and_gc_pauses():
    engine = Engine(StubModel(), num_blocks=64)
    loop = EngineLoop(engine)
    loop.gc_pauses.install()
    try:
        engine.generate([[1, 2, 3] * 7, [4, 5] * 9], max_new_tokens=5)
        gc.collect()
        text = prometheus_text(loop.metrics())
    finally:
        loop.gc_pauses.uninstall()
    for line in ('dsa_host_structure_entries{structure="prefix_blocks"} 2',
                 'dsa_host_structure_entries{structure="engine_requests"} 0',
                 'dsa_gc_collections_total{generation="2"} ', 'dsa_gc_pause_seconds_max{generation="2"} ',
                 "dsa_gc_frozen_objects "):
        assert line in text, f"{line!r} not in /metrics:\n{text}"
    if resident_by_kind() is not None:  # Linux
        assert 'dsa_resident_memory_bytes{kind="resident_anon"}' in text, text


def test_gc_pauses_count_collections_per_generation_and_the_longest():
    pauses = GCPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    pauses.uninstall()  # twice: a no-op
    s = pauses.snapshot()
    assert s["collections"][0] >= 1 and s["collections"][2] >= 2, s
    assert 0 < s["longest"][2] <= s["seconds"][2], s


def test_freeze_after_warmup_leaves_the_frozen_objects_out_of_collections():
    try:
        frozen = freeze_after_warmup()  # a frozen object freed later (another thread's) leaves the count
        assert 0 < gc.get_freeze_count() <= frozen
        kept = [object() for _ in range(1000)]
        assert gc.get_freeze_count() <= frozen, "objects made after the freeze were frozen too"
        del kept
    finally:
        gc.unfreeze()


def _mha_engine(device, dtype, num_blocks: int = 512, prefix_caching: bool = True):
    """A tiny model whose dense prefill rows all take the MHA path (SDPA), on an engine."""
    from dsa.config import DSAConfig
    from dsa.model import DSAModel
    from dsa.model.dispatch import Dispatch
    config = DSAConfig.tiny(n_routed_experts=None, index_topk=2048, max_position_embeddings=4096, vocab_size=256)
    model = DSAModel.random(config, seed=0, dtype=dtype, device=device)
    model.dispatch = Dispatch(kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                              v_head_dim=config.v_head_dim, prefill_mha_min_query=1)
    return Engine(model, num_blocks=num_blocks, max_num_seqs=8, cuda_graphs=False, prefix_caching=prefix_caching)


def test_the_mha_prefill_runs_sdpa_without_cudnn_attention(monkeypatch):
    """cuDNN attention keeps one execution plan per shape with no bound (``MHA_SDPA_BACKENDS``), and
    prefill segments bring a new shape with almost every prompt: the MHA path turns it off around its
    SDPA call (what the H200's ~200 KB per request was, issue #37); the other backends stay on."""
    import torch
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled()))
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    outside = torch.backends.cuda.cudnn_sdp_enabled()
    engine = _mha_engine("cpu", torch.float32)
    rng = random.Random(0)
    engine.generate([[rng.randrange(256) for _ in range(n)] for n in (5, 17, 40)], max_new_tokens=2)
    assert len(seen) >= 3, "no prefill took the MHA path"
    assert all(s == (False, True, True) for s in seen), f"(cudnn, flash, efficient) enabled at SDPA calls: {set(seen)}"
    assert torch.backends.cuda.cudnn_sdp_enabled() == outside, "the global setting was not restored"


class _GemmRows(TorchFunctionMode):
    """The row counts M of every GEMM against one of ``weights`` (the model's parameters and absorbed
    matrices): ``F.linear(x, W)`` and ``einsum("thd,hdr->thr", x, W)``, what cuBLASLt keys its heuristics
    cache by on a GPU."""

    def __init__(self, weights: list):
        super().__init__()
        self.weights, self.rows = {id(w) for w in weights}, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and id(args[1]) in self.weights:
            self.rows.add(args[0].shape[0])
        elif func is torch.einsum and len(args) == 3 and id(args[2]) in self.weights:
            self.rows.add(args[1].shape[0])
        return func(*args, **kwargs)


def test_gemm_row_counts_are_bounded_by_the_token_budget():
    """Prompts of every length meet few GEMM row counts: a prefill or mixed step's rows are padded to
    GEMM_ROW_ALIGN (cuBLASLt keeps ~7 kB of host memory per new row count and weight on a GPU, up to 8,192
    entries); a decode-only step's are its requests. W_UV runs at each attention path's rows: the sparse
    prefill rows padded, a dense segment's (at most index_topk), a decode batch's. Not bounded: a routed
    expert's (the tokens routed to it). The padded steps' tokens are those of the model's forward."""
    model = tiny_model()
    attn = [layer.self_attn for layer in model.layers]
    weights = [p for name, p in model.named_parameters() if ".experts." not in name]  # an expert's rows: its
    weights += [m.w_uk_t for m in attn]  # tokens (MoE models run eagerly anyway)
    engine = Engine(model, num_blocks=96, max_batch_tokens=160, max_num_seqs=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randrange(1, 300))] for _ in range(24)]
    with _GemmRows(weights) as mode, _GemmRows([m.w_uv for m in attn]) as up_v:
        out = engine.generate(prompts, max_new_tokens=3)
    for p, got in zip(prompts[:3], out):  # the padded steps' tokens: those of full-sequence greedy decoding
        seq = list(p)
        for _ in range(3):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert got == seq[len(p):], f"a {len(p)}-token prompt: {got} != {seq[len(p):]}"
    odd = sorted(m for m in mode.rows if m % GEMM_ROW_ALIGN and m > engine.scheduler.max_num_seqs)
    assert not odd, f"GEMM row counts neither padded to {GEMM_ROW_ALIGN} nor a decode batch: {odd}"
    allowed = {GEMM_ROW_ALIGN * i for i in range(1, 160 // GEMM_ROW_ALIGN + 2)} | set(range(1, 5))
    assert engine.runner.gemm_row_counts <= allowed, engine.runner.gemm_row_counts
    dense_rows = model.config.index_topk  # a dense segment's rows fit in index_topk
    odd = sorted(m for m in up_v.rows if m % GEMM_ROW_ALIGN and m > max(dense_rows, engine.scheduler.max_num_seqs))
    assert not odd, f"W_UV row counts neither a dense segment's, a decode batch's nor padded: {odd}"
    assert any(m > dense_rows for m in up_v.rows), f"no sparse prefill rows went up through W_UV: {up_v.rows}"
