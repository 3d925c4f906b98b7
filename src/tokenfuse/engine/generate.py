"""The lockstep decoding loop.

One truth: the output is bytes. Each step the members that are needed produce next-token
distributions, the combiner merges them in the union space, one union entry (a piece of bytes,
or END) is chosen, and every member is re-synchronised on the longer output. Nothing else is
shared between members.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor, wait
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenfuse.alignment.project import Projector, SubtokenAligner
from tokenfuse.alignment.union import END, UnionVocab, build_union
from tokenfuse.combiners import get_combiner
from tokenfuse.combiners.base import Dist, StepView
from tokenfuse.engine.sampling import Sampling, choose
from tokenfuse.engine.sync import _incomplete_tail, append_token, in_step, resync
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member, SeqState



@dataclass(frozen=True)
class TwoFormPrompt:
    """One prompt in two forms: ``messages`` for members with a chat template (each renders them
    with its own template) and ``raw`` text for members without one (base models), instead of
    the plain ``"User: …\n\nAssistant:"`` rendering those would otherwise get."""

    messages: Sequence[dict]
    raw: str


Prompt = str | Sequence[dict] | TwoFormPrompt
STAGES = ("forward", "align", "combine", "choose", "resync")


@dataclass(frozen=True)
class StepEvent:
    """What one step did to one sequence: ``piece`` was appended (empty for END)."""

    index: int
    piece: bytes
    ensembled: bool
    finished: str | None  # None while running, else "end" | "stop" | "length"
    skipped: bool = False  # the computed members agreed: no alignment / combination was needed


@dataclass(frozen=True)
class Generation:
    """The result for one prompt.

    Attributes:
        text: the output decoded as UTF-8 (invalid bytes, if a model produced any, replaced).
        output: the exact output bytes.
        steps: chosen pieces (END not counted).
        ensembled_steps: steps where more than one member was computed (not the gate alone).
        skipped_steps: ensembled steps decided by agreement skip (every computed member's most
            likely piece was the same).
        finish_reason: ``end`` (END chosen), ``stop`` (a stop string, trimmed) or ``length``.
        member_ids: each member's output ids at the end (they decode to ``output``).
        timings: seconds per stage for the whole call (shared by a batch).
    """

    text: str
    output: bytes
    steps: int
    ensembled_steps: int
    finish_reason: str
    member_ids: dict[str, list[int]]
    timings: dict[str, float] = field(default_factory=dict)
    skipped_steps: int = 0


@dataclass(frozen=True)
class Likelihood:
    """``logprob``: natural-log likelihood of a continuation; ``pieces``/``bytes``: its length (for
    per-piece or per-byte normalisation)."""

    logprob: float
    pieces: int
    bytes: int
    ensembled: int = 0  # pieces scored by more than one member (fewer than ``pieces`` when gated)

    @property
    def per_byte(self) -> float:
        return self.logprob / max(self.bytes, 1)


@dataclass
class Seq:
    """One running sequence (``Ensemble.open``): its members' states, options and output so far."""

    index: int
    states: list[SeqState]
    sampling: Sampling
    stops: list[bytes]
    max_new_tokens: int
    generator: torch.Generator | None
    output: bytearray = field(default_factory=bytearray)
    steps: int = 0
    ensembled: int = 0
    skipped: int = 0
    finished: str | None = None



