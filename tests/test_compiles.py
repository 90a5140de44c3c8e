"""The compile counter (``dsa.kernels.compiles``) and the kernels' specialization declarations.

Under the interpreter nothing compiles, so the counter's hooks are exercised in a subprocess that
compiles for sm_90 on the CPU: Triton's JIT with a stand-in CUDA driver (the compiler and ptxas run
without a GPU; nothing is launched). ``tests/test_compiles_gpu.py`` counts the real kernels on a GPU.
"""
import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dsa import kernels as K
from dsa.kernels import compiles

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Per entry kernel (launched with a grid): the non-constexpr arguments that may specialize besides
# pointers (``*_ptr`` / ``*_desc``): ints fixed by the model or the cache layout, and floats (never
# specialized). Every other argument changes per step and must be in ``do_not_specialize``. ``tables``:
# the int tables a step passes as views of its plan at any int32 offset, which must be in
# ``do_not_specialize_on_alignment``.
ENTRY_KERNELS = {
    ("pick_ids", "_pick_ids_kernel"): dict(
        fixed={"stride_default", "stride_tokens", "stride_index", "stride_ids", "stride_ids_index", "stride_out"},
        tables={"default_ptr", "tokens_ptr", "index_ptr", "ids_ptr", "ids_index_ptr", "out_ptr"}),
    ("greedy_accept", "_greedy_accept_kernel"): dict(
        fixed={"stride_ab", "stride_aj", "stride_db", "stride_dj"}, tables={"argmax_ptr", "drafts_ptr"}),
    ("indexer_key_write", "_indexer_key_write_kernel"): dict(
        fixed={"stride_kt", "stride_block", "hadamard_scale"}, tables={"slot_ptr"}),
    ("indexer_logits_paged", "_indexer_logits_paged_kernel"): dict(
        fixed={"stride_block"}, tables={"w_ptr", "table_ptr", "lens_ptr"}),
    ("indexer_logits_paged", "_indexer_logits_paged_tma_kernel"): dict(
        fixed=set(), tables={"w_ptr", "table_ptr", "lens_ptr"}),
    ("indexer_logits_ragged", "_indexer_logits_ragged_kernel"): dict(
        fixed=set(), tables={"w_ptr", "starts_ptr", "ends_ptr"}),
    ("indexer_logits_ragged_hopper", "_ragged_hopper_kernel"): dict(
        fixed=set(), tables={"w_ptr", "starts_ptr", "ends_ptr"}),
    ("indexer_query_prep", "_indexer_query_prep_kernel"): dict(
        fixed={"folded", "hadamard_scale"}, tables=set()),
    ("latent_write", "_latent_write_kernel"): dict(
        fixed={"stride_kv", "stride_pe", "stride_cb", "stride_cp", "block_size"}, tables={"slot_ptr"}),
    ("mla_split", "_mla_combine_kernel"): dict(fixed=set(), tables=set()),
    ("rms_norm", "_rms_norm_kernel"): dict(fixed={"stride_x", "stride_r", "stride_out", "eps"}, tables=set()),
    ("silu_mul", "_silu_mul_kernel"): dict(fixed={"cols", "stride_g", "stride_u"}, tables=set()),
    ("rope", "_rope_at_kernel"): dict(fixed=set(), tables={"pos_ptr"}),
    ("rope", "_rope_rotate_kernel"): dict(
        fixed={"heads", "stride_xt", "stride_xh", "stride_ot", "stride_oh"}, tables=set()),
    ("sparse_mla", "_mla_attn_kernel"): dict(
        fixed={"scale_log2", "H", "stride_cb", "stride_cp", "block_size"},
        tables={"slots_ptr", "block_table_ptr", "seq_lens_ptr"}),
    ("sparse_mla_hopper", "_mla_hopper_kernel"): dict(
        fixed={"scale_log2"}, tables={"slots_ptr", "block_table_ptr", "seq_lens_ptr"}),
    ("topk.launch", "_scan_kernel"): dict(
        fixed={"stride_o", "P", "k"}, tables={"lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"}),
    ("topk.launch", "_finish_kernel"): dict(
        fixed={"stride_o", "P", "k"}, tables={"lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"}),
    ("topk.launch", "_place_kernel"): dict(
        fixed={"stride_o", "P", "k"}, tables={"lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"}),
    ("topk.launch", "_scan_tiles_kernel"): dict(
        fixed={"stride_o", "P", "k"}, tables={"lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"}),
    ("topk.bound", "_tile_max_kernel"): dict(fixed={"k"}, tables={"lengths_ptr", "starts_ptr"}),
    ("topk.bound", "_bound_kernel"): dict(fixed={"k"}, tables={"lengths_ptr", "starts_ptr"}),
}


