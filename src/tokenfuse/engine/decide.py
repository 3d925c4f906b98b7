"""The step decision: which members run, whether they agree, the combined distribution, the choice.

For a batch of sequences at one step:

1. **Groups** (``groups``): every weighted member decides every row; or, with a gate (GaC Eq. 5),
   the gate alone decides the rows where its top probability is above the threshold and the
   weighted members decide the rest.
2. **Agreement skip** (``agreement``): where every computed member ranks the same union entry
   first, that entry is the choice; alignment and combination are skipped (exact for greedy
   decoding with GaC and UniTE).
3. **Combination**: the combiner's distribution over union entries for the other rows (a member
   alone is just projected).
4. **Choice**: greedy (exact ties go to the primary member's preference, then the smaller bytes) or
   sampling with the sequence's own generator.

Adaptive options (the combiner's ``AdaptiveParams``, docs/methods.md "Adaptive combination"):

* ``select`` (SAFE-style selective ensembling) is thresholded mode with the primary member as the
  gate and ``select`` as the threshold, plus a boundary rule on the rows the combination decides:
  where its piece is a strict prefix of some computed member's most likely token, the primary's
  most likely piece is taken instead (``Sequence.vetoed`` counts it).
* ``prompt_weights`` (PackLLM): before a sequence's first forward every weighted member scores its
  own prompt (``prompt_logprob_per_byte``, which is also its prefill); the view of each step
  carries ``log w_i += ℓ_i / τ`` per row (``StepView.log_factors``).

A traced sequence (``Sequence.trace``) also gets a ``StepRecord`` in its ``Decision`` (``trace.py``):
its group is then combined on agreement-skipped rows too (for the record only) and top-k members
are asked for at least the trace's k tokens. Untraced groups do none of this.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

import numpy as np
import torch

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Combiner, Dist, StepView
from tokenfuse.engine.decision import Decision
from tokenfuse.engine.pool import MemberOutput, MemberPool
from tokenfuse.engine.sampling import choose
from tokenfuse.engine.sequence import Sequence
from tokenfuse.engine.timer import StageTimer
from tokenfuse.engine.trace import record_step
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member, SeqState

Group = tuple[list[int], list[int]]  # (rows of the batch, the members that decide them)
PROMPT_CHUNK = 32  # prompt positions per call when a prompt is scored (each keeps a float32[V] row)


class Decider:
    """Decides one step for a batch of sequences (see the module docstring)."""

    def __init__(self, members: Seq[Member], space: VocabSpace, combiner: Combiner, pool: MemberPool,
                 timer: StageTimer, *, primary: int, gate: int | None, threshold: float | None,
                 agreement_skip: bool | None) -> None:
        self.members = list(members)
        self.space = space
        self.combiner = combiner
        self.pool = pool
        self.timer = timer
        self.primary = primary
        self.gate = gate
        self.threshold = threshold
        self.agreement_skip = agreement_skip
        opts = combiner.adaptive
        self.boundary = False  # select's boundary rule
        self.prompt_tau = opts.prompt_weights if opts is not None else None
        self.prompt_bytes = opts.prompt_bytes if opts is not None else None
        if opts is not None and opts.select is not None:
            if gate is not None:
                raise ConfigError("params.select: selective ensembling gates on the primary member; drop `gate` "
                                  "and `threshold` (or drop `select`)")
            self.gate, self.threshold, self.boundary = primary, opts.select, opts.select_boundary

    # ------------------------------------------------------------------ members
    def forward(self, which: list[int], seqs: list[Sequence], *, trace_k: int = 0) -> dict[int, MemberOutput]:
        """Members ``which`` on ``seqs`` (timed as ``forward``); a top-k combiner's members give at
        least ``trace_k`` entries (a traced step shows them; ``view`` passes the combiner its own k)."""
        if not seqs:
            return {}
        if self.prompt_tau is not None:
            self.score_prompts(seqs)
        with self.timer.stage("forward"):
            states = {i: [s.states[i] for s in seqs] for i in which}
            topk = max(self.combiner.k, trace_k) if self.combiner.needs == "topk" else 0
            return self.pool.forward(which, states, topk=topk)

    def groups(self, seqs: list[Sequence]) -> list[Group]:
        """Rows of ``seqs`` and the members that decide them: all weighted members, or with a gate
        the gate alone where its top probability is above the threshold and the weighted members
        (the gate among them if weighted) elsewhere."""
        if self.gate is None:
            return self.split(None, len(seqs))
        return self.split(self.forward([self.gate], seqs)[self.gate], len(seqs))

    def computed(self) -> list[int]:
        """Every member that may decide a row: the weighted ones and the gate."""
        return sorted({i for i, m in enumerate(self.members) if m.weight > 0} | ({self.gate} if self.gate is not None else set()))

    def split(self, gate_out: MemberOutput | None, n: int) -> list[Group]:
        """``groups`` from the gate's output on ``n`` rows (``None`` without a gate)."""
        weights = [m.weight for m in self.members]
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

    def score_prompts(self, seqs: list[Sequence]) -> None:
        """Each weighted member's ``prompt_logprob_per_byte`` for the sequences not scored yet (their
        prefill; PackLLM weights)."""
        fresh = [s for s in seqs if s.prompt_scores is None]
        if not fresh:
            return
        weighted = [i for i, m in enumerate(self.members) if m.weight > 0]
        with self.timer.stage("forward"):
            got = self.pool.run(weighted, lambda i: [prompt_logprob_per_byte(self.members[i], s.states[i],
                                                                             last_bytes=self.prompt_bytes)
                                                     for s in fresh])
        for k, s in enumerate(fresh):
            s.prompt_scores = {i: got[i][k] for i in weighted}

    def view(self, seqs: list[Sequence], members: list[int], outs: dict[int, MemberOutput],
             pick: torch.Tensor | None = None) -> StepView:
        """The combiner's view of ``seqs`` from the members' outputs (rows ``pick`` of them, if given)."""
        return self.states_view({i: [s.states[i] for s in seqs] for i in members}, members, outs, pick, seqs=seqs)

    def states_view(self, states: dict[int, list[SeqState]], members: list[int], outs: dict[int, MemberOutput],
                    pick: torch.Tensor | None = None, *, seqs: list[Sequence] | None = None) -> StepView:
        """``view`` from each member's states of the rows (one-forward scoring builds its own); ``seqs``
        (the rows' sequences) carry the per-prompt weights."""
        view = StepView(space=self.space, models=self.members, states=states,
                        members=members, weights=[self.members[i].weight for i in members], stage=self.timer.stage)
        if self.prompt_tau is not None and len(members) > 1:
            if seqs is None:
                raise ValueError("params.prompt_weights: a view of rows without their sequences has no prompt weights")
            self.score_prompts(seqs)
            view.log_factors = {i: torch.tensor([s.prompt_scores[i] / self.prompt_tau for s in seqs],
                                                dtype=torch.float64) for i in members if i in seqs[0].prompt_scores}
        for i in members:
            o = outs[i].rows(pick)
            if o.logprobs is not None:
                view.logprobs[i] = o.logprobs
            elif o.topk[1].shape[-1] > self.combiner.k:  # widened for a trace
                view.topk[i] = (o.topk[0][:, : self.combiner.k], o.topk[1][:, : self.combiner.k])
            else:
                view.topk[i] = o.topk
        return view

    # ------------------------------------------------------------------ the decision
    def decide(self, seqs: list[Sequence]) -> list[Decision]:
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

    def decide_given(self, seqs: list[Sequence], outs: dict[int, MemberOutput]) -> list[Decision]:
        """``decide`` from outputs already computed (``outs``: every member of ``computed()`` and the
        primary, on every row; each row's states keep the same rows as ``logprobs``), without any
        forward: the same groups, agreement skip, combination, choice and boundary rule. Untraced
        sequences only (speculative verification)."""
        decisions: list[Decision | None] = [None] * len(seqs)
        for rows, members in self.split(outs.get(self.gate), len(seqs)):
            pick = None if len(rows) == len(seqs) else torch.tensor(rows)
            sub = [seqs[r] for r in rows]
            alone = self.gate is not None and members == [self.gate]
            for r, d in zip(rows, self._decide_group(sub, members, {i: o.rows(pick) for i, o in outs.items()}, alone)):
                decisions[r] = d
        return decisions

    def _decide_group(self, seqs: list[Sequence], members: list[int], outs: dict[int, MemberOutput],
                      gated: bool, *, traced: bool = False) -> list[Decision]:
        """Decide every row of one group. With ``traced`` (some row is traced) the combination also
        covers agreement-skipped rows, for their trace only (their choice stays the agreed entry)."""
        ens = len(members) > 1
        result: list[Decision | None] = [None] * len(seqs)
        todo = list(range(len(seqs)))
        with self.timer.stage("choose"):
            if self._skip_enabled(seqs, members):
                agreed = self.agreement(seqs, members, outs)
                todo = [r for r, u in enumerate(agreed) if u < 0]
                for r, u in enumerate(agreed):
                    if u >= 0:
                        result[r] = Decision(u, ens, skipped=ens, gated=gated)
        combined = list(range(len(seqs))) if traced else todo
        if combined:
            view = self.view([seqs[r] for r in combined], members, outs,
                             None if len(combined) == len(seqs) else torch.tensor(combined))
            dist = self.distribution(view, members)
            with self.timer.stage("choose"):
                chosen = {r: self.choose(dist, j, seqs[r]) for j, r in enumerate(combined) if result[r] is None}
                if self.boundary and ens and chosen:
                    chosen = self.word_boundary(seqs, members, outs, chosen)
                for r, e in chosen.items():
                    result[r] = Decision(e, ens, gated=gated)
            if traced:  # (untimed: a trace's own cost shows as "other")
                for j, r in enumerate(combined):
                    if seqs[r].trace is not None:
                        result[r] = self._traced(result[r], dist, j, outs, r, seqs[r])
        return result

    def distribution(self, view: StepView, members: list[int]) -> Dist:
        """The group's next-piece distribution: a member alone gives its own, several the combiner's."""
        with self.timer.stage("combine"):
            if len(members) == 1 and members[0] in view.logprobs:
                return Dist(view.project(members[0]))
            return self.combiner.combine(view)

    def word_boundary(self, seqs: list[Sequence], members: list[int], outs: dict[int, MemberOutput],
                      chosen: dict[int, int]) -> dict[int, int]:
        """``select``'s boundary rule: a chosen piece that is a strict prefix of some member's most
        likely token (a word it holds as one token) gives way to the primary's most likely piece."""
        rows = list(chosen)
        pick = torch.tensor(rows)
        pieces = {r: self.space.piece(chosen[r]) if chosen[r] != END else b"" for r in rows}
        split = set()
        for i in members:
            ids, _ = outs[i].rows(pick).top_text(self.space.union.maps[i])
            token_bytes = self.space.codecs[i].token_bytes
            for r, tid in zip(rows, ids.tolist()):
                b = token_bytes[tid] or b""
                if pieces[r] and len(b) > len(pieces[r]) and b.startswith(pieces[r]):
                    split.add(r)
        if not split:
            return chosen
        p = self.primary
        out = outs[p] if p in outs else self.forward([p], seqs)[p]
        umap = self.space.union.maps[p]
        ids, _ = out.rows(pick).top_text(umap)
        for r, tid in zip(rows, ids.tolist()):
            e = int(umap[tid])
            if r in split and e >= 0 and e != chosen[r] and self.space.union.representable[e]:
                chosen[r] = e
                seqs[r].vetoed += 1
        return chosen

    def _traced(self, d: Decision, dist: Dist, j: int, outs: dict[int, MemberOutput], r: int, s: Sequence) -> Decision:
        rec = record_step(self.space, self.members, self.primary, s.trace.options, d.entry, dist, j, outs, r, s.states,
                          gated=d.gated, ensembled=d.ensembled, skipped=d.skipped)
        return replace(d, trace=rec)

    def _skip_enabled(self, seqs: list[Sequence], members: list[int]) -> bool:
        greedy = all(s.sampling.greedy for s in seqs)
        if self.agreement_skip is None:
            # exact for greedy decoding; a member alone (gated rows) agrees with itself
            return greedy and (self.combiner.exact_agreement or len(members) == 1)
        return self.agreement_skip

    def agreement(self, seqs: list[Sequence], members: list[int], outs: dict[int, MemberOutput]) -> list[int]:
        """Per row the union entry every member ranks first, or ``-1`` where they differ.

        A member's first entry is that of its most likely text id, provided no entry it holds under
        several ids (END, duplicate spellings) has more mass and the entry is representable; else
        the row is not skipped.
        """
        proj = self.space.projector
        agreed = [-2] * len(seqs)  # -2: no member looked yet
        rep = self.space.union.representable
        for i in members:
            umap = self.space.union.maps[i]
            ids, tops = outs[i].top_text(umap)
            entries = umap[ids]
            best_group = own = None
            if proj.group_ids[i].numel():
                gids = proj.group_ids[i].expand(len(seqs), -1)
                gp = np.exp(self.members[i].token_logprobs([s.states[i] for s in seqs], gids).numpy())
                uniq, slot = proj.group_slots_np[i]
                sums = np.zeros((len(seqs), len(uniq)))
                for r in range(len(seqs)):
                    sums[r] = np.bincount(slot, weights=gp[r], minlength=len(uniq))
                best_group = sums.max(axis=1)
                own = [sums[r, np.searchsorted(uniq, e)] if e in proj.groups[i] else np.exp(tops[r])
                       for r, e in enumerate(entries.tolist())]
            for r, e in enumerate(entries.tolist()):
                ok = e >= 0 and rep[e] and (best_group is None or own[r] >= best_group[r])
                if not ok or agreed[r] not in (-2, e):
                    agreed[r] = -1
                elif agreed[r] == -2:
                    agreed[r] = e
        return [max(a, -1) for a in agreed]

    def choose(self, dist: Dist, row: int, s: Sequence) -> int:
        p = dist.probs[row]
        if not s.sampling.greedy:
            return dist.entry(row, choose(p, s.sampling, s.generator))
        arr = p.numpy()
        col = int(arr.argmax())
        if np.count_nonzero(arr == arr[col]) > 1:  # exact ties: the primary's preference, then smallest bytes
            col = self._break_tie(dist, row, np.nonzero(arr == arr[col])[0].tolist(), s)
        return dist.entry(row, col)

    def _break_tie(self, dist: Dist, row: int, cols: list[int], s: Sequence) -> int:
        i = self.primary
        st = s.states[i]
        if st.logprobs is None:
            return cols[0]

        def mass(col: int) -> float:
            ids = self.space.projector.entry_ids(i, dist.entry(row, col))
            return float(st.logprobs[ids].exp().sum()) if ids else 0.0

        return max(cols, key=lambda c: (mass(c), -c))


