"""The step trace: what every step of a sequence did, for a reader (``Ensemble.generate(..., trace=True)``).

Per step: the chosen piece (its text and exact bytes), the probability the combined distribution
gave it, that distribution's most likely pieces, each member's own top-k tokens and whether it
holds the chosen piece as one token, and how the step was decided (its ``StepFlags``: gated /
ensembled / agreement skip; ``speculative`` is always false: traced sequences are decoded plainly,
except in SAFE's drafted rounds, where every position is combined for its record and ``ensembled``
says whether SAFE triggered there).

Zero cost when off: a sequence opened without ``trace`` has ``OpenSequence.trace is None`` and the
decider computes nothing extra for it. When on, a step additionally combines the members even
where agreement skip decided (to report the combined probability; the choice is unchanged), and
takes each member's top-k.

Shapes (``TraceStep.to_dict()``, the JSON of ``tokenfuse generate --trace`` and of the server's
``tokenfuse.trace``; bytes are lower-case hex strings of the exact bytes):

    {"step": 0,                      # 0-based step of this sequence
     "text": " Paris",               # what the step adds to the output text (see below)
     "bytes": "205061726973",        # hex of the chosen piece's bytes as they stand in the output
     "token": " Paris",              # the chosen piece as text; END: the primary member's end token
     "end": false,                   # END was chosen (text and bytes are empty)
     "cut": false,                   # a stop string removed (part of) this piece from the output
     "prob": 0.81,                   # combined probability of the chosen piece (or END)
     "top": [{"text": " Paris", "bytes": "205061726973", "prob": 0.81, "end": false}, ...],
     "gated": false, "ensembled": true, "skipped": false, "speculative": false,
     "members": [{"name": "smollm2", "computed": true, "holds_piece": true, "piece_prob": 0.77,
                  "top": [{"id": 7042, "text": " Paris", "bytes": "205061726973", "prob": 0.77,
                           "end": false}, ...]}, ...]}

- ``text``: the steps' texts concatenate to the output text exactly (``Generation.text``), their
  bytes to the output bytes; a UTF-8 character split across pieces appears in the text of the step
  that completes it. With a stop string the output is trimmed, and so are the last steps' bytes.
- ``prob`` and ``top``: the distribution the step's choice was made from, before temperature /
  top-p / top-k: the combiner's (GaC: the weighted average of the members' projected
  distributions; UniTE: over the union of the members' top-k candidates), or on a gated step the
  gate member's own distribution. ``top`` lists its ``k`` most likely entries (zero-probability
  padding left out).
- ``members``: every member in ensemble order; ``computed`` is false for a member that did not run
  this step (gated steps, weight 0), whose ``top`` and ``piece_prob`` are then ``null``. A member's
  probabilities are its own softmax over its whole vocabulary; ``piece_prob`` is its probability of
  the chosen piece as one token (summed over ids spelling it; END: over its end ids), ``null``
  when it holds no such token (``holds_piece`` false). Member top-k entries carry the token ``id``;
  ``bytes`` is empty for tokens that are not text (END and other special tokens), whose ``text``
  is the token's own string (e.g. ``<|im_end|>``).
- ``terms`` (present only where the combiner reports them, ``Dist.terms``): the numbers the chosen
  piece's probability was computed from, by name. ``contrast``: ``{"score": 1.2, "expert:B": -0.9,
  "amateur:A": -4.1, "amateur:C": -3.3}`` (natural logs; ``combiners/contrast.py``).
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Dist
from tokenfuse.engine.flags import Flagged, StepFlags
from tokenfuse.members.base import Member, SeqState


@dataclass(frozen=True)
class TraceOptions:
    """What a traced sequence records: ``k`` most likely entries of the combined distribution and,
    with ``members``, of each member (the server's ``logprobs`` alone need only the combined ones)."""

    k: int = 5
    members: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"trace k must be a non-negative integer, got {self.k!r}")


@dataclass(frozen=True)
class TopEntry:
    """One of the most likely entries: ``id`` is the member's token id (``None`` in the combined top)."""

    text: str
    bytes: str
    prob: float
    end: bool = False
    id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"text": self.text, "bytes": self.bytes, "prob": self.prob, "end": self.end}
        if self.id is not None:
            d["id"] = self.id
        return d


@dataclass(frozen=True)
class PromptPiece:
    """A scored prompt piece (``Ensemble.score_prompt``): its bytes, its log-probability given the
    pieces before it (``None`` for the first), the combined distribution's most likely entries there."""

    bytes: bytes
    logprob: float | None = None
    top: tuple[TopEntry, ...] = ()


