"""The scheduler: its typed output, blocks on demand with preemption, in-flight prefix sharing, and
the runner's persistent block tables (a step's tables equal ones rebuilt from the requests)."""
import random

import numpy as np
import pytest

import dsa.model.plan
from dsa import Engine
from dsa.engine.scheduler import Request, Scheduler
from tests.model_utils import prompt, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(n_routed_experts=None)


def _req(rid, n, new=4):
    return Request(rid, prompt(n, rid), n, new)


def test_output_puts_decode_rows_first_and_respects_the_budget():
    s = Scheduler(num_blocks=64, block_size=16, max_batch_tokens=40)
    a, b = _req(0, 30), _req(1, 50)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.requests == [a, b] and out.num_rows == [30, 10] and out.admitted == [a, b]
    s.advance(a, 30)
    a.tokens.append(7)
    s.advance(b, 10)
    out = s.schedule()
    assert out.requests == [a, b] and out.num_rows == [1, 39] and not out.admitted  # a decodes, b continues
    assert len(a.blocks) == 2 and len(b.blocks) == 4  # blocks for the rows computed, not the worst case


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = Scheduler(num_blocks=4, block_size=16, max_batch_tokens=64)
    a, b = _req(0, 32, 40), _req(1, 31, 40)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.num_rows == [32, 31]
    for r, n in zip(out.requests, out.num_rows):
        s.advance(r, n)
        r.tokens.append(1)
    out = s.schedule()  # a needs a third block for token 33: none is free, b (newest) goes
    assert out.requests == [a] and out.preempted == [b] and list(s.waiting) == [b]
    assert b.computed == 0 and b.blocks == [] and b.num_preemptions == 1 and s.blocks.num_used == 3
    assert out.finished == [1]  # the runner hears that b's blocks are gone, with the step that ran without it
    assert s.schedule().finished == []


def test_pool_for_four_worst_cases_runs_twelve_requests(model):
    """12 requests with large max_tokens in a pool that fits 4 of them at their worst case: more
    than 4 run at once, all complete with the tokens they get alone, and no block stays held."""
    prompts = [prompt(20 + i, 100 + i) for i in range(12)]
    new = 40
    worst = -(-(20 + 11 + new) // 16)  # blocks of the longest request at its end
    engine = Engine(model, num_blocks=4 * worst, max_batch_tokens=256)
    most = 0
    rids = [engine.add_request(p, new) for p in prompts]
    out = {r: [] for r in rids}
    while engine.has_work():
        for rid, toks in engine.step().items():
            out[rid] += toks
        most = max(most, len(engine.running))
    alone = [Engine(model, num_blocks=4 * worst).generate([p], new)[0] for p in prompts]
    assert most > 4, most
    assert [out[r] for r in rids] == alone
    assert engine.stats.preemptions > 0 and engine.stats.blocks_in_use == 0 and engine.allocator.num_free == 4 * worst


def test_requests_on_one_document_sent_together_compute_it_once(model):
    doc = prompt(96, 7)  # 6 blocks
    questions = [prompt(5, 20 + i) for i in range(4)]
    together = Engine(model, num_blocks=64, max_batch_tokens=32)  # the document takes 3 steps
    out = together.generate([doc + q for q in questions], 3)
    one_by_one = Engine(model, num_blocks=64, max_batch_tokens=32)
    alone = [one_by_one.generate([doc + q], 3)[0] for q in questions]
    assert out == alone
    # rows computed: the document once, then each question (and the block holding its last token)
    assert together.stats.tokens == one_by_one.stats.tokens
    assert together.stats.prefix.hit_tokens == 3 * 96


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("num_blocks", [6, 24], ids=lambda n: f"{n}blocks")  # 6: preemption while idle steps
def test_block_tables_kept_across_steps_equal_tables_rebuilt_from_the_requests(model, seed, num_blocks, monkeypatch):
    rng = random.Random(seed)
    engine = Engine(model, num_blocks=num_blocks, max_batch_tokens=48)
    real_pack = dsa.model.plan.HostPlan.pack.__func__
    checked = [0]

    def pack(cls, query_lens, context_lens, block_tables, block_size, device, **kw):
        reqs = engine.scheduler.running.values()
        by_len = {}
        for r in reqs:
            by_len.setdefault(r.computed, []).append(r)
        for row, c in zip(np.asarray(block_tables), context_lens):  # some running request has exactly this row
            assert any(np.array_equal(row[:len(r.blocks)], r.blocks) and not row[len(r.blocks):].any()
                       for r in by_len[c]), row
        checked[0] += 1
        return real_pack(cls, query_lens, context_lens, block_tables, block_size, device, **kw)

    monkeypatch.setattr(dsa.model.plan.HostPlan, "pack", classmethod(pack))
    live = []
    for _ in range(40):
        action = rng.random()
        if action < 0.3:
            live.append(engine.add_request(prompt(rng.randint(1, 60), rng.randint(0, 999)), rng.randint(1, 20)))
        elif action < 0.4 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        if engine.has_work():
            engine.step()
    while engine.has_work():
        engine.step()
    assert checked[0] > 10 and engine.stats.blocks_in_use == 0


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_block_table_rows_of_requests_that_left_are_freed(model, seed):
    """A request that finished, was aborted or preempted gives its row back with the next step that
    runs, also when the step that saw it leave scheduled nothing (the engine went idle): after each
    wave no row is held for a request of an earlier wave, and the table never grows."""
    rng = random.Random(seed)
    engine = Engine(model, num_blocks=8, max_batch_tokens=48)  # 8 blocks of 16: requests get preempted
    tables = engine.runner.tables
    rows = len(tables.table)
    earlier = set()
    for _ in range(6):
        wave = [engine.add_request(prompt(rng.randint(1, 60), rng.randint(0, 999)), rng.randint(1, 12))
                for _ in range(8)]
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            if steps == 2:
                engine.abort(wave[0])
        assert not set(tables.row_of) & earlier, (sorted(tables.row_of), sorted(earlier))
        earlier |= set(wave)
    assert len(tables.table) == rows and engine.stats.preemptions > 0
