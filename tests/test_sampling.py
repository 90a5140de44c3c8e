"""SamplingParams validation and the batched sampler on fixed logits (no model)."""
import math

import pytest
import torch

from dsa.engine.sampling import Sampler, SamplingParams, hash32, keep_mask, noise_keys, sample_tokens

PROBS = [0.15, 0.5, 0.05, 0.2, 0.1]  # token 1 is the most likely, then 3, 0, 4, 2


def _logits(probs=PROBS, rows=1):
    return torch.tensor(probs, dtype=torch.float32).log().expand(rows, -1).contiguous()


@pytest.mark.parametrize("field,value,error", [
    ("max_tokens", 0, ValueError), ("max_tokens", 1.5, TypeError), ("max_tokens", True, TypeError),
    ("temperature", -0.1, ValueError), ("temperature", float("nan"), ValueError), ("temperature", "hot", TypeError),
    ("top_p", 0.0, ValueError), ("top_p", 1.1, ValueError), ("top_k", -2, ValueError), ("top_k", 2.0, TypeError),
    ("min_p", -0.1, ValueError), ("min_p", 1.5, ValueError), ("seed", 1.0, TypeError), ("stop", "", ValueError),
    ("stop", [1], ValueError), ("stop", [""], ValueError), ("stop_token_ids", [-1], ValueError),
    ("stop_token_ids", [1.0], TypeError), ("stop_token_ids", "3", ValueError), ("ignore_eos", 1, TypeError),
    ("logprobs", -1, ValueError), ("logprobs", 21, ValueError), ("logprobs", 2.0, TypeError),
], ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_invalid_values_name_the_field(field, value, error):
    """The shared checks (dsa.kernels.common.check_int / check_real): TypeError for a value of the
    wrong type, ValueError for one out of range; the message starts with the field."""
    with pytest.raises(error, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_values_are_stored_as_plain_numbers():
    import numpy as np

    sp = SamplingParams(max_tokens=np.int64(3), temperature=1, top_k=np.int32(-1), stop_token_ids=[np.int64(4)],
                        logprobs=np.int64(2), seed=np.uint8(7))
    assert [type(v) for v in (sp.max_tokens, sp.temperature, sp.top_k, sp.stop_token_ids[0], sp.logprobs, sp.seed)] \
        == [int, float, int, int, int, int] and sp.top_k == 0 and sp.stop_token_ids == (4,)


def test_normalized_values():
    p = SamplingParams(stop="###", stop_token_ids=[5, 7], top_k=-1, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 7) and p.top_k == 0 and p.greedy
    assert SamplingParams(stop=None).stop == () and not SamplingParams().greedy


def _lowbias32(x: int) -> int:
    """The hash in plain Python integers, for comparison with the tensor version."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_matches_plain_integers():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + torch.randint(0, 1 << 32, (200,),
                                                                        generator=torch.Generator().manual_seed(0)).tolist()
    got = hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(x) for x in xs] == [hash32(x) for x in xs]
    assert len(set(got)) == len(set(xs))  # a bijection


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,kept", [
    (1.0, 0, 1.0, 0.0, {0, 1, 2, 3, 4}),
    (1.0, 2, 1.0, 0.0, {1, 3}),
    (1.0, 0, 0.45, 0.0, {1}),
    (1.0, 0, 0.6, 0.0, {1, 3}),
    (2.0, 0, 0.6, 0.0, {1, 3, 0}),  # temperature flattens before top_p
    (1.0, 0, 0.75, 0.0, {1, 3, 0}),
    (1.0, 2, 0.75, 0.0, {1, 3}),  # top_p over what top_k kept, renormalized: 0.71 + 0.29
    (1.0, 3, 0.7, 0.0, {1, 3}),  # renormalized over 3: 0.59, 0.24 -> 0.82 >= 0.7
    (1.0, 0, 1.0, 0.35, {1, 3}),  # p >= 0.175
    (1.0, 0, 1.0, 0.25, {1, 3, 0}),  # p >= 0.125
    (1.0, 0, 0.45, 0.25, {1}),
    (1.0, 1, 1.0, 0.0, {1}),
], ids=lambda x: str(x))
def test_keep_mask_on_fixed_logits(temperature, top_k, top_p, min_p, kept):
    scaled = _logits() / temperature
    mask = keep_mask(scaled, torch.tensor([top_k or 5]), torch.tensor([top_p]), torch.tensor([min_p]))
    assert set(mask[0].nonzero()[:, 0].tolist()) == kept


def test_top_k_ties_keep_the_lowest_ids():
    scaled = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5]])
    mask = keep_mask(scaled, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert mask[0].tolist() == [False, True, True, False, False]


def _sample_many(params: SamplingParams, n: int, seed: int = 7):
    sampler = Sampler(len(PROBS), "cpu")
    tokens, _ = sampler(_logits(rows=n), [params] * n, [seed] * n, list(range(n)))
    return torch.bincount(torch.tensor(tokens), minlength=len(PROBS)).double() / n


@pytest.mark.parametrize("params,target", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.5), [p * p for p in PROBS]),
    (SamplingParams(top_p=0.75), [0.15, 0.5, 0, 0.2, 0]),
    (SamplingParams(top_k=2, min_p=0.0), [0, 0.5, 0, 0.2, 0]),
], ids=["t1", "t0.5", "top_p", "top_k"])
def test_frequencies_follow_the_distribution(params, target):
    """Gumbel-max over counter-based noise samples the (filtered, renormalized) softmax: 6000
    positions of one seed, each frequency within 5 standard deviations."""
    n = 6000
    target = torch.tensor(target, dtype=torch.float64)
    target /= target.sum()
    freq = _sample_many(params, n)
    sigma = (target * (1 - target) / n).sqrt()
    bad = (freq - target).abs() > 5 * sigma + 1e-12
    assert not bad.any(), f"frequencies {freq.tolist()} vs {target.tolist()}"


def test_greedy_and_top_k_1_are_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    sampler = Sampler(50, "cpu")
    greedy, _ = sampler(logits, [SamplingParams(temperature=0)] * 6, [1] * 6, list(range(6)))
    top1, _ = sampler(logits, [SamplingParams(temperature=1.3, top_k=1)] * 6, list(range(6)), list(range(6)))
    assert greedy == top1 == logits.argmax(-1).tolist()


def test_a_row_samples_the_same_alone_and_in_any_batch():
    """The noise is a function of (seed, position, token id): a row's token does not depend on the
    other rows, their parameters, or its place in the batch."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0),
              SamplingParams(temperature=1.5, top_k=20, logprobs=3), SamplingParams(min_p=0.1),
              SamplingParams(temperature=0.7)]
    seeds, positions = [11, 12, 13, 14, 11], [40, 41, 42, 43, 40]
    sampler = Sampler(300, "cpu")
    together, _ = sampler(logits, params, seeds, positions)
    alone = [sampler(logits[i:i + 1], [params[i]], [seeds[i]], [positions[i]])[0][0] for i in range(5)]
    order = [3, 0, 4, 2, 1]
    shuffled, _ = sampler(logits[order], [params[i] for i in order], [seeds[i] for i in order],
                          [positions[i] for i in order])
    assert together == alone == [shuffled[order.index(i)] for i in range(5)]
    other_seed, _ = sampler(logits[:1].expand(64, -1), [params[0]] * 64, list(range(64)), [40] * 64)
    assert len(set(other_seed)) > 4  # different seeds give different tokens


def test_noise_keys_separate_seeds_and_positions():
    keys = {noise_keys(s, p) for s in range(50) for p in range(50)}
    assert len(keys) == 2500
    assert noise_keys(-1, 3) == noise_keys((1 << 64) - 1, 3)  # seeds are taken mod 2**64


def test_logprobs_are_the_models():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=g)
    params = [SamplingParams(temperature=0, logprobs=4), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    tokens, lps = Sampler(40, "cpu")(logits, params, [0, 1, 2], [5, 6, 7])
    ref = torch.log_softmax(logits.double(), -1)
    assert lps[1] is None and lps[2].top == [] and lps[2].token_id == tokens[2]
    assert math.isclose(lps[0].logprob, ref[0, tokens[0]].item(), abs_tol=1e-5)
    top = ref[0].topk(4)
    assert [i for i, _ in lps[0].top] == top.indices.tolist()
    assert all(math.isclose(x, y, abs_tol=1e-5) for (_, x), y in zip(lps[0].top, top.values.tolist()))


def test_sample_tokens_shapes():
    logits = torch.randn(3, 10)
    keys = torch.tensor([list(noise_keys(0, i)) for i in range(3)])
    out = sample_tokens(logits, torch.ones(3), torch.full((3,), 10), torch.ones(3), torch.zeros(3), keys,
                        hash32(torch.arange(10)), torch.tensor([True, False, False]), sort=False)
    assert out.shape == (3,) and out.dtype == torch.int64 and out[0] == logits[0].argmax()
