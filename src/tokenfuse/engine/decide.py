"""The step decision: which members run, whether they agree, the combined distribution, the choice.

For a batch of sequences at one step:

1. **Groups** (``groups``): every weighted member decides every row; or, with a gating strategy
   (GaC Eq. 5, ``threshold``), the gate alone decides the rows where its top probability is above
   the threshold and the weighted members decide the rest.
2. **Agreement skip** (``agreement``): where every computed member ranks the same union entry
   first, that entry is the choice; alignment and combination are skipped (exact for greedy
   decoding with GaC and UniTE).
3. **Combination**: the combiner's distribution over union entries for the other rows (a member
   alone is just projected).
4. **Choice**: greedy (exact ties go to the primary member's preference, then the smaller bytes) or
   sampling with the sequence's own generator.

The adaptive rules are strategies (``tokenfuse.engine.strategies``), asked through one narrow
interface: the one that gates gives step 1's gate member and threshold (thresholded mode: ``gate``, by
default the primary), every one may ``prepare`` the sequences before a forward (PackLLM
prompt scores), add per-row log weight factors to the combiner's view (prompt weights, confidence),
``reshape`` the combined distribution (SAFE's sharpening) and ``revise`` a choice (the gate's word-boundary
rule); one may have generation run in drafted rounds (``rounds``: SAFE; the rounds themselves
are ``speculative.Speculator``'s, which decides the triggered positions with ``decide_given``).
This module only orchestrates.

The members' outputs are what the combiner ``needs`` of them: next-token log-probabilities (whole or
top-k), or for a combiner that chooses bytes (``byte``) every member's next-byte distribution, which
``bytegen.ByteDecider`` (this ``Decider`` with the members' outputs, the choice and the step record of
bytes) reads from the sequences' byte-level views. What a combiner lacks (``Combiner.lacks``: the
agreement skip here) is off.

A traced sequence (``OpenSequence.trace``) also gets a ``StepRecord`` in its ``Decision`` (``trace.py``):
its group is then combined on agreement-skipped rows too (for the record only) and top-k members
are asked for at least the trace's k tokens. Untraced groups do none of this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.combiners.base import Combiner, Dist, StepView
from tokenfuse.engine.flags import StepFlags
from tokenfuse.engine.options import EnsembleOptions
from tokenfuse.engine.pool import MemberOutput, MemberPool
from tokenfuse.engine.sampling import choose
from tokenfuse.engine.sequence import Decision, OpenSequence
from tokenfuse.engine.strategies import Strategy, build_strategies
from tokenfuse.engine.timer import StageTimer
from tokenfuse.engine.trace import record_step
from tokenfuse.members.base import Member, SeqState

Group = tuple[list[int], list[int]]  # (rows of the batch, the members that decide them)
SURE = math.log(0.5) + 1e-6  # a text id at least this likely holds more mass than any other entry


class Decider:
    """Decides one step for a batch of sequences (see the module docstring); ``weights``: the
    ensemble's weights of ``members`` (``Ensemble.weights``; members' own are never read)."""

    def __init__(self, members: Sequence[Member], space: VocabSpace, combiner: Combiner, pool: MemberPool,
                 timer: StageTimer, options: EnsembleOptions, *, primary: int, weights: Sequence[float]) -> None:
        self.members = list(members)
        self.weights = list(weights)
        self.space = space
        self.combiner = combiner
        self.pool = pool
        self.timer = timer
        self.primary = primary
        self.agreement_skip = options.agreement_skip if combiner.can("agreement_skip") else False
        self.strategies: list[Strategy] = build_strategies(options)
        for st in self.strategies:
            st.bind(self)
        gates = [g for st in self.strategies if (g := st.gate()) is not None]
        self.gate, self.threshold = gates[0] if gates else (None, None)
        self.prefills = any(st.prefills for st in self.strategies)  # scoring cannot share member rows
        self.speculative_ok = all(st.speculative for st in self.strategies)
        # the choice is the combined distribution's argmax on greedy rows (no strategy reshapes it)
        self.reshapes_none = all(type(st).reshape is Strategy.reshape for st in self.strategies)
        drafting = [st for st in self.strategies if st.chunk() is not None]
        self.rounds: Strategy | None = drafting[0] if drafting else None  # drafted rounds (SAFE)

    def admit(self, s: OpenSequence) -> None:
        """Every strategy's ``admit`` on a sequence just opened (``ConfigError`` where it cannot run)."""
        for st in self.strategies:
            st.admit(s)

    def release(self, s: OpenSequence) -> None:
        """A sequence is closed: nothing of it is kept here (its member states are the ensemble's)."""

    # ------------------------------------------------------------------ members
    def forward(self, which: list[int], seqs: list[OpenSequence], *, trace_k: int = 0) -> dict[int, MemberOutput]:
        """Members ``which`` on ``seqs`` (timed as ``forward``); a top-k combiner's members give at
        least ``trace_k`` entries (a traced step shows them; ``view`` passes the combiner its own k)."""
        if not seqs:
            return {}
        self.prepare(seqs)
        with self.timer.stage("forward"):
            states = {i: [s.states[i] for s in seqs] for i in which}
            topk = max(self.combiner.k, trace_k) if self.combiner.needs == "topk" else 0
            return self.pool.forward(which, states, topk=topk)

    def groups(self, seqs: list[OpenSequence]) -> list[Group]:
        """Rows of ``seqs`` and the members that decide them: all weighted members, or with a gate
        the gate alone where its top probability is above the threshold and the weighted members
        (the gate among them if weighted) elsewhere."""
        if self.gate is None:
            return self.split(None, len(seqs))
        return self.split(self.forward([self.gate], seqs)[self.gate], len(seqs))

    def computed(self) -> list[int]:
        """Every member that may decide a row: the weighted ones and the gate."""
        return sorted({i for i, w in enumerate(self.weights) if w > 0} | ({self.gate} if self.gate is not None else set()))

    def split(self, gate_out: MemberOutput | None, n: int) -> list[Group]:
        """``groups`` from the gate's output on ``n`` rows (``None`` without a gate)."""
        weights = self.weights
        run = [i for i, w in enumerate(weights) if w > 0]
        if self.gate is None:
            return [(list(range(n)), run)]
        g = self.gate
        top = gate_out.top_logprob()
        confident = (top.exp() > self.threshold).tolist()
        sure = [r for r, c in enumerate(confident) if c]
        unsure = [r for r, c in enumerate(confident) if not c]
        others = [i for i in run if i != g]
        groups = [(sure, [g])] if sure else []
        if unsure:
            groups.append((unsure, sorted(set(others) | ({g} if weights[g] > 0 else set())) or [g]))
        return groups

    def prepare(self, seqs: list[OpenSequence]) -> None:
        """Every strategy's ``prepare`` (before a forward of ``seqs``; PackLLM scores new prompts)."""
        for st in self.strategies:
            st.prepare(seqs)

    def view(self, seqs: list[OpenSequence], members: list[int], outs: dict[int, MemberOutput],
             pick: torch.Tensor | None = None) -> StepView:
        """The combiner's view of ``seqs`` from the members' outputs (rows ``pick`` of them, if given)."""
        return self.states_view({i: [s.states[i] for s in seqs] for i in members}, members, outs, pick, seqs=seqs)

    def states_view(self, states: dict[int, list[SeqState]], members: list[int], outs: dict[int, MemberOutput],
                    pick: torch.Tensor | None = None, *, seqs: list[OpenSequence] | None = None) -> StepView:
        """``view`` from each member's states of the rows (one-forward scoring builds its own), with the
        strategies' per-row log weight factors summed in their order; ``seqs`` (the rows' sequences)
        carry what strategies keep per sequence (PackLLM's prompt scores)."""
        view = StepView(space=self.space, models=self.members, states=states,
                        computed=members, weights=[self.weights[i] for i in members], stage=self.timer.stage)
        for i in members:
            o = outs[i].rows(pick)
            if o.logprobs is not None:
                view.logprobs[i] = o.logprobs
            elif o.topk[1].shape[-1] > self.combiner.k:  # widened for a trace
                view.topk[i] = (o.topk[0][:, : self.combiner.k], o.topk[1][:, : self.combiner.k])
            else:
                view.topk[i] = o.topk
        for st in self.strategies:
            for i, f in st.factors(view, seqs).items():
                view.log_factors[i] = view.log_factors[i] + f if i in view.log_factors else f
        return view

    # ------------------------------------------------------------------ the decision
    def decide(self, seqs: list[OpenSequence]) -> list[Decision]:
        decisions: list[Decision | None] = [None] * len(seqs)
        gated = self.gate is not None
        for rows, members in self.groups(seqs):
            sub = [seqs[r] for r in rows]
            alone = gated and members == [self.gate]
            traced = [s.trace.options.k for s in sub if s.trace is not None]
            outs = self.forward(members, sub, trace_k=max(traced, default=0))
            for r, d in zip(rows, self._decide_group(sub, members, outs, alone, traced=bool(traced))):
                decisions[r] = d
        return decisions

    def decide_given(self, seqs: list[OpenSequence], outs: dict[int, MemberOutput], *,
                     keep: Sequence[int | None] | None = None) -> list[Decision]:
        """``decide`` from outputs already computed (``outs``: every member of ``computed()`` and the
        primary, on every row, top-k ones with at least a traced row's k; each row's states keep the
        same rows as ``logprobs``), without any forward: the same groups, agreement skip,
        combination, choice and revisions (speculative verification, drafted rounds). ``keep``: per
        row an entry taken as it is (a drafted piece; ``None``: decide the row), not ensembled,
        its trace recorded from the same combination."""
        decisions: list[Decision | None] = [None] * len(seqs)
        for rows, members in self.split(outs.get(self.gate), len(seqs)):
            pick = None if len(rows) == len(seqs) else torch.tensor(rows)
            sub = [seqs[r] for r in rows]
            alone = self.gate is not None and members == [self.gate]
            kept = {j: keep[r] for j, r in enumerate(rows) if keep is not None and keep[r] is not None}
            got = self._decide_group(sub, members, {i: o.rows(pick) for i, o in outs.items()}, alone,
                                     traced=any(s.trace is not None for s in sub), keep=kept)
            for r, d in zip(rows, got):
                decisions[r] = d
        return decisions

    def _decide_group(self, seqs: list[OpenSequence], members: list[int], outs: dict[int, MemberOutput],
                      gated: bool, *, traced: bool = False, keep: dict[int, int] | None = None) -> list[Decision]:
        """Decide every row of one group. With ``traced`` (some row is traced) the combination also
        covers agreement-skipped rows, for their trace only (their choice stays the agreed entry);
        rows in ``keep`` (row -> entry) take that entry, not ensembled."""
        ens = len(members) > 1
        result: list[Decision | None] = [None] * len(seqs)
        todo = list(range(len(seqs)))
        with self.timer.stage("choose"):
            if self._skip_enabled(seqs, members):
                agreed = self.agreement(seqs, members, outs)
                todo = [r for r, u in enumerate(agreed) if u < 0]
                for r, u in enumerate(agreed):
                    if u >= 0:
                        result[r] = Decision(u, StepFlags(ensembled=ens, skipped=ens, gated=gated))
        combined = list(range(len(seqs))) if traced else todo
        if combined:
            view = self.view([seqs[r] for r in combined], members, outs,
                             None if len(combined) == len(seqs) else torch.tensor(combined))
            view.argmax_only = not traced and self.reshapes_none and all(seqs[r].sampling.greedy for r in combined)
            dist = self.distribution(view, members)
            with self.timer.stage("choose"):
                for st in self.strategies:
                    dist = st.reshape(dist)
                undecided = [(j, r) for j, r in enumerate(combined) if result[r] is None]
                picks = self.choose(dist, [j for j, _ in undecided], [seqs[r] for _, r in undecided])
                chosen = {r: e for (_, r), e in zip(undecided, picks)}
                revised = set().union(*(st.revise(seqs, members, outs, chosen) for st in self.strategies))
                for r, e in chosen.items():
                    result[r] = Decision(e, StepFlags(ensembled=ens, gated=gated, vetoed=r in revised))
        for r, e in (keep or {}).items():
            result[r] = Decision(e)
        if combined and traced:  # (untimed: a trace's own cost shows as "other")
            for j, r in enumerate(combined):
                if seqs[r].trace is not None:
                    result[r] = self._traced(result[r], dist, j, outs, r, seqs[r])
        return result

    def primary_top(self, seqs: list[OpenSequence], outs: dict[int, MemberOutput]) -> list[int]:
        """Per row the union entry of the primary member's most likely text token (``-1`` where the
        union cannot hold it); its output is computed (and added to ``outs``) if it is not there."""
        p = self.primary
        if p not in outs:
            outs[p] = self.forward([p], seqs)[p]
        umap = self.space.union.maps[p]
        ids, _ = outs[p].top_text(umap)
        rep = self.space.union.representable
        return [e if e >= 0 and rep[e] else -1 for e in (int(umap[t]) for t in ids.tolist())]

    def distribution(self, view: StepView, members: list[int]) -> Dist:
        """The group's next-piece distribution: a member alone gives its own, several the combiner's."""
        with self.timer.stage("combine"):
            if len(members) == 1 and members[0] in view.logprobs:
                return Dist(view.project(members[0]))
            return self.combiner.combine(view)

    def _traced(self, d: Decision, dist: Dist, j: int, outs: dict[int, MemberOutput], r: int, s: OpenSequence) -> Decision:
        rec = record_step(self.space, self.members, self.primary, s.trace.options, d.entry, dist, j, outs, r, s.states,
                          flags=d.flags)
        return replace(d, trace=rec)

    def _skip_enabled(self, seqs: list[OpenSequence], members: list[int]) -> bool:
        greedy = all(s.sampling.greedy for s in seqs)
        if self.agreement_skip is None:
            # exact for greedy decoding; a member alone (gated rows) agrees with itself; not where a
            # strategy reshapes the distribution (SAFE's sharpening can move the argmax)
            exact = all(st.exact_agreement for st in self.strategies)
            return greedy and exact and (self.combiner.exact_agreement or len(members) == 1)
        return self.agreement_skip

    def agreement(self, seqs: list[OpenSequence], members: list[int], outs: dict[int, MemberOutput]) -> list[int]:
        """Per row the union entry every member ranks first, or ``-1`` where they differ.

        A member's first entry is that of its most likely text id, provided no entry it holds under
        several ids (END, duplicate spellings) has more mass and the entry is representable; else
        the row is not skipped. Only each row's top id and, on rows whose top id holds less than half
        the mass, the masses of the entries held under several ids leave the members' device.
        """
        agreed = [-2] * len(seqs)  # -2: no member looked yet
        rep = self.space.union.representable
        for i in members:
            umap = self.space.union.maps[i]
            ids, tops = outs[i].top_text(umap)
            entries = umap[ids]
            ok = (entries >= 0) & rep[np.maximum(entries, 0)]
            if self.space.projector.multi(i).numel():
                # a top id with half the mass or more beats every other entry (they share the rest): only
                # the other rows need the multi-id masses (a margin covers the float32 rounding of ``tops``)
                unsure = np.flatnonzero(ok & (tops < SURE))
                if unsure.size:
                    ok[unsure] &= self._beats_multi(i, seqs, unsure, entries[unsure], tops[unsure], outs[i])
            for r, e in enumerate(entries.tolist()):
                if not ok[r] or agreed[r] not in (-2, e):
                    agreed[r] = -1
                elif agreed[r] == -2:
                    agreed[r] = e
        return [max(a, -1) for a in agreed]

    def _beats_multi(self, i: int, seqs: list[OpenSequence], rows: np.ndarray, entries: np.ndarray, tops: np.ndarray,
                     out: MemberOutput) -> np.ndarray:
        """Per row of ``rows``: member ``i``'s mass on ``entries`` (the entries of its most likely text
        ids, whose log-probabilities are ``tops``) is at least that of each entry it holds under several
        ids (``out``: the member's output on ``seqs``; with top-k output the member is asked for those ids)."""
        proj = self.space.projector
        multi = proj.multi(i)
        if out.logprobs is not None:
            sums = proj.multi_masses(i, out.logprobs)[torch.from_numpy(rows)]  # [R, M]
        else:
            ids = proj.ids(i, multi)  # [M, K]
            seqs = [seqs[r] for r in rows]
            lp = self.members[i].token_logprobs([s.states[i] for s in seqs],
                                                torch.where(ids == proj.vocab(i), 0, ids).flatten().expand(len(seqs), -1))
            sums = proj.total(i, ids.to(lp.device), lp.view(len(seqs), *ids.shape).double().exp())
        m, got = multi.numpy(), sums.cpu().numpy()  # a hundred numbers a row at most (Gemma-3's 110)
        slot = np.minimum(np.searchsorted(m, entries), len(m) - 1)
        own = np.where(m[slot] == entries, got[np.arange(len(got)), slot], np.exp(tops.astype(np.float64)))
        return own >= got.max(-1)

    def choose(self, dist: Dist, rows: list[int], seqs: list[OpenSequence]) -> list[int]:
        """The entry chosen in each of ``dist``'s ``rows`` for its sequence: a draw with the sequence's
        sampling, or greedy: the argmax, exact ties going to the primary member's preference, then
        to the smaller bytes. Greedy rows are decided together on the distribution's device; only
        each row's column (and, on an exact tie, the tied columns) reach the host."""
        got = [0] * len(rows)
        greedy = [k for k, s in enumerate(seqs) if s.sampling.greedy]
        for k, (row, s) in enumerate(zip(rows, seqs)):
            if not s.sampling.greedy:
                got[k] = dist.entry(row, choose(dist.probs[row], s.sampling, s.generator))
        for k, cols in zip(greedy, _argmax_ties(dist.probs, [rows[k] for k in greedy])):
            col = cols[0] if len(cols) == 1 else self._break_tie(dist, rows[k], cols, seqs[k])
            got[k] = dist.entry(rows[k], col)
        return got

    def _break_tie(self, dist: Dist, row: int, cols: list[int], s: OpenSequence) -> int:
        i = self.primary
        st = s.states[i]
        if st.logprobs is None:
            return cols[0]
        entries = torch.tensor([dist.entry(row, c) for c in cols])
        mass = self.space.projector.masses(i, st.logprobs.unsqueeze(0), entries, log=True)[0].tolist()
        return max(zip(mass, cols), key=lambda mc: (mc[0], -mc[1]))[1]


