"""Persistent pinned buffers (dsa.engine.staging): a buffer is never handed out while its holder has it
or while the copy recorded at its return may still run; a stream of steps of changing sizes uses a
few buffers that only grow; the plan uploaded through them equals the plan uploaded directly.
(CPU: unpinned buffers and a fake event that says when it was waited on; the GPU tests run the
pinned path in every engine step.)"""
import random

import numpy as np
import pytest
import torch

from dsa.engine.staging import MAX_SLOTS, PinnedBuffers
from dsa.model.plan import Bucket, HostPlan, PlanOptions

WAITED = []  # the FakeEvents waited on, in order


class FakeEvent:
    """An event whose copy finishes when the test says so (``done``), or when waited on."""

    def __init__(self):
        self.recorded = self.done = False

    def record(self):
        self.recorded = True

    def query(self):
        return self.done

    def synchronize(self):
        WAITED.append(self)
        self.done = True


def _staging():
    return PinnedBuffers("cpu", torch.int32, event_factory=FakeEvent)


def test_a_held_or_in_flight_buffer_is_never_handed_out():
    s = _staging()
    a = s.take(10)
    b = s.take(10)
    assert a is not b  # a is held
    s.give_back(a, copied=True)  # its copy is in flight
    c = s.take(10)
    assert c is not a and c is not b and len(s.slots) == 3
    a.event.done = True  # a's copy ran
    assert s.take(10) is a


def test_past_the_slot_limit_it_waits_for_the_oldest_copy():
    s = _staging()
    slots = [s.take(8) for _ in range(MAX_SLOTS)]
    for slot in slots:
        s.give_back(slot, copied=True)
    WAITED.clear()
    oldest = slots[0].event
    again = s.take(8)
    assert again is slots[0] and WAITED == [oldest] and len(s.slots) == MAX_SLOTS
    assert again.event is None and again.held


@pytest.mark.parametrize("max_slots", [1, 3, 9], ids=lambda n: f"max{n}")
def test_max_slots_buffers_in_flight_before_a_taker_waits(max_slots):
    s = PinnedBuffers("cpu", torch.int64, event_factory=FakeEvent, max_slots=max_slots)
    slots = [s.take(8) for _ in range(max_slots)]
    for slot in slots:
        s.give_back(slot, copied=True)
    WAITED.clear()
    oldest = slots[0].event
    assert s.take(8) is slots[0] and WAITED == [oldest] and len(s.slots) == max_slots


@pytest.mark.parametrize("array,dtype", [
    (np.array([3, -1, 7], np.int32), torch.int64), (np.array([True, False]), torch.int64),
    (np.array([[1.5, 2.0]], np.float64), torch.float32), (np.zeros(0, np.int64), torch.int64),
], ids=["int32", "bool", "float64", "empty"])
def test_runner_upload_widens_and_copies(array, dtype):
    """``ModelRunner.upload``: a speculating step's small arrays as int64 or float32, a copy of the
    host array (on the CPU; on CUDA a non-blocking copy from a pinned buffer)."""
    from dsa import DSAConfig, DSAModel
    from dsa.engine.runner import ModelRunner
    runner = ModelRunner(DSAModel.random(DSAConfig.tiny(num_hidden_layers=1), dtype=torch.float32, device="cpu"), 8)
    got = runner.upload(array)
    want = torch.from_numpy(np.array(array)).to(dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want), (got, want)
    if array.size:
        array.flat[0] = 0  # the caller's array, changed after the upload
        assert torch.equal(got, want), "upload kept a view of the caller's array"


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_changing_sizes_use_a_few_buffers_that_only_grow(seed):
    rng = random.Random(seed)
    s = _staging()
    held = []
    sizes = {}
    for _ in range(500):
        slot = s.take(rng.randint(1, 5000))
        assert slot.buffer.numel() >= 64
        sizes.setdefault(id(slot), []).append(slot.buffer.numel())
        held.append(slot)
        if len(held) > 2:  # at most two holders at once, as an engine with one step in flight
            s.give_back(held.pop(0), copied=rng.random() < 0.5)
        for t in s.slots:
            if t.event is not None and rng.random() < 0.5:
                t.event.done = True
    assert len(s.slots) <= MAX_SLOTS
    assert all(b == sorted(b) and b[-1] <= 8192 for b in sizes.values())  # powers of two, never shrunk


def test_a_plan_uploaded_through_staging_equals_the_direct_upload():
    s = _staging()
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    plans = [HostPlan.pack([1, 1, 1], [30, 7, 50], tables, 16, "cpu", options=PlanOptions(index_topk=16), input_ids=ids,
                           bucket=Bucket(4, 64)) for ids in ([5, 6, 7], [8, 9, 10])]
    buf = torch.full((plans[0].packer.size,), -7, dtype=torch.int32)
    for host in plans:
        direct = host.upload()
        assert host.upload(buf, s) is buf
        assert torch.equal(buf, direct), (buf, direct)
    assert len(s.slots) == 2 and not any(slot.held for slot in s.slots)  # the first copy still "runs"
    eager = plans[0].upload(staging=s)  # a CPU plan without out stays the host array (never a reused buffer)
    assert all(eager.data_ptr() != slot.buffer.data_ptr() for slot in s.slots)
