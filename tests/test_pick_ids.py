"""pick_ids (each row's id from the first source that has one, in one launch): the Triton kernel under the CPU
interpreter gives the reference's values, and both a plain-Python oracle's, with and without the second source,
into new, given (poisoned) and in-place outputs; a verify step's draft read gives the old torch expression."""
import pytest
import torch

from dsa import kernels as K

POISON = -7777  # never an output: the kernel must write every element


def _oracle(default, tokens, index, ids=None, ids_index=None) -> list:
    out = []
    for i, d in enumerate(default.tolist()):
        t = int(index[i])
        if 0 <= t < len(tokens) and int(tokens[t]) >= 0:
            out.append(int(tokens[t]))
        elif ids is not None and 0 <= int(ids_index[i]) < len(ids):
            out.append(int(ids[int(ids_index[i])]))
        else:
            out.append(d)
    return out


def _case(t: int, m: int, k: int, seed: int, dtype=torch.int64) -> dict:
    """Random rows: tokens with -1 entries, indices -1, in range, past the end and far outside (-2^31)."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda hi: torch.randint(-2, hi + 3, (t,), generator=g)  # noqa: E731 - -2 .. hi + 2
    index, ids_index = pick(m), pick(k)
    if t:
        index[0], ids_index[-1] = -(2 ** 31), 2 ** 31 - 1
    return dict(default=torch.randint(0, 1000, (t,), generator=g).to(dtype),
                tokens=torch.where(torch.rand(m, generator=g) < 0.3, -1, torch.randint(0, 50, (m,), generator=g)),
                index=index.to(torch.int32), ids=torch.randint(0, 70000, (k,), generator=g).to(torch.int32),
                ids_index=ids_index.to(torch.int32))


SIZES = [(0, 4, 3), (1, 1, 1), (7, 3, 0), (130, 17, 9), (300, 0, 40)]


@pytest.mark.parametrize("two", [False, True], ids=["one-source", "two-sources"])
@pytest.mark.parametrize("t,m,k", SIZES, ids=[f"t{t}-m{m}-k{k}" for t, m, k in SIZES])
def test_the_kernel_gives_the_reference_and_the_oracle(t, m, k, two):
    case = _case(t, m, k, seed=t * 100 + m + k)
    if not two:
        case.pop("ids"), case.pop("ids_index")
    want = _oracle(**case)
    for backend in ("torch", "triton"):
        got = K.pick_ids(**case, backend=backend)
        assert got.dtype == torch.int64 and got.shape == (t,) and got.tolist() == want, backend


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("where", ["given", "in-place"])
def test_into_a_given_or_the_default_tensor(dtype, where):
    case = _case(131, 20, 11, seed=5, dtype=dtype)
    want = _oracle(**case)
    for backend in ("torch", "triton"):
        args = {name: t.clone() for name, t in case.items()}
        out = torch.full((131,), POISON, dtype=dtype) if where == "given" else args["default"]
        got = K.pick_ids(**args, out=out, backend=backend)
        assert got is out and out.dtype == dtype and out.tolist() == want, backend


def test_strided_views_of_a_packed_buffer():
    """Every input a view at an odd offset or stride (a step's packed int32 buffer, a column of drafts)."""
    case = _case(70, 12, 9, seed=11)
    want = _oracle(**case)
    buf = torch.full((1 + 3 * 70 + 9,), -5, dtype=torch.int32)
    views = {}
    at = 1
    for name in ("default", "index", "ids_index", "ids"):
        n = case[name].shape[0]
        views[name] = buf[at:at + n]
        views[name].copy_(case[name])
        at += n
    wide = torch.full((12, 3), 9, dtype=torch.int64)
    wide[:, 1] = case["tokens"]
    out = torch.full((2 * 70,), POISON, dtype=torch.int64)[::2]
    for backend in ("torch", "triton"):
        got = K.pick_ids(views["default"], wide[:, 1], views["index"], views["ids"], views["ids_index"], out=out,
                         backend=backend)
        assert got.tolist() == want, backend


def test_a_verify_steps_draft_read_is_the_old_expression():
    """``draft_verify``: the draft rows (``src >= 0``) read their drafts in place, a -1 draft the row's id (0 on
    the host); the old expression clamped the draft: the same ids."""
    g = torch.Generator().manual_seed(3)
    s, n, t = 5, 3, 23
    drafts = torch.where(torch.rand(s, n, generator=g) < 0.2, -1, torch.randint(0, 256, (s, n), generator=g))
    src = torch.full((t,), -1, dtype=torch.int32)
    rows = torch.randperm(t, generator=g)[:12]
    src[rows] = torch.randperm(s * n, generator=g)[:12].to(torch.int32)
    ids = torch.randint(0, 256, (t,), generator=g).to(torch.int32)
    ids[src >= 0] = 0
    old = torch.where(src >= 0, drafts.reshape(-1).clamp_min(0)[src.long().clamp_min(0)].to(ids.dtype), ids)
    for backend in ("torch", "triton"):
        got = ids.clone()
        K.pick_ids(got, drafts.reshape(-1), src, out=got, backend=backend)
        assert torch.equal(got, old), backend


I64 = torch.int64


@pytest.mark.parametrize("call,error,name", [
    (lambda: K.pick_ids(torch.zeros(3), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64)), TypeError, "default"),
    (lambda: K.pick_ids(torch.zeros(3, 1, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64)),
     ValueError, "default"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, 2, dtype=I64), torch.zeros(3, dtype=I64)),
     ValueError, "tokens"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(4, dtype=I64)),
     ValueError, "index"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64),
                        torch.zeros(2, dtype=I64)), ValueError, "ids"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64),
                        torch.zeros(2, dtype=torch.bool), torch.zeros(3, dtype=I64)), TypeError, "ids"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64),
                        torch.zeros(2, dtype=I64), torch.zeros(2, dtype=I64)), ValueError, "ids_index"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64),
                        out=torch.zeros(3)), TypeError, "out"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64, device="meta")),
     ValueError, "index"),
    (lambda: K.pick_ids(torch.zeros(3, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64),
                        backend="cuda"), ValueError, "backend"),
], ids=["default-dtype", "default-dims", "tokens-dims", "index-rows", "ids-alone", "ids-dtype", "ids_index-rows",
        "out-dtype", "index-device", "backend"])
def test_bad_inputs_name_the_argument(call, error, name):
    with pytest.raises(error, match=f"^{name}"):
        call()
