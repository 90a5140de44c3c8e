"""Which MLA kernel a call runs: the Hopper kernel's conditions, decided without a GPU."""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels import sparse_mla_hopper as hopper

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
TESTED = hopper.TESTED_TRITON[0] + ".0"


def reason(h=128, capability=(9, 0), version=TESTED, tensors=(), device=CUDA):
    return hopper.unsupported_reason(device, h, tensors, capability=capability, triton_version=version)


@pytest.mark.skipif(not hopper.AVAILABLE, reason="this Triton has no Gluon warp specialization")
@pytest.mark.parametrize("h", [64, 128, 192])
def test_hopper_serves_sm90_with_h_a_multiple_of_64(h):
    assert reason(h=h) is None


@pytest.mark.parametrize("h,capability,version,want", [
    (96, (9, 0), TESTED, "H a multiple of 64"),
    (16, (9, 0), TESTED, "H a multiple of 64"),
    (128, (8, 0), TESTED, "sm_90"),
    (128, (8, 9), TESTED, "sm_90"),
    (128, (10, 0), TESTED, "sm_90"),
    (128, (9, 0), "3.9.0", "has run on Triton"),
], ids=["H96", "H16", "sm80", "sm89", "sm100", "triton3.9"])
def test_other_cases_keep_the_portable_kernel(h, capability, version, want):
    got = reason(h=h, capability=capability, version=version)
    assert got is not None and (want in got or not hopper.AVAILABLE), got


def test_cpu_tensors_and_unaligned_or_strided_tensors_are_refused():
    assert "CUDA" in (reason(device=torch.device("cpu")) or "CUDA")
    cache = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    assert reason(tensors=(cache,)) is None or not hopper.AVAILABLE
    unaligned = torch.zeros(4 * 16 * 576 + 1, dtype=torch.bfloat16)[1:].view(4, 16, 576)  # 2 bytes off
    assert reason(tensors=(unaligned,)) is not None
    strided = torch.zeros(4, 32, 576, dtype=torch.bfloat16)[:, ::2]
    assert reason(tensors=(strided,)) is not None


def test_backend_choice():
    cpu = torch.device("cpu")
    assert not hopper.use_hopper("triton", CUDA, 128, capability=(9, 0))
    assert not hopper.use_hopper("auto", CUDA, 96, capability=(9, 0))
    assert not hopper.use_hopper("auto", CUDA, 128, capability=(8, 0))
    with pytest.raises(ValueError, match="^backend: 'hopper'.*H a multiple of 64|^backend: 'hopper'"):
        hopper.use_hopper("hopper", CUDA, 96, capability=(9, 0))
    with pytest.raises(ValueError, match="^backend: 'hopper'"):
        hopper.use_hopper("hopper", cpu, 128)


def test_public_ops_refuse_hopper_where_it_cannot_run():
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^backend"):
        K.sparse_mla(q, cache, torch.zeros(2, 16, dtype=torch.int32), 0.1, backend="hopper")
    with pytest.raises(ValueError, match="^backend"):
        K.dense_mla_decode(q.view(2, 1, 4, 576), cache, torch.zeros(2, 1, dtype=torch.int32),
                           torch.ones(2, dtype=torch.int32), 0.1, backend="hopper")
    with pytest.raises(ValueError, match="^backend"):
        K.sparse_mla(q, cache, torch.zeros(2, 16, dtype=torch.int32), 0.1, backend="gluon")


@pytest.mark.parametrize("sm,programs,tiles,portable,pair", [
    (132, 128, 32, (1, 32), (1, 32)),  # a full grid: no split
    (132, 44, 7, (3, 3), (2, 4)),  # the rules differ: whole tiles vs whole pairs of tiles
    (132, 1, 2048, (64, 32), (64, 32)),  # at most MAX_SPLITS
    (132, 2, 1, (1, 1), (1, 2)),
    (132, 1, 0, (1, 1), (1, 2)),  # no keys
    (132, 3, 129, (43, 3), (33, 4)),
    (8, 1, 5, (3, 2), (3, 2)),  # at most half the tiles
])
def test_split_rules(monkeypatch, sm, programs, tiles, portable, pair):
    """``(splits, tiles a split)`` of the portable kernel (granule 1) and the Hopper kernel (granule 2),
    the numbers each launcher chose before the rule moved to ``mla_split``."""
    from dsa.kernels import mla_split
    monkeypatch.setattr(mla_split, "sm_count", lambda device: sm)
    assert mla_split.choose_splits(CUDA, programs, tiles, 1) == portable
    assert mla_split.choose_splits(CUDA, programs, tiles, 2) == pair
    assert mla_split.choose_splits(CUDA, 1, 7, 2, splits=3) == (2, 4)  # mla_attention_hopper(splits=3)
