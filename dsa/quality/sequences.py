"""Evaluation sequences built on held-out prose, each with the query positions that must copy from a
known target position: a copied random-token span (:func:`copy_sequence`) and a pass key hidden in
the prose (:func:`passkey_sequence`; ``dsa needle`` asks for it the same way)."""
import torch

PASSKEY = " The pass key is {key}. Remember it. "
QUESTION = " What is the pass key? The pass key is {key}"


def copy_sequence(prose: torch.Tensor, span: int, vocab: int, g: torch.Generator):
    """Prose with one random-token span at T/4 and again at the end. The query at the j-th token of the
    second copy must copy the token after the j-th of the first: ``(ids, queries, targets)``."""
    t = prose.numel()
    ids = prose.clone()
    tokens = torch.randint(17, vocab, (span,), generator=g)  # ids 0-16 are SmolLM2's control tokens
    a, b = t // 4, t - span - 8
    ids[a:a + span] = tokens
    ids[b:b + span] = tokens
    return ids, torch.arange(b, b + span - 1), torch.arange(a + 1, a + span)


def _digit_tokens(tokenizer, text: str, key: str) -> tuple:
    enc = tokenizer.encode(text)
    start = text.index(key)
    pos = [next(j for j, (s, e) in enumerate(enc.offsets) if s <= start + d < e) for d in range(len(key))]
    return enc.ids, pos


def passkey_sequence(prose: torch.Tensor, tokenizer, g: torch.Generator):
    """A 5-digit pass key stated once at a random depth of the prose and asked for at the end. The query
    before each digit of the answer must copy that digit from the statement: ``(ids, queries, targets)``."""
    key = "".join(str(int(d)) for d in torch.randint(0, 10, (5,), generator=g))
    hidden, hidden_pos = _digit_tokens(tokenizer, PASSKEY.format(key=key), key)
    question, answer_pos = _digit_tokens(tokenizer, QUESTION.format(key=key), key)
    t = prose.numel()
    fill = t - len(hidden) - len(question)
    depth = int(fill * (0.1 + 0.6 * float(torch.rand((), generator=g))))
    ids = torch.cat((prose[:depth], torch.tensor(hidden), prose[depth:fill], torch.tensor(question)))
    q0 = fill + len(hidden)  # where the question starts
    return ids, torch.tensor([q0 + p - 1 for p in answer_pos]), torch.tensor([depth + p for p in hidden_pos])
