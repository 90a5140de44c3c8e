"""Host time of each CUDA graph launch (issue #39): ``CUDAGraph.replay`` wrapped by a wall clock while ``dsa bench engine
--speculative-tokens 2 --quick`` runs (the plain engine's decode graphs, then the speculating engine's two verify-bucket
graphs); prints and writes ``OUT/replay-host-time.json``: per graph replayed 20 times or more, its median, p10 and p90
microseconds. torch.profiler's trace inflates a launch (CUPTI records every node): this measures it without.

    python benchmarks/replay_host_time.py OUT
"""
import collections
import json
import sys
import time

import torch

from dsa.cli import main

T = collections.defaultdict(list)
orig = torch.cuda.CUDAGraph.replay


def replay(self):
    t = time.perf_counter()
    orig(self)
    T[id(self)].append(time.perf_counter() - t)


torch.cuda.CUDAGraph.replay = replay
sys.argv = ["dsa", "bench", "engine", "--speculative-tokens", "2", "--quick", "--out", sys.argv[1]]
try:
    main()
except SystemExit:
    pass
rows = []
for k, v in T.items():
    if len(v) >= 20:
        v = sorted(v)
        rows.append({"graph": k, "replays": len(v), "median_us": round(v[len(v) // 2] * 1e6, 1),
                     "p10_us": round(v[len(v) // 10] * 1e6, 1), "p90_us": round(v[9 * len(v) // 10] * 1e6, 1)})
print(json.dumps(rows, indent=1))
json.dump(rows, open(sys.argv[-1] + "/replay-host-time.json", "w"))
