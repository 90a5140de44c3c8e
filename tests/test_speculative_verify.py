"""Verify steps through the decode path (#39; float32, CPU). A request's ``k + 1`` verify rows, padded in
front to ``next_n`` rows, run through the paged indexer logits with ``next_n`` rows, top-k per row and
sparse MLA, and give the logits and cache entries of the same rows run as a prefill chunk (the model's
prefill routing), for next_n = 2, 3, 4, odd contexts, rows across a block boundary and across
``index_topk``; the padding rows write nowhere. A speculating engine's verify step is planned on the
decode path (counted at the layers), its graph key carries ``next_n``, and with CUDA graph capture and
replay emulated on the CPU (the runner's one CUDA-specific call, ``record``) the replayed verify steps
give the eager engine's tokens, after a warm-up that captured every verify bucket."""
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsa import Engine
from dsa.engine import spec_step
from dsa.engine.drafter import ScriptedDrafter
from dsa.kernels.layouts import indexer_cache_views
from dsa.model.attention import DSAAttention
from dsa.model.byte_vocab import BYTE_VOCAB_SIZE
from dsa.model.plan import Bucket, HostPlan
from dsa.model.presets import PRESETS
from dsa.model.route import graph_bucket
from model_utils import greedy_oracle, prompt, sharp_model, spec_model

V = BYTE_VOCAB_SIZE
# fp32 on both paths; only the kernels differ (prefill: ragged indexer logits, SDPA / absorbed dense or
# sparse rows; decode: paged logits with next_n rows, sparse MLA over each row's top-k), so the two
# agree to fp32 summation order: measured <= 1.5e-5 of the largest logit at these shapes
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["tiny-exact", "demo-cpu-fp8"])
def model(request):
    if request.param == "tiny-exact":
        return spec_model()
    config = PRESETS["demo-cpu"]().replace(num_hidden_layers=2, index_topk=16, block_size=16, intermediate_size=256,
                                           num_nextn_predict_layers=1)  # demo-cpu's attention, FP8 indexer
    return sharp_model(config, 1)


def _cached(model, contexts: list) -> tuple:
    """``(caches, block tables, tokens)``: each request's first ``contexts[i]`` tokens prefilled (one step)
    into non-contiguous blocks, 8 more tokens of its own to verify."""
    p, b = model.config.block_size, len(contexts)
    per = max(contexts) // p + 2
    caches = model.allocate_caches(b * per + 1)
    tables = (np.arange(b * per).reshape(b, per)[:, ::-1] + 1).astype(np.int32)  # block 0 stays unused
    tokens = [prompt(c + 8, 7 + i, vocab=256) for i, c in enumerate(contexts)]
    some = [i for i, c in enumerate(contexts) if c]
    if some:
        plan = model.plan([contexts[i] for i in some], [0] * len(some), tables[some],
                          input_ids=np.concatenate([tokens[i][:contexts[i]] for i in some]))
        model.step(plan, caches)
    return caches, tables, tokens


def _verify(model, caches, tables, tokens, q, c, next_n):
    """The rows (request ``i``: positions ``c[i] .. c[i] + q[i] - 1``) as one step at ``next_n``: their
    logits ``[T, vocab]``, the caches after it and the plan."""
    caches = copy.deepcopy(caches)
    ids = np.concatenate([tokens[i][c[i]:c[i] + q[i]] for i in range(len(q))])
    host = HostPlan.pack(q, c, tables, model.config.block_size, "cpu", options=model.plan_options(), input_ids=ids,
                         next_n=next_n, logits_rows=np.arange(sum(q)))
    plan = host.derive(host.upload())
    return model.step(plan, caches, logits_rows=plan.logits_rows), caches, plan


CASES = [  # (next_n, rows per request, contexts): rows <= next_n (fewer: padded in front)
    (2, [2, 1, 2], [15, 22, 63]),  # 15, 16: across a block and index_topk; 63, 64: across a block, sparse
    (3, [3, 2, 1], [14, 31, 47]),  # 14..16 across index_topk and a block; 31, 32 across a block
    (4, [4, 4, 2], [13, 30, 45]),  # 13..16 and 30..33 across blocks; a request with two of four rows
    (3, [1], [5]),  # every position (S <= index_topk): the top-k is handed over per row
    (4, [1, 2], [0, 3]),  # a first token (nothing cached): its padding rows sit before position 0
]


@pytest.mark.parametrize("next_n,q,c", CASES, ids=[f"n{n}-q{'.'.join(map(str, q))}-c{'.'.join(map(str, c))}"
                                                   for n, q, c in CASES])
