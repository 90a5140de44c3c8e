"""Input validation and backend choice shared by the public ops of ``dsa.kernels``."""
import functools
import math
import numbers
import os

import torch

BACKENDS = ("auto", "torch", "triton")

# Triton's own switch: with TRITON_INTERPRET=1 set before this package is imported, Triton
# kernels run on CPU tensors through its interpreter (the tests use this without a GPU).
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtype=None, shape=None, device=None) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a tensor that matches.

    ``dtype``: a dtype or a tuple of allowed dtypes. ``shape``: a tuple of ints or None
    (wildcards), or an int for the number of dims. ``device``: a device ``t`` must be on.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            raise TypeError(f"{name}: expected dtype {_dtype_names(allowed)}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = shape if isinstance(shape, int) else len(shape)
        ok = t.dim() == ndim and (isinstance(shape, int) or all(
            want is None or want == got for want, got in zip(shape, t.shape)))
        if not ok:
            want = f"{ndim} dims" if isinstance(shape, int) else "[" + ", ".join(
                "*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def check_same_device(**tensors) -> torch.device:
    """All tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            others = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"{name}: all tensors must be on one device, got {others}")
    return first


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as a Python int; TypeError naming ``name`` unless it is an integer (Python or numpy;
    never a bool, a float or a tensor), ValueError when it is below ``minimum``."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_real(name: str, value, *, positive: bool = False) -> float:
    """``value`` as a float: TypeError naming ``name`` unless it is a real number (never a bool, a string
    or a tensor), ValueError unless it is finite (and > 0 with ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}: expected a finite number{' > 0' if positive else ''}, got {value!r}")
    return value


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints or integer arrays (``b > 0``): blocks for ``a`` tokens, tiles for ``a`` columns."""
    return -(-a // b)


# The SM count the launchers size their grids by off CUDA (only the interpreter launches there): small,
# so the tests' grids split their work over programs as on a GPU.
INTERPRETER_SM_COUNT = 8


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached per device index), or
    :data:`INTERPRETER_SM_COUNT` for any other device."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_block_size(block_size, *, name: str = "block_size") -> int:
    return check_int(name, block_size, minimum=1)


def resolve_backend(backend: str, device: torch.device, op: str, *, triton_dtypes_ok: bool = True,
                    block_size: int | None = None) -> str:
    """Return ``"torch"`` or ``"triton"`` for one call of op ``op``.

    ``"auto"`` runs Triton on CUDA tensors whose dtypes the kernel takes (``triton_dtypes_ok``)
    and the reference otherwise. ``"triton"`` needs CUDA tensors, or CPU tensors with
    ``TRITON_INTERPRET=1`` set before ``dsa.kernels`` was imported. Triton kernels take block
    sizes that are multiples of 16; on CUDA any other size is refused, never silently rerouted.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto" and (device.type != "cuda" or not triton_dtypes_ok):
        return "torch"
    if not triton_dtypes_ok:
        raise TypeError(f"{op}: the Triton kernel takes the low-precision dtypes of its docstring; float32, "
                        "float64 and exact-precision inputs run through backend='torch'")
    if device.type != "cuda" and not (device.type == "cpu" and TRITON_INTERPRET):
        raise ValueError(f"{op}: backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
                         f"set before dsa.kernels is imported; got tensors on {device}")
    if block_size is not None and block_size % 16 != 0:
        raise ValueError(f"block_size: the Triton kernel of {op} takes multiples of 16, got {block_size}; "
                         "use backend='torch' for other block sizes")
    return "triton"


def torch_only(backend: str, op: str) -> None:
    """For ops with no Triton version: validate ``backend`` and refuse ``"triton"``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        raise ValueError(f"{op}: no Triton version exists (torch-only op); use backend='auto' or 'torch'")


def compute_dtype(*tensors) -> torch.dtype:
    """float64 when any float input is float64, else float32: the references' arithmetic."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def hopper_platform_reason(available: bool, unavailable: str, tested: tuple, device: torch.device,
                           capability: tuple[int, int] | None, triton_version: str | None) -> str | None:
    """Why a Gluon kernel for sm_90 cannot run here, or None: ``available`` (its Gluon API imported,
    else ``unavailable`` says what is missing), a Triton release it has run on (``tested`` prefixes),
    a CUDA device of capability (9, 0). ``capability`` and ``triton_version`` default to the device's
    and the installed ones (tests pass them to decide without a GPU)."""
    import triton

    version = triton.__version__ if triton_version is None else triton_version
    if not available:
        return unavailable
    if not version.startswith(tested):
        return f"the kernel has run on Triton {', '.join(tested)}, this is Triton {version}"
    if device.type != "cuda":
        return f"it runs on CUDA devices, got {device}"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != (9, 0):
        return f"it needs an sm_90 (Hopper) device, got sm_{capability[0]}{capability[1]}"
    return None


def choose_hopper(backend: str, reason) -> bool:
    """Whether a call that runs a Triton kernel runs the Hopper one: ``backend="hopper"`` asks for it
    (ValueError naming ``reason()`` where it cannot run), ``"auto"`` takes it where ``reason()`` is
    None, any other backend keeps the portable kernel (``reason`` is not called)."""
    if backend not in ("auto", "hopper"):
        return False
    why = reason()
    if backend == "hopper" and why is not None:
        raise ValueError(f"backend: 'hopper' cannot run this call: {why}; use backend='triton' or 'auto'")
    return why is None
