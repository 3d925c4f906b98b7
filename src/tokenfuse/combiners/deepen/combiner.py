"""DeePEn — distribution ensembling in a relative space (Huang et al. 2024, arXiv 2404.12715).

The method itself (anchors, relative representations, aggregation, inverse transformation, its
deviations from the paper) lives in ``tokenfuse.combiners.deepen.relative``; this is the engine adapter:

- the *main* member (parameter ``main``, default the ensemble's primary member) is the one whose
  vocabulary the choice is made in; the fused main log-probabilities become a distribution over the
  union entries of its text/END ids (entries some member cannot hold are excluded), so greedy
  picks the main member's argmax after the inverse transformation and sampling draws from it;
- weights: DeePEn-Avg uses the ensemble's member weights (equal by default); DeePEn-Adapt (§3.5) with
  ``accuracies: {member: dev accuracy}`` and ``n_choices`` (``K`` for K-choice tasks, omitted for
  free-form) replaces them with ``α_i ∝ acc_i − 1/K``; ``adapt: true`` takes the accuracies from the
  ensemble's member scores (``Setup.scores``: each member config's ``score``, as written by
  ``tokenfuse select``);
- agreement skip is not exact here (the inverse transformation can move the main member away from
  a token every member ranks first), so it is off by default.

Parameters (``params:`` in the config, ``--param`` on the command line): ``main``, ``temperature``
(100), ``steps`` (5), ``lr`` (0.15), ``update`` (``adam`` = the reference optimiser, or ``gd`` =
Eq. 7), ``mass`` and ``max_rows`` (which tokens take part), ``capacity`` (R̂ rows kept in memory per
member), ``accuracies``, ``n_choices``, ``adapt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.combiners.base import Combiner, Dist, Setup, StepView, register
from tokenfuse.combiners.deepen.relative import (DEFAULT_CAPACITY, DEFAULT_LR, DEFAULT_MASS, DEFAULT_MAX_ROWS,
                                                 DEFAULT_STEPS, DEFAULT_TEMPERATURE, DeePEn, adapt_weights)
from tokenfuse.errors import ConfigError

_OPTIONS = ("temperature", "steps", "lr", "update", "mass", "max_rows", "capacity")


class DeePEnParams(BaseModel):
    """DeePEn's parameters (see the module docstring); the relative-space ones go to ``DeePEn``."""

    model_config = ConfigDict(extra="forbid")
    main: str | None = None
    accuracies: dict[str, float] | None = None
    n_choices: int | None = Field(None, ge=2)
    adapt: bool = False
    temperature: float = Field(DEFAULT_TEMPERATURE, gt=0)
    steps: int = Field(DEFAULT_STEPS, ge=0)
    lr: float = Field(DEFAULT_LR, gt=0)
    update: Literal["adam", "gd"] = "adam"
    mass: float = Field(DEFAULT_MASS, gt=0, le=1)
    max_rows: int = Field(DEFAULT_MAX_ROWS, ge=1)
    capacity: int = Field(DEFAULT_CAPACITY, ge=1)


@register
class DeePEnCombiner(Combiner):
    name = "deepen"
    Params = DeePEnParams
    needs = "full"
    exact_agreement = False

    def __init__(self, params: DeePEnParams | None = None) -> None:
        super().__init__(params)
        self.main_name = self.params.main
        self.accuracies = self.params.accuracies
        self.n_choices = self.params.n_choices
        self.adapt = self.params.adapt
        self.options = {k: v for k, v in self.params.model_dump(exclude_unset=True).items() if k in _OPTIONS}
        self.fuser = None  # the DeePEn algorithm on these members (``relative.DeePEn``), from ``bind``

    def describe(self) -> dict:
        return {"method": self.name, "main": self.main_name, **self.options}

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        space, members = setup.space, setup.members
        names = list(space.names)
        if self.main_name is not None and self.main_name not in names:
            raise ConfigError(f"params.main: {self.main_name!r} is not a member (members: {', '.join(names)})")
        self.main = names.index(self.main_name) if self.main_name is not None else setup.primary
        if setup.weights[self.main] <= 0:
            raise ConfigError(f"params.main: the main member {names[self.main]!r} needs weight > 0")
        if self.adapt and self.accuracies is None:
            self.accuracies = dict(zip(names, setup.scores))
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
        try:
            self.fuser = DeePEn(members, space.union, main=self.main, cache_dir=setup.cache_dir, **self.options)
        except ValueError as err:
            raise ConfigError(f"params: deepen: {err}") from None
        maps = torch.from_numpy(space.union.maps[self.main])
        rep = torch.from_numpy(space.union.representable)
        self.valid = (maps >= 0) & rep[maps.clamp_min(0)]
        self.index = maps.clamp_min(0)

    def prepare(self, *, progress: bool = True) -> float:
        """Load or build the relative matrices now (otherwise on the first ensembled step)."""
        return self.fuser.prepare(progress=progress)

    def _weights(self, view: StepView) -> dict[int, float]:
        names = view.space.names
        if self.alpha is not None:
            return {i: self.alpha[names[i]] for i in view.computed}
        return dict(zip(view.computed, view.weights))

    def _fused(self, view: StepView) -> torch.Tensor:
        if self.main not in view.logprobs:
            raise ConfigError("deepen: the main member must run at every ensembled step")
        return self.fuser.fuse(view.logprobs, self._weights(view))

    def _probs(self, z: torch.Tensor) -> torch.Tensor:
        v = min(z.shape[-1], self.valid.numel())
        p = z[:, :v].exp() * self.valid[:v]
        return p / p.sum(-1, keepdim=True).clamp_min(1e-30)

    def combine(self, view: StepView) -> Dist:
        p = self._probs(self._fused(view))
        return Dist(p, self.index[: p.shape[-1]].expand(p.shape[0], -1))

    def piece_probs(self, view: StepView, entries: Sequence[int]) -> torch.Tensor:
        """The main member's fused probability of each row's entry (aligned as in UniTE: the first
        sub-token's where it has no such token), ``float64[R]``."""
        p = self._probs(self._fused(view))
        space = view.space
        aligned = space.aligner.aligned(self.main, torch.tensor(list(entries), dtype=torch.int64, device=p.device))
        return space.projector.masses(self.main, p, aligned.unsqueeze(-1))[:, 0].double()
