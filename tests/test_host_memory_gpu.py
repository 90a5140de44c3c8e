"""Host memory per distinct prefill shape on a GPU (issue #37): cuDNN attention, which PyTorch prefers on
Hopper, keeps an execution plan per SDPA shape with no bound; the MHA prefill path runs SDPA without it,
so prompts of new lengths leave nothing behind on the host."""
import random

import pytest
import torch
from torch.nn.attention import SDPBackend

from dsa.serve.host_memory import resident_by_kind
from tests.test_host_memory import _mha_engine

pytestmark = pytest.mark.gpu

PER_NEW_SHAPE = 8 << 10  # bytes of C heap per prompt of a new length (cuDNN's plans: far more; the probe's numbers
# are in docs/serving.md, "Memory over a long run")


def test_the_mha_path_never_picks_cudnn_and_new_prompt_lengths_leave_no_host_memory(monkeypatch):
    import torch.nn.functional as F

    if resident_by_kind() is None or "malloc_in_use" not in resident_by_kind():
        pytest.skip("needs glibc's mallinfo2")
    chosen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        chosen.append(SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs)))
        return real(q, k, v, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    engine = _mha_engine("cuda", torch.bfloat16, num_blocks=4096, prefix_caching=False)  # no cached blocks' names
    rng = random.Random(0)

    def prompts(lengths):
        for n in lengths:  # one at a time: each prompt one SDPA shape (query rows = keys = n)
            engine.generate([[rng.randrange(256) for _ in range(n)]], max_new_tokens=1)
        torch.cuda.synchronize()
        return resident_by_kind()["malloc_in_use"]

    prompts(range(64, 96))  # warm: the kernels' first launches
    before = prompts(range(96, 106))
    after = prompts(range(106, 306))
    assert SDPBackend.CUDNN_ATTENTION not in chosen, set(chosen)
    per_shape = (after - before) / 200
    print(f"{per_shape:.0f} B of C heap per prompt of a new length; SDPA backends {set(chosen)}")
    assert per_shape <= PER_NEW_SHAPE, f"{per_shape:.0f} B per new prompt length > {PER_NEW_SHAPE}"
