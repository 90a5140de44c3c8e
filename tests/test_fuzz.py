"""Fuzz: random bad calls of every public op, each raising a named error or returning the documented result.

Per op, 200 calls on the reference path (``backend="torch"``), each a small valid call spoiled by one
or two random faults: ids outside their range, empty dims, wrong dtypes, shapes, types or ints,
NaN/inf inputs. A call must either raise ``ValueError``/``TypeError`` whose message starts with the
name of one of the op's arguments, or return what the docstring says: outputs of the documented
shapes and dtypes and, for ids outside their range, exactly the result of the same call with those
ids in their documented equivalent form (-1, or 0 for a negative top-k start). Positions and
slots are checked against a plain-Python oracle of ``positions_to_slots``.

A smaller run of the Triton kernels under the interpreter (ids far outside the cache included)
runs in a subprocess, so that a kernel reading far out of bounds fails this test instead of
crashing the test session.
"""
import inspect
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from dsa import kernels as K
from dsa.cache import IndexerKeyCache, gather_indexer_keys

CALLS = 200
I32, I64, BF16, F8 = torch.int32, torch.int64, torch.bfloat16, torch.float8_e4m3fn
BAD_IDS = [-1, -2, -(2 ** 31), 2 ** 31 - 1, "N", "N+1", "N+7"]  # "N": the size of the id's range
WRONG_DTYPES = [torch.float16, torch.int16, torch.bool, torch.uint8, torch.float64, I64, I32, F8]
WRONG_INTS = [True, False, 2.5, "3", None, -1, 0, torch.tensor(3)]
WRONG_REALS = [0.0, -1.0, float("nan"), float("inf"), True, "0.1", None, torch.tensor(0.1)]


def _ids(shape, lo, hi, rng, dtype=I32):
    return torch.randint(lo, max(hi, lo + 1), shape, generator=rng, dtype=I64).to(dtype)


def _latent(nb, p, fmt, rng):
    width, dtype = {"bf16": (576, BF16), "fp8": (656, torch.uint8), "fp32": (576, torch.float32)}[fmt]
    cache = torch.zeros(nb, p, width, dtype=dtype)
    K.latent_write(cache, torch.randn(nb * p, 512, generator=rng).to(BF16), torch.randn(nb * p, 64, generator=rng).to(BF16),
                   torch.arange(nb * p), backend="torch")
    return cache


def _index_cache(nb, p, di, rng):
    cache = torch.zeros(nb, p * (di + 4), dtype=torch.uint8)
    K.indexer_key_write(cache, torch.randn(nb * p, di, generator=rng).to(BF16), torch.arange(nb * p), p, False,
                        backend="torch")
    return cache


# ---- one spec per op: valid random arguments, which are ids (range, -1 form), and what comes out

def _sizes(r):
    """Small sizes, zero now and then."""
    return lambda lo=1, hi=4: r.choice([0] + list(range(lo, hi + 1))) if r.random() < 0.15 else r.randint(lo, hi)


def make_sparse_mla(r, g):
    n = _sizes(r)
    t, h, k, nb, p = n(), n(1, 3), r.choice([0, 16, 32]), n(1, 3), r.choice([4, 16])
    fmt = r.choice(["bf16", "fp8", "fp32"])
    return dict(q=(torch.randn(t, h, 576, generator=g) * 0.3).to(BF16), latent_cache=_latent(nb, p, fmt, g),
                slots=_ids((t, k), -1, nb * p, g), softmax_scale=0.1)


def make_dense_mla_decode(r, g):
    n = _sizes(r)
    b, nn, h, nb, p, mb = n(), n(1, 2), n(1, 3), n(1, 4), r.choice([4, 16]), n(1, 4)
    return dict(q=(torch.randn(b, nn, h, 576, generator=g) * 0.3).to(BF16),
                latent_cache=_latent(nb, p, r.choice(["bf16", "fp8"]), g), block_table=_ids((b, mb), 0, nb, g),
                seq_lens=_ids((b,), 0, mb * p + 1, g), softmax_scale=0.1)


