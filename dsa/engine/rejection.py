"""The rejection sampler of speculative decoding: which draft tokens a verify step accepts, and the token
after them, so that every token follows the target model's distribution.

A request with ``k`` draft tokens ``d_1 .. d_k`` is verified by ``k + 1`` target rows: row ``j`` holds the
target's logits for the token after ``d_j`` (row 0: after the request's last token). With ``p_j`` the
target's distribution at row ``j`` after the request's sampling (temperature, top-k, top-p, min-p, as
:func:`~dsa.engine.sampling.keep_mask`) and ``q_j`` the drafter's (``None``: a deterministic drafter,
``q_j`` one-hot on ``d_{j+1}``), draft ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``
(Leviathan et al., Chen et al.); at the first rejection the token is drawn from ``max(p_j - q_j, 0)``
(renormalized), and when all ``k`` are accepted a bonus token is drawn from ``p_k``. Greedy requests
(temperature 0) accept the longest prefix of drafts equal to the target's argmax and then take the argmax:
exactly the tokens of plain decoding.

The draws are counter-based like the sampler's (a hash of the request's seed and the position of the token,
:mod:`dsa.engine.sampling`): the acceptance uniform from a salted key, the residual and bonus draws by
Gumbel-max, so a seeded request gives the same tokens alone or in any batch. One batched operation over
``[B, N + 1]`` rows on the logits' device; no host sync.
"""
import math

import torch

from dsa.engine.sampling import hash32, keep_mask, uniform_noise
from dsa.kernels import greedy_accept

ACCEPT_SALT = 0x2545F491  # the acceptance uniform's keys: the position keys xor this


def _accept_uniform(keys: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` fp32 in (0, 1): one uniform per draft, a hash of its row's salted keys and its token."""
    b, n = drafts.shape
    k = (keys[:, :n] ^ ACCEPT_SALT).reshape(b * n, 2)
    vocab_hash = hash32(drafts.clamp_min(0).reshape(b * n, 1))  # [B*N, 1]: one "vocabulary entry" per row
    bits = hash32(((vocab_hash ^ k[:, :1]) + k[:, 1:]) & 0xFFFFFFFF)
    return (((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))).view(b, n)


def rejection_sample(logits: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor | None = None,
                     top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                     min_p: torch.Tensor | None = None, greedy: torch.Tensor | None = None,
                     keys: torch.Tensor | None = None, vocab_hash: torch.Tensor | None = None,
                     draft_probs: torch.Tensor | None = None, sort: bool = True, all_greedy: bool = False) -> tuple:
    """Verify ``B`` requests' drafts (module docstring).

    Args:
        logits: ``[B, N + 1, V]`` fp32 target logits, row ``j`` of request ``b`` after its draft ``j``
            (rows past a request's ``k + 1`` are read for nothing).
        drafts: ``[B, N]`` int64 draft tokens, ``-1`` past a request's ``k`` drafts.
        temperature, top_p, min_p: ``[B]`` fp32 (temperature ignored on greedy rows); top_k: ``[B]``
            int64 (V or more: no limit); greedy: ``[B]`` bool.
        keys: ``[B, N + 1, 2]`` int64 noise keys of each row (:func:`~dsa.engine.sampling.position_keys`
            of the position of the token the row samples).
        vocab_hash: ``[V]`` int64, ``hash32(token id)``.
        draft_probs: ``[B, N, V]`` fp32 the drafter's distributions, or None (a deterministic drafter).
        sort: False when no row uses top_k or top_p.
        all_greedy: True when every request is greedy (the host knows it): the argmax path alone, the
            same tokens without the sampled path's launches; the sampling arguments (temperature ..
            vocab_hash) may then be None, and are required otherwise.

    Returns:
        ``(tokens [B, N + 1] int64, accepted [B] int64)``: request ``b`` emits ``tokens[b, :accepted[b] + 1]``
        (its accepted drafts, then the recovered or bonus token); ``-1`` after them.
    """
    b, n1, v = logits.shape
    n = n1 - 1
    if n < 1 or tuple(drafts.shape) != (b, n):
        raise ValueError(f"drafts: expected [B={b}, N={n} >= 1] for logits {list(logits.shape)}, got "
                         f"{list(drafts.shape)}")
    if all_greedy:  # the argmax, then one launch (dsa.kernels.greedy_accept)
        return greedy_accept(logits.argmax(dim=-1), drafts)
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy, keys=keys,
                 vocab_hash=vocab_hash)
    missing = [name for name, t in given.items() if t is None]
    if missing:
        raise ValueError(f"{missing[0]}: required unless all_greedy (a sampled request's rows need it)")
    rows = logits.reshape(b * n1, v)
    rep = lambda t: t.repeat_interleave(n1)  # noqa: E731 - per request -> per row
    scaled = rows / rep(temperature)[:, None]
    scaled = scaled.masked_fill(~keep_mask(scaled, rep(top_k), rep(top_p), rep(min_p), sort), -math.inf)
    scaled = scaled.view(b, n1, v)
    argmax = logits.argmax(dim=-1)  # [B, N + 1]
    valid = drafts >= 0
    d = drafts.clamp_min(0)
    p = scaled[:, :n].softmax(dim=-1)  # [B, N, V]
    p_d = p.gather(-1, d[..., None])[..., 0]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, d[..., None])[..., 0]
    sampled_ok = _accept_uniform(keys, drafts) * q_d <= p_d
    ok = torch.where(greedy[:, None], argmax[:, :n] == drafts, sampled_ok) & valid
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [B]: the leading accepted drafts
    # the token at row `accepted`: the residual max(p - q, 0) after a rejection, p itself for the bonus row
    # (Gumbel-max over log-weights: the residual need not be normalized)
    at = accepted[:, None]
    row_scaled = scaled.gather(1, at[..., None].expand(b, 1, v))[:, 0]  # [B, V]
    draft_at = at.clamp_max(n - 1)  # the draft rejected at row `accepted` (when it is one)
    rejected = ((at < n) & valid.gather(1, draft_at))[:, 0]  # else every draft was accepted: the bonus row
    if draft_probs is None:  # q one-hot: the residual is p without the rejected draft
        residual = row_scaled.scatter(1, d.gather(1, draft_at), -math.inf)
    else:
        row_q = draft_probs.gather(1, draft_at[..., None].expand(b, 1, v))[:, 0]
        residual = torch.log((row_scaled.softmax(dim=-1) - row_q).clamp_min(0))
    weights = torch.where(rejected[:, None], residual, row_scaled)
    row_keys = keys.gather(1, at[..., None].expand(b, 1, 2))[:, 0]
    gumbel = -torch.log(-torch.log(uniform_noise(row_keys, vocab_hash)))
    final = torch.where(greedy, argmax.gather(1, at)[:, 0], (weights + gumbel).argmax(dim=-1))
    return _emitted(drafts, accepted, final)


def _emitted(drafts: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> tuple:
    """``(tokens [B, N + 1], accepted)``: each request's accepted drafts, then ``final``, then -1."""
    at = accepted[:, None]
    cols = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
    padded = torch.cat((drafts, drafts.new_full((drafts.shape[0], 1), -1)), dim=1)
    return torch.where(cols < at, padded, torch.where(cols == at, final[:, None], -1)), accepted
