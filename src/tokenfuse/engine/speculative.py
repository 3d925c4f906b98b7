"""Speculative ensemble decoding (greedy): a drafter proposes pieces, every member checks them at once.

One round for one sequence:

1. **Draft.** The drafter member alone proposes up to ``k`` pieces, greedily: its most likely
   text token's piece, appended (``OpenSequence.force``, which re-synchronises every member on the
   bytes), ``k`` times — one plain one-position forward of the drafter each, exactly the forwards
   it makes in plain decoding. A draft stops early at END, at a piece the union cannot hold, one
   piece before the sequence's length limit and near the end of a member's context.
2. **Verify.** Every other member that decides (the weighted ones, the gate, the primary) computes
   its distributions before every drafted piece and after the last in as few chunked forwards as
   its ids allow — the one-forward path of teacher forcing (``reading.positions``): the ids a
   member holds before each drafted piece are the very ids plain decoding would give it there,
   because re-synchronisation depends on the output bytes only.
3. **Decide.** Position by position the engine's own decision is taken from those rows
   (``Decider.decide_given``: groups, gate, agreement skip, combination, choice, boundary rule —
   the code plain decoding runs) and applied (``OpenSequence.apply``: stops, limit, re-sync). While it
   equals the drafted piece, the next position is decided; the first that differs, and the
   position after the last drafted piece, end the round with the ensemble's own choice. The draft
   is taken back before deciding (``OpenSequence.snapshot``/``restore``: the output and the members' ids,
   not their caches); afterwards every member's cache keeps the positions the sequence still holds
   (``SeqState.reuse_cache``) and drops the rest, as rollback does.

So each round emits between one and ``k + 1`` pieces, each the piece plain decoding chooses from
the same distributions: greedy output is identical wherever a member's numbers do not depend on how
its ids are cut into forward calls (transformers, to float rounding). On llama.cpp they do (a
one-position call takes other kernels than a chunk: docs/evaluation.md, "One-forward scoring"), so
a near-tie can go the other way; docs/serving.md gives what was measured. Sampling, traced
sequences, PackLLM prompt weights and members that run elsewhere are decoded plainly (drafted
rounds, below, refuse what they cannot run).

``k`` adapts to what is accepted (``adapt``): the next round drafts one more piece than were
accepted in this one (at least one, at most ``k``).

Sequences stepped together run their rounds together (``Speculator.run``): each drafted position is
one drafter forward for every sequence still drafting, and each checking member verifies them all in
one call (``reading.positions_many`` -> ``Member.logprobs_at_many``: one forward per group of
rows on a batched transformers member, the shared context's calls with ``exact_calls`` on
llama.cpp, one sequence after another elsewhere); then each sequence is decided on its own rows, as
alone. The rows are a batch's rows, so they equal one-by-one rows wherever a batched step's do (bit
for bit on llama.cpp's contexts and with ``exact_calls``; to float rounding on batched transformers).

**Drafted rounds** (a strategy with a ``chunk``, SAFE: ``strategies.base``, ``strategies.safe``)
run on the same machinery with another step 3: the drafter is the primary member, it drafts
``chunk()`` pieces (no adaptation), and position by position the strategy's ``trigger`` says
whether the ensemble decides there. Where it does not, the drafted piece is taken (not ensembled);
at the first position where it does, the ensemble's decision (``decide_given``) is taken and the
round ends, whatever was chosen. A chunk without a trigger is taken whole (no extra decided
position after it); a draft cut short (END, a piece the union cannot hold, a context's end) has the
ensemble decide the position it stopped at. Traced sequences run these rounds too: every position
is combined for its record (``decide_given(keep=...)``) and the output is the untraced one.
Sequences that cannot run them are refused when opened (``Strategy.admit``: sampling) or when the
ensemble is built (members elsewhere).
"""

from __future__ import annotations


import torch

from tokenfuse.alignment.union import END
from tokenfuse.engine.decide import Decider
from tokenfuse.engine.options import SpeculativeOptions
from tokenfuse.engine.pool import MemberOutput
from tokenfuse.engine.sequence import Decision, OpenSequence, StepEvent
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member
from tokenfuse.members.reading import positions_many


