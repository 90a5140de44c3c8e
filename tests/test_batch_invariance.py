"""A request's greedy tokens do not depend on its batch (the top-k tie rule makes selection row-local).

Float32 tiny models (V3.2 and GLM-MoE-DSA shapes, ``index_n_heads=4``, ``index_topk=16``) with the
exact and the FP8 indexer. Seeds are fixed here once; a mismatch against the full-sequence forward
prints the top-2 logit margin and the indexer's k-th-value gap, so a reader can tell a floating-point
near-tie (batched vs single-row matmuls differ by ~1e-5 on CPU) from a bug.
"""
import pytest
import torch

import dsa.indexer.lightning as lightning
from dsa import DSAConfig, DSAModel, Engine
from model_utils import prompt

LENGTHS = (37, 9, 20, 52, 16, 30)  # around index_topk=16: dense, sparse, and prompts crossing it
NEW = 6


def _config(kind: str, precision: str) -> DSAConfig:
    common = dict(index_topk=16, index_n_heads=4, indexer_precision=precision)
    if kind == "v32":
        return DSAConfig.tiny(index_topk_pattern="FSFS", **common)
    return DSAConfig.tiny(model_type="glm_moe_dsa", indexer_rope_interleave=True, index_topk_freq=2,
                          index_skip_topk_offset=1, rope_scaling=None, rope_theta=1e6, **common)


@pytest.fixture(scope="module", params=[(k, p) for k in ("v32", "glm") for p in ("exact", "fp8")],
                ids=lambda kp: f"{kp[0]}-{kp[1]}")
def model(request):
    return DSAModel.random(_config(*request.param), seed=0, dtype=torch.float32, device="cpu")


def _prompts():
    return [prompt(n, 100 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy tokens, generated alone (both tests compare against them)."""
    return [Engine(model, num_blocks=64).generate([p], NEW)[0] for p in _prompts()]


def test_tokens_do_not_depend_on_the_batch(model, alone):
    prompts = _prompts()
    variants = {  # "batched" runs at the default max_batch_tokens (8192: every prompt in one step)
        "batched": lambda: Engine(model, num_blocks=64).generate(prompts, NEW),
        "reversed": lambda: Engine(model, num_blocks=64).generate(prompts[::-1], NEW)[::-1],
        "max_batch_tokens=7": lambda: Engine(model, num_blocks=64, max_batch_tokens=7).generate(prompts, NEW),
        "small pool": lambda: Engine(model, num_blocks=5).generate(prompts, NEW),  # 80 tokens: requests wait
    }
    for name, run in variants.items():
        got = run()
        bad = [i for i, (a, b) in enumerate(zip(alone, got)) if a != b]
        assert not bad, f"{name}: requests {bad} produced other tokens than alone"


def _kth_gaps(model, ids, k):
    """Per indexer call of a full forward, the smallest gap between the k-th and (k+1)-th logit of
    any row longer than k (0 means an exact tie, settled by the tie rule)."""
    gaps, real = [], lightning.topk_slots

    def spy(logits, lengths, kk, *args, **kw):
        for row, n in zip(logits, lengths.tolist()):
            if n > kk:
                top = row[:n].topk(kk + 1).values
                gaps.append(float(top[kk - 1] - top[kk]))
        return real(logits, lengths, kk, *args, **kw)

    lightning.topk_slots = spy
    try:
        model(ids)
    finally:
        lightning.topk_slots = real
    return gaps


def test_greedy_decode_matches_the_full_forward(model, alone):
    for p, out in zip(_prompts(), alone):
        ids = torch.tensor([p + out])
        logits = model(ids)[0, len(p) - 1:-1]  # [NEW, vocab]: the logits each generated token came from
        top2 = logits.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        for j in (logits.argmax(-1) != torch.tensor(out)).nonzero().flatten().tolist():
            gaps = _kth_gaps(model, ids, model.config.index_topk)
            reason = (f"prompt of {len(p)}: token {j} is {out[j]}, the full forward says "
                      f"{int(logits[j].argmax())}; top-2 logit margin {float(margin[j]):.3g}, smallest indexer "
                      f"k-th-value gap {min(gaps, default=float('nan')):.3g}")
            assert margin[j] < 1e-4, reason  # only a floating-point near-tie may differ
            print("near-tie:", reason)
