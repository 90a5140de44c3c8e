"""A tiny random llama GGUF written with ``gguf``'s own writer, and a float64 reference forward of it.

The weights are drawn in the Hugging Face layout (Q/K heads rotate halves) and written the way
llama.cpp's converter writes them: Q and K rows permuted per head so that RoPE rotates adjacent
pairs. The reference undoes the permutation and rotates halves, so it shares no code with
``dsa.quality.teacher`` (it dequantizes with ``gguf.quants``).
"""
import numpy as np
import torch
import torch.nn.functional as F

TINY = dict(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, context=512, theta=10000.0, eps=1e-5, embed_rank=None)


def byte_vocab() -> list:
    """GPT-2's byte-to-unicode alphabet (256 tokens), the base of any byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``permute``: per head, rows ``[first half | second half]`` -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, seed: int = 0, qtypes=("Q4_1", "Q8_0"), **sizes) -> dict:
    """Write a random llama GGUF; returns its HF-layout float32 weights (before quantization).
    ``embed_rank``: token embeddings of that rank (default: full)."""
    import gguf

    s = {**TINY, **sizes}
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_vocab()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e"]
    tokens += [m.replace(" ", "") for m in merges]
    vocab = len(tokens) + (-len(tokens)) % 32
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    hd = s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    hf, n = {}, 0

    def add(name, shape, scale, qtype, perm_heads=None):
        nonlocal n
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == "token_embd.weight" and s["embed_rank"]:  # few directions: attention an indexer learns fast
            r = s["embed_rank"]
            x = (rng.standard_normal((shape[0], r)) @ rng.standard_normal((r, shape[1])) / r ** 0.5).astype(np.float32)
        if name.endswith("norm.weight"):
            x = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        hf[name] = x
        stored = permute(x, perm_heads) if perm_heads else x
        if qtype == "F32":
            w.add_tensor(name, stored)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(stored, q), raw_dtype=q)
        n += 1

    qa, qb = qtypes
    add("token_embd.weight", (vocab, s["hidden"]), 1.0, "Q8_0")
    for i in range(s["layers"]):
        add(f"blk.{i}.attn_norm.weight", (s["hidden"],), 0, "F32")
        add(f"blk.{i}.attn_q.weight", (s["heads"] * hd, s["hidden"]), 0.25, qa, s["heads"])
        add(f"blk.{i}.attn_k.weight", (s["kv_heads"] * hd, s["hidden"]), 0.25, qb, s["kv_heads"])
        add(f"blk.{i}.attn_v.weight", (s["kv_heads"] * hd, s["hidden"]), 0.2, qa)
        add(f"blk.{i}.attn_output.weight", (s["hidden"], s["heads"] * hd), 0.1, qb)
        add(f"blk.{i}.ffn_norm.weight", (s["hidden"],), 0, "F32")
        add(f"blk.{i}.ffn_gate.weight", (s["ffn"], s["hidden"]), 0.15, qa)
        add(f"blk.{i}.ffn_up.weight", (s["ffn"], s["hidden"]), 0.15, qb)
        add(f"blk.{i}.ffn_down.weight", (s["hidden"], s["ffn"]), 0.1, qa)
    add("output_norm.weight", (s["hidden"],), 0, "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"sizes": s, "vocab": vocab, "hf": hf}


def reference_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """float64 forward of a llama GGUF the Hugging Face way: gguf.quants dequantization, Q/K un-permuted,
    rotate-half RoPE, explicit softmax attention. ``[T, vocab]``."""
    import gguf

    r = gguf.GGUFReader(str(path))
    get = lambda key: r.fields[key].contents()  # noqa: E731
    L, heads, kvh = get("llama.block_count"), get("llama.attention.head_count"), get("llama.attention.head_count_kv")
    theta, eps = get("llama.rope.freq_base"), get("llama.attention.layer_norm_rms_epsilon")
    w = {}
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape.tolist())])
        if t.name.endswith("attn_q.weight"):
            x = unpermute(x, heads)
        if t.name.endswith("attn_k.weight"):
            x = unpermute(x, kvh)
        w[t.name] = torch.from_numpy(np.array(x, dtype=np.float64))
    t_len = ids.numel()
    hidden = w["token_embd.weight"].shape[1]
    hd = hidden // heads
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(t_len, dtype=torch.float64), inv)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]

    def rot(x):
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat((-b, a), -1) * sin

    def norm(x, g):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    h = w["token_embd.weight"][ids]
    mask = torch.ones(t_len, t_len, dtype=torch.bool).tril()
    for i in range(L):
        x = norm(h, w[f"blk.{i}.attn_norm.weight"])
        q = rot((x @ w[f"blk.{i}.attn_q.weight"].T).view(t_len, heads, hd))
        k = rot((x @ w[f"blk.{i}.attn_k.weight"].T).view(t_len, kvh, hd)).repeat_interleave(heads // kvh, 1)
        v = (x @ w[f"blk.{i}.attn_v.weight"].T).view(t_len, kvh, hd).repeat_interleave(heads // kvh, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        h = h + torch.einsum("hqk,khd->qhd", p, v).reshape(t_len, hidden) @ w[f"blk.{i}.attn_output.weight"].T
        x = norm(h, w[f"blk.{i}.ffn_norm.weight"])
        h = h + (F.silu(x @ w[f"blk.{i}.ffn_gate.weight"].T) * (x @ w[f"blk.{i}.ffn_up.weight"].T)) @ \
            w[f"blk.{i}.ffn_down.weight"].T
    return norm(h, w["output_norm.weight"]) @ w["token_embd.weight"].T
