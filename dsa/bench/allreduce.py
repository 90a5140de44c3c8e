"""``dsa bench allreduce`` (under ``torchrun --nproc-per-node N``): all-reduce latency against message
size, 1 KiB to 16 MiB of bf16, for each path of :mod:`dsa.model.allreduce`:

- ``nccl``: the process group's ``all_reduce``;
- ``symm_mem_one_shot`` and ``symm_mem_two_shot``: copy into a symmetric buffer, the one-shot or
  two-shot kernel, result in the tensor (here over a 16 MiB buffer, so every size runs both);
- ``auto``: what :class:`~dsa.model.allreduce.AllReduce` does with its defaults (symmetric memory up
  to 1 MiB where it initialized, NCCL above): the path the model takes.

Every path is checked against the exact sum first (each rank's tensor is a different small-integer
pattern, so bf16 sums are exact), then ``REPEAT`` calls are captured in one CUDA graph and the
graph is replayed: ``median_us`` is a replay's median over ``REPEAT`` (no L2 flush: the messages
are small and the sender's data is hot in a decode step too). Rank 0 writes the rows.
"""
import os

import torch
import torch.distributed as dist

from dsa.model.allreduce import AllReduce
from dsa.model.parallel import init_tensor_parallel

from .harness import Timer, result_row

SIZES = [1 << k for k in range(10, 25)]  # 1 KiB .. 16 MiB
QUICK_SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 24]
REPEAT = 10  # all-reduces per graph replay


def _pattern(n: int, rank: int, device) -> torch.Tensor:
    """Small integers (|x| <= 8): any sum over a few ranks is exact in bf16."""
    return ((torch.arange(n, device=device) * 7 + 3 * rank) % 17 - 8).to(torch.bfloat16)


def run(device, timer, ceilings, args) -> list:
    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]))
    auto = tp.reducer
    wide = AllReduce(max_bytes=max(SIZES), one_shot_max_bytes=max(SIZES)) if auto.path == "symm_mem" else None
    paths = {"nccl": auto.process_group, "auto": auto}
    if wide is not None:
        paths.update(symm_mem_one_shot=wide.one_shot, symm_mem_two_shot=wide.two_shot)
    say = print if tp.rank == 0 else (lambda *a, **k: None)  # noqa: E731
    say(f"all-reduce over {tp.size} ranks: default path {auto.path} ({auto.reason})")
    replay_timer = Timer(device, reps=timer.reps, flush=False)
    rows = []
    for nbytes in QUICK_SIZES if args.quick else SIZES:
        n = nbytes // 2
        want = sum(_pattern(n, r, device).float() for r in range(tp.size)).to(torch.bfloat16)
        x = torch.empty(n, dtype=torch.bfloat16, device=device)
        for name, reduce in paths.items():
            x.copy_(_pattern(n, tp.rank, device))
            reduce(x)
            if not torch.equal(x, want):
                raise RuntimeError(f"all-reduce {name} of {nbytes} bytes: wrong sum on rank {tp.rank}")

            def calls(reduce=reduce):
                for _ in range(REPEAT):
                    reduce(x)  # the values double each call (to +-inf, never NaN); the time does not depend on them

            dist.barrier()
            t = replay_timer(calls, graph=True)
            t = {k: v / REPEAT if k.endswith("_us") else v for k, v in t.items()}
            rows.append(result_row("allreduce", name, dict(bytes=nbytes, ranks=tp.size), t, ceilings,
                                   bytes_moved=nbytes, bound="none", graph_us=t["median_us"], dtype="bfloat16",
                                   tp_size=tp.size, allreduce=auto.path, repeat_per_graph=REPEAT))
            say(f"{name:18s} {nbytes:>9d} B: {t['median_us']:8.1f} us", flush=True)
    return rows
