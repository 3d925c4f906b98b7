"""The union vocabulary over exact bytes: order, index maps, inverse maps, caches, representability."""

from __future__ import annotations

import numpy as np
import pytest

from tokenfuse.alignment.union import END, UnionVocab, build_union
from tokenfuse.members import codec as codec_mod
from tokenfuse.members.codec import ByteCodec, load_codec_tables, load_or_build_codec, save_codec

FAMILIES = ("smollm2", "gemma3", "qwen")


@pytest.fixture(scope="module")
def codecs(tokenizers) -> dict[str, ByteCodec]:
    return {name: ByteCodec(tok) for name, tok in tokenizers.items()}


@pytest.fixture(scope="module")
def union3(codecs) -> UnionVocab:
    return build_union([codecs[f] for f in FAMILIES])


def assert_same_union(a: UnionVocab, b: UnionVocab) -> None:
    assert a.pieces == b.pieces
    assert len(a.maps) == len(b.maps) and len(a.inverse) == len(b.inverse)
    for x, y in zip(a.maps, b.maps):
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
    for x, y in zip(a.inverse, b.inverse):
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
    assert a.representable.dtype == b.representable.dtype == np.bool_
    assert np.array_equal(a.representable, b.representable)


# ---------------------------------------------------------------------------------- order
def test_pieces_are_end_then_sorted_distinct_bytes(codecs, union3):
    assert union3.pieces[0] == b""
    assert union3.pieces[1:] == sorted(set(union3.pieces[1:]))
    expected = set()
    for f in FAMILIES:
        expected.update(b for b in codecs[f].token_bytes if b)
    assert set(union3.pieces[1:]) == expected
    assert len(union3) == len(expected) + 1


def test_order_does_not_depend_on_member_order(codecs, union3):
    reverse = build_union([codecs[f] for f in reversed(FAMILIES)])
    assert reverse.pieces == union3.pieces
    assert np.array_equal(reverse.representable, union3.representable)
    for i, j in zip(range(3), reversed(range(3))):
        assert np.array_equal(reverse.maps[j], union3.maps[i])
        assert np.array_equal(reverse.inverse[j], union3.inverse[i])
    pair_ab = build_union([codecs["smollm2"], codecs["qwen"]])
    pair_ba = build_union([codecs["qwen"], codecs["smollm2"]])
    assert pair_ab.pieces == pair_ba.pieces
    assert np.array_equal(pair_ab.maps[0], pair_ba.maps[1]) and np.array_equal(pair_ab.maps[1], pair_ba.maps[0])


# ---------------------------------------------------------------------------------- maps
@pytest.mark.parametrize("member", range(3))
def test_map_sends_each_id_to_the_entry_with_exactly_its_bytes(codecs, union3, member):
    codec = codecs[FAMILIES[member]]
    mapping = union3.maps[member]
    assert mapping.shape == (len(codec.token_bytes),)
    pieces = union3.pieces
    for i, b in enumerate(codec.token_bytes):
        u = int(mapping[i])
        if i in codec.end_ids:
            assert u == END
        elif b is None:
            assert u == -1
        else:
            assert u > 0 and pieces[u] == b


@pytest.mark.parametrize("member", range(3))
def test_inverse_gives_the_lowest_normal_id_with_those_bytes(codecs, union3, member):
    codec = codecs[FAMILIES[member]]
    inv = union3.inverse[member]
    assert inv.shape == (len(union3),)
    byte_tokens = {i for i in codec.byte_ids if i is not None} if codec.kind == "sentencepiece" else set()
    best: dict[int, int] = {}
    for i, u in enumerate(union3.maps[member].tolist()):
        if u <= 0:
            continue
        j = best.get(u)
        # Prefer a normal token over a <0xNN> byte token, then the lowest id.
        if j is None or ((i in byte_tokens), i) < ((j in byte_tokens), j):
            best[u] = i
    expected = np.full(len(union3), -1, dtype=np.int64)
    expected[list(best)] = list(best.values())
    expected[END] = min(codec.end_ids)
    assert np.array_equal(inv, expected)
    for u, i in best.items():
        assert codec.token_bytes[i] == union3.pieces[u]


