"""Bad input at the public boundary raises ValueError/TypeError naming the argument; backend rules."""
import pytest
import torch

from dsa import kernels as K

LAT = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
IDX = torch.zeros(2, 16 * 132, dtype=torch.uint8)
I32 = torch.int32

BAD = [
    ("q", TypeError, lambda: K.sparse_mla(torch.zeros(3, 4, 576, dtype=torch.float16), LAT,
                                          torch.zeros(3, 8, dtype=I32), 0.1)),
    ("q", ValueError, lambda: K.sparse_mla(torch.zeros(3, 4, 512, dtype=torch.bfloat16), LAT,
                                           torch.zeros(3, 8, dtype=I32), 0.1)),
    ("slots", ValueError, lambda: K.sparse_mla(torch.zeros(3, 4, 576, dtype=torch.bfloat16), LAT,
                                               torch.zeros(2, 8, dtype=I32), 0.1)),
    ("slots", TypeError, lambda: K.sparse_mla(torch.zeros(3, 4, 576, dtype=torch.bfloat16), LAT,
                                              torch.zeros(3, 8, dtype=torch.int64), 0.1)),
    ("latent_cache", ValueError, lambda: K.sparse_mla(torch.zeros(3, 4, 576, dtype=torch.bfloat16),
                                                      torch.zeros(2, 16, 600, dtype=torch.bfloat16),
                                                      torch.zeros(3, 8, dtype=I32), 0.1)),
    ("seq_lens", ValueError, lambda: K.dense_mla_decode(torch.zeros(2, 1, 4, 576, dtype=torch.bfloat16), LAT,
                                                        torch.zeros(2, 1, dtype=I32), torch.zeros(3, dtype=I32), 0.1)),
    ("k", TypeError, lambda: K.indexer_key_write(IDX, torch.zeros(3, 128, dtype=torch.int32),
                                                 torch.zeros(3, dtype=torch.long), 16, False)),
    ("index_cache", ValueError, lambda: K.indexer_key_write(torch.zeros(2, 16 * 128, dtype=torch.uint8),
                                                            torch.zeros(3, 128), torch.zeros(3, dtype=torch.long),
                                                            16, False)),
    ("slot_mapping", ValueError, lambda: K.indexer_key_write(IDX, torch.zeros(3, 128), torch.zeros(4, dtype=torch.long),
                                                             16, False)),
    ("w", ValueError, lambda: K.indexer_query_prep(torch.zeros(3, 4, 128), torch.zeros(3, 5), True)),
    ("weights", ValueError, lambda: K.indexer_logits_paged(torch.zeros(2, 1, 4, 128, dtype=torch.float8_e4m3fn),
                                                           torch.zeros(2, 1, 5), IDX, torch.zeros(2, 1, dtype=I32),
                                                           torch.zeros(2, dtype=I32), 16)),
    ("q8", TypeError, lambda: K.indexer_logits_paged(torch.zeros(2, 1, 4, 128), torch.zeros(2, 1, 4), IDX,
                                                     torch.zeros(2, 1, dtype=I32), torch.zeros(2, dtype=I32), 16)),
    ("block_table", ValueError, lambda: K.indexer_logits_paged(torch.zeros(2, 1, 4, 128, dtype=torch.float8_e4m3fn),
                                                               torch.zeros(2, 1, 4), IDX, torch.zeros(3, 1, dtype=I32),
                                                               torch.zeros(2, dtype=I32), 16)),
    ("ends", ValueError, lambda: K.indexer_logits_ragged(torch.zeros(3, 4, 128, dtype=torch.float8_e4m3fn),
                                                         torch.zeros(3, 4), torch.zeros(9, 128, dtype=torch.float8_e4m3fn),
                                                         torch.zeros(9), torch.zeros(3, dtype=I32),
                                                         torch.zeros(2, dtype=I32))),
    ("k_scale", TypeError, lambda: K.indexer_logits_ragged(torch.zeros(3, 4, 128, dtype=torch.float8_e4m3fn),
                                                           torch.zeros(3, 4), torch.zeros(9, 128, dtype=torch.float8_e4m3fn),
                                                           None, torch.zeros(3, dtype=I32), torch.zeros(3, dtype=I32))),
    ("lengths", ValueError, lambda: K.topk_indices(torch.zeros(3, 10), torch.zeros(2, dtype=I32), 4)),
    ("logits", TypeError, lambda: K.topk_indices(torch.zeros(3, 10, dtype=torch.float64), torch.zeros(3, dtype=I32), 4)),
    ("k", ValueError, lambda: K.topk_indices(torch.zeros(3, 10), torch.zeros(3, dtype=I32), 0)),
    ("row_to_req", ValueError, lambda: K.topk_slots(torch.zeros(3, 10), torch.zeros(3, dtype=I32), 4,
                                                    torch.zeros(2, 1, dtype=I32), torch.zeros(2, dtype=I32),
                                                    torch.zeros(2, dtype=I32), 16)),
    ("k_pe", ValueError, lambda: K.latent_write(LAT, torch.zeros(3, 512, dtype=torch.bfloat16),
                                                torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long))),
    ("positions", TypeError, lambda: K.positions_to_slots(torch.zeros(3, 4), torch.zeros(2, 1, dtype=I32),
                                                          torch.zeros(3, dtype=I32), torch.zeros(2, dtype=I32), 16)),
    ("group", ValueError, lambda: K.quant_ue8m0(torch.zeros(3, 100))),
    ("backend", ValueError, lambda: K.topk_indices(torch.zeros(3, 10), torch.zeros(3, dtype=I32), 4, backend="cuda")),
]


