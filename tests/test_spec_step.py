"""A speculating step's host work (#39; float32, CPU, CUDA graph capture emulated as the runner's tests do):
one upload, two graph replays and one read of the tokens a greedy step, no eager op between them (counted
with :class:`dsa.testing.StepOps`); a sampled step adds the rejection sampler's ops and its parameters'
uploads only; the packed buffer's parts; the chained proposal rows inside each slot's verify rows; a graph
captured on use changes no request's state."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsa import Engine, SamplingParams, kernels as K
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
        assert by_name.get("copy") == 3, by_name  # its tokens, counts and their packed read in place of the greedy ones
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


def _old_next_ids(ids, tokens, accepted, base, last, after):
    """The MTP observation's next ids and rows before ``pick_ids``: the ids rolled, each request's last row its
    next id, each slot's last accepted row its emitted token (row ``T'``: the padding slots' scratch row)."""
    t = ids.shape[0]
    nxt = torch.cat((torch.roll(ids.long(), -1), ids.new_zeros(1, dtype=torch.int64)))
    nxt[last] = after
    anchor = base + accepted
    nxt[anchor] = tokens.gather(1, accepted[:, None])[:, 0]
    return nxt[:t], anchor.clamp_max(t - 1)


@pytest.mark.parametrize("seed", range(12))
def test_the_observations_next_ids_are_the_old_chains(seed):
    """``spec_step._next_ids`` + :func:`~dsa.kernels.pick_ids` (the interpreter's kernel and the reference) give
    the rolled-and-overwritten ids of before, at every accepted count, for steps of decode requests (padded in
    front to N + 1 rows), prefill chunks and padding requests and slots (a slot's accepted drafts, its rows'
    ids, are its emitted tokens there, as in a step)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    kinds = rng.choice(["decode", "chunk"], int(rng.integers(1, 6)), p=[0.7, 0.3])
    lengths = [n + 1 if kind == "decode" else int(rng.integers(1, 9)) for kind in kinds] + [n + 1] * int(
        rng.integers(0, 3))  # then padding requests
    ends = np.cumsum(lengths)
    t, reqs = int(ends[-1]), len(kinds)
    sampled = [i for i, kind in enumerate(kinds) if kind == "decode" or rng.random() < 0.5]
    k = np.array([int(rng.integers(0, n + 1)) if kinds[i] == "decode" else 0 for i in sampled], np.int64)
    slots = len(sampled) + int(rng.integers(0, 3))  # then padding slots
    base = ends[sampled] - 1 - k
    last, after = ends[:reqs] - 1, rng.integers(0, 256, reqs)
    accepted = np.zeros(slots, np.int64)
    accepted[:len(k)] = [int(rng.integers(0, kk + 1)) for kk in k]
    tokens = torch.full((slots, n + 1), -1, dtype=torch.int64)
    for s in range(slots):
        tokens[s, :accepted[s] + 1] = torch.from_numpy(rng.integers(0, 256, accepted[s] + 1))
    ids = torch.from_numpy(rng.integers(0, 256, t).astype(np.int32))
    for s, b in enumerate(base):  # an accepted draft is the token emitted for its row (the rows read the drafts)
        ids[b + 1:b + 1 + accepted[s]] = tokens[s, :accepted[s]].to(torch.int32)
    want = _old_next_ids(ids, tokens, torch.from_numpy(accepted), torch.from_numpy(np.concatenate(
        (base, np.full(slots - len(k), t)))), torch.from_numpy(np.concatenate((last, np.full(len(lengths) - reqs, t)))),
        torch.from_numpy(np.concatenate((after, np.zeros(len(lengths) - reqs, np.int64)))))
    made = {cached: spec_step._next_ids(t, n + 1, base, k, last, after, cached) for cached in (False, True)}
    assert all(np.array_equal(made[False][name], made[True][name]) for name in made[False])
    arrays = {name: torch.from_numpy(a.astype(np.int32)) for name, a in made[True].items()}
    anchor = torch.from_numpy(np.concatenate((np.minimum(base, t - 1), np.full(slots - len(k), t - 1))))
    for backend in ("torch", "triton"):
        got = K.pick_ids(arrays["next_id"], tokens.reshape(-1), arrays["next_token"], ids, arrays["next_row"],
                         backend=backend)
        assert torch.equal(got, want[0]), backend
    assert torch.equal(anchor + torch.from_numpy(accepted), want[1])


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


def test_the_tokens_copy_is_queued_before_the_drafters_pass(tiny, monkeypatch):
    """The step's read waits for the first pass alone: its copy is queued before the drafter's pass, so the
    host finishes the step and packs the next one while that pass runs; the same tokens, and the draft and
    verify seconds still counted."""
    from dsa.engine import sampling, speculative
    model, reference = tiny
    engine = Engine(model, num_blocks=64, max_batch_tokens=64, speculative_tokens=2)
    order = []
    finish, pending = spec_step.finish, sampling.PendingSample.__init__
    monkeypatch.setattr(spec_step, "finish", lambda *a: (order.append("observe"), finish(*a))[1])
    monkeypatch.setattr(speculative.PendingSample, "__init__",
                        lambda self, *a: (order.append("copy"), pending(self, *a))[1])
    assert engine.generate(PROMPTS, NEW) == reference
    assert order and order == ["copy", "observe"] * (len(order) // 2), order
    s = engine.stats.spec
    assert s.verify_steps > 0 and s.verify_s > 0 and s.draft_s > 0


def test_eager_steps_keep_no_layout_cache(tiny):
    """Only a graph bucket's steps (whose layouts repeat) cache their next-id rows and draft caps: an eager
    step's layouts follow its prompts, and a cache of them would grow with the requests served."""
    from dsa.engine import drafter
    model, reference = tiny
    engine = Engine(model, num_blocks=64, max_batch_tokens=64, speculative_tokens=2)  # eager: no graphs on CPU
    before = spec_step._next_rows.cache_info().currsize, drafter._draft_cap.cache_info().currsize
    assert engine.generate(PROMPTS, NEW) == reference
    assert (spec_step._next_rows.cache_info().currsize, drafter._draft_cap.cache_info().currsize) == before
