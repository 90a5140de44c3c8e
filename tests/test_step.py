"""The step: one plan per step read by every layer, and no host round trip inside a decode step.

On CPU the host-sync rule is checked for the code around the kernels (plan, model, layers, indexer,
cache gathers, runner) by making every tensor-to-host conversion raise while a decode, prefill or
mixed step runs, except inside the ops of ``dsa.kernels``, whose CPU references may read lengths on
the host (there is nothing to wait for on a CPU); the GPU test runs the whole step under
``torch.cuda.set_sync_debug_mode("error")``, where the Triton kernels run.
"""
import functools

import pytest
import torch

import dsa.cache.storage
import dsa.indexer.lightning
import dsa.model.attention
import dsa.model.plan
from dsa import Engine
from dsa.engine import spec_step
from dsa.engine.drafter import ScriptedDrafter
from dsa.indexer import LightningIndexer
from model_utils import prompt, tiny_model


@pytest.fixture(scope="module", params=["exact", "fp8"])
def model(request):
    # dense MLP: MoE layers read their routing on the host, so MoE models stay on the eager path
    return tiny_model(indexer_precision=request.param, n_routed_experts=None)


def _decoding_engine(model, n=3, speculative_tokens=0):
    drafter = ScriptedDrafter(lambda tokens, k: tokens[-k:], speculative_tokens, model.config.vocab_size) \
        if speculative_tokens else None  # a verify step's N + 1 rows a request (the drafts: any ids)
    engine = Engine(model, num_blocks=32, overlap=False, speculative_tokens=speculative_tokens, drafter=drafter)
    for i in range(n):
        engine.add_request(prompt(20 + 7 * i, 40 + i), 8)
    while any(r.prefilling for r in engine.running.values()) or engine.waiting:
        engine.step()
    return engine


GUARDED = ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero")


def _step_of(kind: str, model):
    """An engine and its next scheduled step: decode rows only, a fresh prefill (dense then sparse
    rows, the MHA path among them), or a mixed step (decode rows and a prefill chunk behind a prefix);
    ``verify``: a speculating engine's (N = 2: decode requests of 3 rows), alone or mixed."""
    if kind == "prefill":
        engine = Engine(model, num_blocks=32, overlap=False)
        engine.add_request(prompt(45, 60), 4)
    else:
        engine = _decoding_engine(model, speculative_tokens=2 if kind.startswith("verify") else 0)
        if kind.endswith("mixed"):
            engine.add_request(prompt(60, 61), 4)
            engine.scheduler.max_batch_tokens = len(engine.running) * (1 + engine.speculative_tokens) + 25
            engine.step()  # now it continues behind a 25-token prefix
    return engine, engine.scheduler.schedule()


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed", "verify", "verify-mixed"])
def test_a_step_makes_no_host_round_trip(model, kind, monkeypatch):
    engine, batch = _step_of(kind, model)
    assert {"decode": lambda q: q == [1, 1, 1], "prefill": lambda q: q == [45],
            "mixed": lambda q: q[:3] == [1, 1, 1] and q[3] > 1, "verify": lambda q: q == [3, 3, 3],
            "verify-mixed": lambda q: q[:3] == [3, 3, 3] and q[3] > 3}[kind](batch.num_rows), batch.num_rows
    run = engine.runner.run
    if kind.startswith("verify"):  # a speculating engine's step: the drafts, the target pass, the acceptance
        engine.runner.batch.apply(batch)

        def run(out):
            result = spec_step.run(engine.runner, out)
            spec_step.finish(engine.runner, result)  # the drafter's pass over the rows
            return result
    inside_op = [0]
    originals = {name: getattr(torch.Tensor, name) for name in GUARDED}

    def guard(name):
        def check(*args, **kwargs):
            if not inside_op[0]:
                raise AssertionError(f"Tensor.{name} inside the step, outside the kernel ops")
            return originals[name](*args, **kwargs)
        return check

    def op(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            inside_op[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside_op[0] -= 1
        return run

    with monkeypatch.context() as m:
        for module in (dsa.model.attention, dsa.indexer.lightning, dsa.model.plan, dsa.cache.storage):
            for name, value in vars(module).items():  # the kernel ops these modules call (CPU references may sync)
                if callable(value) and getattr(value, "__module__", "").startswith("dsa.kernels"):
                    m.setattr(module, name, op(value))
        for name in GUARDED:
            m.setattr(torch.Tensor, name, guard(name))
        m.setattr(torch, "tensor", guard("torch.tensor"))
        result = run(batch)  # plan (host ints, one upload) + every layer
    rows = len(batch.sampled) * 3 if kind.startswith("verify") else len(batch)  # N + 1 rows a sampled request
    assert result.logits.reshape(-1, model.config.vocab_size).shape[0] == rows and torch.isfinite(result.logits).all()


def test_one_plan_per_step_read_by_every_layer(model, monkeypatch):
    engine = _decoding_engine(model)
    builds, plans = [], []
    real_derive, real_forward = dsa.model.plan.HostPlan.derive, LightningIndexer.forward
    monkeypatch.setattr(dsa.model.plan.HostPlan, "derive",
                        lambda self, buf: builds.append(real_derive(self, buf)) or builds[-1])

    def spy(self, x, qr, batch, *rest):
        plans.append(batch)
        return real_forward(self, x, qr, batch, *rest)

    monkeypatch.setattr(LightningIndexer, "forward", spy)
    engine.add_request(prompt(30, 50), 2)  # a mixed step: decode rows and a prefill chunk
    engine.step()
    assert len(builds) == 1
    indexer_layers = sum(layer.self_attn.indexer is not None for layer in model.layers)
    assert len(plans) == indexer_layers and all(p is builds[0].indexer for p in plans)


def test_cuda_graphs_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(tiny_model(), num_blocks=4, cuda_graphs=True)  # CPU, and MoE layers
    assert not Engine(tiny_model(), num_blocks=4).runner.use_graphs
