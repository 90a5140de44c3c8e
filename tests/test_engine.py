"""The engine: paths that ran, chunked prefill, batching invariance, greedy = full forward, isolation,
requests checked once."""
import dataclasses

import pytest
import torch

import dsa.engine.engine
import dsa.model.attention
from dsa import Engine, SamplingParams
from dsa.engine.engine import CheckedPrompt
from model_utils import prompt, tiny_model
from stub_model import VOCAB, StubModel, reference


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_paths_and_chunks(model):
    engine = Engine(model, num_blocks=32, max_batch_tokens=16)
    out = engine.generate([prompt(40, 1), prompt(5, 2)], 4)
    assert [len(o) for o in out] == [4, 4]
    rows = engine.stats.rows
    # prompt 1: 40 tokens in chunks of <= 16 (the 5-token prompt shares the first step's budget)
    assert engine.stats.prefill_chunks >= 4
    assert rows["sparse_prefill"] == 40 - 16  # positions 16.. have ranges longer than index_topk
    assert rows["dense_prefill_mha"] + rows["dense_prefill_absorbed"] == 16 + 5
    # every decode row runs top-k + the sparse kernel (prompt 2's S <= 16: its top-k is every position)
    assert rows["sparse_decode"] == 6 and rows["dense_decode"] == 0
    assert engine.stats.blocks_in_use == 0 and engine.scheduler.blocks.num_free == 32


def test_skip_layers_attend_with_the_reused_selection(model, monkeypatch):
    calls = []
    real = dsa.model.attention.sparse_mla

    def spy(q, latent, slots, scale, **kw):
        calls.append(slots.clone())
        return real(q, latent, slots, scale, **kw)

    monkeypatch.setattr(dsa.model.attention, "sparse_mla", spy)
    model(torch.tensor([prompt(30, 3)]))
    assert len(calls) == 4  # every layer attends sparsely, skip layers too
    assert torch.equal(calls[1], calls[0]) and torch.equal(calls[3], calls[2])  # FSFS
    assert not torch.equal(calls[2], calls[0])  # layer 2 ran its own indexer


def test_forced_small_workspace_switches_to_absorbed(model):
    ids = torch.tensor([prompt(16, 4)])
    mha = model(ids)
    saved = model.dispatch
    model.dispatch = dataclasses.replace(saved, mha_workspace_bytes=1)
    try:
        engine = Engine(model, num_blocks=8)
        engine.generate([ids[0].tolist()], 1)
        assert engine.stats.rows["dense_prefill_mha"] == 0 and engine.stats.rows["dense_prefill_absorbed"] == 16
        absorbed = model(ids)
    finally:
        model.dispatch = saved
    engine = Engine(model, num_blocks=8)
    engine.generate([ids[0].tolist()], 1)
    assert engine.stats.rows["dense_prefill_mha"] == 16 and engine.stats.peak_workspace_bytes > 0
    assert torch.allclose(mha, absorbed, atol=1e-4, rtol=1e-4)  # the same function


def test_greedy_decode_matches_full_forward(model):
    p = prompt(25, 8)
    out = Engine(model, num_blocks=16).generate([p], 8)[0]
    logits = model(torch.tensor([p + out]))[0, len(p) - 1:-1]  # [8, vocab]
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # skip near-ties
    assert clear.sum() >= 6
    assert torch.equal(logits.argmax(-1)[clear], torch.tensor(out)[clear])


def test_nan_poisoned_blocks_never_change_tokens(model):
    p = prompt(33, 9)
    clean = Engine(model, num_blocks=12).generate([p], 4)[0]
    engine = Engine(model, num_blocks=12)
    for latent, index in engine.caches:  # every byte NaN before the request writes its own rows
        latent.data.view(torch.uint8).fill_(0xFF)
        if index is not None:
            index.data.view(torch.uint8).fill_(0xFF)
    assert engine.generate([p], 4)[0] == clean


def test_never_fits_is_refused_and_engine_keeps_working(model):
    engine = Engine(model, num_blocks=4)  # 64 tokens
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request(prompt(60, 10), 10)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add_request(prompt(10, 10), model.config.max_position_embeddings)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request([], 3)
    assert len(engine.generate([prompt(20, 11)], 3)[0]) == 3


