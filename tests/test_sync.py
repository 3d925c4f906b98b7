"""Re-synchronisation of a member's ids on the shared output bytes (real tokenizers, property tests)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenfuse.members.codec import ByteCodec
from tokenfuse.engine.sync import append_token, in_step, resync
from tokenfuse.errors import AlignmentError
from tokenfuse.members.base import SeqState

FAMILIES = ("smollm2", "gemma3", "qwen")
SENTINEL = object()


@pytest.fixture(scope="module")
def codecs(tokenizers) -> dict[str, ByteCodec]:
    return {name: ByteCodec(tok) for name, tok in tokenizers.items()}


@pytest.fixture(scope="module")
def allowed_bytes(codecs) -> frozenset[int]:
    """Bytes every member has a single-byte token for.

    smollm2 lacks single-byte tokens for a few control bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D) and
    for the lead bytes 0xF1/0xF2 (and bytes never valid in UTF-8): text with such a character cannot
    be held by smollm2 at all (the union marks it unrepresentable, so the ensemble never emits it),
    and a cut through such a character would be held back instead of fed as raw bytes. Generated
    text is restricted to characters whose UTF-8 bytes are all in every codec's ``byte_ids``.
    """
    ok = set(range(256))
    for codec in codecs.values():
        ok &= {b for b in range(256) if codec.byte_ids[b] is not None}
    assert 0x41 in ok and 0xF0 in ok and 0x04 not in ok
    return frozenset(ok)


@pytest.fixture(scope="module")
def single_token(codecs) -> dict[str, dict[bytes, int]]:
    """Per family: bytes -> the lowest id with exactly those bytes."""
    out = {}
    for name, codec in codecs.items():
        table: dict[bytes, int] = {}
        for i, b in enumerate(codec.token_bytes):
            if b and b not in table:
                table[b] = i
        out[name] = table
    return out


# ---------------------------------------------------------------------------------- helpers
def check_state(codec: ByteCodec, state: SeqState, output: bytes) -> None:
    """The SeqState invariants: ids decode to the covered output and starts are their offsets."""
    assert len(state.starts) == len(state.ids)
    assert 0 <= state.covered <= len(output)
    assert codec.decode(state.ids) == output[: state.covered]
    pos = 0
    for i, tid in enumerate(state.ids):
        assert state.starts[i] == pos, (i, state.starts, state.ids)
        pos += len(codec.token_bytes[tid] or b"")
    assert pos == state.covered


def step(codec: ByteCodec, state: SeqState, output: bytes, *, window: int = 8) -> None:
    """One resync with a simulated cache: everything is cached before it; check what it keeps."""
    state.n_valid = state.length
    state.logprobs = SENTINEL
    old = list(state.ids)
    resync(codec, state, output, window=window, check=True)
    check_state(codec, state, output)
    kept = state.n_valid - len(state.prompt_ids)
    assert 0 <= kept <= len(old)
    assert state.ids[:kept] == old[:kept], "the cache claims ids that changed"
    if state.ids[: len(old)] == old:  # only appended: the cache stays whole
        assert state.n_valid == len(state.prompt_ids) + len(old)
    if state.ids != old:
        assert state.logprobs is None, "stale log-probs kept after the ids changed"


def feed(codec: ByteCodec, data: bytes, cuts, *, window: int = 8, prompt: list[int] | None = None) -> SeqState:
    state = SeqState(prompt_ids=list(prompt or []))
    for cut in sorted(set(cuts)) + [len(data)]:
        step(codec, state, data[:cut], window=window)
    assert state.prompt_ids == list(prompt or [])
    return state


def assert_complete(codec: ByteCodec, state: SeqState, data: bytes) -> None:
    assert state.covered == len(data)
    assert state.provisional is False
    assert codec.decode(state.ids) == data
    assert codec.decode(state.ids) == codec.decode(codec.encode_bytes(data))


# ---------------------------------------------------------------------------------- properties
SPECIAL_CHARS = [" ", "  ", "\n", "\n\n", "\t", "a", "aa", "e", "0", "12", ".", ",", "<", ">", "|", "_",
                 "é", "ï", "\u0301", "ß", "—", "’", "😀", "👍🏽", "東", "京", "€", "▁", "Ġ", "\r\n",
                 "<|im_end|>", "<end_of_turn>", "<start_of_turn>", "<eos>", "<table>", " the", "ing"]


def texts(allowed: frozenset[int]):
    char = st.characters(codec="utf-8").filter(lambda ch: all(b in allowed for b in ch.encode()))
    run = st.tuples(st.sampled_from([" ", "\n", "a", "0", "😀", "ab", "\t"]), st.integers(2, 40)).map(
        lambda t: t[0] * t[1])
    part = st.one_of(char, st.sampled_from([s for s in SPECIAL_CHARS if all(b in allowed for b in s.encode())]), run)
    return st.lists(part, max_size=40).map("".join)


# Derandomised: the same examples on every run (a failure is reproducible, never flaky).
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)


@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_resync_property(codecs, allowed_bytes, family, data):
    codec = codecs[family]
    text = data.draw(texts(allowed_bytes), label="text")
    raw = text.encode()
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12), label="cuts")
    window = data.draw(st.sampled_from([1, 2, 3, 8, 1000]), label="window")
    state = feed(codec, raw, cuts, window=window)
    assert_complete(codec, state, raw)


@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_append_and_resync_mix_property(codecs, single_token, allowed_bytes, family, data):
    """The engine's step: a member with the exact piece as one token appends it, the others resync."""
    codec, table = codecs[family], single_token[family]
    raw = data.draw(texts(allowed_bytes), label="text").encode()
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(raw))), max_size=15), label="cuts")))
    window = data.draw(st.sampled_from([1, 3, 8]), label="window")
    state = SeqState(prompt_ids=[])
    before = 0
    for cut in [c for c in cuts if c <= len(raw)] + [len(raw)]:
        output = raw[:cut]
        piece = output[before:]
        tid = table.get(piece, -1)
        if tid >= 0 and in_step(state, before):
            state.n_valid = state.length
            old = list(state.ids)
            append_token(state, tid, len(piece))
            assert state.ids == old + [tid] and state.n_valid == len(old)
            check_state(codec, state, output)
        else:
            step(codec, state, output, window=window)
        before = cut
    assert_complete(codec, state, raw)


