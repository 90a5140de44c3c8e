"""quant_ue8m0 bit-exact (binade boundaries, zero groups, extremes) and the Hadamard transform."""
import pytest
import torch

from dsa.kernels import hadamard, quant_ue8m0
from dsa.kernels.layouts import latent_fp8_scale, ue8m0_ceil


def _group(amax: float) -> torch.Tensor:
    x = torch.zeros(1, 128)
    x[0, 5] = amax
    x[0, 9] = -amax / 3
    return x


@pytest.mark.parametrize("k", [-20, -3, 0, 1, 7, 30], ids=lambda k: f"2^{k}")
def test_scale_at_and_above_a_binade_boundary(k):
    at = 448.0 * 2.0 ** k
    assert quant_ue8m0(_group(at))[1].item() == 2.0 ** k
    above = torch.nextafter(torch.tensor(at), torch.tensor(float("inf"))).item()
    assert quant_ue8m0(_group(above))[1].item() == 2.0 ** (k + 1)
    below = torch.nextafter(torch.tensor(at), torch.tensor(0.0)).item()
    assert quant_ue8m0(_group(below))[1].item() == 2.0 ** k


def test_zero_and_tiny_groups_clamp_amax():
    x8, s = quant_ue8m0(torch.zeros(2, 256))
    want = ue8m0_ceil(torch.tensor([1e-4 / 448], dtype=torch.float32)).item()
    assert torch.all(s == want) and not x8.float().any()
    assert quant_ue8m0(_group(1e-9))[1].item() == want


def test_huge_values_and_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 30, 64).unsqueeze(1)
    x8, s = quant_ue8m0(x)
    assert s.shape == (64, 2) and x8.dtype == torch.float8_e4m3fn
    assert torch.all(torch.log2(s).frac() == 0)  # powers of two
    back = x8.float().view(64, 2, 128) * s.unsqueeze(-1)
    rel = (back.view(64, 256) - x).abs() / x.abs().amax(1, keepdim=True)
    assert rel.max() < 2 ** -4  # e4m3: 3 mantissa bits, max lands in [224, 448]
    assert x8.float().abs().max() <= 448


def test_ue8m0_is_not_log2_rounding():
    # just above 2^k a float log2 can round down to k; the bit rule never does
    r = torch.nextafter(torch.tensor([2.0 ** -10, 1.0, 2.0 ** 20]), torch.tensor(float("inf")))
    assert torch.equal(ue8m0_ceil(r), torch.tensor([2.0 ** -9, 2.0, 2.0 ** 21]))
    assert torch.equal(ue8m0_ceil(torch.tensor([2.0 ** -10, 0.75])), torch.tensor([2.0 ** -10, 1.0]))


def test_latent_656_rule_is_separate():
    amax = torch.tensor([0.0, 448 * 1e-4, 448.0, 449.0])
    # r = max(amax / 448, 1e-4): the floor applies to the ratio, not to amax
    assert torch.equal(latent_fp8_scale(amax), torch.tensor([2.0 ** -13, 2.0 ** -13, 1.0, 2.0]))


def test_indexer_rule_floor_on_amax():
    x8, s = quant_ue8m0(torch.full((1, 128), 1e-6))
    assert s.item() == ue8m0_ceil(torch.tensor(1e-4, dtype=torch.float32) / 448).item() == 2.0 ** -22
    assert latent_fp8_scale(torch.tensor([1e-6])).item() == 2.0 ** -13


def _sylvester(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 8, 128])
def test_hadamard_matches_sylvester_matrix(d):
    x = torch.randn(5, 3, d, dtype=torch.float64)
    assert torch.allclose(hadamard(x), x @ _sylvester(d) * d ** -0.5, atol=1e-12)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-12)  # orthonormal and symmetric


def test_hadamard_bf16_rounds_once():
    x = torch.randn(9, 128).to(torch.bfloat16)
    y = hadamard(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, hadamard(x.float()).to(torch.bfloat16))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="x: expected the last dim to be a power of two"):
        hadamard(torch.randn(2, 96))
