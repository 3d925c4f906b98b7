"""The member contract: one causal LM, its tokenizer and per-sequence state.

A member turns token ids into next-token log-probabilities. It knows nothing about the other
members: the engine keeps its ids in sync with the shared output bytes (``tokenfuse.engine.sync``)
and only tells it how much of its KV cache is still good, through ``SeqState``'s cache methods
(``drop_cache_after``, ``mark_cached``, ``reuse_cache``; ``snapshot``/``restore`` for speculative
rounds), which keep ``SeqState.n_valid``.

``Member`` is what every member provides, wherever it runs (in this process, behind an
OpenAI-compatible server, in a Ray actor). ``LocalMember`` adds the chunked forward of a model
whose weights are in this process (llama.cpp, transformers): a backend implements ``_forward``.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tokenfuse.errors import ConfigError, TokenfuseError
from tokenfuse.members.codec import ByteCodec
from tokenfuse.members.embeddings import EmbeddingRows
from tokenfuse.members.reading import Take, state_reader
from tokenfuse.members.state import SeqState, StateSnapshot, common_prefix

__all__ = ["LocalMember", "Member", "SeqState", "StateSnapshot", "common_prefix", "cpu_cores", "picked"]


class Member(ABC):
    """One causal LM of the ensemble: everything the engine, combiners and server may ask of it.

    Attributes:
        name: the member's name (unique in an ensemble).
        codec: exact bytes of its vocabulary and its bytes -> ids encoder.
        weight: its default ensemble weight (before normalisation), given at construction and never
            written afterwards: an ``Ensemble`` built without ``weights`` takes it. The weights an
            ensemble decides with are the ensemble's own (``Ensemble.weights``), as are the members'
            dev-set scores (``Ensemble.scores``), so one loaded member can serve several ensembles.
        tokenizer: the Hugging Face tokenizer (chat template, prompt encoding).
        context_length: its context in its own tokens (``None``: unknown, not checked).
        load_seconds: time it took to load.
        weight_bytes: the size of its weights in this process, in bytes (``None``: unknown); the
            smallest is the default speculative drafter.
    """

    name: str
    codec: ByteCodec
    weight: float = 1.0
    tokenizer: Any
    context_length: int | None = None
    load_seconds: float = 0.0
    in_process: bool = False  # its weights are in this process (``LocalMember``): logits at any position, cores to share
    weight_bytes: int | None = None  # the size of its weights in this process (None: unknown or elsewhere)
    unloaded: bool = False  # ``unload`` ran: its model is freed and using it raises ``TokenfuseError``
    scores_together: bool = False  # ``logprobs_at_many`` forwards the sequences together (scoring batches them)

    # ------------------------------------------------------------------ prompts
    @property
    def has_chat_template(self) -> bool:
        """Whether its tokenizer has a chat template (``render_chat`` uses it)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: Sequence[dict]) -> tuple[str, bool]:
        """The member's own rendering of chat ``messages`` and whether it came from a chat template.

        A member without a chat template gets a plain rendering: each message as
        ``"{Role}: {content}\\n\\n"`` followed by ``"Assistant:"``.
        """
        if self.has_chat_template:
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
            return text, True
        return plain_chat(messages), False

    def encode_prompt(self, text: str, *, templated: bool = False) -> list[int]:
        """Ids of a prompt: special-token strings are parsed; BOS is added unless a template wrote it."""
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if templated and bos is not None and len(ids) > 1 and ids[0] == bos == ids[1]:
            ids = ids[1:]  # a template that writes BOS plus a tokenizer that adds one
        if not ids:  # an empty prompt: the model still needs one position to predict from
            start = bos if bos is not None else getattr(self.tokenizer, "eos_token_id", None)
            if start is None:
                raise ConfigError(f"member {self.name!r}: empty prompt and the tokenizer has no BOS or EOS token")
            ids = [start]
        return list(ids)

    def ids_for_prompt(self, prompt: str | Sequence[dict], *, chat: bool = False, raw: str | None = None) -> list[int]:
        """Its ids for a prompt: text as is (or, with ``chat``, as one user message), messages through its
        own chat template; without one, ``raw`` (a two-form prompt's base-model text) when given,
        else the plain rendering (``render_chat``)."""
        messages = [{"role": "user", "content": prompt}] if (chat and isinstance(prompt, str)) else prompt
        if isinstance(messages, str):
            return self.encode_prompt(messages)
        text, templated = self.render_chat(messages)
        if raw is not None and not templated:
            text = raw
        return self.encode_prompt(text, templated=templated)

    def prompt_token_count(self, prompt: str | Sequence[dict], *, chat: bool = False, raw: str | None = None) -> int:
        """How many ids the prompt takes in its context (``ids_for_prompt``'s, without opening a sequence)."""
        return len(self.ids_for_prompt(prompt, chat=chat, raw=raw))

    # ------------------------------------------------------------------ state and compute
    def new_state(self, prompt_ids: Sequence[int]) -> SeqState:
        self.check_loaded()
        return SeqState(prompt_ids=list(prompt_ids))

    def reader(self, start: Sequence[int], *, shared: bool = True) -> contextlib.AbstractContextManager[Take]:
        """A context manager yielding the member's ``take(lists, ids)`` (``members.reading.Take``): the
        natural-log probabilities (float64 arrays) of ``ids[j]`` after ``lists[j]`` (each ``start``
        first; ``None``: the whole row), for many reads along one text (a byte model's histories). By
        default on sequence states after ``start`` kept across calls (``reading.state_reader``); with
        ``shared``, a backend may read branches off one longer list in shared calls of its own
        (llama.cpp's tree reader), whose numbers depend on how the calls are made up."""
        self.check_loaded()
        return state_reader(self, start)

    @abstractmethod
    def next_logprobs(self, states: Sequence[SeqState]) -> torch.Tensor:
        """Log-probabilities of the next token for each state, ``float32[B, V]``, after feeding every
        pending id (the cache cropped to ``n_valid`` first)."""

    @abstractmethod
    def next_topk(self, states: Sequence[SeqState], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens per state: ``(logprobs float32[B, k], ids int64[B, k])``,
        most likely first.

        This and ``token_logprobs`` are all a top-k combiner (UniTE) asks of a member, so a member
        that only exposes top-k log-probabilities (a remote server) can serve top-k methods.
        """

    @abstractmethod
    def token_logprobs(self, states: Sequence[SeqState], ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the named next-token ``ids`` (``int64[B, n]``) after ``next_topk`` or
        ``next_logprobs`` ran on the same states; returns ``float32[B, n]``."""

    def share_cores(self, n: int) -> None:
        """The number of CPU cores its next forward calls may use (the member pool's share: all cores
        when it runs alone, fewer when members run side by side). A backend whose thread count is
        fixed, or that does not compute in this process, ignores it; numbers must not depend on it."""

    def release(self, state: SeqState) -> None:
        """Free a finished sequence's cache (after ``unload`` too: nothing is left to free then)."""
        state.cache = None
        state.logprobs = None

    # ------------------------------------------------------------------ lifetime
    def unload(self) -> None:
        """Free its model and every sequence's cache now, not whenever the garbage collector (or the
        interpreter's exit) gets to them; safe to call twice. Using the member afterwards raises
        ``TokenfuseError``. A model shared with other members (a self-ensemble's copies) is freed with
        the last of them."""
        if not self.unloaded:
            self.unloaded = True
            self._unload()

    def _unload(self) -> None:
        """What ``unload`` frees, once (a backend's part); by default nothing."""

    def check_loaded(self) -> None:
        """Raise ``TokenfuseError`` if the member was unloaded."""
        if self.unloaded:
            raise TokenfuseError(f"member {self.name!r} was unloaded (Ensemble.unload, or the end of a `with` "
                                 "block on its ensemble): load the ensemble again to use it")

    # ------------------------------------------------------------------ weights
    def embedding_rows(self) -> EmbeddingRows:
        """Row-by-row access to its input embeddings (what DeePEn reads), without copying the table.

        Only members whose weights are in this process have them; the others raise ``TokenfuseError``.
        """
        raise TokenfuseError(
            f"member {self.name!r} ({type(self).__name__}) has no input embeddings in this process: DeePEn needs "
            "local weights (backend llamacpp or transformers with placement: local); use another method")

    def input_embeddings(self) -> torch.Tensor:
        """Its input-embedding table, ``float32[V_i, d]`` on the CPU (transformers: the model's own
        tensor when it already is that: read it, never write it)."""
        return self.embedding_rows().all()


class LocalMember(Member):
    """A member whose model runs in this process: one chunked forward per sequence that needs it.

    A backend implements ``_forward`` (and may batch in ``_forward_batch``); the last result of each
    state is kept in ``SeqState.logprobs`` for ``next_topk`` and ``token_logprobs``.
    """

    in_process = True

    def next_logprobs(self, states: Sequence[SeqState]) -> torch.Tensor:
        """Log-probabilities of the next token for each state, ``float32[B, V]``.

        Feeds every pending id (one chunked forward per state), after cropping the cache to
        ``n_valid``. A state with nothing pending reuses its last result.
        """
        self.check_loaded()
        todo = [st for st in states if st.stale]
        for st in todo:
            if st.pending == 0:  # the cache is complete but its last logits are gone: refeed one id
                st.drop_cache_after(st.length - 1)
        if todo:
            for st, lp in zip(todo, self._forward_batch(todo)):
                st.logprobs, st.logprobs_len = lp, st.length
                st.mark_cached()
        return torch.stack([st.logprobs for st in states])

    def next_topk(self, states: Sequence[SeqState], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = self.next_logprobs(states)
        return torch.topk(lp, min(k, lp.shape[-1]), dim=-1)

    def token_logprobs(self, states: Sequence[SeqState], ids: torch.Tensor) -> torch.Tensor:
        return kept_logprobs(states, ids)

    def logprobs_at(self, st: SeqState, ends: Sequence[int], *, pick: Sequence[Sequence[int]] | None = None
                    ) -> torch.Tensor:
        """Next-token log-probabilities after the first ``L`` ids of ``st.all_ids()`` for each ``L`` in
        ``ends`` (increasing, each ``> st.n_valid`` and ``<= st.length``): ``float32[len(ends), V]``.

        The backend feeds every pending id in one chunked forward that keeps the logits of those
        positions (``_forward_at``); the cache then holds the whole sequence. The numbers are those
        of feeding the ids piece by piece wherever the backend's kernels do not depend on how a
        sequence is split into calls (see docs/evaluation.md, "One-forward scoring").

        ``pick`` (one list of ``k`` ids per end; ``ends`` strictly increasing): only those entries of
        each row, ``float32[len(ends), k]``, taken from each row where the backend computes it (no
        whole row is kept or stacked: a 262k-entry vocabulary makes that the cost of scoring); the
        same numbers as the whole rows' entries, bit for bit (a list of rows when the lists' sizes differ).
        """
        return self.logprobs_at_many([st], [ends], picks=None if pick is None else [pick])[0]

    def logprobs_at_many(self, states: Sequence[SeqState], ends: Sequence[Sequence[int]], *,
                         picks: Sequence[Sequence[Sequence[int]]] | None = None) -> list[torch.Tensor]:
        """``logprobs_at`` for several sequences at once (``ends[r]`` for ``states[r]``, distinct
        states; ``picks[r]`` its ``pick``): a backend that batches forwards them together
        (``_forward_at_many``), as a step batches ``next_logprobs`` — speculative verification of
        many sequences."""
        self.check_loaded()
        ends = [list(e) for e in ends]
        for r, (st, e) in enumerate(zip(states, ends)):
            if not e or e != sorted(e) or e[0] <= st.n_valid or e[-1] > st.length:
                raise ValueError(f"logprobs_at: ends {e} must increase within ({st.n_valid}, {st.length}]")
            if picks is not None and (len(set(e)) < len(e) or len(picks[r]) != len(e)):
                raise ValueError("logprobs_at: with pick, ends must strictly increase and each have its ids")
        picks = None if picks is None else [[torch.as_tensor(ids, dtype=torch.long) for ids in p] for p in picks]
        out = []
        for st, e, rows in zip(states, ends, self._forward_at_many(list(states), ends, picks=picks)):
            st.mark_cached()
            if picks is None and e[-1] == st.length:
                st.logprobs, st.logprobs_len = rows[-1], st.length
            out.append(torch.stack(rows) if len({len(r) for r in rows}) == 1 else list(rows))
        return out

    def _forward_at_many(self, states: list[SeqState], ends: list[list[int]], *,
                         picks: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """``logprobs_at_many``'s rows (each gathered by its ``picks`` entry when given); by default
        ``_forward_at`` for one state after another."""
        return [self._forward_at(st, e, pick=pick) for st, e, pick in zip(states, ends, picks or [None] * len(states))]

    def _forward_batch(self, states: list[SeqState]) -> list[torch.Tensor]:
        """Forward the states that need it; by default one chunked forward each."""
        return [self._forward(st) for st in states]

    @abstractmethod
    def _forward(self, state: SeqState) -> torch.Tensor:
        """Crop the cache to ``state.n_valid``, feed the rest, return ``float32[V]`` log-probs."""

    def _forward_at(self, st: SeqState, ends: list[int], *, pick: list[torch.Tensor] | None = None
                    ) -> list[torch.Tensor]:
        """``logprobs_at``'s rows (``pick``: each gathered). By default one ``_forward`` per position
        (a backend that can keep several positions' logits in one forward overrides this)."""
        prompt, ids, full = st.prompt_ids, st.ids, st.all_ids()
        rows = []
        try:
            for k, n in enumerate(ends):
                st.prompt_ids, st.ids = full[:n], []
                rows.append(picked(self._forward_batch([st])[0], pick, k))
                st.mark_cached()  # its ids are ``full[:n]`` now
        finally:
            st.prompt_ids, st.ids = prompt, ids
        if ends[-1] < len(full):  # feed the rest too: the cache holds the whole sequence afterwards
            self._forward_batch([st])
        return rows


def picked(row: torch.Tensor, pick: list[torch.Tensor] | None, k: int) -> torch.Tensor:
    """The ``k``-th row of a ``logprobs_at`` call as it is returned: whole, or its ``pick[k]`` entries."""
    return row if pick is None else row[pick[k]]


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def kept_logprobs(states: Sequence[SeqState], ids: torch.Tensor) -> torch.Tensor:
    """``float32[B, n]``: the log-probabilities of ``ids`` in each state's kept ``logprobs``
    (ids past the vocabulary read its last entry)."""
    return torch.stack([st.logprobs[row.clamp(0, st.logprobs.shape[-1] - 1)] for st, row in zip(states, ids)])


def plain_chat(messages: Sequence[dict]) -> str:
    """The documented rendering for members without a chat template."""
    parts = [f"{str(m.get('role', 'user')).capitalize()}: {m.get('content', '')}\n\n" for m in messages]
    return "".join(parts) + "Assistant:"


class Shared:
    """Something several members use (a llama.cpp model, a Ray placement group), freed by ``free``
    when the last of them lets go: each member ``take``s it once and ``drop``s it once (in ``unload``)."""

    def __init__(self, free: Callable[[], None]) -> None:
        self._free = free
        self.users = 0

    def take(self) -> Shared:
        self.users += 1
        return self

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0:
            self._free()

