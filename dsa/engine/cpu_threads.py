"""How many threads torch computes with on CPU (``dsa.LLM(cpu_threads=...)``, ``--cpu-threads``).

torch's own default is one OpenMP thread per CPU. Its workers spin between parallel regions, and a
decode step is hundreds of small ones; when another process keeps a CPU busy, the thread it
displaces holds up every region, and all threads wait for it. On a 2-core VM (medians of
benchmarks/results/cpu-threads-2cores-2026-12-01.json and its ``-beside-busy`` twin) 2 threads beat
1 alone (generate 62 vs 40 tokens/s, demo prefill 261 vs 157 and decode 42 vs 34) but lose beside
one busy process (generate 19 vs 44, demo prefill 102 vs 140 and decode 10 vs 27).
So the default here is the CPUs this process may run on, less those other processes keep busy
(watched for ``SAMPLE_S`` seconds at start, from ``/proc/stat``; at least 1): 2 on an idle 2-core
machine, 1 beside a busy process. Chosen once, when the LLM (or ``dsa demo``'s engine) is built.

The user's setting wins: an explicit ``cpu_threads``; else ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``
in the environment, or a ``torch.set_num_threads`` call that left another count than one per CPU,
is kept as it is. (A ``torch.set_num_threads`` to exactly one per CPU looks like torch's default:
pass ``cpu_threads`` or set ``OMP_NUM_THREADS`` to keep that count on a busy machine.)
"""
import os
import time

from dsa.kernels.common import check_int

USER_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SAMPLE_S = 0.25  # how long the default watches the other processes' CPU use


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_sample():
    """(CPU-seconds every CPU spent busy, this process's CPU-seconds, monotonic time), or None
    where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic()


def others_busy(window_s: float = SAMPLE_S) -> float | None:
    """CPUs other processes keep busy, over ``window_s`` seconds of this thread sleeping (None
    where ``/proc/stat`` cannot be read)."""
    start = cpu_sample()
    time.sleep(window_s)
    end = cpu_sample()
    if start is None or end is None:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2]))


def default_threads(cpus: int, busy: float | None) -> int:
    """One thread per CPU that other processes leave free (``busy``: CPUs they keep busy, None:
    unknown), at least 1."""
    return max(1, cpus - round(busy or 0.0))


def user_setting() -> str | None:
    """What says the user chose the thread count (an environment variable, or torch's count
    changed from one per CPU, not by dsa), or None."""
    import torch

    for name in USER_ENV:
        if os.environ.get(name, "").strip():
            return f"{name}={os.environ[name].strip()}"
    n = torch.get_num_threads()
    if n != available_cpus() and (_chosen[0] is None or n != _chosen[0][0]):
        return "torch.set_num_threads"
    return None


def apply_cpu_threads(cpu_threads: int | None = None, measure=others_busy) -> tuple:
    """Set torch's thread count: ``cpu_threads`` when given, else the default (``measure()``: the
    CPUs other processes keep busy), chosen once per process, unless the user set one
    (:func:`user_setting`). Returns ``(threads now, why)``, ``why`` a few words for a log line."""
    import torch

    if cpu_threads is not None:
        cpu_threads = check_int("cpu_threads", cpu_threads, minimum=1)
        torch.set_num_threads(cpu_threads)
        return cpu_threads, "asked for"
    user = user_setting()
    if user is not None:
        return torch.get_num_threads(), f"kept: {user}"
    if _chosen[0] is not None and torch.get_num_threads() == _chosen[0][0]:
        return _chosen[0]  # chosen before in this process
    cpus, busy = available_cpus(), measure()
    threads = default_threads(cpus, busy)
    torch.set_num_threads(threads)
    _chosen[0] = threads, (f"one per CPU of {cpus}" if busy is None else f"{cpus} CPUs, {busy:.1f} busy with other work")
    return _chosen[0]


_chosen = [None]  # (threads, why) the default chose in this process


def describe(threads: int, why: str) -> str:
    """``"1 CPU thread (why)"``, for a start line."""
    return f"{threads} CPU thread{'' if threads == 1 else 's'} ({why})"
