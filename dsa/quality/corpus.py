"""Token streams for fitting and evaluation: text files (tokenized by the teacher) or saved token ids.

A ``.txt`` file holds documents separated by ``<|endoftext|>`` (what ``benchmarks/quality/fetch_text.py``
writes); it becomes one stream with that token between documents. A ``.npy`` file holds the ids of
such a stream (``fetch_text.py --tokens`` writes them, so machines without the tokenizer or the text
can still run).
"""
import os

import numpy as np
import torch

SEPARATOR = "<|endoftext|>"


def read_tokens(path: str, tokenizer=None) -> np.ndarray:
    """One file -> int64 ids ``[N]``."""
    if path.endswith(".npy"):
        return np.load(path).astype(np.int64).reshape(-1)
    if tokenizer is None:
        raise ValueError(f"{path}: a text file needs the teacher's tokenizer")
    with open(path, encoding="utf-8") as f:
        docs = [d.strip() for d in f.read().split(SEPARATOR)]
    sep = tokenizer.token_to_id(SEPARATOR)
    ids = []
    for enc in tokenizer.encode_batch([d for d in docs if d]):
        if ids and sep is not None:
            ids.append(sep)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int64)


def save_tokens(ids: np.ndarray, path: str) -> None:
    np.save(path, ids.astype(np.uint16 if ids.max(initial=0) < 1 << 16 else np.int32))


def read_streams(paths, tokenizer=None, min_tokens: int = 1) -> dict:
    """``{name: ids}`` for each path (name: the file name without its extension), in the order of the
    names, whatever the order of ``paths`` (it decides which windows :func:`sample_window` draws)."""
    named = {}
    for p in paths:
        name = os.path.splitext(os.path.basename(p))[0]
        if name in named:
            raise ValueError(f"{named[name]} and {p}: two files named {name!r}")
        named[name] = p
    out = {}
    for name in sorted(named):
        ids = read_tokens(named[name], tokenizer)
        if len(ids) < min_tokens:
            raise ValueError(f"{named[name]}: {len(ids)} tokens, fewer than the {min_tokens} a window needs")
        out[name] = ids
    return out


def sample_window(streams: dict, t: int, generator: torch.Generator) -> torch.Tensor:
    """A random window of ``t`` tokens; streams weighted by their length."""
    names = list(streams)
    sizes = torch.tensor([len(streams[n]) - t + 1 for n in names], dtype=torch.float64)
    ids = streams[names[int(torch.multinomial(sizes, 1, generator=generator))]]
    start = int(torch.randint(0, len(ids) - t + 1, (1,), generator=generator))
    return torch.from_numpy(ids[start:start + t].copy())


def windows(ids: np.ndarray, t: int, count: int) -> list:
    """``count`` evenly spaced windows of ``t`` tokens (fewer when the stream is short)."""
    if len(ids) < t:
        return []
    count = max(1, min(count, len(ids) // t))
    starts = np.linspace(0, len(ids) - t, count).astype(np.int64)
    return [torch.from_numpy(ids[s:s + t].copy()) for s in starts]
