"""Re-synchronise a member on the shared output bytes.

After a piece is appended, a member re-tokenises only a look-behind window: from the start of
one of its last ``window`` tokens (at a UTF-8 character boundary) to the end of the output. It
keeps the longest common prefix with its current ids, marks its cache valid only up to there
(the backend crops lazily at its next forward) and appends the new ids. Prompt ids are never
touched. Bytes of an unfinished UTF-8 character go in as raw byte tokens (``provisional``) and
are replaced once the character completes; a byte the vocabulary cannot hold as a single token
is held back (``covered < len(output)``) until it can be encoded as part of a full character.
"""

from __future__ import annotations

from tokenfuse.members.codec import ByteCodec
from tokenfuse.errors import AlignmentError, SyncError
from tokenfuse.members.base import SeqState

WIDEN_LIMIT = 2


def append_token(st: SeqState, token_id: int, nbytes: int) -> None:
    """Append one id the member has for exactly the new piece (the member 'emits' it itself)."""
    st.ids.append(token_id)
    st.starts.append(st.covered)
    st.covered += nbytes
    st.logprobs = None


def in_step(st: SeqState, output_len_before: int) -> bool:
    """True if the member covered the output exactly before this step, with no raw-byte tail."""
    return st.covered == output_len_before and not st.provisional


def resync(codec: ByteCodec, st: SeqState, output: bytes, *, window: int = 8, check: bool = False) -> None:
    """Make ``st.ids`` decode to ``output`` (or to all of it but a held-back tail)."""
    if st.covered == len(output) and not st.provisional:
        return
    k = max(0, len(st.ids) - window)
    for attempt in range(WIDEN_LIMIT + 1):
        k, s = window_start(st, output, k)
        new_ids, covered, provisional = _encode_window(codec, output, s)
        old = st.ids[k:]
        c = 0
        for a, b in zip(old, new_ids):
            if a != b:
                break
            c += 1
        # The window's first token disagrees: its left edge is not stable; widen it (only while
        # attempts remain: ``k`` must stay the start that ``new_ids`` were encoded from).
        if attempt < WIDEN_LIMIT and c == 0 and k > 0 and old and new_ids and old[0] != new_ids[0]:
            k = max(0, k - window)
            continue
        break
    if c < len(old) or len(new_ids) > c:
        st.logprobs = None
    keep = k + c
    starts = st.starts[:keep]
    pos = st.starts[keep] if keep < len(st.starts) else st.covered
    for tid in new_ids[c:]:
        starts.append(pos)
        pos += len(codec.token_bytes[tid] or b"")
    st.ids = st.ids[:keep] + new_ids[c:]
    st.starts = starts
    st.covered = covered
    st.provisional = provisional
    st.drop_cache_after(len(st.prompt_ids) + keep)
    if check and codec.decode(st.ids) != output[:covered]:
        raise SyncError(f"ids decode to {codec.decode(st.ids)!r}, expected {output[:covered]!r}")


def window_start(st: SeqState, output: bytes, k: int) -> tuple[int, int]:
    """The re-tokenisation window from the member's token ``k``, moved back so it never starts inside
    a UTF-8 character: ``(its first token, the output byte it starts at)``."""
    while k > 0 and 0x80 <= output[st.starts[k]] < 0xC0:
        k -= 1
    return k, (st.starts[k] if k < len(st.ids) else st.covered)


def _encode_window(codec: ByteCodec, output: bytes, start: int) -> tuple[list[int], int, bool]:
    """Ids for ``output[start:]``, the output length they cover, and whether a raw-byte tail is in."""
    seg = output[start:]
    tail = incomplete_tail(seg)
    if tail and codec.can_encode_bytes(seg[-tail:]):
        try:
            return codec.encode_bytes(seg), len(output), True
        except AlignmentError:
            pass
    body = seg[: len(seg) - tail] if tail else seg
    return codec.encode_bytes(body), start + len(body), False


def incomplete_tail(data: bytes) -> int:
    """Length of an unfinished UTF-8 character at the end of ``data`` (0 if none)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return 0
        if b >= 0xC0:  # a lead byte: how long should its character be?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back if back < need else 0
    return 0


def token_at_end(codec: ByteCodec, st: SeqState, output: bytes, piece: bytes, *, window: int = 8) -> int | None:
    """In the member's own tokenisation of ``output + piece`` (re-tokenised from one of its last
    ``window`` tokens, as ``resync`` cuts it): the id of the token that starts where ``output`` ends
    (``-1`` where ``piece`` is empty), or ``None`` where a token straddles that point, so the
    member's state there would be a fragment of one of its tokens. ``None`` also where the member
    does not cover ``output`` exactly (a held-back or raw-byte tail)."""
    if st.covered != len(output) or st.provisional:
        return None
    _, pos = window_start(st, output, max(0, len(st.ids) - window))
    try:
        ids = codec.encode_bytes(output[pos:] + piece)
    except AlignmentError:
        return None
    for tid in ids:
        if pos >= len(output):
            return tid if pos == len(output) else None
        pos += len(codec.token_bytes[tid] or b"")
    return -1 if pos == len(output) else None
