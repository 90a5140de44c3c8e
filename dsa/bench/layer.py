"""``dsa bench layer``: one DSA layer's decode step at V3.2 shapes against the dense absorbed decode.

Attention part (what DSA changes): indexer query prep + paged logits, top-k to slots, sparse MLA
over the selected rows; dense: the absorbed decode over the whole context. Projections (q/kv
down and up, absorption, W_UV, o_proj, the indexer's own projections) are timed apart and added
for the "with projections" columns. Caches are random bytes of the right formats. Every part is
timed eagerly (``triton``: host launch costs included) and replayed from a CUDA graph
(``triton+graph``: how the engine's decode steps run); speedups are given for both.
"""
import torch

from dsa.config import DSAConfig
from dsa.kernels import (
    dense_mla_decode,
    indexer_logits_paged,
    indexer_query_prep,
    rope_at,
    sparse_mla,
    topk_slots,
    yarn_cos_sin,
)
from dsa.model import DSAModel
from dsa.testing import random_block_tables

from .harness import result_row
from .indexer import random_index_cache
from .targets import LAYER_B1_128K_US, LAYER_FASTER_THAN_DENSE_FROM, LAYER_SPEEDUP_WITH_PROJECTIONS

P, K = 64, 2048


def v32_attention(device):
    """One DSAAttention with V3.2 shapes and random weights (seed 0), bf16."""
    cfg = DSAConfig.deepseek_v32(num_hidden_layers=1, n_routed_experts=None, vocab_size=256)
    return DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device=device).layers[0].self_attn


def _caches(b: int, s: int, device, g):
    table, nb = random_block_tables([s] * b, P, generator=g)
    latent = (torch.randn(nb, P, 576, device=device) * 0.5).to(torch.bfloat16)
    index = random_index_cache(nb, device, torch.Generator(device=device).manual_seed(s))
    return latent, index, table.to(device)


def run(device, timer, ceilings, args) -> list:
    attn = v32_attention(device)
    c = attn.config
    g = torch.Generator().manual_seed(0)
    rows = []
    shapes = [(64, 131072)] if args.quick else [(b, s) for b in (1, 64) for s in (8192, 32768, 131072)]
    for b, s in shapes:
        latent, index, table = _caches(b, s, device, g)
        lens = torch.full((b,), s, dtype=torch.int32, device=device)
        req = torch.arange(b, dtype=torch.int32, device=device)
        x = torch.randn(b, c.hidden_size, device=device, dtype=torch.bfloat16)
        pos = lens.long() - 1
        cos, sin = (t.to(device) for t in yarn_cos_sin(s, c.qk_rope_head_dim, c.rope_theta, c.rope_scaling))
        rot = rope_at(pos, cos, sin)
        qr, q_nope, q_pe, kv_c, k_pe = attn.project(x, rot)
        q_abs = attn.absorbed_query(q_nope, q_pe)
        iq, _, iw = attn.indexer.project(x, qr, rot)

        def select(backend="auto"):
            q8, w = indexer_query_prep(iq, iw, True, backend=backend)
            logits = indexer_logits_paged(q8.unsqueeze(1), w.unsqueeze(1), index, table, lens, P, max_seq_len=s,
                                          backend=backend)
            return topk_slots(logits, lens, K, table, req, lens, P, backend=backend)

        def dsa_attention(slots=None, backend="auto"):
            slots = select() if slots is None else slots
            return sparse_mla(q_abs, latent, slots, attn.softmax_scale, backend=backend)

        def dense_attention(backend="auto"):
            return dense_mla_decode(q_abs.unsqueeze(1), latent, table, lens, attn.softmax_scale, backend=backend)

        def projections():
            qr_, qn, qp, _, _ = attn.project(x, rot)
            attn.absorbed_query(qn, qp)
            attn.indexer.project(x, qr_, rot)
            return attn.o_proj(attn._up_v(q_abs[..., :512]).flatten(1))

        # correctness before timing, against the torch references: the selection as a set (FP8 logits
        # agree to calc_diff ~1e-7, so only near-ties at the threshold may swap), then each attention on
        # the same inputs
        mine, ref = select().cpu(), select("torch").cpu()
        overlap = sum(len(set(a.tolist()) & set(r.tolist())) for a, r in zip(mine, ref)) / ref.numel()
        assert overlap >= 0.99, f"top-k at B={b} S={s}: {overlap:.4f} of the reference selection"
        slots = select()
        for name, got, want in (("sparse", dsa_attention(slots), dsa_attention(slots, "torch")),
                                ("dense", dense_attention(), dense_attention("torch"))):
            err = float((got[0].float() - want[0].float()).abs().max() / want[0].float().abs().max())
            assert err < 2e-2, f"{name} attention at B={b} S={s}: relative error {err:.3g} against the reference"
        shape = dict(B=b, N=1, S=s, H=c.num_attention_heads, K=K)
        for impl, graph in (("triton", False), ("triton+graph", True)):
            t_dsa = timer(dsa_attention, graph=graph)
            t_dense = timer(dense_attention, graph=graph)
            t_proj = timer(projections, graph=graph)
            speedup = t_dense["median_us"] / t_dsa["median_us"]
            with_proj = (t_dense["median_us"] + t_proj["median_us"]) / (t_dsa["median_us"] + t_proj["median_us"])
            targets = {}
            if graph and b == 1:
                targets = dict(target_us=LAYER_B1_128K_US if s == 131072 else None,
                               target_faster_than_dense=s >= LAYER_FASTER_THAN_DENSE_FROM)
            elif graph and (b, s) == (64, 131072):
                targets = dict(target_speedup_with_projections=LAYER_SPEEDUP_WITH_PROJECTIONS)
            rows.append(result_row("layer_dsa_attention", impl, shape, t_dsa, ceilings, speedup_vs_dense=speedup,
                                   speedup_with_projections=with_proj, projections_us=t_proj["median_us"],
                                   target_speedup=8.0 if (b, s) == (64, 131072) else None, **targets))
            rows.append(result_row("layer_dense_attention", impl, shape, t_dense, ceilings,
                                   bytes_moved=b * s * 1152, flops=2 * b * c.num_attention_heads * s * (576 + 512),
                                   bound="bf16"))
            rows.append(result_row("layer_projections", "torch+graph" if graph else "torch", dict(B=b), t_proj,
                                   ceilings))
            print(f"B={b} S={s} {impl}: DSA {t_dsa['median_us']:.1f} us, dense {t_dense['median_us']:.1f} us, "
                  f"projections {t_proj['median_us']:.1f} us: {speedup:.2f}x, {with_proj:.2f}x with projections",
                  flush=True)
        del latent, index
        torch.cuda.empty_cache()
    return rows

