"""The GGUF teacher: GGML dequantization, a tiny random llama GGUF against float references, chunked attention."""
import math

import numpy as np
import pytest
import torch

from dsa.quality.ggml import dequantize
from dsa.quality.teacher import LlamaTeacher, attention_probs, selection_mask
from quality_utils import reference_logits, write_tiny_gguf

gguf = pytest.importorskip("gguf")  # the test extra has it; a bare GPU box may not


@pytest.mark.parametrize("rows", [1, 7], ids=["1row", "7rows"])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_dequantize_matches_gguf(qtype, rows):
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 96)) * 3 + 0.5).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    t = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(x, t)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, t), dtype=np.float32).reshape(rows, 96))
    got = dequantize(torch.from_numpy(np.array(data)), qtype, (rows, 96))
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    diff = (got - want).abs().max().item()
    assert torch.equal(got, want), f"{qtype}: max abs difference {diff}"


def test_dequantize_rejects_bad_input():
    with pytest.raises(ValueError, match="qtype"):
        dequantize(torch.zeros(34, dtype=torch.uint8), "Q5_K", (1, 32))
    with pytest.raises(ValueError, match="raw"):
        dequantize(torch.zeros(33, dtype=torch.uint8), "Q8_0", (1, 32))
    with pytest.raises(ValueError, match="shape"):
        dequantize(torch.zeros(34, dtype=torch.uint8), "Q8_0", (2, 16))


@pytest.fixture(scope="module", params=[("Q4_1", "Q8_0"), ("Q8_0", "Q4_1")], ids=["q-Q4_1", "q-Q8_0"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    info = write_tiny_gguf(path, seed=3, qtypes=request.param)
    return path, info


def test_tiny_gguf_matches_float_reference(tiny):
    """Permuted Q/K + adjacent-pair RoPE (ours) == un-permuted Q/K + rotate-half (the HF way), float64."""
    path, info = tiny
    teacher = LlamaTeacher.from_gguf(str(path), device="cpu")
    assert teacher.config.num_layers == 2 and teacher.config.num_kv_heads == 2
    ids = torch.randint(0, info["vocab"], (77,), generator=torch.Generator().manual_seed(0))
    got, want = teacher.logits(ids).double(), reference_logits(path, ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"max abs error / max abs logit = {err:.2e}"
    loss = torch.nn.functional.cross_entropy(want[:-1], ids[1:])
    assert teacher.loss(ids).mean().item() == pytest.approx(loss.item(), rel=1e-5)


def test_tiny_gguf_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip(f"transformers {transformers.__version__} < 5.24")
    path, info = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    ids = torch.randint(0, info["vocab"], (50,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    got = LlamaTeacher.from_gguf(str(path), device="cpu").logits(ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"max abs error / max abs logit = {err:.2e}"


def test_truncated_teacher(tiny):
    path, info = tiny
    full = LlamaTeacher.from_gguf(str(path), device="cpu")
    one = LlamaTeacher.from_gguf(str(path), device="cpu", num_layers=1)
    ids = torch.randint(0, info["vocab"], (20,))
    assert torch.equal(one.hidden(ids), full.hidden(ids, layers=1))
    with pytest.raises(ValueError, match="fewer blocks"):
        one.loss(ids)
    with pytest.raises(ValueError, match="num_layers"):
        LlamaTeacher.from_gguf(str(path), device="cpu", num_layers=3)


def test_tokenizer_splits_digits(tiny):
    teacher = LlamaTeacher.from_gguf(str(tiny[0]), device="cpu")
    enc = teacher.tokenizer.encode("key 40213<|endoftext|>")
    assert enc.tokens[-6:] == ["4", "0", "2", "1", "3", "<|endoftext|>"]
    assert teacher.tokenizer.decode(teacher.encode("the pass key")) == "the pass key"


@pytest.mark.parametrize("chunk", [1, 4, 64], ids=["chunk1", "chunk4", "chunk64"])
def test_attention_probs_is_the_head_mean_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    t, h, kvh, d = 37, 6, 2, 16
    q, k = torch.randn(t, h, d, generator=g), torch.randn(t, kvh, d, generator=g)
    queries = torch.tensor([0, 5, 17, 36])
    got = attention_probs(q, k, queries, chunk=chunk)
    kk = k.repeat_interleave(h // kvh, dim=1)
    for j, p in enumerate(queries.tolist()):
        s = torch.einsum("hd,shd->hs", q[p].double(), kk[:p + 1].double()) / math.sqrt(d)
        want = torch.softmax(s, dim=-1).mean(0)
        assert torch.allclose(got[j, :p + 1].double(), want, atol=1e-6)
        assert got[j, p + 1:].abs().sum().item() == 0.0
    assert torch.allclose(got.sum(1), torch.ones(len(queries)), atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3], ids=["chunk1", "chunk3"])
def test_attention_probs_on_an_allowed_set_is_each_heads_softmax_there(chunk):
    """The sparse model's attention: every head's softmax over its row's allowed keys, then the head mean
    (not the dense head mean renormalized over the set)."""
    g = torch.Generator().manual_seed(1)
    t, h, kvh, d = 23, 6, 3, 8
    q, k = torch.randn(t, h, d, generator=g), torch.randn(t, kvh, d, generator=g)
    queries = torch.tensor([2, 9, 22])
    allowed = torch.rand(3, t, generator=g) < 0.4
    allowed[torch.arange(3), queries] = True  # each row keeps its own position
    allowed[1, 15:] = True  # past the query: still hidden by the causal mask
    got = attention_probs(q, k, queries, chunk=chunk, allowed=allowed)
    kk = k.repeat_interleave(h // kvh, dim=1)
    for j, p in enumerate(queries.tolist()):
        keep = torch.nonzero(allowed[j, :p + 1]).flatten()
        s = torch.einsum("hd,shd->hs", q[p].double(), kk[keep].double()) / math.sqrt(d)
        want = torch.zeros(t, dtype=torch.float64)
        want[keep] = torch.softmax(s, dim=-1).mean(0)
        assert torch.allclose(got[j].double(), want, atol=1e-6), f"row {p}: max error {(got[j] - want).abs().max()}"
    dense = attention_probs(q, k, queries)
    assert not torch.allclose(got, dense * allowed / (dense * allowed).sum(1, keepdim=True), atol=1e-4)


def test_attending_to_every_position_is_dense(tiny):
    teacher = LlamaTeacher.from_gguf(str(tiny[0]), device="cpu")
    ids = torch.randint(0, tiny[1]["vocab"], (29,))
    t = ids.numel()
    everything = torch.where(torch.arange(t)[None, :] <= torch.arange(t)[:, None], torch.arange(t)[None, :], -1)
    everything = torch.cat((everything, torch.full((t, 3), -1)), dim=1).to(torch.int32)
    assert selection_mask(everything, t).equal(torch.ones(t, t, dtype=torch.bool).tril())
    dense, sparse = teacher.logits(ids), teacher.logits(ids, select=lambda *a: everything)
    assert torch.allclose(dense, sparse, atol=1e-5)
    only_self = torch.arange(t, dtype=torch.int32)[:, None]  # a real restriction changes the output
    assert not torch.allclose(dense, teacher.logits(ids, select=lambda *a: only_self), atol=1e-3)
