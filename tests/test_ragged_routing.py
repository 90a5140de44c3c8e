"""Which ragged-logits kernel a call runs: the Hopper (Gluon) kernel's conditions, decided without a GPU."""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels import indexer_logits_ragged_hopper as hopper

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
TESTED = hopper.TESTED_TRITON[0] + ".0"


def reason(hi=64, di=128, capability=(9, 0), version=TESTED, tensors=(), device=CUDA):
    return hopper.unsupported_reason(device, hi, di, tensors, capability=capability, triton_version=version)


@pytest.mark.skipif(not hopper.AVAILABLE, reason="this Triton has no Gluon warp specialization and TMA")
@pytest.mark.parametrize("hi", [16, 32, 64, 128])
def test_hopper_serves_sm90_with_hi_a_power_of_two(hi):
    assert reason(hi=hi) is None


@pytest.mark.parametrize("hi,di,capability,version,want", [
    (48, 128, (9, 0), TESTED, "HI in 16, 32, 64, 128"),
    (8, 128, (9, 0), TESTED, "HI in 16, 32, 64, 128"),
    (256, 128, (9, 0), TESTED, "HI in 16, 32, 64, 128"),
    (64, 64, (9, 0), TESTED, "DI = 128"),
    (64, 128, (8, 0), TESTED, "sm_90"),
    (64, 128, (10, 0), TESTED, "sm_90"),
    (64, 128, (9, 0), "3.9.0", "has run on Triton"),
], ids=["HI48", "HI8", "HI256", "DI64", "sm80", "sm100", "triton3.9"])
def test_other_cases_keep_the_portable_kernel(hi, di, capability, version, want):
    got = reason(hi=hi, di=di, capability=capability, version=version)
    assert got is not None and (want in got or not hopper.AVAILABLE), got


def test_cpu_tensors_and_unaligned_tensors_are_refused():
    assert "CUDA" in (reason(device=torch.device("cpu")) or "CUDA")
    keys = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    assert reason(tensors=(keys,)) is None or not hopper.AVAILABLE
    unaligned = torch.zeros(64 * 128 + 8, dtype=torch.float8_e4m3fn)[8:].view(64, 128)  # 8 bytes off
    assert reason(tensors=(unaligned,)) is not None


def test_backend_choice():
    assert not hopper.use_hopper("triton", CUDA, 64, 128, capability=(9, 0))
    assert not hopper.use_hopper("deepgemm", CUDA, 64, 128, capability=(9, 0))
    assert not hopper.use_hopper("auto", CUDA, 48, 128, capability=(9, 0))
    assert not hopper.use_hopper("auto", CUDA, 64, 128, capability=(8, 0))
    with pytest.raises(ValueError, match="^backend: 'hopper'"):
        hopper.use_hopper("hopper", CUDA, 48, 128, capability=(9, 0))
    with pytest.raises(ValueError, match="^backend: 'hopper'"):
        hopper.use_hopper("hopper", torch.device("cpu"), 64, 128)


def test_the_public_op_refuses_hopper_where_it_cannot_run():
    q8 = torch.zeros(3, 64, 128).to(torch.float8_e4m3fn)
    w, k8, k_scale = torch.zeros(3, 64), torch.zeros(10, 128).to(torch.float8_e4m3fn), torch.ones(10)
    ends = torch.full((3,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="^backend: 'hopper'"):
        K.indexer_logits_ragged(q8, w, k8, k_scale, torch.zeros_like(ends), ends, backend="hopper")
    with pytest.raises(TypeError, match="FP8|low-precision"):  # exact inputs never reach a Triton kernel
        K.indexer_logits_ragged(torch.zeros(3, 64, 128), w, torch.zeros(10, 128), None, torch.zeros_like(ends), ends,
                                backend="hopper")
