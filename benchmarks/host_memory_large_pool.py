"""Host memory per request of an engine whose pool is as large as demo-gpu's on an H200 (~344K blocks
of 64), so that no request evicts: where the bytes go, on CPU.

A one-layer model with small rows (hidden 64, the FP8 latent cache: 788 B a token, 50 KiB a block;
its pages are touched only where requests write, so the pool costs what the requests use) serves
batches of 32 unique prompts (``PROMPT`` tokens, 4 sampled new tokens, a byte tokenizer for text
and stop checks). After a warm batch, per request: bytes traced by tracemalloc grouped by the line
that allocated them, Python objects by type (gc), glibc's heap (``mallinfo2``) and resident memory
by kind (``/proc/self/status``), the cache's own pages apart (``RssAnon`` counts them on CPU).

    python benchmarks/host_memory_large_pool.py > benchmarks/results/host-memory-large-pool-cpu-2cores-2026-12-02.json
"""
import collections
import gc
import json
import random
import sys
import time
import tracemalloc

import torch

from dsa.config import DSAConfig, bytes_per_token
from dsa.engine.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.model import DSAModel
from dsa.serve.host_memory import resident_by_kind
from dsa.serve.tokenizer import ByteTokenizer

NUM_BLOCKS, PROMPT, NEW, BATCH, BATCHES = 344_000, 448, 4, 32, 8


def main() -> None:
    torch.manual_seed(0)
    tok = ByteTokenizer()
    config = DSAConfig.tiny(num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                            q_lora_rank=32, n_routed_experts=None, index_n_heads=2, index_topk=64, block_size=64,
                            kv_cache_format="fp8", max_position_embeddings=4096, vocab_size=259,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    engine = Engine(DSAModel.random(config, dtype=torch.float32, device="cpu"), num_blocks=NUM_BLOCKS,
                    max_batch_tokens=8192, max_num_seqs=BATCH, tokenizer=tok)
    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=NEW, temperature=0.8, ignore_eos=True)

    def batch():
        engine.generate([[rng.randrange(256) for _ in range(PROMPT)] for _ in range(BATCH)], sampling=sampling)

    batch()
    gc.collect()
    tracemalloc.start(1)
    types0 = collections.Counter(type(o).__name__ for o in gc.get_objects())
    snap0, res0, blocks0, t0 = tracemalloc.take_snapshot(), resident_by_kind(), engine.stats.prefix.cached_blocks, \
        time.perf_counter()
    for _ in range(BATCHES):
        batch()
    gc.collect()
    snap1, res1 = tracemalloc.take_snapshot(), resident_by_kind()
    n, cached = BATCH * BATCHES, engine.stats.prefix.cached_blocks - blocks0
    types = collections.Counter(type(o).__name__ for o in gc.get_objects()) - types0
    lines = snap1.compare_to(snap0, "lineno")
    block_bytes = bytes_per_token(config, torch.float32) * config.block_size
    print(json.dumps({
        "machine": "2-core CPU VM", "command": "python benchmarks/host_memory_large_pool.py",
        "num_blocks": NUM_BLOCKS, "prompt_tokens": PROMPT, "new_tokens": NEW, "requests": n,
        "seconds": round(time.perf_counter() - t0, 1), "cached_blocks_added": cached,
        "cache_bytes_per_block": block_bytes,
        "traced_bytes_per_request": round(sum(d.size_diff for d in lines) / n, 1),
        "traced_bytes_per_cached_block": round(sum(d.size_diff for d in lines) / cached, 1),
        "traced_by_line_bytes_per_request": {str(d.traceback[0]): round(d.size_diff / n, 1)
                                             for d in lines[:8] if d.size_diff > 0},
        "objects_per_request": {k: round(v / n, 2) for k, v in types.most_common(8)},
        "resident_by_kind_bytes_per_request": {k: round((res1[k] - res0[k]) / n) for k in res0},
        "cache_pages_bytes_per_request": round(cached * block_bytes / n),
    }, indent=1))


if __name__ == "__main__":
    sys.exit(main())
