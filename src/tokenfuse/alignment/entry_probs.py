"""A member's probability of a union entry: the one rule, vectorised over rows.

The rule: a member's distribution is renormalised over its text + END ids (ids whose map is ``-1``,
special tokens and logit rows past its vocabulary, are dropped); its probability of a union entry
is the sum of its probabilities over every id that maps to the entry (usually one; END and
duplicate spellings may have several), added in ascending id order.

``EntryProbs`` holds, per member, each entry's ids in that order: the first (``first``, the spare id
``V_i`` where the member has none) and, for the few entries held under several ids, the others
(``extra``, one row per such entry, spare-padded). Everything runs on the device of the numbers it
is given, by gathers with a fixed order of summation (no scatter-add, no atomics), so a projection
is the same to the bit on every run. The tables are copied to a device once, on first use there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from tokenfuse.alignment.union import UnionVocab


@dataclass(frozen=True)
class _Tables:
    """One member's index tables on one device (see the module docstring)."""

    spare: int  # V_i: the id standing for "none"
    first: torch.Tensor  # int64[U]: each entry's first id, or spare
    multi: torch.Tensor  # int64[M]: the entries held under several ids, ascending
    extra: torch.Tensor  # int64[M, K - 1]: their other ids, ascending, spare-padded
    gather: torch.Tensor  # int32/int64[U]: ``first``, with the non-representable entries at spare
    rep_multi: torch.Tensor  # int64[M']: the representable entries of ``multi``
    rep_ids: torch.Tensor  # int64[M', K]: all their ids
    other: torch.Tensor  # int64[·]: the ids that are not text (map -1), ascending
    target: torch.Tensor  # int64[V_i]: each id's entry where every member can hold it, else -1

    def to(self, device: torch.device) -> _Tables:
        return _Tables(self.spare, *(getattr(self, f).to(device) for f in
                                     ("first", "multi", "extra", "gather", "rep_multi", "rep_ids", "other", "target")))


def _other_ids(t: _Tables, width: int) -> torch.Tensor:
    """The member's ids that are not text, of those a row of ``width`` logits holds."""
    return t.other if width >= t.spare else t.other[t.other < width]


def _mass_left(whole: torch.Tensor, rest: torch.Tensor) -> torch.Tensor | None:
    """``log(whole - rest)`` in float64 (a row's text + END mass: its whole mass less its other ids'),
    or ``None`` where that difference would lose digits (the other ids hold half the row or more) or
    a sum underflows or overflows."""
    if bool(((rest < 0.5 * whole) & (whole > 1e-30) & torch.isfinite(whole)).all()):
        return torch.log((whole - rest).double())
    return None


def _host(x: torch.Tensor) -> bool:
    """``x`` is float32 on the CPU (numpy can read it as it is)."""
    return x.device.type == "cpu" and x.dtype == torch.float32


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """``x[..., 0] + x[..., 1] + ...`` in that order (the last dimension is small; a numpy array too)."""
    out = x[..., 0]
    for k in range(1, x.shape[-1]):
        out = out + x[..., k]
    return out


