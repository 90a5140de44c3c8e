"""``dsa bench topk``: top-2048 of each logits row, torch.topk in the same run."""
import torch

from dsa.kernels import topk_indices_reference

from .harness import result_row

K = 2048


def run(device, timer, ceilings, args) -> list:
    rows = []
    shapes = [(64, 65536)] if args.quick else [(b, l) for b in (1, 4, 64) for l in (4096, 16384, 65536, 131072)]
    for b, l in shapes:
        logits = torch.randn(b, l, device=device)
        lengths = torch.full((b,), l, dtype=torch.int32, device=device)
        t = timer(lambda: torch.topk(logits, K, dim=1))
        rows.append(result_row("topk", "torch.topk", dict(B=b, L=l, k=K), t, ceilings, bytes_moved=b * l * 4))
        if (b, l) == (64, 65536):
            t = timer(lambda: topk_indices_reference(logits, lengths, K), reps=10)
            rows.append(result_row("topk_indices", "torch-reference", dict(B=b, L=l, k=K), t, ceilings,
                                   bytes_moved=b * l * 4))
    return rows
