"""What the benchmarks, the quality tools and the commands record beside their results: the
environment of a run (:func:`env_info`) and figures (:func:`save_figure`, after
:func:`require_matplotlib` has checked the plotting extra before any work)."""
import datetime
import importlib.util
import os
import platform
import subprocess

import torch

from dsa.errors import DSAError


def git_sha() -> str:
    """The checkout's commit, ``-dirty`` when tracked files changed; ``"unknown"`` outside git."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def env_info() -> dict:
    """torch, Python, Triton, the commit, the date and time (UTC), and the GPU where there is one."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "git_sha": git_sha(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1))
    return info


def require_matplotlib(command: str) -> None:
    """A :class:`DSAError` naming the extra to install when matplotlib is missing (call it before any work)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise DSAError(f"{command}: plotting needs matplotlib; install it with "
                       "pip install 'deepseek-sparse-attention[eval]' (or pip install matplotlib)")


def save_figure(fig, out_dir: str, name: str) -> str:
    """``fig`` as ``out_dir/name`` (laid out tight, 110 dpi), then closed; returns the path."""
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