@dataclass(frozen=True)
class MemberStep:
    """One member at one step (see the module docstring)."""

    name: str
    computed: bool
    holds_piece: bool
    piece_prob: float | None = None
    top: tuple[TopEntry, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "computed": self.computed, "holds_piece": self.holds_piece,
                "piece_prob": self.piece_prob, "top": None if self.top is None else [t.to_dict() for t in self.top]}


@dataclass(frozen=True)
class StepRecord(Flagged):
    """What the decider saw at one step of one traced sequence (its place in the output is added by
    ``Trace``: ``TraceStep``). ``flags``: how the step was decided (``StepFlags``; ``r.gated``,
    ``r.ensembled``, ``r.skipped``, ``r.speculative``, ... read them)."""

    token: str
    end: bool
    prob: float
    top: tuple[TopEntry, ...]
    flags: StepFlags = field(default_factory=StepFlags)
    members: tuple[MemberStep, ...] = ()
    terms: dict[str, float] | None = None


@dataclass(frozen=True, kw_only=True)
class TraceStep(StepRecord):
    """One step of a traced sequence, as a reader sees it (``to_dict``: its JSON; the module docstring):
    its ``StepRecord`` placed in the output, ``step`` its number, ``text`` and ``bytes`` (hex) what it
    adds to the output, ``cut`` whether a stop string trimmed it."""

    step: int
    text: str
    bytes: str
    cut: bool = False

    @property
    def logprob(self) -> float:
        """The natural log of ``prob`` (``-inf`` for 0)."""
        return math.log(self.prob) if self.prob > 0 else -math.inf

    @property
    def raw(self) -> bytes:
        """The step's bytes in the output."""
        return bytes.fromhex(self.bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "text": self.text, "bytes": self.bytes, "token": self.token, "end": self.end,
                "cut": self.cut, "prob": self.prob, "top": [t.to_dict() for t in self.top], "gated": self.gated,
                "ensembled": self.ensembled, "skipped": self.skipped, "speculative": self.speculative,
                "members": [m.to_dict() for m in self.members], **({"terms": self.terms} if self.terms else {})}


# ---------------------------------------------------------------------------- one sequence's trace

@dataclass
class Trace:
    """A traced sequence's steps: recorded as the decider decides them (``add``), trimmed by a stop
    string (``cut``), released with their text once their bytes are final (``release``)."""

    options: TraceOptions
    steps: list[TraceStep] = field(default_factory=list)  # released so far
    _pending: list[list] = field(default_factory=list)  # [record, start, end, cut]
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def add(self, record: StepRecord, start: int, end: int) -> None:
        """A step whose piece spans output bytes ``[start, end)``."""
        self._pending.append([record, start, end, False])

    def cut(self, n: int) -> None:
        """The output was trimmed to ``n`` bytes (a stop string): trim the pending steps' spans."""
        for p in self._pending:
            if p[2] > n:
                p[1], p[2], p[3] = min(p[1], n), n, True

    def release(self, out: bytes, limit: int | None) -> list[TraceStep]:
        """The pending steps whose bytes end by ``limit`` (``None``: all, the sequence has finished),
        with their text; ``out`` is the output."""
        take = len(self._pending) if limit is None else sum(1 for p in self._pending if p[2] <= limit)
        done = []
        for n, (rec, start, end, cut) in enumerate(self._pending[:take]):
            final = limit is None and n == take - 1
            text = self._decoder.decode(out[start:end], final=final)
            done.append(TraceStep(**vars(rec), step=len(self.steps) + len(done), text=text,
                                  bytes=out[start:end].hex(), cut=cut))
        del self._pending[:take]
        self.steps.extend(done)
        return done


# ---------------------------------------------------------------------------- recording a step

def token_text(member: Member, tid: int) -> str:
    """A member token as text: its bytes (invalid UTF-8 replaced), or for a token that is not text
    (END, special) its own string."""
    b = member.codec.token_bytes[tid] if tid < len(member.codec.token_bytes) else None
    if b is not None:
        return b.decode("utf-8", errors="replace")
    tok = getattr(member, "tokenizer", None)
    s = tok.convert_ids_to_tokens(int(tid)) if tok is not None and hasattr(tok, "convert_ids_to_tokens") else None
    return s if isinstance(s, str) else f"<{tid}>"


