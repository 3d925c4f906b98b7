"""DeePEn — distribution ensembling in a relative space (Huang et al. 2024, arXiv 2404.12715).

The method itself (anchors, relative representations, aggregation, inverse transformation, its
deviations from the paper) lives in ``tokenfuse.alignment.relative``; this is the engine adapter:

- the *main* member (parameter ``main``, default the ensemble's primary member) is the one whose
  vocabulary the choice is made in; the fused main log-probabilities become a distribution over the
  union entries of its text/END ids (entries some member cannot hold are excluded), so greedy
  picks the main member's argmax after the inverse transformation and sampling draws from it;
- weights: DeePEn-Avg uses the member weights (equal by default); DeePEn-Adapt (§3.5) with
  ``accuracies: {member: dev accuracy}`` and ``n_choices`` (``K`` for K-choice tasks, omitted for
  free-form) replaces them with ``α_i ∝ acc_i − 1/K``; ``adapt: true`` takes the accuracies from the
  members' ``score`` (as written by ``tokenfuse select``);
- agreement skip is not exact here (the inverse transformation can move the main member away from
  a token every member ranks first), so it is off by default.

Parameters (``params:`` in the config, ``--param`` on the command line): ``main``, ``temperature``
(100), ``steps`` (5), ``lr`` (0.15), ``update`` (``adam`` = the reference optimiser, or ``gd`` =
Eq. 7), ``mass`` and ``max_rows`` (which tokens take part), ``capacity`` (R̂ rows kept in memory per
member), ``accuracies``, ``n_choices``, ``adapt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenfuse.combiners.base import Combiner, Dist, StepView, register
from tokenfuse.errors import ConfigError

_OPTIONS = ("temperature", "steps", "lr", "update", "mass", "max_rows", "capacity")


@register
class DeePEnCombiner(Combiner):
    name = "deepen"
    needs = "full"
    exact_agreement = False

    def __init__(self, main: str | None = None, accuracies: dict[str, float] | None = None,
                 n_choices: int | None = None, adapt: bool = False, **options: Any) -> None:
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; known: main, accuracies, "
                            f"n_choices, adapt, {', '.join(_OPTIONS)}")
        self.main_name = main
        self.accuracies = accuracies
        self.n_choices = n_choices
        self.adapt = adapt
        self.options = options
        self.method = None

    def describe(self) -> dict:
        return {"method": self.name, "main": self.main_name, **self.options}

    def bind(self, ens) -> None:
        from tokenfuse.alignment.relative import DeePEn, adapt_weights

        names = [m.name for m in ens.members]
        if self.main_name is not None and self.main_name not in names:
            raise ConfigError(f"params.main: {self.main_name!r} is not a member (members: {', '.join(names)})")
        self.main = names.index(self.main_name) if self.main_name is not None else ens.primary
        if ens.members[self.main].weight <= 0:
            raise ConfigError(f"params.main: the main member {names[self.main]!r} needs weight > 0")
        if self.adapt and self.accuracies is None:
            self.accuracies = {m.name: getattr(m, "score", None) for m in ens.members}
            missing = [k for k, v in self.accuracies.items() if v is None]
            if missing:
                raise ConfigError(f"params.adapt: members without a `score` (dev accuracy): {', '.join(missing)}")
        self.alpha = None
        if self.accuracies is not None:
            extra = set(self.accuracies) - set(names)
            if extra or set(names) - set(self.accuracies):
                raise ConfigError(f"params.accuracies: give one accuracy per member ({', '.join(names)})")
            try:
                self.alpha = adapt_weights(self.accuracies, self.n_choices)
            except ValueError as err:
                raise ConfigError(f"params.accuracies: {err}") from None
        self.ens = ens
        try:
            self.method = DeePEn(ens.members, ens.union, main=self.main, cache_dir=ens.align_cache, **self.options)
        except ValueError as err:
            raise ConfigError(f"params: deepen: {err}") from None
        maps = torch.from_numpy(ens.union.maps[self.main])
        rep = torch.from_numpy(ens.union.representable)
        self.valid = (maps >= 0) & rep[maps.clamp_min(0)]
        self.index = maps.clamp_min(0)

    def prepare(self, *, progress: bool = True) -> float:
        """Load or build the relative matrices now (otherwise on the first ensembled step)."""
        return self.method.prepare(progress=progress)

    def _weights(self, view: StepView) -> dict[int, float]:
        names = [m.name for m in view.ens.members]
        if self.alpha is not None:
            return {i: self.alpha[names[i]] for i in view.members}
        return dict(zip(view.members, view.weights))

    def _fused(self, view: StepView) -> torch.Tensor:
        if self.main not in view.logprobs:
            raise ConfigError("deepen: the main member must run at every ensembled step")
        return self.method.fuse(view.logprobs, self._weights(view))

    def _probs(self, z: torch.Tensor) -> torch.Tensor:
        v = min(z.shape[-1], self.valid.numel())
        p = z[:, :v].exp() * self.valid[:v]
        return p / p.sum(-1, keepdim=True).clamp_min(1e-30)

    def combine(self, view: StepView) -> Dist:
        p = self._probs(self._fused(view))
        return Dist(p, self.index[: p.shape[-1]].expand(p.shape[0], -1))

    def piece_probs(self, view: StepView, entries: Sequence[int]) -> torch.Tensor:
        p = self._probs(self._fused(view))
        out = torch.zeros(len(entries), dtype=torch.float64)
        for r, e in enumerate(entries):
            ids = [t for t in view.ens.aligner.query_ids(self.main, e) if t < p.shape[-1]]
            out[r] = float(p[r, ids].sum()) if ids else 0.0
        return out
