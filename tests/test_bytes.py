"""ByteCodec on the real tokenizers of the three bundled models: token id -> exact bytes, encoding."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenfuse.members.codec import BYTE_LEVEL, SENTENCEPIECE, ByteCodec, _end_of_turn_ids, byte_decoder
from tokenfuse.alignment.project import Projector
from tokenfuse.alignment.union import END, build_union
from tokenfuse.errors import AlignmentError

FAMILIES = ("smollm2", "gemma3", "qwen")
BYTE_LEVEL_FAMILIES = ("smollm2", "qwen")


@pytest.fixture(scope="module")
def codecs(tokenizers) -> dict[str, ByteCodec]:
    return {name: ByteCodec(tok) for name, tok in tokenizers.items()}


def token_id(tok, piece: str) -> int:
    """The id of a token string; fails (instead of silently giving the unk id) if it is absent."""
    idx = tok.convert_tokens_to_ids(piece)
    assert idx is not None and tok.convert_ids_to_tokens(idx) == piece, f"{piece!r} is not a token"
    return idx


# ---------------------------------------------------------------------------------- families
def test_kinds_are_read_from_the_tokenizer(codecs):
    assert codecs["smollm2"].kind == BYTE_LEVEL
    assert codecs["qwen"].kind == BYTE_LEVEL
    assert codecs["gemma3"].kind == SENTENCEPIECE


def test_byte_decoder_is_a_bijection_onto_all_256_bytes():
    table = byte_decoder()
    assert len(table) == 256
    assert sorted(table.values()) == list(range(256))
    assert all(len(ch) == 1 for ch in table)
    # The GPT-2 table: printable bytes stand for themselves, the others are shifted past 255.
    assert table["!"] == 0x21 and table["~"] == 0x7E and table["ÿ"] == 0xFF
    assert table["Ā"] == 0x00 and table["ĉ"] == 0x09 and table["Ċ"] == 0x0A and table["Ġ"] == 0x20
    assert table["ð"] == 0xF0 and table["Ł"] == 0x9F and table["ĺ"] == 0x98


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_byte_level_known_tokens(tokenizers, codecs, family):
    tok, codec = tokenizers[family], codecs[family]
    tb = codec.token_bytes
    assert tb[token_id(tok, "Ġthe")] == b" the"
    assert tb[token_id(tok, "Ġ")] == b" "
    assert tb[token_id(tok, "Ċ")] == b"\n"
    assert tb[token_id(tok, "ĊĊ")] == b"\n\n"
    assert tb[token_id(tok, "Ã©")] == "é".encode() == b"\xc3\xa9"
    # A token that holds only the first three bytes of a 4-byte character (a space + U+1F6xx prefix).
    assert tb[token_id(tok, "ĠðŁĺ")] == b" \xf0\x9f\x98"


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_byte_level_single_byte_tokens_follow_the_gpt2_table(tokenizers, codecs, family):
    tok, codec = tokenizers[family], codecs[family]
    table = byte_decoder()
    char_of = {b: ch for ch, b in table.items()}
    present = 0
    for b in range(256):
        idx = codec.byte_ids[b]
        if idx is None:
            continue
        present += 1
        assert codec.token_bytes[idx] == bytes([b])
        assert tok.convert_ids_to_tokens(idx) == char_of[b]
    # smollm2 lacks a few (control and never-valid UTF-8) bytes; qwen has them all.
    assert present == (256 if family == "qwen" else 235)


def test_sentencepiece_known_tokens(tokenizers, codecs):
    tok, codec = tokenizers["gemma3"], codecs["gemma3"]
    tb = codec.token_bytes
    assert tb[token_id(tok, "▁")] == b" "
    assert tb[token_id(tok, "▁▁")] == b"  "
    assert tb[token_id(tok, "A")] == b"A"
    assert tb[token_id(tok, "<0x0A>")] == b"\n"
    assert tb[token_id(tok, "<0xF0>")] == b"\xf0"
    assert tb[token_id(tok, "<0x41>")] == b"A"
    # Every byte value has its own <0xNN> token, and byte_ids prefers it over a normal 1-byte token.
    for b in range(256):
        idx = codec.byte_ids[b]
        assert idx is not None
        assert tok.convert_ids_to_tokens(idx) == f"<0x{b:02X}>"
        assert tb[idx] == bytes([b])
    assert codec.byte_ids[ord("A")] == token_id(tok, "<0x41>") != token_id(tok, "A")


def test_sentencepiece_non_special_added_tokens_are_text(tokenizers, codecs):
    tok, codec = tokenizers["gemma3"], codecs["gemma3"]
    added = tok.backend_tokenizer.get_added_tokens_decoder()
    plain = {i: a.content for i, a in added.items() if not a.special}
    # Newline runs, tab runs and HTML tags are added tokens that are not special: they are text.
    for content in ("\n", "\n\n", "\n" * 31, "\t", "\t\t", "<table>", "</td>"):
        idx = token_id(tok, content)
        assert plain.get(idx) == content
        assert codec.token_bytes[idx] == content.encode()
        assert idx not in codec.special_ids
    assert all(codec.token_bytes[i] == c.encode() for i, c in plain.items())


def test_sentencepiece_special_tokens_are_not_text(tokenizers, codecs):
    tok, codec = tokenizers["gemma3"], codecs["gemma3"]
    for piece in ("<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused0>", "<unused6241>",
                  "<start_of_turn>", "<end_of_turn>"):
        idx = token_id(tok, piece)
        assert codec.token_bytes[idx] is None, piece
        assert idx in codec.special_ids, piece
    added = tok.backend_tokenizer.get_added_tokens_decoder()
    special = {i for i, a in added.items() if a.special}
    assert special <= codec.special_ids
    assert all(codec.token_bytes[i] is None for i in codec.special_ids)
    # Nothing else is None: every other id of the vocabulary is text.
    assert {i for i, b in enumerate(codec.token_bytes) if b is None} == set(codec.special_ids)


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_byte_level_special_tokens_are_not_text(tokenizers, codecs, family):
    tok, codec = tokenizers[family], codecs[family]
    for piece in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        idx = token_id(tok, piece)
        assert codec.token_bytes[idx] is None and idx in codec.special_ids
    assert {i for i, b in enumerate(codec.token_bytes) if b is None} == set(codec.special_ids)


# ---------------------------------------------------------------------------------- END
def test_end_ids(tokenizers, codecs):
    assert codecs["smollm2"].end_ids == {token_id(tokenizers["smollm2"], "<|im_end|>")}
    assert codecs["qwen"].end_ids == {token_id(tokenizers["qwen"], "<|im_end|>")}
    assert codecs["gemma3"].end_ids == {token_id(tokenizers["gemma3"], "<eos>")}
    for codec in codecs.values():
        assert codec.end_ids <= codec.special_ids
        assert all(codec.token_bytes[i] is None for i in codec.end_ids)


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_end_of_turn_is_read_off_the_chat_template(tokenizers, family):
    tok = tokenizers[family]
    # What the template writes right after an assistant message: the end-of-turn marker.
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "XYZ"}],
                                   tokenize=False)
    assert text[text.rindex("XYZ") + 3:].startswith("<|im_end|>")
    added = tok.backend_tokenizer.get_added_tokens_decoder()
    assert _end_of_turn_ids(tok, added) == {token_id(tok, "<|im_end|>")}


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_end_of_turn_is_an_end_id_even_when_eos_is_another_token(tokenizers, family):
    tok = copy.deepcopy(tokenizers[family])
    tok.eos_token = "<|endoftext|>"
    endoftext, im_end = token_id(tok, "<|endoftext|>"), token_id(tok, "<|im_end|>")
    assert tok.eos_token_id == endoftext != im_end
    assert ByteCodec(tok).end_ids == {endoftext, im_end}


def test_extra_end_ids_are_end_and_not_text(tokenizers):
    tok = tokenizers["smollm2"]
    endoftext, im_end = token_id(tok, "<|endoftext|>"), token_id(tok, "<|im_end|>")
    codec = ByteCodec(tok, extra_end_ids=[endoftext, None])
    assert codec.end_ids == {endoftext, im_end}
    assert codec.fingerprint != ByteCodec(tok).fingerprint


def test_union_gives_every_end_id_the_shared_end_symbol(codecs):
    members = [codecs[f] for f in FAMILIES]
    union = build_union(members)
    assert END == 0
    assert union.pieces[0] == b""
    assert b"" not in union.pieces[1:]
    for codec, mapping in zip(members, union.maps):
        for e in codec.end_ids:
            assert mapping[e] == END
        # Only end ids go to END; other non-text ids are dropped (-1).
        assert set((mapping == END).nonzero()[0].tolist()) == set(codec.end_ids)
        dropped = set((mapping == -1).nonzero()[0].tolist())
        assert dropped == set(codec.special_ids - codec.end_ids)
    for codec, inv in zip(members, union.inverse):
        assert inv[END] == min(codec.end_ids)


# ---------------------------------------------------------------------------------- decode agreement
@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_agree_with_tokenizer_decode(tokenizers, codecs, family):
    tok, codec = tokenizers[family], codecs[family]
    ids = range(len(codec.token_bytes)) if family != "gemma3" else range(0, len(codec.token_bytes), 7)
    checked = 0
    for i in ids:
        b = codec.token_bytes[i]
        if b is None:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial character: the tokenizer's decode shows U+FFFD, nothing to compare
        got = tok.decode([i])
        # SentencePiece decoders may strip the leading space of a lone "▁..." token.
        assert got == text or (family == "gemma3" and text.startswith(" ") and got == text[1:]), (i, got, b)
        checked += 1
    assert checked > {"smollm2": 48_000, "gemma3": 36_000, "qwen": 150_000}[family]


# ---------------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("family", FAMILIES)
def test_encode_text_adds_no_bos_eos_and_no_dummy_prefix(tokenizers, codecs, family):
    codec = codecs[family]
    for text in ("a b", "a", " a", "hello", "  two leading", "trailing  ", "\nnew\n", "x\n\n"):
        ids = codec.encode_text(text)
        assert codec.decode(ids) == text.encode(), text
        assert not set(ids) & codec.special_ids, text
    assert codec.encode_text("") == []
    assert codec.decode(codec.encode_text("a b")) == b"a b"
    if family == "gemma3":
        # The plain tokenizer adds BOS and the codec does not; no "▁" in front of "hello".
        assert tokenizers[family]("hello")["input_ids"][0] == token_id(tokenizers[family], "<bos>")
        assert codec.encode_text("hello") == [token_id(tokenizers[family], "hello")]


@pytest.mark.parametrize(("family", "marker"), [
    ("smollm2", "<|im_end|>"), ("smollm2", "<|im_start|>"), ("smollm2", "<|endoftext|>"),
    ("qwen", "<|im_end|>"), ("qwen", "<|endoftext|>"),
    ("gemma3", "<end_of_turn>"), ("gemma3", "<start_of_turn>"), ("gemma3", "<eos>"), ("gemma3", "<bos>"),
])
def test_encode_text_splits_special_token_strings_as_text(tokenizers, codecs, family, marker):
    tok, codec = tokenizers[family], codecs[family]
    special = token_id(tok, marker)
    for text in (marker, f"say {marker} now", f"{marker}\n"):
        ids = codec.encode_text(text)
        assert special not in ids
        assert not set(ids) & codec.special_ids
        assert codec.decode(ids) == text.encode()
        assert codec.decode(codec.encode_bytes(text.encode())) == text.encode()
    assert len(codec.encode_text(marker)) > 1
    # The tokenizer's shared backend is left as it was: ordinary encoding still parses the marker.
    assert tok(marker, add_special_tokens=False)["input_ids"] == [special]


def test_encode_bytes_incomplete_and_invalid_utf8_sentencepiece(tokenizers, codecs):
    tok, codec = tokenizers["gemma3"], codecs["gemma3"]
    partial = " 😀".encode()[:-1]
    assert partial == b" \xf0\x9f\x98"
    ids = codec.encode_bytes(partial)
    assert codec.decode(ids) == partial
    assert [tok.convert_ids_to_tokens(i) for i in ids[-3:]] == ["<0xF0>", "<0x9F>", "<0x98>"]
    for data in (b"ab\x80", b"\x80", b"\xff\xfe", b"a\xc3", b"\xe6\x9d", b"x\xc3(y", "é".encode() + b"\xa9\xa9 z"):
        assert codec.decode(codec.encode_bytes(data)) == data, data
    ids = codec.encode_bytes(b"ab\x80")
    assert ids == codec.encode_text("ab") + [token_id(tok, "<0x80>")]
    # Only the invalid bytes become byte tokens; the text around them is encoded as text.
    c3 = token_id(tok, "<0xC3>")
    assert codec.encode_bytes(b"x\xc3(y") == codec.encode_text("x") + [c3] + codec.encode_text("(y")
    assert codec.encode_bytes(b"hello \xff\xfe world") == (
        codec.encode_text("hello ") + [token_id(tok, "<0xFF>"), token_id(tok, "<0xFE>")] + codec.encode_text(" world"))
    assert codec.encode_bytes(b"") == []


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_encode_bytes_incomplete_utf8_byte_level(codecs, family):
    codec = codecs[family]
    for data in (" 😀".encode()[:-1], "😀".encode()[:1], "naïve".encode()[:3], b"ab\x80"):
        assert codec.decode(codec.encode_bytes(data)) == data, data


def test_encode_bytes_raises_for_a_byte_without_a_single_byte_token(codecs):
    codec = codecs["smollm2"]
    missing = [b for b in range(256) if codec.byte_ids[b] is None]
    assert missing == [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]
    invalid = next(b for b in missing if b >= 0x80)  # never valid UTF-8 on its own
    assert not codec.can_encode_bytes(bytes([invalid]))
    assert codec.can_encode_bytes(b"ab\x80")
    with pytest.raises(AlignmentError, match=f"0x{invalid:02X}"):
        codec.encode_bytes(b"ab" + bytes([invalid]))
    with pytest.raises(AlignmentError):
        codec.bytes_as_tokens(bytes([invalid]))


# ---------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("family", FAMILIES)
def test_vocabulary_padding_rows_are_not_text(tokenizers, codecs, family):
    tok = tokenizers[family]
    n = len(tok)
    padded = ByteCodec(tok, vocab_size=n + 64)
    assert len(padded.token_bytes) == padded.vocab_size == n + 64
    assert padded.token_bytes[n:] == [None] * 64
    assert padded.token_bytes[:n] == codecs[family].token_bytes
    assert padded.end_ids == codecs[family].end_ids
    assert padded.fingerprint != codecs[family].fingerprint
    # A vocab_size below the tokenizer's never truncates it.
    assert len(ByteCodec(tok, vocab_size=10).token_bytes) == n


def test_padded_member_projects(make_tiny, tokenizers, codecs):
    member = make_tiny("smollm2", seed=3, pad=64)
    n = len(tokenizers["smollm2"])
    assert len(member.codec.token_bytes) == n + 64
    union = build_union([member.codec, codecs["gemma3"]])
    proj = Projector(union)
    state = member.new_state(member.codec.encode_text("Hello there"))
    lp = member.next_logprobs([state])
    assert lp.shape == (1, n + 64)
    out = proj.project(0, lp)
    assert out.shape == (1, len(union))
    assert torch.isclose(out.sum(), torch.tensor(1.0), atol=1e-5)
    # Probability on padding rows is dropped, not leaked: give them almost all the mass.
    fake = torch.full((1, n + 64), -30.0)
    fake[0, n:] = 0.0
    a, b = member.codec.encode_text("a")[0], member.codec.encode_text("b")[0]
    fake[0, a], fake[0, b] = -1.0, -2.0
    out = proj.project(0, fake)
    assert torch.isclose(out.sum(), torch.tensor(1.0), atol=1e-5)
    ratio = out[0, union.maps[0][a]] / out[0, union.maps[0][b]]
    assert torch.isclose(ratio, torch.tensor(2.718281828), rtol=1e-4)
    # Logits without the padding rows (a backend that trims them) project the same way.
    out_trim = proj.project(0, fake[:, :n])
    assert torch.allclose(out_trim, out, atol=1e-7)
    # Logits narrower than the tokenizer: the ids past them are dropped, the rest still sums to 1.
    out_narrow = proj.project(0, fake[:, : n - 100])
    assert torch.isclose(out_narrow.sum(), torch.tensor(1.0), atol=1e-5)
    assert torch.isclose(out_narrow[0, union.maps[0][a]] / out_narrow[0, union.maps[0][b]], torch.tensor(2.718281828),
                         rtol=1e-4)


def test_codec_tables_are_cached_by_the_codec_module(tokenizers, tmp_path, monkeypatch):
    from tokenfuse.members.codec import load_codec_tables, load_or_build_codec

    tok = tokenizers["qwen"]
    built = load_or_build_codec(tok, vocab_size=None, cache=tmp_path)
    assert built.cache_path.parent == tmp_path and load_codec_tables(built.cache_path) == built.tables()
    monkeypatch.setattr(ByteCodec, "_build", lambda *a, **k: pytest.fail("rebuilt instead of loaded"))
    loaded = load_or_build_codec(tok, vocab_size=None, cache=tmp_path)
    assert loaded.tables() == built.tables() and loaded.cache_path == built.cache_path