def end_text(member: Member) -> str:
    """How END is written: the member's end-of-sequence token (its first end id's string otherwise)."""
    tok = getattr(member, "tokenizer", None)
    eos, eid = getattr(tok, "eos_token", None), getattr(tok, "eos_token_id", None)
    if isinstance(eos, str) and eos and eid in member.codec.end_ids:
        return eos
    ends = sorted(member.codec.end_ids)
    return token_text(member, ends[0]) if ends else "<end>"


def entry_text(space: VocabSpace, entry: int, end: str) -> str:
    return end if entry == END else space.piece(entry).decode("utf-8", errors="replace")


def combined_top(space: VocabSpace, dist: Dist, row: int, k: int, end: str) -> tuple[TopEntry, ...]:
    """The ``k`` most likely entries of row ``row`` of a combined distribution (zero mass left out)."""
    p = dist.probs[row]
    if k <= 0:
        return ()
    vals, cols = torch.topk(p, min(k, p.numel()))
    out = []
    for v, c in zip(vals.tolist(), cols.tolist()):
        if v <= 0:
            break
        e = dist.entry(row, c)
        out.append(TopEntry(entry_text(space, e, end), space.piece(e).hex(), float(v), end=e == END))
    return tuple(out)


def entry_column(dist: Dist, row: int, entry: int) -> int | None:
    """The column of ``entry`` in row ``row`` (``None`` when it is not among the columns)."""
    if dist.index is None:
        return entry
    cols = (dist.index[row] == entry).nonzero()
    return int(cols[0]) if len(cols) else None


def entry_prob(dist: Dist, row: int, entry: int) -> float:
    """The combined probability of ``entry`` in row ``row`` (0 when it is not among the columns)."""
    col = entry_column(dist, row, entry)
    return float(dist.probs[row, col]) if col is not None else 0.0


def entry_terms(dist: Dist, row: int, entry: int) -> dict[str, float] | None:
    """The combiner's terms (``Dist.terms``) of ``entry`` in row ``row``; ``None`` without any."""
    col = entry_column(dist, row, entry)
    if not dist.terms or col is None:
        return None
    terms = {k: float(v[row, col]) for k, v in dist.terms.items()}
    return terms if all(math.isfinite(x) for x in terms.values()) else None


def member_step(space: VocabSpace, member: Member, i: int, out: Any, row: int, state: SeqState, entry: int,
                k: int) -> MemberStep:
    """Member ``i`` at one step: its top-``k`` from its output ``out`` (row ``row``) and its probability
    of the chosen ``entry`` as one token."""
    ids = space.projector.entry_ids(i, entry)
    if out is None:
        return MemberStep(member.name, False, bool(ids))
    if out.logprobs is not None:
        lp = out.logprobs[row]
        vals, tids = torch.topk(lp, min(k, lp.shape[-1]))
        piece = float(lp[ids].exp().sum()) if ids else None
    else:
        vals, tids = out.topk[0][row, :k], out.topk[1][row, :k]
        piece = float(member.token_logprobs([state], torch.tensor([ids])).exp().sum()) if ids else None
    ends = member.codec.end_ids
    top = tuple(TopEntry(token_text(member, t), (member.codec.token_bytes[t] or b"").hex(), p, end=t in ends, id=t)
                for p, t in zip(vals.exp().tolist(), tids.tolist()))
    return MemberStep(member.name, True, bool(ids), piece, top)


def record_step(space: VocabSpace, members: Sequence[Member], primary: int, options: TraceOptions, entry: int,
                dist: Dist, dist_row: int, outs: dict[int, Any], row: int, states: Sequence[SeqState], *,
                flags: StepFlags) -> StepRecord:
    """The record of one traced step: ``entry`` chosen from row ``dist_row`` of ``dist``, decided as
    ``flags``; ``outs``: the outputs of the members computed for it (row ``row``); ``states``: the
    sequence's states."""
    end = end_text(members[primary])
    rec_members: tuple[MemberStep, ...] = ()
    if options.members:
        rec_members = tuple(member_step(space, m, i, outs.get(i), row, states[i], entry, options.k)
                            for i, m in enumerate(members))
    return StepRecord(token=entry_text(space, entry, end), end=entry == END, prob=entry_prob(dist, dist_row, entry),
                      top=combined_top(space, dist, dist_row, options.k, end), flags=flags, members=rec_members,
                      terms=entry_terms(dist, dist_row, entry))
