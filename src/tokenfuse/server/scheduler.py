"""Step-level batching: one thread owns the engine and steps every running sequence together.

The engine is not thread-safe, so every ``open`` / ``step`` / ``close`` happens on the scheduler
thread. Requests arrive through a queue (``submit`` / ``cancel`` are safe from any thread) and
their text comes back to the asyncio side through ``loop.call_soon_threadsafe``. Between two steps
new sequences join (up to ``max_batch``) and finished or cancelled ones leave, so a client that
disconnects stops its sequence within one step.

Sequences with different ensemble options run on different ``Ensemble`` objects that share the
loaded members and the union vocabulary (``EnsemblePool``); one step batches only sequences of the
same ``Ensemble``, and every ensemble with running sequences takes one step per round.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenfuse.engine import Ensemble, Prompt, OpenSequence
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.trace import PromptPiece, TraceOptions, TraceStep
from tokenfuse.errors import MemberUnavailableError, TokenfuseError
from tokenfuse.server.ensembles import EnsemblePool

log = logging.getLogger("tokenfuse.server")


# ---------------------------------------------------------------------------- requests

@dataclass
class Update:
    """What the scheduler sends back for one sequence: new text, and at the end the summary."""

    index: int
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" once finished
    error: BaseException | None = None
    info: dict | None = None  # at the end: token counts, steps, skipped members
    opened: bool = False  # the sequence was admitted (its prompt fits): generation starts
    steps: list[TraceStep] | None = None  # a traced job: the steps of ``text`` (their texts make it up)


@dataclass(eq=False)
class Job:
    """One sequence to generate (one choice of one request)."""

    prompt: Prompt
    chat: bool
    sampling: Sampling
    stop: list[str]
    max_new_tokens: int
    index: int
    options: dict | None
    post: Callable[[Update], None]
    truncate: bool = False
    trace: TraceOptions | None = None  # record the steps (for the trace or log-probabilities)
    score_prompt: int | None = None  # echo + logprobs: score the prompt's pieces with this many alternatives
    # owned by the scheduler thread (``prompt_logprobs`` is set before the ``opened`` update)
    prompt_logprobs: list[PromptPiece] | None = None
    ens: Ensemble | None = None
    seq: OpenSequence | None = None
    skipped: set[str] = field(default_factory=set)
    truncated: int = 0  # prompt characters / messages dropped by left-truncation
    done: bool = False


class ContextError(TokenfuseError):
    """The prompt (plus ``max_tokens``) does not fit a member's context."""


