"""Text generation on the engine: sampling in steps, stop conditions, streaming, abort, threads,
failures, ``dsa.LLM`` (embedded default and a transformers checkpoint) and ``dsa generate``."""
import sys
import threading
import types

import pytest
import torch

import dsa
from dsa import Engine, SamplingParams
from dsa.model.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE
from dsa.serve.tokenizer import ByteTokenizer
from model_utils import prompt, tiny_model

BYTES = dict(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID)


@pytest.fixture(scope="module")
def model():
    return tiny_model(**BYTES)


def engine_for(model, num_blocks=32, **kw):
    return Engine(model, num_blocks=num_blocks, tokenizer=ByteTokenizer(), **kw)


def p(n, seed):
    return prompt(n, seed, vocab=256)


def test_temperature_0_and_top_k_1_are_greedy(model):
    prompts = [p(20, 1), p(7, 2)]
    greedy = engine_for(model).generate(prompts, 6)
    assert engine_for(model).generate(prompts, sampling=SamplingParams(max_tokens=6, temperature=0)) == greedy
    top1 = SamplingParams(max_tokens=6, temperature=0.8, top_k=1, seed=5)
    assert engine_for(model).generate(prompts, sampling=top1) == greedy


def test_seeded_sampling_alone_and_batched(model):
    """A seeded request gives the same tokens alone, batched with others (other parameters, other
    lengths, chunked prefill), and on a second run."""
    a = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    alone = engine_for(model).generate([p(30, 3)], sampling=a)[0]
    others = [SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=9, temperature=0.7, top_k=40),
              a, SamplingParams(max_tokens=3, min_p=0.05)]
    batched = engine_for(model, max_batch_tokens=16).generate([p(11, 4), p(25, 5), p(30, 3), p(4, 6)], sampling=others)
    assert batched[2] == alone
    assert engine_for(model).generate([p(30, 3)], sampling=a)[0] == alone
    other_seed = engine_for(model).generate([p(30, 3)], sampling=SamplingParams(max_tokens=8, seed=99))[0]
    assert other_seed != alone


def test_length_limit_is_given_once(model):
    engine = engine_for(model)
    with pytest.raises(ValueError, match="max_new_tokens.*disagrees"):
        engine.add_request(p(5, 1), 4, sampling=SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="give one"):
        engine.add_request(p(5, 1))
    with pytest.raises(TypeError, match="sampling"):
        engine.add_request(p(5, 1), sampling={"max_tokens": 3})
    rid = engine.add_request(p(5, 1), 4, sampling=SamplingParams(max_tokens=4))
    assert engine.waiting[0].rid == rid and engine.waiting[0].max_new_tokens == 4
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        Engine(model, num_blocks=8).add_request(p(5, 1), sampling=SamplingParams(stop="x"))


def _stream(engine, prompts, sampling):
    texts, tokens, reasons, prefixes = {}, {}, {}, {}
    for d in engine.stream(prompts, sampling=sampling):
        texts[d.index] = texts.get(d.index, "") + d.text
        tokens.setdefault(d.index, []).extend(d.token_ids)
        prefixes.setdefault(d.index, []).append(texts[d.index])
        if d.finished:
            reasons[d.index] = d.finish_reason
    return texts, tokens, reasons, prefixes


def test_stop_strings_end_the_text_and_streaming_equals_the_final_text(model):
    prompts = [p(12, 7), p(33, 8)]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    full_text, full, _, _ = _stream(engine_for(model), prompts, greedy)
    stops = [SamplingParams(max_tokens=24, temperature=0, stop=["\x00never", full_text[0][6:9]]),  # matches
             SamplingParams(max_tokens=24, temperature=0, stop=full_text[1][10:12] + "\x00never")]  # only starts
    texts, tokens, reasons, prefixes = _stream(engine_for(model), prompts, stops)
    cut = full_text[0].find(full_text[0][6:9])
    assert texts[0] == full_text[0][:cut] and reasons[0] == "stop"
    assert tokens[0] == full[0][:len(tokens[0])] and len(tokens[0]) < 24  # stopped early, the same tokens
    assert texts[1] == full_text[1] and reasons[1] == "length" and tokens[1] == full[1]
    for i in (0, 1):  # every prefix of a stream is a prefix of the final text (the stop's tail was held back)
        assert all(texts[i].startswith(s) for s in prefixes[i])
    assert any(len(a) == len(b) for a, b in zip(prefixes[1], prefixes[1][1:]))  # held back at least once
    llm_text = [c.text for c in _llm_on(model).generate(prompts, stops)]
    assert llm_text == [texts[0], texts[1]]


def _llm_on(model):
    return dsa.LLM.from_model(model, ByteTokenizer(), num_blocks=32)


