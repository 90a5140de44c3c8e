"""Read HF checkpoint folders (``config.json`` + safetensors, sharded or not): the config and the tensors.

Tensor names are HF's with the ``model.`` prefix dropped. FP8 weights with ``weight_scale_inv``
(one fp32 scale per 128x128 block) are dequantized: ``W = W8 * scale_inv[i // 128, j // 128]``.
MTP / next-n layers (``num_hidden_layers <= layer < num_hidden_layers + num_nextn_predict_layers``,
recognized by their ``eh_proj``): the first one is read as ``mtp.*`` (:mod:`dsa.model.mtp`; its copies
of the embedding and head, ``embed_tokens`` and ``shared_head.head``, are the main model's and are
skipped), any later one is skipped with a log line. Building the model is :meth:`dsa.DSAModel.from_pretrained`'s job; this
module imports nothing of the model.

Whatever cannot be loaded faithfully is refused with an error naming the file and the tensor or
field: an unreadable ``config.json`` or safetensors file, decoder layers past ``num_hidden_layers``
(a config that lowers it would load a truncated model), layers past the MTP layers, indexer weights
for a model without an indexer, scale blocks that do not match their weight, non-finite weights or
scales, missing or mis-shaped tensors.
"""
import logging
import os
import re

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from dsa.config import DSAConfig, read_json_object
from dsa.kernels.common import cdiv

log = logging.getLogger("dsa")

# DSAConfig fields that change which tensors exist or their shapes: not overridable at load
SHAPE_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "index_n_heads",
    "index_head_dim", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "indexer_types",
    "tie_word_embeddings", "attention_bias", "num_nextn_predict_layers"})
FP8_BLOCK = 128
LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
SCALE_SUFFIX = "_scale_inv"


