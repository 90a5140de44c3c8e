"""Speculative decoding in the engine: one step drafts, verifies and accepts (vLLM v1's design, scaled down).

The scheduler gives each decode request ``1 + k`` rows (its last token, then ``k <= speculative_tokens``
draft rows, fewer near its length limit) and blocks for all of them. The step runs on the device from one
upload (:mod:`dsa.engine.spec_step`): the drafter (:mod:`dsa.engine.drafter`) proposes the draft ids, the
target verifies every row of the step in one pass (the decode path with ``next_n = N + 1`` rows a request,
its ``k + 1`` rows padded in front, causal: paged indexer logits with N + 1 rows, top-k per row, sparse MLA
over the rows) and the longest agreeing prefix is accepted (greedy); then the drafter observes the rows
(the MTP module over them). When every request decodes the step replays the two CUDA graphs of its batch
and context bucket and ``next_n``. A step with a sampled request runs the rejection sampler
(:mod:`dsa.engine.rejection`) eagerly between the two passes. The host then reads the tokens once (the
step's one sync, on the first pass's copy: the drafter's pass still runs while the host applies the stop
rules and schedules and packs the next step), applies the stop rules token by token (EOS, stop tokens,
stop strings, ``max_tokens``: a stop inside the accepted drafts drops the tokens after it), and the
scheduler advances each request by its accepted rows. Rejected rows stay in the caches past the request's ``computed`` length: no row reads them
(attention is causal) and the next step overwrites them; no prefix-cache name covers them.

Speculating engines schedule each step after the one before is read (its accepted counts decide the next
step's rows); ``speculative_tokens=0`` is the plain engine, unchanged.
"""
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dsa.engine import spec_step
from dsa.engine.rejection import rejection_sample
from dsa.engine.sampling import PendingSample, position_keys


@dataclass
class SpecStats:
    """What speculation did (``EngineStats.spec``): accepted tokens per step and by draft position."""
    speculative_tokens: int = 0
    verify_steps: int = 0  # steps that verified at least one draft
    drafts: int = 0  # draft tokens proposed
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens the verify steps' requests produced (accepted drafts + one each)
    requests: int = 0  # request-steps that carried drafts
    by_position: list = field(default_factory=list)  # [N]: drafts accepted at draft position j (0-based)
    proposed_by_position: list = field(default_factory=list)  # [N]: drafts proposed at position j
    accepted_lengths: list = field(default_factory=list)  # [N + 1]: request-steps that accepted 0 .. N drafts
    draft_s: float = 0.0  # seconds in the drafter's pass after the target (the MTP module over the verify rows)
    verify_s: float = 0.0  # seconds proposing (inside the verify pass), verifying and accepting

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a drafting request gets per verify step (1 without drafts; up to N + 1)."""
        return self.emitted / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        acc = [a / p if p else 0.0 for a, p in zip(self.by_position, self.proposed_by_position)]
        return {"speculative_tokens": self.speculative_tokens, "verify_steps": self.verify_steps,
                "drafts": self.drafts, "accepted": self.accepted, "acceptance": round(self.acceptance, 4),
                "tokens_per_step": round(self.tokens_per_step, 4), "acceptance_by_position": [round(a, 4) for a in acc],
                "accepted_lengths": list(self.accepted_lengths),
                "draft_ms_per_step": round(1e3 * self.draft_s / max(self.verify_steps, 1), 3),
                "verify_ms_per_step": round(1e3 * self.verify_s / max(self.verify_steps, 1), 3)}


class _Clock:
    """Wall seconds of device work between marks (CUDA events on CUDA), read once the last has happened."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def done(self) -> bool:
        """Whether :meth:`spans` can answer without waiting (the last mark follows the drafter's pass)."""
        return not self.cuda or self.marks[-1].query()

    def spans(self) -> list:
        m = self.marks
        if self.cuda:
            m[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:])]
        return [b - a for a, b in zip(m, m[1:])]


@dataclass
class VerifiedStep:
    """A speculating step on its way to the host."""
    sampled: list  # SampledRow
    packed: PendingSample  # its rows [S, N + 2]: tokens, then accepted, on their way to the host
    clock: _Clock
    num_drafts: np.ndarray  # [S] drafts each sampled request carried