def _argmax_ties(probs: torch.Tensor, rows: list[int]) -> list[list[int]]:
    """Per row of ``rows``: the columns holding its largest value, ascending (usually one)."""
    if not rows:
        return []
    if probs.device.type == "cpu":  # numpy: a row's argmax is ~20x faster than torch's on a CPU
        return [argmax_ties_numpy(probs[row].numpy()) for row in rows]
    return argmax_ties_torch(probs[torch.tensor(rows, device=probs.device)])


def argmax_ties_numpy(arr: np.ndarray) -> list[int]:
    """The columns of a row ``arr`` holding its largest value, ascending (usually one)."""
    col = int(arr.argmax())
    return np.flatnonzero(arr == arr[col]).tolist() if np.count_nonzero(arr == arr[col]) > 1 else [col]


def argmax_ties_torch(p: torch.Tensor) -> list[list[int]]:
    """``argmax_ties_numpy`` of each row of ``p`` on its device: only the columns reach the host."""
    col = p.argmax(-1, keepdim=True)
    tied = p == p.gather(1, col)
    many = tied.sum(-1) > 1
    out = [[c] for c in col[:, 0].tolist()]
    if bool(many.any()):
        for k in torch.nonzero(many)[:, 0].tolist():
            out[k] = torch.nonzero(tied[k])[:, 0].tolist()
    return out
