"""Where a speculating engine's greedy tokens leave the plain engine's (issue #39), on a GPU in bf16: for
each model and context, the plain run with graphs, the plain run eager, then the speculating runs (N = 2)
with the scripted test drafter (p = 0.7, proposing the plain run's tokens) and the MTP drafter, each with
and without CUDA graphs. A row gives the first token index where each run differs from the plain graph
run (``first_diff``; None: identical) and from the plain eager run, its acceptance and accepted lengths.

    python benchmarks/spec_divergence.py [--new 32] --out F.json

A bookkeeping bug would make a drafter's tokens differ where the others agree, or graphs differ from
eager; bf16 rounding of the verify step's ``next_n = 3`` kernels makes every speculating run leave the
plain one at the same token.
"""
import argparse
import json
import sys

import torch

from dsa.bench.speculative import prompt_ids, set_acceptance, spec_model, timed
from dsa.engine import Engine
from dsa.kernels.common import cdiv

CASES = (("default", 16253), ("demo-gpu", 4096), ("demo-gpu", 163709))  # the bench's longest contexts and a short one


def first_diff(a: list, b: list) -> int | None:
    """The first index where ``a`` and ``b`` differ (None: equal)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def model_for(name: str):
    """The bench's model: the trained default, or a preset with a random MTP module (``spec_model``)."""
    preset = None if name == "default" else name
    return spec_model(argparse.Namespace(preset=preset, checkpoint=None), torch.device("cuda"))[0]


def case(name: str, s: int, new: int) -> dict:
    model = model_for(name)
    ids, c = prompt_ids(model, None, s), model.config
    blocks = cdiv(s + new + 3, c.block_size) + 2
    base = timed(Engine(model, num_blocks=blocks, prefix_caching=False), ids, new)[0][0]
    eager = timed(Engine(model, num_blocks=blocks, prefix_caching=False, cuda_graphs=False), ids, new)[0][0]
    row = dict(model=name, S=s, new=new, plain_eager_vs_graphs=first_diff(base, eager))
    for graphs in (True, False):
        for drafter in ("scripted", "mtp"):
            d = set_acceptance(base, ids, 2, c.vocab_size, 0.7) if drafter == "scripted" else None
            engine = Engine(model, num_blocks=blocks, prefix_caching=False, speculative_tokens=2, drafter=d,
                            cuda_graphs=graphs)
            got = timed(engine, ids, new)[0][0]
            st = engine.stats.spec.as_dict()
            row[f"{drafter}_{'graphs' if graphs else 'eager'}"] = dict(
                first_diff=first_diff(base, got), first_diff_eager=first_diff(eager, got),
                acceptance=st["acceptance"], lengths=st["accepted_lengths"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    ap.add_argument("--out", required=True, help="JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("spec_divergence.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for name, s in CASES:
        rows.append(case(name, s, args.new))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
