"""The runner's persistent batch (dsa.engine.input_batch), changed only by the scheduler's deltas,
against a batch rebuilt from scratch from the scheduler's state after every step, over waves of
admissions, aborts, preemptions, prefix hits, stop tokens and both scheduling modes (stub model:
tests/stub_model.py). And the tokens: greedy ones equal the stub's reference, sampled ones equal
the same request run alone."""
import random

import numpy as np
import pytest

from dsa import Engine, SamplingParams
from dsa.engine.input_batch import InputBatch
from dsa.engine.sampling import SamplingBatch
from dsa.engine.scheduler import PENDING, NewRequest, SchedulerOutput
from model_utils import prompt
from stub_model import VOCAB, StubModel, reference

COLUMNS = ("temperature", "top_p", "min_p", "top_k", "greedy", "sorts", "seed_key", "logprobs")


def _rebuilt(engine) -> InputBatch:
    """A fresh batch of the scheduler's running requests, each announced as new."""
    old = engine.runner.batch
    fresh = InputBatch(len(old.sampled_row), old.token_ids.shape[1], old.block_table.shape[1], VOCAB)
    fresh.apply(SchedulerOutput(new=[NewRequest(r.rid, list(r.tokens), list(r.blocks), r.sampling, r.seed)
                                     for r in engine.scheduler.running.values()]))
    return fresh


def _check(engine, read_from: dict) -> None:
    """The kept batch equals the rebuilt one for every running request: the block-table row (zeros
    past its blocks), the sampling row, and the token ids from the first position the last step
    read (``read_from``: computed before it) to its end."""
    kept, fresh = engine.runner.batch, _rebuilt(engine)
    running = engine.scheduler.running
    assert set(kept.row_of) == set(running), (sorted(kept.row_of), sorted(running))
    assert len(kept.row_of) + len(kept.free_rows) == len(kept.sampled_row) == len(set(kept.free_rows) |
                                                                                 set(kept.row_of.values()))
    for rid, req in running.items():
        k, f = kept.row_of[rid], fresh.row_of[rid]
        assert np.array_equal(kept.block_table[k], fresh.block_table[f]), (rid, kept.block_table[k], req.blocks)
        assert kept.num_blocks[k] == len(req.blocks)
        for name in COLUMNS:
            assert getattr(kept.sampling, name)[k] == getattr(fresh.sampling, name)[f], (rid, name)
        start, end = read_from.get(rid, req.computed), len(req.tokens)
        assert np.array_equal(kept.token_ids[k, start:end], fresh.token_ids[f, start:end]), \
            (rid, start, kept.token_ids[k, start:end].tolist(), req.tokens[start:])


def _sampling(rng, i):
    if i % 3:
        return SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, stop_token_ids=[rng.randrange(VOCAB)])
    return SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 5]),
                          top_p=rng.choice([1.0, 0.8]), seed=i, logprobs=rng.choice([None, 2]))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("num_blocks", [7, 24], ids=lambda n: f"{n}blocks")  # 7: preemptions, idle steps
