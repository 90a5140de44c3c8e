"""greedy_accept (a verify step's greedy acceptance in one launch): the Triton kernel under the CPU interpreter
gives the reference's tensors, and both give the rejection sampler's earlier torch expression, at every
accepted length 0 .. N, with rows of fewer drafts than N (-1 past them), N = 1 .. 4, odd row counts and none."""
import pytest
import torch

from dsa import kernels as K
from dsa.engine.rejection import _emitted

POISON = -7777  # never an output: the kernel must write every element


def _old_greedy(argmax, drafts):
    """The rejection sampler's greedy path before the kernel: the longest agreeing prefix, then ``_emitted``."""
    n = drafts.shape[1]
    accepted = ((argmax[:, :n] == drafts) & (drafts >= 0)).long().cumprod(dim=-1).sum(dim=-1)
    return _emitted(drafts, accepted, argmax.gather(1, accepted[:, None])[:, 0])


def _rows(b: int, n: int, seed: int, vocab: int = 11) -> tuple:
    """``(argmax [B, N + 1], drafts [B, N])`` int64: row ``i`` carries the ``i``-th pair (cycling) of :func:`_pairs`,
    ``k`` drafts (-1 after) of which the first ``a`` agree with the argmax and the next one (if any) does not; a
    few rows with drafts past a -1 that agree too."""
    g = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, vocab, (b, n + 1), generator=g)
    drafts = torch.full((b, n), -1, dtype=torch.int64)
    pairs = _pairs(n)
    for i in range(b):
        k, a = pairs[i % len(pairs)]
        drafts[i, :k] = argmax[i, :k]
        if a < k:
            drafts[i, a] = (argmax[i, a] + 1 + int(torch.randint(0, vocab - 1, (), generator=g))) % vocab
            drafts[i, a + 1:k] = torch.where(torch.rand(k - a - 1, generator=g) < 0.5, argmax[i, a + 1:k],
                                             drafts[i, a + 1:k])
        if i % 7 == 3 and k < n:  # an agreeing draft after a -1: still not accepted
            drafts[i, k + 1:] = argmax[i, k + 1:n]
    return argmax, drafts


def _pairs(n: int) -> list:
    """Every ``(drafts k, accepted a)`` of ``N`` drafts: ``0 <= a <= k <= N``."""
    return [(k, a) for k in range(n + 1) for a in range(k + 1)]


@pytest.fixture
def poisoned(monkeypatch):
    """``torch.empty`` filled with :data:`POISON` while a test runs (the kernel's outputs start as garbage)."""
    empty = torch.empty

    def garbage(*args, **kwargs):
        return empty(*args, **kwargs).fill_(POISON)
    monkeypatch.setattr(torch, "empty", garbage)


CASES = [(b, n) for n in (1, 2, 3, 4) for b in (0, 1, 5, 17, 67)]


@pytest.mark.parametrize("b,n", CASES, ids=[f"b{b}-n{n}" for b, n in CASES])
def test_the_kernel_gives_the_reference_and_the_old_expression(poisoned, b, n):
    argmax, drafts = _rows(b, n, seed=100 * n + b)
    want = _old_greedy(argmax, drafts)
    ref = K.greedy_accept_reference(argmax, drafts)
    got = K.greedy_accept(argmax, drafts, backend="triton")
    for name, w, r, x in zip(("tokens", "accepted"), want, ref, got):
        assert r.dtype == x.dtype == torch.int64 and r.shape == x.shape == w.shape, name
        assert torch.equal(r, w), f"{name}: the reference {r.tolist()} != the old expression's {w.tolist()}"
        assert torch.equal(x, w), f"{name}: the kernel {x.tolist()} != the old expression's {w.tolist()}"
    if b >= len(_pairs(n)):
        assert set(got[1].tolist()) == set(range(n + 1)), "every accepted length occurs"


@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int64), (torch.int64, torch.int32), (torch.int32, torch.int32)],
                         ids=["i32-argmax", "i32-drafts", "i32-both"])
def test_int32_inputs(poisoned, dtypes):
    argmax, drafts = _rows(29, 3, seed=3)
    want = _old_greedy(argmax, drafts)
    a, d = argmax.to(dtypes[0]), drafts.to(dtypes[1])
    for backend in ("torch", "triton"):
        for w, x in zip(want, K.greedy_accept(a, d, backend=backend)):
            assert x.dtype == torch.int64 and torch.equal(x, w), backend


def test_strided_views_of_a_packed_buffer(poisoned):
    """The inputs as views at any offset and stride (drafts a column slice, argmax a view of an int32 buffer)."""
    n, b = 3, 70
    argmax, drafts = _rows(b, n, seed=9)
    want = _old_greedy(argmax, drafts)
    buf = torch.full((1 + b * (n + 1),), -5, dtype=torch.int32)
    buf[1:] = argmax.reshape(-1)
    wide = torch.full((b, n + 4), 3, dtype=torch.int64)
    wide[:, 2:2 + n] = drafts
    got = K.greedy_accept(buf[1:].view(b, n + 1), wide[:, 2:2 + n], backend="triton")
    for w, x in zip(want, got):
        assert torch.equal(x, w)
    t = torch.empty(n, b, dtype=torch.int64)  # drafts column-major
    t.copy_(drafts.t())
    for w, x in zip(want, K.greedy_accept(argmax, t.t(), backend="triton")):
        assert torch.equal(x, w)


def test_the_rejection_samplers_greedy_path_is_the_kernel():
    from dsa.engine.rejection import rejection_sample
    n, b = 2, 9
    logits = torch.randint(0, 3, (b, n + 1, 6), generator=torch.Generator().manual_seed(2)).float()  # ties
    argmax = logits.argmax(dim=-1)
    drafts = torch.where(torch.arange(n)[None] < torch.arange(b)[:, None] % (n + 1), argmax[:, :n], -1)
    for w, x in zip(_old_greedy(argmax, drafts), rejection_sample(logits, drafts, all_greedy=True)):
        assert torch.equal(x, w)


@pytest.mark.parametrize("call,error,name", [
    (lambda: K.greedy_accept(torch.zeros(3, 3), torch.zeros(3, 2, dtype=torch.long)), TypeError, "argmax"),
    (lambda: K.greedy_accept(torch.zeros(3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long)), ValueError,
     "argmax"),
    (lambda: K.greedy_accept(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 0, dtype=torch.long)), ValueError,
     "argmax"),
    (lambda: K.greedy_accept(torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)), ValueError,
     "drafts"),
    (lambda: K.greedy_accept(torch.zeros(3, 3, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long)), ValueError,
     "drafts"),
    (lambda: K.greedy_accept(torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 2)), TypeError, "drafts"),
    (lambda: K.greedy_accept(torch.zeros(3, 3, dtype=torch.long), [[0, 0]] * 3), TypeError, "drafts"),
    (lambda: K.greedy_accept(torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long, device="meta")),
     ValueError, "drafts"),
    (lambda: K.greedy_accept(torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long),
                             backend="cuda"), ValueError, "backend"),
], ids=["argmax-dtype", "argmax-dims", "argmax-no-draft", "drafts-width", "drafts-rows", "drafts-dtype",
        "drafts-list", "drafts-device", "backend"])
def test_bad_inputs_name_the_argument(call, error, name):
    with pytest.raises(error, match=f"^{name}"):
        call()
