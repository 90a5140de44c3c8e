"""The non-attention blocks of a DeepSeek-V3-style model in plain torch: RMSNorm, SwiGLU MLP, MoE."""
import torch
import torch.nn.functional as F
from torch import nn

from dsa.config import DSAConfig
from dsa.kernels import rms_norm, silu_mul
from dsa.model.parallel import TensorParallel


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``, normalized in fp32 and cast back before the weight (HF semantics):
    :func:`dsa.kernels.rms_norm`, one kernel a call on CUDA bf16 rows."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The normed rows of ``x``; with ``residual``, ``(normed x + residual, x + residual)`` (one launch)."""
        return rms_norm(x, self.weight, self.eps, residual=residual)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``. Under tensor parallelism (``tp``) this rank holds
    ``intermediate / tp`` rows of gate and up and the matching columns of down; with ``reduce`` the
    partial outputs are summed over the ranks here (MoE sums its parts once, itself)."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = TensorParallel(), reduce: bool = True):
        super().__init__()
        part = tp.split(intermediate, "intermediate_size")
        self.gate_proj = nn.Linear(hidden, part.stop - part.start, bias=False)
        self.up_proj = nn.Linear(hidden, part.stop - part.start, bias=False)
        self.down_proj = nn.Linear(part.stop - part.start, hidden, bias=False)
        self.tp = tp if reduce else TensorParallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x))))


class MoEGate(nn.Module):
    """DeepSeek router: sigmoid scores, ``e_score_correction_bias`` for the choice, group-limited top-k."""

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, 1)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(c.n_routed_experts // c.n_group, 1),
                                        float("-inf"))
        idx = choice.topk(c.num_experts_per_tok, dim=-1).indices  # [T, k]
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * c.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts (SwiGLU each) weighted by the gate, plus the shared experts. Under tensor
    parallelism a rank holds the experts ``e % tp == rank`` (the router is replicated) and its share
    of the shared experts; the parts are summed over the ranks once. The expert loop reads the
    routing on the host, so MoE models run eagerly (no CUDA graphs)."""

    def __init__(self, config: DSAConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.gate = MoEGate(config)
        self.experts = nn.ModuleDict({str(e): MLP(config.hidden_size, config.moe_intermediate_size, reduce=False)
                                      for e in range(config.n_routed_experts) if tp.owns_expert(e)})
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, tp,
                                   reduce=False) if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)  # [T, k], [T, k] fp32
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            if str(e) not in self.experts:
                continue  # another rank's expert
            token, slot = torch.nonzero(idx == e, as_tuple=True)
            y = self.experts[str(e)](x[token]) * w[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


def is_moe_layer(config: DSAConfig, layer_id: int) -> bool:
    return (config.n_routed_experts is not None and layer_id >= config.first_k_dense_replace
            and layer_id % config.moe_layer_freq == 0)
