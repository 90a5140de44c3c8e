"""A speculating step's host work (#39; float32, CPU, CUDA graph capture emulated as the runner's tests do):
one upload, two graph replays and one read of the tokens a greedy step, no eager op between them (counted
with :class:`dsa.testing.StepOps`); a sampled step adds the rejection sampler's ops and its parameters'
uploads only; the packed buffer's parts; the chained proposal rows inside each slot's verify rows; a graph
captured on use changes no request's state."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsa import Engine, SamplingParams
from dsa.engine import spec_step
from dsa.engine.drafter import ScriptedDrafter, Slots
from dsa.model.byte_vocab import BYTE_VOCAB_SIZE
from dsa.model.plan import Bucket, HostPlan, PackedStep
from dsa.testing import StepOps
from model_utils import greedy_oracle, prompt, spec_model

V = BYTE_VOCAB_SIZE
PROMPTS = [prompt(n, 50 + n, vocab=256) for n in (5, 14, 23)]
NEW = 9


@pytest.fixture(scope="module")
def tiny():
    m = spec_model()
    return m, Engine(m, num_blocks=64).generate(PROMPTS, NEW)


def _emulate(runner, ops: StepOps, monkeypatch) -> list:
    """CUDA graphs on the CPU: ``record`` runs the step once; a replay (counted by ``ops``) reruns it."""
    captured = []

    def record(step):
        outputs = step()
        captured.append(None)
        rerun = ops.replaying(lambda: [o.copy_(r) for o, r in zip(outputs, step()) if o is not None])
        return SimpleNamespace(replay=rerun), outputs

    monkeypatch.setattr(runner, "use_graphs", True)
    monkeypatch.setattr(runner, "record", record)
    return captured


def _count_steps(engine, ops: StepOps, monkeypatch, prompts, sampling) -> list:
    """``ops`` of each verify step after the prompts' prefill (one StepOps a step)."""
    mode = ops.counting(monkeypatch)
    for p in prompts:
        engine.add_request(p, sampling=sampling)
    engine.step()  # the prefill
    steps = []
    while engine.has_work():
        ops.__init__()
        with torch.no_grad(), mode:
            engine.step()
        steps.append((ops.eager, ops.uploads, ops.reads, ops.replays, dict(ops.ops)))
    return steps


@pytest.mark.parametrize("drafter", ["mtp", "scripted"])
def test_a_replayed_greedy_step_is_one_upload_two_replays_and_one_read(tiny, monkeypatch, drafter):
    model, reference = tiny
    n = 2
    d = None if drafter == "mtp" else ScriptedDrafter(greedy_oracle(PROMPTS, reference), n, V,
                                                      wrong=lambda count, j: j == count % 3)
    engine = Engine(model, num_blocks=64, max_batch_tokens=64, speculative_tokens=n, drafter=d)
    ops = StepOps()
    captured = _emulate(engine.runner, ops, monkeypatch)
    engine.warmup(progress=False)
    before = len(captured)
    steps = _count_steps(engine, ops, monkeypatch, PROMPTS, SamplingParams(max_tokens=NEW, temperature=0))
    assert len(steps) > 2 and len(captured) == before
    for eager, uploads, reads, replays, by_name in steps:
        assert (eager, uploads, reads, replays) == (0, 1, 1, 2), by_name
    assert 0 < engine.stats.spec.verify_steps <= len(steps)  # (a last step of no draft is no verify step)
    if drafter == "scripted":
        assert engine.stats.spec.accepted == engine.drafter.accepted > 0


def test_a_sampled_step_adds_the_rejection_sampler_alone(tiny, monkeypatch):
    model, _ = tiny
    engine = Engine(model, num_blocks=64, max_batch_tokens=64, speculative_tokens=2)
    ops = StepOps()
    _emulate(engine.runner, ops, monkeypatch)
    engine.warmup(progress=False)
    sampling = SamplingParams(max_tokens=NEW, temperature=0.8, top_p=0.9, seed=3)
    steps = _count_steps(engine, ops, monkeypatch, PROMPTS[:2], sampling)
    for eager, uploads, reads, replays, by_name in steps:
        # the step's buffer, then temperature, top_k, top_p, min_p, greedy and the noise keys
        assert (uploads, reads, replays) == (7, 1, 2) and eager > 0, by_name
        assert by_name.get("copy") == 2, by_name  # its tokens and counts in place of the greedy ones
    again = Engine(model, num_blocks=64, max_batch_tokens=64, speculative_tokens=2)
    assert again.generate(PROMPTS[:2], sampling=sampling) == engine.generate(PROMPTS[:2], sampling=sampling)


