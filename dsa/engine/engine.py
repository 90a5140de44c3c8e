"""Engine: the long-context inference API, batching requests over shared paged caches.

Three small objects (as nano-vllm splits them): the :class:`~dsa.engine.scheduler.Scheduler` (waiting and
running requests, their blocks, which rows each step serves), the :class:`~dsa.engine.runner.ModelRunner`
(the caches; plans a step and runs it, replaying a CUDA graph for decode-only steps) and the
:class:`~dsa.engine.sampling.Sampler` (one batched operation over the step's logits, outside the graph).
With a tokenizer, each request's text is detokenized incrementally and checked for stop strings
(:mod:`dsa.engine.output`).

Batch invariance: every op a row goes through depends on that row alone (the top-k's tie rule
gives the lowest positions at the k-th value, whatever the row's padding or batch; a decode row's
kernel depends on the model, not on the batch; the sampling noise is a hash of the request's seed
and the token's position), so in float32 a request's tokens are the same alone, in any batch, in
any order and at any chunk size, up to floating-point near-ties of the projections (batched and
single-row matmuls differ by ~1e-5).

Threads: one re-entrant lock (``engine.lock``) is held by ``add_request``, ``abort`` and ``step``.
Any thread may call them; a thread inside ``stream`` or ``generate`` steps the engine for every
request and takes its own requests' deltas from its own queue, so two threads generating on one
engine each get their own tokens. (A server that must not wait on steps runs the engine in one
loop thread fed by a queue instead: ``dsa serve``.)
"""
import collections
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dsa.config import bytes_per_token
from dsa.engine import speculative
from dsa.engine.blocks import PrefixStats
from dsa.engine.drafter import MTPDrafter
from dsa.engine.output import Delta, TextOutput
from dsa.engine.runner import ModelRunner
from dsa.engine.sampling import PendingSample, Sampler, SamplingParams
from dsa.engine.scheduler import Request, Scheduler
from dsa.kernels import compiles
from dsa.kernels.common import check_int
from dsa.model.plan import PATHS

log = logging.getLogger("dsa.engine")


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt and its sampling as :meth:`Engine.check_request` checked them: ``add_request``
    takes it as it is (on an engine of the same limits)."""
    ids: tuple  # token ids in [0, vocab_size)
    sampling: SamplingParams
    limits: tuple  # the engine limits it was checked against (Engine._limits)

    def __len__(self) -> int:  # its tokens, as a prompt's
        return len(self.ids)


@dataclass
class PrefillStep:
    """A step that computed chunks of long prompts (longer than ``max_batch_tokens``), as
    :attr:`EngineStats.prefill_steps` keeps it: each such chunk's request, first position and rows,
    the step's decode rows, and its time (shared by every row of the step)."""
    chunks: tuple  # (request id, first position, rows) of each chunk of a long prompt
    decode_rows: int
    ms: float  # device time (CUDA events around the step's launch; on CPU, its wall time)


