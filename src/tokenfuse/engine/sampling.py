"""Choosing the next union entry from the combined distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Decoding options: ``temperature == 0`` means greedy (the default)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def choose(probs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One index from ``probs`` (``float[U]``, not necessarily normalised).

    Greedy takes the argmax (ties go to the lowest index, i.e. the smallest bytes). Sampling
    sharpens by ``1/temperature``, keeps the ``top_k`` most likely and the smallest set whose mass
    reaches ``top_p``, and draws with the sequence's own seeded generator.
    """
    if sampling.greedy or sampling.temperature < torch.finfo(probs.dtype).tiny:  # (the dtype's 0: its limit)
        return int(torch.argmax(probs))
    return int(torch.multinomial(sampled_probs(probs, sampling), 1, generator=generator))


def sampled_probs(probs: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution a sampling ``choose`` draws from: ``probs`` sharpened by ``1/temperature``
    (positive), cut to the ``top_k`` most likely and to the smallest set whose mass reaches ``top_p``,
    normalised."""
    logp = torch.log(probs.clamp_min(1e-30))
    logits = (logp - logp.max()) / sampling.temperature  # the top stays 0: no inf/nan at a tiny temperature
    logits = torch.where(probs > 0, logits, torch.full_like(logits, float("-inf")))
    if sampling.top_k > 0:
        k = min(sampling.top_k, logits.numel())
        kth = torch.topk(logits, k).values[-1]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= sampling.top_p  # keep the first that crosses
        drop[0] = False  # and always the most likely (a top_p the dtype rounds to 0 keeps it alone)
        sorted_logits[drop] = float("-inf")
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return torch.softmax(logits, dim=-1)
