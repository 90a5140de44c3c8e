"""Helpers the benchmarks share with the tests: random block tables, comparisons of results, and counters of what
a step does on the host (:class:`StepOps`) and launches on the device (:class:`DeviceOps`)."""
import functools
from types import SimpleNamespace

import torch

from dsa.kernels.common import cdiv
from dsa.kernels.topk import topk_indices


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2<x,y> / (|x|^2 + |y|^2)`` in float64 (DeepGEMM's measure); 0 for identical tensors."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def topk_agreement(ours: torch.Tensor, theirs: torch.Tensor, lengths: torch.Tensor, k: int,
                   starts: torch.Tensor | None = None) -> dict:
    """How two logits of the same rows (with the same ``-inf`` masks) agree, for a report.

    ``max_abs_diff`` and ``calc_diff`` over the finite entries; the top-k of each row's window
    ``[start, start + length)`` by ``topk_indices``: ``rows_same_topk`` of ``rows`` select the same
    set, ``positions_differing`` in all. A position selected by one and not the other lies within
    ``2 d`` of ``ours``' k-th value, ``d`` the row's largest ``|ours - theirs|`` (the two k-th values
    differ by at most ``d``): ``max_tie_gap`` is the largest such distance over ``d``, so at most 2
    when every difference is a near-tie (0 when no set differs).
    """
    finite = torch.isfinite(ours)
    diff = (ours - theirs)[finite].abs()
    sel_a, sel_b = topk_indices(ours, lengths, k, starts), topk_indices(theirs, lengths, k, starts)
    same = (sel_a.sort(dim=1).values == sel_b.sort(dim=1).values).all(dim=1)
    report = {"max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
              "calc_diff": calc_diff(ours[finite], theirs[finite]), "rows": ours.shape[0],
              "rows_same_topk": int(same.sum()), "positions_differing": 0, "max_tie_gap": 0.0}
    for r in (~same).nonzero().flatten().tolist():
        start = 0 if starts is None else max(0, int(starts[r]))
        row_a, row_b = ours[r, start:start + int(lengths[r])], theirs[r, start:start + int(lengths[r])]
        a, b = set(sel_a[r].tolist()) - {-1}, set(sel_b[r].tolist()) - {-1}
        odd = torch.tensor(sorted(a ^ b), device=ours.device)
        d = float((row_a - row_b)[torch.isfinite(row_a)].abs().max())
        kth = float(row_a[sel_a[r][sel_a[r] >= 0].long()].min())
        gap = float((row_a[odd] - kth).abs().max())
        report["positions_differing"] += len(odd)
        report["max_tie_gap"] = max(report["max_tie_gap"], gap / d if d > 0 else float("inf"))
    return report


def random_block_tables(seq_lens: list[int], block_size: int, *, extra_blocks: int = 0, generator=None,
                        device=None) -> tuple[torch.Tensor, int]:
    """Non-contiguous block tables: each request owns ``ceil(S / P)`` distinct random blocks.

    Returns ``(block_table [B, MB] int32, num_blocks)``; unused table entries are 0 (never read
    for valid positions). ``extra_blocks`` leaves blocks that no request owns.
    """
    need = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    mb = max(need + [1])
    table = torch.zeros(len(seq_lens), mb, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return table.to(device), num_blocks


# aten ops that only make views (no kernel, no copy): the rest of a step's eager ops each launch work on CUDA
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "slice", "select", "as_strided", "unsqueeze", "squeeze", "expand",
             "detach", "alias", "t", "transpose", "permute", "lift_fresh", "unbind", "split", "chunk", "narrow",
             "view_as", "expand_as", "_reshape_alias", "unfold", "split_with_sizes", "clone_view"}