class EntryProbs:
    """Each member's probability of union entries, by the rule of the module docstring.

    ``project`` gives a member's whole distribution in the union; ``probs`` / ``logprobs`` its
    probabilities of given entries per row; ``text_logmass`` the mass its renormalisation divides
    by; ``ids`` and ``total`` are the rule's two halves for callers that obtain the ids' numbers
    themselves (a member's ``token_logprobs``, an already normalised distribution).
    """

    def __init__(self, union: UnionVocab) -> None:
        self.union = union
        self.size = len(union)
        self._cpu = [self._build(m, union.representable) for m in union.maps]
        self._on: dict[tuple[int, torch.device], _Tables] = {}
        self._lock = threading.Lock()

    def _build(self, m: np.ndarray, representable: np.ndarray) -> _Tables:
        spare = len(m)
        ids = np.nonzero(m >= 0)[0]
        ids = ids[np.argsort(m[ids], kind="stable")]  # by entry, then by id
        counts = np.bincount(m[ids], minlength=self.size)
        starts = np.cumsum(counts) - counts
        first = np.full(self.size, spare, dtype=np.int64)
        held = counts > 0
        first[held] = ids[starts[held]]
        multi = np.nonzero(counts > 1)[0]
        extra = np.full((len(multi), max(1, int(counts.max(initial=1))) - 1), spare, dtype=np.int64)
        for k in range(1, extra.shape[1] + 1):
            has = counts[multi] > k
            extra[has, k - 1] = ids[starts[multi[has]] + k]
        gather = np.where(representable, first, spare).astype(np.int32 if spare < 2**31 - 1 else np.int64)
        rep = representable[multi]
        rep_ids = np.concatenate([first[multi[rep], None], extra[rep]], axis=1)
        target = np.where((m >= 0) & representable[np.maximum(m, 0)], m, -1).astype(np.int64)
        t = torch.from_numpy
        return _Tables(spare, t(first), t(multi), t(extra), t(gather), t(multi[rep]), t(rep_ids),
                       t(np.nonzero(m < 0)[0]), t(target))

    def _tables(self, member: int, device: torch.device) -> _Tables:
        key = (member, device)
        got = self._on.get(key)
        if got is None:
            with self._lock:
                got = self._on.setdefault(key, self._cpu[member].to(device))
        return got

    # ------------------------------------------------------------------ lookups
    def vocab(self, member: int) -> int:
        """The member's vocabulary size ``V_i``, also the spare id that ``ids`` pads with."""
        return self._cpu[member].spare

    def holds(self, member: int, entries: torch.Tensor) -> torch.Tensor:
        """``bool[...]``: the member has at least one id for each entry (``-1``: no)."""
        t = self._tables(member, entries.device)
        return (entries >= 0) & (t.first[entries.clamp_min(0)] != t.spare)

    def multi(self, member: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The entries the member holds under several ids (END, duplicate spellings), ascending, on
        ``device``."""
        return self._tables(member, torch.device(device)).multi

    def ids(self, member: int, entries: torch.Tensor) -> torch.Tensor:
        """``int64[..., K]``: each entry's ids in ascending order, padded with the spare id ``V_i``
        (an entry the member lacks, or ``-1``, is all spare); ``K`` is the member's largest count."""
        t = self._tables(member, entries.device)
        e = entries.clamp_min(0)
        first = torch.where(entries >= 0, t.first[e], t.spare).unsqueeze(-1)
        if not t.multi.numel():
            return first
        slot = torch.searchsorted(t.multi, e).clamp_max(len(t.multi) - 1)
        is_multi = (t.multi[slot] == e) & (entries >= 0)
        more = torch.where(is_multi.unsqueeze(-1), t.extra[slot], t.spare)
        return torch.cat([first, more], dim=-1)

    def total(self, member: int, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The sum over the last dimension of ``probs`` (each id's probability, as laid out by
        ``ids``), spare slots left out, in the ids' order."""
        return ordered_sum(torch.where(ids == self.vocab(member), torch.zeros_like(probs), probs))

    # ------------------------------------------------------------------ the rule
    def project(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """``float[R, V_i]`` log-probs -> ``float32[R, U]`` probabilities, each row's renormalised
        over the member's text + END ids.

        Entries the member lacks get 0, and so do entries some member cannot hold (never chosen);
        the mass they had still counts in the renormalisation (a row sums to 1 less that, usually
        nothing: a few control bytes). Passes over the data: exp, sum and
        divide over the member's vocabulary, then one gather into the union (a spare zero column
        past the vocabulary for the entries it lacks) and a few columns more for the entries it
        holds under several ids.
        """
        t = self._tables(member, logprobs.device)
        v = min(logprobs.shape[-1], t.spare)
        p = torch.empty(logprobs.shape[0], t.spare + 1, dtype=torch.float32, device=logprobs.device)
        torch.exp(logprobs[:, :v].float(), out=p[:, :v])
        p[:, v:] = 0.0  # the spare column (and ids past narrower logits)
        p[:, t.other] = 0.0
        p.div_(p.sum(-1, keepdim=True).clamp_min(1e-30))
        out = p.index_select(1, t.gather)
        if t.rep_multi.numel():
            out[:, t.rep_multi] = ordered_sum(p[:, t.rep_ids.flatten()].view(len(p), *t.rep_ids.shape))
        return out

    def text_logmass(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """The log of the member's mass on its text + END ids ``float64[R]``: the whole row's (its
        probabilities added in float64) less that of its few other ids (special tokens, logit rows
        past the vocabulary); where those hold half of it or more (the difference would lose
        digits), or the row's probabilities underflow or overflow, the text + END ids' own
        ``logsumexp``."""
        t = self._tables(member, logprobs.device)
        other = _other_ids(t, logprobs.shape[-1])
        whole = logprobs.exp().sum(-1, dtype=torch.float64)
        rest = logprobs[:, other].double().exp().sum(-1) + logprobs[:, t.spare:].double().exp().sum(-1)
        if (left := _mass_left(whole, rest)) is not None:
            return left
        text = logprobs[:, : t.spare].to(torch.float64, copy=True)
        text[:, other] = -torch.inf
        return text.logsumexp(-1)

    def head(self, member: int, logprobs: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The member's likely entries and its rows' text + END log mass, from one pass over its
        vocabulary (``sparse_average``; numpy on a CPU, several times faster there than torch):

        * ``int64[n]``, ascending: the entries every member can hold that get an id of probability
          ``exp(logprobs)`` at least ``floor`` in some row, and those the member holds under several
          ids. Any other entry's probability (``probs``) is, in every row, below ``floor`` over the
          row's mass: its one id, if any, has less than ``floor``.
        * ``float64[R]``: ``text_logmass`` to float32 precision (the mass summed in float32, a
          relative error of a few 1e-7), for bounds and comparisons; ``text_logmass`` itself where the
          ids that are not text hold half of the row or more, or a sum is not finite.
        """
        t = self._tables(member, logprobs.device)
        other = _other_ids(t, logprobs.shape[-1])
        if _host(logprobs):  # the passes in numpy: torch's per-call cost is most of the time on small vocabularies
            p = np.exp(logprobs.numpy())
            hot = p[:, : t.spare] >= floor
            found = t.target.numpy()[np.flatnonzero(hot.any(0) if len(hot) > 1 else hot[0])]
            entries = torch.from_numpy(np.union1d(found[found >= 0], t.rep_multi.numpy()))
            whole = torch.from_numpy(p.sum(-1))
            rest = torch.from_numpy(p[:, other.numpy()].sum(-1) + p[:, t.spare:].sum(-1))
        else:
            p = logprobs.float().exp()
            found = t.target[torch.nonzero((p[:, : t.spare] >= floor).any(0))[:, 0]]
            entries = torch.unique(torch.cat([found[found >= 0], t.rep_multi]))
            whole, rest = p.sum(-1), p[:, other].sum(-1) + p[:, t.spare:].sum(-1)
        left = _mass_left(whole, rest)
        return entries, self.text_logmass(member, logprobs) if left is None else left

    def multi_masses(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """``float64[R, M]``: each row's mass (not renormalised) on each entry the member holds under
        several ids (``multi``), added in the ids' order."""
        t = self._tables(member, logprobs.device)
        return self.close_probs(member, logprobs, t.multi, logprobs.new_zeros(len(logprobs), dtype=torch.float64))

    def close_probs(self, member: int, logprobs: torch.Tensor, entries: torch.Tensor,
                    logmass: torch.Tensor) -> torch.Tensor:
        """``probs`` of ``entries`` (``int64[n]``, every row; each ``>= 0``) given ``logmass``
        (``head``): the same numbers to float64 rounding, for comparisons. On a CPU in numpy, whose
        small gathers cost a few microseconds where torch's cost tens."""
        if not _host(logprobs):
            return self.probs(member, logprobs, entries, logmass)
        t = self._tables(member, logprobs.device)
        e = entries.numpy()
        ids = t.first.numpy()[e][:, None]
        if t.multi.numel():
            multi = t.multi.numpy()
            slot = np.minimum(np.searchsorted(multi, e), len(multi) - 1)
            ids = np.concatenate([ids, np.where((multi[slot] == e)[:, None], t.extra.numpy()[slot], t.spare)], axis=1)
        a = logprobs.numpy()
        vals = np.where(ids < min(a.shape[-1], t.spare), a[:, np.minimum(ids, a.shape[-1] - 1)], -np.inf)
        return torch.from_numpy(ordered_sum(np.exp(vals.astype(np.float64) - logmass.numpy()[:, None, None])))

    def probs(self, member: int, logprobs: torch.Tensor, entries: torch.Tensor,
              logmass: torch.Tensor | None = None) -> torch.Tensor:
        """The member's probabilities ``float64[R, n]`` of ``entries`` (``int64[R, n]``, or ``[n]``
        for every row; ``-1``: probability 0), renormalised over its text + END ids (``logmass``: their
        ``text_logmass``, if the caller has it). Unlike ``project``, an entry some member cannot hold
        keeps its probability."""
        vals = self._gathered(member, logprobs, entries, -torch.inf).double()
        logmass = self.text_logmass(member, logprobs) if logmass is None else logmass
        return ordered_sum((vals - logmass[:, None, None]).exp())

    def logprobs(self, member: int, logprobs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """``log`` of ``probs`` (``-inf`` where it is 0)."""
        return self.probs(member, logprobs, entries).log()

    def masses(self, member: int, values: torch.Tensor, entries: torch.Tensor, *, log: bool = False) -> torch.Tensor:
        """Sums ``[R, n]`` of a distribution over the member's ids over each entry's ids, taken as it
        is (already normalised, or only compared): ``values`` ``[R, W]`` holds probabilities, or with
        ``log`` log-probabilities (``exp`` is taken of the ids gathered); ids ``>= W`` count 0."""
        vals = self._gathered(member, values, entries, -torch.inf if log else 0.0)
        return ordered_sum(vals.exp() if log else vals)

    def _gathered(self, member: int, values: torch.Tensor, entries: torch.Tensor, fill: float) -> torch.Tensor:
        """``values[r, id]`` for each id of each entry ``[R, n, K]`` (``ids``), ``fill`` for spare slots
        and ids past ``values``' width."""
        ids = self.ids(member, entries.to(values.device).expand(values.shape[0], -1))
        flat = ids.flatten(1)
        vals = values.gather(1, flat.clamp_max(values.shape[-1] - 1))
        return vals.masked_fill(flat >= min(values.shape[-1], self.vocab(member)), fill).view(ids.shape)
