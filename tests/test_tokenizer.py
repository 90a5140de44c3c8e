"""Tokenizers, chat templates and incremental detokenization (no model needed)."""
import json

import pytest

from dsa.engine.output import TextOutput
from dsa.model.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID
from dsa.serve.chat_template import ChatTemplateError, render_chat
from dsa.serve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from text_utils import CHAT_TEMPLATE, write_tokenizer

TEXTS = ["plain ascii", "naïve café", "東京は日本の首都です。", "emoji 🎉🚀✨ mixed é", "", " leading and trailing "]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BYTE_BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))


def test_byte_tokenizer_specials_and_template():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 258
    assert tok.encode("a<|eos|>b", add_special_tokens=False) == [97, BYTE_EOS_ID, 98]
    assert tok.decode([97, BYTE_EOS_ID, 98]) == "ab"
    assert tok.decode([97, BYTE_EOS_ID, 98], skip_special_tokens=False) == "a<|eos|>b"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # an incomplete character
    ids = tok.apply_chat_template([{"role": "user", "content": "hé"}])
    assert ids == [BYTE_BOS_ID] + list("user: hé\nassistant: ".encode())


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_bpe_round_trip(bpe, text):
    ids = bpe.encode(text)
    assert ids[0] == bpe.bos_token_id == 0  # add_bos_token
    assert bpe.decode(ids) == text  # <s> is skipped
    assert bpe.encode(text, add_special_tokens=False) == ids[1:]


