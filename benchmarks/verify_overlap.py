"""How much a verify step's rows share their top-k selections (issue #40, item 5): the input statistics
that ``dsa bench mla``'s ``next_n >= 2`` rows should have, measured on real verify steps.

Runs a speculating engine (the embedded trained default, its MTP module, greedy) over the demo's held-out
text and records every verify step's decode selection in each indexer layer: ``next_n = N + 1`` rows a
request, each its ``index_topk`` cache slots. For row ``j >= 1`` of a request, its overlap is the share of
its slots that row 0 also selected; the union of the rows' slots over ``k`` is what a kernel that loads
the union once per request would read. Prints a table and writes JSON (``--json``).

    python benchmarks/verify_overlap.py [--context 4096] [--new 48] [--speculative-tokens 2] [--json out.json]
"""
import argparse
import json
import sys

import numpy as np
import torch

from dsa.bench.speculative import prompt_ids, spec_model
from dsa.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.indexer import LightningIndexer
from dsa.kernels.common import cdiv
from dsa.report import env_info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--new", type=int, default=48, help="greedy tokens (default 48)")
    p.add_argument("--speculative-tokens", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.preset = args.checkpoint = None
    model, tok, name = spec_model(args, torch.device(args.device))
    c, n = model.config, args.speculative_tokens
    ids = prompt_ids(model, tok, args.context)
    engine = Engine(model, num_blocks=cdiv(args.context + args.new + n + 1, c.block_size) + 1, prefix_caching=False,
                    speculative_tokens=n)
    seen = []  # (layer, [R, N + 1, k] slots) of each verify step
    forward = LightningIndexer.forward

    def recording(self, x, qr, batch, cache, rot):
        sel = forward(self, x, qr, batch, cache, rot)
        d = batch.decode
        if d is not None and d.next_n == n + 1 and sel.decode is not None:
            seen.append((id(self), sel.decode.view(-1, n + 1, sel.decode.shape[-1]).cpu().numpy()))
        return sel

    LightningIndexer.forward = recording
    try:
        list(engine.stream([ids], sampling=SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)))
    finally:
        LightningIndexer.forward = forward
    layers = {key: i for i, key in enumerate(dict.fromkeys(k for k, _ in seen))}
    overlap = {j: [] for j in range(1, n + 1)}
    union, per_layer = [], {i: [] for i in layers.values()}
    for key, sel in seen:
        for req in sel:  # [N + 1, k], -1 padded
            sets = [set(r[r >= 0].tolist()) for r in req]
            if not sets[0]:
                continue
            shares = [len(sets[j] & sets[0]) / max(1, len(sets[j])) for j in range(1, n + 1)]
            for j, share in enumerate(shares, 1):
                overlap[j].append(share)
            union.append(len(set().union(*sets)) / len(sets[0]))
            per_layer[layers[key]].append(np.mean(shares))
    result = {"op": "verify-overlap", "env": env_info(), "model": name, "context": args.context, "N": n,
              "index_topk": c.index_topk, "verify_steps_layers": len(seen), "spec": engine.stats.spec.as_dict(),
              "overlap_with_row0": {str(j): round(float(np.mean(v)), 4) for j, v in overlap.items() if v},
              "union_over_k": round(float(np.mean(union)), 4) if union else None,
              "overlap_by_layer": [round(float(np.mean(v)), 4) for _, v in sorted(per_layer.items()) if v],
              "command": "python benchmarks/verify_overlap.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(f"{name}, context {args.context}, N = {n}, k = {c.index_topk}: {len(seen)} verify-step layers; "
          f"row j's slots also in row 0's: {result['overlap_with_row0']}; the rows' union / k: {result['union_over_k']}; "
          f"by layer {result['overlap_by_layer']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