class Ensemble:
    """Members with different tokenizers generating as one model.

    Args:
        members: the loaded members (their order fixes the order of ``member_ids`` only).
        method: a registered combiner name (``gac``, ``unite``, ...); ``method_params`` its options.
        primary: the primary member's name (default: the first member). Every member re-syncs from
            the output bytes, so no member's tokenization drives the loop; "primary" means: greedy
            ties between pieces go to the piece the primary finds more likely; it is the default
            gate and the member whose tokenization segments given text into steps where that is
            needed (likelihood scoring); one step is always one chosen piece, whichever member's
            token it is.
        agreement_skip: when every computed member's most likely piece is the same, take it and
            skip alignment and combination. ``None`` (default): on for greedy decoding with combiners
            for which this is exact (``gac``, ``unite``), off otherwise.
        gate, threshold: thresholded mode (GaC Eq. 5): the gate member runs every step; the others
            only when the gate's top probability is ``<= threshold``.
        window: look-behind window (member tokens) for re-synchronisation.
        parallel: forward the members in threads instead of one after another (see the README's
            benchmark section for which is faster on a 2-core CPU).
        align_cache: directory for cached alignment tables (``None``: no disk cache).
    """

    def __init__(
        self,
        members: Sequence[Member],
        *,
        method: str = "gac",
        method_params: dict | None = None,
        primary: str | None = None,
        agreement_skip: bool | None = None,
        gate: str | None = None,
        threshold: float | None = None,
        window: int = 8,
        parallel: bool = True,
        align_cache=None,
        union: UnionVocab | None = None,
    ) -> None:
        if not members:
            raise ConfigError("members: an ensemble needs at least one member")
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ConfigError(f"members: names must be unique, got {names}")
        self.members = list(members)
        self.combiner = get_combiner(method, **(method_params or {}))
        if threshold is not None and gate is None:
            raise ConfigError("gate: thresholded GaC needs a gate member (set `gate` to a member name)")
        for field_name, value in (("gate", gate), ("primary", primary)):
            if value is not None and value not in names:
                raise ConfigError(f"{field_name}: {value!r} is not a member (members: {', '.join(names)})")
        if all(m.weight <= 0 for m in members):
            raise ConfigError("members.weight: at least one member needs a positive weight")
        self.gate = names.index(gate) if gate is not None else None
        self.primary = names.index(primary) if primary is not None else 0
        self.threshold = threshold
        self.agreement_skip = agreement_skip
        self.window = window
        self.parallel = parallel
        self._pool = ThreadPoolExecutor(max_workers=len(members), thread_name_prefix="member") if parallel else None
        self.align_cache = align_cache
        self.union = union or build_union([m.codec for m in members], cache=align_cache)
        self.projector = Projector(self.union)
        self.aligner = SubtokenAligner(self.projector, [m.codec for m in self.members])
        self.timings = dict.fromkeys(STAGES, 0.0)
        self.combiner.bind(self)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        max_new_tokens: int = 64,
        sampling: Sampling = Sampling(),
        stop: Sequence[str] = (),
        chat: bool = False,
    ) -> Generation | list[Generation]:
        """Generate for one prompt (returns a ``Generation``) or a batch (returns a list)."""
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        seqs: list[Seq] = []
        start_timings = dict(self.timings)
        t0 = time.perf_counter()
        for _ in self.steps(batch, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, chat=chat,
                            _seqs=seqs):
            pass
        timings = {k: self.timings[k] - start_timings[k] for k in STAGES}
        timings["total"] = time.perf_counter() - t0
        timings["other"] = timings["total"] - sum(timings[k] for k in STAGES)
        results = [self.result(s, timings) for s in seqs]
        for s in seqs:
            self.close(s)
        return results[0] if single else results

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               stop: Sequence[str] = (), chat: bool = False) -> Iterator[str]:
        """Text pieces as they become final: never a split UTF-8 character, never a stop string.

        The pieces concatenate to ``generate(...).text`` for the same arguments.
        """
        seqs: list[Seq] = []
        emitted = 0
        for ev in self.steps([prompt], max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, chat=chat,
                             _seqs=seqs):
            out = bytes(seqs[0].output)
            end = len(out) if ev.finished else safe_end(out, seqs[0].stops)
            if end > emitted:
                yield out[emitted:end].decode("utf-8", errors="replace")
                emitted = end
        self.close(seqs[0])

    # ------------------------------------------------------------------ the loop
    def steps(self, prompts: Sequence[Prompt], *, max_new_tokens: int, sampling: Sampling,
              stop: Sequence[str] = (), chat: bool = False, _seqs: list | None = None) -> Iterator[StepEvent]:
        """The decoding loop, one ``StepEvent`` per sequence per step."""
        seqs = [self.open(p, chat=chat, sampling=sampling, stop=stop, max_new_tokens=max_new_tokens, index=i)
                for i, p in enumerate(prompts)]
        if _seqs is not None:
            _seqs.extend(seqs)
        while active := [s for s in seqs if s.finished is None]:
            yield from self.step(active)

    def open(self, prompt: Prompt, *, chat: bool = False, sampling: Sampling = Sampling(), stop: Sequence[str] = (),
             max_new_tokens: int = 64, index: int = 0) -> Seq:
        """Start a sequence (every member encodes the prompt); run it with ``step``, free it with ``close``.

        Sequences opened separately can share a ``step`` (each keeps its own sampling options, stop
        strings and length limit), so callers such as a server can let requests join and leave a
        running batch between steps.
        """
        messages = [{"role": "user", "content": prompt}] if (chat and isinstance(prompt, str)) else prompt
        states = []
        for m in self.members:
            if isinstance(messages, str):
                ids = m.encode_prompt(messages)
            else:
                two = isinstance(messages, TwoFormPrompt)
                text, templated = m.render_chat(messages.messages if two else messages)
                if two and not templated:
                    text = messages.raw  # a member without a template gets the raw form
                ids = m.encode_prompt(text, templated=templated)
            states.append(m.new_state(ids))
        gen = None
        if not sampling.greedy:
            gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        return Seq(index, states, sampling, [s.encode("utf-8") for s in stop if s], max_new_tokens, gen)

    def close(self, s: Seq) -> None:
        """Free a sequence's per-member state (caches); safe to call twice."""
        for m, st in zip(self.members, s.states):
            m.release(st)
        if s.finished is None:
            s.finished = "cancelled"

    def step(self, active: list[Seq]) -> list[StepEvent]:
        """One decoding step for every sequence in ``active`` (all unfinished)."""
        events = []
        for s, (u, ens, skipped) in zip(active, self._decide(active)):
            # append the piece, then check END, stop strings and the length limit
            before = len(s.output)
            piece = self.union.pieces[u] if u != END else b""
            if u == END:
                s.finished = "end"
            else:
                s.output += piece
                s.steps += 1
                s.ensembled += ens  # like ``steps``, END is not counted
                s.skipped += skipped and ens
                if (cut := _find_stop(s.output, s.stops, before)) is not None:
                    del s.output[cut:]
                    s.finished = "stop"
                elif s.steps >= s.max_new_tokens:
                    s.finished = "length"
            # re-synchronise every member on the new output
            if s.finished in (None, "length"):
                self._resync(s, u, before)
            elif s.finished == "stop":
                self._resync_trimmed(s)
            out_piece = piece if s.finished != "stop" else bytes(s.output[before:])
            events.append(StepEvent(s.index, out_piece, ens, s.finished, skipped and ens))
        return events

    # ------------------------------------------------------------------ likelihood
    def loglikelihood(self, requests: Sequence[tuple[Prompt, str]], *, chat: bool = False) -> list[Likelihood]:
        """Log-likelihood of each ``(context, continuation)`` under the token-level ensemble.

        Definition: the continuation's bytes are cut into pieces by the primary member's own
        mid-stream tokenization. Piece by piece, every weighted member runs on the context plus the
        pieces so far (the same lockstep engine and re-sync as generation), and the piece's
        probability is the combiner's probability of that union entry (``Combiner.piece_probs``:
        for GaC the weighted average of the members' probabilities, a member without the piece as
        one token contributing its first sub-token's probability as in UniTE; for UniTE the piece
        joins the top-k candidates). The result is the sum of the pieces' log-probabilities; a
        member alone (or copies of one member) gives exactly that member's own likelihood of its
        tokens, each renormalised over its text + END ids.

        Thresholded GaC (``gate``/``threshold``) gates each piece as in generation: where the gate
        member's top probability is above the threshold, the piece's probability is the gate's
        alone; elsewhere the group's combination. ``Likelihood.ensembled`` counts the latter.
        """
        seqs = [self.open(ctx, chat=chat, index=k) for k, (ctx, _) in enumerate(requests)]
        primary = self.members[self.primary]
        cuts = []
        for _, cont in requests:
            ids = primary.codec.encode_text(cont)
            cuts.append([int(self.union.maps[self.primary][t]) for t in ids])
        totals, ensembled = [0.0] * len(seqs), [0] * len(seqs)
        try:
            for j in range(max((len(c) for c in cuts), default=0)):
                rows = [k for k in range(len(seqs)) if j < len(cuts[k])]
                active = [seqs[k] for k in rows]
                entries = [cuts[k][j] for k in rows]
                probs: list[float] = [0.0] * len(active)
                for group, members in self._groups(active):
                    sub = [active[r] for r in group]
                    view = self._view(sub, members, self._forward_many(members, sub))
                    t = time.perf_counter()
                    got = self.combiner.piece_probs(view, [entries[r] for r in group]).tolist()
                    self.timings["combine"] += time.perf_counter() - t
                    for r, p in zip(group, got):
                        probs[r] = p
                        ensembled[rows[r]] += len(members) > 1
                for k, s, u, p in zip(rows, active, entries, probs):
                    totals[k] += math.log(p) if p > 0 else float("-inf")
                    before = len(s.output)
                    s.output += self.union.pieces[u]
                    s.steps += 1
                    self._resync(s, u, before)
        finally:
            for s in seqs:
                self.close(s)
        return [Likelihood(lp, len(c), len(cont.encode("utf-8")), e)
                for lp, c, e, (_, cont) in zip(totals, cuts, ensembled, requests)]

    # ------------------------------------------------------------------ stages
    def _decide(self, active: list[Seq]) -> list[tuple[int, bool, bool]]:
        """Per sequence: (chosen union entry, ensembled, decided by agreement skip)."""
        decisions: list[tuple[int, bool, bool] | None] = [None] * len(active)
        for rows, members in self._groups(active):
            seqs = [active[r] for r in rows]
            outs = self._forward_many(members, seqs)
            for r, d in zip(rows, self._decide_group(seqs, members, outs)):
                decisions[r] = d
        return decisions

    def _groups(self, active: list[Seq]) -> list[tuple[list[int], list[int]]]:
        """Rows of ``active`` and the members that decide them: all weighted members, or with a gate
        (GaC Eq. 5) the gate alone where its top probability is above the threshold and the
        weighted members (the gate among them if weighted) elsewhere."""
        weights = [m.weight for m in self.members]
        run = [i for i, w in enumerate(weights) if w > 0]
        if self.gate is None:
            return [(list(range(len(active))), run)]
        g = self.gate
        out = self._forward_many([g], active)[g]
        top = out.max(dim=-1).values if isinstance(out, torch.Tensor) else out[0][:, 0]
        confident = (top.exp() > self.threshold).tolist()
        sure = [r for r, c in enumerate(confident) if c]
        unsure = [r for r, c in enumerate(confident) if not c]
        others = [i for i in run if i != g]
        groups = [(sure, [g])] if sure else []
        if unsure:
            groups.append((unsure, sorted(set(others) | ({g} if weights[g] > 0 else set())) or [g]))
        return groups

    def _decide_group(self, seqs: list[Seq], members: list[int], outs: dict) -> list[tuple[int, bool, bool]]:
        ens = len(members) > 1
        result: list[tuple[int, bool, bool] | None] = [None] * len(seqs)
        t = time.perf_counter()
        todo = list(range(len(seqs)))
        if self._skip_enabled(seqs, members):
            agreed = self._agreement(seqs, members, outs)
            todo = [r for r, u in enumerate(agreed) if u < 0]
            for r, u in enumerate(agreed):
                if u >= 0:
                    result[r] = (u, ens, True)
        self.timings["choose"] += time.perf_counter() - t
        if todo:
            view = self._view([seqs[r] for r in todo], members, outs,
                              None if len(todo) == len(seqs) else torch.tensor(todo))
            t, align0 = time.perf_counter(), self.timings["align"]
            if len(members) == 1 and isinstance(outs[members[0]], torch.Tensor):
                dist = Dist(self.project(members[0], view.logprobs[members[0]]))  # a member alone
            else:
                dist = self.combiner.combine(view)
            self.timings["combine"] += time.perf_counter() - t - (self.timings["align"] - align0)
            t = time.perf_counter()
            for j, r in enumerate(todo):
                result[r] = (self._choose(dist, j, seqs[r]), ens, False)
            self.timings["choose"] += time.perf_counter() - t
        return result

    def _view(self, seqs: list[Seq], members: list[int], outs: dict, pick: torch.Tensor | None = None) -> StepView:
        """The combiner's view of ``seqs`` from the members' outputs (rows ``pick`` of them, if given)."""
        view = StepView(ens=self, states={i: [s.states[i] for s in seqs] for i in members}, members=members,
                        weights=[self.members[i].weight for i in members])
        for i in members:
            o = outs[i]
            if isinstance(o, torch.Tensor):
                view.logprobs[i] = o if pick is None else o[pick]
            else:
                view.topk[i] = o if pick is None else (o[0][pick], o[1][pick])
        return view

    def _skip_enabled(self, seqs: list[Seq], members: list[int]) -> bool:
        greedy = all(s.sampling.greedy for s in seqs)
        if self.agreement_skip is None:
            # exact for greedy decoding; a member alone (gated rows) agrees with itself
            return greedy and (self.combiner.exact_agreement or len(members) == 1)
        return self.agreement_skip

    def _agreement(self, seqs: list[Seq], members: list[int], outs: dict) -> list[int]:
        """Per row the union entry every member ranks first, or ``-1`` where they differ.

        A member's first entry is that of its most likely text id, provided no entry it holds under
        several ids (END, duplicate spellings) has more mass and the entry is representable; else
        the row is not skipped. (numpy: its 1-D argmax is ~20x faster than torch's here.)
        """
        agreed = [-2] * len(seqs)  # -2: no member looked yet
        rep = self.union.representable
        for i in members:
            o, umap = outs[i], self.union.maps[i]
            if isinstance(o, torch.Tensor):
                arr = o.numpy()
                ids = arr.argmax(axis=-1)
                for r, tid in enumerate(ids):
                    if umap[tid] < 0:  # a special token on top: look at text ids only
                        ids[r] = np.where(umap[: arr.shape[-1]] >= 0, arr[r], -np.inf).argmax()
                tops = arr[np.arange(len(ids)), ids]
            else:
                tlp, tids = o[0].numpy(), o[1].numpy()
                col = (umap[tids] >= 0).argmax(axis=-1)  # first text column (a non-text id fails below)
                ids, tops = tids[np.arange(len(col)), col], tlp[np.arange(len(col)), col]
            entries = umap[ids]
            best_group = own = None
            if self.projector.group_ids[i].numel():
                gids = self.projector.group_ids[i].expand(len(seqs), -1)
                gp = np.exp(self.members[i].token_logprobs([s.states[i] for s in seqs], gids).numpy())
                uniq, slot = self.projector.group_slots_np[i]
                sums = np.zeros((len(seqs), len(uniq)))
                for r in range(len(seqs)):
                    sums[r] = np.bincount(slot, weights=gp[r], minlength=len(uniq))
                best_group = sums.max(axis=1)
                own = [sums[r, np.searchsorted(uniq, e)] if e in self.projector.groups[i] else np.exp(tops[r])
                       for r, e in enumerate(entries.tolist())]
            for r, e in enumerate(entries.tolist()):
                ok = e >= 0 and rep[e] and (best_group is None or own[r] >= best_group[r])
                if not ok or agreed[r] not in (-2, e):
                    agreed[r] = -1
                elif agreed[r] == -2:
                    agreed[r] = e
        return [max(a, -1) for a in agreed]

    def _choose(self, dist: Dist, row: int, s: Seq) -> int:
        p = dist.probs[row]
        if not s.sampling.greedy:
            return dist.entry(row, choose(p, s.sampling, s.generator))
        arr = p.numpy()
        col = int(arr.argmax())
        if np.count_nonzero(arr == arr[col]) > 1:  # exact ties: the primary's preference, then smallest bytes
            col = self._break_tie(dist, row, np.nonzero(arr == arr[col])[0].tolist(), s)
        return dist.entry(row, col)

    def _break_tie(self, dist: Dist, row: int, cols: list[int], s: Seq) -> int:
        i = self.primary
        st = s.states[i]
        if st.logprobs is None:
            return cols[0]
        def mass(col: int) -> float:
            ids = self.projector.entry_ids(i, dist.entry(row, col))
            return float(st.logprobs[ids].exp().sum()) if ids else 0.0
        return max(cols, key=lambda c: (mass(c), -c))

    def project(self, i: int, logprobs: torch.Tensor) -> torch.Tensor:
        """Member ``i``'s log-probs mapped into the union (timed as the ``align`` stage)."""
        t = time.perf_counter()
        out = self.projector.project(i, logprobs)
        self.timings["align"] += time.perf_counter() - t
        return out

    def _forward_many(self, members: list[int], seqs: list[Seq]) -> dict[int, object]:
        """Forward several members on the same sequences: one after another, or in threads
        (``parallel``; backends that release the GIL, such as llama.cpp, then overlap).

        Returns per member full log-probs ``[R, V_i]`` or, for top-k combiners, ``(logprobs, ids)``.
        """
        if not members or not seqs:
            return {}
        t = time.perf_counter()
        if not self.parallel or len(members) == 1:
            out = {i: self._member_forward(i, seqs) for i in members}
        else:
            futures = {i: self._pool.submit(self._member_forward, i, seqs) for i in members}
            wait(futures.values())  # all finished (even when one raises) before anyone touches the states
            out = {i: f.result() for i, f in futures.items()}
        self.timings["forward"] += time.perf_counter() - t
        return out

    def _member_forward(self, i: int, seqs: list[Seq]):
        states = [s.states[i] for s in seqs]
        if self.combiner.needs == "topk":
            return self.members[i].next_topk(states, self.combiner.k)
        return self.members[i].next_logprobs(states)

    def _resync(self, s: Seq, u: int, before: int) -> None:
        t = time.perf_counter()
        out = bytes(s.output)
        n = len(out) - before
        for i, (m, st) in enumerate(zip(self.members, s.states)):
            tid = self.projector.member_id(i, u)
            if tid >= 0 and in_step(st, before):
                append_token(st, tid, n)  # the member has this exact piece as one token
            else:
                resync(m.codec, st, out, window=self.window)
        self.timings["resync"] += time.perf_counter() - t

    def _resync_trimmed(self, s: Seq) -> None:
        """After a stop string was cut off (possibly reaching into earlier pieces), make every
        member's ids decode to the trimmed output again, so ``member_ids`` keeps its contract."""
        t = time.perf_counter()
        out = bytes(s.output)
        for m, st in zip(self.members, s.states):
            _rollback(st, len(out))
            resync(m.codec, st, out, window=self.window)
        self.timings["resync"] += time.perf_counter() - t

    # ------------------------------------------------------------------ helpers
    def result(self, s: Seq, timings: dict[str, float] | None = None) -> Generation:
        out = bytes(s.output)
        return Generation(
            text=out.decode("utf-8", errors="replace"),
            output=out,
            steps=s.steps,
            ensembled_steps=s.ensembled,
            finish_reason=s.finished or "length",
            member_ids={m.name: list(st.ids) for m, st in zip(self.members, s.states)},
            timings=timings or {},
            skipped_steps=s.skipped,
        )