# ---------------------------------------------------------------------------------- examples
@pytest.mark.parametrize("family", FAMILIES)
def test_emoji_split_across_chunks(codecs, family):
    codec = codecs[family]
    raw = "Hi 😀!".encode()
    assert raw == b"Hi \xf0\x9f\x98\x80!"
    state = SeqState(prompt_ids=[])
    step(codec, state, raw[:3])
    assert (state.covered, state.provisional) == (3, False)
    for cut in (4, 5, 6):  # inside the emoji: raw byte tokens, provisional
        step(codec, state, raw[:cut])
        assert (state.covered, state.provisional) == (cut, True)
        assert codec.decode(state.ids) == raw[:cut]
    step(codec, state, raw[:7])
    assert (state.covered, state.provisional) == (7, False)
    step(codec, state, raw)
    assert_complete(codec, state, raw)
    # The provisional byte tokens were replaced: the emoji is tokenised as a whole again.
    assert codec.decode(state.ids) == raw and state.ids == codec.encode_bytes(raw)


@pytest.mark.parametrize("family", FAMILIES)
def test_multilingual_text_byte_by_byte(codecs, family):
    codec = codecs[family]
    raw = "naïve café 😀 東京".encode()
    state = feed(codec, raw, range(len(raw) + 1))
    assert_complete(codec, state, raw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window", [1, 8, 1000])
def test_special_token_strings_as_literal_text(codecs, family, window):
    codec = codecs[family]
    raw = "a <|im_end|> b <end_of_turn>\n<start_of_turn>model <eos>".encode()
    state = feed(codec, raw, range(0, len(raw), 3), window=window)
    assert_complete(codec, state, raw)
    assert not set(state.ids) & codec.special_ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", ["  leading spaces", "trailing spaces   ", "\n\nnewlines first", "last\n\n\n",
                                  " ", "\n", " \n \n ", "\t x \t"])
def test_leading_and_trailing_whitespace(codecs, family, text):
    codec = codecs[family]
    raw = text.encode()
    state = feed(codec, raw, range(len(raw)))
    assert_complete(codec, state, raw)
    state = feed(codec, raw, [])
    assert_complete(codec, state, raw)
    assert state.ids == codec.encode_bytes(raw)  # one chunk from empty: the plain encoding


@pytest.mark.parametrize("family", FAMILIES)
def test_window_wider_than_the_text(codecs, family):
    codec = codecs[family]
    raw = "short 😀 text".encode()
    state = feed(codec, raw, [2, 7, 9, 12], window=10_000)
    assert_complete(codec, state, raw)
    assert state.ids == codec.encode_bytes(raw)  # the whole output is always re-encoded


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window", [1, 2, 3])
def test_long_runs_with_a_small_window(codecs, family, window):
    """Runs make the window's left edge unstable, so resync widens it (up to its limit)."""
    codec = codecs[family]
    for text in ["\n" * 130, "a" * 90, " " * 70 + "x", "0 a9|a\u0301aaab   > \t", "😀" * 30]:
        raw = text.encode()
        for cuts in (range(0, len(raw), 7), [40, 42, 45, 66], [3, 4, 10, 11, 15, 16, 17]):
            state = feed(codec, raw, [c for c in cuts if c <= len(raw)], window=window)
            assert_complete(codec, state, raw)


