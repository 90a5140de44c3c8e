"""The scheduler: its typed output (rows, sampled rows, the runner's deltas), blocks on demand with
preemption, in-flight prefix sharing, the one writer of every Request field. The engine-driven
checks run on the stub model (tests/stub_model.py): milliseconds a step, the same bookkeeping."""
import random
import sys

import pytest

from dsa import Engine, SamplingParams
from dsa.engine.scheduler import PENDING, Request, Scheduler
from model_utils import prompt, tiny_model
from stub_model import VOCAB, StubModel, reference


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
    assert out.rids == [0, 1] and out.num_rows == [30, 10] and out.computed == [0, 0], out
    assert [n.rid for n in out.new] == [0, 1] and out.new[1].tokens == b.tokens and out.new[1].blocks == b.blocks
    assert [(x.row, x.request, x.index, x.last) for x in out.sampled] == [(0, a, 30, False)]  # a's prompt is done
    assert a.tokens[30] == PENDING and a.computed == 30 and b.computed == 10  # computed once scheduled
    s.update([(out.sampled[0], 7, False)])
    out = s.schedule()
    assert out.rids == [0, 1] and out.num_rows == [1, 39] and out.computed == [30, 10] and not out.new  # a decodes
    assert out.tokens == {0: [(30, 7)]}, out.tokens  # no launched row read a's token: the runner needs it
    assert len(a.blocks) == 2 and len(b.blocks) == 4  # blocks for the rows computed, not the worst case
    assert out.grants == [(1, b.blocks[1:])], out.grants


def test_a_token_some_launched_row_read_is_not_sent_again():
    """Overlapped scheduling: step N+1 is scheduled (reading step N's token on the device) before
    step N's tokens reach the host; those tokens are then no news to the runner."""
    s = Scheduler(num_blocks=8, block_size=16, max_batch_tokens=64)
    a = _req(0, 5, 8)
    s.add(a)
    first = s.schedule()
    second = s.schedule()  # a's decode row reads the token first samples
    assert second.rids == [0] and second.computed == [5] and a.tokens[5:] == [PENDING, PENDING]
    s.update([(first.sampled[0], 11, False)])
    s.update([(second.sampled[0], 12, False)])
    third = s.schedule()
    assert a.tokens[5:7] == [11, 12] and third.tokens == {0: [(6, 12)]}, third.tokens


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = Scheduler(num_blocks=4, block_size=16, max_batch_tokens=64)
    a, b = _req(0, 32, 40), _req(1, 31, 40)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.num_rows == [32, 31]
    s.update([(x, 1, False) for x in out.sampled])
    out = s.schedule()  # a needs a third block for token 33: none is free, b (newest) goes
    assert out.rids == [0] and out.preempted == [1] and list(s.waiting) == [b]
    assert b.computed == 0 and b.blocks == [] and b.num_preemptions == 1 and s.blocks.num_used == 3
    assert out.finished == [1]  # the runner hears that b's blocks are gone, with the step that ran without it
    assert out.grants == [(0, a.blocks[2:])] and not out.new
    s.update([(out.sampled[0], 2, True)])  # a ends: its blocks go back
    again = s.schedule()  # b comes back: a fresh row with all its tokens and its blocks of now
    assert again.finished == [0] and [n.rid for n in again.new] == [1], again
    assert again.new[0].tokens == b.tokens[:32] and PENDING not in again.new[0].tokens
    assert again.new[0].blocks == b.blocks and b.computed == 32 and b.num_preemptions == 1


def test_rids_that_left_wait_for_a_step_that_runs():
    """A request that leaves when the next step is empty (the engine goes idle) reaches the
    runner's ``finished`` with the next step that runs (acdaade: it was dropped)."""
    s = Scheduler(num_blocks=8, block_size=16, max_batch_tokens=64)
    a = _req(0, 5, 1)
    s.add(a)
    out = s.schedule()
    assert out.sampled[0].last  # its length limit is that token
    s.update([(out.sampled[0], 3, True)])
    assert a.tokens[5:] == [3] and not s.running and s.blocks.num_used == 0
    idle = s.schedule()
    assert not idle and idle.finished == []
    s.add(_req(1, 4))
    assert s.schedule().finished == [0]


def _stub_prompts(rng, n, shared=None):
    doc = prompt(40, 999, VOCAB)
    return [(doc[:rng.randint(0, 40)] if shared else []) + prompt(rng.randint(1, 50), rng.randint(0, 10 ** 6), VOCAB)
            for _ in range(n)]


def run_to_the_end(engine, prompts: list, new: int) -> tuple:
    """Add every prompt, step until nothing is left: ``(tokens of each prompt in order, the most
    requests that ran at once)``."""
    rids = [engine.add_request(p, new) for p in prompts]
    out, most = {r: [] for r in rids}, 0
    while engine.has_work():
        for rid, toks in engine.step().items():
            out[rid] += toks
        most = max(most, len(engine.running))
    return [out[r] for r in rids], most


