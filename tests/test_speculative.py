"""Speculative decoding in the engine (float32, CPU): greedy tokens identical to N = 0 for N = 1, 2, 3 with the
MTP module (random) and the scripted drafter (every accepted length 0..N), with prefix caching, preemption,
stop tokens and strings and max_tokens landing inside a draft; the one-line errors."""
import pytest
import torch

from dsa import Engine, SamplingParams
from dsa.engine.drafter import MTPDrafter, ScriptedDrafter
from dsa.model.byte_vocab import BYTE_VOCAB_SIZE
from dsa.model.mtp import mtp_logits
from dsa.model.presets import PRESETS, default_model
from dsa.serve.tokenizer import ByteTokenizer
from model_utils import greedy_oracle, prompt, sharp_model, spec_model, tiny_model

V = BYTE_VOCAB_SIZE
LENGTHS = (5, 14, 23)  # around index_topk = 16: dense rows, sparse rows, and prompts that cross it
NEW = 9


@pytest.fixture(scope="module")
def model():
    return spec_model()


def _prompts():
    return [prompt(n, 50 + n, vocab=256) for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model):
    out = Engine(model, num_blocks=64).generate(_prompts(), NEW)
    assert all(len(set(o)) > NEW // 2 for o in out), f"degenerate continuations {out}"
    return out


def scripted(n, prompts, outputs, vocab=V):
    """Proposal c rejects draft c % (N + 1) (none when that is N): every accepted length 0..N occurs."""
    return ScriptedDrafter(greedy_oracle(prompts, outputs), n, vocab, wrong=lambda count, j: j == count % (n + 1))


@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"N{n}")
def test_greedy_tokens_are_identical_with_the_scripted_drafter(model, reference, n):
    e = Engine(model, num_blocks=64, speculative_tokens=n, drafter=scripted(n, _prompts(), reference))
    assert e.generate(_prompts(), NEW) == reference
    assert e.stats.prefill_chunks == len(LENGTHS)  # accepted rows count as computed: none is recomputed
    spec = e.stats.spec
    assert all(spec.accepted_lengths), f"accepted lengths {spec.accepted_lengths}: one of 0..{n} never occurred"
    assert spec.tokens_per_step > 1 and spec.drafts == e.drafter.proposed and spec.accepted == e.drafter.accepted


@pytest.mark.parametrize("n", [1, 3], ids=lambda n: f"N{n}")
def test_greedy_tokens_are_identical_with_the_mtp_module(model, reference, n):
    e = Engine(model, num_blocks=64, speculative_tokens=n)
    assert e.generate(_prompts(), NEW) == reference
    assert e.stats.spec.drafts > 0 and e.stats.spec.verify_steps > 0


def test_max_tokens_inside_a_draft(model, reference):
    n = 3
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (1, 2, 6)]  # 6: the last step has 1 draft
    e = Engine(model, num_blocks=64, speculative_tokens=n,
               drafter=ScriptedDrafter(greedy_oracle(_prompts(), reference), n, V))
    got = e.generate(_prompts(), sampling=params)
    assert got == [r[:p.max_tokens] for r, p in zip(reference, params)]


def test_stop_token_and_stop_string_inside_a_draft(model, reference):
    n = 3
    tok = ByteTokenizer()
    prompts = _prompts()
    stop_tok = [SamplingParams(max_tokens=NEW, temperature=0, stop_token_ids=(r[2],)) for r in reference]
    stop_str = [SamplingParams(max_tokens=NEW, temperature=0, stop=tok.decode(r[4:6]) or "x") for r in reference]
    for params in (stop_tok, stop_str):
        plain = Engine(model, num_blocks=64, tokenizer=tok).stream(prompts, sampling=params)
        spec = Engine(model, num_blocks=64, tokenizer=tok, speculative_tokens=n,
                      drafter=ScriptedDrafter(greedy_oracle(prompts, reference), n, V)).stream(prompts, sampling=params)
        want, got = _collect(plain), _collect(spec)
        assert got == want
        assert all(reason == "stop" for _, _, reason in want.values()) or params is stop_str


def _collect(deltas) -> dict:
    out = {}
    for d in deltas:
        ids, text, reason = out.get(d.index, ([], "", None))
        out[d.index] = (ids + d.token_ids, text + (d.text or ""), d.finish_reason or reason)
    return out


