"""The model on the GPU (Triton kernels) against the same model on the CPU (torch references)."""
import copy

import pytest
import torch

from dsa import DSAConfig, DSAModel, Engine
from dsa.indexer import LightningIndexer

pytestmark = pytest.mark.gpu


def _pair(**overrides):
    cfg = DSAConfig.tiny(**{**dict(index_topk=64, index_topk_pattern="FSFS", num_attention_heads=16,
                                   block_size=16), **overrides})
    cpu = DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device="cpu")
    gpu = copy.deepcopy(cpu).finalize(torch.bfloat16, "cuda")
    return cpu, gpu


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(0, -2), b.double().flatten(0, -2), dim=-1)


def test_bf16_within_index_topk_matches_cpu():
    cpu, gpu = _pair()
    ids = torch.randint(0, 512, (3, 64), generator=torch.Generator().manual_seed(0))
    assert _cos(gpu(ids.cuda()).cpu(), cpu(ids)).min() >= 0.995


def test_beyond_index_topk_recall_and_logits(monkeypatch):
    """Model level: mean logits cosine. Per indexer layer: the GPU indexer (Triton) and the CPU one (references)
    on the same layer inputs, so bf16 drift between the two whole models does not blur the comparison."""
    cpu, gpu = _pair()
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(1))
    seen = []
    real = LightningIndexer.forward

    def spy(self, x, qr, *rest):
        out = real(self, x, qr, *rest)
        seen.append((x, qr, out.prefill))
        return out

    monkeypatch.setattr(LightningIndexer, "forward", spy)
    ref = cpu(ids)
    monkeypatch.undo()
    assert _cos(gpu(ids.cuda()).cpu(), ref).mean() >= 0.99
    b, s = ids.shape
    per = -(-s // gpu.config.block_size)
    plan = gpu.plan([s] * b, [0] * b, torch.arange(b * per, dtype=torch.int32).view(b, per))
    caches = [index for _, index in gpu.allocate_caches(b * per) if index is not None]
    indexers = [layer.self_attn.indexer for layer in gpu.layers if layer.self_attn.indexer is not None]
    assert len(seen) == len(indexers) == 2
    for (x, qr, want), indexer, cache in zip(seen, indexers, caches):
        got = indexer(x.cuda(), qr.cuda(), plan.indexer, cache, gpu.rope_at(plan.positions)).prefill.cpu()
        hits = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want))
        assert hits / want.numel() >= 0.99


def test_engine_decode_on_gpu_matches_cpu_tokens_mostly():
    cpu, gpu = _pair()
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 100)]
    out_gpu = Engine(gpu, num_blocks=64).generate(prompts, 6)
    out_cpu = Engine(cpu, num_blocks=64).generate(prompts, 6)
    assert [len(o) for o in out_gpu] == [6, 6]
    assert out_gpu[0][0] == out_cpu[0][0] and out_gpu[1][0] == out_cpu[1][0]  # first tokens (no drift yet)


def test_peak_workspace_matches_allocator_growth():
    cfg = DSAConfig.tiny(index_topk=None, num_attention_heads=16, block_size=16, max_position_embeddings=8192)
    model = DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, num_blocks=300, max_batch_tokens=4096, overlap=False)  # one step, finished within it
    rid = engine.add_request([i % cfg.vocab_size for i in range(4096)], 1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.step()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - base
    ws = engine.stats.peak_workspace_bytes
    assert engine.stats.rows["dense_prefill_mha"] == 4096 and rid not in engine.running
    assert ws <= growth <= 4 * ws, (ws, growth)  # the math SDPA path would need H * Q * S floats more
