"""Where a speculating step's host time goes (issue #39), on the CPU without the model's forward.

The trained default and its MTP module, ``--batch`` requests placed as prefilled at ``--context`` tokens
(``Scheduler.run_as_prefilled``: no prefill runs), greedy, ``speculative_tokens = N``. CUDA graphs are
emulated: a bucket's capture runs its padding step once (the real forward: not timed), and each replay is a
stand-in that does no model work: the first pass nothing, the second writes the packed tokens and accepted
counts a step reads (``--accepted``: every request accepts that many drafts, or fewer near its limit), so
only the host's work remains: scheduling, the batch's deltas, ``spec_step.pack`` (the verify plan's and the
drafter's chained ``HostPlan.pack`` calls, ``drafter.prepare``), the upload, the read, the stop rules, the
stats. Prints and writes (``--out``) microseconds per step: the whole ``engine.step()`` and, inclusive, the
functions named in ``TIMED`` (nested: a parent includes its children), then cProfile's top functions.

    python benchmarks/spec_host_time.py [--batch 1] [--context 15000] [--steps 300] [--out spec_host_time.json]
"""
import argparse
import cProfile
import json
import pstats
import sys
import time
from types import SimpleNamespace

import torch

from dsa.engine import Engine, drafter, engine as engine_mod, input_batch, scheduler, spec_step, speculative
from dsa.engine.sampling import PendingSample, SamplingParams
from dsa.model import plan
from dsa.model.presets import default_model

# (label, owner, attribute): timed inclusively while the steps run
TIMED = [
    ("schedule", scheduler.Scheduler, "schedule"),
    ("launch", speculative, "launch"),
    ("  batch.apply", input_batch.InputBatch, "apply"),
    ("  spec_step.run", spec_step, "run"),
    ("    spec_step.pack", spec_step, "pack"),
    ("      HostPlan.pack", plan.HostPlan, "pack"),
    ("      drafter.prepare", drafter.MTPDrafter, "prepare"),
    ("      PackedStep", spec_step, "PackedStep"),
    ("    upload", plan._Packer, "upload"),
    ("  rejection_args", speculative, "rejection_args"),
    ("  spec_step.finish", spec_step, "finish"),
    ("  PendingSample", PendingSample, "__init__"),
    ("finish_verified", engine_mod.Engine, "_finish_verified"),
    ("  read (rows)", PendingSample, "rows"),
    ("  count", speculative, "count"),
    ("  scheduler.update", scheduler.Scheduler, "update"),
]


class _Patch:
    """A monkeypatch outside pytest."""

    def __init__(self):
        self.saved = []

    def setattr(self, owner, name, value):
        self.saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self):
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)


def stand_in_graphs(runner, accepted: int, patch) -> None:
    """CUDA graphs without the model: ``record`` runs the step once (the capture); a replay of the first pass
    does nothing, of the second writes tokens (id 7) and ``accepted`` into its packed output."""
    def record(step):
        runner.captures = getattr(runner, "captures", 0) + 1
        outputs = step()
        if len(outputs) == 1:  # observe: (packed [S', N + 2] float64,)
            packed = outputs[0]

            def replay():
                packed[:, :-1] = 7
                packed[:, -1] = accepted
            return SimpleNamespace(replay=replay), outputs
        return SimpleNamespace(replay=lambda: None), outputs
    patch.setattr(runner, "use_graphs", True)
    patch.setattr(runner, "record", record)


def timers(patch) -> dict:
    """Wrap every ``TIMED`` function with an inclusive wall-clock accumulator: label -> [seconds, calls]."""
    acc = {}
    for label, owner, name in TIMED:
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        fn = raw.__func__ if kind else raw
        slot = acc[label] = [0.0, 0]

        def timed(*args, _fn=fn, _slot=slot, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _slot[0] += time.perf_counter() - t0
                _slot[1] += 1
        patch.setattr(owner, name, kind(timed) if kind else timed)
    return acc


def build(args):
    model = default_model("cpu")
    engine = Engine(model, num_blocks=args.batch * (args.context + args.steps * 4) // model.config.block_size + 8,
                    prefix_caching=False, speculative_tokens=args.speculative_tokens, max_num_seqs=max(args.batch, 1))
    return model, engine


def add(engine, args, steps: int) -> None:
    """``--batch`` requests of ``--context`` tokens, as prefilled, each for ``steps`` verify steps' tokens."""
    n = args.speculative_tokens
    sp = SamplingParams(max_tokens=steps * (min(args.accepted, n) + 1), temperature=0, ignore_eos=True)
    for b in range(args.batch):
        ids = [(b * 31 + i) % (engine.config.vocab_size - 1) + 1 for i in range(args.context)]
        rid = engine.add_request(ids, sampling=sp)
        engine.scheduler.run_as_prefilled(engine._requests[rid])


def measure(args) -> dict:
    _, engine = build(args)
    patch = _Patch()
    stand_in_graphs(engine.runner, args.accepted, patch)
    with torch.no_grad():
        add(engine, args, 4)  # captures the bucket's graphs: not timed
        while engine.has_work():
            engine.step()
        add(engine, args, args.steps)
        engine.reset_stats()
        captures = engine.runner.captures
        acc = timers(patch)
        prof = cProfile.Profile() if args.profile else None
        steps, total = 0, 0.0
        while engine.has_work():
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t0
            if prof:
                prof.disable()
            steps += 1
    patch.undo()
    us = lambda s: round(1e6 * s / steps, 1)
    out = {"batch": args.batch, "context": args.context, "speculative_tokens": args.speculative_tokens,
           "accepted": args.accepted, "steps": steps, "graph_steps": engine.stats.graph_steps,
           "tokens_per_step": engine.stats.spec.tokens_per_step, "profiled": bool(prof),
           "captures_timed": engine.runner.captures - captures,
           "step_us": us(total), "by_function_us": {label: us(s) for label, (s, _) in acc.items()},
           "calls_per_step": {label: round(c / steps, 2) for label, (_, c) in acc.items()}}
    if prof:
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        out["cprofile_tottime_us"] = [{"function": f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", "calls": v[1],
                                       "tottime_us": us(v[2]), "cumtime_us": us(v[3])} for k, v in rows]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=15000)
    p.add_argument("--speculative-tokens", type=int, default=2)
    p.add_argument("--accepted", type=int, default=2, help="drafts every request accepts per step (stand-in)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="also cProfile the steps (slows them: a separate run)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
