"""Member backend: a model behind an OpenAI-compatible server (``backend: openai``).

vLLM, SGLang, llama.cpp's server and llama-cpp-python's ``python -m llama_cpp.server`` answer
``POST /v1/completions`` with ``max_tokens: 1, logprobs: k, temperature: 0``: the next token's
``k`` most likely tokens and their log-probabilities. That is all a top-k combiner (UniTE) asks of
a member. The server's prefix cache keeps each step close to one decode.

The member's tokenizer is loaded locally (``tokenizer``: a bundled model name or a directory with
tokenizer.json; default ``source``), because byte alignment needs every id's exact bytes.

Choices, and where they are approximate:

* Prompt: token ids where the server accepts them (vLLM, SGLang), else text (llama-cpp-python's
  server accepts only strings): the prompt as the user gave it plus the output bytes so far.
  ``prompt_format: auto`` tries ids once and falls back to text for good. With text the server
  tokenises prompt + output itself, which can differ from this member's ids at the boundary.
* Mapping the answer back to ids: with vLLM's ``return_tokens_as_token_ids`` (always requested)
  the keys are ``token_id:N`` and exact. Otherwise the keys are token *strings* decoded with
  ``errors="ignore"``; each is matched to the id whose bytes decode to exactly that string
  (a valid-UTF-8 token first, then the lowest id). The empty string is what end-of-sequence and
  other special tokens, and partial UTF-8 byte tokens, look like: it is taken as END.
* End of sequence: a server stops *before* reporting log-probabilities when its greedy token is
  EOS, so every END id gets ``logit_bias: -100`` in the request; servers compute the reported
  log-probabilities before applying the bias, so END keeps its real probability in the top-k.
* Ids outside the returned top-k (``token_logprobs``): the mass the top-k leaves, spread evenly
  over the rest of the vocabulary (never above the k-th log-probability). No second request.
* Full-distribution methods (GaC) need every id: with ``topk_fill: uniform`` ``next_logprobs``
  returns that same distribution (top-k exact, the rest even); the default is a clear error.

Timeouts and retries (with backoff) per request; a member that still fails raises
``MemberUnavailableError``. After a failure the member fails fast for ``cooldown`` seconds, so a
server configured to go on without it (``on_member_failure: skip``) does not wait on every step.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenfuse.errors import ConfigError, MemberUnavailableError, ModelLoadError, TokenfuseError
from tokenfuse.members.base import Member, SeqState
from tokenfuse.members.codec import load_or_build_codec


@dataclass
class _Top:
    """The server's last answer for one sequence: log-probabilities of the ids it named."""

    length: int
    logprobs: dict[int, float]
    floor: float  # log-probability given to every id it did not name


@dataclass
class _Remote:
    """A sequence's state on this side: its prompt text (for text-prompt servers) and last answer."""

    prompt_text: str | None
    top: _Top | None = None


