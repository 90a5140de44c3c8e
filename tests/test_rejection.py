"""The rejection sampler: greedy rows accept the longest agreeing prefix; sampled rows follow the target
distribution (chi-square on a small vocabulary, seeded), with a deterministic or a probabilistic drafter."""
import math

import numpy as np
import pytest
import torch

from dsa.engine.rejection import rejection_sample
from dsa.engine.sampling import SamplingParams, SamplingRows, hash32, keep_mask, position_keys, seed_key

V = 8


def _args(b: int, n: int, params: SamplingParams, seeds, position0: int = 100):
    rows = SamplingRows(b, V)
    for i, seed in enumerate(seeds):
        rows.set(i, params, seed)
    pos = position0 + np.arange(n + 1)
    k1, k2 = position_keys(rows.seed_key[:, None], pos[None, :])
    keys = torch.from_numpy(np.stack((k1, k2), axis=-1).astype(np.int64))
    return dict(temperature=torch.tensor(rows.temperature, dtype=torch.float32), top_k=torch.tensor(rows.top_k),
                top_p=torch.tensor(rows.top_p, dtype=torch.float32),
                min_p=torch.tensor(rows.min_p, dtype=torch.float32), greedy=torch.tensor(rows.greedy), keys=keys,
                vocab_hash=hash32(torch.arange(V, dtype=torch.int64)))


@pytest.mark.parametrize("all_greedy", [False, True], ids=["general-path", "greedy-path"])
@pytest.mark.parametrize("mismatch", [0, 1, 2, 3, None], ids=lambda m: f"reject-at-{m}")
def test_greedy_accepts_the_agreeing_prefix(mismatch, all_greedy):
    n = 3
    logits = torch.randn(2, n + 1, V, generator=torch.Generator().manual_seed(1))
    target = logits.argmax(-1)  # [2, 4]
    drafts = target[:, :n].clone()
    if mismatch is not None and mismatch < n:
        drafts[:, mismatch] = (drafts[:, mismatch] + 1) % V
    drafts[1, 2:] = -1  # request 1 has 2 drafts only
    tokens, accepted = rejection_sample(logits, drafts, **_args(2, n, SamplingParams(temperature=0), [0, 1]),
                                        all_greedy=all_greedy)
    for b, k in ((0, n), (1, 2)):
        a = k if mismatch is None or mismatch >= k else mismatch
        assert int(accepted[b]) == a
        assert tokens[b, :a + 1].tolist() == target[b, :a + 1].tolist()
        assert (tokens[b, a + 1:] == -1).all()


def test_the_greedy_path_gives_the_general_paths_tokens_on_ties_and_nan():
    n, b = 3, 64
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (b, n + 1, V), generator=g).float()  # many ties: the first index wins
    logits[7, 1] = float("nan")  # a NaN row: argmax takes the NaN's index in both paths
    drafts = torch.randint(-1, V, (b, n), generator=g)
    args = _args(b, n, SamplingParams(temperature=0), range(b))
    want = rejection_sample(logits, drafts, **args)
    got = rejection_sample(logits, drafts, **args, all_greedy=True)
    for w, x, name in zip(want, got, ("tokens", "accepted")):
        assert torch.equal(w, x), f"{name}: the greedy path {x.tolist()} != the general path's {w.tolist()}"


def _chi2_critical(df: int, z: float = 4.0) -> float:
    """The chi-square quantile at ``z`` normal sigmas (Wilson-Hilferty): about 3e-5 of false failures."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple:
    keep = probs > 0
    assert counts[~keep].sum() == 0, f"tokens of probability 0 were drawn: {counts}"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat, _chi2_critical(int(keep.sum()) - 1)


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-topk5", "t1.3-topp0.8"])
@pytest.mark.parametrize("drafter", ["fixed", "probabilistic"])
def test_sampled_tokens_follow_the_target_distribution(params, drafter):
    """Every request has the same target logits and drafts 2 tokens; its first token must follow p_0 and
    (first token, second token) the product p_0(d_1) p_1 when the first draft is accepted."""
    b, n = 20000, 2
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(1, n + 1, V, generator=gen) * 1.5).expand(b, -1, -1).contiguous()
    args = _args(b, n, params, range(b))
    scaled = logits[0] / args["temperature"][0]
    keep = keep_mask(scaled, args["top_k"][:1].expand(n + 1), args["top_p"][:1].expand(n + 1),
                     args["min_p"][:1].expand(n + 1))
    p = scaled.masked_fill(~keep, -math.inf).softmax(-1).double().numpy()  # [n + 1, V]
    if drafter == "fixed":  # q one-hot on the drafts: d_1 = the target's 2nd most likely token
        d1 = int(np.argsort(-p[0])[1])
        drafts, q = torch.tensor([[d1, 3]]).expand(b, -1).contiguous(), None
    else:  # drafts drawn from a q that differs from p
        q = torch.softmax(torch.randn(1, n, V, generator=gen), -1).expand(b, -1, -1).contiguous()
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(b, n)
    tokens, accepted = rejection_sample(logits, drafts, draft_probs=q, **args)
    first = np.bincount(tokens[:, 0].numpy(), minlength=V)
    stat, crit = _chi2(first, p[0])
    assert stat < crit, f"first token: chi2 {stat:.1f} >= {crit:.1f}; counts {first}, p {np.round(p[0], 3)}"
    if drafter == "fixed":  # joint of (d_1 accepted, second token): p_0(d_1) * p_1
        second = tokens[accepted >= 1, 1].numpy()
        frac = len(second) / b
        assert abs(frac - p[0][d1]) < 5 * math.sqrt(p[0][d1] * (1 - p[0][d1]) / b), (frac, p[0][d1])
        stat, crit = _chi2(np.bincount(second, minlength=V), p[1])
        assert stat < crit, f"second token given d_1: chi2 {stat:.1f} >= {crit:.1f}"


def test_the_draws_are_a_function_of_seed_and_position():
    n = 2
    logits = torch.randn(4, n + 1, V, generator=torch.Generator().manual_seed(3))
    drafts = torch.tensor([[1, 2]] * 4)
    args = _args(4, n, SamplingParams(temperature=1.0), [5, 6, 7, 8])
    a = rejection_sample(logits, drafts, **args)
    order = torch.tensor([2, 0, 3, 1])  # the same requests in another batch order
    shuffled = {k: v[order] if k not in ("vocab_hash",) else v for k, v in args.items()}
    b = rejection_sample(logits[order], drafts[order], **shuffled)
    assert torch.equal(a[0][order], b[0]) and torch.equal(a[1][order], b[1])


def test_drafts_must_fit_the_rows():
    with pytest.raises(ValueError, match="drafts"):
        rejection_sample(torch.zeros(2, 3, V), torch.zeros(2, 3, dtype=torch.int64),
                         **_args(2, 2, SamplingParams(temperature=0), [0, 1]))


def test_seed_key_is_stable():  # the acceptance draws hash the same keys as the sampler's noise
    assert seed_key(5) == seed_key(5 + (1 << 64))


def test_a_sampled_batch_needs_its_sampling_arguments():
    logits, drafts = torch.zeros(2, 3, V), torch.zeros(2, 2, dtype=torch.int64)
    tokens, accepted = rejection_sample(logits, drafts, all_greedy=True)  # the argmax path reads none of them
    assert tokens.shape == (2, 3) and accepted.shape == (2,)
    args = _args(2, 2, SamplingParams(temperature=1.0), [0, 1])
    with pytest.raises(ValueError, match="^keys: required unless all_greedy"):
        rejection_sample(logits, drafts, **{**args, "keys": None})
