"""Sampling parameters and the batched sampler that turns a step's logits into tokens.

One step samples every row in one batched operation on the logits' device, with each request's
parameters as per-row tensors (uploaded once per step) and no per-request launches:

1. ``temperature`` scales the logits (rows with temperature 0 take the argmax of the raw logits);
2. ``top_k`` keeps the k largest (stable sort: at a tie the lower token id wins, as in argmax);
3. ``top_p`` keeps the smallest prefix (largest first) of what top_k kept, renormalized, whose
   probability reaches p (the first token always);
4. ``min_p`` keeps tokens whose probability is at least ``min_p`` times the largest;
5. Gumbel-max: the token is ``argmax(logits / temperature + g)`` over the kept tokens, with
   ``g = -log(-log(u))`` and ``u`` uniform noise that is a hash of (request seed, position of the
   token being sampled, token id), computed with integer tensor ops. The noise is a function of
   those three numbers alone (counter-based; no generator state), so a seeded request gives the
   same tokens alone or in any batch, at any chunk size.

Logprobs are the model's: ``log_softmax`` of the raw logits (before temperature and filters).
"""
import math
from dataclasses import dataclass

import numpy as np
import torch

from dsa.engine.staging import PinnedBuffers
from dsa.kernels.common import check_int, check_real