def test_prefix_caching_and_preemption(model, reference):
    n = 2
    prompts = _prompts()
    e = Engine(model, num_blocks=64, speculative_tokens=n, drafter=scripted(n, prompts, reference))
    assert e.generate(prompts, NEW) == reference
    assert e.generate(prompts, NEW) == reference  # again: the prompts' blocks come from the prefix cache
    assert e.stats.prefix.hit_tokens > 0
    small = Engine(model, num_blocks=4, speculative_tokens=n, drafter=scripted(n, prompts, reference))
    assert small.generate(prompts, NEW) == reference  # 64 tokens of pool: requests are preempted
    assert small.stats.preemptions > 0


def test_demo_cpu_shapes(reference):
    """demo-cpu's attention shapes (hidden 1024, 16 heads, 64 indexer heads) with index_topk 16, N = 2."""
    config = PRESETS["demo-cpu"]().replace(num_hidden_layers=1, index_topk=16, block_size=16,
                                           num_nextn_predict_layers=1, intermediate_size=256)
    m = sharp_model(config, 1)
    prompts = [prompt(n, 7 + n, vocab=256) for n in (6, 19)]
    ref = Engine(m, num_blocks=16).generate(prompts, 6)
    for drafter in (None, scripted(2, prompts, ref)):
        e = Engine(m, num_blocks=16, speculative_tokens=2, drafter=drafter)
        assert e.generate(prompts, 6) == ref


def test_stats_report_acceptance(model, reference):
    n = 2
    e = Engine(model, num_blocks=64, speculative_tokens=n,
               drafter=ScriptedDrafter(greedy_oracle(_prompts(), reference), n, V))
    e.generate(_prompts(), NEW)
    d = e.stats.spec.as_dict()
    assert d["acceptance"] == 1.0 and d["acceptance_by_position"] == [1.0, 1.0], d
    assert d["tokens_per_step"] > 2 and d["verify_ms_per_step"] > 0
    assert Engine(model, num_blocks=8).stats.spec.as_dict()["verify_steps"] == 0