def test_a_full_pool_preempts_the_newest_request_and_tokens_do_not_change(model):
    a, b = prompt(30, 12), prompt(25, 13)
    engine = Engine(model, num_blocks=3)  # 48 tokens: both prompts start, then b gives its blocks back
    ra, rb = engine.add_request(a, 4), engine.add_request(b, 4)
    outs = {ra: [], rb: []}
    for rid, toks in engine.step().items():  # a's prompt (30 rows, 2 blocks) and the first block of b's
        outs[rid] += toks
    assert [r.rid for r in engine.running.values()] == [ra, rb] and not engine.waiting
    while engine.has_work():
        for rid, toks in engine.step().items():
            outs[rid] += toks
    assert engine.stats.preemptions >= 1 and engine.stats.blocks_in_use == 0
    assert outs[ra] == Engine(model, num_blocks=3).generate([a], 4)[0]
    assert outs[rb] == Engine(model, num_blocks=3).generate([b], 4)[0]


def test_engine_arguments():
    m = tiny_model()
    with pytest.raises(ValueError, match="exactly one"):
        Engine(m)
    e = Engine(m, memory_bytes=10 << 20)
    assert e.capacity_tokens == e.num_blocks * 16 > 0


def test_short_decode_rows_take_the_sparse_kernel_with_every_position(model):
    """A decode row whose context fits in index_topk is served by top-k + the sparse kernel (its top-k
    is every position): the same function as the dense absorbed decode."""
    from dsa.kernels import dense_mla_decode, sparse_mla
    engine = Engine(model, num_blocks=4)
    rid = engine.add_request(prompt(12, 14), 3)
    engine.step()  # prefill
    req = engine.running[rid]
    plan = model.plan([1], [req.computed], [req.blocks], input_ids=[req.tokens[-1]])
    assert plan.route.decode_only and plan.route.rows["sparse_decode"] == 1 and plan.route.every_position
    latent = engine.caches.latent[0].data
    q = torch.randn(1, model.config.num_attention_heads, 576, generator=torch.Generator().manual_seed(0))
    sparse, _ = sparse_mla(q, latent, plan.indexer.every_position, 0.1)
    dense, _ = dense_mla_decode(q[:, None], latent, plan.decode.block_table, plan.decode.seq_lens, 0.1)
    assert torch.allclose(sparse, dense[:, 0], atol=1e-5, rtol=1e-5)
    assert engine.generate([prompt(12, 14)], 3)[0] == Engine(model, num_blocks=4).generate([prompt(12, 14)], 3)[0]


def test_warmup_runs_every_step_kind_and_changes_no_tokens(model):
    prompts = [prompt(40, 21), prompt(5, 22)]
    cold = Engine(model, num_blocks=16, max_batch_tokens=24)
    warm = Engine(model, num_blocks=16, max_batch_tokens=24)
    report = warm.warmup(progress=False)
    # prefill: chunks 1, 2, 4, 8, 16, 24 from a fresh prompt, and behind prefixes; decode: every bucket
    assert report["prefill_steps"] >= 6 and report["decode_buckets"] >= 5 and report["graphs_captured"] == 0
    assert warm.stats.steps == 0 and warm.stats.blocks_in_use == 0  # no request, no block held
    assert warm.generate(prompts, 6) == cold.generate(prompts, 6)
    with pytest.raises(RuntimeError, match="warmup: call it before"):
        warm.add_request(prompt(3, 1), 2)
        warm.warmup(progress=False)


def test_a_checked_prompt_is_added_as_it_is(monkeypatch):
    """check_request's record goes into add_request without a second check (a server checks in its
    handler, then its loop thread adds); raw ids are still checked; a record of other limits or
    with another sampling is refused."""
    engine = Engine(StubModel(), num_blocks=8)
    sp = SamplingParams(max_tokens=3, temperature=0)
    p = prompt(10, 5, VOCAB)
    checked = engine.check_request(p, sp)
    assert isinstance(checked, CheckedPrompt) and list(checked.ids) == p and len(checked) == 10
    calls = []
    real = dsa.engine.engine.token_ids
    monkeypatch.setattr(dsa.engine.engine, "token_ids", lambda *a: calls.append(a) or real(*a))
    rid = engine.add_request(checked, sampling=sp)
    assert calls == [], calls
    other = engine.add_request(p, 3)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="^sampling: differs"):
        engine.add_request(checked, sampling=SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="^max_new_tokens"):
        engine.add_request(checked, 5)
    with pytest.raises(ValueError, match="^prompt_ids: checked by an engine with other limits"):
        Engine(StubModel(), num_blocks=4).add_request(checked)
    out = {}
    while engine.has_work():
        for r, toks in engine.step().items():
            out.setdefault(r, []).extend(toks)
    assert out[rid] == out[other] == reference(p, 3)
