"""What the proper text scores need from the members, one teacher-forced pass each.

A document is cut into the **primary** member's own tokens of it (``ByteCodec.encode_text``). Every
token-level row (``tokenfuse.engine.text_rows``) is, before each of those tokens, a distribution over
the primary's next token, built from numbers each member computes at a point that depends only on
the tokens so far: that is what makes the rows proper (docs/methods.md, "Proper scores of text").

Per primary position ``k`` (before its token ``t_k``) this module keeps:

- ``p_true[k]``: the primary's probability of ``t_k``; ``cand[k]``, ``p_cand[k]``: its ``K`` most
  likely *text* tokens (``C_k``) and their probabilities; ``true_at[k]``: where ``t_k`` is in ``C_k``
  (``-1``: not among them).
- for every other member ``j``: ``e[j][k, c]``, its probability that the text goes on with exactly the
  bytes of candidate ``c``. The member is re-synchronised on the bytes so far as in generation
  (``engine.sync.resync``), and its last token is *healed*: it is dropped, its bytes ``r`` become a
  condition, and the member's distribution one token earlier says how the text goes on after
  ``r``. With ``h`` its ids before that last token,
  ``e = [p(token r+v | h) + p(r | h) · p(token v | h, r)] / M(r | h)``, where ``M(r | h)`` is the mass
  of its tokens that start with ``r``: the two one- and two-token paths to exactly ``r+v``, given
  that the text starts with ``r``. Distinct candidates are distinct paths, so ``Σ_c e[j][k, c] ≤ 1``.
  (A raw-byte or held-back tail leaves only the one-token path.)

Each member alone is scored on its own tokens of the document (``single``: the log-probability of
every one of them after the start token).

The members' distributions come from ``Rows``: the member's next-token log-probabilities after each
of many id lists, which ``from_member`` computes with ``members.reading.positions`` (one chunked
forward per run of lists that only grow: the primary's lists and a member's own tokens are one run;
healing only ever asks for prefixes of the re-synchronised ids, almost always prefixes of the
member's own tokens of the document).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.engine.sync import incomplete_tail, resync
from tokenfuse.members.base import Member, SeqState
from tokenfuse.members.codec import ByteCodec
from tokenfuse.members.reading import Take, positions

DEFAULT_CANDIDATES = 16


@dataclass
class Rows:
    """A member as the text scores see it: its codec, its start ids (BOS, else EOS), ``fn``, its
    next-token log-probabilities after each of a list of id lists (start ids included), and
    ``take``, given entries of those rows (``None``: taken from ``fn``'s rows). ``take`` gives ``fn``'s
    entries bit for bit without keeping whole rows (``Member.logprobs_at``'s ``pick``)."""

    name: str
    codec: ByteCodec
    start: list[int]
    fn: Callable[[list[list[int]]], list[torch.Tensor]]
    take: Take | None = None
    held: Callable[[], contextlib.AbstractContextManager[Take]] | None = None

    @classmethod
    def from_member(cls, member: Member, start: Sequence[int] | None = None) -> Rows:
        """The member's rows after ``start`` (default: its start ids, ``encode_prompt("")``; byte-level
        generation gives a prompt's ids)."""
        start = member.encode_prompt("") if start is None else list(start)

        def fn(lists: list[list[int]], ids: list[Sequence[int]] | None = None) -> list[torch.Tensor]:
            st = member.new_state(start)
            try:
                return positions(member, st, lists, pick=None if ids is None else list(ids))
            finally:
                member.release(st)

        def take(lists: list[list[int]], ids: list[Sequence[int]]) -> list[np.ndarray]:
            return [r.numpy().astype(np.float64) for r in fn(lists, ids)]

        return cls(member.name, member.codec, start, fn, take, lambda: member.reader(start))

    @contextlib.contextmanager
    def reader(self) -> Iterator[Take]:
        """``entries`` for many reads along one text (a byte model's): the member's reader
        (``Member.reader``: sequence states kept across calls, a list that shares a prefix with one fed
        before re-feeding only the rest; on llama.cpp branches off one trunk in shared calls); without
        one (``held``), ``entries``."""
        if self.held is None:
            yield self.entries
            return
        with self.held() as take:
            yield take

    def entries(self, lists: list[list[int]], ids: list[Sequence[int]]) -> list[np.ndarray]:
        """The natural-log probabilities of ``ids[j]`` (several) after ``lists[j]``, for each ``j``."""
        if self.take is not None:
            return self.take(lists, ids)
        return [r.numpy()[np.asarray(x, dtype=np.int64)].astype(np.float64) for r, x in zip(self.fn(lists), ids)]

    def logprobs_of(self, lists: list[list[int]], ids: list[int]) -> np.ndarray:
        """The natural-log probability of ``ids[j]`` after ``lists[j]``, for each ``j``."""
        if not lists:
            return np.zeros(0)
        return np.array([float(x[0]) for x in self.entries(lists, [[t] for t in ids])], dtype=np.float64)


@dataclass
class DocFeatures:
    """One document's numbers (see the module docstring); ``single[i]`` is member ``i``'s natural-log
    probability of each of its own tokens, ``tokens[i]`` their bytes' lengths."""

    nbytes: int
    primary: int
    p_true: np.ndarray  # float64[n]
    cand: np.ndarray  # int64[n, K]
    p_cand: np.ndarray  # float64[n, K]
    true_at: np.ndarray  # int64[n]
    e: dict[int, np.ndarray] = field(default_factory=dict)  # member -> float64[n, K]
    single: dict[int, np.ndarray] = field(default_factory=dict)  # member -> float64[its tokens]
    piece_bytes: list[int] = field(default_factory=list)  # bytes of each primary token

    def to_npz(self) -> dict[str, np.ndarray]:
        out = {"nbytes": np.array(self.nbytes), "primary": np.array(self.primary), "p_true": self.p_true,
               "cand": self.cand, "p_cand": self.p_cand, "true_at": self.true_at,
               "piece_bytes": np.asarray(self.piece_bytes, dtype=np.int64)}
        out.update({f"e{j}": v for j, v in self.e.items()})
        out.update({f"single{i}": v for i, v in self.single.items()})
        return out

    @classmethod
    def from_npz(cls, data) -> DocFeatures:
        f = cls(int(data["nbytes"]), int(data["primary"]), data["p_true"], data["cand"], data["p_cand"],
                data["true_at"], piece_bytes=data["piece_bytes"].tolist())
        for key in data.files:
            if key.startswith("e") and key[1:].isdigit():
                f.e[int(key[1:])] = data[key]
            elif key.startswith("single"):
                f.single[int(key[6:])] = data[key]
        return f


class _Vocab(TokenBytes):
    """``TokenBytes`` with a mask: 0 on text tokens, -inf elsewhere (the primary's candidates)."""

    def __init__(self, codec: ByteCodec) -> None:
        super().__init__(codec.token_bytes)
        mask = torch.full((len(codec.token_bytes),), float("-inf"))
        mask[torch.from_numpy(self.order)] = 0.0
        self.text_mask = mask


def _mass(lp: np.ndarray, ids: Sequence[int] | np.ndarray) -> float:
    """The probability mass of ``ids`` under the log-probabilities ``lp``."""
    if len(ids) == 0:
        return 0.0
    return float(np.exp(lp[ids].astype(np.float64)).sum())


@dataclass
class _Heal:
    """Where member ``j`` stands before one primary position: its ids before its last token (``h``),
    that token's bytes plus any held-back bytes (``r``) and, where that tail is one whole token, all
    its ids (``full``; ``None`` otherwise)."""

    h: list[int]
    r: bytes
    full: list[int] | None


def _heal(st: SeqState, output: bytes) -> _Heal:
    ids = list(st.ids)
    if not ids:
        return _Heal([], output, None)
    if st.covered == len(output) and not st.provisional:
        m = len(ids) - 1
        return _Heal(ids[:m], output[st.starts[m]:], ids)
    cut = len(output) - incomplete_tail(output)  # where an unfinished character (raw-byte tail) starts
    m = next((i for i, s in enumerate(st.starts) if s >= cut), len(ids))
    m = max(0, m - 1)
    return _Heal(ids[:m], output[st.starts[m]:] if m < len(ids) else output[st.covered:], None)


def primary_tokens(codec: ByteCodec, text: str) -> list[int]:
    """The primary member's own tokens of ``text`` (exact bytes; raw bytes where a normaliser would change them)."""
    ids = codec.encode_text(text)
    if codec.decode(ids) != text.encode("utf-8"):
        ids = codec.encode_bytes(text.encode("utf-8"))
    return ids


def doc_features(text: str, members: Sequence[Rows], primary: int, *, k: int = DEFAULT_CANDIDATES,
                 vocabs: dict[int, _Vocab] | None = None) -> DocFeatures:
    """Every number the rows need for one document (one ``Rows.fn`` call per member)."""
    vocabs = vocabs if vocabs is not None else {}
    for i, m in enumerate(members):
        if i not in vocabs:
            vocabs[i] = _Vocab(m.codec)
    data = text.encode("utf-8")
    pm = members[primary]
    toks = primary_tokens(pm.codec, text)
    n = len(toks)
    piece_bytes = [len(pm.codec.token_bytes[t] or b"") for t in toks]
    # the primary: its rows before each of its tokens (one run); its own tokens are its ``single``
    rows = pm.fn([pm.start + toks[:j] for j in range(n)]) if n else []
    lp = torch.stack(rows) if rows else torch.zeros((0, len(pm.codec.token_bytes)))
    p_true = torch.exp(lp[torch.arange(n), torch.tensor(toks, dtype=torch.long)].double()).numpy() if n else np.zeros(0)
    kk = min(k, len(vocabs[primary].sorted))
    top_lp, cand = torch.topk(lp + vocabs[primary].text_mask, kk, dim=-1)
    cand_np = cand.numpy().astype(np.int64)
    true_at = np.full(n, -1, dtype=np.int64)
    for j, t in enumerate(toks):
        hit = np.flatnonzero(cand_np[j] == t)
        if hit.size:
            true_at[j] = int(hit[0])
    feats = DocFeatures(len(data), primary, p_true, cand_np, torch.exp(top_lp.double()).numpy(), true_at,
                        piece_bytes=piece_bytes)
    feats.single[primary] = np.log(np.maximum(p_true, 0.0)) if n else np.zeros(0)
    del rows, lp, top_lp
    cand_bytes = [[pm.codec.token_bytes[c] for c in row] for row in cand_np.tolist()]
    for i, m in enumerate(members):
        if i != primary:
            feats.e[i], feats.single[i] = _member_features(m, vocabs[i], data, toks, pm.codec, cand_bytes)
    return feats


def _member_features(m: Rows, vocab: _Vocab, data: bytes, toks: list[int], pcodec: ByteCodec,
                     cand_bytes: list[list[bytes]]) -> tuple[np.ndarray, np.ndarray]:
    """Member ``m``'s ``e`` (healed, before each primary position) and its own ``single`` log-probabilities."""
    own = primary_tokens(m.codec, data.decode("utf-8"))
    st = SeqState(prompt_ids=list(m.start))
    heals: list[_Heal] = []
    out = b""
    for t in toks:
        resync(m.codec, st, out)
        heals.append(_heal(st, out))
        out += pcodec.token_bytes[t] or b""
    wanted = {tuple(m.start + own[:j]) for j in range(len(own))}
    for hl in heals:
        wanted.add(tuple(m.start + hl.h))
        if hl.full is not None:
            wanted.add(tuple(m.start + hl.full))
    lists = sorted(wanted)  # a prefix sorts before what extends it: runs that only grow stay together
    got = dict(zip(lists, m.fn([list(x) for x in lists])))
    rows = {key: r.numpy() for key, r in got.items()}
    single = np.array([float(rows[tuple(m.start + own[:j])][own[j]]) for j in range(len(own))], dtype=np.float64)
    e = np.zeros((len(toks), len(cand_bytes[0]) if cand_bytes else 0), dtype=np.float64)
    for pos, hl in enumerate(heals):
        lh = rows[tuple(m.start + hl.h)]
        total = _mass(lh, vocab.starting_with(hl.r))
        if total <= 0:
            continue
        lf = rows[tuple(m.start + hl.full)] if hl.full is not None else None
        p_tail = math.exp(float(lh[hl.full[-1]])) if hl.full is not None else 0.0
        for c, v in enumerate(cand_bytes[pos]):
            p = _mass(lh, vocab.exact.get(hl.r + v, ()))
            if lf is not None:
                p += p_tail * _mass(lf, vocab.exact.get(v, ()))
            e[pos, c] = p / total
    return e, single
