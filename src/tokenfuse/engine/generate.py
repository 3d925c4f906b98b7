"""The lockstep decoding loop.

One truth: the output is bytes. Each step the members that are needed produce next-token
distributions, the combiner merges them in the union space, one union entry (a piece of bytes,
or END) is chosen, and every member is re-synchronised on the longer output. Nothing else is
shared between members.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tokenfuse.alignment.project import Projector
from tokenfuse.alignment.union import END, UnionVocab, build_union
from tokenfuse.combiners import get_combiner
from tokenfuse.engine.sampling import Sampling, choose
from tokenfuse.engine.sync import _incomplete_tail, append_token, in_step, resync
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member, SeqState

Prompt = str | Sequence[dict]
STAGES = ("forward", "align", "combine", "choose", "resync")


@dataclass(frozen=True)
class StepEvent:
    """What one step did to one sequence: ``piece`` was appended (empty for END)."""

    index: int
    piece: bytes
    ensembled: bool
    finished: str | None  # None while running, else "end" | "stop" | "length"


@dataclass(frozen=True)
class Generation:
    """The result for one prompt.

    Attributes:
        text: the output decoded as UTF-8 (invalid bytes, if a model produced any, replaced).
        output: the exact output bytes.
        steps: chosen pieces (END not counted).
        ensembled_steps: steps whose distribution came from more than the gate member.
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


@dataclass
class _Seq:
    index: int
    states: list[SeqState]
    generator: torch.Generator | None
    output: bytearray = field(default_factory=bytearray)
    steps: int = 0
    ensembled: int = 0
    finished: str | None = None


