"""The device ops inside a speculating step's two graph bodies and a plain decode step's (issue #39: on the
H200 a speculating step at batch 1 is bound by the number of kernels it launches), counted on the CPU by
:class:`dsa.testing.DeviceOps` with the CUDA graph capture emulated (``record`` keeps each body): the glue
around the target model and the MTP module (the plans' device facts, the greedy acceptance, the drafts read
into the verify rows, the MTP module's next ids and state) stays at the counts reached; a plain decode step
derives its plan by one op."""
import pytest

from dsa import Engine, SamplingParams
from dsa.testing import DeviceOps, record_bodies
from model_utils import prompt, spec_model

# N -> the most glue ops (everything outside "target" and "mtp_step") of the two bodies together, as reached by
# #39's cuts (before them, counted alike: 71, 77 and 83; at N = 2 derive 14 + 11, accept 15, the passes' 18 + 19)
GLUE_MAX = {1: 17, 2: 20, 3: 22}
MODEL_PHASES = ("target", "mtp_step")


@pytest.fixture(scope="module")
def model():
    return spec_model()


def _bodies(model, n: int, monkeypatch) -> list:
    """The graph bodies of a decode step (N = 0: one) or a verify step (two) of one request, B = 1, greedy."""
    engine = Engine(model, num_blocks=32, prefix_caching=False, speculative_tokens=n)
    bodies = record_bodies(engine.runner, monkeypatch)
    engine.add_request(prompt(40, 3, vocab=256), sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # the first decode step: its bucket's graphs captured
    assert len(bodies) == (2 if n else 1)
    return bodies


def _glue(counts: dict) -> int:
    return sum(v for phase, v in counts.items() if phase not in MODEL_PHASES)


@pytest.mark.parametrize("n", sorted(GLUE_MAX))
def test_a_speculating_steps_glue_stays_at_its_count(model, monkeypatch, n):
    ops = DeviceOps()
    bodies = _bodies(model, n, monkeypatch)
    ops.counting(monkeypatch)
    lines, glue = [], 0
    for i, body in enumerate(bodies):
        counts = ops.count(body, f"glue{i}")
        glue += _glue(counts)
        lines += [f"body {i}: {counts}", ops.breakdown()]
    assert glue <= GLUE_MAX[n], f"N = {n}: {glue} glue ops, at most {GLUE_MAX[n]} expected\n" + "\n".join(lines)


def test_a_plain_decode_step_derives_its_plan_by_one_op(model, monkeypatch):
    ops = DeviceOps()
    (body,) = _bodies(model, 0, monkeypatch)
    counts = ops.counting(monkeypatch).count(body, "glue")
    assert _glue(counts) <= 1 and counts.get("derive") == 1, f"{counts}\n{ops.breakdown()}"  # (before #39: 3)
