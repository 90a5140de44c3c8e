"""``python -m dsa demo`` end to end on the CPU default model, with a short context past index_topk."""
import argparse
import json

import pytest
import torch

from dsa.cli import main
from dsa.commands.demo import demo_context


def test_demo_runs_sparse_and_writes_json(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "--preset", "demo-cpu", "--context", "530", "--new-tokens", "3", "--device", "cpu", "--json",
                 str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "prefill: 100%" in captured.err and "decode: 100%" in captured.err  # one bar per phase
    assert "tokens/s" in text and "cache bytes per token" in text and "layers running the indexer: 2 of 2" in text
    result = json.loads(out.read_text())
    assert result["rows"]["sparse_prefill"] == 530 - 512 and result["rows"]["sparse_decode"] == 2
    assert result["cache_bytes_per_token_dsa"] == 2 * 2304 + 2 * 132
    assert result["cache_bytes_per_token_dense_mla"] == 2 * 2304
    assert result["max_batch_tokens"] == 128 and result["prefill_chunks"] == 5  # the bar moves per chunk
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["cpu_threads"] == torch.get_num_threads() and f", {result['cpu_threads']} CPU thread" in text


def test_demo_on_the_embedded_default_prints_its_continuation(tmp_path, capsys):
    """The trained default: held-out text in, a continuation at its sampling defaults out (the prompt's end
    and the text)."""
    out = tmp_path / "demo.json"
    assert main(["demo", "--context", "600", "--new-tokens", "4", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "device cpu: 5 layers, hidden 384" in text and "continuation (temperature 0.7, top_p 0.9, seed 0): " in text
    result = json.loads(out.read_text())
    assert result["context"] == 600 and result["model"]["index_topk"] == 512
    assert result["rows"]["sparse_prefill"] == 600 - 512 and result["rows"]["sparse_decode"] == 3
    assert isinstance(result["continuation"], str) and result["continuation"].strip()
    assert result["sampling"] == {"temperature": 0.7, "top_p": 0.9, "seed": 0}


@pytest.mark.parametrize("checkpoint, device, context, new, max_pos, want", [
    (None, "cuda", None, 32, 16384, 16352),  # the embedded default on a GPU: 16K minus the new tokens
    ("ckpt", "cuda", None, 32, 16384, 16352),  # a checkpoint's 32K default, cut to what its positions leave
    ("ckpt", "cuda", None, 32, 163840, 32768),
    ("ckpt", "cpu", None, 7, 1000, 993),
    (None, "cpu", None, 32, 16384, 4096),
    (None, "cpu", 16352, 32, 16384, 16352),  # exactly full
], ids=["default-gpu", "ckpt-gpu-capped", "ckpt-gpu", "ckpt-cpu-capped", "default-cpu", "given-full"])
def test_demo_context_stays_within_the_models_positions(checkpoint, device, context, new, max_pos, want):
    args = argparse.Namespace(checkpoint=checkpoint, preset=None, context=context, new_tokens=new)
    assert demo_context(args, torch.device(device), max_pos) == want


@pytest.mark.parametrize("context, new, match", [
    (16353, 32, r"--context: 16353 \+ --new-tokens 32 exceed the model's max_position_embeddings 16384$"),
    (None, 16384, "--new-tokens: 16384 leave no prompt"),
], ids=["context-too-long", "no-room"])
def test_demo_context_past_the_models_positions_is_one_line(context, new, match):
    args = argparse.Namespace(checkpoint="ckpt", preset=None, context=context, new_tokens=new)
    with pytest.raises(SystemExit, match=match):
        demo_context(args, torch.device("cpu"), 16384)


def test_demo_refuses_a_context_past_the_default_models_positions():
    with pytest.raises(SystemExit, match="max_position_embeddings 16384$"):
        main(["demo", "--context", "16380", "--new-tokens", "8", "--device", "cpu"])
