"""DSAModel: embeddings, decoder layers (DSA attention + dense MLP or MoE), final norm, lm_head.

A step runs the rows of a :class:`dsa.model.plan.BatchPlan` through every layer with a
:class:`StepContext` (the plan, the caches, the RoPE tables, and the selection the last indexer
layer made, which layers that skip the indexer reuse). Caches live outside the model
(:class:`Caches`), so several engines can share one model and ``model(input_ids)`` uses its own.
"""
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsa.cache import IndexerKeyCache, LatentCache
from dsa.config import DSAConfig, latent_format
from dsa.indexer import Selection
from dsa.kernels import rope_at, yarn_cos_sin
from dsa.kernels.common import cdiv, check_int
from dsa.model.decoder import DecoderLayer
from dsa.model.dispatch import load_dispatch
from dsa.model.layers import RMSNorm
from dsa.model.loading import match_state_dict, read_pretrained
from dsa.model.mtp import MTPLayer, mtp_layer_shape
from dsa.model.parallel import TensorParallel, init_tensor_parallel
from dsa.model.plan import BatchPlan, PlanOptions
from dsa.model.route import gemm_rows

log = logging.getLogger("dsa.model")
FP32_PARAMS = (".mlp.gate.", ".indexer.weights_proj.", ".indexer.k_norm.")  # the router, the indexer's head
# weights and key norm stay fp32 (their math is fp32: no cast a step)


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if any(part in name for part in FP32_PARAMS) else dtype


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Module constructors without torch's random init, for modules built on the meta device (no data to
    fill: their weights are assigned right after). The init would do nothing there but cost: a meta
    ``normal_`` runs torch's reference op, whose wrapper imports torch._dynamo (~1.5 s, once a process;
    every ``dsa serve`` paid it). A mode, not a patch of ``torch.nn.init``: other threads are untouched."""

    SKIPPED = (nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.constant_)  # those that dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@dataclass
class Caches:
    """One engine's paged caches: per layer a latent cache and (layers that index) an indexer key
    cache, all sharing one block numbering."""
    latent: list  # LatentCache per layer
    index: list  # IndexerKeyCache or None per layer
    num_blocks: int

    def __iter__(self):
        return iter(zip(self.latent, self.index))


@dataclass
class StepContext:
    """What every layer of one step reads: the plan, the caches, the rows' RoPE rotations
    ``[T, D_R / 2]`` complex (computed once per step); ``selection`` is the top-k of the last layer
    that ran its indexer."""
    plan: BatchPlan
    caches: Caches
    rope: torch.Tensor
    selection: Selection | None = None


class DSAModel(nn.Module):
    """A DeepSeek-V3.2 / GLM-MoE-DSA / DeepSeek-V3 causal LM over paged caches.

    ``model(input_ids [B, S]) -> logits [B, S, vocab]`` (fp32) runs full sequences with
    temporary caches; the :class:`dsa.Engine` drives :meth:`step` over persistent ones.
    """

    def __init__(self, config: DSAConfig, mha_workspace_bytes: int = 256 << 20, tp: TensorParallel = TensorParallel(),
                 mtp_shape: tuple | None = None):
        super().__init__()
        self.config = config
        self.tp = tp
        self.mha_workspace_bytes = mha_workspace_bytes
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the MTP module (dsa.model.mtp), registered last so that the main model's random weights do not
        # depend on it; mtp_shape: (runs_indexer, moe) as the checkpoint has it (None: the config's)
        self.mtp = MTPLayer(config, tp, *(mtp_shape or (None, None))) if config.num_nextn_predict_layers else None
        self._rope = None
        self._retired_rope = []  # tables a longer max_model_len replaced (a captured graph may still read them)
        self.checkpoint = None  # the folder the weights came from (None: random weights)
        self.trained_positions = trained_positions(config)  # the RoPE's trained range

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def random(cls, config: DSAConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               device=None, tp_size: int = 1, tp_check: bool = False) -> "DSAModel":
        """Random weights drawn on the target device from ``seed``: normal(0, 0.02) for matrices and
        embeddings, norms at 1, zero biases and router bias (HF's init). With ``tp_size > 1`` (one
        process per rank, see :mod:`dsa.model.parallel`) every rank draws the whole model and keeps its
        shard, so the weights do not depend on the rank count; ``tp_check`` compares every layer's
        selection across the ranks each step (a debug check)."""
        device = _default_device(device)
        tp = init_tensor_parallel(tp_size, check_selection=tp_check)
        if tp.size > 1:
            full = cls.random(config, seed, dtype, device)
            with torch.device("meta"), _SkipInit():
                model = cls(config, tp=tp)
            model.load_state_dict(shard_state_dict(full.state_dict(), model, tp), strict=True, assign=True)
            return model.finalize(dtype, device)
        with torch.device(device):
            model = cls(config)
        init_random_(model, torch.Generator(device=device).manual_seed(seed))
        return model.finalize(dtype, device)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.bfloat16, device=None, tp_size: int = 1,
                        tp_check: bool = False, **overrides) -> "DSAModel":
        """Load a HF checkpoint folder (``config.json`` + safetensors). :mod:`dsa.model.loading` reads and checks
        the config and tensors (errors name the file and tensor); the model is built here. With
        ``tp_size > 1`` (one process per rank, see :mod:`dsa.model.parallel`) each rank reads only its shard."""
        tp = init_tensor_parallel(tp_size, check_selection=tp_check)
        config, tensors = read_pretrained(path, overrides, tp)
        shape = mtp_layer_shape(config, tensors) if config.num_nextn_predict_layers else None
        with torch.device("meta"), _SkipInit():
            model = cls(config, tp=tp, mtp_shape=shape)
        state = match_state_dict(tensors, {k: v.shape for k, v in model.state_dict().items()}, path)
        model.load_state_dict({k: t.to(param_dtype(k, dtype)) for k, t in state.items()}, strict=True, assign=True)
        model.checkpoint = os.fspath(path)
        return model.finalize(dtype, _default_device(device))

    def finalize(self, dtype: torch.dtype, device) -> "DSAModel":
        """Cast, move, absorb ``kv_b_proj``, pick the dispatch thresholds; call once after loading."""
        for name, p in self.named_parameters():
            p.data = p.data.to(device=device, dtype=param_dtype(name, dtype))
        for layer in self.all_layers():
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

    def all_layers(self) -> list:
        """The decoder layers, then the MTP module's (when the model has one)."""
        return list(self.layers) + ([self.mtp] if self.mtp is not None else [])

    def allocate_caches(self, num_blocks: int, mtp: bool = False) -> Caches:
        """Per layer a ``LatentCache`` and (layers that index) an ``IndexerKeyCache`` of ``num_blocks``;
        with ``mtp`` the MTP module's layer too (entry ``num_hidden_layers``: an engine that speculates)."""
        if mtp and self.mtp is None:
            raise ValueError("mtp: the model has no MTP module (num_nextn_predict_layers = 0)")
        c, latent, index = self.config, [], []
        for layer in self.all_layers() if mtp else self.layers:
            latent.append(LatentCache(num_blocks, c.block_size, format=self.latent_format(), device=self.device))
            exact = c.indexer_precision == "exact"
            index.append(IndexerKeyCache(num_blocks, c.block_size, precision=c.indexer_precision,
                                         dtype=self.dtype if exact else None, device=self.device,
                                         head_dim=c.index_head_dim) if layer.self_attn.runs_indexer else None)
        return Caches(latent, index, num_blocks)

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [max_position_embeddings, D_R / 2]`` fp32, built once: a CUDA graph keeps
        their addresses."""
        if self._rope is None:
            c = self.config
            cos, sin = yarn_cos_sin(c.max_position_embeddings, c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
            self._rope = (cos.to(self.device), sin.to(self.device))
        return self._rope

    def set_max_model_len(self, max_model_len: int) -> None:
        """Make room for requests of ``max_model_len`` tokens: within ``max_position_embeddings``
        nothing changes (an engine limits itself); past it, random weights get the config's
        ``max_position_embeddings`` raised to it (and their RoPE tables rebuilt), with one warning
        when it is past the RoPE's trained range (:func:`trained_positions`), and a checkpoint's
        weights refuse it: ValueError naming ``max_model_len`` and the limit."""
        n = check_int("max_model_len", max_model_len, minimum=1)
        c = self.config
        if n <= c.max_position_embeddings:
            return
        if self.checkpoint is not None:
            raise ValueError(f"max_model_len: {n} tokens is more than this checkpoint allows, max_position_embeddings "
                             f"{c.max_position_embeddings} in {os.path.join(self.checkpoint, 'config.json')}; "
                             f"give at most {c.max_position_embeddings}")
        if n > self.trained_positions:
            log.warning("max_model_len: %d tokens is past the RoPE's trained range of %d positions (%s): the "
                        "positions past it are extrapolated (random weights: speed runs only)", n,
                        self.trained_positions, _rope_range(c))
        self.config = c.replace(max_position_embeddings=n)
        if self._rope is not None:
            self._retired_rope.append(self._rope)
            self._rope = None

    def rope_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Per-token RoPE rotations ``[T, D_R / 2]`` complex for ``positions [T]``."""
        return rope_at(positions, *self.rope_tables())

    def plan_options(self) -> PlanOptions:
        """The model's :class:`PlanOptions` for :meth:`BatchPlan.build` / ``HostPlan.pack``."""
        c = self.config
        kv_bytes = (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim + 2 * c.qk_head_dim)
                    * self.embed_tokens.weight.element_size())  # up-projected K/V per context token (MHA path)
        return PlanOptions(index_topk=c.index_topk, dispatch=self.dispatch, mha_kv_bytes_per_token=kv_bytes)

    def plan(self, query_lens, context_lens, block_tables, input_ids=None, staging=None) -> BatchPlan:
        """:meth:`BatchPlan.build` with the model's block size, device and options (``staging``: a
        :class:`~dsa.engine.staging.PinnedBuffers` of int32 for the upload, as an engine's runner holds)."""
        return BatchPlan.build(query_lens, context_lens, block_tables, self.config.block_size, self.device,
                               options=self.plan_options(), input_ids=input_ids, staging=staging)

    # ---- running -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, plan: BatchPlan, caches: Caches, input_ids: torch.Tensor | None = None,
             logits_rows: torch.Tensor | None = None, return_hidden: bool = False):
        """Run the plan's rows through every layer, writing the caches; no host sync. A step that does
        not only decode runs its GEMMs over its rows padded to :data:`~dsa.model.route.GEMM_ROW_ALIGN`
        (:func:`~dsa.model.route.gemm_rows`): the padding rows (token 0) read and write no cache and
        reach no output.

        Args:
            plan: the step; caches: the engine's (or temporary) caches.
            input_ids: ``[T]`` token ids (default: ``plan.input_ids``).
            logits_rows: rows whose logits to return (default: every row).
            return_hidden: also return every row's hidden state after the final norm (the MTP
                module's input).

        Returns:
            ``[R, vocab]`` fp32 logits; with ``return_hidden``, ``(logits, hidden [T, hidden])``.
        """
        step = StepContext(plan, caches, self.rope_at(plan.positions))
        ids = plan.input_ids if input_ids is None else input_ids.to(self.device)
        t = plan.num_tokens
        pad = gemm_rows(t, plan.route.decode_only) - t
        x = self.embed_tokens(F.pad(ids, (0, pad)) if pad else ids)  # padding rows: token 0
        for layer in self.layers:
            x = layer(x, step)
        h = self.norm(x[:t])
        logits = self.lm_head(h if logits_rows is None else h[logits_rows]).float()
        return (logits, h) if return_hidden else logits

    @torch.no_grad()
    def mtp_step(self, plan: BatchPlan, caches: Caches, next_ids: torch.Tensor, hidden: torch.Tensor,
                 logits_rows: torch.Tensor | None = None) -> tuple:
        """Run the plan's rows through the MTP module (:mod:`dsa.model.mtp`), writing its layer's
        caches (``caches`` from ``allocate_caches(..., mtp=True)``); no host sync.

        Args:
            plan: the rows (their positions and slots); next_ids: ``[T]`` the token after each row's;
            hidden: ``[T, hidden]`` each row's main-model hidden state after the final norm (or the
                module's own output, chaining drafts); logits_rows: rows whose logits to return.

        Returns:
            ``(logits [R, vocab] fp32, out [T, hidden])``: ``out`` before ``shared_head.norm``, the
            hidden state of the next draft.
        """
        if self.mtp is None:
            raise ValueError("model: it has no MTP module (num_nextn_predict_layers = 0)")
        step = StepContext(plan, caches, self.rope_at(plan.positions))
        t = plan.num_tokens
        pad = gemm_rows(t, plan.route.decode_only) - t
        next_ids, hidden = next_ids.to(self.device), hidden.to(self.dtype)
        if pad:
            next_ids, hidden = F.pad(next_ids, (0, pad)), F.pad(hidden, (0, 0, 0, pad))
        x = self.mtp.project(self.embed_tokens(next_ids), hidden)
        y = self.mtp(x, step)[:t]
        rows = y if logits_rows is None else y[logits_rows]
        return self.lm_head(self.mtp.shared_head.norm(rows)).float(), y

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, S]`` -> fp32 ``logits [B, S, vocab]``, full sequences, temporary caches."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, S], got {list(input_ids.shape)}")
        b, s = input_ids.shape
        if b * s == 0:
            return torch.zeros(b, s, self.config.vocab_size, device=self.device)
        per = cdiv(s, self.config.block_size)
        caches = self.allocate_caches(b * per)
        table = torch.arange(b * per, dtype=torch.int32).view(b, per)
        plan = self.plan([s] * b, [0] * b, table, input_ids=input_ids.reshape(-1))
        return self.step(plan, caches).view(b, s, -1)