def test_bpe_config_flags(tmp_path):
    write_tokenizer(tmp_path, add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("hi")[-1] == tok.eos_token_id == 1 and tok.encode("hi")[0] != 0
    assert tok.special_tokens() == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")  # wins over the config
    assert Tokenizer.from_pretrained(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "X"


@pytest.mark.parametrize("token_id, expected", [(200, b"\xc8"), (0, b"\x00"), (ord("a"), b"a"), (BYTE_BOS_ID, b"<|bos|>"),
                                                 (BYTE_EOS_ID, b"<|eos|>")], ids=["200", "0", "a", "bos", "eos"])
def test_byte_tokenizer_token_bytes_are_the_byte(token_id, expected):
    tok = ByteTokenizer()
    assert tok.token_bytes(token_id) == expected, f"token {token_id}: {tok.token_bytes(token_id)!r}"


@pytest.mark.parametrize("token_id", [-1, 258], ids=["negative", "past-the-vocabulary"])
def test_byte_tokenizer_token_bytes_out_of_range(token_id):
    with pytest.raises(ValueError, match="token_id"):
        ByteTokenizer().token_bytes(token_id)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_bpe_token_bytes_join_to_the_text(bpe, text):
    ids = bpe.encode(text, add_special_tokens=False)
    pieces = [bpe.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8"), f"{text!r}: {ids} -> {pieces}"


def test_bpe_token_bytes_of_parts_of_a_character_and_specials(bpe):
    ids = bpe.encode("東京🎉", add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in bpe.token_text(i)]
    assert partial, f"the test needs a token holding part of a character: {ids}"
    assert all(b"\xef\xbf\xbd" not in bpe.token_bytes(i) for i in partial), [bpe.token_bytes(i) for i in partial]
    assert bpe.token_bytes(bpe.bos_token_id) == b"<s>" and bpe.token_bytes(bpe.eos_token_id) == b"</s>"
    with pytest.raises(ValueError, match="token_id"):
        bpe.token_bytes(10 ** 6)


def test_byte_fallback_token_bytes(tmp_path):
    from tokenizers import Tokenizer as Backend, decoders, models

    vocab = {"<unk>": 0, "a": 1, "<0x0A>": 2, "<0xC8>": 3, "<0xE6>": 4}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert [tok.token_bytes(i) for i in (1, 2, 3)] == [b"a", b"\n", b"\xc8"]
    assert tok.token_text(3) == "\ufffd"  # the text cannot show one byte of a character; the bytes can


LOOP_TEMPLATE = ("{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}\n"
                 "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
                 "{{ m.role }}={{ m.content | tojson }};\n"
                 "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}{% endif %}")
MESSAGES = [{"role": "skip", "content": "a"}, {"role": "user", "content": "é<b> \"q\""},
            {"role": "assistant", "content": "c"}, {"role": "user", "content": "never"}]


def test_chat_template_renders_like_transformers(tmp_path):
    """A tokenizer_config.json the test writes: special tokens, loop controls, tojson (non-ASCII and
    HTML kept), add_generation_prompt, trim_blocks/lstrip_blocks."""
    write_tokenizer(tmp_path, chat_template=LOOP_TEMPLATE)
    tok = Tokenizer.from_pretrained(tmp_path)
    expected = 'user="é<b> \\"q\\"";\nassistant="c";\n'
    assert tok.render_chat(MESSAGES, add_generation_prompt=False) == expected
    assert tok.render_chat(MESSAGES) == expected + "<s>"
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == tok.encode(expected + "<s>", add_special_tokens=False) and ids[-1] == tok.bos_token_id


@pytest.mark.parametrize("template", [LOOP_TEMPLATE, CHAT_TEMPLATE], ids=["loops", "roles"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(tmp_path, template, generation_prompt):
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path, chat_template=template)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    msgs = [m for m in MESSAGES if m["role"] != "skip"] if template is CHAT_TEMPLATE else MESSAGES
    text = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.render_chat(msgs, add_generation_prompt=generation_prompt) == text
    ids = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.apply_chat_template(msgs, add_generation_prompt=generation_prompt) == list(ids)
    text = "naïve café 🎉"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def test_chat_template_errors(bpe, tmp_path):
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        bpe.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="parse"):
        render_chat("{% for %}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])
    write_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "missing")


def test_named_templates_pick_default(tmp_path):
    write_tokenizer(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default",
                                                                                   "template": CHAT_TEMPLATE}])
    assert Tokenizer.from_pretrained(tmp_path).render_chat([]) == "<s><|assistant|>"
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is True


def _stream_pieces(tok, prompt_ids, ids, stop=()):
    out = TextOutput(tok, prompt_ids, stop)
    pieces = []
    for t in ids:
        stopped = out.append(t)
        pieces.append(out.release(final=stopped))
        if stopped:
            break
    out.finish()
    pieces.append(out.release(final=True))
    return pieces, out


@pytest.mark.parametrize("text", TEXTS[1:4], ids=["latin", "cjk", "emoji"])
def test_incremental_detokenization_bytes(text):
    """One byte per token: every multi-byte character is split across tokens; no piece carries a
    replacement character and the pieces join to the text."""
    tok = ByteTokenizer()
    pieces, _ = _stream_pieces(tok, tok.encode("prompt "), list(text.encode()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) == len(text)  # each character appears once, whole


def test_incremental_detokenization_bpe(bpe):
    text = "émoji 🎉🚀 Grüße 東京 and the lazy dog"
    ids = bpe.encode(text, add_special_tokens=False)
    assert any("\ufffd" in bpe.decode([t]) for t in ids)  # some tokens hold part of a character
    pieces, _ = _stream_pieces(bpe, bpe.encode("Hello"), ids)
    assert "".join(pieces) == bpe.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incomplete_character_at_the_end_is_flushed():
    tok = ByteTokenizer()
    pieces, _ = _stream_pieces(tok, [BYTE_BOS_ID], [0x61, 0xE2, 0x82])
    assert pieces[0] == "a" and "".join(pieces) == tok.decode([0x61, 0xE2, 0x82]) == "a\ufffd"


@pytest.mark.parametrize("stop,expected", [
    (("lo w",), "hel"),  # a stop string spanning tokens
    (("xyz", "o"), "hell"),  # the earliest of several
    (("world!",), "hello world"),  # never completes: its prefix "world" is released at the end
    (("h",), ""),  # at the very start
], ids=["span", "earliest", "prefix-only", "start"])
def test_stop_strings_and_held_back_tails(stop, expected):
    tok = ByteTokenizer()
    pieces, out = _stream_pieces(tok, [BYTE_BOS_ID], list(b"hello world"), stop)
    assert "".join(pieces) == expected == out.text
    seen = ""
    for p in pieces:  # every prefix of the stream is a prefix of the final text
        seen += p
        assert expected.startswith(seen)
    if stop == ("world!",):
        assert pieces[-1] == "world"  # held back until the end: it could have started "world!"
