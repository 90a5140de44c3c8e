"""Dequantize GGML tensor data (F32, F16, Q8_0, Q4_1) in torch, on any device.

A GGUF file stores each weight row by row; a quantized row is a run of 32-value blocks:

    Q8_0: fp16 scale d, 32 int8 q              value = d * q                      (34 bytes)
    Q4_1: fp16 scale d, fp16 min m, 16 bytes   value = d * q + m, q a 4-bit nibble (20 bytes);
          byte j holds value j in its low nibble and value j + 16 in its high nibble

(ggml's ``dequantize_row_q8_0`` / ``dequantize_row_q4_1``, fp32 arithmetic). Doing it here keeps
the teacher independent of ``gguf.quants`` (pure numpy, slow, and absent on machines without the
``gguf`` package); ``tests/test_teacher.py`` checks every type against ``gguf.quants.dequantize``.
"""
import torch

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}
TYPES = ("F32", "F16", "Q8_0", "Q4_1")


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """``[..., 2] uint8`` little-endian halves -> ``[...]`` float32."""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple) -> torch.Tensor:
    """GGML data -> float32 tensor of ``shape`` (torch order: rows first, the contiguous dim last).

    Args:
        raw: ``uint8`` bytes of the tensor (any shape, contiguous), or for F32/F16 the values
            themselves as float32/float16.
        qtype: one of ``F32``, ``F16``, ``Q8_0``, ``Q4_1`` (``GGMLQuantizationType`` names).
        shape: the logical shape, e.g. ``(out_features, in_features)``; the last dim a multiple of
            32 for the block types.
    """
    if qtype not in TYPES:
        raise ValueError(f"qtype: expected one of {TYPES}, got {qtype!r}")
    numel = 1
    for n in shape:
        numel *= n
    if qtype in ("F32", "F16"):
        want = torch.float32 if qtype == "F32" else torch.float16
        values = raw if raw.dtype == want else raw.contiguous().view(torch.uint8).view(want)
        if values.numel() != numel:
            raise ValueError(f"raw: expected {numel} {qtype} values for shape {tuple(shape)}, got {values.numel()}")
        return values.reshape(shape).float()
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw: expected uint8 bytes for {qtype}, got {raw.dtype}")
    if shape[-1] % BLOCK:
        raise ValueError(f"shape: the last dim must be a multiple of {BLOCK} for {qtype}, got {tuple(shape)}")
    blocks = numel // BLOCK
    size = BLOCK_BYTES[qtype]
    if raw.numel() != blocks * size:
        raise ValueError(f"raw: expected {blocks * size} bytes for {qtype} {tuple(shape)}, got {raw.numel()}")
    b = raw.reshape(blocks, size)
    d = _fp16(b[:, 0:2])[:, None]  # [blocks, 1]
    if qtype == "Q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).float()  # [blocks, 32]
        out = d * q
    else:
        m = _fp16(b[:, 2:4])[:, None]
        qs = b[:, 4:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()  # [blocks, 32]: low nibbles, then high
        out = d * q + m
    return out.reshape(shape)
