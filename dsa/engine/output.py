"""A request's output text, built token by token, and the deltas streamed to its reader.

:class:`TextOutput` detokenizes incrementally (the algorithm vLLM and TGI use): it decodes a short
window of tokens before and after the last emitted point and emits only what the new token added,
waiting while the window's text ends in an incomplete UTF-8 character (U+FFFD), so a multi-byte
character split across tokens appears once, whole. At the end, what is still pending is flushed
(with U+FFFD for bytes that never completed a character). Stop strings end the text before the
first one; while a request runs, the tail that could still start a stop string is held back, so
the concatenated stream always equals the final text.
"""
from dataclasses import dataclass, field

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one (word boundaries, leading spaces)


@dataclass
class Delta:
    """What one request produced since its previous delta.

    ``token_ids``: its new tokens (every generated token, including EOS / a stop token);
    ``text``: its new text (None when the engine has no tokenizer); ``finish_reason``: None while it
    runs, then "stop" (EOS, a stop token or a stop string), "length" (max_tokens) or "abort";
    ``logprobs``: a :class:`~dsa.engine.sampling.Logprob` per new token when the request asked for them.
    """
    request_id: int
    token_ids: list = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list | None = None
    index: int | None = None  # the prompt's position in a stream() / generate() call

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TextOutput:
    """Generated text of one request: ``append`` tokens, ``release`` the text that is final."""

    def __init__(self, tokenizer, prompt_ids, stop: tuple = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens before this are already in self.text
        self.stop = tuple(stop)
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.sent = 0  # characters of self.text already released
        self.stopped = False  # a stop string was found (self.text ends before it)

    def append(self, token_id: int) -> bool:
        """Add a generated token; returns True once the text contains a stop string."""
        if not self.stopped:
            self.ids.append(token_id)
            self._advance(final=False)
        return self.stopped

    def finish(self) -> None:
        """Flush the pending tokens (the request ended)."""
        if not self.stopped and self.read < len(self.ids):
            self._advance(final=True)

    def _advance(self, final: bool) -> None:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        now = decode(self.ids[self.prefix:])
        if not final and (len(now) <= len(before) or now.endswith("\ufffd")):
            return  # nothing new yet, or an incomplete character at the end: wait for the next token
        self._extend(now[len(before):])
        self.prefix, self.read = self.read, len(self.ids)

    def _extend(self, piece: str) -> None:
        start = max(0, len(self.text) - self.max_stop + 1)  # a match may begin in the old text
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = self.text[-self.max_stop:] if self.max_stop else ""
        return max((k for s in self.stop for k in range(1, min(len(s), len(tail) + 1))
                    if tail.endswith(s[:k])), default=0)

    def release(self, final: bool) -> str:
        """The text not released before that is final: all of it at the end or after a stop
        string, else all but the tail that could still start a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