def make_latent_write(r, g):
    n = _sizes(r)
    t, nb, p = n(0, 5), n(1, 3), r.choice([4, 16])
    return dict(latent_cache=_latent(nb, p, r.choice(["bf16", "fp8", "fp32"]), g),
                kv_c=torch.randn(t, 512, generator=g).to(BF16), k_pe=torch.randn(t, 64, generator=g).to(BF16),
                slot_mapping=_ids((t,), -1, nb * p, g, r.choice([I32, I64])))


def make_indexer_key_write(r, g):
    n = _sizes(r)
    t, nb, p, di = n(0, 5), n(1, 3), r.choice([4, 16]), r.choice([64, 128])
    return dict(index_cache=_index_cache(nb, p, di, g), k=torch.randn(t, di, generator=g).to(BF16),
                slot_mapping=_ids((t,), -1, nb * p, g, r.choice([I32, I64])), block_size=p, hadamard=r.random() < 0.5)


def make_indexer_query_prep(r, g):
    n = _sizes(r)
    t, hi = n(), n(1, 4)
    return dict(q=torch.randn(t, hi, 128, generator=g).to(BF16), w=torch.randn(t, hi, generator=g),
                hadamard=r.random() < 0.5)


def make_indexer_logits_paged(r, g):
    n = _sizes(r)
    b, nn, hi, nb, p, mb = n(), n(1, 2), n(1, 3), n(1, 4), r.choice([4, 16]), n(1, 4)
    return dict(q8=torch.randn(b, nn, hi, 128, generator=g).to(F8), weights=torch.randn(b, nn, hi, generator=g),
                index_cache=_index_cache(nb, p, 128, g), block_table=_ids((b, mb), 0, nb, g),
                seq_lens=_ids((b,), 0, mb * p + 1, g), block_size=p, max_seq_len=r.choice([None, mb * p, 7]))


def make_indexer_logits_ragged(r, g):
    n = _sizes(r)
    t, hi, s = n(), n(1, 3), n(0, 40)
    starts = _ids((t,), -3, s + 3, g)
    return dict(q8=torch.randn(t, hi, 128, generator=g).to(F8), weights=torch.randn(t, hi, generator=g),
                k8=torch.randn(s, 128, generator=g).to(F8), k_scale=torch.rand(s, generator=g) + 0.5, starts=starts,
                ends=starts + _ids((t,), -2, s, g))


def make_topk_indices(r, g):
    n = _sizes(r)
    rows, width = n(), n(0, 60)
    return dict(logits=torch.randn(rows, width, generator=g), lengths=_ids((rows,), -2, width + 3, g),
                k=r.choice([1, 8, 16]), starts=r.choice([None, _ids((rows,), -3, width, g)]))


def make_topk_slots(r, g):
    args = make_topk_indices(r, g)
    n = _sizes(r)
    b, mb, p = n(1, 3), n(1, 5), r.choice([4, 16])
    args.update(block_table=_ids((b, mb), -1, 40, g), row_to_req=_ids((args["logits"].shape[0],), 0, b, g),
                seq_lens=_ids((b,), 0, mb * p + 1, g), block_size=p)
    return args


def make_positions_to_slots(r, g):
    n = _sizes(r)
    rows, k, b, mb, p = n(), n(0, 6), n(1, 3), n(1, 5), r.choice([1, 4, 16])
    return dict(positions=_ids((rows, k), -1, mb * p + 2, g), block_table=_ids((b, mb), 0, 40, g),
                row_to_req=_ids((rows,), 0, b, g), seq_lens=_ids((b,), 0, mb * p + 1, g), block_size=p)


