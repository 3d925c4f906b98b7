"""Per-prompt weights (PackLLM-sim): each member's weight times ``exp(ℓ_i / τ)``.

``ℓ_i`` is member ``i``'s mean log-probability per UTF-8 byte of its own prompt, computed as the
sequence's prefill before its first forward (``prompt_logprob_per_byte``) and kept in
``OpenSequence.notes["prompt_weights"]``; ``prompt_weights`` is ``τ`` (``None``: off) and
``prompt_bytes`` scores only each member's ids that cover the prompt's last ``N`` bytes (the
item-specific end of a few-shot prompt; the prefix before them is a plain prefill, which a cached
prefix can serve). Every weighted member must run in this process.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.combiners.base import StepView
from tokenfuse.engine.strategies.base import Strategy, param
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member, SeqState

PROMPT_CHUNK = 32  # prompt positions per call when a prompt is scored (each keeps a float32[V] row)


class PromptParams(BaseModel):
    """``prompt_weights``: the temperature ``τ`` (``None``: off); ``prompt_bytes``: score only the
    prompt's last ``N`` bytes (``None``: the whole prompt)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt_weights: float | None = Field(None, gt=0)
    prompt_bytes: int | None = Field(None, ge=1)


class PromptWeights(Strategy):
    name = "prompt_weights"
    Params = PromptParams
    prefills = True
    speculative = False

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return param(options, PromptParams, "prompt_weights") is not None

    def prepare(self, seqs) -> None:
        """Each weighted member's score of the prompts not scored yet (their prefill)."""
        fresh = [s for s in seqs if self.name not in s.notes]
        if not fresh:
            return
        d = self.decider
        weighted = [i for i, w in enumerate(d.weights) if w > 0]
        with d.timer.stage("forward"):
            got = d.pool.run(weighted, lambda i: [prompt_logprob_per_byte(d.members[i], s.states[i],
                                                                          last_bytes=self.params.prompt_bytes)
                                                  for s in fresh])
        for k, s in enumerate(fresh):
            s.notes[self.name] = {i: got[i][k] for i in weighted}

    def factors(self, view: StepView, seqs) -> dict[int, torch.Tensor]:
        if len(view.computed) < 2:
            return {}
        if seqs is None:
            raise ValueError("params.prompt_weights: a view of rows without their sequences has no prompt weights")
        self.prepare(seqs)
        tau = self.params.prompt_weights
        scores = [s.notes[self.name] for s in seqs]
        return {i: torch.tensor([sc[i] / tau for sc in scores], dtype=torch.float64)
                for i in view.computed if i in scores[0]}


def prompt_logprob_per_byte(member: Member, st: SeqState, *, last_bytes: int | None = None) -> float:
    """``member``'s mean log-probability per UTF-8 byte of its prompt (the ids after the first, or
    with ``last_bytes`` the last ids that cover at least that many bytes; ids without bytes, i.e.
    special tokens, left out; 0 for a prompt without text), computed as the sequence's prefill: the
    prompt goes in through ``Member.logprobs_at`` in calls that end at multiples of
    ``PROMPT_CHUNK`` (the last call takes the remainder too), after which the state holds the prompt
    and its next-token distribution as a plain prefill leaves them. Needs a fresh state (no output
    yet) of a member in this process."""
    if not member.in_process:
        raise ConfigError(f"params.prompt_weights: member {member.name!r} does not run in this process "
                          "(PackLLM weights need its log-probabilities at every prompt position)")
    if st.ids or st.n_valid:
        raise ValueError("prompt_logprob_per_byte: the state must be fresh (nothing fed, no output)")
    full = list(st.prompt_ids)
    token_bytes = member.codec.token_bytes

    def text(n: int) -> bytes:
        return (token_bytes[full[n]] if full[n] < len(token_bytes) else None) or b""

    first, covered = 1, 0  # the first id scored
    if last_bytes is not None:
        first = len(full)
        while first > 1 and covered < last_bytes:
            first -= 1
            covered += len(text(first))
    stops = [m for m in range(PROMPT_CHUNK, len(full) - PROMPT_CHUNK + 1, PROMPT_CHUNK) if m >= first]
    stops.append(len(full))
    total, nbytes, lo = 0.0, 0, first
    try:
        for stop in stops:
            st.prompt_ids = full[:stop]
            ends = list(range(lo, stop + 1))  # after ``n`` ids: the distribution of id ``n``
            rows = member.logprobs_at(st, ends)
            for k, n in enumerate(ends):
                if n < len(full) and text(n):
                    total += float(rows[k, full[n]])
                    nbytes += len(text(n))
            lo = stop + 1
    finally:
        st.prompt_ids = full
    return total / nbytes if nbytes else 0.0