def test_stop_tokens_and_eos_finish_with_stop(model):
    base = engine_for(model).generate([p(15, 9)], 12)[0]
    stop_tok = base[4]
    first = base.index(stop_tok)
    sp = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok])
    out = _llm_on(model).generate([p(15, 9)], sp)[0]
    assert out.finish_reason == "stop" and out.token_ids == base[:first + 1]
    assert out.text == ByteTokenizer().decode(base[:first])  # the stop token's text is not in the output
    eos_model = tiny_model(**{**BYTES, "eos_token_id": stop_tok})  # the same weights, another EOS id
    engine = engine_for(eos_model)
    assert engine.generate([p(15, 9)], 12)[0] == base[:first + 1]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert engine.generate([p(15, 9)], sampling=sp)[0] == base
    assert engine.scheduler.blocks.num_free == engine.num_blocks


def test_abort_frees_blocks_of_running_and_waiting_requests(model):
    engine = engine_for(model, num_blocks=3)  # 48 tokens: a's 40-token prompt takes every block
    seen = []
    a = engine.add_request(p(40, 10), 8, on_output=seen.append)
    b = engine.add_request(p(20, 11), 8, on_output=seen.append)
    engine.step()
    assert a in engine.running and [r.rid for r in engine.waiting] == [b]
    assert engine.abort(b) and not engine.waiting and engine.scheduler.blocks.num_free == 0
    assert engine.abort(a) and not engine.running and engine.scheduler.blocks.num_free == 3
    assert engine.stats.blocks_in_use == 0
    assert not engine.abort(a) and not engine.abort(12345)
    assert [d.finish_reason for d in seen if d.request_id == b] == ["abort"]
    assert seen[-1].request_id == a and seen[-1].finish_reason == "abort"
    assert len(engine.generate([p(40, 10)], 8)[0]) == 8  # still usable


def test_leaving_a_stream_early_aborts_its_requests(model):
    engine = engine_for(model, num_blocks=8)
    stream = engine.stream([p(20, 12), p(9, 13)], sampling=SamplingParams(max_tokens=10, temperature=0))
    next(stream)
    assert engine.scheduler.blocks.num_free < 8
    stream.close()
    assert engine.scheduler.blocks.num_free == 8 and not engine.has_work()


def test_two_threads_on_one_engine(model):
    prompts = [[p(25, 14), p(6, 15)], [p(13, 16), p(31, 17), p(3, 18)]]
    sampling = SamplingParams(max_tokens=7, temperature=0.9, seed=3)
    expected = [engine_for(model).generate(ps, sampling=sampling) for ps in prompts]
    engine = engine_for(model, num_blocks=20)
    results, errors = [None, None], []

    def work(i):
        try:
            for _ in range(2):
                results[i] = engine.generate(prompts[i], sampling=sampling)
                assert results[i] == expected[i]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == expected
    assert engine.scheduler.blocks.num_free == 20 and not engine.has_work()


def test_a_failing_generate_leaves_the_pool_full(model, monkeypatch):
    engine = engine_for(model, num_blocks=10)
    with pytest.raises(ValueError, match="blocks"):  # the second prompt never fits: the first is withdrawn
        engine.generate([p(10, 19), p(200, 20)], 4)
    assert not engine.has_work() and engine.scheduler.blocks.num_free == 10
    calls = {"n": 0}
    real = engine.runner.run

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(*args)

    monkeypatch.setattr(engine.runner, "run", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([p(10, 21), p(40, 22)], 6)
    assert not engine.has_work() and engine.scheduler.blocks.num_free == 10
    assert len(engine.generate([p(10, 21)], 6)[0]) == 6


def test_default_llm_text_in_text_out(capsys):
    """The embedded default model (trained, with its BPE tokenizer), and ``dsa generate`` streaming it
    with the checkpoint's sampling defaults (generation_config.json) unless told otherwise."""
    llm = dsa.LLM(device="cpu")
    cfg = llm.model.config
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.num_hidden_layers) == (4096, 0, 1, 5)
    assert llm.generation_defaults == {"temperature": 0.7, "top_p": 0.9}
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate(["héllo"], sp)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("héllo") and out.prompt_token_ids[0] == 0  # BOS
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert llm.chat([{"role": "user", "content": "hi"}], sp)[0].prompt_token_ids[-3:] == llm.tokenizer.encode(
        "assistant:")[-3:]
    from dsa.cli import main
    assert main(["generate", "--prompt", "héllo", "--max-tokens", "4", "--device", "cpu", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out == llm.generate(["héllo"], SamplingParams(max_tokens=4, temperature=0))[0].text + "\n"
    assert "finish_reason=" in captured.err
    start = captured.err.splitlines()[0]
    assert start.startswith("dsa generate: model: embedded default (trained, 5 layers x 384") and \
        "; float32 on cpu, " in start and " CPU thread" in start, start
    assert main(["generate", "--prompt", "Once upon a time", "--max-tokens", "8", "--device", "cpu", "--seed",
                 "3"]) == 0
    sampled = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3)
    assert capsys.readouterr().out == llm.generate(["Once upon a time"], sampled)[0].text + "\n"


@pytest.mark.parametrize("text, shown", [
    ("a\nb\tc", "a\nb\tc"), ("\x07bell", "\\x07bell"), ("\x1b[31mred", "\\x1b[31mred"), ("\r\x00", "\\x0d\\x00"),
    ("\x7f\x85\x9f", "\\x7f\\x85\\x9f"), ("é🎉\ufffd\xa0", "é🎉\ufffd\xa0")],
    ids=["newline-tab", "bell", "escape", "cr-nul", "del-c1", "printable"])
def test_escape_controls(text, shown):
    from dsa.commands.generate import escape_controls
    assert escape_controls(text) == shown


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_generate_escapes_control_characters_on_a_terminal_only(monkeypatch, capsys, terminal):
    """The command shows what a stream yields escaped on a terminal, as it is elsewhere; the start
    line names a checkpoint, the dtype, the device and the threads."""
    from dsa.cli import main
    from dsa.commands import generate
    pieces = ["ok\x07", "\x1b[2J", "\n\tend"]
    fake = types.SimpleNamespace(model=types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32),
                                 cpu_threads=1, cpu_threads_reason="asked for", generation_defaults={},
                                 stream=lambda prompts, sampling: iter(dsa.Delta(0, [i], t) for i, t in enumerate(pieces)))
    monkeypatch.setattr(generate, "llm_from_args", lambda args, command: fake)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    assert main(["generate", "--prompt", "x", "--checkpoint", "some/folder"]) == 0
    out, err = capsys.readouterr()
    assert out == ("ok\\x07\\x1b[2J\n\tend\n" if terminal else "".join(pieces) + "\n"), repr(out)
    assert err.splitlines()[0] == "dsa generate: model: checkpoint some/folder; float32 on cpu, 1 CPU thread (asked for)"