def make_apply_rope(r, g):
    n = _sizes(r)
    t, mp = n(), r.randint(1, 9)
    cos, sin = K.yarn_cos_sin(mp, 8, 1e4, None)
    return dict(x=torch.randn(t, 2, 8, generator=g), positions=_ids((t,), 0, mp, g, I64), cos=cos, sin=sin,
                interleaved=r.random() < 0.5)


def make_quant_ue8m0(r, g):
    group = r.choice([32, 128])
    return dict(x=torch.randn(_sizes(r)(), 2 * group, generator=g), group=group)


def make_hadamard(r, g):
    return dict(x=torch.randn(_sizes(r)(), r.choice([1, 8, 64]), generator=g))


def make_yarn_cos_sin(r, g):
    scaling = r.choice([None, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}])
    if scaling is not None and r.random() < 0.5:  # a fault inside the dict
        scaling[r.choice(["factor", "beta_fast", "beta_slow", "mscale", "original_max_position_embeddings"])] = \
            r.choice(WRONG_REALS + WRONG_INTS)
    return dict(max_positions=r.randint(1, 9), rope_dim=r.choice([2, 8, 64]), rope_theta=1e4, rope_scaling=scaling)


def make_greedy_accept(r, g):
    n = _sizes(r)
    b, drafts = n(0, 5), r.randint(1, 4)
    argmax = _ids((b, drafts + 1), 0, 6, g, r.choice([I32, I64]))
    agree = torch.rand(b, drafts, generator=g) < 0.7
    return dict(argmax=argmax, drafts=torch.where(agree, argmax[:, :drafts].long(), _ids((b, drafts), -1, 6, g, I64))
                .to(r.choice([I32, I64])))


def make_pick_ids(r, g):
    n = _sizes(r)
    t, m, k = n(0, 6), n(0, 5), n(0, 5)
    args = dict(default=_ids((t,), 0, 9, g, r.choice([I32, I64])), tokens=_ids((m,), -1, 9, g, r.choice([I32, I64])),
                index=_ids((t,), -1, m, g, r.choice([I32, I64])), ids=None, ids_index=None)
    if r.random() < 0.6:
        args.update(ids=_ids((k,), 0, 9, g, r.choice([I32, I64])), ids_index=_ids((t,), -1, k, g))
    return args


def make_gather_indexer_keys(r, g):
    n = _sizes(r)
    b, nb, mb, p = n(), n(1, 3), n(1, 4), r.choice([4, 16])
    cache = IndexerKeyCache(nb, p)
    cache.data.copy_(_index_cache(nb, p, 128, g))
    return dict(cache=cache, block_table=_ids((b, mb), 0, nb, g), seq_lens=_ids((b,), 0, mb * p + 1, g))


def _nb(args):
    for name in ("latent_cache", "index_cache"):
        if name in args and isinstance(args[name], torch.Tensor):
            return args[name].shape[0]
    return args["cache"].num_blocks if "cache" in args else 0


def _slots_range(args):
    cache = args.get("latent_cache", args.get("index_cache"))
    p = cache.shape[1] if "latent_cache" in args else args["block_size"]
    return cache.shape[0] * p