def test_inverse_examples(tokenizers, codecs, union3):
    index = {p: u for u, p in enumerate(union3.pieces)}
    gemma, smol, qwen = tokenizers["gemma3"], tokenizers["smollm2"], tokenizers["qwen"]
    inv_smol, inv_gemma, inv_qwen = union3.inverse
    # gemma has both "A" and <0x41>, and "\n" (an added token) and <0x0A>: the normal token wins.
    assert gemma.convert_ids_to_tokens(int(inv_gemma[index[b"A"]])) == "A"
    assert int(inv_gemma[index[b"\n"]]) == gemma.convert_tokens_to_ids("\n")
    assert gemma.convert_ids_to_tokens(int(inv_gemma[index[b"\xf0"]])) == "<0xF0>"
    assert codecs["gemma3"].byte_ids[ord("A")] != int(inv_gemma[index[b"A"]])
    assert smol.convert_ids_to_tokens(int(inv_smol[index[b" the"]])) == "Ġthe"
    assert qwen.convert_ids_to_tokens(int(inv_qwen[index[b" \xf0\x9f\x98"]])) == "ĠðŁĺ"
    # An entry a member has no single token for.
    assert int(inv_smol[index[b"\x04"]]) == -1
    assert int(inv_smol[index[b"<table>"]]) == -1
    assert int(inv_gemma[index[b"<table>"]]) == gemma.convert_tokens_to_ids("<table>")
    assert [int(inv[END]) for inv in union3.inverse] == [
        smol.convert_tokens_to_ids("<|im_end|>"), gemma.convert_tokens_to_ids("<eos>"),
        qwen.convert_tokens_to_ids("<|im_end|>")]


# ---------------------------------------------------------------------------------- representable
def test_representable_marks_entries_with_a_byte_some_member_lacks(codecs, union3):
    missing: set[int] = set()
    for f in FAMILIES:
        missing |= {b for b in range(256) if codecs[f].byte_ids[b] is None}
    assert missing == {b for b in range(256) if codecs["smollm2"].byte_ids[b] is None}
    assert len(missing) == 21
    expected = np.array([not (set(p) & missing) for p in union3.pieces], dtype=bool)
    assert np.array_equal(union3.representable, expected)
    index = {p: u for u, p in enumerate(union3.pieces)}
    assert union3.representable[END]
    assert union3.representable[index[b"A"]]
    assert not union3.representable[index[b"\x04"]]  # gemma's <0x04>; smollm2 cannot hold it
    assert not union3.representable[index[b"\xf1"]]
    assert union3.representable[index[b"\xf0"]]
    assert 0 < int((~union3.representable).sum()) < 100
    # Without smollm2 every byte has a token, so everything is representable.
    assert build_union([codecs["gemma3"], codecs["qwen"]]).representable.all()


# ---------------------------------------------------------------------------------- disk caches
def test_union_disk_cache_round_trips(codecs, union3, tmp_path):
    members = [codecs[f] for f in FAMILIES]
    first = build_union(members, cache=tmp_path)
    assert not first.from_cache
    assert len(list(tmp_path.glob("union-*.npz"))) == 1
    second = build_union(members, cache=tmp_path)
    assert second.from_cache
    assert_same_union(second, first)
    assert_same_union(second, union3)
    # The same cache file serves the members in another order, maps in that order.
    reverse = build_union(members[::-1], cache=tmp_path)
    assert reverse.from_cache
    assert len(list(tmp_path.glob("union-*.npz"))) == 1
    assert reverse.pieces == union3.pieces
    for i, j in zip(range(3), reversed(range(3))):
        assert np.array_equal(reverse.maps[j], union3.maps[i])
        assert np.array_equal(reverse.inverse[j], union3.inverse[i])
    # A different member set gets its own file.
    pair = build_union(members[:2], cache=tmp_path)
    assert not pair.from_cache
    assert len(list(tmp_path.glob("union-*.npz"))) == 2


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


