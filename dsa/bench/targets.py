"""Every target a bench row carries (``target_us`` and its kin), in one place, each with its issue.

Graph-replay times on the H200 unless named otherwise; a row meets its target when its time (its
``graph_us`` when it has one) is at most the target (:mod:`dsa.bench.report`).
"""

# bench mla (issue #40; #15 before it): sparse decode B = 64 (next_n = 1) and B = 128 (next_n = 2) per cache
# format, the sparse prefill (4,096 queries x 2,048 selected keys) and the dense absorbed decode at 32K
MLA_US = {("sparse_mla_decode", 64, 1, "bf16"): 98.0, ("sparse_mla_decode", 64, 1, "fp8"): 105.0,
          ("sparse_mla_decode", 128, 2, "bf16"): 365.0, ("sparse_mla_decode", 128, 2, "fp8"): 400.0,
          ("sparse_mla_prefill", 4096, 1, "bf16"): 4700.0, ("dense_mla_decode", 64, 32768, "bf16"): 1050.0}

# bench topk (issue #40; #16 before it): (B, L) -> us for 2,048 of L, exact, without a previous step's guess;
# the slots variant (top-k, then the block-table lookup) gets 10% more
TOPK_US = {(64, 65536): 22.0, (64, 131072): 25.0, (1, 131072): 15.0}
TOPK_SLOTS_SLACK = 1.1

# bench indexer: the paged logits (issue #16): (B, S, next_n) -> us; the ragged logits' rate (issue #40)
INDEXER_PAGED_US = {(64, 65536, 1): 150.0, (64, 131072, 1): 290.0}
INDEXER_RAGGED_TFLOPS = 1000.0

# bench layer (issue #16): one DSA layer's attention at B = 1, 128K; faster than dense from 32K; with its
# projections >= 10x dense at B = 64, 128K
LAYER_B1_128K_US = 60.0
LAYER_FASTER_THAN_DENSE_FROM = 32768
LAYER_SPEEDUP_WITH_PROJECTIONS = 10.0

# bench long (issue #38): demo-gpu, one prompt of L tokens -> seconds to its first token (85.6 s at 1M before it)
LONG_TTFT_S = {1048576: 50.0}