def _launched_kernels() -> set:
    """Names of the kernels launched as ``name[grid](...)`` / ``name[(...)](...)`` in kernels/ (its subpackages too)."""
    found = set()
    for path in (ROOT / "kernels").rglob("*.py"):
        found.update(re.findall(r"\b(_\w+_kernel)\[(?:grid\]|\()", path.read_text()))
    return found


def _declared(kernel):
    """(parameter names, constexpr names, do_not_specialize, do_not_specialize_on_alignment) of a
    JITFunction / GluonJITFunction, or of the interpreter's InterpretedFunction (names or indices)."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = [p.name for p in params]
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    if hasattr(kernel, "do_not_specialize"):
        dns, dnsa = kernel.do_not_specialize, kernel.do_not_specialize_on_alignment
    else:
        dns, dnsa = kernel.kwargs.get("do_not_specialize"), kernel.kwargs.get("do_not_specialize_on_alignment")

    def resolve(entries):
        out = set()
        for e in entries or ():
            assert isinstance(e, str) and e in names or isinstance(e, int) and 0 <= e < len(names), \
                f"{kernel.fn.__name__}: do_not_specialize entry {e!r} names no argument (Triton ignores it)"
            out.add(names[e] if isinstance(e, int) else e)
        return out

    return names, constexprs, resolve(dns), resolve(dnsa)


def test_every_launched_kernel_is_in_the_table():
    launched, listed = _launched_kernels(), {kernel for _, kernel in ENTRY_KERNELS}
    assert launched == listed, f"launched but not in ENTRY_KERNELS: {sorted(launched - listed)}; " \
                               f"listed but never launched: {sorted(listed - launched)}"


@pytest.mark.parametrize("module,name", sorted(ENTRY_KERNELS))
def test_per_step_ints_are_not_specialized(module, name):
    mod = importlib.import_module(f"dsa.kernels.{module}")
    if module.endswith("_hopper") and not mod.AVAILABLE:
        pytest.skip("Gluon is not importable in this Triton")
    kernel = getattr(mod, name)
    names, constexprs, dns, dnsa = _declared(kernel)
    entry = ENTRY_KERNELS[(module, name)]
    runtime = [n for n in names if n not in constexprs]
    pointers = {n for n in runtime if n.endswith(("_ptr", "_desc"))}
    assert entry["fixed"] <= set(runtime), f"{name}: the table names unknown arguments {entry['fixed'] - set(runtime)}"
    per_step = set(runtime) - pointers - entry["fixed"]
    assert per_step <= dns, f"{name}: per-step arguments {sorted(per_step - dns)} are specialized; declare them in " \
                            "do_not_specialize (or, if fixed by the model, in this test's table)"
    assert not dns & constexprs, f"{name}: constexprs in do_not_specialize: {sorted(dns & constexprs)}"
    assert entry["tables"] <= dnsa, f"{name}: {sorted(entry['tables'] - dnsa)} may be plan views at any offset; " \
                                    "declare them in do_not_specialize_on_alignment"


def test_listeners_and_install_under_the_interpreter(device):
    compiles.install()
    compiles.install()  # idempotent
    import triton
    assert triton.knobs.runtime.jit_post_compile_hook is compiles._post_compile
    assert triton.knobs.compilation.listener is compiles._compile_listener
    seen = []

    def listener(name, key):
        seen.append((name, key))

    compiles.add_listener(listener)
    compiles.add_listener(listener)  # once per function
    before = compiles.total()
    q = torch.randn(5, 4, 32, dtype=torch.bfloat16, device=device)
    w = torch.randn(5, 4, dtype=torch.float32, device=device)
    K.indexer_query_prep(q, w, True, backend="triton")
    if device.type == "cpu":  # the interpreter compiles nothing: no hook fires
        assert compiles.total() == before and not seen
    compiles.remove_listener(listener)
    with pytest.raises(ValueError, match="^fn"):
        compiles.remove_listener(listener)
    with pytest.raises(TypeError, match="^fn"):
        compiles.add_listener(3)
    assert isinstance(compiles.counts(), dict) and compiles.disk_hits() <= compiles.total()


_HOOK_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class StandIn(DriverBase):  # what the JIT asks the driver before compiling; nothing launches
        @staticmethod
        def is_active():
            return True
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self):
            return torch.device("cpu")
        def get_current_device(self):
            return 0
        def get_current_stream(self, device=None):
            return 0
        def get_device_interface(self):
            return torch.cuda
        def get_benchmarker(self):
            raise NotImplementedError
        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError
        def clear_cache(self, cache):
            raise NotImplementedError
        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

    driver.set_active(StandIn())
    earlier = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["fn"].name)
    from dsa.kernels import compiles
    compiles.install()
    compiles.install()
    seen = []
    compiles.add_listener(lambda name, key: seen.append((name, key)))

    @triton.jit
    def specialized(x_ptr, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    @triton.jit(do_not_specialize=["n"])
    def runtime(x_ptr, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.zeros(64)
    for n in (1, 5, 16, 17, 32, 1):
        specialized.warmup(x, n, B=16, grid=(1,))
        runtime.warmup(x, n, B=16, grid=(1,))
    print("COUNTS", sorted(compiles.counts().items()))
    print("TOTAL", compiles.total(), "DISK", compiles.disk_hits(), "EARLIER", len(earlier), "SEEN", len(seen))
''')


def _run_hook_script(tmp_path, cache_dir):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache_dir), CUDA_VISIBLE_DEVICES="",
               TRITON_DEFAULT_FP_FUSION="1")
    script = tmp_path / "hook.py"
    script.write_text(_HOOK_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("COUNTS", "TOTAL")))
    return eval(lines["COUNTS"]), lines["TOTAL"].split()


def test_hooks_count_each_variant_once_and_chain(tmp_path):
    """Three value classes (== 1, a multiple of 16, other) give three variants of a specialized int,
    one with ``do_not_specialize``; a second process loads the same four variants from the disk cache."""
    counts, total = _run_hook_script(tmp_path, tmp_path / "cache")
    assert total == ["4", "DISK", "0", "EARLIER", "4", "SEEN", "4"], total
    by_kernel = {}
    for (name, key), n in counts:
        assert n == 1 and len(key) < 200, (name, key, n)
        by_kernel.setdefault(name, []).append(key)
    assert sorted(by_kernel) == ["runtime", "specialized"]
    assert sorted(by_kernel["specialized"]) == [
        "num_warps=4 num_stages=3; x_ptr:*fp32/16, n:i32, B=16",
        "num_warps=4 num_stages=3; x_ptr:*fp32/16, n:i32/16, B=16",
        "num_warps=4 num_stages=3; x_ptr:*fp32/16, n==1, B=16"]
    assert by_kernel["runtime"] == ["num_warps=4 num_stages=3; x_ptr:*fp32/16, n:i32, B=16"]
    _, total = _run_hook_script(tmp_path, tmp_path / "cache")
    assert total == ["4", "DISK", "4", "EARLIER", "4", "SEEN", "4"], total