class _StepClock:
    """Times a launched step without waiting for it: CUDA events on the stream (read once the
    step has finished), or the wall clock on CPU, where ops run as they are called."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return 1e3 * (self.end - self.start)


@dataclass
class _InFlight:
    """A launched step: its sampled tokens on their way (on the device, ``sample.tokens``, for the
    next step's pending inputs), the rows that sampled for a request, and (a step with prefill
    chunks) its clock and chunks."""
    sample: PendingSample
    sampled: list  # SampledRow
    clock: _StepClock | None = None
    chunks: tuple = ()
    decode_rows: int = 0


PREFILL_STEPS = 4096  # prefill steps EngineStats keeps (a 1M-token prompt in chunks of 8192 takes 128)


@dataclass
class EngineStats:
    """What the engine has done since it started."""
    rows: dict = field(default_factory=lambda: dict.fromkeys(PATHS, 0))  # rows per path, named by the kernels run
    prefill_chunks: int = 0  # prefill chunks (a prompt longer than max_batch_tokens takes several)
    peak_workspace_bytes: int = 0  # the largest MHA workspace a step needed
    steps: int = 0
    graph_steps: int = 0  # steps replayed from a CUDA graph
    tokens: int = 0  # rows computed (prompt and generated tokens)
    generated_tokens: int = 0
    preemptions: int = 0  # running requests that gave their blocks back to recompute later
    kernel_compiles: int = 0  # Triton/Gluon kernel variants built in this process (dsa.kernels.compiles)
    compiles_after_warmup: int | None = None  # of them, after this engine's warm-up (None before one ran)
    blocks_in_use: int = 0  # cache blocks held by requests now
    prefix: PrefixStats = field(default_factory=PrefixStats)  # the prefix cache's counters now
    # the last PREFILL_STEPS steps with chunks of long prompts (PrefillStep): a long prompt's cost by position
    prefill_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=PREFILL_STEPS))
    spec: speculative.SpecStats = field(default_factory=speculative.SpecStats)  # speculative decoding's counters


class Engine:
    """Batches requests over one pool of paged caches (``num_blocks`` blocks, or as many as
    ``memory_bytes`` holds), ``max_batch_tokens`` rows per step (long prompts are prefilled in
    chunks), at most ``max_num_seqs`` requests running at once. ``cuda_graphs``: replay
    decode-only steps from CUDA graphs (None: whenever the model allows, i.e. on CUDA without MoE
    layers; False: always eager). ``prefix_caching``: reuse the cached blocks of a prompt's prefix
    (both caches of every layer) and keep finished requests' blocks cached until the pool needs
    them. ``tokenizer``: makes deltas carry text and enables stop strings; its EOS joins the
    config's ``eos_token_id``. ``overlap``: schedule and launch step N+1 before reading step N's
    tokens back, so the host's work hides behind the GPU's (a decode row's input token is read on
    the device from the step before; a request that stops at step N has a row in step N+1 whose
    token is dropped); False: each step finishes before the next is scheduled. Tokens are the
    same either way. ``max_model_len``: the most tokens (prompt + generated) a request may have
    (None: the config's ``max_position_embeddings``); past the config's limit, a model of random
    weights has it raised (one warning past the RoPE's trained range) and a checkpoint refuses it
    (:meth:`~dsa.model.DSAModel.set_max_model_len`). The decode graphs' context buckets reach it.
    ``speculative_tokens`` (N): draft N tokens per decode request and verify them in
    one step (:mod:`dsa.engine.speculative`; greedy tokens as without it, sampled ones from the same
    distribution), drafted by the model's MTP module or by ``drafter`` (:mod:`dsa.engine.drafter`);
    such an engine runs without overlap, on one device, without logprobs; its verify steps take the
    decode path with N + 1 rows a request and replay CUDA graphs (keyed by N + 1 too) as decode steps do.

    Requests: :meth:`add_request` (token ids + :class:`~dsa.engine.sampling.SamplingParams`, or the
    ``max_new_tokens`` shorthand: greedy), :meth:`abort`, :meth:`step`; :meth:`stream` and
    :meth:`generate` add prompts and drive steps until they finish. Thread-safe (module docstring).
    """

    def __init__(self, model, num_blocks: int | None = None, memory_bytes: int | None = None,
                 max_batch_tokens: int = 8192, max_num_seqs: int = 256, cuda_graphs: bool | None = None,
                 prefix_caching: bool = True, tokenizer=None, overlap: bool = True, max_model_len: int | None = None,
                 speculative_tokens: int = 0, drafter=None):
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("num_blocks / memory_bytes: give exactly one of them")
        max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, minimum=1)
        if max_model_len is not None:
            model.set_max_model_len(max_model_len)  # raises a random model's limit, refuses past a checkpoint's
        self.model = model
        self.config = c = model.config
        self.max_model_len = c.max_position_embeddings if max_model_len is None else max_model_len
        # the limit as errors name it
        self.max_model_len_name = "max_position_embeddings" if max_model_len is None else "max_model_len"
        self.speculative_tokens = n = _check_speculation(model, speculative_tokens, drafter)
        # the MTP module's layer joins the caches (a drafter that drafts with it says uses_mtp_caches)
        mtp_caches = n > 0 and (drafter is None or getattr(drafter, "uses_mtp_caches", False))
        if num_blocks is None:
            num_blocks = int(memory_bytes) // (bytes_per_token(c, model.dtype, mtp=mtp_caches) * c.block_size)
        num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.num_blocks = num_blocks
        namespace = repr((c, str(model.dtype)))  # what changes a block's content besides its tokens
        self.scheduler = Scheduler(num_blocks, c.block_size, max_batch_tokens, max_num_seqs=max_num_seqs,
                                   prefix_caching=prefix_caching, namespace=namespace, speculative_tokens=n)
        self.drafter = (drafter or MTPDrafter(model, n, max_num_seqs)) if n else None
        self.runner = ModelRunner(model, num_blocks, cuda_graphs, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, mtp_caches=mtp_caches, speculative_tokens=n,
                                  drafter=self.drafter)
        self.sampler = Sampler(c.vocab_size, model.device)
        self.tokenizer = tokenizer
        self.lock = threading.RLock()
        self.overlap = bool(overlap) and not n  # a verify step's rows depend on the last step's acceptance
        self._inflight = collections.deque()  # _InFlight steps launched, not finished on the host
        self._ids = itertools.count()
        self._requests: dict = {}  # rid -> Request, waiting or running
        self._seed_base = self._shared_seed()  # unseeded requests' noise keys derive from it
        eos = c.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.reset_stats()
        self._warm_total = None  # compiles.total() when warm-up ended
        compiles.install()

    def _shared_seed(self) -> int:
        """A random 63-bit number, the same on every tensor-parallel rank: each rank runs this engine
        on the same requests (SPMD) and must sample the same tokens, so rank 0's is broadcast once."""
        seed = random.SystemRandom().getrandbits(63)
        tp = getattr(self.model, "tp", None)
        if tp is not None and tp.size > 1:
            import torch.distributed as dist
            t = torch.tensor([seed], dtype=torch.int64, device=self.model.device)
            dist.broadcast(t, src=0 if tp.group is None else dist.get_global_rank(tp.group, 0), group=tp.group)
            seed = int(t.item())
        return seed

    def __getstate__(self):  # copy.deepcopy, pickle: a lock is not state
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state):
        self.__dict__.update(state, lock=threading.RLock())

    # ---- state the tests and tools look at ------------------------------------------------
    def reset_stats(self) -> None:
        """Zero :attr:`stats`' counters (a bench times a warm pass after a first one)."""
        n = self.speculative_tokens
        self._stats = EngineStats(spec=speculative.SpecStats(n, by_position=[0] * n, proposed_by_position=[0] * n,
                                                                 accepted_lengths=[0] * (n + 1)))
        self._spec_clocks = []  # finished verify steps whose drafter's pass may still run: timed when done

    @property
    def stats(self) -> EngineStats:
        s = self._stats
        speculative.add_times(s.spec, self._spec_clocks, wait=True)  # (the last steps' drafter passes)
        s.blocks_in_use, s.prefix = self.scheduler.blocks.num_used, self.scheduler.blocks.stats
        s.kernel_compiles = compiles.total()
        s.compiles_after_warmup = None if self._warm_total is None else s.kernel_compiles - self._warm_total
        return s

    @property
    def caches(self):
        return self.runner.caches

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def warmup(self, progress: bool = True) -> dict:
        """Compile every kernel and capture every CUDA graph this engine can launch, before any
        request: prefill chunks of each size class up to ``max_batch_tokens``, decode steps at
        every batch bucket up to ``max_num_seqs`` and context bucket up to ``max_model_len`` (or
        the pool's, when smaller), and the sampler's paths. Returns what it did (steps, graphs
        captured, seconds, bytes the graphs hold). Triton keeps what it compiled on disk
        (``~/.triton/cache``, or ``TRITON_CACHE_DIR``), so a second start of the same model
        compiles nothing."""
        with self.lock:
            if self.has_work() or self.scheduler.blocks.num_used:
                raise RuntimeError("warmup: call it before any request is added")
            max_context = min(self.max_model_len, self.capacity_tokens)
            rows = min(self.max_batch_tokens, self.num_blocks, self.scheduler.max_num_seqs)
            report = self.runner.warmup(self.max_batch_tokens, max_context, max_decode_rows=rows, progress=progress)
            logits = torch.zeros(2, self.config.vocab_size, device=self.model.device)
            for params in ([SamplingParams(temperature=0)] * 2,
                           [SamplingParams(temperature=0.7, top_p=0.9, top_k=5, logprobs=2), SamplingParams()]):
                self.sampler(logits, params, [0, 1], [0, 1])
            _listen_for_compiles()
            self._warm_total = compiles.total()
            report["kernel_variants"] = self._warm_total
            return report

    # ---- requests --------------------------------------------------------------------------
    def sampling_params(self, max_new_tokens: int | None = None, sampling: SamplingParams | None = None):
        """``sampling``, or greedy ``SamplingParams(max_tokens=max_new_tokens, temperature=0)``;
        both given must agree on the length."""
        if sampling is None:
            if max_new_tokens is None:
                raise ValueError("max_new_tokens / sampling: give one of them")
            max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
            return SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected dsa.SamplingParams, got {type(sampling).__name__}")
        if max_new_tokens is not None and max_new_tokens != sampling.max_tokens:
            raise ValueError(f"max_new_tokens: {max_new_tokens!r} disagrees with sampling.max_tokens "
                             f"{sampling.max_tokens}; give the limit once")
        return sampling

    def check_request(self, prompt_ids, sampling: SamplingParams) -> "CheckedPrompt":
        """The checks :meth:`add_request` makes, once (no state is touched): the prompt as a
        :class:`CheckedPrompt` that ``add_request`` takes as it is. ValueError when the request
        could never run, naming the limit."""
        vocab = self.config.vocab_size
        prompt = token_ids(prompt_ids, vocab)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (Engine(..., tokenizer=...), or dsa.LLM)")
        if any(t >= vocab for t in sampling.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if sampling.logprobs is not None and self.speculative_tokens:
            raise ValueError("logprobs: not supported with speculative_tokens > 0")
        if sampling.logprobs is not None and sampling.logprobs > vocab:
            raise ValueError(f"logprobs: at most the vocabulary size {vocab}, got {sampling.logprobs}")
        total = len(prompt) + sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt_ids: {len(prompt)} + max_new_tokens {sampling.max_tokens} = {total} tokens "
                             f"exceed {self.max_model_len_name} {self.max_model_len}")
        blocks = self.scheduler.blocks_for(total)
        if blocks > self.num_blocks:
            raise ValueError(f"prompt_ids: {total} tokens need {blocks} blocks; the engine holds "
                             f"{self.num_blocks} ({self.capacity_tokens} tokens)")
        return CheckedPrompt(tuple(prompt), sampling, self._limits())

    def _limits(self) -> tuple:
        """What :meth:`check_request` checks a request against."""
        c = self.config
        return c.vocab_size, self.max_model_len, self.num_blocks, c.block_size, self.tokenizer is not None

    def add_request(self, prompt_ids, max_new_tokens: int | None = None, *, sampling: SamplingParams | None = None,
                    on_output=None) -> int:
        """Queue a prompt (token ids, or a :class:`CheckedPrompt` of :meth:`check_request`, taken as
        it is); returns its request id. Raises ValueError if it can never fit.

        ``on_output(delta)``: called with each :class:`~dsa.engine.output.Delta` of this request, under the
        engine lock, by the thread that runs the step (keep it short: e.g. put it in a queue).
        """
        if isinstance(prompt_ids, CheckedPrompt):
            checked = prompt_ids
            if checked.limits != self._limits():
                raise ValueError("prompt_ids: checked by an engine with other limits; check it with this one")
            if sampling is not None and sampling != checked.sampling:
                raise ValueError("sampling: differs from the one the prompt was checked with")
            self.sampling_params(max_new_tokens, checked.sampling)
        else:
            checked = self.check_request(prompt_ids, self.sampling_params(max_new_tokens, sampling))
        sp, prompt = checked.sampling, list(checked.ids)
        text = None if self.tokenizer is None else TextOutput(self.tokenizer, prompt, sp.stop)
        with self.lock:
            rid = next(self._ids)
            seed = (self._seed_base + rid * 0x9E3779B97F4A7C15) % (1 << 64) if sp.seed is None else sp.seed
            req = Request(rid, prompt, len(prompt), sp.max_tokens, sampling=sp, seed=seed, text=text,
                          on_output=on_output)
            self.scheduler.add(req)
            self._requests[req.rid] = req
        return req.rid

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request and free its blocks now; its reader gets a last delta
        with ``finish_reason="abort"``. False when the request is unknown or already finished."""
        with self.lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return False
            self.scheduler.remove(req)
            self._deliver(req, [], None, "abort")
            while self._inflight and not self._requests:  # nobody waits for the steps in flight
                self._finish_step(self._inflight.popleft())
            return True

    def step(self) -> dict:
        """Run one batch; returns ``{request id: [tokens]}`` of the step that finished (with
        ``overlap``, the one launched by the call before: the GPU runs this call's step meanwhile)."""
        return self._step()[1]

    def _step(self) -> tuple:
        """``(whether anything was launched or finished, {request id: [tokens]})``."""
        with self.lock:
            launched = self._launch()
            produced = {}
            while len(self._inflight) > (1 if self.overlap and launched else 0):
                produced.update(self._finish_step(self._inflight.popleft()))
            return launched or bool(produced), produced

    def _launch(self) -> bool:
        """Schedule a step and put it on the GPU, its sampled tokens on their way to the host; the
        requests that sample hold a PENDING token until :meth:`_finish_step`."""
        out = self.scheduler.schedule()
        s = self._stats
        s.preemptions += len(out.preempted)
        if not out:
            return False
        if self.speculative_tokens:
            self._inflight.append(speculative.launch(self, out))
            s.prefill_chunks += out.prefill_chunks
            s.steps += 1
            s.tokens += out.num_tokens
            return True
        chunks = self._long_chunks(out) if out.prefill_chunks else ()
        clock = _StepClock(self.model.device) if chunks else None
        result = self.runner.run(out, self._inflight[-1].sample.tokens if self._inflight else None)
        sample = self.sampler.launch(result.logits, result.sampling)
        step = _InFlight(sample, out.sampled)
        if clock is not None:
            clock.stop()
            step.clock, step.chunks, step.decode_rows = clock, chunks, sum(n == 1 for n in out.num_rows)
        s.prefill_chunks += out.prefill_chunks
        for path, rows in result.rows.items():
            s.rows[path] += rows
        s.peak_workspace_bytes = max(s.peak_workspace_bytes, result.workspace_bytes)
        s.steps += 1
        s.graph_steps += result.graph
        s.tokens += out.num_tokens
        self._inflight.append(step)
        return True

    def _long_chunks(self, out) -> tuple:
        """``(request id, first position, rows)`` of the step's chunks of long prompts (longer than
        ``max_batch_tokens``: prefilled over several steps), the ones :class:`PrefillStep` records."""
        longest = self.max_batch_tokens
        return tuple((rid, c, n) for rid, c, n in zip(out.rids, out.computed, out.num_rows)
                     if n > 1 and getattr(self._requests.get(rid), "prompt_len", 0) > longest)

    def _finish_step(self, step: "_InFlight") -> dict:
        """The host side of a launched step: stop checks, its tokens to the scheduler (in place of
        the PENDING ones), deltas to the readers."""
        if isinstance(step, speculative.VerifiedStep):
            return self._finish_verified(step)
        tokens, logprobs = step.sample.result()
        if step.clock is not None:
            self._stats.prefill_steps.append(PrefillStep(step.chunks, step.decode_rows, step.clock.ms()))
        results, reasons = [], []
        for sampled in step.sampled:
            req = sampled.request
            if self._requests.get(req.rid) is not req:
                continue  # finished or aborted meanwhile: this row's token is dropped
            tok = tokens[sampled.row]
            reason = self._stop_reason(req, tok, sampled.last)
            results.append((sampled, tok, reason is not None))
            reasons.append(reason)
        self.scheduler.update(results)
        produced = {}
        for (sampled, tok, _), reason in zip(results, reasons):
            req = sampled.request
            produced[req.rid] = [tok]
            if reason is not None:
                del self._requests[req.rid]
                if req.text is not None:
                    req.text.finish()
            lp = logprobs[sampled.row]
            self._deliver(req, [tok], None if lp is None else [lp], reason)
        self._stats.generated_tokens += len(produced)
        return produced

    def _finish_verified(self, step: "speculative.VerifiedStep") -> dict:
        """:meth:`_finish_step` of a speculating step: each request's accepted drafts and one more token,
        cut after the first that stops it (EOS, a stop token or string, its length limit)."""
        n = self.speculative_tokens
        rows = step.packed.rows()
        results, reasons, kept = [], [], []
        accepted = [int(row[n + 1]) for row in rows]
        for sampled, row, a in zip(step.sampled, rows, accepted):
            req = sampled.request
            if self._requests.get(req.rid) is not req:
                kept.append(0)
                continue  # finished or aborted meanwhile
            tokens, reason, done = [], None, sampled.index - req.prompt_len
            for j, tok in enumerate(int(t) for t in row[:a + 1]):
                tokens.append(tok)
                reason = self._stop_reason(req, tok, done + j + 1 >= req.max_new_tokens)
                if reason is not None:
                    break
            results.append((sampled, tokens, reason is not None))
            reasons.append(reason)
            kept.append(len(tokens))
        speculative.add_times(self._stats.spec, self._spec_clocks, wait=False)
        speculative.count(self._stats.spec, step, accepted, kept, self._spec_clocks)
        self.scheduler.update(results)
        produced = {}
        for (sampled, tokens, _), reason in zip(results, reasons):
            req = sampled.request
            produced[req.rid] = tokens
            if reason is not None:
                del self._requests[req.rid]
                if req.text is not None:
                    req.text.finish()
            self._deliver(req, tokens, None, reason)
        self._stats.generated_tokens += sum(map(len, produced.values()))
        return produced

    def _stop_reason(self, req: Request, tok: int, last: bool) -> str | None:
        """Why a request ends with this token (None: it goes on); its text takes the token."""
        sp = req.sampling
        if tok in sp.stop_token_ids or (tok in self.eos and not sp.ignore_eos):
            return "stop"  # the stop token's text is not part of the output
        if req.text is not None and req.text.append(tok):
            return "stop"  # a stop string: the text ends before it
        return "length" if last else None

    def _deliver(self, req: Request, tokens: list, logprobs, reason) -> None:
        if req.on_output is not None:
            text = None if req.text is None else req.text.release(final=reason is not None)
            req.on_output(Delta(req.rid, tokens, text, reason, logprobs))

    def stream(self, prompts, max_new_tokens: int | None = None, *, sampling=None):
        """Add ``prompts`` (token id lists) and yield each request's :class:`~dsa.engine.output.Delta` s as
        steps produce them, until all finish; ``delta.index`` is the prompt's position in
        ``prompts``. ``sampling``: one SamplingParams for all, or one per prompt (None: greedy with
        ``max_new_tokens``). Leaving the loop early (break, an exception) aborts the unfinished
        requests; so does an error while adding them."""
        prompts = list(prompts)
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise ValueError(f"sampling: expected one per prompt ({len(prompts)}), got {len(samplings)}")
        deltas = collections.deque()  # appended under the lock by whichever thread steps
        index, live = {}, set()
        try:
            with self.lock:
                for i, (p, sp) in enumerate(zip(prompts, samplings)):
                    rid = self.add_request(p, max_new_tokens, sampling=sp, on_output=deltas.append)
                    index[rid] = i
                    live.add(rid)
            while live:
                while deltas:
                    d = deltas.popleft()
                    d.index = index[d.request_id]
                    if d.finished:
                        live.discard(d.request_id)
                    yield d
                if live:
                    with self.lock:
                        if not deltas and not self._step()[0]:
                            raise RuntimeError("engine: requests are waiting but none can be scheduled")
        finally:
            if live:
                with self.lock:
                    for rid in live:
                        self.abort(rid)

    def generate(self, prompts, max_new_tokens: int | None = None, *, sampling=None) -> list:
        """Completions (generated token ids only) of each prompt, in order; greedy unless ``sampling``
        says otherwise. A generate that raises leaves none of its requests behind."""
        prompts = list(prompts)
        out = [[] for _ in prompts]
        for d in self.stream(prompts, max_new_tokens, sampling=sampling):
            out[d.index].extend(d.token_ids)
        return out


def _check_speculation(model, n, drafter) -> int:
    """``speculative_tokens`` checked against the model and the drafter (one-line ValueErrors)."""
    n = check_int("speculative_tokens", n, minimum=0)
    if drafter is not None and not n:
        raise ValueError("drafter: given with speculative_tokens = 0 (give N >= 1 draft tokens)")
    tp = getattr(model, "tp", None)
    if n and tp is not None and tp.size > 1:
        raise ValueError(f"speculative_tokens: not supported with tensor parallelism (tp = {tp.size})")
    if n and drafter is None and model.mtp is None:
        raise ValueError("speculative_tokens: the model has no MTP module (num_nextn_predict_layers = 0)")
    return n


_listening = []


def _listen_for_compiles() -> None:
    """Once per process, after the first warm-up: log every kernel variant built from then on (a
    step that waited for Triton, seconds, on a path the warm-up did not cover)."""
    if not _listening:
        compiles.add_listener(lambda kernel, key: log.warning("kernel compiled after warm-up: %s [%s]", kernel, key))
        _listening.append(True)


def token_ids(prompt_ids, vocab_size: int) -> list:
    """A prompt as a list of ints in ``[0, vocab_size)``, at least one; ``TypeError`` for floats and
    bools (a float tensor too), ``ValueError`` for an empty prompt or ids out of range. Checked as
    one array (a 128K-token prompt in milliseconds)."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dtype == torch.bool or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise TypeError(f"prompt_ids: expected integer token ids, got a {prompt_ids.dtype} tensor")
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids: expected a 1-D tensor, got shape {list(prompt_ids.shape)}")
        ids = prompt_ids.cpu().numpy()
    elif isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids: expected integer token ids, got {type(prompt_ids).__name__}")
    else:
        prompt_ids = list(prompt_ids)
        ids = np.asarray(prompt_ids) if prompt_ids else np.zeros(0, np.int64)
        if ids.dtype.kind not in "iu" or ids.ndim != 1 or any(type(t) is bool for t in prompt_ids):
            # floats, bools (numpy would make ints of them), nested or mixed: name the first bad one
            for t in prompt_ids:
                check_int("prompt_ids", t)
            raise TypeError("prompt_ids: expected a flat sequence of integer token ids")
    if ids.size == 0:
        raise ValueError("prompt_ids: expected at least one token")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab_size})")
    return ids.tolist()