def rejection_args(runner, out, step, n: int, vocab_hash: torch.Tensor) -> dict:
    """The rejection sampler's per-request parameters and per-row noise keys (the row ``j`` of a
    request samples the token at its sampled index + j); none when every request is greedy (the argmax
    path reads none: no upload)."""
    rows, sr = step.rows[step.sampled], runner.batch.sampling
    if sr.greedy[rows].all():
        return dict(all_greedy=True)
    index = np.fromiter((x.index for x in out.sampled), np.int64, len(out.sampled))
    k1, k2 = position_keys(sr.seed_key[rows][:, None], index[:, None] + np.arange(n + 1)[None, :])
    up = runner.upload  # floats as float32, ints and bools as int64
    return dict(temperature=up(sr.temperature[rows]), top_k=up(sr.top_k[rows]), top_p=up(sr.top_p[rows]),
                min_p=up(sr.min_p[rows]), greedy=up(sr.greedy[rows]).bool(), keys=up(np.stack((k1, k2), axis=-1)),
                vocab_hash=vocab_hash, sort=bool((sr.sorts[rows] & ~sr.greedy[rows]).any()))


def launch(engine, out) -> VerifiedStep:
    """Draft, verify, accept, observe: one step on the device (:mod:`dsa.engine.spec_step`: one upload, two
    passes or their graphs), its tokens on their way to the host."""
    runner, n = engine.runner, engine.speculative_tokens
    clock = _Clock(runner.device)
    runner.batch.apply(out)
    clock.mark()
    result = spec_step.run(runner, out)
    args = rejection_args(runner, out, result.step, n, engine.sampler.vocab_hash)
    if not args.get("all_greedy"):  # a sampled request: the rejection sampler's tokens replace the greedy ones
        s = len(out.sampled)
        result.accept(*rejection_sample(result.logits[:s], result.drafts[:s], **args))
    clock.mark()
    packed = result.packed[:len(out.sampled)] if len(out.sampled) else torch.zeros(0, n + 2, dtype=torch.float64)
    packed = PendingSample(packed, packed, None, None, engine.sampler.staging)  # its copy now, before the drafter's
    spec_step.finish(runner, result)  # pass: the host reads the tokens while that pass runs
    clock.mark()
    s = engine._stats
    host = result.step.host
    for path, rows in host.route.rows.items():
        s.rows[path] += rows
    s.peak_workspace_bytes = max(s.peak_workspace_bytes, host.route.workspace_bytes)
    s.graph_steps += result.graph is not None
    return VerifiedStep(out.sampled, packed, clock, result.step.num_drafts)


def count(stats: SpecStats, step: VerifiedStep, accepted: list, emitted: list, clocks: list | None = None) -> None:
    """Speculation's counters for a finished step (``accepted``: drafts each sampled request accepted;
    ``emitted``: tokens each kept). Its seconds are read now, or with ``clocks`` (a list the engine keeps)
    once its drafter's pass is done (:func:`add_times`): reading them now would wait for that pass."""
    k = step.num_drafts.tolist()
    if not any(k):  # a prefill step, or one whose requests could take no draft: not a verify step's cost
        return
    if clocks is None:
        add_times(stats, [step.clock], wait=True)
    else:
        clocks.append(step.clock)
    stats.verify_steps += 1
    for kk, a, e in zip(k, accepted, emitted):
        if not kk:
            continue
        stats.requests += 1
        stats.drafts += kk
        stats.accepted += a
        stats.emitted += e
        stats.accepted_lengths[a] += 1
        for j in range(kk):
            stats.proposed_by_position[j] += 1
            stats.by_position[j] += j < a


def add_times(stats: SpecStats, clocks: list, wait: bool) -> None:
    """Add the verify and draft seconds of ``clocks`` (verify steps' :class:`_Clock`, oldest first) to
    ``stats`` and drop them from the list: all of them with ``wait``, else those already done."""
    while clocks and (wait or clocks[0].done()):
        spans = clocks.pop(0).spans()
        stats.verify_s += spans[0]
        stats.draft_s += spans[1]
