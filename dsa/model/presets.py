"""Model presets: the embedded default model and the random-weight shapes the tools and benches use.

``demo-cpu``: 2 layers with the V3.2 latent (512 + 64) and indexer (64 heads x 128) shapes, hidden
1024, 16 heads, dense MLP, ``index_topk=512``, so sparse attention runs at a 4K context.
``demo-gpu``: 4 layers with full V3.2 attention shapes (hidden 7168, 128 heads, 64 indexer heads,
``index_topk=2048``). Both use the byte-level tokenizer's vocabulary (:mod:`dsa.model.byte_vocab`).
``tiny`` and ``glm-skip-small`` are test and recall shapes.
"""
import dataclasses
import os

import torch

from dsa.config import DSAConfig
from dsa.model.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE
from dsa.model.preset_names import PRESET_NAMES

BYTE_VOCAB = dict(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID)

CPU_DEFAULT = dict(num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, q_lora_rank=512,
                   intermediate_size=2048, n_routed_experts=None, index_topk=512, max_position_embeddings=16384,
                   block_size=64, **BYTE_VOCAB)
GPU_DEFAULT = dict(num_hidden_layers=4, n_routed_experts=None, index_topk=2048, max_position_embeddings=163840,
                   block_size=64, **BYTE_VOCAB)

PRESETS = {  # name -> a config factory, one for each of PRESET_NAMES (in its order)
    "tiny": lambda: DSAConfig.tiny(index_topk=64, index_topk_pattern="FSFS"),
    "demo-cpu": lambda: DSAConfig.deepseek_v32(**CPU_DEFAULT),
    "demo-gpu": lambda: DSAConfig.deepseek_v32(**GPU_DEFAULT),
    "glm-skip-small": lambda: DSAConfig.glm_5_2_skip(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16,
                                                     q_lora_rank=512, intermediate_size=2048, n_routed_experts=None,
                                                     vocab_size=8192, index_topk=512),
}


DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "default")


def default_model(device, dtype: torch.dtype | None = None, tp_size: int = 1):
    """The embedded default model: the trained checkpoint in ``DEFAULT_CHECKPOINT`` (5 layers + MTP,
    hidden 384, the V3.2 latent and indexer shapes, ``index_topk`` 512, 16K context, a 4,096-token BPE;
    ``benchmarks/train_default/train.py`` made it), bf16 on CUDA, else fp32."""
    from dsa.model import DSAModel
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    return DSAModel.from_pretrained(DEFAULT_CHECKPOINT, dtype=dtype, device=device, tp_size=tp_size)


def preset_model(name: str, device, dtype: torch.dtype | None = None, seed: int = 0, tp_size: int = 1,
                 mtp: bool = False):
    """A preset with random weights (seed ``seed``) and the byte-level tokenizer's vocabulary (the
    presets with another vocabulary get the byte one), bf16 on CUDA, else fp32; ``mtp``: with a
    (random) MTP module, built after the other weights (which stay the same)."""
    from dsa.model import DSAModel
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {', '.join(PRESET_NAMES)}, got {name!r}")
    device = torch.device(device)
    config = PRESETS[name]()
    if (config.vocab_size, config.bos_token_id, config.eos_token_id) != (BYTE_VOCAB_SIZE, BYTE_BOS_ID, BYTE_EOS_ID):
        config = dataclasses.replace(config, **BYTE_VOCAB)
    if mtp:
        config = dataclasses.replace(config, num_nextn_predict_layers=1)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return DSAModel.random(config, seed=seed, dtype=dtype, device=device, tp_size=tp_size)
