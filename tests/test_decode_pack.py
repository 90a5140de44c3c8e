"""A graph bucket's step packs by its own fast path (#39: a speculating step's host time): ``HostPlan.pack`` of a
decode-only step padded to a :class:`Bucket` (``HostPlan._decode``) gives the plan the general path
(``HostPlan._general``) gives the same checked inputs: the spec, the packed bytes, the route, the row index, the
lengths, the bucket. And through the engine: a speculating step's packed buffer (``spec_step.pack``: the verify
plan, the MTP drafter's chained plans or the scripted drafter's drafts) is the same by either path."""
import dataclasses

import numpy as np
import pytest
import torch

from dsa import Engine, SamplingParams
from dsa.engine import spec_step
from dsa.engine.drafter import ScriptedDrafter
from dsa.model.byte_vocab import BYTE_VOCAB_SIZE
from dsa.model.plan import Bucket, HostPlan, PlanOptions
from dsa.model.route import context_bucket
from model_utils import greedy_oracle, prompt, spec_model

P = 16


def _general(cls, query, seq, tables, ids, src, rows, num_tokens, block_size, device, options, bucket):
    """``HostPlan._decode``'s inputs through the general path."""
    return cls._general(query, seq - query, seq, tables, ids, src, rows, block_size, device, options, bucket,
                        bucket.next_n)


