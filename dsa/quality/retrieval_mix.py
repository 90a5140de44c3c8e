"""Training windows with retrieval structure (``dsa fit-indexer --retrieval``): the query rows where a
model looks something up, inside natural text, so that an indexer fitted to the teacher's attention sees them.

A fit on natural text alone draws its query rows at random; the rows that copy from far back (a needle's
value, a repeated span) are rare there, and the fitted indexers miss them. A retrieval window is one of,
with equal odds:

    needle / multikey / passkey   a ``dsa needle`` sample (:func:`dsa.quality.needle.build`) on training
                                  filler, at a random length, depth and needle kind; its rows of interest:
                                  the question and the answer (the rows whose attention must find the needle)
    copy                          natural text in which a span of 16-96 tokens (random tokens, or the text's
                                  own) appears again later; its rows: the second copy (each must attend to
                                  the token after its counterpart in the first)

Its rows of interest are joined by random rows up to ``queries`` (the natural-text fit goes on in the same
window). The needle templates are those ``dsa needle`` asks; the grid's filler comes from sources no fit
trains on (``heldout/``), so the grid measures the lookup, not the filler.
"""
import torch

from dsa.quality.corpus import sample_window
from dsa.quality.fit import sample_queries
from dsa.quality.needle import DEPTHS, KINDS, build

EPISODES = ("needle", "multikey", "passkey", "copy")
LENGTHS = (2048, 4096, 8192)  # a retrieval window's length, drawn per window (at most the fit's context)
SPAN = (16, 96)  # a copied span's length, tokens
FIRST_ID = 17  # SmolLM2's ids 0-16 are control tokens: a random span avoids them


def _pick(options, g: torch.Generator):
    return options[int(torch.randint(0, len(options), (), generator=g))]


def _uniform(lo: int, hi: int, g: torch.Generator) -> int:
    return int(torch.randint(lo, max(lo, hi) + 1, (), generator=g))


def copy_window(streams: dict, t: int, vocab: int, g: torch.Generator) -> tuple:
    """``(ids [t], rows)``: natural text with one span copied later (random tokens half the time)."""
    ids = sample_window(streams, t, g)
    m = _uniform(*SPAN, g)
    a = _uniform(t // 16, t // 2, g)
    b = _uniform(a + m + 64, t - m - 1, g)
    span = torch.randint(FIRST_ID, vocab, (m,), generator=g) if bool(torch.rand((), generator=g) < 0.5) \
        else ids[a:a + m].clone()
    ids[a:a + m] = span
    ids[b:b + m] = span
    return ids, torch.arange(b, b + m - 1)


def needle_window(streams: dict, t: int, task: str, tokenizer, g: torch.Generator) -> tuple:
    """``(ids [t], rows)``: a ``dsa needle`` sample on training filler; rows from the question to the answer's end."""
    s = build(task, t, _pick(DEPTHS, g), _pick(KINDS, g), lambda n: sample_window(streams, n, g), tokenizer, g)
    return s["ids"], torch.arange(s["question_at"] - 1, t - 1)


def retrieval_window(streams: dict, context: int, queries: int, min_position: int, tokenizer, vocab: int,
                     g: torch.Generator) -> tuple:
    """``(ids [T], queries [Q] sorted, episode)``: one retrieval window of a length from :data:`LENGTHS` (at
    most ``context``), its rows of interest and random rows from ``[min_position, T)`` up to ``queries``."""
    t = _pick([n for n in LENGTHS if n <= context] or [context], g)
    episode = _pick(EPISODES, g)
    if episode == "copy":
        ids, rows = copy_window(streams, t, vocab, g)
    else:
        ids, rows = needle_window(streams, t, episode, tokenizer, g)
    rows = rows[-queries:]
    extra = sample_queries(t, queries, min_position, g)
    extra = extra[~torch.isin(extra, rows)][:max(0, queries - len(rows))]
    return ids, torch.cat((rows, extra)).sort().values, episode


def window_source(streams: dict, context: int, queries: int, min_position: int, retrieval: float = 0.0,
                  tokenizer=None, vocab: int | None = None):
    """``draw(g) -> (ids, queries)`` for :func:`dsa.quality.fit.fit`: a natural window of ``context`` tokens
    with random rows, or, with probability ``retrieval``, a :func:`retrieval_window`."""
    if not 0.0 <= retrieval <= 1.0:
        raise ValueError(f"retrieval: expected a share in [0, 1], got {retrieval}")
    if retrieval and (tokenizer is None or vocab is None):
        raise ValueError("retrieval: retrieval windows need the teacher's tokenizer and vocab size")

    def draw(g: torch.Generator) -> tuple:
        if retrieval and bool(torch.rand((), generator=g) < retrieval):
            return retrieval_window(streams, context, queries, min_position, tokenizer, vocab, g)[:2]
        ids = sample_window(streams, context, g)
        return ids, sample_queries(context, queries, min_position, g)
    return draw