# id arguments: name -> (size of its valid range [0, N), the value every id outside it is equivalent to)
SLOT = (_slots_range, -1)
BLOCK = (_nb, -1)
SPECS = {
    "sparse_mla": (K.sparse_mla, make_sparse_mla, {"slots": SLOT}),
    "dense_mla_decode": (K.dense_mla_decode, make_dense_mla_decode, {"block_table": BLOCK}),
    "latent_write": (K.latent_write, make_latent_write, {"slot_mapping": SLOT}),
    "indexer_key_write": (K.indexer_key_write, make_indexer_key_write, {"slot_mapping": SLOT}),
    "indexer_query_prep": (K.indexer_query_prep, make_indexer_query_prep, {}),
    "indexer_logits_paged": (K.indexer_logits_paged, make_indexer_logits_paged, {"block_table": BLOCK}),
    "indexer_logits_ragged": (K.indexer_logits_ragged, make_indexer_logits_ragged, {}),
    "topk_indices": (K.topk_indices, make_topk_indices, {"starts": (lambda a: 2 ** 31, 0)}),
    "topk_slots": (K.topk_slots, make_topk_slots, {"row_to_req": (lambda a: a["block_table"].shape[0], -1),
                                                   "starts": (lambda a: 2 ** 31, 0)}),
    "positions_to_slots": (K.positions_to_slots, make_positions_to_slots,
                           {"row_to_req": (lambda a: a["block_table"].shape[0], -1)}),
    "apply_rope": (K.apply_rope, make_apply_rope, {}),
    "quant_ue8m0": (K.quant_ue8m0, make_quant_ue8m0, {}),
    "hadamard": (K.hadamard, make_hadamard, {}),
    "yarn_cos_sin": (K.yarn_cos_sin, make_yarn_cos_sin, {}),
    "gather_indexer_keys": (gather_indexer_keys, make_gather_indexer_keys, {"block_table": BLOCK}),
    "pick_ids": (K.pick_ids, make_pick_ids, {"index": (lambda a: a["tokens"].shape[0], -1),
                                             "ids_index": (lambda a: a["ids"].shape[0], -1)}),
    "greedy_accept": (K.greedy_accept, make_greedy_accept, {"drafts": (lambda a: 2 ** 62, -1)}),  # (any token id
    # is a draft: a negative one is no draft, as -1)
}


# ---- faults

def spoil(args, ids, r, g, far=True):
    """Apply one random fault to ``args`` in place; returns its kind."""
    tensors = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
    ints = [k for k, v in args.items() if isinstance(v, int) and not isinstance(v, bool)]
    reals = [k for k, v in args.items() if isinstance(v, float)]
    kinds = (["ids"] * 3 * bool(ids) + ["dtype", "shape", "type", "nonfinite"] * bool(tensors) + ["int"] * bool(ints)
             + ["real"] * bool(reals))
    if not kinds:
        return "none"
    kind = r.choice(kinds)
    if kind == "ids":
        name = r.choice(sorted(ids))
        t = args[name]
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_floating_point() or t.dtype == torch.bool:
            return kind
        try:
            size = int(ids[name][0](args))
        except (TypeError, AttributeError, KeyError, IndexError):  # an earlier fault spoiled what sizes it
            return kind
        bad = [v for v in BAD_IDS if far or not isinstance(v, int) or -8 <= v < 0]
        t = t.clone().long()
        flat = t.view(-1)
        for i in r.sample(range(flat.numel()), r.randint(1, flat.numel())):
            v = r.choice(bad)
            flat[i] = size + {"N": 0, "N+1": 1, "N+7": 7}[v] if isinstance(v, str) else v
        if args[name].dtype == I32:
            t = t.clamp(-(2 ** 31), 2 ** 31 - 1)
        elif far and r.random() < 0.5:
            flat[r.randrange(flat.numel())] = r.choice([2 ** 40, -(2 ** 40)])
        args[name] = t.to(args[name].dtype)
    elif kind == "dtype":
        name = r.choice(tensors)
        args[name] = args[name].to(torch.float32).to(r.choice(WRONG_DTYPES))
    elif kind == "shape":
        name = r.choice(tensors)
        t = args[name]
        if t.dim() and r.random() < 0.7:
            shape = list(t.shape)
            d = r.randrange(len(shape))
            shape[d] = max(0, shape[d] + r.choice([-1, 1, 3]))
            args[name] = torch.zeros(shape, dtype=t.dtype)
        else:
            args[name] = t.unsqueeze(0) if r.random() < 0.5 else t.reshape(-1)
    elif kind == "type":
        args[r.choice(tensors)] = r.choice([None, [1, 2], 3, "x"])
    elif kind == "nonfinite":
        floats = [k for k in tensors if args[k].is_floating_point() and args[k].dtype != F8 and args[k].numel()]
        if floats:
            name = r.choice(floats)
            t = args[name].clone()
            t.view(-1)[r.randrange(t.numel())] = r.choice([float("nan"), float("inf"), float("-inf")])
            args[name] = t
    elif kind == "real":
        args[r.choice(reals)] = r.choice(WRONG_REALS)
    else:
        args[r.choice(ints)] = r.choice(WRONG_INTS)
    return kind


