"""Counts the kernel variants Triton builds in this process: every Triton and Gluon kernel, every
specialization.

Triton builds a variant the first time a kernel is launched with a new specialization key (the
argument types, the int arguments' value classes ``== 1`` / ``% 16 == 0`` / other unless declared
``do_not_specialize``, pointer alignment, constexprs, launch options). A variant is either compiled
(seconds) or loaded from Triton's on-disk cache (milliseconds, after a compile by an earlier process
with the same Triton); both are counted, since a variant met after warm-up on a warm disk cache is a
compile on a fresh machine. :func:`disk_hits` says how many came from the disk cache.

``install()`` chains two Triton hooks (3.6 and 3.9 have both, with the same keywords):
``triton.knobs.runtime.jit_post_compile_hook``, called by the JIT after it built a variant (Triton's
in-memory kernel cache missed), and ``triton.knobs.compilation.listener``, called inside
``triton.compile`` with ``cache_hit`` (whether it loaded the disk cache). Hooks already installed keep
being called. Under ``TRITON_INTERPRET=1`` nothing is compiled and neither hook fires: the counts
stay 0. With Triton's async compile mode the disk-cache flag is not seen (counted as compiled).

The key of a variant is short and readable: ``num_warps=4 num_stages=3; x_ptr:*bf16/16, n:i32, m==1,
BLOCK=64`` (``/16``: specialized as a multiple of 16 (an address: 16-byte aligned); ``m==1``: an int
argument specialized as ``== 1``; ``BLOCK=64``: a constexpr parameter).
"""
import threading

import triton

_lock = threading.Lock()
_counts: dict = {}  # (kernel name, key) -> variants built
_disk_hits = 0
_listeners: list = []
_installed = False
_chained = {"post_compile": None, "listener": None}  # the hooks found at install
_flag = threading.local()  # cache_hit of the last triton.compile on this thread


def _knobs():
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook") or \
            not hasattr(knobs.compilation, "listener"):
        raise RuntimeError(f"dsa.kernels.compiles: Triton {triton.__version__} has no "
                           "knobs.runtime.jit_post_compile_hook / knobs.compilation.listener (Triton >= 3.4 has)")
    return knobs


def _variant_key(compile_info: dict, constexprs: set) -> str:
    """The readable key of one variant from the ``compile`` dict Triton's JIT hooks receive;
    ``constexprs``: the names of the kernel's ``constexpr`` parameters."""
    signature = compile_info["signature"]
    constants = {path[0]: value for path, value in compile_info["constants"].items() if len(path) == 1}
    attrs = compile_info["configs"][0] if compile_info.get("configs") else {}
    parts = []
    for i, (name, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            value = constants.get(i)
            value = getattr(value, "value", value)
            parts.append(f"{name}={value}" if name in constexprs else f"{name}=={value}")  # == : an int == 1
        else:
            aligned = any(a[0] == "tt.divisibility" for a in attrs.get((i,), ()))
            parts.append(f"{name}:{ty}{'/16' if aligned else ''}")
    return f"num_warps={compile_info['num_warps']} num_stages={compile_info['num_stages']}; " + ", ".join(parts)


def _compile_listener(**kwargs):
    _flag.cache_hit = bool(kwargs.get("cache_hit"))
    if _chained["listener"] is not None:
        _chained["listener"](**kwargs)


def _post_compile(**kwargs):
    global _disk_hits
    fn = kwargs["fn"]
    name = fn.name
    key = _variant_key(kwargs["compile"], {p.name for p in fn.jit_function.params if p.is_constexpr})
    disk = getattr(_flag, "cache_hit", False)
    _flag.cache_hit = False
    with _lock:
        _counts[(name, key)] = _counts.get((name, key), 0) + 1
        _disk_hits += disk
        listeners = list(_listeners)
    for listener in listeners:
        listener(name, key)
    if _chained["post_compile"] is not None:
        return _chained["post_compile"](**kwargs)
    return None


def install() -> None:
    """Start counting (idempotent; the engine calls it at start). Hooks already set are chained."""
    global _installed
    knobs = _knobs()
    with _lock:
        if _installed:
            return
        _chained["post_compile"] = knobs.runtime.jit_post_compile_hook
        _chained["listener"] = knobs.compilation.listener
        knobs.runtime.jit_post_compile_hook = _post_compile
        knobs.compilation.listener = _compile_listener
        _installed = True


def counts() -> dict:
    """A copy of ``{(kernel name, key): variants built}`` since :func:`install`."""
    with _lock:
        return dict(_counts)


def total() -> int:
    """Variants built since :func:`install` (compiled or loaded from the disk cache)."""
    with _lock:
        return sum(_counts.values())


def disk_hits() -> int:
    """How many of :func:`total` Triton loaded from its on-disk cache instead of compiling."""
    with _lock:
        return _disk_hits


def add_listener(fn) -> None:
    """Call ``fn(kernel_name, key)`` on every variant built from now on (once per ``fn``)."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    with _lock:
        if fn not in _listeners:
            _listeners.append(fn)


def remove_listener(fn) -> None:
    """Stop calling ``fn``; ValueError if it was not added."""
    with _lock:
        if fn not in _listeners:
            raise ValueError(f"fn: {fn!r} is not a listener")
        _listeners.remove(fn)