@pytest.fixture
def general(monkeypatch):
    """``(fast, general)``: ``HostPlan.pack`` as it is, and with its graph bucket's path the general one."""
    def by_general(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(HostPlan, "_decode", classmethod(_general))
            return HostPlan.pack(*args, **kwargs)
    return by_general


def assert_same_plan(fast: HostPlan, slow: HostPlan) -> None:
    assert fast.bucket == slow.bucket and fast.bucket is not None
    assert fast.spec == slow.spec
    a, b = np.concatenate(fast.packer.parts), np.concatenate(slow.packer.parts)
    assert a.dtype == b.dtype == np.int32 and a.tobytes() == b.tobytes()
    assert fast.packer.size == slow.packer.size == a.size
    for name in ("query_lens", "context_lens", "row_index"):
        x, y = getattr(fast, name), getattr(slow, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for name in ("num_requests", "block_size", "index_topk", "max_seq_len", "device", "next_n"):
        assert getattr(fast, name) == getattr(slow, name), name
    for field in dataclasses.fields(fast.route):
        x, y = getattr(fast.route, field.name), getattr(slow.route, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


def _step(rng, batch: int, rows: int, next_n: int, max_seq_len: int):
    """Random lengths of a decode-only step: one request at its first token (context 0) when it can, one
    whose length is the bucket's edge."""
    query = rng.integers(1, next_n + 1, batch)
    context = rng.integers(0, max_seq_len - next_n + 1, batch)
    context[0] = 0
    if batch > 1:
        context[1] = max_seq_len - query[1]
    return query, context


CASES = [(b, r, n) for b in (1, 3, 16) for r in (1, 4, 16, 32) for n in (1, 2, 3, 4) if r >= b]


@pytest.mark.parametrize("topk", [None, 2048, "above"], ids=["no-indexer", "topk2048", "every-position"])
@pytest.mark.parametrize("batch,rows,next_n", CASES, ids=[f"b{b}-rows{r}-n{n}" for b, r, n in CASES])
def test_a_graph_buckets_plan_is_the_general_paths(general, batch, rows, next_n, topk):
    rng = np.random.default_rng(batch * 1000 + rows * 10 + next_n)
    max_seq_len = context_bucket(int(rng.integers(100, 5000)), P)
    options = PlanOptions(index_topk=max_seq_len + 1 if topk == "above" else topk)
    for trial in range(3):
        query, context = _step(rng, batch, rows, next_n, max_seq_len)
        t = int(query.sum())
        width = max_seq_len // P + int(rng.integers(0, 3))
        tables = rng.integers(0, 1 << 20, (batch, width)).astype(np.int32)
        ids = rng.integers(0, 50000, t).astype(np.int32)
        src = np.where(rng.random(t) < 0.3, rng.integers(0, 64, t), -1)
        logits = [None, rng.integers(0, t, int(rng.integers(1, 2 * t + 1))), np.arange(t)][trial]
        kwargs = dict(options=options, input_ids=ids, input_src=None if trial == 2 else src, logits_rows=logits,
                      next_n=next_n)
        by = dict(bucket=Bucket(rows, max_seq_len, next_n)) if trial else dict(graphs=True)
        fast = HostPlan.pack(query, context, tables, P, "cpu", **kwargs, **by)
        assert_same_plan(fast, general(query, context, tables, P, "cpu", **kwargs, **by))
        if trial == 0:  # the runner's and the drafter's plans: no ids, default logits rows, a list of tables
            bare = dict(options=options, next_n=next_n, bucket=Bucket(rows, max_seq_len, next_n))
            lists = [list(r[:int(rng.integers(0, width + 1))]) for r in tables]
            fast = HostPlan.pack(query.tolist(), context.tolist(), lists, P, "cpu", **bare)
            assert_same_plan(fast, general(query.tolist(), context.tolist(), lists, P, "cpu", **bare))


def test_the_padding_plan_of_a_bucket_is_the_general_paths(general):
    args = ([], [], np.zeros((0, 64), np.int32), P, "cpu")
    for n in (1, 3):
        kwargs = dict(options=PlanOptions(index_topk=512), input_ids=np.zeros(0, np.int32), bucket=Bucket(8, 1024, n),
                      next_n=n)
        assert_same_plan(HostPlan.pack(*args, **kwargs), general(*args, **kwargs))


def _device_facts(d) -> tuple:
    """The decode rows' row ids and visible lengths as ``derive`` computed them on the device before they were
    packed: ``arange // N`` and ``max(0, S - N + 1 + j % N)``."""
    j = torch.arange(d.row_ids.shape[0], dtype=torch.int32)
    row_ids = j // d.next_n
    return row_ids, (d.seq_lens[row_ids.long()] - d.next_n + 1 + j % d.next_n).clamp_min(0)


STEPS = {"decode": ([1, 1, 2], [0, 37, 300]), "mixed": ([2, 9, 1, 2], [5, 0, 63, 17]),
         "mixed-last": ([1, 4, 3], [16, 2, 40])}
FACTS = [(by, step, n) for by in ("eager", "bucket") for step in STEPS for n in (1, 2, 3, 4)
         if by == "eager" or max(STEPS[step][0]) <= n]  # (a graph bucket pads decode-only steps)


@pytest.mark.parametrize("by,step,next_n", FACTS, ids=[f"{by}-{step}-n{n}" for by, step, n in FACTS])
def test_the_decode_rows_row_ids_and_lengths_are_packed(by, step, next_n):
    """``DecodeRows.row_ids`` and (N > 1) ``lengths`` are int32 views of the packed buffer (no device op), with the
    values the device computed before: eager steps of decode requests only, or mixed with prefill chunks (decode rows
    gathered), and graph buckets (padding requests: length 0)."""
    query, context = STEPS[step]
    bucket = Bucket(8, 512, next_n) if by == "bucket" else None
    host = HostPlan.pack(query, context, np.arange(4 * 32, dtype=np.int32).reshape(4, 32)[:len(query)], P, "cpu",
                         options=PlanOptions(index_topk=64), next_n=next_n, bucket=bucket)
    buf = host.upload()
    d = host.derive(buf).decode
    decode = [q <= next_n for q in query] + [True] * (0 if bucket is None else bucket.rows - len(query))
    assert d is not None and d.row_ids.shape == (sum(decode) * next_n,)
    row_ids, lengths = _device_facts(d)
    for name, got, want in (("row_ids", d.row_ids, row_ids), ("lengths", d.lengths, lengths)):
        assert got.dtype == torch.int32 and torch.equal(got, want), name
        if name == "row_ids" or next_n > 1:  # (at N = 1 the lengths are the seq_lens, gathered in a mixed step)
            assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), f"{name}: not a view"
    if bucket is not None:
        assert (d.lengths[len(query) * next_n:] == 0).all()


@pytest.mark.parametrize("bad,message", [
    (dict(block_tables=np.zeros((3, 8), np.int32)), "block_tables: expected"),
    (dict(input_ids=np.zeros(4, np.int32)), "input_ids: expected"),
    (dict(input_src=np.zeros(2, np.int64)), "input_src: expected"),
    (dict(logits_rows=[0, 9]), "logits_rows: rows must be in"),
    (dict(logits_rows=np.zeros((2, 2), np.int64)), "logits_rows: expected a 1-D"),
    (dict(query_lens=[0, 2]), "query_lens: every request"),
    (dict(context_lens=[-1, 4]), "query_lens: every request"),
    (dict(bucket=Bucket(1, 256, 2)), "bucket: padding needs"),
    (dict(bucket=Bucket(4, 16, 2)), "bucket: max_seq_len must be"),
    (dict(bucket=Bucket(4, 256, 3)), "bucket: its next_n"),
], ids=["tables", "ids", "src", "rows-range", "rows-shape", "query", "context", "rows", "width", "next_n"])
def test_a_graph_buckets_bad_inputs_raise_the_general_errors(bad, message):
    args = dict(query_lens=[1, 2], context_lens=[5, 40], block_tables=np.zeros((2, 16), np.int32), block_size=P,
                device="cpu", options=PlanOptions(index_topk=64), input_ids=np.zeros(3, np.int32),
                input_src=np.full(3, -1), bucket=Bucket(4, 256, 2), next_n=2)
    with pytest.raises(ValueError, match=message):
        HostPlan.pack(**{**args, **bad})


V = BYTE_VOCAB_SIZE
PROMPTS = [prompt(n, 40 + n, vocab=256) for n in (5, 14, 23, 9, 31)]


@pytest.fixture(scope="module")
def tiny():
    m = spec_model()
    return m, Engine(m, num_blocks=96).generate(PROMPTS, 8)


@pytest.mark.parametrize("drafter", ["mtp", "scripted"])
def test_a_speculating_steps_packed_buffer_is_the_general_paths(tiny, general, monkeypatch, drafter):
    """Every step of a speculating engine's run (eager, graphs off): ``spec_step.pack`` at a graph bucket by the
    fast path and by the general one, the same layout and bytes."""
    model, reference = tiny
    n = 3
    d = None if drafter == "mtp" else ScriptedDrafter(greedy_oracle(PROMPTS, reference), n, V,
                                                      wrong=lambda count, j: j == count % 4)
    engine = Engine(model, num_blocks=96, max_batch_tokens=64, speculative_tokens=n, drafter=d)
    runner, compared = engine.runner, []
    real_pack = spec_step.pack

    def both_ways(out) -> list:
        """``spec_step.pack`` at the step's graph bucket by each path, from the same batch and drafter state."""
        batch, packs = runner.batch, []
        for fast in (True, False):
            saved = batch.token_ids.copy(), batch.sampled_row.copy(), (d.calls, d.proposed) if d else None
            with monkeypatch.context() as m:
                m.setattr(runner, "use_graphs", True)
                if not fast:
                    m.setattr(HostPlan, "_decode", classmethod(_general))
                packs.append(real_pack(runner, out))
            batch.token_ids[:], batch.sampled_row[:] = saved[:2]
            if d:
                d.calls, d.proposed = saved[2]
        return packs

    def pack(runner, out):
        if out.rids and all(q <= n + 1 for q in out.num_rows):  # a step with a graph bucket
            fast, slow = both_ways(out)
            assert fast.bucket == slow.bucket and fast.bucket is not None
            assert fast.packed.layout == slow.packed.layout
            a, b = np.concatenate(fast.packed.packer.parts), np.concatenate(slow.packed.packer.parts)
            assert a.tobytes() == b.tobytes()
            compared.append(fast.bucket)
        return real_pack(runner, out)

    monkeypatch.setattr(spec_step, "pack", pack)
    rng = np.random.default_rng(7)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, sampling=SamplingParams(max_tokens=int(rng.integers(4, 12)), temperature=0))
            engine.step()
        while engine.has_work():
            engine.step()
    assert len(compared) > 5 and len({b.rows for b in compared}) > 1


def test_a_graph_buckets_shared_facts_are_read_only():
    """Plans of one bucket and row count share their route, lengths and row index (cached): none can be written."""
    args = ([1, 1], [5, 40], np.zeros((2, 16), np.int32), P, "cpu")
    a, b = (HostPlan.pack(*args, options=PlanOptions(index_topk=64), bucket=Bucket(4, 256)) for _ in range(2))
    assert a.route is b.route and a.packer.parts[0] is not b.packer.parts[0]
    for array in (a.query_lens, a.row_index, a.route.decode_reqs):
        with pytest.raises(ValueError):
            array[0] = 7
    with pytest.raises(TypeError):
        a.route.rows["sparse_decode"] = 0
