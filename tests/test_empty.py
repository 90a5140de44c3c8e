"""Empty batches (B = 0, T = 0, N = 0, H = 0, K = 0, L = 0, S = 0, NB = 0, MB = 0) give empty outputs of the
documented shapes on both backends (Triton under the interpreter on CPU); ``k = 0`` for top-k stays an error."""
import pytest
import torch

from dsa import kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = dict(dtype=torch.int32, device=DEVICE)
F8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def z(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(shape, dtype=dtype, device=device)


def full(n, value):
    return torch.full((n,), value, **I32)


LAT, LAT8, IDX = z(2, 16, 576, dtype=BF16), z(2, 16, 656, dtype=torch.uint8), z(3, 16 * 132, dtype=torch.uint8)
CASES = {  # name: (call(backend), expected output shapes; () for in-place ops)
    "paged-B0": (lambda b: K.indexer_logits_paged(z(0, 2, 4, 128, dtype=F8), z(0, 2, 4), IDX, z(0, 3, **I32),
                                                  z(0, **I32), 16, backend=b), [(0, 0)]),
    "paged-N0": (lambda b: K.indexer_logits_paged(z(2, 0, 4, 128, dtype=F8), z(2, 0, 4), IDX, z(2, 2, **I32),
                                                  full(2, 5), 16, backend=b), [(0, 5)]),
    "paged-NB0": (lambda b: K.indexer_logits_paged(z(2, 1, 4, 128, dtype=F8), z(2, 1, 4), z(0, 16 * 132, dtype=torch.uint8),
                                                   z(2, 2, **I32), full(2, 5), 16, backend=b), [(2, 5)]),
    "paged-MB0": (lambda b: K.indexer_logits_paged(z(2, 1, 4, 128, dtype=F8), z(2, 1, 4), IDX, z(2, 0, **I32),
                                                   full(2, 5), 16, backend=b), [(2, 5)]),
    "ragged-T0": (lambda b: K.indexer_logits_ragged(z(0, 4, 128, dtype=F8), z(0, 4), z(9, 128, dtype=F8), z(9),
                                                    z(0, **I32), z(0, **I32), backend=b), [(0, 9)]),
    "ragged-S0": (lambda b: K.indexer_logits_ragged(z(3, 4, 128, dtype=F8), z(3, 4), z(0, 128, dtype=F8), z(0),
                                                    z(3, **I32), z(3, **I32), backend=b), [(3, 0)]),
    "query_prep-T0": (lambda b: K.indexer_query_prep(z(0, 4, 128, dtype=BF16), z(0, 4), True, backend=b),
                      [(0, 4, 128), (0, 4)]),
    "query_prep-HI0": (lambda b: K.indexer_query_prep(z(3, 0, 128, dtype=BF16), z(3, 0), True, backend=b),
                       [(3, 0, 128), (3, 0)]),
    "key_write-T0": (lambda b: K.indexer_key_write(IDX.clone(), z(0, 128, dtype=BF16), z(0, dtype=torch.long), 16,
                                                   True, backend=b), ()),
    "key_write-NB0": (lambda b: K.indexer_key_write(z(0, 16 * 132, dtype=torch.uint8), z(3, 128, dtype=BF16),
                                                    torch.arange(3, device=DEVICE), 16, True, backend=b), ()),
    "latent_write-T0": (lambda b: K.latent_write(LAT.clone(), z(0, 512, dtype=BF16), z(0, 64, dtype=BF16),
                                                 z(0, dtype=torch.long), backend=b), ()),
    "latent_write-NB0": (lambda b: K.latent_write(z(0, 16, 656, dtype=torch.uint8), z(3, 512, dtype=BF16),
                                                  z(3, 64, dtype=BF16), torch.arange(3, device=DEVICE), backend=b), ()),
    "topk-R0": (lambda b: K.topk_indices(z(0, 10), z(0, **I32), 4, backend=b), [(0, 4)]),
    "topk-L0": (lambda b: K.topk_indices(z(3, 0), full(3, 5), 4, backend=b), [(3, 4)]),
    "topk_slots-R0": (lambda b: K.topk_slots(z(0, 10), z(0, **I32), 4, z(2, 2, **I32), z(0, **I32), full(2, 5), 16,
                                             backend=b), [(0, 4)]),
    "topk_slots-B0": (lambda b: K.topk_slots(z(3, 10), full(3, 5), 4, z(0, 2, **I32), z(3, **I32), z(0, **I32), 16,
                                             backend=b), [(3, 4)]),
    "sparse_mla-T0": (lambda b: K.sparse_mla(z(0, 4, 576, dtype=BF16), LAT, z(0, 16, **I32), 0.1, backend=b),
                      [(0, 4, 512), (0, 4)]),
    "sparse_mla-H0": (lambda b: K.sparse_mla(z(3, 0, 576, dtype=BF16), LAT, z(3, 16, **I32), 0.1, backend=b),
                      [(3, 0, 512), (3, 0)]),
    "sparse_mla-K0": (lambda b: K.sparse_mla(z(3, 4, 576, dtype=BF16), LAT, z(3, 0, **I32), 0.1, backend=b),
                      [(3, 4, 512), (3, 4)]),
    "sparse_mla-NB0": (lambda b: K.sparse_mla(z(3, 4, 576, dtype=BF16), z(0, 16, 656, dtype=torch.uint8),
                                              z(3, 16, **I32), 0.1, backend=b), [(3, 4, 512), (3, 4)]),
    "dense_mla-B0": (lambda b: K.dense_mla_decode(z(0, 1, 4, 576, dtype=BF16), LAT, z(0, 1, **I32), z(0, **I32),
                                                  0.1, backend=b), [(0, 1, 4, 512), (0, 1, 4)]),
    "dense_mla-N0": (lambda b: K.dense_mla_decode(z(2, 0, 4, 576, dtype=BF16), LAT8, z(2, 1, **I32), full(2, 5),
                                                  0.1, backend=b), [(2, 0, 4, 512), (2, 0, 4)]),
    "dense_mla-H0": (lambda b: K.dense_mla_decode(z(2, 1, 0, 576, dtype=BF16), LAT, z(2, 1, **I32), full(2, 5),
                                                  0.1, backend=b), [(2, 1, 0, 512), (2, 1, 0)]),
    "dense_mla-NB0": (lambda b: K.dense_mla_decode(z(2, 1, 4, 576, dtype=BF16), z(0, 16, 576, dtype=BF16),
                                                   z(2, 2, **I32), full(2, 20), 0.1, backend=b), [(2, 1, 4, 512), (2, 1, 4)]),
    "dense_mla-MB0": (lambda b: K.dense_mla_decode(z(2, 1, 4, 576, dtype=BF16), LAT, z(2, 0, **I32), full(2, 20),
                                                   0.1, backend=b), [(2, 1, 4, 512), (2, 1, 4)]),
}
TORCH_ONLY = {
    "quant_ue8m0-T0": (lambda: K.quant_ue8m0(z(0, 3, 256)), [(0, 3, 256), (0, 3, 2)]),
    "hadamard-T0": (lambda: K.hadamard(z(0, 128)), [(0, 128)]),
    "apply_rope-T0": (lambda: K.apply_rope(z(0, 3, 64), z(0, dtype=torch.long), *K.yarn_cos_sin(4, 64, 1e4, None), True),
                      [(0, 3, 64)]),
    "positions_to_slots-R0": (lambda: K.positions_to_slots(z(0, 4, **I32), z(2, 2, **I32), z(0, **I32), full(2, 5), 16),
                              [(0, 4)]),
}


def _check(out, shapes):
    outs = () if out is None else out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == [tuple(s) for s in shapes]
    for o in outs:  # lse / logits of empty rows are -inf, outputs 0, slots -1: never NaN
        assert not o.is_floating_point() or o.dtype == F8 or not torch.isnan(o.float()).any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_empty_inputs_give_empty_outputs(case, backend):
    call, shapes = CASES[case]
    _check(call(backend), shapes)


@pytest.mark.parametrize("case", sorted(TORCH_ONLY))
def test_empty_inputs_of_torch_only_ops(case):
    call, shapes = TORCH_ONLY[case]
    _check(call(), shapes)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_topk_with_k_zero_stays_an_error(backend):
    with pytest.raises(ValueError, match="^k: expected an int >= 1"):
        K.topk_indices(z(3, 10), full(3, 5), 0, backend=backend)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0), (0, 0)], ids=["B0", "S0", "B0-S0"])
def test_model_on_an_empty_batch(shape):
    from model_utils import tiny_model
    model = tiny_model()
    logits = model(torch.zeros(shape, dtype=torch.long))
    assert logits.shape == shape + (model.config.vocab_size,) and logits.dtype == torch.float32
