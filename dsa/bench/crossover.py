"""``dsa bench crossover``: where the faster of two implementations of the same function changes.

Dense prefill rows: up-projected MHA (gather, ``kv_b_proj``, SDPA with a bottom-right causal mask)
vs the absorbed kernel (``dense_mla_decode`` with N = the chunk), by query length Q and prefix
length. ``prefill_mha_min_query`` is the smallest Q from which MHA was faster for every measured
prefix (the analytic FLOP rule in ``dsa/dispatch.py`` says Q ~ 171 for long contexts).

Writes ``crossover-<gpu>-<date>.json`` (every measurement) and ``dispatch_<gpu>.json`` (the
threshold, the file ``dispatch_thresholds`` names; the H200 one ships as ``dsa/data/dispatch_h200.json``).
"""
import json
import os

import torch

from dsa.cache import LatentCache
from dsa.kernels import dense_mla_decode
from dsa.model.dispatch import Dispatch
from dsa.model.plan import BatchPlan, PlanOptions
from dsa.testing import random_block_tables

from .harness import gpu_slug, result_row
from .layer import v32_attention

P = 64


def run(device, timer, ceilings, args) -> list:
    attn = v32_attention(device)
    c = attn.config
    h = c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    rows = []
    # dense prefill: MHA vs absorbed, by query length and prefix length
    queries = [64, 256, 1024] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    prefixes = [0, 8192] if args.quick else [0, 2048, 8192]
    mha_from = {}
    for prefix in prefixes:
        for qn in queries:
            s = prefix + qn
            table, nb = random_block_tables([s], P, generator=g)
            every_mha = PlanOptions(dispatch=Dispatch(c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim,
                                                      prefill_mha_min_query=1))
            plan = BatchPlan.build([qn], [prefix], table, P, device, options=every_mha)  # one MHA segment
            seg = plan.mha[0]
            cache = LatentCache(nb, P, device=device)
            cache.data.copy_(torch.randn(nb, P, 576, device=device) * 0.5)
            q_nope = (torch.randn(qn, h, c.qk_nope_head_dim, device=device) * 0.1).to(torch.bfloat16)
            q_pe = (torch.randn(qn, h, c.qk_rope_head_dim, device=device) * 0.1).to(torch.bfloat16)

            def mha():
                return attn._mha(q_nope, q_pe, seg, cache)

            def absorbed():
                o, _ = dense_mla_decode(attn.absorbed_query(q_nope, q_pe).unsqueeze(0), cache.data,
                                        seg.block_table, seg.seq_len, attn.softmax_scale)
                return attn._up_v(o[0])

            ref = mha().float()
            err = float((absorbed().float() - ref).abs().max() / ref.abs().max())
            assert err < 3e-2, f"MHA vs absorbed at Q={qn} prefix={prefix}: relative error {err:.3g}"
            t_mha, t_abs = timer(mha), timer(absorbed)
            shape = dict(Q=qn, prefix=prefix, S=s, H=h)
            rows.append(result_row("prefill_mha", "sdpa", shape, t_mha, ceilings))
            rows.append(result_row("prefill_absorbed", "triton", shape, t_abs, ceilings))
            if t_mha["median_us"] < t_abs["median_us"] and prefix not in mha_from:
                mha_from[prefix] = qn
            del cache
    never = max(queries) * 2  # MHA never won at this prefix: a threshold past every measured Q
    prefill_min = max(mha_from.get(p, never) for p in prefixes)
    thresholds = {"prefill_mha_min_query": prefill_min,
                  "mha_from_query_by_prefix": {str(p): mha_from.get(p) for p in prefixes},
                  "measured": {"prefill_Q": queries, "prefill_prefix": prefixes, "H": h}}
    gpu = torch.cuda.get_device_name(device)
    path = os.path.join(args.out, f"dispatch_{gpu_slug(gpu)}.json")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"gpu": gpu, **thresholds}, f, indent=1)
        f.write("\n")
    print(f"thresholds: {thresholds['prefill_mha_min_query']=} -> {path}")
    return rows