@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"seed{s}")
def test_kept_batch_equals_one_rebuilt_from_the_scheduler_every_step(seed, num_blocks, overlap, monkeypatch):
    rng = random.Random(seed)
    engine = Engine(StubModel(), num_blocks=num_blocks, max_batch_tokens=40, max_num_seqs=6, overlap=overlap)
    real_run, checked = engine.runner.run, [0]

    def run(out, previous=None):
        result = real_run(out, previous)
        _check(engine, dict(zip(out.rids, out.computed)))
        checked[0] += 1
        return result

    monkeypatch.setattr(engine.runner, "run", run)
    doc = prompt(40, 999, VOCAB)
    asked, produced = {}, {}
    for wave in range(5):
        for i in range(rng.randint(2, 8)):
            p = doc[:rng.choice([0, 17, 33, 40])] + prompt(rng.randint(1, 40), rng.randrange(10 ** 6), VOCAB)
            sp = _sampling(rng, len(asked))
            rid = engine.add_request(p, sampling=sp,
                                     on_output=lambda d: produced.setdefault(d.request_id, []).append(d))
            asked[rid] = (p, sp)
        for _ in range(rng.randint(0, 12)):
            if engine.has_work():
                engine.step()
            if rng.random() < 0.15 and engine._requests:
                engine.abort(rng.choice(list(engine._requests)))
    while engine.has_work():
        engine.step()
    assert checked[0] > 10 and engine.stats.blocks_in_use == 0
    if num_blocks == 7:
        assert engine.stats.preemptions > 0
    for rid, (p, sp) in asked.items():
        deltas = produced[rid]
        if deltas[-1].finish_reason == "abort":
            continue
        tokens = [t for d in deltas for t in d.token_ids]
        if sp.greedy:
            want = reference(p, sp.max_tokens)
            stop = next((i for i, t in enumerate(want) if t in sp.stop_token_ids), None)
            want = want if stop is None else want[:stop + 1]
        else:
            want = Engine(StubModel(), num_blocks=24).generate([p], sampling=sp)[0]
        assert tokens == want, (rid, p, sp, tokens, want)


def test_a_pending_id_is_read_from_the_step_that_samples_it():
    """Ids the last step run samples are PENDING in the kept rows: a step reading one gets, in
    ``src``, the row of that step's tokens to read it from on the device."""
    batch = InputBatch(4, 32, 4, VOCAB)
    sp = SamplingParams(temperature=0)
    batch.apply(SchedulerOutput(new=[NewRequest(7, [1, 2, 3], [0], sp, 0), NewRequest(9, [4, 5], [1], sp, 0)]))
    rows = batch.rows([9, 7])
    ids, src = batch.input_ids(rows, np.array([2, 3]), np.array([0, 0]), each=None)
    assert ids.tolist() == [4, 5, 1, 2, 3] and src is None
    ids, src = batch.input_ids(rows, np.array([2, 2]), np.array([0, 1]), each=2)  # as many rows each: a grid
    assert ids.tolist() == [4, 5, 2, 3] and src is None
    batch.expect(rows, np.array([2, 3]), np.array([0, 1]))  # both sample their next token: 9 in row 0, 7 in row 1
    ids, src = batch.input_ids(batch.rows([7, 9]), np.array([1, 1]), np.array([3, 2]), each=1)
    assert ids.tolist() == [PENDING, PENDING] and src.tolist() == [1, 0]
    batch.apply(SchedulerOutput(tokens={9: [(2, 6)]}))  # the host learned 9's token first
    ids, src = batch.input_ids(batch.rows([7, 9]), np.array([1, 1]), np.array([3, 2]), each=1)
    assert ids.tolist() == [PENDING, 6] and src.tolist() == [1, -1]


def test_sampling_rows_give_the_noise_keys_of_noise_keys():
    """The batch's vectorized noise keys and parameters equal SamplingParams packed one by one."""
    from dsa.engine.sampling import noise_keys

    params = [SamplingParams(temperature=0.7, top_k=3, seed=5), SamplingParams(temperature=0),
              SamplingParams(top_p=0.5, min_p=0.1, logprobs=3), SamplingParams(top_k=VOCAB + 9)]
    seeds, positions = [5, (1 << 64) - 3, 2 ** 40 + 17, 0], [3, 70000, 2 ** 33 + 5, 0]
    batch = SamplingBatch.of(params, seeds, positions, VOCAB)
    want = np.array([(p.temperature or 1.0, p.top_p, p.min_p, p.top_k or VOCAB, p.greedy, *noise_keys(s, pos))
                     for p, s, pos in zip(params, seeds, positions)], dtype=np.float64)
    assert np.array_equal(batch.table, want), (batch.table, want)
    assert batch.sort and batch.logprobs.tolist() == [-1, -1, 3, -1]
    assert SamplingBatch.of(params[1:2] * 3, [1, 2, 3], [4, 5, 6], VOCAB).table is None  # all greedy: an argmax
