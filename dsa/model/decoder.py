"""DecoderLayer: pre-norm DSA attention and a dense MLP or MoE, the block of the model and of its MTP module."""
import torch
from torch import nn

from dsa.config import DSAConfig
from dsa.model.attention import DSAAttention
from dsa.model.layers import MLP, MoE, RMSNorm, is_moe_layer
from dsa.model.parallel import TensorParallel


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (or MoE). ``runs_indexer`` / ``moe``: given for a layer past
    ``num_hidden_layers`` (the MTP module's), whose shape the checkpoint decides; else from the config."""

    def __init__(self, config: DSAConfig, layer_id: int, tp: TensorParallel = TensorParallel(),
                 runs_indexer: bool | None = None, moe: bool | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DSAAttention(config, layer_id, tp, runs_indexer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = is_moe_layer(config, layer_id) if moe is None else moe
        self.mlp = MoE(config, tp) if moe else MLP(config.hidden_size, config.intermediate_size, tp)

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        h, x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), step), residual=x)
        return x + self.mlp(h)
