"""After ``Engine.warmup`` no kernel compiles (marker ``gpu``): a randomized run of fresh prompt
lengths, output lengths and batch mixes builds no Triton/Gluon variant, and decode steps replay the
graphs the warm-up captured."""
import random

import pytest
import torch

from dsa import DSAConfig, DSAModel, Engine, SamplingParams
from dsa.kernels import compiles
from dsa.model.presets import GPU_DEFAULT

pytestmark = pytest.mark.gpu


def test_a_randomized_run_after_warmup_compiles_nothing():
    cfg = DSAConfig.deepseek_v32(**{**GPU_DEFAULT, "num_hidden_layers": 2, "max_position_embeddings": 32768})
    model = DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, memory_bytes=16 << 30, max_batch_tokens=4096)
    report = engine.warmup(progress=False)
    graphs = len(engine.runner.graphs)
    print(f"warm-up: {report}")
    built = []
    listener = lambda kernel, key: built.append(f"{kernel} [{key}]")  # noqa: E731
    compiles.add_listener(listener)
    try:
        _randomized_run(engine, cfg)
    finally:
        compiles.remove_listener(listener)
    assert not built, "variants built after warm-up:\n" + "\n".join(built)
    assert engine.stats.compiles_after_warmup == 0 and len(engine.runner.graphs) == graphs
    assert engine.stats.graph_steps > 0


def _randomized_run(engine, cfg):
    rng = random.Random(0)
    for burst in range(10):  # ~30 requests: bursts of 1-6 with fresh lengths, some joining running ones
        for _ in range(rng.randint(1, 6)):
            n = rng.choice([1, 2, 15, 16, 17, 63, 64, 65, 2047, 2049]) if burst < 3 else rng.randint(1, 30000)
            prompt = [rng.randrange(cfg.vocab_size) for _ in range(n)]
            engine.add_request(prompt, sampling=SamplingParams(max_tokens=rng.randint(1, 48), ignore_eos=True,
                                                               temperature=rng.choice([0.0, 0.8])))
        for _ in range(rng.randint(1, 40)):
            if engine.has_work():
                engine.step()
    while engine.has_work():
        engine.step()
