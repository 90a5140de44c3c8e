"""``dsa bench engine --speculative-tokens N``: decode tokens/s with and without speculation, at B = 1 and
the batch sizes of ``--spec-batch`` (B requests of the same prompt).

For each context S one prompt (the demo's held-out text for a checkpoint with a tokenizer, random tokens
for a preset) is prefilled and NEW tokens are decoded greedily (``ignore_eos``), three ways: the plain
engine (CUDA graphs, its default), the plain engine eagerly (``cuda_graphs=False``: a decode step without
graph replay), and the speculating engine (its verify steps replay graphs keyed by ``next_n = N + 1``).
Decode time is from the moment every request has its first streamed token to the last token, so the
prefills are not in it, nor in the stats (the engine's stats are zeroed at that moment: at B > 1 the verify
steps beside another request's prefill chunk would inflate the draft and verify times), in passes after a
first of the same requests on the same engine (the first compiles its kernels and captures its graphs; the
row says what the timed passes still compiled and captured): :data:`PASSES` timed passes of the plain and
the speculating engine, alternated, and their medians (each pass's rates are in the row: on the H200 a
single pass's speedup moved from 1.06x to 2.08x with the host's noise). The drafter is
the model's MTP module, or with ``--draft-acceptance P`` the test drafter
(:class:`~dsa.engine.drafter.ScriptedDrafter`) proposing the plain run's own tokens, each draft wrong
with probability ``1 - P`` (a seeded hash), for a model whose MTP module is random.

Each ``engine_speculative`` row carries the measured acceptance (overall and by draft position), the
tokens each verify step brings (``tokens_per_step``), the draft and verify times per step, the plain
step time, ``speedup`` (speculating tokens/s over plain, graphs) and ``predicted_speedup`` =
``tokens_per_step * plain_step_ms / (draft_ms + verify_ms)``, and ``identical``: the greedy tokens equal
the plain run's.
"""
import os
import statistics
import time

import torch

from dsa.engine import Engine
from dsa.engine.drafter import ScriptedDrafter
from dsa.engine.sampling import SamplingParams, hash32
from dsa.kernels import compiles
from dsa.kernels.common import cdiv

from .harness import result_row

NEW = 128
PASSES = 5  # timed passes of the plain and the speculating engine each, alternated


def spec_model(args, device):
    """``(model, tokenizer or None, name)``: ``--preset`` with a random MTP module, else ``--checkpoint``
    (default: the embedded trained model)."""
    from dsa.model import DSAModel
    from dsa.model.presets import BYTE_VOCAB, DEFAULT_CHECKPOINT, PRESETS
    from dsa.serve.tokenizer import Tokenizer
    if getattr(args, "preset", None):
        config = PRESETS[args.preset]().replace(num_nextn_predict_layers=1, **BYTE_VOCAB)
        return DSAModel.random(config, seed=0, dtype=torch.bfloat16, device=device), None, args.preset
    folder = args.checkpoint or DEFAULT_CHECKPOINT
    model = DSAModel.from_pretrained(folder, dtype=torch.bfloat16, device=device)
    tok = Tokenizer.from_pretrained(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) else None
    return model, tok, "default" if args.checkpoint is None else os.path.basename(os.path.normpath(folder))


def prompt_ids(model, tok, s: int) -> list:
    """``s`` prompt tokens: the demo text repeated (with a tokenizer), else random ids."""
    if tok is not None:
        from dsa.model.presets import DEFAULT_CHECKPOINT
        with open(os.path.join(os.path.dirname(DEFAULT_CHECKPOINT), "demo_prompt.txt"), encoding="utf-8") as f:
            ids = tok.encode(f.read())  # the demo's held-out text
        return (ids * cdiv(s, len(ids)))[:s]
    g = torch.Generator().manual_seed(s)
    return torch.randint(0, min(256, model.config.vocab_size), (s,), generator=g).tolist()


def decode(engine: Engine, ids: list, new: int, batch: int = 1) -> tuple:
    """``(tokens of each request, decode seconds, decode tokens, warm)`` of a warm pass (the same requests
    run once before it: its kernels compiled, its graphs captured; the stats are the timed window's):
    ``batch`` requests of the prompt ``ids``, timed from the moment every one has its first token (their
    prefills done) to the last token. ``warm`` says what the timed pass still compiled and captured, and
    the first pass's seconds."""
    first = timed(engine, ids, new, batch)[1]
    graphs, kernels = len(engine.runner.graphs), compiles.total()
    out, t, tokens = timed(engine, ids, new, batch)
    return out, t, tokens, dict(first_pass_s=first, graphs_captured=len(engine.runner.graphs) - graphs,
                                kernels_compiled=compiles.total() - kernels)


def timed(engine: Engine, ids: list, new: int, batch: int = 1) -> tuple:
    """``(tokens of each request, seconds, tokens)`` from every request's first token to the last; the
    engine's stats count that window alone (zeroed at its start)."""
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    out, start, after = [[] for _ in range(batch)], None, 0
    for d in engine.stream([ids] * batch, sampling=sp):
        if start is not None:
            after += len(d.token_ids)
        out[d.index].extend(d.token_ids)
        if start is None and all(out):
            engine.reset_stats()
            start = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, after


