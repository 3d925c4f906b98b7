"""What a request asks to see of the steps (``Asked``: log-probabilities, the trace) and OpenAI's
``logprobs`` shapes built from the engine's step trace (``tokenfuse.engine.trace``).

- ``/v1/completions`` (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
  ``top_logprobs`` entries are ``{token: logprob}`` objects; with ``echo`` the prompt's pieces come
  first (their first entry ``null``), each with the combined distribution's alternatives at that
  point of the prompt (teacher forcing, ``Ensemble.score_prompt``).
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.

One entry per chosen piece, from the distribution the piece was chosen from (see
``tokenfuse.engine.trace``); END is an entry too, written as the primary member's end token. A
piece a stop string removed entirely has no entry; one it cut keeps its log-probability, with the
text that remains (so the tokens concatenate to the choice's text). A log-probability of zero
probability is written ``-9999.0`` (JSON has no ``-Infinity``).
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenfuse.engine.trace import PromptPiece, TopEntry, TraceOptions, TraceStep

FLOOR = -9999.0  # the log-probability written for probability 0


@dataclass(frozen=True)
class Asked:
    """What a request asks to see besides the text.

    Attributes:
        logprobs: alternatives per token (``top_logprobs``) when log-probabilities are asked, else ``None``.
        trace_k: each member's top-k in the step trace when ``tokenfuse.trace`` is asked, else ``None``.
        echo: (completions) the prompt is echoed, with its pieces' log-probabilities when ``logprobs``.
    """

    logprobs: int | None = None
    trace_k: int | None = None
    echo: bool = False

    @classmethod
    def of(cls, body, *, chat: bool) -> Asked:
        if chat:
            n = (body.top_logprobs or 0) if body.logprobs else None
        else:
            n = body.logprobs
        opts = body.tokenfuse
        return cls(logprobs=n, trace_k=opts.trace_k if opts is not None and opts.trace else None,
                   echo=not chat and bool(getattr(body, "echo", False)))

    @property
    def score_prompt(self) -> int | None:
        """With ``echo`` + ``logprobs``: how many alternatives each scored prompt piece shows; else ``None``."""
        return self.logprobs if self.echo else None

    def trace_options(self) -> TraceOptions | None:
        """What the sequences record (``None``: nothing, the engine's zero-cost path)."""
        if self.logprobs is None and self.trace_k is None:
            return None
        return TraceOptions(k=max(self.logprobs or 0, self.trace_k or 0), members=self.trace_k is not None)

    def trace(self, index: int, steps: Sequence[TraceStep]) -> dict:
        """One choice's ``tokenfuse.trace`` element: its steps, each with ``trace_k`` top entries
        (the sequence may have recorded more, for ``top_logprobs``)."""
        out = []
        for s in steps:
            d = s.to_dict()
            d["top"] = d["top"][: self.trace_k]
            for m in d["members"]:
                if m["top"] is not None:
                    m["top"] = m["top"][: self.trace_k]
            out.append(d)
        return {"index": index, "steps": out}


def logprob(p: float | None) -> float | None:
    if p is None:
        return None
    return FLOOR if p == -math.inf else p


def _lp(prob: float) -> float:
    return math.log(prob) if prob > 0 else FLOOR


def _shown(steps: Sequence[TraceStep]) -> list[tuple[str, TraceStep]]:
    """The steps that have an entry, with their token text (END: the end token)."""
    return [(s.token if s.end else s.text, s) for s in steps if s.end or s.bytes]


def _top_dict(top: Sequence[TopEntry], n: int) -> dict[str, float]:
    d: dict[str, float] = {}
    for t in top[:n]:
        d.setdefault(t.text, _lp(t.prob))
    return d


def prompt_texts(pieces: Sequence[PromptPiece]) -> list[str]:
    """The prompt pieces as text (a character split across pieces goes with the piece that ends it)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    return [dec.decode(p.bytes, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]


def legacy(steps: Sequence[TraceStep], n: int, *, offset: int = 0,
           prompt: Sequence[PromptPiece] | None = None) -> dict:
    """A ``/v1/completions`` ``logprobs`` object: the echoed ``prompt`` pieces (if any), then the
    steps; ``text_offset`` counts characters of the choice's text from ``offset``."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict | None] = []
    offsets: list[int] = []
    at = offset
    if prompt:
        for text, p in zip(prompt_texts(prompt), prompt):
            tokens.append(text)
            lps.append(logprob(p.logprob))
            tops.append(None if p.logprob is None else _top_dict(p.top, n))
            offsets.append(at)
            at += len(text)
    for token, s in _shown(steps):
        tokens.append(token)
        lps.append(_lp(s.prob))
        tops.append(_top_dict(s.top, n))
        offsets.append(at)
        at += len(s.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat(steps: Sequence[TraceStep], n: int) -> dict:
    """A ``/v1/chat/completions`` ``logprobs`` object (``{"content": [...]}``)."""
    content = []
    for token, s in _shown(steps):
        content.append({"token": token, "logprob": _lp(s.prob),
                        "bytes": list(token.encode("utf-8") if s.end else s.raw),
                        "top_logprobs": [{"token": t.text, "logprob": _lp(t.prob),
                                          "bytes": list(t.text.encode("utf-8") if t.end else bytes.fromhex(t.bytes))}
                                         for t in s.top[:n]]})
    return {"content": content}