def test_verify_rows_through_decode_equal_the_prefill_path(model, next_n, q, c):
    caches, tables, tokens = _cached(model, c)
    want, want_caches, prefill = _verify(model, caches, tables, tokens, q, c, 1)
    got, got_caches, decode = _verify(model, caches, tables, tokens, q, c, next_n)
    assert decode.route.decode_only and decode.route.next_n == next_n
    assert decode.route.rows["sparse_decode"] == sum(q) and decode.num_tokens == next_n * len(q)
    assert prefill.route.decode_only == all(n == 1 for n in q)  # the reference: rows of > 1 token as prefill
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < TOLERANCE, (f"verify logits through decode vs prefill: max |diff| / max |logit| = {err:.2e} >= "
                             f"{TOLERANCE} (both fp32: only fp32 summation order may differ)")
    written = prefill.slot_mapping
    assert torch.equal(torch.sort(decode.slot_mapping[decode.slot_mapping >= 0]).values, torch.sort(written).values)
    assert (decode.slot_mapping[decode.row_to_req < 0] == -1).all()  # padding rows write nowhere
    for layer, caches_of in enumerate(zip(caches, want_caches, got_caches)):
        for x, y, z in zip(*caches_of):
            if x is not None:
                _check_cache_rows(layer, *(_slot_values(t, model.config.block_size) for t in (x, y, z)), written)


def _slot_values(cache, block_size: int) -> tuple:
    """``(values [NB * P, D] float64, fp8)``: each slot's cached values (an FP8 key dequantized)."""
    if cache.data.dim() == 2:  # the FP8 indexer cache: uint8 [NB, P * (DI + 4)]
        k8, scale = indexer_cache_views(cache.data, block_size)
        return (k8.double() * scale.double()[..., None]).flatten(0, 1), True
    return cache.data.double().flatten(0, 1), False


def _check_cache_rows(layer: int, before: tuple, want: tuple, got: tuple, written: torch.Tensor) -> None:
    """The decode path wrote exactly the prefill path's slots, the same values up to fp32 summation order
    (an FP8 key: one e4m3 step, 1/8 of it, where the two round a value the other way)."""
    (x, _), (y, fp8), (z, _) = before, want, got
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    keep[written.long()] = False
    assert torch.equal(z[keep], x[keep]), f"layer {layer}: the decode path wrote outside the verify rows' slots"
    y, z = y[written.long()], z[written.long()]
    if fp8:
        bad = (z - y).abs() > 0.13 * torch.maximum(y.abs(), z.abs()) + 1e-9
        assert not bad.any(), f"layer {layer}: FP8 keys differ by more than one e4m3 step at {int(bad.sum())} values"
        return
    d, scale = (z - y).abs().max().item(), y.abs().max().item()
    assert d <= TOLERANCE * max(scale, 1.0), (f"layer {layer}: cache rows differ by {d:.2e} (max |value| {scale:.2e}), "
                                              f"more than fp32 summation order explains")


def _oracle_drafter(prompts, outputs, n, wrong=lambda count, j: j == count % 3):
    """The target's own greedy tokens as drafts, with scripted mismatches (accepted lengths vary)."""
    return ScriptedDrafter(greedy_oracle(prompts, outputs), n, V, wrong=wrong)


PROMPTS = [prompt(n, 50 + n, vocab=256) for n in (5, 14, 23)]
NEW = 9


@pytest.fixture(scope="module")
def tiny():
    m = spec_model()
    return m, Engine(m, num_blocks=64).generate(PROMPTS, NEW)


def test_a_verify_step_runs_the_decode_path(tiny, monkeypatch):
    """Counted at the layers: after the prompts' prefill every target step's rows reach ``_decode`` (N + 1
    per request), none the MHA path or the indexer's prefill scoring."""
    model, reference = tiny
    n = 2
    calls = {"decode_rows": [], "mha": 0, "prefill_scored": 0}
    decode, mha = DSAAttention._decode, DSAAttention._mha

    def count_decode(self, q_abs, *args):
        calls["decode_rows"].append(q_abs.shape[0])
        return decode(self, q_abs, *args)

    def count_mha(self, *args):
        calls["mha"] += 1
        return mha(self, *args)

    monkeypatch.setattr(DSAAttention, "_decode", count_decode)
    monkeypatch.setattr(DSAAttention, "_mha", count_mha)
    engine = Engine(model, num_blocks=64, speculative_tokens=n, drafter=_oracle_drafter(PROMPTS, reference, n))
    for p in PROMPTS:
        engine.add_request(p, NEW)
    engine.step()  # the three prompts' prefill
    calls.update(decode_rows=[], mha=0)
    routes = []
    forward = engine.runner._forward
    monkeypatch.setattr(engine.runner, "_forward", lambda plan, verify: routes.append(plan.route) or forward(plan,
                                                                                                              verify))
    while engine.has_work():
        engine.step()
    assert routes and all(r.decode_only and r.next_n == n + 1 for r in routes)
    assert sum(r.rows["sparse_prefill"] + r.rows["dense_prefill_mha"] + r.rows["dense_prefill_absorbed"]
               for r in routes) == 0
    layers = model.config.num_hidden_layers
    assert len(calls["decode_rows"]) == layers * len(routes) and calls["mha"] == 0
    assert all(r % (n + 1) == 0 for r in calls["decode_rows"]), calls["decode_rows"]  # N + 1 rows a request
    prefill = sum(engine.stats.rows[path] for path in ("sparse_prefill", "dense_prefill_mha", "dense_prefill_absorbed"))
    assert prefill == sum(map(len, PROMPTS))  # the prompts' rows only