class Scheduler:
    """The engine thread: admits, steps and retires sequences (see the module docstring).

    Args:
        ensembles: the ensembles per option set (``EnsemblePool``), on the same loaded members.
        max_batch: running sequences at most (the rest wait in arrival order).
        max_queue: waiting sequences at most (``submit`` raises ``queue.Full`` beyond).
        on_member_failure: ``error`` (the affected requests fail) or ``skip`` (they go on without
            the unavailable member, and their responses name it).
    """

    def __init__(self, ensembles: EnsemblePool, *, max_batch: int = 16, max_queue: int = 256,
                 on_member_failure: str = "error") -> None:
        self.ensembles = ensembles
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.on_member_failure = on_member_failure
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stop = False
        self.steps = 0  # engine steps taken (all ensembles), for tests and stats
        self.closed = 0  # sequences closed (finished, cancelled or failed)

    # -------------------------------------------------------------- any thread
    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._run, name="tokenfuse-scheduler", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        if self._inbox.qsize() + len(self._pending) + len(jobs) > self.max_queue:
            raise queue.Full
        self.start()
        for j in jobs:
            self._inbox.put(("submit", j))

    def cancel(self, jobs: Iterable[Job]) -> None:
        """Stop these jobs (a client went away); their sequences are closed before the next step."""
        for j in jobs:
            self._inbox.put(("cancel", j))

    @property
    def active(self) -> int:
        return len(self._active)

    # -------------------------------------------------------------- scheduler thread
    def _run(self) -> None:
        while not self._stop:
            self._intake(block=not self._active and not self._pending)
            self._admit()
            groups: dict[int, list[Job]] = {}
            for j in self._active:
                groups.setdefault(id(j.ens), []).append(j)
            for jobs in groups.values():
                self._step(jobs)

    def _intake(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, job = item
            if kind == "submit":
                self._pending.append(job)
            elif kind == "cancel" and not job.done:
                job.done = True
                if job in self._active:
                    self._retire(job)
                elif job in self._pending:
                    self._pending.remove(job)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        while self._pending and len(self._active) < self.max_batch:
            job = self._pending.popleft()
            if job.done:
                continue
            try:
                self._open(job)
            except Exception as err:  # noqa: BLE001 - reported to the client
                self._fail(job, err)
                continue
            self._active.append(job)
            job.post(Update(job.index, opened=True))
            if job.seq.finished:  # max_tokens 0: nothing to generate
                self._finish(job, "")

    def _open(self, job: Job, down: frozenset[str] = frozenset()) -> None:
        job.ens = self.ensembles.get(job.options, down)
        prompt = self._fit(job)
        seq = job.ens.open(prompt, chat=job.chat, sampling=job.sampling, stop=job.stop,
                           max_new_tokens=job.max_new_tokens, index=job.index, trace=job.trace)
        if job.score_prompt is not None:
            try:
                job.prompt_logprobs = job.ens.score_prompt(prompt, top=job.score_prompt)
            except BaseException:
                job.ens.close(seq)
                raise
        job.seq = seq
        self.ensembles.acquire(job.ens)

    def _fit(self, job: Job) -> Prompt:
        """``job``'s prompt as it fits every member's context with ``max_new_tokens`` (the members count
        its ids: no sequence is opened), left-truncated when ``job.truncate``; else ``ContextError``."""
        prompt = job.prompt
        for _ in range(8):  # left-truncation may need a few rounds (re-tokenised edges)
            over = self._overflow(job.ens, job.ens.prompt_token_counts(prompt, chat=job.chat), job.max_new_tokens)
            if over is None:
                return prompt
            name, need, ctx = over
            if not job.truncate:
                raise ContextError(
                    f"this request needs {need} tokens of member {name!r} (prompt plus max_tokens), "
                    f"more than its context of {ctx}; shorten the prompt or lower max_tokens")
            room = ctx - job.max_new_tokens  # tokens the prompt may keep
            if room < 2:
                raise ContextError(f"max_tokens={job.max_new_tokens} alone fills member {name!r}'s context of {ctx}")
            prompt = _truncate(prompt, job.chat, fraction=min(0.9, room / (need - job.max_new_tokens) * 0.95))
            job.truncated += 1
            if not prompt:
                raise ContextError(f"the prompt cannot be truncated to fit member {name!r}'s context of {ctx}")
        raise ContextError("the prompt could not be truncated to fit every member's context")

    @staticmethod
    def _overflow(ens: Ensemble, counts: list[int], max_new: int) -> tuple[str, int, int] | None:
        """The first member whose context ``counts`` prompt ids plus ``max_new`` overflow: its name, the
        tokens needed and its context; ``None`` if they fit every member."""
        for m, n in zip(ens.members, counts):
            ctx = m.context_length
            if ctx is not None and n + max_new > ctx:
                return m.name, n + max_new, ctx
        return None

    def _step(self, jobs: list[Job]) -> None:
        ens = jobs[0].ens
        try:
            ens.step([j.seq for j in jobs])  # one event per sequence, or several (speculative decoding)
        except MemberUnavailableError as err:
            ens.pool.quiesce()
            if self.on_member_failure == "skip":
                for j in jobs:  # the step changed no sequence: go on without the member
                    self._move(j, err.member)
            else:
                for j in jobs:
                    self._fail(j, err)
            return
        except Exception as err:  # noqa: BLE001 - an engine failure fails its requests, not the server
            log.exception("step failed")
            ens.pool.quiesce()
            for j in jobs:
                self._fail(j, err)
            return
        self.steps += 1
        for j in jobs:
            s = j.seq
            if s.finished is None and self._at_context_end(j):
                s.finish("length")
            steps = s.take_steps() if s.trace is not None else None
            text = "".join(st.text for st in steps) if steps is not None else s.take_text()
            if s.finished:
                self._finish(j, text, steps)
            elif text or steps:
                j.post(Update(j.index, text, steps=steps))

    def _finish(self, job: Job, text: str, steps: list[TraceStep] | None = None) -> None:
        """Retire a finished job and send its last text (and steps) with the summary."""
        s, ens = job.seq, job.ens
        g = s.result()
        info = {
            "prompt_tokens": {m.name: len(st.prompt_ids) for m, st in zip(ens.members, s.states)},
            "primary": ens.members[ens.primary].name,
            "completion_tokens": g.steps,
            "ensembled_steps": g.ensembled_steps,
            "skipped_steps": g.skipped_steps,
            "finish": g.finish_reason,
            "unavailable_members": sorted(job.skipped),
            "truncated": job.truncated,
        }
        job.done = True
        self._retire(job)
        job.post(Update(job.index, text, "length" if s.finished == "length" else "stop", info=info,
                        steps=steps if steps is not None or s.trace is None else []))

    def _at_context_end(self, job: Job) -> bool:
        """A member's cache is (nearly) full: end the sequence as ``length`` rather than overflow it."""
        for m, st in zip(job.ens.members, job.seq.states):
            ctx = m.context_length
            if ctx is not None and st.length >= ctx - 1:
                return True
        return False

    def _move(self, job: Job, member: str) -> None:
        """Continue ``job`` on the ensemble without ``member`` (its weight 0: kept in sync, not run)."""
        down = frozenset(job.skipped | {member})
        try:
            ens = self.ensembles.get(job.options, down)
        except Exception as err:  # noqa: BLE001 - e.g. no member left
            self._fail(job, err)
            return
        self.ensembles.release(job.ens)
        job.ens = ens
        job.skipped.add(member)
        self.ensembles.acquire(ens)

    def _fail(self, job: Job, err: BaseException) -> None:
        job.done = True
        if job in self._active:
            self._retire(job)
        job.post(Update(job.index, error=err))

    def _retire(self, job: Job) -> None:
        self._active.remove(job)
        if job.seq is not None:
            job.ens.close(job.seq)
            self.closed += 1
            self.ensembles.release(job.ens)


def _truncate(prompt: Prompt, chat: bool, *, fraction: float) -> Prompt:
    """Drop the start of a prompt, keeping about ``fraction`` of it: the oldest characters of a text
    prompt, or the oldest non-system messages of a conversation (the last message stays)."""
    if isinstance(prompt, str):
        keep = int(len(prompt) * fraction)
        return prompt[len(prompt) - keep:] if keep > 0 else ""
    msgs = list(prompt)
    system = [m for m in msgs[:1] if m.get("role") == "system"]
    rest = msgs[len(system):]
    if len(rest) <= 1:
        raise ContextError("the last message alone does not fit a member's context")
    return system + rest[1:]


def make_poster(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[Update], None]:
    """``post(update)`` for the scheduler thread: puts the update on an asyncio queue."""

    def post(update: Update) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, update)
        except RuntimeError:  # the event loop is gone: nobody is listening
            pass

    return post