def test_llm_on_a_transformers_checkpoint(text_checkpoint):
    """A random DeepseekV32ForCausalLM saved by transformers with a BPE tokenizer.json trained in the test."""
    llm = dsa.LLM(text_checkpoint, device="cpu")
    assert llm.tokenizer.bos_token_id == 0 and llm.engine.eos == {1}
    prompts = ["Hello world", "naïve café 🎉", llm.tokenizer.encode("the lazy dog")]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.prompt_token_ids for o in outs[:2]] == [llm.tokenizer.encode(t) for t in prompts[:2]]
    for o in outs:
        assert o.finish_reason in ("stop", "length") and 1 <= len(o.token_ids) <= 10
        ids = o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids
        assert o.text == llm.tokenizer.decode(ids)
    alone = llm.engine.generate([llm.tokenizer.encode("naïve café 🎉")], 10)[0]
    assert outs[1].token_ids == alone[:len(outs[1].token_ids)]
    sampled = llm.generate(prompts[:1] * 2, SamplingParams(max_tokens=6, seed=42, logprobs=2))
    assert sampled[0].token_ids == sampled[1].token_ids and len(sampled[0].logprobs) == len(sampled[0].token_ids)
    chat = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]],
                    SamplingParams(max_tokens=3, temperature=0))
    assert chat[0].prompt_token_ids == llm.tokenizer.encode("<s><|user|>hi<|assistant|>", add_special_tokens=False)
    assert len(chat) == 2
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[0, 10 ** 6]])


def test_overlapped_scheduling_gives_the_same_tokens_and_text(model):
    """Step N+1 launched before step N's tokens are read: the same tokens, text and finish reasons
    with stop tokens, stop strings, EOS, seeded sampling, logprobs and chunked prefill; no block
    stays held, and a request that stopped gets no token of the step after."""
    base = engine_for(model, overlap=False).generate([p(15, 9)], 24)[0]
    prompts = [p(40, 30), p(9, 31), p(15, 9), p(23, 32)]
    samplings = [SamplingParams(max_tokens=12, temperature=0.9, seed=7, logprobs=2),
                 SamplingParams(max_tokens=20, stop=[chr(base[3])] if base[3] < 128 else [], temperature=0),
                 SamplingParams(max_tokens=24, stop_token_ids=[base[5]], temperature=0),
                 SamplingParams(max_tokens=1, temperature=0)]
    runs = {}
    for overlap in (False, True):
        engine = engine_for(model, max_batch_tokens=24, overlap=overlap)
        runs[overlap] = [(d.index, d.token_ids, d.text, d.finish_reason, d.logprobs)
                         for d in engine.stream(prompts, sampling=samplings)]
        assert engine.stats.blocks_in_use == 0 and not engine.has_work()
    assert sorted(runs[True], key=lambda r: r[0]) == sorted(runs[False], key=lambda r: r[0])
    third = [t for i, toks, *_ in runs[True] if i == 2 for t in toks]
    assert third == base[:base.index(base[5]) + 1]  # stopped at its stop token, nothing after it
