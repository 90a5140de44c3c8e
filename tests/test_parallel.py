"""Tensor parallelism on CPU: 2 processes over gloo give the single-process model's logits and greedy
tokens (float32, exact indexer), with each rank holding about half of the sharded weights."""
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsa import DSAConfig, DSAModel, Engine, SamplingParams

KINDS = ("v32", "glm")
TIMEOUT_S = 240


def _config(kind: str) -> DSAConfig:
    common = dict(index_topk=16, index_n_heads=4, indexer_precision="exact", num_attention_heads=4)
    if kind == "v32":
        return DSAConfig.tiny(index_topk_pattern="FSFS", n_routed_experts=None, **common)
    return DSAConfig.tiny(model_type="glm_moe_dsa", indexer_rope_interleave=True, index_topk_freq=2,
                          index_skip_topk_offset=1, rope_scaling=None, rope_theta=1e6, n_shared_experts=1, **common)


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 9, 25)]
    return ids, prompts


def _run(model):
    ids, prompts = _inputs(model.config.vocab_size)
    sampled = SamplingParams(max_tokens=6, temperature=1.0)  # unseeded: the ranks must still agree
    return {"logits": model(ids), "tokens": Engine(model, num_blocks=64).generate(prompts, 6),
            "sampled": Engine(model, num_blocks=64).generate(prompts, sampling=sampled),
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _worker(rank, world, port, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for kind in KINDS:
            model = DSAModel.random(_config(kind), seed=0, dtype=torch.float32, device="cpu", tp_size=world,
                                    tp_check=True)
            torch.save(_run(model), os.path.join(out, f"{kind}-rank{rank}.pt"))
        model = DSAModel.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32, device="cpu", tp_size=world,
                                         indexer_precision="exact")
        torch.save(_run(model), os.path.join(out, f"hf-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world, *args):
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes; a failing rank raises here."""
    ctx = mp.start_processes(fn, args=(world, _free_port(), *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # True once every rank has exited
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the {world} ranks did not finish within {TIMEOUT_S} s")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The ranks' results for random V3.2 and GLM-MoE-DSA models and a checkpoint saved by transformers."""
    from test_interop import _save
    out = tmp_path_factory.mktemp("tp")
    _save("deepseek_v32", out / "hf")
    spawn(_worker, 2, str(out))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_the_single_process_results(kind, two_ranks):
    one = _run(DSAModel.random(_config(kind), seed=0, dtype=torch.float32, device="cpu"))
    ranks = [torch.load(two_ranks / f"{kind}-rank{r}.pt") for r in range(2)]
    for r in ranks:
        err = float((r["logits"] - one["logits"]).abs().max())
        assert err < 1e-5, f"logits differ from one process by {err:.3g}"
        assert r["tokens"] == one["tokens"]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # every rank holds the same logits
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # and samples the same tokens
    sharded = sum(p.numel() * p.element_size() for name, p in
                  DSAModel.random(_config(kind), seed=0, dtype=torch.float32, device="cpu").named_parameters()
                  if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight", "proj.weight"))
                  and ".indexer." not in name and "kv_a_proj" not in name and "q_a_proj" not in name)
    saved = one["bytes"] - ranks[0]["bytes"]
    assert abs(saved - sharded / 2) <= 0.05 * sharded, (saved, sharded)  # each rank holds half of the split tensors


def test_a_transformers_checkpoint_loads_sharded(two_ranks):
    one = _run(DSAModel.from_pretrained(two_ranks / "hf", dtype=torch.float32, device="cpu",
                                        indexer_precision="exact"))
    for r in range(2):
        got = torch.load(two_ranks / f"hf-rank{r}.pt")
        assert float((got["logits"] - one["logits"]).abs().max()) < 1e-5 and got["tokens"] == one["tokens"]
        assert got["bytes"] < one["bytes"]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_shard_of_fp8_blocks(rank, tmp_path):
    """Split rows of q_b_proj (2 x 192) cut through a 128-row scale block: the shard dequantizes with
    the blocks of its own rows."""
    from dsa.model.loading import read_pretrained
    from dsa.model.parallel import TensorParallel
    from model_utils import tiny_model
    from test_loading import _hf_tensors, _quantize_fp8_block, _write
    tensors = {}
    for k, v in _hf_tensors(tiny_model(seed=3, block_size=16)).items():
        if v.dim() == 2 and "proj" in k and v.shape[0] >= 64:
            tensors[k], tensors[k + "_scale_inv"] = _quantize_fp8_block(v)
        else:
            tensors[k] = v
    _write(tmp_path, tensors, shards=2)
    tp = TensorParallel(size=2, rank=rank)
    config, full = read_pretrained(tmp_path)
    _, part = read_pretrained(tmp_path, tp=tp)
    experts = [k for k in full if ".experts." in k]
    assert experts and all(tp.holds(k) == (k in part) for k in experts)
    for name, t in part.items():
        index = tp.shard(name, tuple(full[name].shape), config)
        assert torch.equal(t, full[name] if index is None else full[name][index]), name
    assert part["layers.0.self_attn.q_b_proj.weight"].shape[0] == 2 * 96


def test_tp_size_without_torchrun_is_explained():
    with pytest.raises(RuntimeError, match="torchrun"):
        DSAModel.random(_config("v32"), seed=0, dtype=torch.float32, device="cpu", tp_size=2)


def _reduce_worker(rank, world, port, out):
    """The all-reduce on gloo: the process group's path, in place; the bench's no-op switch."""
    from dsa.model.parallel import init_tensor_parallel, without_all_reduce
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.pop(name, None)
    os.environ["NCCL_NVLS_ENABLE"] = "7"  # set by the user: kept
    tp = init_tensor_parallel(world, backend="gloo")
    try:
        got = {"env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                       "NVSHMEM_DISABLE_NVLS")},
               "describe": tp.reducer.describe()}
        x = torch.full((3, 5), float(rank + 1))
        y = tp.all_reduce(x)
        got["summed"], got["in_place"] = y.clone(), y is x
        got["bf16"] = tp.all_reduce(torch.full((4,), rank + 0.5, dtype=torch.bfloat16)).clone()
        with without_all_reduce():
            with without_all_reduce():  # nests
                pass
            got["skipped"] = tp.all_reduce(torch.full((2,), float(rank + 1))).clone()
        got["after"] = tp.all_reduce(torch.full((2,), float(rank + 1))).clone()
        try:
            tp.reducer.one_shot(torch.ones(4))
        except ValueError as e:
            got["one_shot_error"] = str(e)
        got["staged"] = _staged_calls(tp.reducer, rank)
        torch.save(got, os.path.join(out, f"reduce-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


class _GlooSymmOps:
    """Stands in for torch.ops.symm_mem on CPU (it has no CPU kernels): the same in/out contract,
    summed by gloo, checking that the kernels get the symmetric buffer; records the calls."""

    def __init__(self, buffer):
        self.buffer, self.calls = buffer, []

    def _check(self, buf, op, name):
        assert buf.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr() and op == "sum"

    def one_shot_all_reduce_out(self, buf, op, name, out):
        self._check(buf, op, name)
        self.calls.append("one_shot")
        summed = buf.clone()
        dist.all_reduce(summed)
        return out.copy_(summed)

    def two_shot_all_reduce_(self, buf, op, name):
        self._check(buf, op, name)
        self.calls.append("two_shot")
        dist.all_reduce(buf)
        return buf


def _staged_calls(reducer, rank) -> dict:
    """The symm_mem path's dispatch and copies, its kernels replaced by gloo (see _GlooSymmOps)."""
    from dsa.model.allreduce import MAX_BYTES
    reducer.buffer = torch.full((MAX_BYTES,), 255, dtype=torch.uint8)
    reducer.group_name, reducer.ops = "world", _GlooSymmOps(reducer.buffer)
    out = {}
    for name, x in {"4KiB": torch.full((1024,), rank + 1.0), "512KiB": torch.full((512, 512), rank + 1.0,
                                                                                   dtype=torch.bfloat16),
                    "2MiB": torch.full((512, 1024), rank + 1.0), "fp16": torch.full((8,), rank + 1.0,
                                                                                   dtype=torch.float16)}.items():
        before = len(reducer.ops.calls)
        y = reducer(x)
        out[name] = (y is x, bool((x == 3).all()), reducer.ops.calls[before:])
    reducer.buffer = None
    return out


def test_all_reduce_on_gloo_takes_the_process_group_path(tmp_path):
    spawn(_reduce_worker, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"reduce-rank{rank}.pt")
        assert got["env"] == {"NCCL_NVLS_ENABLE": "7", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                              "NVSHMEM_DISABLE_NVLS": "1"}
        d = got["describe"]
        assert d["path"] == "gloo" and "needs NCCL" in d["reason"] and d["ranks"] == 2 and d["symm_mem_max_bytes"] == 0
        assert torch.equal(got["summed"], torch.full((3, 5), 3.0)) and got["in_place"]
        assert torch.equal(got["bf16"], torch.full((4,), 2.0, dtype=torch.bfloat16))
        assert torch.equal(got["skipped"], torch.full((2,), float(rank + 1)))  # each rank keeps its own part
        assert torch.equal(got["after"], torch.full((2,), 3.0))
        assert "needs the symm_mem path" in got["one_shot_error"] and "path gloo" in got["one_shot_error"]
        assert got["staged"] == {"4KiB": (True, True, ["one_shot"]), "512KiB": (True, True, ["two_shot"]),
                                 "2MiB": (True, True, []), "fp16": (True, True, [])}  # the last two: gloo


def test_the_all_reduce_path_choice():
    from dsa.model.allreduce import choose_path
    assert choose_path("nccl", True, ["a", "a"], True) == ("symm_mem", "NCCL on CUDA, every rank on one host")
    assert choose_path("gloo", False, ["a", "a"], True)[0] == "gloo"
    assert choose_path("nccl", False, ["a", "a"], True)[0] == "nccl"
    path, reason = choose_path("nccl", True, ["a", "b", "a"], True)
    assert path == "nccl" and "2 hosts" in reason
    path, reason = choose_path("nccl", True, ["a", "a"], False)
    assert path == "nccl" and "one_shot_all_reduce_out" in reason


def test_which_tensors_fit_the_symmetric_buffer():
    from dsa.model.allreduce import MAX_BYTES, fits
    assert fits(torch.zeros(64, 7168, dtype=torch.bfloat16), MAX_BYTES)  # B = 64 decode rows: 0.9 MiB
    assert not fits(torch.zeros(128, 7168, dtype=torch.bfloat16), MAX_BYTES)  # 1.8 MiB: NCCL
    assert fits(torch.zeros(8, dtype=torch.float32), MAX_BYTES)
    assert not fits(torch.zeros(8, dtype=torch.float16), MAX_BYTES)  # the kernels add bf16 and fp32 only
    assert not fits(torch.zeros(3, dtype=torch.bfloat16), MAX_BYTES)  # 6 bytes: not a multiple of 4
    assert not fits(torch.zeros(8, 8, dtype=torch.float32).t(), MAX_BYTES)  # not contiguous
    assert not fits(torch.zeros(9, dtype=torch.float32)[1:], MAX_BYTES)  # 4-byte aligned only
    assert not fits(torch.zeros(0, dtype=torch.float32), MAX_BYTES)


def test_without_all_reduce_is_off_outside_its_block():
    from dsa.model import parallel
    with parallel.without_all_reduce():
        assert parallel._skip_all_reduce
    assert not parallel._skip_all_reduce
    with pytest.raises(KeyError):
        with parallel.without_all_reduce():
            raise KeyError("x")
    assert not parallel._skip_all_reduce
