"""What a speculating decode step does on the host (issue #39), counted on the CPU: eager aten ops outside
graph replays (by name), host-to-device uploads, device-to-host reads and graph replays per step, with CUDA
graph capture emulated (``record`` runs the step; a replay reruns it, its ops not counted), so the counts are
the ones a CUDA step launches. The trained default and its MTP module, B = 1, greedy. With ``--bodies``, the
device ops inside the step's graph bodies instead (:class:`dsa.testing.DeviceOps`, by phase; N = 0: the plain
decode step's one body), the trained default in bf16.

    python benchmarks/count_spec_step.py [--speculative-tokens N] [--new 24] [--context 200] [--bodies]
"""
import argparse
import json
import sys
from types import SimpleNamespace

import torch

from dsa.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.model.presets import default_model
from dsa.testing import DeviceOps, StepOps, record_bodies


class _Patch:
    """A monkeypatch outside pytest (``setattr`` kept until ``undo``)."""

    def __init__(self):
        self.saved = []

    def setattr(self, owner, name, value):
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self):
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)


def emulate_graphs(runner, ops: StepOps, patch) -> None:
    """CUDA graphs on the CPU: ``record`` runs the step once; a replay reruns it into the same outputs."""
    def record(step):
        outputs = step()
        rerun = lambda: [o.copy_(r) for o, r in zip(outputs, step()) if o is not None]
        return SimpleNamespace(replay=ops.replaying(rerun)), outputs
    patch.setattr(runner, "use_graphs", True)
    patch.setattr(runner, "record", record)


def count(n: int, new: int, context: int) -> dict:
    model = default_model("cpu")
    ids = torch.randint(1, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    ops, patch = StepOps(), _Patch()
    engine = Engine(model, num_blocks=64, prefix_caching=False, speculative_tokens=n)
    emulate_graphs(engine.runner, ops, patch)
    mode = ops.counting(patch)
    engine.add_request(ids, sampling=SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    engine.step()  # the prefill (and the first capture of the graphs it needs)
    engine.step()  # the first verify step captures its graphs: not counted
    ops.__init__()
    steps = 0
    with torch.no_grad(), mode:
        while engine.has_work():
            engine.step()
            steps += 1
    patch.undo()
    per = lambda x: round(x / steps, 2)
    return {"N": n, "steps": steps, "eager_ops_per_step": per(ops.eager), "uploads_per_step": per(ops.uploads),
            "reads_per_step": per(ops.reads), "replays_per_step": per(ops.replays),
            "ops_per_step": {k: per(v) for k, v in sorted(ops.ops.items(), key=lambda kv: -kv[1])},
            "spec": engine.stats.spec.as_dict()}


def count_bodies(n: int, context: int) -> dict:
    """The device ops of each graph body of the first decode step after the prefill (two a verify step, one a
    plain decode step), by phase and by op."""
    model = default_model("cpu", dtype=torch.bfloat16)
    ids = torch.randint(1, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(model, num_blocks=64, prefix_caching=False, speculative_tokens=n)
    patch = _Patch()
    bodies = record_bodies(engine.runner, patch)
    engine.add_request(ids, sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # the first decode step captures its bucket's graphs
    ops = DeviceOps().counting(patch)
    out = {}
    for i, body in enumerate(bodies):
        phases = ops.count(body, f"glue{i}")
        out[f"body{i}"] = {"ops": sum(phases.values()), "phases": phases,
                           "by_op": {f"{p} {name}": v for (p, name), v in sorted(ops.ops.items())}}
    patch.undo()
    return {"N": n, **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speculative-tokens", type=int, default=2)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--bodies", action="store_true", help="the device ops inside the graph bodies, by phase")
    args = p.parse_args(argv)
    if args.bodies:
        print(json.dumps(count_bodies(args.speculative_tokens, args.context), indent=1))
    else:
        print(json.dumps(count(args.speculative_tokens, args.new, args.context), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