@torch.no_grad()
def init_random_(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """HF's init in place: normal(0, 0.02) for matrices and embeddings, norms at 1, zero biases."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, 0.02, generator=generator)
        else:
            p.zero_()
    return module


def shard_state_dict(full: dict, model: "DSAModel", tp: TensorParallel) -> dict:
    """The tensors of ``full`` (an unsharded state dict) that ``model`` (built with ``tp``) holds,
    sliced to this rank's shard."""
    out = {}
    for name in model.state_dict():
        index = tp.shard(name, tuple(full[name].shape), model.config)
        out[name] = full[name] if index is None else full[name][index].contiguous()
    return out


def trained_positions(config: DSAConfig) -> int:
    """The positions a config's RoPE covers as trained: YaRN's ``factor`` x
    ``original_max_position_embeddings`` (163,840 for V3.2), else ``max_position_embeddings``."""
    rope = config.rope_scaling or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        return int(rope["factor"] * rope["original_max_position_embeddings"])
    return config.max_position_embeddings


def _rope_range(config: DSAConfig) -> str:
    rope = config.rope_scaling or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        return (f"YaRN factor {rope['factor']:g} x original_max_position_embeddings "
                f"{rope['original_max_position_embeddings']}")
    return f"max_position_embeddings {config.max_position_embeddings}"


def _default_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
