"""Host memory of a step's pinned copies: a buffer pinned anew each step (what the runner and the
sampler did until wave 3's end) against dsa.engine.staging.PinnedBuffers, on a CUDA device.

Each of ``--steps`` steps uploads an int32 plan of a random size (serving-like: mostly small decode
plans, sometimes a prefill chunk's), runs a little GPU work that reads it, and copies a float64
sample of a random batch size back, the host reading step N's sample after launching step N+1 (one
step in flight, as the engine). Checks that every uploaded plan and every sample arrives intact,
and reports resident memory and the caching host allocator's reserved bytes at each quarter.

    python benchmarks/pinned_memory.py --steps 4000 --json pinned-memory.json
"""
import argparse
import json
import random
import subprocess
import sys

import numpy as np
import torch

from dsa.engine.staging import PinnedBuffers


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def host_reserved_mib():
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    value = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current"))
    return None if value is None else value / 2**20


def run(mode: str, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    dev = torch.device("cuda")
    plans, samples = PinnedBuffers(dev, torch.int32), PinnedBuffers(dev, torch.float64)
    work = torch.randn(2048, 2048, device=dev)
    pending, trace, bad = None, [], 0
    for step in range(steps):
        n = rng.choice([rng.randint(64, 4096)] * 9 + [rng.randint(8192, 600_000)])  # ints in the plan
        plan = np.arange(step, step + n, dtype=np.int32)
        if mode == "fresh":
            dev_plan = torch.from_numpy(plan).pin_memory().to(dev, non_blocking=True)
        else:
            slot = plans.take(n)
            np.copyto(slot.buffer[:n].numpy(), plan)
            dev_plan = slot.buffer[:n].to(dev, non_blocking=True)
            plans.give_back(slot, copied=True)
        work = torch.tanh(work @ work) * 0.5  # the step's compute, so copies stay in flight
        b = rng.randint(1, 256)
        packed = (dev_plan[:b].double() if b <= n else dev_plan.double()).reshape(-1, 1)
        if mode == "fresh":
            host, slot = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True), None
        else:
            slot = samples.take(packed.numel())
            host = slot.buffer[:packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        if pending is not None:  # read step N-1's sample after launching step N
            p_event, p_host, p_slot, p_first = pending
            p_event.synchronize()
            got = p_host[:, 0].tolist()
            bad += got != [float(p_first + i) for i in range(len(got))]
            if p_slot is not None:
                samples.give_back(p_slot, copied=False)
        pending = (event, host, slot, step)
        if (step + 1) % (steps // 4) == 0:
            torch.cuda.synchronize()
            trace.append({"step": step + 1, "rss_mib": round(rss_mib(), 1), "host_reserved_mib": host_reserved_mib()})
    torch.cuda.synchronize()
    return {"mode": mode, "steps": steps, "corrupted_samples": bad, "trace": trace,
            "slots": {"plans": len(plans.slots), "samples": len(samples.slots)} if mode == "staging" else None}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("staging", "fresh"), help="one mode in this process (default: each in its own)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_memory.py: needs a CUDA device (pinned memory is a CUDA host allocation)")
    if args.mode:
        print(json.dumps(run(args.mode, args.steps, args.seed)))
        return
    runs = []
    for mode in ("staging", "fresh"):  # a process each: the host allocator's cache is per process
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--steps", str(args.steps),
                              "--seed", str(args.seed)], check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(mode, "corrupted", runs[-1]["corrupted_samples"], "slots", runs[-1]["slots"])
        for t in runs[-1]["trace"]:
            print(f"  step {t['step']}: resident {t['rss_mib']} MiB, "
                  f"host allocator reserved {t['host_reserved_mib']} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "command": sys.argv,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