def test_the_graph_key_carries_next_n():
    assert graph_bucket(np.array([3, 1]), 40, 16, next_n=3) == Bucket(2, 256, 3) != Bucket(2, 256)
    assert graph_bucket(np.array([1, 1]), 40, 16) == Bucket(2, 256, 1)
    assert graph_bucket(np.array([4, 1]), 40, 16, next_n=3) is None  # a prefill chunk: eager
    assert len({Bucket(2, 256, n) for n in (1, 2, 3, 4)}) == 4  # one graph per (rows, context, next_n)


def _emulated_graphs(runner, monkeypatch) -> list:
    """CUDA graphs emulated on the CPU: ``record`` (the runner's one CUDA-specific call) runs the step
    once, as the GPU's side-stream warm-up does, and its "replay" reruns it into the same output
    tensors. The buckets captured are returned as they come."""
    captured = []

    def record(step):
        outputs = step()
        captured.append(None)
        return SimpleNamespace(replay=lambda: [o.copy_(r) for o, r in zip(outputs, step()) if o is not None]), outputs

    monkeypatch.setattr(runner, "use_graphs", True)
    monkeypatch.setattr(runner, "record", record)
    return captured


@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"N{n}")
def test_replayed_verify_steps_give_the_eager_tokens(tiny, monkeypatch, n):
    model, reference = tiny
    drafter = None if n == 2 else _oracle_drafter(PROMPTS, reference, n, wrong=lambda count, j: j == count % (n + 1))
    engine = Engine(model, num_blocks=64, speculative_tokens=n, drafter=drafter)  # n = 2: the MTP module
    captured = _emulated_graphs(engine.runner, monkeypatch)
    replays = []
    run = spec_step.run
    monkeypatch.setattr(spec_step, "run", lambda runner, out: replays.append(run(runner, out)) or replays[-1])
    assert engine.generate(PROMPTS, NEW) == reference
    keys = list(engine.runner.graphs)
    # each verify bucket: its two passes (the drafter's proposals inside the first, its observation the second)
    assert keys and all(k.next_n == n + 1 for k in keys) and len(captured) == 2 * len(keys)
    graphs = [r.graph for r in replays if r.graph is not None]
    assert len(graphs) > len(keys) and engine.stats.graph_steps == len(graphs)  # graphs replayed after their capture
    assert engine.stats.spec.verify_steps > 0


def test_warmup_captures_the_verify_buckets_and_steps_only_replay(tiny, monkeypatch):
    model, reference = tiny
    n = 2
    engine = Engine(model, num_blocks=16, max_batch_tokens=32, speculative_tokens=n,
                    drafter=_oracle_drafter(PROMPTS, reference, n))
    captured = _emulated_graphs(engine.runner, monkeypatch)
    report = engine.warmup(progress=False)
    # the pool's 256 tokens: one context bucket; batch buckets 1 .. 16 (16 blocks), at next_n = 3 only; two
    # graphs a bucket
    assert set(engine.runner.graphs) == {Bucket(b, 256, n + 1) for b in (1, 2, 4, 8, 16)}
    assert report["graphs_captured"] == len(captured) == 10
    spec = engine.runner._padding_plan(1, 256, n + 1).spec
    assert engine.runner.graphs[Bucket(1, 256, n + 1)].spec == spec
    assert engine.generate(PROMPTS[:1], NEW) == reference[:1]
    assert len(captured) == 10  # nothing captured after the warm-up


@pytest.mark.parametrize("warm", [False, True], ids=["captured-on-use", "after-warmup"])
def test_replayed_mtp_passes_draft_what_the_eager_passes_draft(tiny, monkeypatch, warm):
    """The MTP drafter's chained proposals and observation inside the (emulated) verify graphs propose the
    drafts of its eager passes: the same acceptance, draft by draft, and the same tokens; after a warm-up
    nothing more is captured."""
    model, reference = tiny
    n = 3  # two chained proposals a step
    finish = spec_step.finish

    def run(graphs: bool):
        engine = Engine(model, num_blocks=64, max_batch_tokens=64, speculative_tokens=n)
        captured = _emulated_graphs(engine.runner, monkeypatch) if graphs else []
        if graphs and warm:
            engine.warmup(progress=False)
        before, drafts, replayed = len(captured), [], []

        def recording(runner, result):  # each step's drafts of its sampled requests, as the step proposed them
            drafts.append(result.drafts[:len(result.step.sampled)].tolist())
            replayed.append(result.graph is not None)
            return finish(runner, result)
        monkeypatch.setattr(spec_step, "finish", recording)
        tokens = engine.generate(PROMPTS, NEW)
        return tokens, drafts, replayed, len(captured) - before

    eager_tokens, eager_drafts, _, _ = run(False)
    tokens, drafts, replayed, captured_after = run(True)
    assert tokens == eager_tokens == reference
    assert sum(len(d) for d in drafts) > 0 and drafts == eager_drafts, (drafts, eager_drafts)
    assert sum(replayed) > 2, replayed
    if warm:
        assert captured_after == 0, f"{captured_after} graphs captured after the warm-up"
