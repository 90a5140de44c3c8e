"""Paired difference of two `dsa recall --teacher` results (the same windows and queries, two sets of indexers).

    python benchmarks/quality/compare_quality.py A/quality.json B/quality.json

Prints, over every (layer, k) row, the mean and largest |B - A| of the attention mass the fitted
indexers keep (FP8 and exact scoring), and the k = 512 row of each layer.
"""
import json
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: compare_quality.py A/quality.json B/quality.json")
    a, b = (json.load(open(p))["table"] for p in argv)
    if [(r["layer"], r["k"]) for r in a] != [(r["layer"], r["k"]) for r in b]:
        raise SystemExit("the two results hold different (layer, k) rows: not the same run settings")
    for key in ("fitted_fp8", "fitted_exact"):
        d = [y[key] - x[key] for x, y in zip(a, b)]
        print(f"{key}: {len(d)} rows, mean B - A {sum(d) / len(d):+.5f}, largest |B - A| {max(map(abs, d)):.5f}")
    for x, y in zip(a, b):
        if x["k"] == 512:
            print(f"layer {x['layer']:>2} k=512: A {x['fitted_fp8']:.4f}  B {y['fitted_fp8']:.4f}  "
                  f"B - A {y['fitted_fp8'] - x['fitted_fp8']:+.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