def set_acceptance(tokens: list, prompt: list, n: int, vocab: int, p: float) -> ScriptedDrafter:
    """The test drafter: the plain run's tokens, each draft wrong with probability ``1 - p``."""
    def propose(seq, k):
        done = len(seq) - len(prompt)
        return (tokens + [0] * k)[done:done + k]
    limit = int(p * (1 << 32))
    return ScriptedDrafter(propose, n, vocab, wrong=lambda count, j: hash32((count * 64 + j) & 0xFFFFFFFF) >= limit)


def run(device, timer, ceilings, args) -> list:
    model, tok, name = spec_model(args, device)
    longest = model.config.max_position_embeddings - NEW - args.speculative_tokens - 1
    contexts = sorted({min(s, longest) for s in ((longest,) if args.quick else (1024, 8192, 32768, longest))})
    batches = [int(b) for b in str(getattr(args, "spec_batch", "1")).split(",")]
    return rows(model, tok, name, args.speculative_tokens, args.draft_acceptance, contexts, NEW, ceilings, batches)


def rows(model, tok, name: str, n: int, p: float | None, contexts: list, new: int, ceilings: dict,
         batches=(1,)) -> list:
    """One ``engine_speculative`` row per context and batch size (module docstring)."""
    c, out = model.config, []
    for s in contexts:
        ids = prompt_ids(model, tok, s)
        for b in batches:
            out.append(_row(model, name, n, p, ids, b, new, ceilings))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def _row(model, name: str, n: int, p: float | None, ids: list, b: int, new: int, ceilings: dict) -> dict:
    c, s = model.config, len(ids)
    blocks = b * (cdiv(s + new + n + 1, c.block_size) + 1)
    _, t_eager, k_eager, _ = decode(Engine(model, num_blocks=blocks, prefix_caching=False, cuda_graphs=False), ids,
                                    new, b)
    plain = Engine(model, num_blocks=blocks, prefix_caching=False)
    base = timed(plain, ids, new, b)[0]  # (the first pass: compiles and captures)
    drafter = None if p is None else set_acceptance(base[0], ids, n, c.vocab_size, p)
    engine = Engine(model, num_blocks=blocks, prefix_caching=False, speculative_tokens=n, drafter=drafter)
    first = timed(engine, ids, new, b)[1]
    graphs, kernels = len(engine.runner.graphs), compiles.total()
    rates, plain_rates, passes, identical = [], [], [], True
    for _ in range(PASSES):
        out, t, k = timed(plain, ids, new, b)
        plain_rates.append(k / t)
        got, t, k = timed(engine, ids, new, b)
        rates.append(k / t)
        passes.append(engine.stats.spec.as_dict())
        identical = identical and out == base and got == base
    st = dict(passes[-1], **{key: statistics.median(x[key] for x in passes)
                             for key in ("draft_ms_per_step", "verify_ms_per_step")})
    warm = dict(first_pass_s=first, graphs_captured=len(engine.runner.graphs) - graphs,
                kernels_compiled=compiles.total() - kernels)
    tps, plain_tps = statistics.median(rates), statistics.median(plain_rates)
    plain_ms = 1e3 * b / plain_tps  # a plain step: b tokens
    predicted = st["tokens_per_step"] * plain_ms / max(st["draft_ms_per_step"] + st["verify_ms_per_step"], 1e-9)
    r = result_row("engine_speculative", f"{name}+N{n}" + ("" if p is None else f"+p{p:g}"),
                   dict(B=b, S=s, N=n, layers=c.num_hidden_layers), dict(median_us=1e6 / tps, reps=PASSES),
                   ceilings, tokens_per_s=tps, plain_tokens_per_s=plain_tps,
                   plain_eager_tokens_per_s=k_eager / t_eager, plain_step_ms=plain_ms, speedup=tps / plain_tps,
                   predicted_speedup=predicted, identical=identical,
                   passes=dict(tokens_per_s=rates, plain_tokens_per_s=plain_rates),
                   drafter="mtp" if p is None else f"scripted p={p:g}", **warm, **st)
    print(f"{name} B={b} S={s} N={n}: {r['tokens_per_s']:.0f} tokens/s speculating vs {r['plain_tokens_per_s']:.0f} "
          f"plain ({r['plain_eager_tokens_per_s']:.0f} eager): {r['speedup']:.2f}x (predicted "
          f"{predicted:.2f}x; medians of {PASSES} alternated passes, plain {min(plain_rates):.0f}-"
          f"{max(plain_rates):.0f}, speculating {min(rates):.0f}-{max(rates):.0f}); acceptance "
          f"{st['acceptance']:.2f} {st['acceptance_by_position']}, {st['tokens_per_step']:.2f} tokens/step, draft "
          f"{st['draft_ms_per_step']:.2f} ms + verify {st['verify_ms_per_step']:.2f} ms a step; identical "
          f"{r['identical']}", flush=True)
    return r
