"""Prefix caching: a request reuses the cached blocks of its prompt's prefix (latent rows and indexer
keys together) and produces the same tokens as without caching (float32, exact and FP8 indexers)."""
import pytest
import torch

import dsa.indexer.lightning as lightning
from dsa import Engine
from model_utils import prompt, tiny_model

P = 16  # tiny_model's block size; index_topk 16: a 3-block prefix reaches into the sparse range


@pytest.fixture(scope="module", params=["exact", "fp8"])
def model(request):
    return tiny_model(indexer_precision=request.param, n_routed_experts=None)


def _both(model, prompts, new=4, **kw):
    """Tokens per prompt, run one after another on one engine, with and without prefix caching."""
    runs = {}
    for caching in (True, False):
        engine = Engine(model, prefix_caching=caching, **{"num_blocks": 40, **kw})
        runs[caching] = ([engine.generate([p], new)[0] for p in prompts], engine)
    return runs


def test_shared_three_block_prefix(model):
    doc = prompt(3 * P, 1)
    prompts = [doc + prompt(7, 2), doc + prompt(12, 3)]
    runs = _both(model, prompts)
    assert runs[True][0] == runs[False][0]
    stats = runs[True][1].stats.prefix
    assert stats.hit_tokens == 3 * P and stats.prompt_tokens == sum(map(len, prompts))
    assert runs[False][1].stats.prefix.hit_tokens == 0


def test_multi_turn_chat_reuses_each_turn(model):
    engine, plain = Engine(model, num_blocks=40), Engine(model, num_blocks=40, prefix_caching=False)
    history, hits = prompt(20, 4), []
    for turn in range(3):
        out = engine.generate([history], 5)[0]
        assert out == plain.generate([history], 5)[0]
        hits.append(engine.stats.prefix.hit_tokens)
        history = history + out + prompt(9, 10 + turn)  # the next turn extends this one, answer included
    assert hits[0] == 0 and hits[2] > hits[1] > 0


@pytest.mark.parametrize("length", [4 * P, 4 * P + 5], ids=["block-aligned", "partial-block"])
def test_prompt_entirely_cached_recomputes_its_last_block(model, length):
    p = prompt(length, 5)
    runs = _both(model, [p, p])
    assert runs[True][0] == runs[False][0] and runs[True][0][0] == runs[True][0][1]
    assert runs[True][1].stats.prefix.hit_tokens == (length - 1) // P * P  # never the last token's block


def test_eviction_under_a_small_pool(model):
    """Later requests stay correct when cached blocks are evicted; blocks in use never are."""
    prompts = [prompt(40, 20 + i) for i in range(4)] + [prompt(40, 20)]  # the last repeats the first
    runs = _both(model, prompts, num_blocks=8)  # 8 blocks = 128 tokens: room for ~2 cached prompts
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].stats.prefix.evictions > 0
    engine = Engine(model, num_blocks=8)
    a = engine.add_request(prompt(66, 30), 14)  # 80 tokens: 5 of the 8 blocks from its first step on
    out = engine.step().get(a, [])
    held = list(engine.running[a].blocks)
    for seed in (31, 32):  # b runs and leaves 2 cached blocks; c then needs them: they are evicted
        r = engine.add_request(prompt(40, seed), 3)
        while r in engine.running or any(w.rid == r for w in engine.waiting):
            out += engine.step().get(a, [])
            assert engine.running[a].blocks == held
    assert engine.stats.prefix.evictions == 2
    while a in engine.running:
        out += engine.step().get(a, [])
    assert out == Engine(model, num_blocks=8).generate([prompt(66, 30)], 14)[0]


def test_interleaved_requests_with_different_prefixes(model):
    docs = [prompt(2 * P + 3, 40), prompt(3 * P, 41)]
    prompts = [docs[i % 2] + prompt(5, 50 + i) for i in range(4)]
    for caching in (True, False):
        engine = Engine(model, num_blocks=40, max_batch_tokens=24, prefix_caching=caching)
        first = engine.generate(prompts[:2], 4)
        second = engine.generate(prompts[2:], 4)  # these share prefixes with the first two
        if caching:
            cached = first + second
            assert engine.stats.prefix.hit_tokens == 2 * P + 3 * P
        else:
            assert cached == first + second


def test_nan_in_free_blocks_never_reaches_an_output(model):
    doc = prompt(3 * P, 60)
    prompts = [doc + prompt(6, 61), doc + prompt(6, 62), prompt(30, 63)]
    clean = _both(model, prompts)[True][0]
    engine = Engine(model, num_blocks=40)
    real_step = engine.step

    def poisoned():  # before every step (and admission): NaN bytes in every block no one may read
        free = torch.tensor(list(engine.scheduler.blocks.free_ids), dtype=torch.long)
        for latent, index in engine.caches:
            latent.data.view(torch.uint8)[free] = 0xFF
            if index is not None:
                index.data.view(torch.uint8)[free] = 0xFF
        return real_step()

    engine.step = poisoned
    assert [engine.generate([p], 4)[0] for p in prompts] == clean
    assert engine.stats.prefix.hit_tokens == 3 * P


def test_a_block_is_named_by_its_whole_prefix(model):
    """Equal tokens in a block after different prefixes are different blocks (their rows differ)."""
    x, y, z, w = (prompt(P, 80 + i) for i in range(4))
    prompts = [x + y + prompt(3, 90), z + w + prompt(3, 91), x + w + prompt(3, 92)]
    runs = _both(model, prompts)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].stats.prefix.hit_tokens == P  # the third reuses x, not the w after z


def test_reused_prefix_restores_the_indexer_keys(model, monkeypatch):
    """The reused blocks' indexer keys are what the new request's indexer reads: corrupting them
    changes its selection, poisoning every other block does not."""
    doc = prompt(3 * P, 70)
    engine = Engine(model, num_blocks=40)
    engine.generate([doc + prompt(5, 71)], 2)
    reused = engine.scheduler.blocks.by_name.values()
    seen, real = [], lightning.topk_slots

    def spy(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(lightning, "topk_slots", spy)

    def selections(corrupt):
        import copy
        e = copy.deepcopy(engine)
        blocks = sorted(reused) if corrupt == "reused" else list(e.scheduler.blocks.free_ids)
        for _, index in e.caches:
            if index is not None and corrupt is not None:
                index.data[blocks] = torch.randn(index.data[blocks].shape).to(index.data.dtype) if \
                    index.data.is_floating_point() else index.data[blocks].flip(-1)
        seen.clear()
        e.generate([doc + prompt(9, 72)], 2)
        assert e.stats.prefix.hit_tokens == 3 * P  # the new request reused the document's 3 blocks
        return [s.clone() for s in seen]

    clean, others, reused_bad = selections(None), selections("free"), selections("reused")
    assert all(torch.equal(a, b) for a, b in zip(clean, others))
    assert not all(torch.equal(a, b) for a, b in zip(clean, reused_bad))
