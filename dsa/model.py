"""DSAModel: embeddings, decoder layers (DSA attention + dense MLP or MoE), final norm, lm_head."""
import torch
from torch import nn

from dsa.cache import IndexerKeyCache, LatentCache
from dsa.kernels import yarn_cos_sin

from .attention import DSAAttention
from .config import DSAConfig, latent_format
from .dispatch import load_dispatch
from .layers import MLP, MoE, RMSNorm, is_moe_layer
from .loading import match_state_dict, read_pretrained
from .plan import BatchPlan

FP32_PARAMS = (".mlp.gate.", ".indexer.weights_proj.")  # the router and the indexer head weights stay fp32


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if any(part in name for part in FP32_PARAMS) else dtype


class DecoderLayer(nn.Module):
    def __init__(self, config: DSAConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DSAAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if is_moe_layer(config, layer_id) else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, plan, caches, cos, sin, reused, stats):
        h, selected = self.self_attn(self.input_layernorm(x), plan, *caches, cos, sin, reused, stats)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), selected


class DSAModel(nn.Module):
    """A DeepSeek-V3.2 / GLM-MoE-DSA / DeepSeek-V3 causal LM over paged caches.

    ``model(input_ids [B, S]) -> logits [B, S, vocab]`` (fp32) runs full sequences with
    temporary caches; the :class:`dsa.Engine` drives :meth:`step` over persistent ones.
    """

    def __init__(self, config: DSAConfig, mha_workspace_bytes: int = 256 << 20):
        super().__init__()
        self.config = config
        self.mha_workspace_bytes = mha_workspace_bytes
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope = None

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def random(cls, config: DSAConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               device=None) -> "DSAModel":
        """Random weights drawn on the target device from ``seed``: normal(0, 0.02) for matrices and
        embeddings, norms at 1, zero biases and router bias (HF's init)."""
        device = _default_device(device)
        with torch.device(device):
            model = cls(config)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=g)
                else:
                    p.zero_()
        return model.finalize(dtype, device)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.bfloat16, device=None, **overrides) -> "DSAModel":
        """Load a HF checkpoint folder (``config.json`` + safetensors). :mod:`dsa.loading` reads and checks
        the config and tensors (errors name the file and tensor); the model is built here."""
        config, tensors = read_pretrained(path, overrides)
        with torch.device("meta"):
            model = cls(config)
        state = match_state_dict(tensors, {k: v.shape for k, v in model.state_dict().items()}, path)
        model.load_state_dict({k: t.to(param_dtype(k, dtype)) for k, t in state.items()}, strict=True, assign=True)
        return model.finalize(dtype, _default_device(device))

    def finalize(self, dtype: torch.dtype, device) -> "DSAModel":
        """Cast, move, absorb ``kv_b_proj``, pick the dispatch thresholds; call once after loading."""
        for name, p in self.named_parameters():
            p.data = p.data.to(device=device, dtype=param_dtype(name, dtype))
        for layer in self.layers:
            layer.self_attn.absorb()
        self.eval().requires_grad_(False)
        self.dispatch = load_dispatch(self.config, torch.device(device), self.mha_workspace_bytes)
        return self

    # ---- properties ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def latent_format(self) -> str:
        return latent_format(self.config, self.dtype)

    def allocate_caches(self, num_blocks: int) -> list:
        """One ``(LatentCache, IndexerKeyCache | None)`` per layer, all sharing one block numbering."""
        c, caches = self.config, []
        for layer in self.layers:
            latent = LatentCache(num_blocks, c.block_size, format=self.latent_format(), device=self.device)
            index = None
            if layer.self_attn.runs_indexer:
                exact = c.indexer_precision == "exact"
                index = IndexerKeyCache(num_blocks, c.block_size, precision=c.indexer_precision,
                                        dtype=self.dtype if exact else None, device=self.device,
                                        head_dim=c.index_head_dim)
            caches.append((latent, index))
        return caches

    def rope_tables(self, positions_needed: int):
        c = self.config
        if self._rope is None or self._rope[0].shape[0] < positions_needed:
            n = max(positions_needed, min(c.max_position_embeddings, 4096))
            cos, sin = yarn_cos_sin(n, c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
            self._rope = (cos.to(self.device), sin.to(self.device))
        return self._rope

    def plan(self, query_lens, context_lens, block_tables) -> BatchPlan:
        c = self.config
        kv_bytes = (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim + 2 * c.qk_head_dim)
                    * self.embed_tokens.weight.element_size())  # up-projected K/V per context token (MHA path)
        return BatchPlan.build(query_lens, context_lens, block_tables, c.block_size, self.device,
                               index_topk=c.index_topk, dispatch=self.dispatch, mha_kv_bytes_per_token=kv_bytes)

    # ---- running -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, plan: BatchPlan, caches: list, logits_rows: torch.Tensor | None = None,
             stats: dict | None = None) -> torch.Tensor:
        """Run the plan's rows (``input_ids [T]``) through every layer, writing the caches.

        Returns fp32 logits of ``logits_rows`` (all rows when None) ``[R, vocab]``.
        """
        stats = {} if stats is None else stats
        cos, sin = self.rope_tables(int(plan.seq_lens.max()))
        x = self.embed_tokens(input_ids.to(self.device))
        selected = None
        for layer, cache in zip(self.layers, caches):
            x, selected = layer(x, plan, cache, cos, sin, selected, stats)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.lm_head(self.norm(x)).float()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, S]`` -> fp32 ``logits [B, S, vocab]``, full sequences, temporary caches."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, S], got {list(input_ids.shape)}")
        b, s = input_ids.shape
        per = -(-s // self.config.block_size)
        caches = self.allocate_caches(b * per)
        table = torch.arange(b * per, dtype=torch.int32).view(b, per)
        plan = self.plan([s] * b, [0] * b, table)
        return self.step(input_ids.reshape(-1), plan, caches).view(b, s, -1)


def _default_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