def test_widening_stops_at_the_window_it_encoded(codecs):
    """Regression: after the last allowed widening, ids were kept from the wrong window (bytes lost)."""
    codec = codecs["qwen"]
    raw = "0 a9|a\u0301aaab   > \t".encode()
    state = feed(codec, raw, [3, 4, 10, 11, 15, 16], window=3)
    assert_complete(codec, state, raw)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_are_never_touched(codecs, family):
    codec = codecs[family]
    prompt = codec.encode_text("The prompt ends with a space ")
    raw = "and the output 😀 continues".encode()
    state = feed(codec, raw, range(0, len(raw), 2), window=1000, prompt=prompt)
    assert_complete(codec, state, raw)
    assert state.prompt_ids == prompt
    assert state.n_valid >= len(prompt)
    assert state.all_ids() == prompt + state.ids


@pytest.mark.parametrize("family", FAMILIES)
def test_mix_of_append_token_and_resync(codecs, single_token, family):
    codec, table = codecs[family], single_token[family]
    output = b""
    state = SeqState(prompt_ids=[])
    appended = resynced = 0
    for piece in [b"Hello", b" world", b"!", b" \xf0\x9f", b"\x98\x80", b" caf", b"\xc3\xa9", b"\n", b"\n",
                  b"<|im_end|>", b" the", b"re", b" \xe6\x9d\xb1", b"\xe4\xba\xac"]:
        before = len(output)
        output += piece
        tid = table.get(piece, -1)
        if tid >= 0 and in_step(state, before):
            append_token(state, tid, len(piece))
            appended += 1
            check_state(codec, state, output)
        else:
            step(codec, state, output, window=4)
            resynced += 1
        assert state.covered == len(output)
        assert not state.provisional or output.endswith(b" \xf0\x9f")  # only inside the emoji
    assert appended >= 5 and resynced >= 3
    assert_complete(codec, state, output)
    assert output.decode() == "Hello world! 😀 café\n\n<|im_end|> there 東京"


def test_in_step_and_append_token():
    state = SeqState(prompt_ids=[7], ids=[1], starts=[0], covered=3, n_valid=2, logprobs=SENTINEL)
    assert in_step(state, 3) and not in_step(state, 4)
    append_token(state, 5, 2)
    assert (state.ids, state.starts, state.covered, state.n_valid) == ([1, 5], [0, 3], 5, 2)
    assert state.logprobs is None
    state.provisional = True
    assert not in_step(state, 5)


@pytest.mark.parametrize("family", FAMILIES)
def test_resync_when_in_sync_is_a_no_op(codecs, family):
    codec = codecs[family]
    raw = b"already in sync"
    state = feed(codec, raw, [])
    ids, starts = list(state.ids), list(state.starts)
    state.n_valid, state.logprobs = state.length, SENTINEL
    resync(codec, state, raw, check=True)
    assert (state.ids, state.starts, state.n_valid, state.logprobs) == (ids, starts, len(ids), SENTINEL)


def test_unencodable_tail_is_held_back(tokenizers, codecs):
    """A codec without a byte token for a lead byte holds the cut character back until it completes."""
    real = codecs["qwen"]
    tables = real.tables()
    tables["byte_ids"] = list(tables["byte_ids"])
    tables["byte_ids"][0xF0] = None  # as if 0xF0 had no single-byte token
    codec = ByteCodec(tokenizers["qwen"], tables=tables)
    raw = "ab 😀 c".encode()
    state = SeqState(prompt_ids=[])
    step(codec, state, raw[:3])
    for cut in (4, 5, 6):  # the emoji's first bytes: not representable yet, held back
        step(codec, state, raw[:cut])
        assert (state.covered, state.provisional) == (3, False)
    step(codec, state, raw[:7])
    assert (state.covered, state.provisional) == (7, False)
    step(codec, state, raw)
    assert_complete(codec, state, raw)
    # The real codec feeds the same cut as raw byte tokens instead.
    state = feed(real, raw, [5])
    assert_complete(real, state, raw)
    partial = SeqState(prompt_ids=[])
    step(real, partial, raw[:5])
    assert (partial.covered, partial.provisional) == (5, True)


def test_unrepresentable_text_raises(codecs):
    """smollm2 cannot hold U+0004 at all; resync says so instead of desynchronising silently."""
    codec = codecs["smollm2"]
    state = SeqState(prompt_ids=[])
    with pytest.raises(AlignmentError):
        resync(codec, state, b"a\x04b", check=True)