class StepOps:
    """Counts what a speculating engine's steps do on the host, CPU or CUDA alike (issue #39): the
    eager aten ops outside graph replays (views not counted; ``ops`` by name), the host-to-device
    uploads (:class:`~dsa.engine.staging.PinnedBuffers` copies and packed plans), the device-to-host
    reads of sampled tokens, and the graph replays. Use it around ``engine.step()`` calls, with the
    graph replays marked by :meth:`replaying` (the CPU tests' emulation does it)."""

    def __init__(self):
        self.ops, self.uploads, self.reads, self.replays, self._quiet = {}, 0, 0, 0, 0

    @property
    def eager(self) -> int:
        return sum(self.ops.values())

    def replaying(self, replay):
        """``replay`` wrapped: counted as one replay, its own ops not counted."""
        def run():
            self.replays += 1
            self._quiet += 1
            try:
                return replay()
            finally:
                self._quiet -= 1
        return run

    def op(self, name: str) -> None:
        name = name.rstrip("_")  # in-place ops as their own: fill_ as fill
        if not self._quiet and name not in _VIEW_OPS:
            self.ops[name] = self.ops.get(name, 0) + 1

    def counting(self, monkeypatch):
        """Install the counters (``monkeypatch``: pytest's, or any object with ``setattr``); returns a
        context manager that counts the aten ops dispatched inside it."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from dsa.engine import sampling, staging
        from dsa.model import plan
        counter = self

        def wrap(owner, name, bump):
            original = getattr(owner, name)

            def counted(*args, **kwargs):
                bump()
                counter._quiet += 1  # an upload's own host-side ops are the copy
                try:
                    return original(*args, **kwargs)
                finally:
                    counter._quiet -= 1
            monkeypatch.setattr(owner, name, counted)

        wrap(staging.PinnedBuffers, "copy_to", lambda: setattr(self, "uploads", self.uploads + (not self._quiet)))
        wrap(plan._Packer, "upload", lambda: setattr(self, "uploads", self.uploads + (not self._quiet)))
        wrap(sampling.PendingSample, "__init__", lambda: setattr(self, "reads", self.reads + (not self._quiet)))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.op(str(func.overloadpacket.__name__))
                return func(*args, **(kwargs or {}))
        return Mode()


# aten ops that launch nothing on CUDA: allocations, and the CPU scalar an op with a Python number wraps
_NO_LAUNCH = {"empty", "empty_strided", "scalar_tensor"}

# the phases of a step's device ops (DeviceOps): what runs them, (owner module, attribute)
DEVICE_PHASES = {"target": ("dsa.model.model", "DSAModel.step"), "mtp_step": ("dsa.model.model", "DSAModel.mtp_step"),
                 "derive": ("dsa.model.plan", "HostPlan.derive"),
                 "accept": ("dsa.engine.spec_step", "rejection_sample")}


def record_bodies(runner, monkeypatch) -> list:
    """CUDA graphs emulated on any device for :class:`DeviceOps`: the runner's ``record`` runs each step once
    and keeps its body in the returned list; a replay reruns it into the same outputs (``monkeypatch``:
    pytest's, or any object with ``setattr``)."""
    bodies = []

    def record(step):
        outputs = step()
        bodies.append(step)
        return SimpleNamespace(replay=lambda: [o.copy_(r) for o, r in zip(outputs, step()) if o is not None]), outputs

    monkeypatch.setattr(runner, "use_graphs", True)
    monkeypatch.setattr(runner, "record", record)
    return bodies


class DeviceOps:
    """Counts the device ops of a step's graph bodies on the CPU (issue #39: a speculating step at batch 1 is
    bound by the number of kernels it launches), by phase: ``target`` (the main model's forward), ``mtp_step``
    (the MTP module), ``derive`` (a plan's device facts), ``accept`` (the rejection sampler in the speculating
    passes), and the glue around them (the phase the caller names). A proxy for CUDA launches: one per non-view
    aten op (allocations and wrapped Python numbers excepted), one per public ``dsa.kernels`` / ``dsa.cache`` call
    (``K:name``, its own ops not counted), plus the
    copies CUDA adds inside an op that the CPU dispatcher does not show: an int32 index tensor of ``index`` /
    ``index_put`` is cast to int64 first (``cast:int32-index``), a ``cat`` of mixed dtypes copies each input
    (``cat:mixed``). RMSNorm counts its CPU ops (fused on CUDA)."""

    def __init__(self):
        self.ops, self.phase, self._quiet, self.on = {}, ["glue"], 0, False

    def bump(self, name: str, count: int = 1) -> None:
        if self.on and not self._quiet:
            key = (self.phase[-1], name)
            self.ops[key] = self.ops.get(key, 0) + count

    def by_phase(self) -> dict:
        out = {}
        for (phase, _), n in self.ops.items():
            out[phase] = out.get(phase, 0) + n
        return out

    def breakdown(self) -> str:
        """``phase op count`` lines, each phase's largest first."""
        rows = sorted(self.ops.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1]))
        return "\n".join(f"  {phase:<10} {name:<28} {n}" for (phase, name), n in rows)

    def count(self, body, phase: str) -> dict:
        """Run ``body()`` with its ops counted under ``phase`` (outside the named phases); returns :meth:`by_phase`
        of it alone (the counters installed: :meth:`counting`)."""
        self.ops, self.phase, self.on = {}, [phase], True
        try:
            with torch.no_grad(), self._mode:
                body()
        finally:
            self.on = False
        return self.by_phase()

    def counting(self, monkeypatch) -> "DeviceOps":
        """Install the counters (``monkeypatch``: pytest's or any object with ``setattr``): every public kernel
        and cache function where a dsa module imported it, and the phases' functions."""
        import importlib
        import inspect
        import sys

        from dsa import cache, kernels as K
        named = [(K, n) for n in K.__all__ if not n.endswith("_reference")] + [
            (cache, n) for n in dir(cache) if not n[0].isupper() and callable(getattr(cache, n)) and
            getattr(getattr(cache, n), "__module__", "").startswith("dsa.cache")]
        public = {id(inspect.unwrap(getattr(owner, n))): n for owner, n in named}  # (unwrapped: counters installed
        # twice, the outer one counts)
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("dsa") and m is not None]:
            for attr, value in list(vars(module).items()):
                if callable(value) and id(inspect.unwrap(value)) in public:
                    monkeypatch.setattr(module, attr, self._kernel(value, public[id(inspect.unwrap(value))]))
        for phase, (module, path) in DEVICE_PHASES.items():
            owner = importlib.import_module(module)
            *outer, attr = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            monkeypatch.setattr(owner, attr, self._phase(getattr(owner, attr), phase))
        self._mode = self._dispatch_mode()
        return self

    def _kernel(self, fn, name: str):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.bump("K:" + name)
            self._quiet += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._quiet -= 1
        return counted

    def _phase(self, fn, phase: str):
        def counted(*args, **kwargs):
            self.phase.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase.pop()
        return counted

    def _dispatch_mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__.rstrip("_")
                if name not in _VIEW_OPS and name not in _NO_LAUNCH:
                    counter.bump(name)
                    counter._hidden(name, args)
                return func(*args, **(kwargs or {}))
        return Mode()

    def _hidden(self, name: str, args) -> None:
        """The copies CUDA makes inside ``name`` (class docstring)."""
        if name in ("index", "index_put") and len(args) > 1:
            casts = sum(1 for t in args[1] if isinstance(t, torch.Tensor) and t.dtype == torch.int32)
            if casts:
                self.bump("cast:int32-index", casts)
        elif name == "cat" and args and len({t.dtype for t in args[0]}) > 1:
            self.bump("cat:mixed", len(args[0]) - 1)