class Ensemble:
    """Members with different tokenizers generating as one model.

    Args:
        members: the loaded members (their order fixes the order of ``member_ids`` only).
        method: a registered combiner name (``gac``).
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
        if gate is not None and gate not in names:
            raise ConfigError(f"gate: {gate!r} is not a member (members: {', '.join(names)})")
        if all(m.weight <= 0 for m in members):
            raise ConfigError("members.weight: at least one member needs a positive weight")
        self.gate = names.index(gate) if gate is not None else None
        self.threshold = threshold
        self.window = window
        self.parallel = parallel
        self._pool = ThreadPoolExecutor(max_workers=len(members), thread_name_prefix="member") if parallel else None
        self.union = union or build_union([m.codec for m in members], cache=align_cache)
        self.projector = Projector(self.union)
        self.timings = dict.fromkeys(STAGES, 0.0)

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
        seqs: list[_Seq] = []
        start_timings = dict(self.timings)
        t0 = time.perf_counter()
        for _ in self.steps(batch, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, chat=chat,
                            _seqs=seqs):
            pass
        timings = {k: self.timings[k] - start_timings[k] for k in STAGES}
        timings["total"] = time.perf_counter() - t0
        timings["other"] = timings["total"] - sum(timings[k] for k in STAGES)
        results = [self._result(s, timings) for s in seqs]
        for s in seqs:
            for m, st in zip(self.members, s.states):
                m.release(st)
        return results[0] if single else results

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               stop: Sequence[str] = (), chat: bool = False) -> Iterator[str]:
        """Text pieces as they become final: never a split UTF-8 character, never a stop string.

        The pieces concatenate to ``generate(...).text`` for the same arguments.
        """
        seqs: list[_Seq] = []
        stops = [s.encode("utf-8") for s in stop if s]
        emitted = 0
        for ev in self.steps([prompt], max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, chat=chat,
                             _seqs=seqs):
            out = bytes(seqs[0].output)
            end = len(out) if ev.finished else _safe_end(out, stops)
            if end > emitted:
                yield out[emitted:end].decode("utf-8", errors="replace")
                emitted = end
        for m, st in zip(self.members, seqs[0].states):
            m.release(st)

    # ------------------------------------------------------------------ the loop
    def steps(self, prompts: Sequence[Prompt], *, max_new_tokens: int, sampling: Sampling,
              stop: Sequence[str] = (), chat: bool = False, _seqs: list | None = None) -> Iterator[StepEvent]:
        """The decoding loop, one ``StepEvent`` per sequence per step."""
        seqs = [self._start(i, p, chat=chat, sampling=sampling) for i, p in enumerate(prompts)]
        if _seqs is not None:
            _seqs.extend(seqs)
        stops = [s.encode("utf-8") for s in stop if s]
        while active := [s for s in seqs if s.finished is None]:
            # 1. forward: the gate alone where it is confident, every weighted member elsewhere
            probs, ensembled = self._distributions(active)
            # 2. choose one union entry per sequence
            t = time.perf_counter()
            chosen = [choose(probs[r], sampling, s.generator) for r, s in enumerate(active)]
            self.timings["choose"] += time.perf_counter() - t
            for s, u, ens in zip(active, chosen, ensembled):
                # 3. append the piece, then check END, stop strings and the length limit
                before = len(s.output)
                piece = self.union.pieces[u] if u != END else b""
                if u == END:
                    s.finished = "end"
                else:
                    s.output += piece
                    s.steps += 1
                    s.ensembled += ens  # like ``steps``, END is not counted
                    if (cut := _find_stop(s.output, stops, before)) is not None:
                        del s.output[cut:]
                        s.finished = "stop"
                    elif s.steps >= max_new_tokens:
                        s.finished = "length"
                # 4. re-synchronise every member on the new output
                if s.finished in (None, "length"):
                    self._resync(s, u, before)
                elif s.finished == "stop":
                    self._resync_trimmed(s)
                yield StepEvent(s.index, piece if s.finished != "stop" else bytes(s.output[before:]), ens, s.finished)

    # ------------------------------------------------------------------ stages
    def _distributions(self, active: list[_Seq]) -> tuple[torch.Tensor, list[bool]]:
        weights = [m.weight for m in self.members]
        if self.gate is None:
            run = [i for i, w in enumerate(weights) if w > 0]
            lp = self._forward_many(run, active)
            projected = self._align(lp)
            t = time.perf_counter()
            q = self.combiner.combine([projected[i] for i in run], [weights[i] for i in run])
            self.timings["combine"] += time.perf_counter() - t
            return q, [len(run) > 1] * len(active)
        g = self.gate
        gate_lp = self._forward(g, active)
        confident = gate_lp.max(dim=-1).values.exp() > self.threshold
        rows = [r for r in range(len(active)) if not confident[r]]
        others = [i for i, w in enumerate(weights) if w > 0 and i != g] if rows else []
        lp = {g: gate_lp}
        lp.update(self._forward_many(others, [active[r] for r in rows]))
        projected = self._align(lp)
        q = projected[g]  # rows the gate decides alone; ensembled rows are overwritten below
        if rows and others:
            t = time.perf_counter()
            run = [g] + others if weights[g] > 0 else others
            parts = [projected[g][rows] if i == g else projected[i] for i in run]
            q[rows] = self.combiner.combine(parts, [weights[i] for i in run])
            self.timings["combine"] += time.perf_counter() - t
        return q, [not bool(c) and bool(others) for c in confident]

    def _forward_many(self, members: list[int], seqs: list[_Seq]) -> dict[int, torch.Tensor]:
        """Forward several members on the same sequences: one after another, or in threads
        (``parallel``; backends that release the GIL, such as llama.cpp, then overlap)."""
        if not members or not seqs:
            return {}
        if not self.parallel or len(members) == 1:
            return {i: self._forward(i, seqs) for i in members}
        t = time.perf_counter()
        futures = {i: self._pool.submit(self.members[i].next_logprobs, [s.states[i] for s in seqs]) for i in members}
        out = {i: f.result() for i, f in futures.items()}
        self.timings["forward"] += time.perf_counter() - t
        return out

    def _forward(self, i: int, seqs: list[_Seq]) -> torch.Tensor:
        t = time.perf_counter()
        out = self.members[i].next_logprobs([s.states[i] for s in seqs])
        self.timings["forward"] += time.perf_counter() - t
        return out

    def _align(self, logprobs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        t = time.perf_counter()
        out = {i: self.projector.project(i, lp) for i, lp in logprobs.items()}
        self.timings["align"] += time.perf_counter() - t
        return out

    def _resync(self, s: _Seq, u: int, before: int) -> None:
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

    def _resync_trimmed(self, s: _Seq) -> None:
        """After a stop string was cut off (possibly reaching into earlier pieces), make every
        member's ids decode to the trimmed output again, so ``member_ids`` keeps its contract."""
        t = time.perf_counter()
        out = bytes(s.output)
        for m, st in zip(self.members, s.states):
            _rollback(st, len(out))
            resync(m.codec, st, out, window=self.window)
        self.timings["resync"] += time.perf_counter() - t

    # ------------------------------------------------------------------ helpers
    def _start(self, index: int, prompt: Prompt, *, chat: bool, sampling: Sampling) -> _Seq:
        messages = [{"role": "user", "content": prompt}] if (chat and isinstance(prompt, str)) else prompt
        states = []
        for m in self.members:
            if isinstance(messages, str):
                ids = m.encode_prompt(messages)
            else:
                text, templated = m.render_chat(messages)
                ids = m.encode_prompt(text, templated=templated)
            states.append(m.new_state(ids))
        gen = None
        if not sampling.greedy:
            gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        return _Seq(index, states, gen)

    def _result(self, s: _Seq, timings: dict[str, float]) -> Generation:
        out = bytes(s.output)
        return Generation(
            text=out.decode("utf-8", errors="replace"),
            output=out,
            steps=s.steps,
            ensembled_steps=s.ensembled,
            finish_reason=s.finished or "length",
            member_ids={m.name: list(st.ids) for m, st in zip(self.members, s.states)},
            timings=timings,
        )


def _is_single(prompts) -> bool:
    if isinstance(prompts, str):
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


def _safe_end(out: bytes, stops: list[bytes]) -> int:
    """How much of ``out`` can be shown now: no unfinished character, no partial stop string."""
    end = len(out)
    for st in stops:
        for n in range(min(len(st) - 1, len(out)), 0, -1):
            if out.endswith(st[:n]):
                end = min(end, len(out) - n)
                break
    end -= _incomplete_tail(out[:end])
    return end
