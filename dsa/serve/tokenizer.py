"""Tokenizers: a checkpoint's ``tokenizer.json`` (through the ``tokenizers`` library) and the
byte-level tokenizer of the embedded default model.

Both have one interface: ``encode(text, add_special_tokens=True) -> ids``, ``decode(ids,
skip_special_tokens=True) -> str``, ``token_text(id)``, ``bos_token_id``, ``eos_token_id``,
``vocab_size`` and ``apply_chat_template(messages, add_generation_prompt=True) -> ids``.

From a checkpoint folder: ``tokenizer.json``, plus ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ``pad_token``, ``unk_token``, ``add_bos_token``, ``add_eos_token``,
``chat_template``; ``special_tokens_map.json`` fills in missing token strings and a
``chat_template.jinja`` file wins over the config's template, as transformers saves them). When
the config sets ``add_bos_token`` or ``add_eos_token``, those flags decide which special tokens
``encode`` adds; otherwise ``tokenizer.json``'s own post-processor does.
"""
import functools
import json
import os
import re

from dsa.model.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE
from dsa.serve.chat_template import render_chat

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

BYTE_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                      "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


class _ChatMixin:
    chat_template: str | None

    def special_tokens(self) -> dict:
        """The special token strings a chat template sees (``bos_token``, ``eos_token``, ...)."""
        return {}

    def render_chat(self, messages: list, add_generation_prompt: bool = True, **variables) -> str:
        if not self.chat_template:
            raise ValueError("chat: this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                             "and no chat_template.jinja); format the prompt yourself and call generate()")
        variables = {**self.special_tokens(), **variables}
        return render_chat(self.chat_template, messages, add_generation_prompt, **variables)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, **variables) -> list:
        """Token ids of the rendered conversation (the template writes its own special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **variables), add_special_tokens=False)


class ByteTokenizer(_ChatMixin):
    """UTF-8 bytes as tokens 0-255, BOS 256 and EOS 257 (written ``<|bos|>`` and ``<|eos|>`` in text),
    with a plain ``role: content`` chat template. ``encode`` adds BOS."""
    bos_token, eos_token = "<|bos|>", "<|eos|>"
    bos_token_id, eos_token_id = BYTE_BOS_ID, BYTE_EOS_ID
    vocab_size = BYTE_VOCAB_SIZE
    chat_template = BYTE_CHAT_TEMPLATE
    _split = re.compile("(<\\|bos\\|>|<\\|eos\\|>)")

    def special_tokens(self) -> dict:
        return {"bos_token": self.bos_token, "eos_token": self.eos_token}

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self._split.split(text):
            if piece == self.bos_token:
                ids.append(self.bos_token_id)
            elif piece == self.eos_token:
                ids.append(self.eos_token_id)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for t in ids:
            if t < 256:
                raw.append(t)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            if not skip_special_tokens:
                out.append({BYTE_BOS_ID: self.bos_token, BYTE_EOS_ID: self.eos_token}.get(t, ""))
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: one byte for ids 0-255 (a byte of a longer character too, which
        ``token_text`` shows as U+FFFD), the UTF-8 of ``<|bos|>`` / ``<|eos|>`` for BOS / EOS."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id: {token_id} is not in [0, {self.vocab_size})")
        return bytes([token_id]) if token_id < 256 else self.token_text(token_id).encode("utf-8")


def _byte_level_alphabet() -> dict:
    """GPT-2's byte-level alphabet, as ``tokenizers``' ByteLevel writes tokens: character -> byte
    (printable bytes stand for themselves, the others for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile("<0x([0-9A-Fa-f]{2})>")


def _decoder_types(decoder) -> set:
    """The types of a ``tokenizer.json`` decoder, through ``Sequence`` s."""
    if not isinstance(decoder, dict):
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type")}


def _token_string(value):
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer(_ChatMixin):
    """A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, its special
    tokens and chat template from ``tokenizer_config.json`` (see the module docstring)."""

    def __init__(self, backend, config: dict | None = None, chat_template: str | None = None):
        self.backend = backend
        config = dict(config or {})
        for name in SPECIAL_TOKEN_NAMES:
            setattr(self, name, _token_string(config.get(name)))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.add_bos_token = config.get("add_bos_token")
        self.add_eos_token = config.get("add_eos_token")
        template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template = template

    def _id_of(self, token):
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"path: no tokenizer.json in {path}")

        def read_json(name):
            f = os.path.join(path, name)
            if not os.path.exists(f):
                return {}
            with open(f, encoding="utf-8") as fh:
                return json.load(fh)

        config = {k: v for k, v in read_json("special_tokens_map.json").items() if k in SPECIAL_TOKEN_NAMES}
        config.update({k: v for k, v in read_json("tokenizer_config.json").items() if v is not None})
        template = None
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as fh:
                template = fh.read()
        return cls(Backend.from_file(file), config, template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special_tokens(self) -> dict:
        return {name: getattr(self, name) for name in SPECIAL_TOKEN_NAMES if getattr(self, name) is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        flags = self.add_bos_token is not None or self.add_eos_token is not None
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens and not flags).ids
        if add_special_tokens and flags:
            if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, also when they are part of a longer character: a ByteLevel token's
        characters mapped back to bytes, a byte-fallback ``<0xNN>`` token's byte; an added (special)
        token's and any other token's text in UTF-8."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token_id: {token_id} is not in the vocabulary")
        if token_id not in self._added_ids:
            if "ByteLevel" in self._decoders and all(c in BYTE_LEVEL_ALPHABET for c in piece):
                return bytes(BYTE_LEVEL_ALPHABET[c] for c in piece)
            match = _BYTE_FALLBACK.fullmatch(piece)
            if "ByteFallback" in self._decoders and match:
                return bytes([int(match.group(1), 16)])
        return self.token_text(token_id).encode("utf-8")

    @functools.cached_property
    def _decoders(self) -> set:
        return _decoder_types(json.loads(self.backend.to_str()).get("decoder"))

    @functools.cached_property
    def _added_ids(self) -> set:
        return set(self.backend.get_added_tokens_decoder())


def load_tokenizer(path):
    """``Tokenizer.from_pretrained(path)``, or a :class:`ByteTokenizer` when ``path`` is None."""
    return ByteTokenizer() if path is None else Tokenizer.from_pretrained(path)
