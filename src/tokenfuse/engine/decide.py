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
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.combiners.base import Combiner, Dist, StepView
from tokenfuse.engine.decision import Decision
from tokenfuse.engine.pool import MemberOutput, MemberPool
from tokenfuse.engine.sampling import choose
from tokenfuse.engine.sequence import Sequence
from tokenfuse.engine.timer import StageTimer
from tokenfuse.members.base import Member

Group = tuple[list[int], list[int]]  # (rows of the batch, the members that decide them)


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

    # ------------------------------------------------------------------ members
    def forward(self, which: list[int], seqs: list[Sequence]) -> dict[int, MemberOutput]:
        """Members ``which`` on ``seqs`` (timed as ``forward``)."""
        if not seqs:
            return {}
        with self.timer.stage("forward"):
            states = {i: [s.states[i] for s in seqs] for i in which}
            return self.pool.forward(which, states, topk=self.combiner.k if self.combiner.needs == "topk" else 0)

    def groups(self, seqs: list[Sequence]) -> list[Group]:
        """Rows of ``seqs`` and the members that decide them: all weighted members, or with a gate
        the gate alone where its top probability is above the threshold and the weighted members
        (the gate among them if weighted) elsewhere."""
        weights = [m.weight for m in self.members]
        run = [i for i, w in enumerate(weights) if w > 0]
        if self.gate is None:
            return [(list(range(len(seqs))), run)]
        g = self.gate
        top = self.forward([g], seqs)[g].top_logprob()
        confident = (top.exp() > self.threshold).tolist()
        sure = [r for r, c in enumerate(confident) if c]
        unsure = [r for r, c in enumerate(confident) if not c]
        others = [i for i in run if i != g]
        groups = [(sure, [g])] if sure else []
        if unsure:
            groups.append((unsure, sorted(set(others) | ({g} if weights[g] > 0 else set())) or [g]))
        return groups

    def view(self, seqs: list[Sequence], members: list[int], outs: dict[int, MemberOutput],
             pick: torch.Tensor | None = None) -> StepView:
        """The combiner's view of ``seqs`` from the members' outputs (rows ``pick`` of them, if given)."""
        view = StepView(space=self.space, models=self.members, states={i: [s.states[i] for s in seqs] for i in members},
                        members=members, weights=[self.members[i].weight for i in members], stage=self.timer.stage)
        for i in members:
            o = outs[i].rows(pick)
            if o.logprobs is not None:
                view.logprobs[i] = o.logprobs
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
            for r, d in zip(rows, self._decide_group(sub, members, self.forward(members, sub), alone)):
                decisions[r] = d
        return decisions

    def _decide_group(self, seqs: list[Sequence], members: list[int], outs: dict[int, MemberOutput],
                      gated: bool) -> list[Decision]:
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
        if todo:
            view = self.view([seqs[r] for r in todo], members, outs,
                             None if len(todo) == len(seqs) else torch.tensor(todo))
            with self.timer.stage("combine"):
                if len(members) == 1 and members[0] in view.logprobs:
                    dist = Dist(view.project(members[0]))  # a member alone
                else:
                    dist = self.combiner.combine(view)
            with self.timer.stage("choose"):
                for j, r in enumerate(todo):
                    result[r] = Decision(self.choose(dist, j, seqs[r]), ens, gated=gated)
        return result

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
