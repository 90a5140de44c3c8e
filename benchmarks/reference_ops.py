"""Run a ``dsa`` command with the model's fused small ops put back to their torch ops: the same-run baseline of
the launch-count work of issue #39 (``rms_norm`` with its residual add, ``silu_mul``, ``rope_rotate`` and
``rope_at`` each one Triton launch on CUDA, against five, two, four or five, and about twelve torch launches).

    python benchmarks/reference_ops.py [--reference] -- bench engine --speculative-tokens 2 --quick ...

Without ``--reference`` the command runs as ``python -m dsa`` would (the control of an A/B pair run the same
way); with it, the model's modules call the references (the numerics of the commit before the kernels, but
for their last-place rounding). Only the model's calls are replaced; nothing is written to the package.
"""
import argparse
import sys


def use_reference_ops() -> None:
    from dsa import kernels
    from dsa.indexer import lightning
    from dsa.model import attention, layers, model

    def rope_rotate(x, rot, interleaved, *, out=None, backend="auto"):
        y = kernels.rope_rotate_reference(x, rot, interleaved)
        return y if out is None else out.copy_(y)

    layers.rms_norm = lambda x, weight, eps, residual=None: kernels.rms_norm_reference(x, weight, eps, residual)
    layers.silu_mul = kernels.silu_mul_reference
    attention.rope_rotate = lightning.rope_rotate = rope_rotate
    model.rope_at = kernels.rope_at_reference


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", action="store_true", help="the model's small ops as torch ops (the baseline)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the dsa command and its flags, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("command: give the dsa command after --, e.g. -- bench engine --quick")
    if args.reference:
        use_reference_ops()
    from dsa.cli import main as dsa_main
    return dsa_main(command)


if __name__ == "__main__":
    sys.exit(main())