def _two_plans():
    first = HostPlan.pack([3, 2], [17, 40], np.arange(8).reshape(2, 4), 16, "cpu", input_ids=np.arange(5),
                          bucket=Bucket(4, 64, 3), next_n=3)
    second = HostPlan.pack([1, 1], [5, 9], np.arange(2)[:, None], 16, "cpu", bucket=Bucket(4, 64, 1))
    return first, second


def test_packed_step_parts_are_each_plan_and_array():
    first, second = _two_plans()
    step = PackedStep({"a": first, "b": second}, {"x": np.array([7, -1, 3]), "y": np.arange(6).reshape(3, 2)})
    buf = step.upload("cpu")
    assert buf.numel() == step.size == first.packer.size + second.packer.size + 9
    assert torch.equal(step.part(buf, "a"), first.upload()) and torch.equal(step.part(buf, "b"), second.upload())
    assert step.part(buf, "x").tolist() == [7, -1, 3] and step.part(buf, "y").tolist() == [[0, 1], [2, 3], [4, 5]]
    for name, host in (("a", first), ("b", second)):
        got, want = step.derive(buf, name), host.derive(host.upload())
        assert torch.equal(got.slot_mapping, want.slot_mapping) and torch.equal(got.positions, want.positions)
    other = PackedStep({"a": _two_plans()[0], "b": second}, {"x": np.zeros(3), "y": np.ones((3, 2))})
    assert other.layout == step.layout  # one bucket, one layout: a graph's buffer is refilled in place


def test_chained_proposal_rows_stay_inside_each_slots_verify_rows(tiny):
    """N = 3: a slot of k drafts chains its row j at c + j - 2 while j <= k + 1, else at a position inside its
    verify rows c .. c + k (which the step's observation rewrites); a graph bucket chains N - 1 rows a slot."""
    model, _ = tiny
    engine = Engine(model, num_blocks=64, speculative_tokens=3)
    c, k = np.array([20, 33, 47]), np.array([0, 1, 3])
    rows = np.array([0, 1, 2])
    engine.runner.batch.num_blocks[rows] = 4  # each row's blocks cover its verify rows
    for bucket in (None, Bucket(4, 256, 4)):
        plans, arrays = engine.drafter.prepare(engine.runner, Slots(rows, c, k, 3 if bucket is None else 4, bucket))
        assert sorted(plans) == ["chain2", "chain3"]
        for j, host in ((2, plans["chain2"]), (3, plans["chain3"])):
            at = host.context_lens[:3]  # each row's position
            assert ((at >= c) & (at <= c + np.maximum(k, 0))).all(), (j, at)
            assert at[2] == c[2] + j - 2  # the slot that drafts all three: its true chain position
        assert arrays["state"].tolist() == rows.tolist() + ([] if bucket is None else [engine.drafter.scratch])
    plans, _ = engine.drafter.prepare(engine.runner, Slots(rows[:2], c[:2], k[:2], 2, None))
    assert not plans  # eager: as many chained rows as the longest request needs (1 draft: none)


def test_a_graph_captured_on_use_changes_no_request_state(tiny, monkeypatch):
    """A step's graphs are captured on its bucket's padding step: the caches and the drafter's state of
    every request row are as before (only its scratch row is written)."""
    model, _ = tiny
    engine = Engine(model, num_blocks=64, speculative_tokens=2)
    engine.add_request(PROMPTS[2], 6)
    engine.step()
    engine.step()  # eager: a real state and caches
    drafter, runner = engine.drafter, engine.runner
    first, hidden = drafter.first[:-1].clone(), drafter.hidden[:-1].clone()
    caches = [t.data.clone() for layer in runner.caches for t in layer if t is not None]
    _emulate(runner, StepOps(), monkeypatch)
    spec_step.capture(runner, Bucket(2, 256, 3))
    assert torch.equal(drafter.first[:-1], first) and torch.equal(drafter.hidden[:-1], hidden)
    after = [t.data for layer in runner.caches for t in layer if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, caches))