def test_errors_name_speculative_tokens(model):
    with pytest.raises(ValueError, match="speculative_tokens: the model has no MTP module"):
        Engine(tiny_model(), num_blocks=8, speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_tokens: expected an int >= 0"):
        Engine(model, num_blocks=8, speculative_tokens=-1)
    with pytest.raises(TypeError, match="speculative_tokens"):
        Engine(model, num_blocks=8, speculative_tokens=1.5)
    with pytest.raises(ValueError, match="drafter"):
        Engine(model, num_blocks=8, drafter=ScriptedDrafter(lambda t, k: [], 1, V))
    e = Engine(model, num_blocks=8, speculative_tokens=1)
    with pytest.raises(ValueError, match="logprobs"):
        e.add_request([1, 2], sampling=SamplingParams(logprobs=1))


def test_tensor_parallel_is_refused(model, monkeypatch):
    class TwoRanks:
        size = 2
    monkeypatch.setattr(model, "tp", TwoRanks())
    with pytest.raises(ValueError, match=r"speculative_tokens: not supported with tensor parallelism \(tp = 2\)"):
        Engine(model, num_blocks=8, speculative_tokens=1)


def test_sampled_requests_run_and_stay_seeded(model):
    params = SamplingParams(max_tokens=NEW, temperature=0.8, top_p=0.9, seed=3)
    runs = [Engine(model, num_blocks=64, speculative_tokens=2).generate(_prompts(), sampling=params) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(r) == NEW for r in runs[0])


class _Recording(MTPDrafter):
    """The MTP drafter, keeping each request's tokens and drafts of every step (a host copy: eager steps)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen, self.slots = [], None

    def prepare(self, runner, slots):
        self.slots = slots
        return super().prepare(runner, slots)

    def draft(self, runner, step, buf):
        drafts = super().draft(runner, step, buf)
        sl = self.slots
        for row, c, k, d in zip(sl.rows.tolist(), sl.computed.tolist(), sl.num_drafts.tolist(), drafts.tolist()):
            if k:
                self.seen.append((runner.batch.token_ids[row, :c + 1].tolist(), d))
        return drafts


def test_the_trained_mtp_module_drafts_what_its_reference_says():
    """The default checkpoint's trained MTP module: tokens as without speculation, drafts accepted, and
    each step's first draft the full-sequence MTP forward's argmax at the row before the last token."""
    m = default_model("cpu")
    prompts = [[0] + prompt(n, 3 + n, vocab=4096) for n in (12, 30)]
    ref = Engine(m, num_blocks=16).generate(prompts, 8)
    drafter = _Recording(m, 2, 256)
    e = Engine(m, num_blocks=16, speculative_tokens=2, drafter=drafter)
    assert e.generate(prompts, 8) == ref
    assert e.stats.spec.accepted > 0, e.stats.spec.as_dict()
    assert len(drafter.seen) >= e.stats.spec.requests > 0
    for tokens, drafts in drafter.seen:
        logits, _ = mtp_logits(m, torch.tensor([tokens]))
        want = int(logits[0, -1].argmax())
        assert drafts[0] == want, f"after {len(tokens)} tokens: drafted {drafts[0]}, the reference says {want}"


def test_bench_rows_on_cpu(model, capsys):
    """``dsa bench engine --speculative-tokens`` rows (the GPU command's code), small, on the CPU."""
    from dsa.bench.speculative import rows
    ceilings = dict(copy_tbps=1.0, bf16_tflops=1.0, fp8_tflops=1.0, bf16_tflops_p10=1.0)
    (mtp,) = rows(model, None, "tiny", 2, None, [20], 6, ceilings)
    scripted, batched = rows(model, None, "tiny", 2, 1.0, [20], 6, ceilings, batches=(1, 3))
    assert mtp["identical"] and scripted["identical"] and scripted["acceptance"] == 1.0
    assert scripted["tokens_per_step"] > 2 and scripted["predicted_speedup"] > 0 and "speedup" in mtp
    assert batched["shape"]["B"] == 3 and batched["identical"] and batched["acceptance"] == 1.0
    assert batched["graphs_captured"] == batched["kernels_compiled"] == 0
    assert "tokens/s speculating" in capsys.readouterr().out


def test_bench_stats_count_the_timed_window_alone(model, reference):
    """At B > 1 with chunked prefills, requests verify drafts beside another's prefill chunk before every
    request has its first token; the bench's draft and verify times (and the prediction made of them) are
    the timed window's: its verify steps emit exactly the tokens the window counts."""
    from dsa.bench.speculative import decode
    ids = _prompts()[0]
    e = Engine(model, num_blocks=64, max_batch_tokens=len(ids) + 2, speculative_tokens=2,
               drafter=ScriptedDrafter(greedy_oracle([ids] * 3, [reference[0]] * 3), 2, V))
    out, _, tokens, _ = decode(e, ids, NEW, 3)
    assert out == [reference[0]] * 3
    st = e.stats.spec
    assert st.emitted == tokens, f"the stats count {st.emitted} tokens, the timed window {tokens}"


@pytest.mark.parametrize("drafter", ["mtp", "scripted"])
def test_chunked_prefill_steps_without_a_sampled_row(model, reference, drafter):
    """max_batch_tokens = 7: some steps only prefill a chunk (nothing samples, nothing is verified)."""
    d = None if drafter == "mtp" else ScriptedDrafter(greedy_oracle(_prompts(), reference), 2, V)
    e = Engine(model, num_blocks=64, max_batch_tokens=7, speculative_tokens=2, drafter=d)
    assert e.generate(_prompts(), NEW) == reference
    assert e.stats.prefill_chunks > len(LENGTHS)


def test_draft_and_verify_seconds_count_verify_steps_only():
    """A prefill step (no drafts) takes the speculating path too; its seconds are not a verify step's
    (the H200 row reported 62.9 ms of verify a step inside 10.6 ms steps: the 163K prefill counted)."""
    import numpy as np

    from dsa.engine.speculative import SpecStats, VerifiedStep, count

    class Clock:
        def __init__(self, spans):
            self._spans = spans

        def spans(self):
            return self._spans

    stats = SpecStats(2, by_position=[0, 0], proposed_by_position=[0, 0], accepted_lengths=[0, 0, 0])
    prefill = VerifiedStep([], None, Clock([4.0, 0.5]), np.zeros(1, np.int64))  # (draft + verify, observe)
    verify = VerifiedStep([], None, Clock([0.002, 0.004]), np.array([2]))
    count(stats, prefill, np.zeros(1, np.int64), [1])
    count(stats, verify, np.array([1]), [2])
    d = stats.as_dict()
    assert stats.verify_steps == 1 and d["verify_ms_per_step"] == 2.0 and d["draft_ms_per_step"] == 4.0, d