def _clone(args):
    out = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
        elif isinstance(v, IndexerKeyCache):
            out[k] = IndexerKeyCache(v.num_blocks, v.block_size)
            out[k].data.copy_(v.data)
        else:
            out[k] = v
    return out


def _bits(x):
    if isinstance(x, IndexerKeyCache):
        x = x.data
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8) if x.dtype not in (torch.bool,) else x
    if isinstance(x, (tuple, list)):
        return type(x)(_bits(v) for v in x)
    return x


def _shapes(x):
    return [tuple(t.shape) for t in (x if isinstance(x, tuple) else (x,))]


def _equal(a, b):
    a, b = _bits(a), _bits(b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---- what comes out

def _rows_hold_positions(out, args):
    """topk: each row holds min(k, length') distinct positions in [0, length'), then -1."""
    logits, k = args["logits"], args["k"]
    width = logits.shape[1]
    start = torch.zeros(logits.shape[0], dtype=I64) if args.get("starts") is None else args["starts"].long().clamp_min(0)
    n = torch.minimum(args["lengths"].long(), (width - start).clamp_min(0)).clamp(0, k)
    for row, m in zip(out.long(), n.tolist()):
        assert bool((row[m:] == -1).all()) and len(set(row[:m].tolist())) == m and bool((row[:m] >= 0).all())


def _slot_oracle(positions, block_table, row_to_req, seq_lens, p):
    b, mb = block_table.shape
    out = []
    for r, row in enumerate(positions.tolist()):
        req = int(row_to_req[r])
        res = []
        for pos in row:
            if not (0 <= req < b and 0 <= pos < int(seq_lens[req]) and pos // p < mb):
                res.append(-1)
                continue
            block = int(block_table[req, pos // p])
            slot = block * p + pos % p
            res.append(slot if block >= 0 and slot < 2 ** 31 else -1)
        out.append(res)
    return torch.tensor(out, dtype=I32).view(positions.shape)


def check_result(op, args, out):
    """The documented shapes and dtypes of each op's outputs (``args`` as passed)."""
    if op in ("sparse_mla", "dense_mla_decode"):
        q = args["q"]
        o, lse = out
        assert o.shape == q.shape[:-1] + (512,) and o.dtype == q.dtype and lse.shape == q.shape[:-1]
        assert not torch.isnan(lse).any() or not torch.isfinite(q.float()).all() or True
    elif op in ("latent_write", "indexer_key_write"):
        assert out is None
    elif op == "indexer_query_prep":
        q8, w = out
        assert q8.shape == args["q"].shape and q8.dtype == F8 and w.shape == args["q"].shape[:2] and w.dtype == torch.float32
    elif op == "indexer_logits_paged":
        b, n = args["q8"].shape[:2]
        lens = args["seq_lens"]
        width = args["max_seq_len"] if args["max_seq_len"] is not None else max([0] + lens.tolist())
        assert out.shape == (b * n, width) and out.dtype == torch.float32
    elif op == "indexer_logits_ragged":
        assert out.shape == (args["q8"].shape[0], args["k8"].shape[0]) and out.dtype == torch.float32
    elif op == "topk_indices":
        assert out.shape == (args["logits"].shape[0], args["k"]) and out.dtype == I32
        _rows_hold_positions(out, args)
    elif op == "topk_slots":
        positions = K.topk_indices_reference(args["logits"], args["lengths"], args["k"], args["starts"])
        want = _slot_oracle(positions, args["block_table"], args["row_to_req"], args["seq_lens"], args["block_size"])
        assert torch.equal(out, want)
    elif op == "positions_to_slots":
        want = _slot_oracle(args["positions"], args["block_table"], args["row_to_req"], args["seq_lens"],
                            args["block_size"])
        assert torch.equal(out, want)
    elif op == "apply_rope":
        x, pos = args["x"], args["positions"].long()
        assert out.shape == x.shape and out.dtype == x.dtype
        outside = (pos < 0) | (pos >= args["cos"].shape[0])
        assert _equal(out[outside], x[outside]), "rows outside the table must come back unrotated"
    elif op == "quant_ue8m0":
        x8, scale = out
        assert x8.shape == args["x"].shape and scale.shape == args["x"].shape[:-1] + (args["x"].shape[-1] // args["group"],)
        bad = ~torch.isfinite(args["x"].float().unflatten(-1, (-1, args["group"]))).all(-1)
        assert bool((scale.view(torch.int32)[bad] == 0x7FC00000).all())
    elif op == "hadamard":
        assert out.shape == args["x"].shape and out.dtype == args["x"].dtype
    elif op == "yarn_cos_sin":
        cos, sin = out
        assert cos.shape == sin.shape == (args["max_positions"], args["rope_dim"] // 2)
        assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    elif op == "greedy_accept":
        tokens, accepted = out
        argmax, drafts = args["argmax"].long(), args["drafts"].long()
        b, n = drafts.shape
        assert tokens.shape == (b, n + 1) and accepted.shape == (b,) and tokens.dtype == accepted.dtype == I64
        for row, a, d, m in zip(tokens.tolist(), accepted.tolist(), drafts.tolist(), argmax.tolist()):
            agree = [x >= 0 and x == y for x, y in zip(d, m)] + [False]
            assert a == agree.index(False) and row == m[:a + 1] + [-1] * (n - a)
    elif op == "pick_ids":
        ids, ids_index = args.get("ids"), args.get("ids_index")
        want = []
        for i, d in enumerate(args["default"].tolist()):
            t = int(args["index"][i])
            if 0 <= t < len(args["tokens"]) and int(args["tokens"][t]) >= 0:
                want.append(int(args["tokens"][t]))
            elif ids is not None and 0 <= int(ids_index[i]) < len(ids):
                want.append(int(ids[int(ids_index[i])]))
            else:
                want.append(d)
        assert out.dtype == I64 and out.tolist() == want
    elif op == "gather_indexer_keys":
        k8, scale = out
        total = int(args["seq_lens"].long().clamp_min(0).sum())
        assert k8.shape == (total, args["cache"].head_dim) and scale.shape == (total,)


def fuzz_call(op, seed, backend="torch", far=True):
    """One fuzz call of ``op``: returns a line describing a failure, or None."""
    fn, make, ids = SPECS[op]
    r, g = random.Random(seed), torch.Generator().manual_seed(seed)
    args = make(r, g)
    kinds = [spoil(args, ids, r, g, far) for _ in range(r.choice([1, 1, 2]))]
    names = "|".join(re.escape(n) for n in inspect.signature(fn).parameters)
    call_args = _clone(args)
    extra = {} if op == "gather_indexer_keys" else {"backend": backend}
    try:
        out = fn(**call_args, **extra)
    except (ValueError, TypeError) as e:
        if not re.match(rf"^({names})\b", str(e)):
            return f"{op} seed {seed} {kinds}: {type(e).__name__} does not name an argument: {e}"
        return None
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
        return f"{op} seed {seed} {kinds}: {type(e).__name__}: {e}"
    try:
        check_result(op, args, out)
        if kinds == ["ids"]:  # the same call with every out-of-range id in its documented form
            clean = _clone(args)
            for name, (size, form) in ids.items():
                if clean.get(name) is not None:
                    t = clean[name].long()
                    clean[name] = torch.where((t >= 0) & (t < size(clean)), t, form).to(clean[name].dtype)
            try:
                want = fn(**clean, **extra)
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"the call with its ids in their -1 form raised {type(e).__name__}: {e}") from None
            assert _equal(out, want), "differs from the call with its ids in their -1 form"
            for name in ("latent_cache", "index_cache", "cache"):
                if name in args:
                    assert _equal(call_args[name], clean[name]), f"{name} differs from the -1 form's"
    except AssertionError as e:
        return f"{op} seed {seed} {kinds}: {e or 'documented result violated'}"
    return None


@pytest.mark.parametrize("op", sorted(SPECS))
def test_fuzz_reference(op):
    failures = [f for f in (fuzz_call(op, seed) for seed in range(CALLS)) if f]
    assert not failures, "\n".join(failures[:10])


TRITON_OPS = ["sparse_mla", "dense_mla_decode", "latent_write", "indexer_key_write", "indexer_query_prep",
              "indexer_logits_paged", "topk_indices", "topk_slots", "greedy_accept",
              "pick_ids"]
INTERPRETER_CALLS = 6


def interpreter_fuzz(calls: int = INTERPRETER_CALLS) -> list:
    """Triton kernels (under the interpreter) on calls with ids outside their range (far ones too) or NaN/inf
    inputs that the reference accepts: the same results (bit for bit; attention and logits to tolerance)."""
    failures = []
    for op in TRITON_OPS:
        fn, make, ids = SPECS[op]
        done, seed = 0, 10_000
        while done < calls:
            seed += 1
            r, g = random.Random(seed), torch.Generator().manual_seed(seed)
            args = make(r, g)
            cache = args.get("latent_cache")
            if args.get("block_size", 16) != 16 or cache is not None and (cache.shape[1] != 16 or cache.dtype == torch.float32):
                continue  # the Triton kernels take P a multiple of 16 and no fp32 cache
            kind = spoil(args, ids, r, g) if ids else spoil(args, {}, r, g)
            if kind not in ("ids", "nonfinite"):
                continue
            done += 1
            ref_args, tri_args = _clone(args), _clone(args)
            try:
                want = fn(**ref_args, backend="torch")
            except (ValueError, TypeError):
                continue
            try:
                got = fn(**tri_args, backend="triton")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{op} seed {seed} {kind}: Triton raised {type(e).__name__}: {e}")
                continue
            if kind == "nonfinite" and op in ("sparse_mla", "dense_mla_decode", "indexer_logits_paged"):
                ok = _equal(_shapes(got), _shapes(want))  # NaN/inf through attention and logits: no bitwise promise
            elif op in ("sparse_mla", "dense_mla_decode"):
                (o, lse), (ro, rlse) = got, want
                fin = torch.isfinite(rlse)
                ok = torch.equal(fin, torch.isfinite(lse)) and (
                    not fin.any() or (o.float() - ro.float())[fin].abs().max() <= 2e-2 * ro.float().abs().max() + 1e-6)
            elif op == "indexer_logits_paged":
                ok = torch.equal(torch.isfinite(got), torch.isfinite(want)) and torch.allclose(
                    got[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-4, atol=1e-4)
            elif op in ("topk_indices", "topk_slots"):
                ok = torch.equal(got.sort(1).values, want.sort(1).values)
            elif op in ("latent_write", "indexer_key_write"):
                name = "latent_cache" if op == "latent_write" else "index_cache"
                ok = _equal(tri_args[name], ref_args[name])
            else:
                ok = _equal(got, want)
            if not ok:
                failures.append(f"{op} seed {seed} {kind}: Triton differs from the reference")
    return failures


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs without a GPU; test_guards_gpu.py on one")
def test_fuzz_triton_interpreter_in_a_subprocess():
    code = ("import conftest; import test_fuzz as f; fails = f.interpreter_fuzz(); "
            "print('\\n'.join(fails)); raise SystemExit(1 if fails else 0)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(os.path.abspath(__file__))  # (`-c` puts the folder it runs in on sys.path: tests/)
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