def prompt_logprob_per_byte(member: Member, st: SeqState, *, last_bytes: int | None = None) -> float:
    """``member``'s mean log-probability per UTF-8 byte of its prompt (the ids after the first, or
    with ``last_bytes`` the last ids that cover at least that many bytes; ids without bytes, i.e.
    special tokens, left out; 0 for a prompt without text), computed as the sequence's prefill: the
    prompt goes in through ``Member.logprobs_at`` in calls that end at multiples of
    ``PROMPT_CHUNK`` (the last call takes the remainder too), after which the state holds the prompt
    and its next-token distribution as a plain prefill leaves them. Needs a fresh state (no output
    yet) of a member in this process."""
    if not member.in_process:
        raise ConfigError(f"params.prompt_weights: member {member.name!r} does not run in this process "
                          "(PackLLM weights need its log-probabilities at every prompt position)")
    if st.ids or st.n_valid:
        raise ValueError("prompt_logprob_per_byte: the state must be fresh (nothing fed, no output)")
    full = list(st.prompt_ids)
    token_bytes = member.codec.token_bytes

    def text(n: int) -> bytes:
        return (token_bytes[full[n]] if full[n] < len(token_bytes) else None) or b""

    first, covered = 1, 0  # the first id scored
    if last_bytes is not None:
        first = len(full)
        while first > 1 and covered < last_bytes:
            first -= 1
            covered += len(text(first))
    stops = [m for m in range(PROMPT_CHUNK, len(full) - PROMPT_CHUNK + 1, PROMPT_CHUNK) if m >= first]
    stops.append(len(full))
    total, nbytes, lo = 0.0, 0, first
    try:
        for stop in stops:
            st.prompt_ids = full[:stop]
            ends = list(range(lo, stop + 1))  # after ``n`` ids: the distribution of id ``n``
            rows = member.logprobs_at(st, ends)
            for k, n in enumerate(ends):
                if n < len(full) and text(n):
                    total += float(rows[k, full[n]])
                    nbytes += len(text(n))
            lo = stop + 1
    finally:
        st.prompt_ids = full
    return total / nbytes if nbytes else 0.0