class RemoteMember(Member):
    """A member served by an OpenAI-compatible server, driven through next-token top-k.

    Args:
        name, tokenizer, weight: as for every member (``tokenizer`` is local).
        base_url: the server's API root, e.g. ``http://127.0.0.1:8080/v1``.
        model: the server's model id.
        top_k: log-probabilities asked per step (at least the combiner's ``k``).
        prompt_format: ``auto`` | ``ids`` | ``text`` (see the module docstring).
        topk_fill: ``error`` | ``uniform`` (full distributions for GaC; module docstring).
        context_length: the server's context in its tokens (``None``: unknown, not checked).
    """

    def __init__(self, name: str, tokenizer: Any, *, base_url: str, model: str, api_key: str | None = None,
                 weight: float = 1.0, top_k: int = 20, timeout: float = 30.0, retries: int = 2,
                 prompt_format: str = "auto", topk_fill: str = "error", context_length: int | None = None,
                 cooldown: float = 5.0, align_cache: Path | None = None, client: Any = None) -> None:
        import httpx

        self.name = name
        self.tokenizer = tokenizer
        self.weight = float(weight)
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.top_k = top_k
        self.retries = retries
        self.prompt_format = prompt_format
        self.topk_fill = topk_fill
        self.context_length = context_length
        self.cooldown = cooldown
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._own_client = client is None  # unload closes only a client it made
        self.client = client or httpx.Client(timeout=timeout, headers=headers)
        self.codec = load_or_build_codec(tokenizer, vocab_size=len(tokenizer), cache=align_cache)
        self.vocab_size = len(self.codec.token_bytes)
        self._by_text = self._string_table()
        self._end = min(self.codec.end_ids) if self.codec.end_ids else None
        self._texts: OrderedDict[tuple, str] = OrderedDict()
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"remote-{name}")
        self.requests = 0  # HTTP requests sent (stats)

    def _string_table(self) -> dict[str, int]:
        """Token string as a server prints it (bytes decoded with errors="ignore") -> id.

        A token whose bytes are valid UTF-8 wins over one that only looks the same once invalid
        bytes are dropped; among equals the lowest id wins.
        """
        table: dict[str, tuple[int, int]] = {}
        for i, b in enumerate(self.codec.token_bytes):
            if b is None:
                continue
            try:
                s, rank = b.decode("utf-8"), 0
            except UnicodeDecodeError:
                s, rank = b.decode("utf-8", errors="ignore"), 1
            if s and (s not in table or (rank, i) < table[s]):
                table[s] = (rank, i)
        return {s: i for s, (_, i) in table.items()}

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, text: str, *, templated: bool = False) -> list[int]:
        ids = super().encode_prompt(text, templated=templated)
        self._texts[tuple(ids)] = text  # the text goes to text-prompt servers as the user wrote it
        while len(self._texts) > 256:
            self._texts.popitem(last=False)
        return ids

    def new_state(self, prompt_ids: Sequence[int]) -> SeqState:
        st = super().new_state(prompt_ids)
        st.cache = _Remote(self._texts.pop(tuple(prompt_ids), None))
        return st

    def _prompt_text(self, st: SeqState) -> str:
        r: _Remote = st.cache
        if r.prompt_text is None:
            ids = st.prompt_ids
            if ids and ids[0] == getattr(self.tokenizer, "bos_token_id", None):
                ids = ids[1:]  # the server adds its own BOS
            r.prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        out = self.codec.decode(st.ids)
        return r.prompt_text + out.decode("utf-8", errors="ignore")

    # ------------------------------------------------------------------ the member contract
    def next_topk(self, states: Sequence[SeqState], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tops = self._tops(states)
        n = min(k, self.top_k)
        lp = torch.full((len(states), n), -math.inf)
        ids = torch.zeros((len(states), n), dtype=torch.int64)
        for r, top in enumerate(tops):
            best = sorted(top.logprobs.items(), key=lambda kv: -kv[1])[:n]
            for c, (tid, v) in enumerate(best):
                ids[r, c], lp[r, c] = tid, v
            if len(best) < n:  # fewer usable answers than asked: pad with the first id, probability 0
                ids[r, len(best):] = best[0][0]
        return lp, ids

    def token_logprobs(self, states: Sequence[SeqState], ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.shape, dtype=torch.float32)
        for r, st in enumerate(states):
            top = st.cache.top
            if top is None:
                raise TokenfuseError(f"member {self.name!r}: token_logprobs before next_topk")
            for c, tid in enumerate(ids[r].tolist()):
                out[r, c] = top.logprobs.get(tid, top.floor)
        return out

    def next_logprobs(self, states: Sequence[SeqState]) -> torch.Tensor:
        if self.topk_fill != "uniform":
            raise ConfigError(
                f"member {self.name!r} (backend openai) has only top-k log-probabilities; use a top-k method "
                "(method: unite), or set `topk_fill: uniform` on the member to give full-distribution "
                "methods the top-k with the remaining mass spread evenly")
        tops = self._tops(states)
        out = torch.empty((len(states), self.vocab_size))
        for r, top in enumerate(tops):
            out[r].fill_(top.floor)
            for tid, v in top.logprobs.items():
                out[r, tid] = v
            out[r] = torch.log_softmax(out[r], dim=-1)  # exactly normalised
        return out

    def release(self, state: SeqState) -> None:
        if isinstance(state.cache, _Remote):
            state.cache.top = None
        state.logprobs = None

    def _unload(self) -> None:
        """Stop its request threads and close its HTTP client (one it was given stays open)."""
        self._pool.shutdown(wait=True)
        if self._own_client:
            self.client.close()

    # ------------------------------------------------------------------ requests
    def _tops(self, states: Sequence[SeqState]) -> list[_Top]:
        """Each state's top-k answer for its current ids (one request per state that changed)."""
        self.check_loaded()
        todo = [st for st in states if _stale(st)]
        if len(todo) > 1:
            results = list(self._pool.map(self._ask, todo))
        else:
            results = [self._ask(st) for st in todo]
        for st, top in zip(todo, results):
            st.cache.top = top
            st.mark_cached()  # nothing is pending any more (the server holds the prefix)
        return [st.cache.top for st in states]

    def _ask(self, st: SeqState) -> _Top:
        if time.monotonic() < self._down_until:
            raise MemberUnavailableError(self.name, f"{self.url} failed recently; retrying after the cool-down")
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": 1, "temperature": 0, "logprobs": self.top_k, "echo": False,
            "return_tokens_as_token_ids": True,
        }
        if self.codec.end_ids:
            body["logit_bias"] = {str(i): -100 for i in sorted(self.codec.end_ids)}
        fmt = self.prompt_format
        if fmt in ("auto", "ids"):
            body["prompt"] = st.all_ids()
            try:
                return self._parse(self._post(body), st)
            except _Rejected as err:
                if fmt == "ids":
                    raise MemberUnavailableError(self.name, f"the server rejected a token-id prompt: {err}") from None
                self.prompt_format = fmt = "text"  # e.g. llama-cpp-python: strings only
        body["prompt"] = self._prompt_text(st)
        try:
            return self._parse(self._post(body), st)
        except _Rejected as err:
            raise MemberUnavailableError(self.name, f"the server rejected the request: {err}") from None

    def _post(self, body: dict) -> dict:
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0, 0.25 * 2 ** (attempt - 1)))
            try:
                self.requests += 1
                r = self.client.post(self.url, json=body)
            except httpx.HTTPError as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                if body.get("prompt") and isinstance(body["prompt"], list) and r.status_code == 500 \
                        and "valid string" in r.text:
                    raise _Rejected(r.text[:300])  # llama-cpp-python answers a token-id prompt with a 500
                last = f"HTTP {r.status_code}: {r.text[:300]}"
                continue
            if r.status_code >= 400:
                raise _Rejected(f"HTTP {r.status_code}: {r.text[:300]}")
            try:
                return r.json()
            except ValueError:
                last = f"not JSON: {r.text[:200]}"
        self._down_until = time.monotonic() + self.cooldown
        raise MemberUnavailableError(self.name, f"{self.url}: {last} (after {self.retries + 1} attempts)")

    def _parse(self, data: dict, st: SeqState) -> _Top:
        try:
            lp = data["choices"][0]["logprobs"]
            top = (lp.get("top_logprobs") or [None])[0]
            if not top and lp.get("content"):  # chat-style logprobs
                top = {t["token"]: t["logprob"] for t in lp["content"][0]["top_logprobs"]}
        except (KeyError, IndexError, TypeError):
            raise MemberUnavailableError(self.name, f"no log-probabilities in the answer: {str(data)[:300]}") from None
        if not top:
            raise MemberUnavailableError(self.name, "the server returned no top log-probabilities (does it support "
                                                    "`logprobs` on /v1/completions?)")
        out: dict[int, float] = {}
        for key, v in top.items():
            tid = self._id_of(key)
            if tid is not None and v is not None and (tid not in out or v > out[tid]):
                out[tid] = float(v)
        if not out:
            raise MemberUnavailableError(self.name, f"none of the returned tokens is in the local tokenizer: {top}")
        mass = sum(math.exp(v) for v in out.values())
        rest = max(self.vocab_size - len(out), 1)
        floor = min(math.log(max(1.0 - mass, 1e-12) / rest), min(out.values()))
        return _Top(st.length, out, floor)

    def _id_of(self, key: str) -> int | None:
        if key.startswith("token_id:"):
            try:
                return int(key[len("token_id:"):])
            except ValueError:
                return None
        if key == "":
            return self._end
        return self._by_text.get(key)


