"""``python -m dsa demo`` end to end on the CPU default model, with a short context past index_topk."""
import json

import torch

from dsa.cli import main


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
    """The trained default: held-out text in, greedy continuation out (the prompt's end and the text)."""
    out = tmp_path / "demo.json"
    assert main(["demo", "--context", "600", "--new-tokens", "4", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "device cpu: 5 layers, hidden 384" in text and "continuation (greedy): " in text
    result = json.loads(out.read_text())
    assert result["context"] == 600 and result["model"]["index_topk"] == 512
    assert result["rows"]["sparse_prefill"] == 600 - 512 and result["rows"]["sparse_decode"] == 3
    assert isinstance(result["continuation"], str) and result["continuation"].strip()