def default_drafter(members: list[Member]) -> int:
    """The member expected to be fastest: the smallest weights in this process (``Member.weight_bytes``);
    the first such member if none knows its size."""
    local = [i for i, m in enumerate(members) if m.in_process]
    if not local:
        raise ConfigError("speculative: needs a member that runs in this process to draft")
    sized = [i for i in local if members[i].weight_bytes is not None]
    return min(sized, key=lambda i: members[i].weight_bytes) if sized else local[0]


class Speculator:
    """Runs speculative rounds for the sequences it can (``eligible``) with the engine's ``Decider``:
    ``draft`` the drafter (member index; ``options.draft`` or ``default_drafter``), up to
    ``options.k`` pieces per round."""

    def __init__(self, decider: Decider, options: SpeculativeOptions | None) -> None:
        self.decider = decider
        self.options = options = options if options is not None else SpeculativeOptions()
        self.members = decider.members
        self.rounds = decider.rounds  # a strategy drafting in rounds (SAFE), else None
        names = [m.name for m in self.members]
        if self.rounds is not None:
            self.draft = decider.primary  # its own checks name the fields (``Strategy.bind``)
        else:
            self.draft = default_drafter(self.members) if options.draft is None else names.index(options.draft)
        if not self.members[self.draft].in_process:
            raise ConfigError(f"speculative.draft: {options.draft!r} does not run in this process; choose a local member")
        self.check = sorted(set(decider.computed()) | {decider.primary})  # every member a decision may read

    @property
    def k(self) -> int:
        """Pieces drafted per round (at most, with ``adapt``)."""
        return self.rounds.chunk() if self.rounds is not None else self.options.k

    @property
    def adapt(self) -> bool:
        return self.rounds is None and self.options.adapt

    def eligible(self, s: OpenSequence) -> bool:
        """Greedy, untraced, strategies that allow it (not PackLLM weights), every member that
        decides in this process; with drafted rounds every sequence (``Strategy.admit`` refused the others)."""
        return self.rounds is not None or (s.sampling.greedy and s.trace is None and self.decider.speculative_ok
                                           and all(self.members[i].in_process for i in self.check))

    def run(self, seqs: list[OpenSequence]) -> dict[int, list[StepEvent]]:
        """One round for each of ``seqs`` (see the module docstring), run together: one drafter
        forward for all of them per drafted position, one verifying call per member for all of them
        (``positions_many``), then each sequence decided on its own rows. The pieces each emits, in
        order, by ``id``."""
        d = self.draft
        # the last piece before the limit is never drafted, but a chunk runs up to it (no bonus position)
        ks = [min(s.draft_k or self.k, s.max_new_tokens - s.steps - (1 if self.rounds is None else 0)) for s in seqs]
        saved = [s.snapshot() for s in seqs]
        drafts, before, own = self._draft(seqs, ks, last=self.rounds is None)
        with self.decider.timer.stage("forward"):
            others = [i for i in self.check if i != d]
            checked = self.decider.pool.run(others, lambda i: positions_many(
                self.members[i], [s.states[i] for s in seqs], [b[i] for b in before]))
        events = {}
        for r, s in enumerate(seqs):
            rows = {i: checked[i][r] for i in others} | {d: own[r]}
            cached = [st.cached_ids() for st in s.states]  # what each cache holds now
            s.restore(saved[r])  # back to before the draft
            if self.rounds is None:
                got, accepted = self._decide(s, drafts[r], rows)  # no forward: the caches are untouched
            else:
                got, accepted = self._examine(s, drafts[r], rows, cut=len(drafts[r]) < ks[r])
            for st, ids in zip(s.states, cached):  # a cache keeps every position the sequence still holds
                st.reuse_cache(ids)
            s.record_round(len(drafts[r]), accepted, max(1, min(self.k, accepted + 1)) if self.adapt else None)
            events[id(s)] = got
        return events

    def _draft(self, seqs: list[OpenSequence], ks: list[int], *, last: bool = True
               ) -> tuple[list[list[int]], list[dict[int, list[list[int]]]], list[list[torch.Tensor]]]:
        """Per sequence: the drafter's pieces (up to its ``ks[r]``), every checked member's ids before
        each of them and, with ``last`` or a draft cut short, after the last (``before[r][i]``), and the
        drafter's own rows there. The sequences still drafting share each drafter forward."""
        d = self.draft
        space = self.decider.space
        umap, rep = space.union.maps[d], space.union.representable
        before: list[dict[int, list[list[int]]]] = [{i: [] for i in self.check} for _ in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        own: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [r for r in range(len(seqs)) if last or ks[r] > 0]
        while live:
            for r in live:
                for i in self.check:
                    before[r][i].append(seqs[r].states[i].all_ids())
            with self.decider.timer.stage("forward"):  # the drafter alone, on all the cores
                lp = self.decider.pool.run([d], lambda i: self.members[i].next_logprobs([seqs[r].states[i] for r in live]))[d]
            ids, _ = MemberOutput(logprobs=lp).top_text(umap)
            going = []
            for r, row, top in zip(live, lp, ids.tolist()):
                own[r].append(row)
                u = int(umap[top])
                if len(drafts[r]) == ks[r] or u < 0 or u == END or not rep[u] or not self._fits(seqs[r], len(space.piece(u))):
                    continue  # drafted all it may, or cut short
                drafts[r].append(u)
                with self.decider.timer.stage("resync"):
                    seqs[r].force(u)
                if last or len(drafts[r]) < ks[r]:
                    going.append(r)
            live = going
        return drafts, before, own

    def _fits(self, s: OpenSequence, nbytes: int) -> bool:
        """Every member's context keeps room for a drafted piece of ``nbytes`` bytes (generously: its
        re-synced ids may be re-cut over a window); near a context's end nothing more is drafted."""
        return all(m.context_length is None or st.length + 2 * (nbytes + s.window) < m.context_length - 1
                   for m, st in zip(self.members, s.states))

    def _outs(self, s: OpenSequence, rows: dict[int, list[torch.Tensor]], j: int) -> dict[int, MemberOutput]:
        """The checked members' outputs at drafted position ``j`` (``s`` is there), as a decision
        reads them; every state keeps its row as ``logprobs`` (ties, groups)."""
        topk = self.decider.combiner.k if self.decider.combiner.needs == "topk" else 0
        if topk and s.trace is not None:
            topk = max(topk, s.trace.options.k)
        outs = {}
        for i in self.check:
            lp = rows[i][j]
            st = s.states[i]
            st.logprobs, st.logprobs_len = lp, st.length
            outs[i] = (MemberOutput(topk=torch.topk(lp[None], min(topk, lp.shape[-1]), dim=-1)) if topk
                       else MemberOutput(logprobs=lp[None]))
        return outs

    def _examine(self, s: OpenSequence, drafts: list[int], rows: dict[int, list[torch.Tensor]], *,
                 cut: bool) -> tuple[list[StepEvent], int]:
        """Drafted rounds' step 3 (module docstring): the drafted pieces up to the first position the
        strategy triggers at, that one decided by the ensemble (``cut``: the draft stopped short, the
        position after it is decided too); the events and how many drafted pieces were taken."""
        events: list[StepEvent] = []
        accepted = 0
        for j in range(len(drafts) + cut):
            draft = drafts[j] if j < len(drafts) else None
            fire = draft is None or self.rounds.trigger(s, drafts[j:], {i: rows[i][j] for i in self.check})
            if fire or s.trace is not None:  # an untraced drafted piece taken as it is reads no output
                outs = self._outs(s, rows, j)
            if fire:  # ensembled where the combination decides (not where a gate decides alone)
                (decision,) = self.decider.decide_given([s], outs)
            elif s.trace is not None:  # combined for the record only
                (decision,) = self.decider.decide_given([s], outs, keep=[draft])
            else:
                decision = Decision(draft)
            with self.decider.timer.stage("resync"):
                events.append(s.apply(decision))
            accepted += decision.entry == draft
            if fire or s.finished is not None:
                break
        for i in self.check:
            s.states[i].logprobs = None  # rows of positions the sequence may no longer hold
        return events, accepted

    def _decide(self, s: OpenSequence, drafts: list[int], rows: dict[int, list[torch.Tensor]]) -> tuple[list[StepEvent], int]:
        """Decide and apply position by position while the choice is the drafted piece; the events
        and how many drafted pieces were accepted."""
        events: list[StepEvent] = []
        accepted = 0
        for j in range(len(drafts) + 1):
            outs = self._outs(s, rows, j)
            (decision,) = self.decider.decide_given([s], outs)
            with self.decider.timer.stage("resync"):
                events.append(s.apply(decision))
            if j == len(drafts) or decision.entry != drafts[j]:
                break
            accepted += 1
            if s.finished is not None:
                break
        for i in self.check:
            s.states[i].logprobs = None  # rows of positions the sequence may no longer hold
        return events, accepted

