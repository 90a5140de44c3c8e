"""Decode steps replayed from CUDA graphs (marker ``gpu``): bitwise the eager step at the same padded
shapes, no host sync inside a step, the same tokens as the eager engine. The same for the verify steps
of speculative decoding (#39): the decode path with next_n = N + 1 rows, one graph per Bucket(rows,
context, next_n)."""
import pytest
import torch

from dsa import DSAConfig, DSAModel, Engine
from dsa.engine.drafter import ScriptedDrafter
from dsa.model.plan import Bucket, HostPlan
from dsa.model.route import batch_bucket, context_bucket
from model_utils import greedy_oracle

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    cfg = DSAConfig.tiny(n_routed_experts=None, index_topk=64, num_attention_heads=16, block_size=16,
                         index_topk_pattern="FSFS")
    return DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 150, 97)]  # dense and sparse rows


def _decoding(model, **kw):
    engine = Engine(model, num_blocks=64, overlap=False, **kw)  # every step finished: the runner is driven by hand
    for p in _prompts():
        engine.add_request(p, 12)
    while any(r.prefilling for r in engine.running.values()) or engine.waiting:
        engine.step()
    return engine


def test_replay_is_bitwise_the_eager_step_at_the_same_padded_shapes(model):
    engine = _decoding(model)
    assert engine.runner.use_graphs
    for _ in range(3):  # the first step captures, the next ones replay
        batch = engine.scheduler.schedule()
        q, c, reqs = batch.num_rows, batch.computed, [s.request for s in batch.sampled]  # every decode row samples
        tables, ids = [r.blocks for r in reqs], [r.tokens[n] for r, n in zip(reqs, c)]
        bucket = Bucket(batch_bucket(len(q)), context_bucket(max(c) + 1, model.config.block_size))
        host = HostPlan.pack(q, c, tables, model.config.block_size, "cuda", options=model.plan_options(),
                             input_ids=ids, bucket=bucket)
        eager = model.step(host.derive(host.upload()), engine.caches)[:len(q)].clone()  # writes the same rows
        result = engine.runner.run(batch)
        assert result.graph and torch.equal(result.logits, eager)
        engine.scheduler.update([(s, tok, False) for s, tok in zip(batch.sampled, result.logits.argmax(-1).tolist())])


def _run_without_sync(engine, batch):
    """The runner's step with every host sync an error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return engine.runner.run(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_no_host_sync_inside_a_decode_step(model, graphs):
    engine = _decoding(model, cuda_graphs=graphs)
    engine.step()  # captures (graph) or compiles (eager) outside the checked step
    result = _run_without_sync(engine, engine.scheduler.schedule())
    assert result.graph == graphs and torch.isfinite(result.logits).all()


@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_no_host_sync_inside_a_prefill_or_mixed_step(model, kind):
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, 512, (300,), generator=g).tolist()  # dense rows, then sparse rows (index_topk 64)
    engine = _decoding(model) if kind == "mixed" else Engine(model, num_blocks=64, overlap=False)
    engine.add_request(long, 4)
    engine.scheduler.max_batch_tokens = 128  # chunks behind a prefix after the first
    engine.step()  # compiles outside the checked step
    batch = engine.scheduler.schedule()
    assert any(n > 1 for n in batch.num_rows) and (kind == "prefill") == all(n > 1 for n in batch.num_rows)
    result = _run_without_sync(engine, batch)
    assert not result.graph and torch.isfinite(result.logits).all()


def test_graph_engine_gives_the_eager_engines_tokens(model):
    p = _prompts()[1]  # one request: the bucket of 1 row is the eager shape
    graph = Engine(model, num_blocks=16)
    assert graph.generate([p], 10)[0] == Engine(model, num_blocks=16, cuda_graphs=False).generate([p], 10)[0]
    assert graph.stats.graph_steps == 9  # every decode step after the prefill
    both = Engine(model, num_blocks=64).generate(_prompts(), 4)
    assert [o[0] for o in both] == [o[0] for o in Engine(model, num_blocks=64, cuda_graphs=False).generate(_prompts(), 4)]


def test_warmup_captures_every_decode_bucket_and_later_steps_only_replay(model):
    engine = Engine(model, num_blocks=16, max_batch_tokens=64, cuda_graphs=True)
    report = engine.warmup(progress=False)
    # contexts up to the pool's 256 tokens: one bucket; batch buckets 1 .. 16 (16 blocks)
    assert report["graphs_captured"] == len(engine.runner.graphs) == 5 and engine.scheduler.blocks.num_free == 16
    captured = dict(engine.runner.graphs)
    out = engine.generate([_prompts()[0]], 5)[0]
    assert len(out) == 5 and engine.stats.graph_steps == 4 and engine.runner.graphs == captured


def _scripted(model, prompts, outputs, n):
    """Drafts: the eager engine's own tokens, draft j of proposal c wrong when j == c % (N + 1)."""
    return ScriptedDrafter(greedy_oracle(prompts, outputs), n, model.config.vocab_size,
                           wrong=lambda count, j: j == count % (n + 1))