def _shards(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json_object(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map: expected an object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no safetensors files (*.safetensors)")
    return [os.path.join(path, f) for f in files]


def dequantize_fp8_block(w8: torch.Tensor, scale_inv: torch.Tensor, part: tuple = ()) -> torch.Tensor:
    """``W8 [N, K] e4m3`` times its per-128x128-block ``scale_inv [ceil(N/128), ceil(K/128)]`` -> fp32.
    ``part``: the index ``w8`` was read with from a larger weight (tensor parallelism)."""
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    rows, cols = (part + (slice(None),) * 2)[:2]
    s = s[_offset(rows, w8.shape[0]), _offset(cols, w8.shape[1])]
    return w8.float() * s


def quantize_fp8_block(w: torch.Tensor) -> tuple:
    """``w [N, K]`` -> ``(w8 [N, K] e4m3, scale_inv [ceil(N/128), ceil(K/128)] fp32)`` with ``w ~ w8 *
    scale_inv`` per 128 x 128 block (DeepSeek-V3's block format; each block's largest magnitude maps to 448)."""
    n, k = w.shape
    rb, cb = cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK)
    padded = F.pad(w.float(), (0, cb * FP8_BLOCK - k, 0, rb * FP8_BLOCK - n))
    blocks = padded.view(rb, FP8_BLOCK, cb, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    w8 = (blocks / scale[:, None, :, None]).view(rb * FP8_BLOCK, cb * FP8_BLOCK)[:n, :k]
    return w8.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _offset(ix: slice, n: int) -> slice:
    start = ix.start or 0
    return slice(start, start + n)


def _nonfinite(t: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:  # NaN is S.1111.111; e4m3fn has no inf
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


MTP_SHARED = ("embed_tokens.", "shared_head.head.")  # the MTP layer's copies of the main model's tensors


def _mtp_name(key: str, num_layers: int) -> str | None:
    """``mtp.*`` for a tensor of the first MTP layer that the model reads, else None."""
    rest = LAYER_RE.sub("", key, count=1)
    return None if rest.startswith(MTP_SHARED) else "mtp." + rest


def _read_files(path: str, num_layers: int, num_nextn: int, select=None) -> tuple[dict, dict, dict]:
    """``(tensors by HF name minus ``model.``, file of each, slices read)``, the first MTP layer as
    ``mtp.*``, the later ones dropped, everything else refused unless readable and finite.
    ``select(name, full_shape)``: None to skip the tensor, else the index of the part to read (``()``: all of it)."""
    raw, where, skipped, parts = {}, {}, {}, {}  # skipped: layer -> (a file, has eh_proj)
    for file in _shards(path):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    m = LAYER_RE.match(key)
                    if m and int(m.group(1)) >= num_layers:
                        if int(m.group(1)) >= num_layers + num_nextn:
                            raise ValueError(
                                f"{file}: {key}: layer {m.group(1)} is past num_hidden_layers = {num_layers} + "
                                f"num_nextn_predict_layers = {num_nextn} of config.json (a config that drops layers "
                                "would load a truncated model)")
                        layer = int(m.group(1))
                        skipped[layer] = (file, skipped.get(layer, (file, False))[1] or ".eh_proj." in key)
                        name = _mtp_name(key, num_layers) if layer == num_layers else None
                        if name is None:
                            continue
                    else:
                        name = key.removeprefix("model.")
                    if name in raw:
                        raise ValueError(f"{file}: {key} is also in {where[name]}")
                    shape = tuple(f.get_slice(key).get_shape())
                    part = () if select is None else select(name, shape)
                    if part is None:
                        continue  # another rank's expert
                    if part and not name.endswith(SCALE_SUFFIX):
                        raw[name], parts[name] = f.get_slice(key)[part], (part, shape)
                    else:  # whole, and block scales whole (a slice of their weight picks its blocks)
                        raw[name] = f.get_tensor(key)
                    where[name] = file
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    for layer, (file, mtp) in sorted(skipped.items()):
        if not mtp:
            raise ValueError(f"{file}: layers.{layer}: a decoder layer past num_hidden_layers = {num_layers} of "
                             "config.json without the eh_proj of an MTP layer (a config that drops layers would "
                             "load a truncated model)")
    if len(skipped) > 1:
        log.info("skipping MTP / next-n layers %s (num_hidden_layers = %d; the model builds the first)",
                 sorted(skipped)[1:], num_layers)
    for name, t in raw.items():
        if _nonfinite(t):
            raise ValueError(f"{where[name]}: {name}: holds NaN or inf")
    return raw, where, parts


def _dequantize(raw: dict, where: dict, parts: dict) -> dict:
    """FP8 weights times their block scales; a scale must belong to an FP8 2-D weight of its exact grid.
    A weight read in part (``parts``: its index and whole shape) takes the blocks of that part."""
    out = {}
    for key, t in raw.items():
        if key.endswith(SCALE_SUFFIX):
            weight = raw.get(key.removesuffix(SCALE_SUFFIX))
            if weight is None or weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{where[key]}: {key}: a block scale without an FP8 weight "
                                 f"{key.removesuffix(SCALE_SUFFIX)}")
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = raw.get(key + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"{where[key]}: {key}: an FP8 weight without its {key}{SCALE_SUFFIX}")
            if t.dim() != 2:
                raise ValueError(f"{where[key]}: {key}: expected a 2-D FP8 weight, got shape {list(t.shape)}")
            part, full = parts.get(key, ((), tuple(t.shape)))
            grid = [cdiv(n, FP8_BLOCK) for n in full]
            if list(scale.shape) != grid:
                raise ValueError(f"{where[key + SCALE_SUFFIX]}: {key}{SCALE_SUFFIX}: expected {grid} blocks of "
                                 f"{FP8_BLOCK}x{FP8_BLOCK} for the weight's {list(full)}, got {list(scale.shape)}")
            t = dequantize_fp8_block(t, scale, part)
        out[key] = t
    return out


def read_pretrained(path, overrides: dict | None = None, tp=None) -> tuple[DSAConfig, dict]:
    """``(config, tensors)`` of a checkpoint folder: our tensor names -> fp32 (dequantized) or stored dtype.

    ``overrides``: DSAConfig fields that keep weight shapes; others raise ``ValueError``. Indexer
    weights in a checkpoint whose config has no indexer (``deepseek_v3``) are refused. ``tp``: a
    :class:`dsa.model.parallel.TensorParallel`; only this rank's shard of each tensor is read.
    """
    path = os.fspath(path)
    overrides = dict(overrides or {})
    bad = sorted(set(overrides) & SHAPE_FIELDS)
    if bad or ("index_topk" in overrides and overrides["index_topk"] is None):
        raise ValueError(f"overrides: {bad or ['index_topk=None']} would change the checkpoint's weights; "
                         "only fields that keep weight shapes can be overridden")
    config_file = os.path.join(path, "config.json")
    config = DSAConfig.from_hf_config(config_file, **overrides)
    num_nextn = config.num_nextn_predict_layers
    select = None
    if tp is not None and tp.size > 1:
        def select(name, shape):  # block scales are read whole: a slice of their weight picks its blocks
            if not tp.holds(name):
                return None
            return () if name.endswith(SCALE_SUFFIX) else tp.shard(name, shape, config) or ()
    raw, where, parts = _read_files(path, config.num_hidden_layers, num_nextn, select)
    if config.index_topk is None:
        indexer = sorted(k for k in raw if ".indexer." in k)
        if indexer:
            raise ValueError(f"{where[indexer[0]]}: {indexer[0]} (and {len(indexer) - 1} more indexer tensors): "
                             f"model_type {config.model_type!r} of {config_file} has no indexer, so they would be "
                             "dropped; use the checkpoint's own model_type")
    if num_nextn and not any(k.startswith("mtp.") for k in raw):
        log.info("%s: num_nextn_predict_layers = %d but no MTP layer tensors: loading without the MTP module",
                 config_file, num_nextn)
        config = config.replace(num_nextn_predict_layers=0)
    tensors = _dequantize(raw, where, parts)
    if config.tie_word_embeddings and "lm_head.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return config, tensors


def match_state_dict(tensors: dict, expected: dict, path) -> dict:
    """The tensors a model expects (``expected``: name -> shape), or ``ValueError`` naming the missing and
    the mis-shaped ones; unused extras are logged."""
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {os.fspath(path)}: missing tensors {missing[:8]}{more}")
    wrong = [f"{k}: expected {list(shape)}, got {list(tensors[k].shape)}" for k, shape in expected.items()
             if tuple(tensors[k].shape) != tuple(shape)]
    if wrong:
        raise ValueError(f"checkpoint {os.fspath(path)}: mis-shaped tensors: " + "; ".join(wrong[:8]))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        log.info("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(extra), extra[:3])
    return {k: tensors[k] for k in expected}