@pytest.mark.parametrize("arg,exc,call", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(arg, exc, call):
    with pytest.raises(exc, match=rf"^{arg}\b"):
        call()


def test_mixed_devices_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="one device"):
        K.sparse_mla(torch.zeros(3, 4, 576, dtype=torch.bfloat16, device="cuda"), LAT, torch.zeros(3, 8, dtype=I32), 0.1)


@pytest.mark.parametrize("op", [lambda b: K.quant_ue8m0(torch.zeros(2, 128), backend=b),
                                lambda b: K.hadamard(torch.zeros(2, 128), backend=b),
                                lambda b: K.yarn_cos_sin(4, 8, 1e4, None, backend=b),
                                lambda b: K.positions_to_slots(torch.zeros(1, 2, dtype=I32), torch.zeros(1, 1, dtype=I32),
                                                               torch.zeros(1, dtype=I32), torch.ones(1, dtype=I32), 16,
                                                               backend=b)],
                         ids=["quant_ue8m0", "hadamard", "yarn_cos_sin", "positions_to_slots"])
def test_torch_only_ops_refuse_triton(op):
    with pytest.raises(ValueError, match="torch-only"):
        op("triton")
    op("torch")


def test_float32_inputs_never_take_triton():
    with pytest.raises(TypeError, match="backend='torch'"):
        K.sparse_mla(torch.zeros(1, 2, 576), torch.zeros(1, 16, 576), torch.zeros(1, 16, dtype=I32), 0.1,
                     backend="triton")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    from dsa.kernels import common
    monkeypatch.setattr(common, "TRITON_INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        common.resolve_backend("triton", torch.device("cpu"), "op")
    assert common.resolve_backend("auto", torch.device("cpu"), "op") == "torch"


def test_block_size_not_multiple_of_16_is_refused_for_triton(monkeypatch):
    from dsa.kernels import common
    monkeypatch.setattr(common, "TRITON_INTERPRET", True)
    with pytest.raises(ValueError, match="block_size"):
        common.resolve_backend("triton", torch.device("cpu"), "op", block_size=24)


# ---- one int check everywhere: bools, floats and tensors are refused, naming the argument

def _int_sites():
    from dsa.cache import IndexerKeyCache, LatentCache
    i32 = dict(dtype=I32)
    return {
        "block_size": lambda v: K.positions_to_slots(torch.zeros(1, 2, **i32), torch.zeros(1, 1, **i32),
                                                     torch.zeros(1, **i32), torch.ones(1, **i32), v),
        "k": lambda v: K.topk_indices(torch.zeros(2, 10), torch.ones(2, **i32), v),
        "group": lambda v: K.quant_ue8m0(torch.zeros(2, 128), v),
        "max_seq_len": lambda v: K.indexer_logits_paged(torch.zeros(1, 1, 4, 128, dtype=torch.float8_e4m3fn),
                                                        torch.zeros(1, 1, 4), IDX, torch.zeros(1, 1, **i32),
                                                        torch.ones(1, **i32), 16, v),
        "max_positions": lambda v: K.yarn_cos_sin(v, 8, 1e4, None),
        "rope_dim": lambda v: K.yarn_cos_sin(4, v, 1e4, None),
        "num_blocks": lambda v: LatentCache(v, 16),
        "head_dim": lambda v: IndexerKeyCache(1, 16, head_dim=v),
    }


@pytest.mark.parametrize("value", [True, 2.0, torch.tensor(2), "2"], ids=["bool", "float", "tensor", "str"])
@pytest.mark.parametrize("site", sorted(_int_sites()))
def test_int_arguments_refuse_non_ints(site, value):
    with pytest.raises(TypeError, match=rf"^{site}: expected an int"):
        _int_sites()[site](value)


def test_int_arguments_take_numpy_ints():
    import numpy as np
    assert K.topk_indices(torch.zeros(2, 10), torch.ones(2, dtype=I32), np.int64(3)).shape == (2, 3)


def test_yarn_refuses_non_positive_theta_and_factor():
    for theta in (0.0, -1e4, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^rope_theta"):
            K.yarn_cos_sin(4, 8, theta, None)
    for factor in (0, -4.0, float("nan")):
        with pytest.raises(ValueError, match=r"^rope_scaling\['factor'\]"):
            K.yarn_cos_sin(4, 8, 1e4, {"type": "yarn", "factor": factor, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="^rope_theta"):  # YaRN divides by ln(theta)
        K.yarn_cos_sin(4, 8, 1, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})


@pytest.fixture(scope="module")
def engine():
    from dsa import Engine
    from model_utils import tiny_model
    return Engine(tiny_model(), num_blocks=8)


@pytest.mark.parametrize("prompt,max_new,arg", [
    ([1, 2, 3], True, "max_new_tokens"), ([1, 2, 3], 2.0, "max_new_tokens"), ([1, 2.5, 3], 2, "prompt_ids"),
    ([1, True, 3], 2, "prompt_ids"), (torch.tensor([1.0, 2.0]), 2, "prompt_ids"), (torch.tensor([True]), 2, "prompt_ids"),
    ("abc", 2, "prompt_ids")], ids=["max_new_bool", "max_new_float", "float_id", "bool_id", "float_tensor",
                                    "bool_tensor", "str"])
def test_engine_refuses_non_int_requests(engine, prompt, max_new, arg):
    with pytest.raises(TypeError, match=rf"^{arg}"):
        engine.add_request(prompt, max_new)
    assert not engine.waiting


@pytest.mark.parametrize("kw,arg", [(dict(num_blocks=True), "num_blocks"), (dict(num_blocks=4.0), "num_blocks"),
                                    (dict(num_blocks=4, max_batch_tokens=True), "max_batch_tokens")],
                         ids=["blocks_bool", "blocks_float", "batch_bool"])
def test_engine_refuses_non_int_sizes(kw, arg):
    from dsa import Engine
    from model_utils import tiny_model
    with pytest.raises(TypeError, match=rf"^{arg}"):
        Engine(tiny_model(), **kw)