@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"N{n}")
def test_verify_steps_replay_graphs_keyed_by_next_n(model, n):
    """A speculating engine replays its verify steps (one request: the bucket of 1 row is the eager
    shape) and gives the eager speculating engine's tokens (bf16: the same kernels, so the same rows;
    against the plain engine only fp32 is exact, as the CPU tests check); every graph is keyed by
    next_n = N + 1."""
    p = [_prompts()[1]]
    ref = Engine(model, num_blocks=16, cuda_graphs=False).generate(p, 12)
    eager = Engine(model, num_blocks=16, cuda_graphs=False, speculative_tokens=n, drafter=_scripted(model, p, ref, n))
    graph = Engine(model, num_blocks=16, speculative_tokens=n, drafter=_scripted(model, p, ref, n))
    assert graph.runner.use_graphs and graph.generate(p, 12) == eager.generate(p, 12)
    assert graph.stats.graph_steps == graph.stats.steps - 1  # every step after the prefill
    assert graph.runner.graphs and all(k.next_n == n + 1 for k in graph.runner.graphs)


def test_verify_replay_is_bitwise_the_eager_step_at_the_same_padded_shapes(model, monkeypatch):
    """Each replayed verify step of three requests (bucket 4, one padding request) against the eager
    forward of the same packed plan (writing the same cache rows again)."""
    prompts, n = _prompts(), 2
    ref = Engine(model, num_blocks=64, cuda_graphs=False).generate(prompts, 8)
    engine = Engine(model, num_blocks=64, speculative_tokens=n, drafter=_scripted(model, prompts, ref, n))
    from dsa.engine import spec_step
    checked, run = [], spec_step.run

    def checking(runner, out):
        result = run(runner, out)
        if result.graph is not None:
            got = result.logits.clone()
            plan = result.step.packed.derive(result.buf, "verify")  # the same buffer: drafts read in
            eager, _ = runner._forward(plan, True)
            checked.append(torch.equal(got.flatten(0, 1), eager[:got.shape[0] * got.shape[1]]))
        return result

    monkeypatch.setattr(spec_step, "run", checking)
    engine.generate(prompts, 8)
    assert checked and all(checked), checked


@pytest.mark.parametrize("drafter", ["scripted", "mtp"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_no_host_sync_inside_a_speculating_step(model, monkeypatch, graphs, drafter):
    """The whole step, draft (the MTP module's passes or the scripted drafts' upload), verify, the
    rejection sampler's arguments and the MTP module's pass over the verify rows, enqueues without a
    host sync; the tokens are read when the step finishes."""
    from dsa.engine import speculative
    p, n = [_prompts()[0]], 2
    ref = Engine(model, num_blocks=16, cuda_graphs=False).generate(p, 10)
    if drafter == "mtp":
        target = DSAModel.random(model.config.replace(num_nextn_predict_layers=1), seed=0, dtype=torch.bfloat16,
                                 device="cuda")
        engine = Engine(target, num_blocks=16, cuda_graphs=graphs, speculative_tokens=n)
    else:
        engine = Engine(model, num_blocks=16, cuda_graphs=graphs, speculative_tokens=n,
                        drafter=_scripted(model, p, ref, n))
    launch, steps = speculative.launch, []

    def guarded(eng, out):
        if steps:  # the first speculating step captures (graph) or compiles (eager) outside the check
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            steps.append(launch(eng, out))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return steps[-1]

    monkeypatch.setattr(speculative, "launch", guarded)
    assert len(engine.generate(p, 10)[0]) == 10
    assert len(steps) > 2 and engine.stats.graph_steps == (engine.stats.steps - 1 if graphs else 0)


def test_warmup_captures_every_verify_bucket_and_later_steps_only_replay(model):
    n, p = 2, [_prompts()[0]]
    ref = Engine(model, num_blocks=16, cuda_graphs=False).generate(p, 6)
    engine = Engine(model, num_blocks=16, max_batch_tokens=64, speculative_tokens=n,
                    drafter=_scripted(model, p, ref, n))
    report = engine.warmup(progress=False)
    # contexts up to the pool's 256 tokens: one bucket; batch buckets 1 .. 16 (16 blocks), at next_n = 3
    assert set(engine.runner.graphs) == {Bucket(b, 256, n + 1) for b in (1, 2, 4, 8, 16)}
    assert report["graphs_captured"] == 10 and engine.scheduler.blocks.num_free == 16  # two a verify bucket
    captured = dict(engine.runner.graphs)
    assert len(engine.generate(p, 6)[0]) == 6 and engine.runner.graphs == captured
    assert engine.stats.graph_steps == engine.stats.steps - 1 and engine.stats.compiles_after_warmup == 0
