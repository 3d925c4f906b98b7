"""``Ensemble``: members with different tokenizers generating as one model (the engine's facade).

One truth: the output is bytes. Each step the members that are needed produce next-token
distributions, the combiner merges them in the union space, one union entry (a piece of bytes,
or END) is chosen, and every member is re-synchronised on the longer output. Nothing else is
shared between members. Where each part lives:

- ``sequence.Sequence``: one sequence's member states, output, stops, finishing and text out;
- ``decide.Decider``: which members run, agreement skip, combination and choice (a ``Decision``);
- ``pool.MemberPool``: the members' forward passes, in threads;
- ``likelihood``: teacher forcing; ``timer.StageTimer``: where the time goes;
- ``trace``: the step trace of a sequence opened with ``trace`` (nothing is recorded otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END, UnionVocab
from tokenfuse.combiners import Setup, get_combiner
from tokenfuse.engine.decide import Decider
from tokenfuse.engine.likelihood import Likelihood, RowMemo, score
from tokenfuse.engine.pool import MemberPool
from tokenfuse.engine.prompt import Prompt, is_single, prompt_ids
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.sequence import Generation, Sequence, StepEvent
from tokenfuse.engine.speculative import Speculator, resolve
from tokenfuse.engine.timer import StageTimer
from tokenfuse.engine.trace import PromptPiece, TopEntry, Trace, TraceOptions, TraceStep, end_text, entry_text
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member


def check_members(names: Seq[str], weights: Seq[float], *, gate: str | None = None, threshold: float | None = None,
                  primary: str | None = None) -> None:
    """The rules an ensemble's members obey (the config checks them through this too): at least
    one member, unique names, ``gate``/``primary`` among them, a threshold exactly when there is a
    gate, some positive weight. Raises ``ConfigError`` naming the field."""
    if not names:
        raise ConfigError("members: an ensemble needs at least one member")
    dup = sorted({n for n in names if list(names).count(n) > 1})
    if dup:
        raise ConfigError(f"members: names must be unique; repeated: {', '.join(dup)}")
    if threshold is not None and gate is None:
        raise ConfigError("gate: thresholded GaC needs a gate member (set `gate` to a member name)")
    for field_name, value in (("gate", gate), ("primary", primary)):
        if value is not None and value not in names:
            raise ConfigError(f"{field_name}: {value!r} is not a member (members: {', '.join(names)})")
    if gate is not None and threshold is None:
        raise ConfigError(f"threshold: gate {gate!r} needs a threshold (ensemble where its top probability is at "
                          "or below it), e.g. threshold: 0.5")
    if all(w <= 0 for w in weights):
        raise ConfigError("members.weight: at least one member needs a positive weight")


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
        union: an already built union of these members' vocabularies (e.g. shared by a server's
            ensembles), else built or loaded.
        scoring: ``loglikelihood``'s path: ``one-forward`` (each member's ids in as few chunked
            forwards as they allow) or ``stepwise`` (piece by piece, the reference); see
            ``tokenfuse.engine.likelihood``.
        speculative: speculative decoding for greedy sequences (``tokenfuse.engine.speculative``):
            ``{"draft": member name or None (the smallest local member), "k": pieces per round,
            "adapt": bool}``; ``None`` (default): every step decided plainly.
    """

    def __init__(
        self,
        members: Seq[Member],
        *,
        method: str = "gac",
        method_params: dict | None = None,
        primary: str | None = None,
        agreement_skip: bool | None = None,
        gate: str | None = None,
        threshold: float | None = None,
        window: int = 8,
        parallel: bool = True,
        align_cache: str | Path | None = None,
        union: UnionVocab | None = None,
        scoring: str = "one-forward",
        speculative: dict | None = None,
    ) -> None:
        names = [m.name for m in members]
        check_members(names, [m.weight for m in members], gate=gate, threshold=threshold, primary=primary)
        self.members = list(members)
        self.combiner = get_combiner(method, **(method_params or {}))
        self.gate = names.index(gate) if gate is not None else None
        self.primary = names.index(primary) if primary is not None else 0
        self.threshold = threshold
        self.agreement_skip = agreement_skip
        self.window = window
        self.parallel = parallel
        if scoring not in ("one-forward", "stepwise"):
            raise ConfigError(f"scoring: expected 'one-forward' or 'stepwise', got {scoring!r}")
        self.scoring = scoring
        self.align_cache = Path(align_cache) if align_cache is not None else None
        self.space = VocabSpace.build(names, [m.codec for m in members], union=union, cache=self.align_cache)
        self.timer = StageTimer()
        self.pool = MemberPool(self.members, parallel=parallel)
        self.combiner.bind(Setup(self.space, self.members, self.primary, self.align_cache))
        self.decider = Decider(self.members, self.space, self.combiner, self.pool, self.timer, primary=self.primary,
                               gate=self.gate, threshold=threshold, agreement_skip=agreement_skip)
        spec = resolve(speculative, self.members)
        self.speculator = Speculator(self.decider, spec) if spec is not None else None

    @classmethod
    def single(cls, member: Member, *, window: int = 8, align_cache: str | Path | None = None,
               scoring: str = "one-forward") -> Ensemble:
        """One member alone through the same engine (its own choices, its own likelihoods)."""
        return cls([member], window=window, parallel=False, align_cache=align_cache, scoring=scoring)

    @property
    def union(self) -> UnionVocab:
        return self.space.union

    # ------------------------------------------------------------------ sequences
    def open(self, prompt: Prompt, *, chat: bool = False, sampling: Sampling = Sampling(), stop: Seq[str] = (),
             max_new_tokens: int = 64, index: int = 0, trace: TraceOptions | None = None) -> Sequence:
        """Start a sequence (every member encodes the prompt); run it with ``step``, free it with ``close``.

        Sequences opened separately can share a ``step`` (each keeps its own sampling options, stop
        strings and length limit), so callers such as a server can let requests join and leave a
        running batch between steps. With ``trace`` its steps are recorded (``Sequence.take_steps``).
        ``max_new_tokens=0`` opens a sequence that has already finished (``length``).
        """
        states = [m.new_state(prompt_ids(m, prompt, chat=chat)) for m in self.members]
        gen = None
        if not sampling.greedy:
            gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        return Sequence(index, states, self.space, self.window, sampling, [s.encode("utf-8") for s in stop if s],
                        max_new_tokens, gen, finished="length" if max_new_tokens <= 0 else None,
                        trace=Trace(trace) if trace is not None else None)

    def step(self, active: list[Sequence]) -> list[StepEvent]:
        """One decoding step for every sequence in ``active`` (all unfinished): one event per
        sequence, or with speculative decoding one or more for each sequence it runs (in order)."""
        spec = self.speculator
        plain = [s for s in active if spec is None or not spec.eligible(s)]
        events: dict[int, list[StepEvent]] = {}
        if plain:
            decisions = self.decider.decide(plain)
            with self.timer.stage("resync"):
                events = {id(s): [s.apply(d)] for s, d in zip(plain, decisions)}
        if len(plain) < len(active):
            events |= {id(s): spec.round(s) for s in active if id(s) not in events}
        return [ev for s in active for ev in events[id(s)]]

    def close(self, s: Sequence) -> None:
        """Free a sequence's per-member state (caches); safe to call twice."""
        for m, st in zip(self.members, s.states):
            m.release(st)
        s.finish("cancelled")

    # ------------------------------------------------------------------ whole calls
    def steps(self, prompts: Seq[Prompt], *, max_new_tokens: int, sampling: Sampling, stop: Seq[str] = (),
              chat: bool = False) -> Iterator[StepEvent]:
        """The decoding loop over a batch, one ``StepEvent`` per sequence per step; the sequences
        are closed when the loop ends."""
        seqs = [self.open(p, chat=chat, sampling=sampling, stop=stop, max_new_tokens=max_new_tokens, index=i)
                for i, p in enumerate(prompts)]
        try:
            while active := [s for s in seqs if s.finished is None]:
                yield from self.step(active)
        finally:
            for s in seqs:
                self.close(s)

    def generate(self, prompts: Prompt | Seq[Prompt], *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                 stop: Seq[str] = (), chat: bool = False, trace: bool = False,
                 trace_k: int = 5) -> Generation | list[Generation]:
        """Generate for one prompt (returns a ``Generation``) or a batch (returns a list).

        With ``trace`` each ``Generation.trace`` lists every step: the chosen piece, its combined
        probability, the combined and each member's ``trace_k`` most likely tokens and how the step
        was decided (``tokenfuse.engine.trace``). The output is the same with or without it.
        """
        single = is_single(prompts)
        batch = [prompts] if single else list(prompts)
        before, t0 = self.timer.snapshot(), time.perf_counter()
        opts = TraceOptions(k=trace_k) if trace else None
        seqs = [self.open(p, chat=chat, sampling=sampling, stop=stop, max_new_tokens=max_new_tokens, index=i,
                          trace=opts)
                for i, p in enumerate(batch)]
        try:
            while active := [s for s in seqs if s.finished is None]:
                self.step(active)
            timings = self.timer.since(before, time.perf_counter() - t0)
            results = [s.result(timings) for s in seqs]
        finally:
            for s in seqs:
                self.close(s)
        return results[0] if single else results

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               stop: Seq[str] = (), chat: bool = False, trace: bool = False,
               trace_k: int = 5) -> Iterator[str] | Iterator[TraceStep]:
        """Text pieces as they become final: never a split UTF-8 character, never a stop string.

        The pieces concatenate to ``generate(...).text`` for the same arguments. With ``trace`` it
        yields the steps (``TraceStep``) instead, as they become final under the same rules; their
        ``text`` fields concatenate to that text and they equal ``generate(..., trace=True).trace``.
        """
        s = self.open(prompt, chat=chat, sampling=sampling, stop=stop, max_new_tokens=max_new_tokens,
                      trace=TraceOptions(k=trace_k) if trace else None)
        try:
            while s.finished is None:
                self.step([s])
                if trace:
                    yield from s.take_steps()
                elif text := s.take_text():
                    yield text
        finally:
            self.close(s)

    def prompt_logprobs(self, prompt: str) -> list[tuple[bytes, float | None]]:
        """The prompt's pieces in the primary member's segmentation, each with its log-probability
        given the pieces before it (``score_prompt`` without the alternatives)."""
        return [(p.bytes, p.logprob) for p in self.score_prompt(prompt)]

    def score_prompt(self, prompt: str, *, top: int = 0) -> list[PromptPiece]:
        """The prompt's pieces in the primary member's segmentation, each with its log-probability
        given the pieces before it (teacher forcing, as ``loglikelihood``: the first piece is the
        context, the rest its continuation) and, with ``top``, the combined distribution's ``top``
        most likely entries there. The first piece has none (``None``); so do the next ones in the
        rare case that the rest of the prompt, tokenised alone, would be cut otherwise than within
        the whole prompt (the context then grows until it is not)."""
        codec = self.space.codecs[self.primary]
        ids = codec.encode_text(prompt)
        pieces = [codec.token_bytes[t] or b"" for t in ids]
        data = prompt.encode("utf-8")
        for m in range(1, len(ids) + 1):
            head = b"".join(pieces[:m])
            try:
                context = head.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a split character: the context grows to the end of it
            rest = data[len(head):].decode("utf-8")
            if codec.encode_text(rest) == ids[m:]:
                break
        else:
            return [PromptPiece(p) for p in pieces]
        if not rest:
            return [PromptPiece(p) for p in pieces]
        (lk,) = self._score([(context, rest)], chat=False, stepwise=self.scoring == "stepwise", top=top)
        end = end_text(self.members[self.primary])
        tops = lk.piece_tops or ((),) * lk.pieces
        return [PromptPiece(p) for p in pieces[:m]] + [
            PromptPiece(b, lp, tuple(TopEntry(entry_text(self.space, e, end), self.space.piece(e).hex(), v, end=e == END)
                                     for e, v in t))
            for b, lp, t in zip(lk.piece_bytes, lk.piece_logprobs, tops)]

    def loglikelihood(self, requests: Seq[tuple[Prompt, str]], *, chat: bool = False,
                      stepwise: bool | None = None, memo: RowMemo | None = None) -> list[Likelihood]:
        """Log-likelihood of each ``(context, continuation)`` under the token-level ensemble
        (definition: ``tokenfuse.engine.likelihood``); ``stepwise`` takes the piece-by-piece
        reference path instead of one-forward scoring (default: the ensemble's ``scoring``);
        ``memo`` (a ``RowMemo``) shares the members' rows with other scorings of the same requests,
        e.g. by other ensembles on the same loaded members."""
        if stepwise is None:
            stepwise = self.scoring == "stepwise"
        return self._score(requests, chat=chat, stepwise=stepwise, memo=memo)

    def _score(self, requests: Seq[tuple[Prompt, str]], *, chat: bool, stepwise: bool, top: int = 0,
               memo: RowMemo | None = None) -> list[Likelihood]:
        seqs = [self.open(ctx, chat=chat, index=k) for k, (ctx, _) in enumerate(requests)]
        try:
            return score(self.decider, seqs, [cont for _, cont in requests], stepwise=stepwise, top=top, memo=memo)
        finally:
            for s in seqs:
                self.close(s)

    # ------------------------------------------------------------------ lifetime
    def unload(self) -> None:
        """Free every member's model and caches now (llama.cpp contexts and models, a transformers
        model, a remote member's client, a Ray actor); safe to call twice. Using the ensemble
        afterwards raises ``TokenfuseError``. Members shared with other ensembles (the server's
        per-request ensembles, ``Reweighted`` views) are unloaded for those too; a model several
        members share (a self-ensemble) is freed once, with the last of them."""
        self.pool.shutdown()
        for m in self.members:
            m.unload()

    def __enter__(self) -> Ensemble:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unload()
