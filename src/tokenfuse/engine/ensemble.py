"""``Ensemble``: members with different tokenizers generating as one model (the engine's facade).

One truth: the output is bytes. Each step the members that are needed produce next-token
distributions, the combiner merges them in the union space, one union entry (a piece of bytes,
or END) is chosen, and every member is re-synchronised on the longer output. Nothing else is
shared between members. Where each part lives:

- ``sequence.OpenSequence``: one sequence's member states, output, stops, finishing and text out;
- ``decide.Decider``: which members run, agreement skip, combination and choice (a ``sequence.Decision``);
  for a combiner that ``needs`` the members' next-byte distributions (the ``byte`` method: one byte per
  step) its ``bytegen.ByteDecider``, the same loop on the members' byte-level views (``DECIDERS``);
- ``pool.MemberPool``: the members' forward passes, in threads;
- ``likelihood``: teacher forcing; ``timer.StageTimer``: where the time goes;
- ``trace``: the step trace of a sequence opened with ``trace`` (nothing is recorded otherwise).

Every ensemble still open at exit is unloaded then (``unload``; ``with`` unloads at the end of the
block), while the interpreter still runs: llama-cpp-python would otherwise free its models after
its own module is gone and print a ``TypeError`` traceback for each.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END, UnionVocab
from tokenfuse.combiners import Setup, get_combiner
from tokenfuse.engine.bytegen import ByteDecider, top_entries
from tokenfuse.engine.bytescore import byte_loglikelihood, byte_score_prompt
from tokenfuse.engine.decide import Decider
from tokenfuse.engine.likelihood import Likelihood, RowMemo, score
from tokenfuse.engine.options import EnsembleOptions, options_error, own_params
from tokenfuse.engine.pool import MemberPool
from tokenfuse.engine.prompt import Prompt, is_single, prompt_ids, prompt_token_count
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.sequence import Generation, OpenSequence, StepEvent
from tokenfuse.engine.speculative import Speculator
from tokenfuse.engine.timer import StageTimer
from tokenfuse.engine.trace import (
    PromptPiece,
    TopEntry,
    Trace,
    TraceOptions,
    TraceStep,
    end_text,
    entry_text,
)
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member

_open: weakref.WeakSet[Ensemble] = weakref.WeakSet()  # every ensemble made, held weakly until exit
# the step decision by what the combiner needs of the members (``Combiner.needs``; else ``Decider``)
DECIDERS: dict[str, type[Decider]] = {"bytes": ByteDecider}


@atexit.register
def _unload_open() -> None:
    """Unload the ensembles still open (unloading twice is harmless) while the interpreter still runs."""
    for ens in list(_open):
        ens.unload()


class Ensemble:
    """Members with different tokenizers generating as one model.

    Args:
        members: the loaded members (their order fixes the order of ``member_ids`` only). The
            ensemble never writes to them: the same member objects may serve several ensembles
            (``variant``: the server's per-request ensembles, ``tokenfuse eval``'s rows).
        options: what the ensemble is (``EnsembleOptions``: method and parameters, primary, gate,
            agreement skip, window, scoring, threads, speculative decoding); keyword ``fields`` are a
            shorthand for ``EnsembleOptions(**fields)`` (or, with ``options``, ``options.replace``).
            Every member re-syncs from the output bytes, so no member's tokenization drives the loop;
            the primary member (default: the highest of ``scores``, else the first) breaks greedy ties,
            is the default gate of ``threshold`` and segments given text into steps (likelihood scoring).
        weights: each member's weight before normalisation, in member order or ``{name: weight}``
            (default, and for the names a mapping leaves out: the member's own default ``weight``,
            given when it was built). ``self.weights`` holds them, fixed when the ensemble is made
            (``variant`` for others); a weight of 0 keeps a member in sync without running it.
        scores: each member's dev-set accuracy (as ``tokenfuse select`` writes it into a config;
            ``None``: unknown), in member order: the default primary and DeePEn-Adapt read them.
            ``self.scores`` holds them (default: none known).
        align_cache: directory for cached alignment tables (``None``: no disk cache).
        union: an already built union of these members' vocabularies (e.g. shared by a server's
            ensembles), else built or loaded.
    """

    def __init__(self, members: Sequence[Member], options: EnsembleOptions | None = None, *,
                 weights: Sequence[float] | Mapping[str, float] | None = None,
                 scores: Sequence[float | None] | None = None, align_cache: str | Path | None = None,
                 union: UnionVocab | None = None, **fields: Any) -> None:
        if fields:
            try:
                options = options.replace(**fields) if options is not None else EnsembleOptions(**fields)
            except ValidationError as err:
                raise ConfigError(options_error(err)) from None
        self.options = options = options if options is not None else EnsembleOptions()
        self.members = list(members)
        names = [m.name for m in self.members]
        self.weights: list[float] = member_weights(self.members, weights)
        self.scores: list[float | None] = [None] * len(names) if scores is None else list(scores)
        if len(self.scores) != len(names):
            raise ConfigError(f"scores: {len(self.scores)} scores for {len(names)} members ({', '.join(names)})")
        options.check_members(names, self.weights)
        self.combiner = get_combiner(options.method, **own_params(options))
        self.primary = names.index(options.primary_of(names, self.scores))
        self.align_cache = Path(align_cache) if align_cache is not None else None
        self.space = VocabSpace.build(names, [m.codec for m in members], union=union, cache=self.align_cache)
        self.timer = StageTimer()
        self.pool = MemberPool(self.members, parallel=options.parallel)
        self.combiner.bind(Setup(self.space, self.members, self.primary, self.align_cache, weights=self.weights,
                                 scores=self.scores))
        decider = DECIDERS.get(self.combiner.needs, Decider)
        self.decider = decider(self.members, self.space, self.combiner, self.pool, self.timer, options,
                               primary=self.primary, weights=self.weights)
        spec = options.speculative
        rounds = self.decider.rounds is not None  # a strategy drafting in rounds (SAFE) runs on the speculator
        self.speculator = Speculator(self.decider, spec) if spec is not None or rounds else None
        _open.add(self)

    @classmethod
    def single(cls, member: Member, *, window: int = 8, align_cache: str | Path | None = None,
               scoring: str = "one-forward") -> Ensemble:
        """One member alone through the same engine (its own choices, its own likelihoods)."""
        return cls([member], window=window, parallel=False, align_cache=align_cache, scoring=scoring)

    def variant(self, options: EnsembleOptions | None = None, *,
                weights: Sequence[float] | Mapping[str, float] | None = None, progress: bool = False) -> Ensemble:
        """Another ensemble on these same member objects and this union (sequences and caches stay the
        members' own): ``options`` (default: these), ``weights`` (in member order, or
        ``{name: weight}`` with the others kept; default: these), these ``scores``, its combiner
        prepared (``Combiner.prepare``). Nothing of the members is written: this ensemble keeps its
        own weights."""
        if isinstance(weights, Mapping):
            weights = member_weights(self.members, weights, defaults=self.weights)
        ens = Ensemble(self.members, options if options is not None else self.options,
                       weights=self.weights if weights is None else weights, scores=self.scores,
                       align_cache=self.align_cache, union=self.union)
        ens.combiner.prepare(progress=progress)
        return ens

    def describe(self) -> dict[str, Any]:
        """What this ensemble is, as plain data: the one self-description (CLI ``--json``, bench rows,
        ``/v1/models``, eval headers): the members, then every option (the fields of ``EnsembleOptions``,
        as plain data). Names, not indices; ``primary`` and the drafter resolved."""
        o = self.options
        return {
            "members": [{"name": m.name, "weight": w, **({"score": s} if s is not None else {})}
                        for m, w, s in zip(self.members, self.weights, self.scores)],
            **o.model_dump(),
            "primary": self.members[self.primary].name,
            "speculative": ({"draft": self.members[self.speculator.draft].name, "k": self.speculator.k,
                             "adapt": self.speculator.adapt} if o.speculative is not None else None),
        }

    @property
    def union(self) -> UnionVocab:
        return self.space.union

    # ------------------------------------------------------------------ sequences
    def open(self, prompt: Prompt, *, chat: bool = False, sampling: Sampling = Sampling(), stop: Sequence[str] = (),
             max_new_tokens: int = 64, index: int = 0, trace: TraceOptions | None = None) -> OpenSequence:
        """Start a sequence (every member encodes the prompt); run it with ``step``, free it with ``close``.

        Sequences opened separately can share a ``step`` (each keeps its own sampling options, stop
        strings and length limit), so callers such as a server can let requests join and leave a
        running batch between steps. With ``trace`` its steps are recorded (``OpenSequence.take_steps``).
        ``max_new_tokens=0`` opens a sequence that has already finished (``length``).
        """
        states = [m.new_state(prompt_ids(m, prompt, chat=chat)) for m in self.members]
        gen = None
        if not sampling.greedy:
            gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        seq = OpenSequence(index, states, self.space, self.options.window, sampling, [s.encode("utf-8") for s in stop if s],
                           max_new_tokens, gen, finished="length" if max_new_tokens <= 0 else None,
                           trace=Trace(trace) if trace is not None else None)
        try:
            self.decider.admit(seq)
        except ConfigError:
            self.close(seq)
            raise
        return seq

    def step(self, active: list[OpenSequence]) -> list[StepEvent]:
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
            events |= spec.run([s for s in active if id(s) not in events])
        return [ev for s in active for ev in events[id(s)]]

    def close(self, s: OpenSequence) -> None:
        """Free a sequence's per-member state (caches); safe to call twice."""
        self.decider.release(s)
        for m, st in zip(self.members, s.states):
            m.release(st)
        s.finish("cancelled")

    # ------------------------------------------------------------------ whole calls
    def steps(self, prompts: Sequence[Prompt], *, max_new_tokens: int, sampling: Sampling, stop: Sequence[str] = (),
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

    def generate(self, prompts: Prompt | Sequence[Prompt], *, max_new_tokens: int = 64,
                 sampling: Sampling | Sequence[Sampling] = Sampling(), stop: Sequence[str] = (), chat: bool = False,
                 trace: bool = False, trace_k: int = 5) -> Generation | list[Generation]:
        """Generate for one prompt (returns a ``Generation``) or a batch (returns a list).

        ``sampling`` is every sequence's, or one per prompt of a batch (e.g. the same prompt several
        times with its own ``seed`` each: every sequence draws with its own generator, so a sample
        does not depend on the other sequences of its batch).

        With ``trace`` each ``Generation.trace`` lists every step: the chosen piece, its combined
        probability, the combined and each member's ``trace_k`` most likely tokens and how the step
        was decided (``tokenfuse.engine.trace``). The output is the same with or without it.
        """
        single = is_single(prompts)
        batch = [prompts] if single else list(prompts)
        before, t0 = self.timer.snapshot(), time.perf_counter()
        opts = TraceOptions(k=trace_k) if trace else None
        samplings = [sampling] * len(batch) if isinstance(sampling, Sampling) else list(sampling)
        if len(samplings) != len(batch):
            raise ValueError(f"generate: {len(samplings)} sampling options for {len(batch)} prompts")
        seqs: list[OpenSequence] = []
        try:
            for i, (p, sp) in enumerate(zip(batch, samplings)):
                seqs.append(self.open(p, chat=chat, sampling=sp, stop=stop, max_new_tokens=max_new_tokens, index=i,
                                      trace=opts))
            while active := [s for s in seqs if s.finished is None]:
                self.step(active)
            timings = self.timer.since(before, time.perf_counter() - t0)
            results = [s.result(timings) for s in seqs]
        finally:
            for s in seqs:
                self.close(s)
        return results[0] if single else results

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               stop: Sequence[str] = (), chat: bool = False, trace: bool = False,
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
        the whole prompt (the context then grows until it is not). The ``byte`` method scores every
        byte, the first too (``engine.bytescore.byte_score_prompt``)."""
        if self.combiner.needs == "bytes":
            end = end_text(self.members[self.primary])
            return [PromptPiece(bytes([b]), lp, top_entries(dist, top, end) if dist is not None else ())
                    for b, lp, dist in byte_score_prompt(self.members, self.combiner, self.decider.table, self.pool,
                                                         prompt, top=top, weights=self.weights)]
        self._scores_pieces()
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
        (lk,) = self._score([(context, rest)], chat=False, stepwise=self.options.scoring == "stepwise", top=top)
        end = end_text(self.members[self.primary])
        tops = lk.piece_tops or ((),) * lk.pieces
        return [PromptPiece(p) for p in pieces[:m]] + [
            PromptPiece(b, lp, tuple(TopEntry(entry_text(self.space, e, end), self.space.piece(e).hex(), v, end=e == END)
                                     for e, v in t))
            for b, lp, t in zip(lk.piece_bytes, lk.piece_logprobs, tops)]

    def loglikelihood(self, requests: Sequence[tuple[Prompt, str]], *, chat: bool = False,
                      stepwise: bool | None = None, memo: RowMemo | None = None) -> list[Likelihood]:
        """Log-likelihood of each ``(context, continuation)`` under the token-level ensemble
        (definition: ``tokenfuse.engine.likelihood``; the ``byte`` method's on bytes:
        ``tokenfuse.engine.bytescore``); ``stepwise`` takes the piece-by-piece
        reference path instead of one-forward scoring (default: the ensemble's ``scoring``);
        ``memo`` (a ``RowMemo``) shares the members' rows with other scorings of the same requests,
        e.g. by other ensembles on the same loaded members."""
        if self.combiner.needs == "bytes":  # the byte method scores bytes (engine/bytescore.py)
            return byte_loglikelihood(self.members, self.combiner, self.decider.table, self.pool, requests, chat=chat,
                                      weights=self.weights, memo=memo)
        if stepwise is None:
            stepwise = self.options.scoring == "stepwise"
        return self._score(requests, chat=chat, stepwise=stepwise, memo=memo)

    def _score(self, requests: Sequence[tuple[Prompt, str]], *, chat: bool, stepwise: bool, top: int = 0,
               memo: RowMemo | None = None) -> list[Likelihood]:
        self._scores_pieces()
        seqs = [self.open(ctx, chat=chat, index=k) for k, (ctx, _) in enumerate(requests)]
        try:
            return score(self.decider, seqs, [cont for _, cont in requests], stepwise=stepwise, top=top, memo=memo)
        finally:
            for s in seqs:
                self.close(s)

    def _scores_pieces(self) -> None:
        """Scoring (``loglikelihood``, ``score_prompt``) is of pieces: refused where the method lacks it
        (``Combiner.lacks``: the ``byte`` method has no pieces)."""
        self.combiner.refuse("scoring")

    def prompt_token_counts(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        """How many ids each member (ensemble order) has for ``prompt``, as ``open`` encodes it; opens nothing."""
        return [prompt_token_count(m, prompt, chat=chat) for m in self.members]

    # ------------------------------------------------------------------ lifetime
    def unload(self) -> None:
        """Free every member's model and caches now (llama.cpp contexts and models, a transformers
        model, a remote member's client, a Ray actor); safe to call twice. Using the ensemble
        afterwards raises ``TokenfuseError``. Members shared with other ensembles (the server's
        per-request ensembles, ``variant``s) are unloaded for those too; a model several
        members share (a self-ensemble) is freed once, with the last of them."""
        self.pool.shutdown()
        for m in self.members:
            m.unload()

    def __enter__(self) -> Ensemble:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unload()


def member_weights(members: Sequence[Member], weights: Sequence[float] | Mapping[str, float] | None, *,
                   defaults: Sequence[float] | None = None) -> list[float]:
    """Every member's weight from a list in member order or a ``{name: weight}`` mapping; a member
    the mapping leaves out (all, for ``None``) keeps its default: ``defaults``' entry, else its own
    constructor-given ``weight``. ``ConfigError`` for a list of the wrong length or an unknown name."""
    names = [m.name for m in members]
    defaults = [float(getattr(m, "weight", 1.0)) for m in members] if defaults is None else list(defaults)
    if weights is None:
        return defaults
    if isinstance(weights, Mapping):
        bad = [n for n in weights if n not in names]
        if bad:
            raise ConfigError(f"weights: {', '.join(map(repr, bad))} not a member (members: {', '.join(names)})")
        return [float(weights.get(n, d)) for n, d in zip(names, defaults)]
    weights = [float(w) for w in weights]
    if len(weights) != len(names):
        raise ConfigError(f"weights: {len(weights)} weights for {len(names)} members ({', '.join(names)})")
    return weights