def _is_single(prompts) -> bool:
    if isinstance(prompts, (str, TwoFormPrompt)):
        return True
    return bool(prompts) and isinstance(prompts[0], dict)  # one chat conversation


def _find_stop(output: bytearray, stops: list[bytes], before: int) -> int | None:
    """Start of the earliest stop string that the last piece completed, or ``None``."""
    best = None
    for st in stops:
        pos = output.find(st, max(0, before - len(st) + 1))
        if pos >= 0 and (best is None or pos < best):
            best = pos
    return best


def _rollback(st: SeqState, n: int) -> None:
    """Drop a member's ids that reach past output byte ``n`` (the output was trimmed to ``n``)."""
    ends = st.starts[1:] + [st.covered]
    keep = sum(1 for e in ends[: len(st.ids)] if e <= n)  # token ends never decrease
    if keep == len(st.ids) and st.covered <= n:
        return
    st.ids = st.ids[:keep]
    st.starts = st.starts[:keep]
    st.covered = ends[keep - 1] if keep else 0
    st.provisional = False
    st.n_valid = min(st.n_valid, len(st.prompt_ids) + keep)
    st.logprobs = None


def safe_end(out: bytes, stops: list[bytes]) -> int:
    """How much of ``out`` can be shown now: no unfinished character, no partial stop string."""
    end = len(out)
    for st in stops:
        for n in range(min(len(st) - 1, len(out)), 0, -1):
            if out.endswith(st[:n]):
                end = min(end, len(out) - n)
                break
    end -= _incomplete_tail(out[:end])
    return end
