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
import json
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfuse.config import EnsembleConfig, parse_config
from tokenfuse.engine.generate import Ensemble, Prompt, Seq, safe_end
from tokenfuse.engine.sampling import Sampling
from tokenfuse.errors import ConfigError, TokenfuseError

log = logging.getLogger("tokenfuse.server")


# ---------------------------------------------------------------------------- members' context

def context_length(member: Any) -> int | None:
    """A member's context length in its own tokens (``None``: unknown, not checked)."""
    m = getattr(member, "member", member)  # a re-weighted view: the member underneath
    for attr in ("context_length", "_n_ctx"):
        n = getattr(m, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    model_cfg = getattr(getattr(m, "model", None), "config", None)
    if model_cfg is not None:
        text = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
        n = getattr(text, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


class Reweighted:
    """A member seen with another weight: everything else (model, caches, codec) is the member's own,
    so sequences can move between ensembles that differ only in weights."""

    def __init__(self, member: Any, weight: float) -> None:
        self.member = member
        self.weight = float(weight)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.member, name)


def _base(member: Any) -> Any:
    return member.member if isinstance(member, Reweighted) else member


# ---------------------------------------------------------------------------- ensembles per option set

def config_of(ens: Ensemble) -> EnsembleConfig:
    """A config describing an already built ensemble (for servers built on in-memory members)."""
    params = {k: v for k, v in ens.combiner.describe().items() if k != "method"}
    names = [m.name for m in ens.members]
    return parse_config({
        "members": [{"name": m.name, "weight": m.weight} for m in ens.members],
        "method": ens.combiner.name, "params": params, "primary": names[ens.primary],
        "agreement_skip": ens.agreement_skip, "gate": names[ens.gate] if ens.gate is not None else None,
        "threshold": ens.threshold, "window": ens.window, "parallel": ens.parallel,
    }, origin="ensemble")


OPTION_KEYS = ("method", "params", "gate", "threshold", "primary", "agreement_skip", "weights")


class EnsemblePool:
    """``Ensemble`` objects per option set, all on the same loaded members and union.

    The base ensemble serves requests without options. Others are built on first use and kept
    (least recently used first out, only while no sequence runs on them) up to ``max_size``.
    """

    def __init__(self, base: Ensemble, cfg: EnsembleConfig | None = None, *, max_size: int = 8) -> None:
        self.base = base
        self.cfg = cfg or config_of(base)
        self.members = list(base.members)
        self.max_size = max_size
        self._cache: OrderedDict[str, Ensemble] = OrderedDict()
        self.in_use: dict[int, int] = {}

    @staticmethod
    def key(options: dict | None, down: frozenset[str] = frozenset()) -> str:
        return json.dumps([options or {}, sorted(down)], sort_keys=True)

    def get(self, options: dict | None = None, down: frozenset[str] = frozenset()) -> Ensemble:
        """The ensemble for per-request ``options`` with the members in ``down`` silenced (weight 0)."""
        if not options and not down:
            return self.base
        key = self.key(options, down)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ens = self._build(options or {}, down)
        self._cache[key] = ens
        for k in list(self._cache):
            if len(self._cache) <= self.max_size:
                break
            if not self.in_use.get(id(self._cache[k])):
                del self._cache[k]
        return ens

    def _build(self, options: dict, down: frozenset[str]) -> Ensemble:
        from tokenfuse.load import ensemble_from_members

        unknown = set(options) - set(OPTION_KEYS)
        if unknown:
            raise ConfigError(f"tokenfuse: unknown option(s) {', '.join(sorted(unknown))}; "
                              f"allowed: {', '.join(OPTION_KEYS)}")
        data = self.cfg.model_dump()
        for k in ("method", "gate", "threshold", "primary", "agreement_skip"):
            if k in options:
                data[k] = options[k]
        if "method" in options and options["method"] != self.cfg.method:
            data["params"] = {}  # another method's parameters do not carry over
        if options.get("params") is not None:
            data["params"] = {**data["params"], **options["params"]}
        names = [m.name for m in self.members]
        weights = [m.weight for m in self.members]
        w = options.get("weights")
        if isinstance(w, dict):
            bad = [n for n in w if n not in names]
            if bad:
                raise ConfigError(f"tokenfuse.weights: {', '.join(map(repr, bad))} not a member "
                                  f"(members: {', '.join(names)})")
            weights = [float(w.get(n, x)) for n, x in zip(names, weights)]
        elif isinstance(w, list):
            if len(w) != len(names):
                raise ConfigError(f"tokenfuse.weights: {len(w)} weights for {len(names)} members ({', '.join(names)})")
            weights = [float(x) for x in w]
        if any(x < 0 for x in weights):
            raise ConfigError("tokenfuse.weights: weights must be >= 0")
        for i, m in enumerate(data["members"]):
            m["weight"] = weights[i]
        cfg = parse_config(data, origin="tokenfuse")
        weights = [0.0 if n in down else x for n, x in zip(names, weights)]
        if all(x <= 0 for x in weights):
            raise ConfigError("no member with a positive weight is left"
                              + (f" (unavailable: {', '.join(sorted(down))})" if down else ""))
        members = [m if x == m.weight else Reweighted(_base(m), x) for m, x in zip(self.members, weights)]
        return ensemble_from_members(cfg, members, union=self.base.union)


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
    # owned by the scheduler thread
    ens: Ensemble | None = None
    seq: Seq | None = None
    emitted: int = 0
    skipped: set[str] = field(default_factory=set)
    truncated: int = 0  # prompt characters / messages dropped by left-truncation
    done: bool = False


class ContextError(TokenfuseError):
    """The prompt (plus ``max_tokens``) does not fit a member's context."""


class Scheduler:
    """The engine thread: admits, steps and retires sequences (see the module docstring).

    Args:
        pool: the ensembles.
        max_batch: running sequences at most (the rest wait in arrival order).
        max_queue: waiting sequences at most (``submit`` raises ``queue.Full`` beyond).
        on_member_failure: ``error`` (the affected requests fail) or ``skip`` (they go on without
            the unavailable member, and their responses name it).
    """

    def __init__(self, pool: EnsemblePool, *, max_batch: int = 16, max_queue: int = 256,
                 on_member_failure: str = "error") -> None:
        self.pool = pool
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

    def submit(self, jobs: Sequence[Job]) -> None:
        if self._inbox.qsize() + len(self._pending) + len(jobs) > self.max_queue:
            raise queue.Full
        self.start()
        for j in jobs:
            self._inbox.put(("submit", j))

    def cancel(self, jobs: Sequence[Job]) -> None:
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

    def _open(self, job: Job, down: frozenset[str] = frozenset()) -> None:
        job.ens = self.pool.get(job.options, down)
        prompt = job.prompt
        for _ in range(8):  # left-truncation may need a few rounds (re-tokenised edges)
            seq = job.ens.open(prompt, chat=job.chat, sampling=job.sampling, stop=job.stop,
                               max_new_tokens=job.max_new_tokens, index=job.index)
            over = self._overflow(job.ens, seq, job.max_new_tokens)
            if over is None:
                break
            job.ens.close(seq)
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
        else:
            raise ContextError("the prompt could not be truncated to fit every member's context")
        job.seq = seq
        self.pool.in_use[id(job.ens)] = self.pool.in_use.get(id(job.ens), 0) + 1

    @staticmethod
    def _overflow(ens: Ensemble, seq: Seq, max_new: int) -> tuple[str, int, int] | None:
        for m, st in zip(ens.members, seq.states):
            ctx = context_length(m)
            if ctx is not None and len(st.prompt_ids) + max_new > ctx:
                return m.name, len(st.prompt_ids) + max_new, ctx
        return None

    def _step(self, jobs: list[Job]) -> None:
        from tokenfuse.members.remote import MemberUnavailableError

        ens = jobs[0].ens
        try:
            events = ens.step([j.seq for j in jobs])
        except MemberUnavailableError as err:
            _quiesce(ens)
            if self.on_member_failure == "skip":
                for j in jobs:  # the step changed no sequence: go on without the member
                    self._move(j, err.member)
            else:
                for j in jobs:
                    self._fail(j, err)
            return
        except Exception as err:  # noqa: BLE001 - an engine failure fails its requests, not the server
            log.exception("step failed")
            _quiesce(ens)
            for j in jobs:
                self._fail(j, err)
            return
        self.steps += 1
        for j, ev in zip(jobs, events):
            s = j.seq
            if ev.finished is None and self._at_context_end(j):
                s.finished = "length"
            out = bytes(s.output)
            end = len(out) if s.finished else safe_end(out, s.stops)
            text = out[j.emitted:end].decode("utf-8", errors="replace") if end > j.emitted else ""
            j.emitted = max(j.emitted, end)
            if s.finished:
                g = ens.result(s)
                info = {
                    "prompt_tokens": {m.name: len(st.prompt_ids) for m, st in zip(ens.members, s.states)},
                    "primary": ens.members[ens.primary].name,
                    "completion_tokens": g.steps,
                    "ensembled_steps": g.ensembled_steps,
                    "skipped_steps": g.skipped_steps,
                    "finish": g.finish_reason,
                    "unavailable_members": sorted(j.skipped),
                    "truncated": j.truncated,
                }
                j.done = True
                self._retire(j)
                j.post(Update(j.index, text, "length" if s.finished == "length" else "stop", info=info))
            elif text:
                j.post(Update(j.index, text))

    def _at_context_end(self, job: Job) -> bool:
        """A member's cache is (nearly) full: end the sequence as ``length`` rather than overflow it."""
        for m, st in zip(job.ens.members, job.seq.states):
            ctx = context_length(m)
            if ctx is not None and st.length >= ctx - 1:
                return True
        return False

    def _move(self, job: Job, member: str) -> None:
        """Continue ``job`` on the ensemble without ``member`` (its weight 0: kept in sync, not run)."""
        down = frozenset(job.skipped | {member})
        try:
            ens = self.pool.get(job.options, down)
        except Exception as err:  # noqa: BLE001 - e.g. no member left
            self._fail(job, err)
            return
        self.pool.in_use[id(job.ens)] -= 1
        job.ens = ens
        job.skipped.add(member)
        self.pool.in_use[id(ens)] = self.pool.in_use.get(id(ens), 0) + 1

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
            self.pool.in_use[id(job.ens)] -= 1


def _quiesce(ens: Ensemble, timeout: float = 600.0) -> None:
    """Wait until none of ``ens``'s member threads is still running a forward pass.

    When one member raises inside a parallel step, the engine returns at once while the other
    members' forwards may still run in its pool; their sequences must not be closed (caches freed)
    or stepped again before they finish. One barrier task per pool thread can only all run once
    every earlier task is done.
    """
    pool = getattr(ens, "_pool", None)
    n = getattr(pool, "_max_workers", 0)
    if pool is None or not n:
        return
    barrier = threading.Barrier(n + 1)
    for _ in range(n):
        pool.submit(barrier.wait, timeout)
    try:
        barrier.wait(timeout)
    except threading.BrokenBarrierError:
        log.warning("member threads did not finish within %.0f s", timeout)


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


def now() -> int:
    return int(time.time())