class _Rejected(Exception):
    """The server refused the request itself (a 4xx): retrying the same request will not help."""


def _stale(st: SeqState) -> bool:
    top = st.cache.top if isinstance(st.cache, _Remote) else None
    return top is None or top.length != st.length or st.pending > 0


def load_remote_member(cfg, *, root: Path, progress: bool = True) -> RemoteMember:
    """A ``backend: openai`` member from its config (its tokenizer loaded locally)."""
    from tokenfuse.bundled import BUNDLED
    from tokenfuse.members.fasttok import FastTokenizer
    from tokenfuse.members.gguf_tokenizer import ensure_tokenizer

    t0 = time.perf_counter()
    source = cfg.tokenizer or cfg.resolved_source
    if source in BUNDLED:
        tokenizer = FastTokenizer(ensure_tokenizer(source, root=root, progress=progress))
    elif (Path(source).expanduser() / "tokenizer.json").is_file():
        tokenizer = FastTokenizer(Path(source).expanduser())
    else:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as err:
            raise ModelLoadError(
                f"member {cfg.name!r}: no local tokenizer at {source!r} (set `tokenizer:` to a bundled model name or "
                f"a directory with tokenizer.json): {err}") from None
    api_key = cfg.api_key or (os.environ.get(cfg.api_key_env) if cfg.api_key_env else None)
    member = RemoteMember(cfg.name, tokenizer, base_url=cfg.base_url, model=cfg.model or cfg.name, api_key=api_key,
                          weight=cfg.weight, top_k=cfg.top_k, timeout=cfg.timeout, retries=cfg.retries,
                          prompt_format=cfg.prompt_format, topk_fill=cfg.topk_fill, context_length=cfg.n_ctx,
                          align_cache=root / "alignment")
    member.load_seconds = time.perf_counter() - t0
    return member
