"""Helpers the benchmarks share with the kernel tests: random block tables and comparisons of results."""
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
