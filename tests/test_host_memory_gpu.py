"""Host memory per distinct prefill shape on a GPU (issue #37): cuDNN attention, which PyTorch prefers on
Hopper, keeps an execution plan per SDPA shape with no bound; the MHA prefill path runs SDPA without it
(``dsa.model.attention.MHA_SDPA_BACKENDS``), so prompts of new lengths leave nothing behind on the host.
The second case lets cuDNN back in (the code before the fix) to show the measurement sees its plans."""
import random

import pytest
import torch
from torch.nn.attention import SDPBackend

from dsa.kernels import compiles
from dsa.model import attention
from dsa.serve.host_memory import resident_by_kind
from test_host_memory import _mha_engine

pytestmark = pytest.mark.gpu

PER_NEW_SHAPE = 8 << 10  # bytes of C heap per prompt of a new length (numbers: docs/serving.md, "Memory over a long run")


@pytest.mark.parametrize("cudnn", [False, True], ids=["fixed", "cudnn-allowed"])
def test_new_prompt_lengths_leave_no_host_memory_without_cudnn_attention(monkeypatch, cudnn):
    import torch.nn.functional as F

    if "malloc_in_use" not in (resident_by_kind() or {}):
        pytest.skip("needs glibc's mallinfo2")
    if cudnn:
        monkeypatch.setattr(attention, "MHA_SDPA_BACKENDS", [*attention.MHA_SDPA_BACKENDS, SDPBackend.CUDNN_ATTENTION])
    chosen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        chosen.append(SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs)))
        return real(q, k, v, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    engine = _mha_engine("cuda", torch.bfloat16, num_blocks=4096, prefix_caching=False)  # no cached names
    rng = random.Random(0)

    def prompts(lengths):
        for n in lengths:  # one at a time: each prompt one SDPA shape (query rows = keys = n)
            engine.generate([[rng.randrange(256) for _ in range(n)]], max_new_tokens=1)
        torch.cuda.synchronize()
        return resident_by_kind()["malloc_in_use"]

    # warm: every kernel variant the lengths below need (Triton's depend on a length's class and power of
    # two, not on the length), from prompts of every eighth length; then 200 prompts of lengths not seen
    prompts(range(64, 344, 8))
    before = prompts(range(64, 144, 8))  # the same shapes again: nothing new
    built = compiles.total()
    fresh = [n for n in range(97, 344) if n % 8][:200]
    after = prompts(fresh)
    per_shape = (after - before) / len(fresh)
    print(f"cuDNN allowed: {cudnn}; {per_shape:.0f} B of C heap per prompt of a new length; SDPA chose {set(chosen)}")
    assert compiles.total() == built, "kernels compiled while measuring: their binaries are in the heap too"
    if not cudnn:
        assert SDPBackend.CUDNN_ATTENTION not in chosen, set(chosen)
        assert per_shape <= PER_NEW_SHAPE, f"{per_shape:.0f} B per new prompt length > {PER_NEW_SHAPE}"
    elif SDPBackend.CUDNN_ATTENTION not in chosen:
        pytest.skip(f"this torch does not prefer cuDNN attention here (chose {set(chosen)})")
    else:
        assert per_shape > PER_NEW_SHAPE, f"cuDNN's plans not seen: {per_shape:.0f} B per new prompt length"