def test_pool_for_four_worst_cases_runs_twelve_requests_stub():
    """12 requests with large max_tokens in a pool that fits 4 of them at their worst case: more
    than 4 run at once, all complete with the stub's tokens (the same as alone), and no block
    stays held."""
    prompts = [prompt(20 + i, 100 + i, VOCAB) for i in range(12)]
    new = 40
    worst = -(-(20 + 11 + new) // 16)  # blocks of the longest request at its end
    engine = Engine(StubModel(), num_blocks=4 * worst, max_batch_tokens=256)
    out, most = run_to_the_end(engine, prompts, new)
    assert most > 4, most
    assert out == [reference(p, new) for p in prompts]
    assert engine.stats.preemptions > 0 and engine.stats.blocks_in_use == 0
    assert engine.scheduler.blocks.num_free == 4 * worst


@pytest.mark.slow
def test_pool_for_four_worst_cases_runs_twelve_requests(model):
    """The same on the tiny model: preemption and recomputation change no token."""
    prompts = [prompt(20 + i, 100 + i) for i in range(12)]
    new = 40
    worst = -(-(20 + 11 + new) // 16)  # blocks of the longest request at its end
    engine = Engine(model, num_blocks=4 * worst, max_batch_tokens=256)
    out, most = run_to_the_end(engine, prompts, new)
    alone = [Engine(model, num_blocks=4 * worst).generate([p], new)[0] for p in prompts]
    assert most > 4, most
    assert out == alone
    assert engine.stats.preemptions > 0 and engine.stats.blocks_in_use == 0
    assert engine.scheduler.blocks.num_free == 4 * worst


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


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_rows_of_requests_that_left_are_freed(seed):
    """A request that finished, was aborted or preempted gives its batch row back with the next
    step that runs, also when the step that saw it leave scheduled nothing (the engine went idle):
    after each wave no row is held for a request of an earlier wave, and no row leaks."""
    rng = random.Random(seed)
    engine = Engine(StubModel(), num_blocks=8, max_batch_tokens=48, max_num_seqs=8)  # 8 blocks: preemptions
    batch = engine.runner.batch
    earlier = set()
    for _ in range(6):
        wave = [engine.add_request(p, rng.randint(1, 12)) for p in _stub_prompts(rng, 8)]
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            if steps == 2:
                engine.abort(wave[0])
        assert not set(batch.row_of) & earlier, (sorted(batch.row_of), sorted(earlier))
        assert len(batch.row_of) + len(batch.free_rows) == 8, (batch.row_of, batch.free_rows)
        earlier |= set(wave)
    assert engine.stats.preemptions > 0


def test_a_request_run_as_prefilled_starts_with_its_last_token():
    """run_as_prefilled (the engine benchmark's stand-in prefill): blocks for all its tokens, its
    first step one decode row; with the cache rows written as a prefill would have, its tokens are
    the prefilled request's."""
    engine = Engine(StubModel(), num_blocks=16, prefix_caching=False)
    prompts = [prompt(40, 1, VOCAB), prompt(17, 2, VOCAB)]
    rids = [engine.add_request(p, 6) for p in prompts]
    s, p = engine.scheduler, 16
    for req, ids in zip(list(s.waiting), prompts):
        s.run_as_prefilled(req)
        assert req.computed == len(ids) - 1 and len(req.blocks) == -(-len(ids) // p)
        for pos, tok in enumerate(ids[:-1]):  # the stand-in rows: what the prompt's prefill writes
            engine.caches.tokens[req.blocks[pos // p] * p + pos % p] = tok
    assert not s.waiting
    out = {r: [] for r in rids}
    while engine.has_work():
        for rid, toks in engine.step().items():
            out[rid] += toks
    assert [out[r] for r in rids] == [reference(q, 6) for q in prompts]
    assert engine.stats.tokens == 2 * 6 and engine.stats.prefill_chunks == 0  # decode rows only


FIELDS = ("tokens", "blocks", "block_names", "chain", "computed", "num_preemptions")
MUTATORS = ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__",
            "__iadd__", "__imul__")


def test_every_request_field_is_written_by_the_scheduler_alone(monkeypatch):
    """Once the engine has built a Request, each of its fields is assigned or mutated only in
    dsa.engine.scheduler: a run with prefix hits, preemptions, aborts, stop tokens and both
    scheduling modes records the module of every write."""
    writes = {}

    def record(name):
        writes.setdefault(name, set()).add(sys._getframe(2).f_globals.get("__name__"))

    class Watched(list):
        pass

    for m in MUTATORS:
        def method(self, *args, _m=m):
            record(self.field)
            return getattr(list, _m)(self, *args)
        setattr(Watched, m, method)

    real_init = Request.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        object.__setattr__(self, "_built", True)

    def setattr_(self, name, value):
        if getattr(self, "_built", False):
            record(name)
        if isinstance(value, list):
            value = Watched(value)
            value.field = name
        object.__setattr__(self, name, value)

    monkeypatch.setattr(Request, "__init__", init)
    monkeypatch.setattr(Request, "__setattr__", setattr_)
    rng = random.Random(0)
    for overlap in (True, False):
        engine = Engine(StubModel(), num_blocks=10, max_batch_tokens=48, overlap=overlap)
        live = []
        for i in range(30):
            p = _stub_prompts(rng, 1, shared=True)[0]
            live.append(engine.add_request(p, sampling=SamplingParams(max_tokens=rng.randint(1, 20),
                                                                      stop_token_ids=[rng.randrange(VOCAB)])))
            if i % 7 == 6:
                engine.abort(live.pop(rng.randrange(len(live))))
            engine.step()
        while engine.has_work():
            engine.step()
        assert engine.stats.preemptions > 0 and engine.stats.prefix.hit_tokens > 0
    assert set(writes) == set(FIELDS), writes  # every field was written (the recording works)
    assert all(modules == {"dsa.engine.scheduler"} for modules in writes.values()), writes