MAX_LOGPROBS = 20
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's tokens and when to stop.

    ``max_tokens``: tokens to generate at most (the request's one length limit).
    ``temperature``: 0 is greedy (argmax). ``top_k``: 0 (or -1) keeps every token. ``top_p``: 1
    keeps every token. ``min_p``: 0 keeps every token. ``seed``: the request's noise key (None:
    drawn at random when the request is added). ``stop``: strings that end the text before them.
    ``stop_token_ids``: tokens that end generation (``finish_reason="stop"``; their text is not
    in the output). ``ignore_eos``: keep going past EOS. ``logprobs``: None, or n in [0, 20]: each
    token's logprob and the n most likely tokens' logprobs.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        def fail(name, expected):
            raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        def store(name, value):
            object.__setattr__(self, name, value)

        store("max_tokens", check_int("max_tokens", self.max_tokens, minimum=1))
        store("temperature", check_real("temperature", self.temperature))
        if self.temperature < 0:
            fail("temperature", "a finite float >= 0")
        store("top_p", check_real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            fail("top_p", "a float in (0, 1]")
        if check_int("top_k", self.top_k) < -1:
            fail("top_k", "an int >= 0 (0 or -1: no limit)")
        store("min_p", check_real("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            fail("min_p", "a float in [0, 1]")
        if self.seed is not None:
            store("seed", check_int("seed", self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            fail("stop", "a non-empty string or a list of them")
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            fail("stop_token_ids", "a list of token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")
        if self.logprobs is not None:
            store("logprobs", check_int("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                fail("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        store("stop", tuple(stop))
        store("stop_token_ids", tuple(check_int("stop_token_ids", t, minimum=0) for t in ids))
        store("top_k", max(int(self.top_k), 0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)  # a request's sampling when nothing else is said (its length aside)


# ---- counter-based noise -------------------------------------------------------------------
def _mul32(x, c: int):
    """``x * c mod 2**32`` for 32-bit ``x`` in int64 (split so no product overflows int64)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x):
    """A 32-bit integer hash (``lowbias32``: xor-shift-multiply, a bijection of [0, 2**32)),
    for an int64 tensor of values in [0, 2**32) or a Python int."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request's seed (mod 2**64) hashed to 32 bits: the part of its noise keys that every one
    of its tokens shares (hashed once, when it is admitted)."""
    seed &= (1 << 64) - 1
    return hash32(hash32(seed & _M32) ^ (seed >> 32))


def position_keys(seed_keys, positions) -> tuple:
    """The two 32-bit noise keys of rows: a hash of (:func:`seed_key`, position of the token
    sampled), for ints or int64 arrays / tensors."""
    k1 = hash32(seed_keys ^ (positions & _M32))
    return k1, hash32(k1 ^ 0x5BD1E995)


def noise_keys(seed: int, position: int) -> tuple:
    """The two 32-bit keys of one row's noise: a hash of (seed mod 2**64, position)."""
    return position_keys(seed_key(seed), position)


def uniform_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """``u [B, V]`` fp32 in (0, 1): ``(hash32(((vh ^ k1) + k2) mod 2**32) >> 8) + 0.5) / 2**24``
    with ``keys [B, 2]`` int64 (k1, k2 per row) and ``vocab_hash [V]`` int64 = ``hash32(token id)``."""
    bits = hash32(((vocab_hash[None, :] ^ keys[:, :1]) + keys[:, 1:]) & _M32)
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


# ---- the batched operation -----------------------------------------------------------------
def keep_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
              sort: bool = True) -> torch.Tensor:
    """Which tokens each row may sample.

    ``scaled [B, V]`` fp32: logits / temperature; ``top_k [B]`` int64 (V or more: no limit);
    ``top_p [B]`` fp32 (1: no limit); ``min_p [B]`` fp32 (0: no limit). Returns bool ``[B, V]``.
    ``sort=False`` skips top_k and top_p (when no row uses them).
    """
    b, v = scaled.shape
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if sort:
        vals, order = scaled.sort(dim=-1, descending=True, stable=True)
        ranked = torch.arange(v, device=scaled.device)[None, :] < top_k[:, None]
        probs = vals.masked_fill(~ranked, -math.inf).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the larger tokens
        ranked &= (before < top_p[:, None]) | (top_p[:, None] >= 1)
        ranked[:, 0] = True
        keep = torch.zeros_like(keep).scatter_(-1, order, ranked)
    # p >= min_p * p_max  <=>  scaled >= max(scaled) + log(min_p)   (min_p = 0: log is -inf)
    floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return keep & (scaled >= floor)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor, greedy: torch.Tensor,
                  sort: bool = True) -> torch.Tensor:
    """One token per row: ``tokens [B]`` int64.

    ``logits [B, V]`` fp32; ``temperature [B]`` fp32 (> 0; ignored on greedy rows); ``top_k [B]``
    int64, ``top_p`` / ``min_p [B]`` fp32 (see :func:`keep_mask`); ``keys [B, 2]`` int64 and
    ``vocab_hash [V]`` int64 (see :func:`uniform_noise`); ``greedy [B]`` bool: argmax of ``logits``.
    """
    scaled = logits / temperature[:, None]
    scaled = scaled.masked_fill(~keep_mask(scaled, top_k, top_p, min_p, sort), -math.inf)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, vocab_hash)))
    return torch.where(greedy[:, None], logits, scaled + gumbel).argmax(dim=-1)


@dataclass
class Logprob:
    """A generated token's logprob under the model and the ``n`` most likely tokens' (largest first)."""
    token_id: int
    logprob: float
    top: list  # [(token id, logprob)]


class SamplingRows:
    """Sampling parameters, one row per request, kept across steps: the runner's batch writes a
    request's row when it is admitted (:meth:`set`) and gathers a step's rows with one fancy
    index per column (:meth:`take`), so no step reads a :class:`SamplingParams`."""

    def __init__(self, rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.temperature = np.ones(rows)  # 1 on greedy rows (their logits are not scaled)
        self.top_p = np.ones(rows)
        self.min_p = np.zeros(rows)
        self.top_k = np.full(rows, vocab_size, np.int64)  # the vocabulary size: no limit
        self.greedy = np.ones(rows, bool)
        self.sorts = np.zeros(rows, bool)  # it uses top_k or top_p: a step that samples it sorts
        self.seed_key = np.zeros(rows, np.int64)  # seed_key(seed)
        self.logprobs = np.full(rows, -1, np.int64)  # top logprobs it asks for (-1: none)

    def set(self, row: int, params: SamplingParams, seed: int) -> None:
        self.temperature[row] = params.temperature or 1.0
        self.top_p[row], self.min_p[row] = params.top_p, params.min_p
        self.top_k[row] = params.top_k or self.vocab_size
        self.greedy[row] = params.greedy
        self.sorts[row] = bool(params.top_k or params.top_p < 1)
        self.seed_key[row] = seed_key(seed)
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs

    def take(self, rows: np.ndarray, positions: np.ndarray) -> "SamplingBatch":
        """A step's sampling: ``rows`` of this table, ``positions`` [B] int64 of the tokens sampled."""
        greedy, logprobs = self.greedy[rows], self.logprobs[rows]
        if greedy.all():
            return SamplingBatch(None, False, logprobs)
        k1, k2 = position_keys(self.seed_key[rows], positions)
        table = np.stack((self.temperature[rows], self.top_p[rows], self.min_p[rows], self.top_k[rows], greedy, k1, k2),
                         axis=1).astype(np.float64, copy=False)
        return SamplingBatch(table, bool((self.sorts[rows] & ~greedy).any()), logprobs)


@dataclass
class SamplingBatch:
    """One step's sampling rows (:meth:`SamplingRows.take`)."""
    table: np.ndarray | None  # [B, 7] float64: temperature, top_p, min_p, top_k, greedy, noise keys k1, k2
    # (the step's one upload); None when every row is greedy (one argmax)
    sort: bool  # some sampled row uses top_k or top_p
    logprobs: np.ndarray  # [B] int64: top logprobs asked for per row (-1: none)

    @classmethod
    def of(cls, params: list, seeds: list, positions: list, vocab_size: int) -> "SamplingBatch":
        """The rows of B SamplingParams, their seeds and the positions of the tokens sampled."""
        rows = SamplingRows(len(params), vocab_size)
        for i, (p, seed) in enumerate(zip(params, seeds)):
            rows.set(i, p, seed)
        return rows.take(np.arange(len(params)), np.asarray(positions, dtype=np.int64))


class Sampler:
    """Samples a step's rows: uploads the step's sampling table once (through persistent pinned
    buffers), runs :func:`sample_tokens`; the tokens (and logprobs, when asked for) come back in
    one non-blocking copy (:meth:`launch` returns at once, :meth:`PendingSample.result` waits for
    the copy). A batch of greedy rows is one argmax; sorting happens only when a row uses top_k or
    top_p."""

    def __init__(self, vocab_size: int, device):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.vocab_hash = hash32(torch.arange(vocab_size, dtype=torch.int64, device=self.device))
        self.uploads = PinnedBuffers(self.device, torch.float64)  # the sampling tables, on their way up
        self.staging = PinnedBuffers(self.device, torch.float64)  # the sampled rows, on their way down

    def __call__(self, logits: torch.Tensor, params: list, seeds: list, positions: list) -> tuple:
        """Sample B rows of B SamplingParams (their seeds, the positions of the tokens sampled) and
        wait: ``(tokens: list[int], logprobs: list[Logprob | None])``."""
        return self.launch(logits, SamplingBatch.of(params, seeds, positions, self.vocab_size)).result()

    def launch(self, logits: torch.Tensor, batch: SamplingBatch) -> "PendingSample":
        """``logits [B, V]`` fp32, ``batch`` their B rows. The tokens stay on the device
        (``.tokens [B]`` int64, for the next step's inputs) and start their copy to the host."""
        if batch.table is None:
            tokens = logits.argmax(dim=-1)
        else:
            dev = self.uploads.copy_to(batch.table)
            tokens = sample_tokens(logits, dev[:, 0].float(), dev[:, 3].long(), dev[:, 1].float(), dev[:, 2].float(),
                                   dev[:, 5:7].long(), self.vocab_hash, dev[:, 4].bool(), sort=batch.sort)
        n = int(batch.logprobs.max(initial=-1))
        n = None if n < 0 else n
        packed = tokens[:, None].double()
        if n is not None:
            lp = torch.log_softmax(logits, dim=-1)
            top = lp.topk(n, dim=-1)
            packed = torch.cat([packed, lp.gather(1, tokens[:, None]).double(), top.values.double(),
                                top.indices.double()], dim=1)
        return PendingSample(tokens, packed, batch.logprobs.tolist() if n is not None else None, n, self.staging)


class PendingSample:
    """A step's sampled tokens on their way to the host: ``tokens`` on the device now, the host
    lists from :meth:`result` (which waits for the copy alone, not for later work on the GPU).
    On CUDA the copy lands in a buffer of ``staging``, held until the result is read (or this
    object is dropped unread)."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, logprobs: list | None, n: int | None,
                 staging: PinnedBuffers):
        self.tokens, self.logprobs, self.n = tokens, logprobs, n  # logprobs: per row k (-1: none), with n
        self._staging = self._slot = self._event = self._rows = None
        if packed.device.type == "cuda":
            self._staging, self._slot = staging, staging.take(packed.numel())
            self._host = self._slot.buffer[:packed.numel()].view(packed.shape)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def rows(self) -> list:
        """The packed rows as host lists (waits for their copy alone)."""
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._host.tolist()
            self._release()
        return self._rows

    def result(self) -> tuple:
        """``(tokens: list[int], logprobs: list[Logprob | None])``."""
        rows = self.rows()
        if self.n is None:
            return [int(r[0]) for r in rows], [None] * len(rows)
        n, out = self.n, []
        for k, row in zip(self.logprobs, rows):
            out.append(None if k < 0 else
                       Logprob(int(row[0]), row[1], [(int(i), x) for x, i in zip(row[2:2 + k], row[2 + n:2 + n + k])]))
        return [int(r[0]) for r in rows], out

    def _release(self) -> None:
        if self._slot is not None:
            self._staging.give_back(self._slot, copied=False)  # read (or never to be read)
            self._slot = None

    def __del__(self):  # a step dropped unread: its copy may still run, so wait for it first
        if self._slot is not None:
            try:
                self._event.synchronize()
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; so is the buffer's user
                return
            self._release()