DAMAGE = {
    "garbage": lambda raw: b"this is not an npz file",
    "empty": lambda raw: b"",
    "truncated": _truncated,
    "tail_cut": lambda raw: raw[:-64],
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_union_cache_is_rebuilt(codecs, tmp_path, damage):
    members = [codecs["smollm2"], codecs["qwen"]]
    good = build_union(members, cache=tmp_path)
    (path,) = tmp_path.glob("union-*.npz")
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    rebuilt = build_union(members, cache=tmp_path)
    assert not rebuilt.from_cache
    assert_same_union(rebuilt, good)
    again = build_union(members, cache=tmp_path)  # the rebuilt union was written back
    assert again.from_cache
    assert_same_union(again, good)


@pytest.mark.parametrize("family", FAMILIES)
def test_codec_cache_round_trips_the_tables(tokenizers, tmp_path, monkeypatch, family):
    tok = tokenizers[family]
    end = tok.convert_tokens_to_ids("<pad>" if family == "gemma3" else "<|endoftext|>")
    kwargs = {"vocab_size": len(tok) + 64, "extra_end_ids": [end]}
    built = load_or_build_codec(tok, cache=tmp_path, **kwargs)
    assert len(list(tmp_path.glob("codec-*.npz"))) == 1
    assert end in built.end_ids and built.token_bytes[-1] is None

    def no_build(*args, **kw):
        raise AssertionError("the codec was rebuilt instead of loaded from the cache")

    monkeypatch.setattr(ByteCodec, "_build", no_build)
    loaded = load_or_build_codec(tok, cache=tmp_path, **kwargs)
    want, got = built.tables(), loaded.tables()
    assert set(got) == set(want)
    for key in want:
        assert got[key] == want[key], key
        assert type(got[key]) is type(want[key]), key
    assert type(got["vocab_size"]) is int and type(got["kind"]) is str and type(got["fingerprint"]) is str
    assert all(type(i) is int for i in got["end_ids"] | got["special_ids"])
    assert all(i is None or type(i) is int for i in got["byte_ids"])
    # The loaded codec encodes like the built one (the encoder comes from the tokenizer).
    text = "Hello <|im_end|> wörld 😀\n"
    assert loaded.encode_text(text) == built.encode_text(text)
    assert loaded.decode(loaded.encode_bytes(text.encode())) == text.encode()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_codec_cache_is_rebuilt(tokenizers, tmp_path, damage):
    tok = tokenizers["smollm2"]
    built = load_or_build_codec(tok, vocab_size=None, cache=tmp_path)
    (path,) = tmp_path.glob("codec-*.npz")
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    rebuilt = load_or_build_codec(tok, vocab_size=None, cache=tmp_path)
    assert rebuilt.tables() == built.tables()
    # The rebuilt tables were written back and load again.
    assert codec_mod.load_codec_tables(path) == built.tables()


def test_codec_cache_key_depends_on_vocab_size_and_end_ids(tokenizers, tmp_path):
    tok = tokenizers["smollm2"]
    a = load_or_build_codec(tok, vocab_size=None, cache=tmp_path)
    b = load_or_build_codec(tok, vocab_size=len(tok) + 8, cache=tmp_path)
    c = load_or_build_codec(tok, vocab_size=None, extra_end_ids=[0], cache=tmp_path)
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert len(list(tmp_path.glob("codec-*.npz"))) == 3
    assert len(b.token_bytes) == len(a.token_bytes) + 8
    assert c.end_ids == a.end_ids | {0}
    assert load_or_build_codec(tok, vocab_size=None, cache=None).tables() == a.tables()


def test_codec_tables_keep_empty_and_missing_entries_apart(tokenizers, codecs, tmp_path):
    """``b""`` (an empty text token) and ``None`` (not text) survive the cache as themselves."""
    tables = codecs["smollm2"].tables()
    tables["token_bytes"] = list(tables["token_bytes"])
    tables["token_bytes"][100] = b""
    tables["token_bytes"][101] = None
    codec = ByteCodec(tokenizers["smollm2"], tables=tables)
    save_codec(tmp_path / "c.npz", codec)
    loaded = load_codec_tables(tmp_path / "c.npz")
    assert loaded["token_bytes"][100] == b"" and loaded["token_bytes"][101] is None
    assert loaded == tables
    # An empty token carries no text: the union drops it rather than making it a second END.
    u = build_union([codec])
    assert u.maps[0][100] == -1 and u.maps[0][101] == -1
    assert b"" not in u.pieces[1:]
