"""Host memory per distinct SDPA shape on a GPU, by backend (issue #37): whether
``F.scaled_dot_product_attention`` keeps host memory for each new (query, key) length, as cuDNN
attention's per-shape plan cache does (PyTorch prefers cuDNN attention on sm90 / sm100).

demo-gpu's MHA prefill shapes: ``[1, 128 heads, L, 192]`` bf16, causal (no prefix) or a bottom-right
boolean mask (behind a prefix). For each sweep of new lengths it reports glibc's heap in use
(``mallinfo2``) and anonymous resident memory per new shape, and the milliseconds per call (a new
shape's first call builds cuDNN's plan); then the same lengths again (cached: no growth expected);
then new lengths with cuDNN turned off (the MHA path's ``MHA_SDPA_BACKENDS``); then each backend's
steady-state time per call at a few lengths (the speed the fix trades).

    python benchmarks/sdpa_host_memory.py [--json out/sdpa-host-memory.json]
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from dsa.model.attention import MHA_SDPA_BACKENDS
from dsa.report import env_info
from dsa.serve.host_memory import resident_by_kind

H, D = 128, 192


def qkv(q_len: int, k_len: int):
    q = torch.randn(1, H, q_len, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, H, k_len, D, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def call(length: int, masked):
    """SDPA of ``length`` query rows: causal (``masked`` False), or behind a 64-token prefix, query i
    seeing keys [0, 64 + i], by a bool mask (``masked`` True) or by ``causal_lower_right`` ("lower_right":
    what the MHA path runs)."""
    if masked:
        q, k, v = qkv(length, length + 64)
        mask = (causal_lower_right(length, length + 64) if masked == "lower_right" else
                torch.ones(length, length + 64, dtype=torch.bool, device="cuda").tril(64))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1)
    q, k, v = qkv(length, length)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)


def memory() -> tuple:
    torch.cuda.synchronize()
    r = resident_by_kind()
    return r["malloc_in_use"], r["resident_anon"]


def sweep(lengths, label: str, backends=None, masked=False) -> dict:
    m0, a0 = memory()
    t0 = time.perf_counter()
    for n in lengths:
        if backends is None:
            call(n, masked)
        else:
            with sdpa_kernel(backends):
                call(n, masked)
    m1, a1 = memory()
    n = len(lengths)
    row = {"sweep": label, "shapes": n, "malloc_in_use_bytes_per_shape": round((m1 - m0) / n),
           "resident_anon_bytes_per_shape": round((a1 - a0) / n),
           "ms_per_call": round(1e3 * (time.perf_counter() - t0) / n, 3), "malloc_in_use_mib": round(m1 / 2**20)}
    print(json.dumps(row), flush=True)
    return row


def speed(length: int) -> dict:
    q, k, v = qkv(length, length)
    row = {"length": length}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
                torch.cuda.synchronize()
            row[f"{name}_us"] = round(1e6 * (time.perf_counter() - t0) / 20, 1)
        except RuntimeError as e:
            row[f"{name}_us"] = f"not available: {str(e).splitlines()[0][:80]}"
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sdpa_host_memory: needs a CUDA GPU")
    q, k, v = qkv(700, 700)
    mask = torch.ones(600, 700, dtype=torch.bool, device="cuda").tril(100)
    chosen = {"causal": SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, scale=0.1)).name,
              "masked": SDPBackend(torch._fused_sdp_choice(q[:, :, :600], k, v, attn_mask=mask, scale=0.1)).name}
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; SDPA chooses {chosen}", flush=True)
    sweep(range(300, 310), "warm-up")
    rows = [sweep(range(512, 712), "default backends, 200 new causal lengths"),
            sweep(range(512, 712), "default backends, the same 200 lengths again"),
            sweep(range(812, 1012), "MHA_SDPA_BACKENDS (no cuDNN), 200 new causal lengths", MHA_SDPA_BACKENDS),
            sweep(range(1112, 1212), "default backends, 100 new masked shapes", masked=True),
            sweep(range(1262, 1362), "MHA_SDPA_BACKENDS (no cuDNN), 100 new masked shapes", MHA_SDPA_BACKENDS,
                  masked=True),
            sweep(range(1412, 1512), "MHA_SDPA_BACKENDS, causal_lower_right (the MHA path behind a prefix), "
                  "100 new shapes", MHA_SDPA_BACKENDS, masked="lower_right")]
    speeds = [speed(n) for n in (512, 1024, 1600)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"op": "sdpa-host-memory", "env": env_info(), "cudnn": torch.backends.cudnn.version(),
                       "chosen": chosen, "sweeps": rows, "speed": speeds}, f, indent=1)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
