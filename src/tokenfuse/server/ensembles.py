"""The server's ensembles: one ``Ensemble`` per set of per-request options, all sharing the loaded
members and the union vocabulary (``EnsemblePool``, through ``Ensemble.variant``)."""

from __future__ import annotations

import json
from collections import OrderedDict

from tokenfuse.config import EnsembleConfig, parse_config
from tokenfuse.engine import Ensemble
from tokenfuse.errors import ConfigError


# ---------------------------------------------------------------------------- ensembles per option set

def config_of(ens: Ensemble) -> EnsembleConfig:
    """A config describing an already built ensemble (for servers built on in-memory members)."""
    return parse_config({**ens.options.model_dump(), "primary": ens.members[ens.primary].name,
                         "members": [{"name": m.name, "weight": w, "score": s}
                                     for m, w, s in zip(ens.members, ens.weights, ens.scores)]},
                        origin="ensemble")


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
        self._in_use: dict[int, int] = {}  # running sequences per ensemble (``acquire``/``release``)

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
            if not self._in_use.get(id(self._cache[k])):
                del self._cache[k]
        return ens

    def acquire(self, ens: Ensemble) -> None:
        """A sequence starts running on ``ens`` (it stays cached while any does)."""
        self._in_use[id(ens)] = self._in_use.get(id(ens), 0) + 1

    def release(self, ens: Ensemble) -> None:
        """A sequence on ``ens`` has ended."""
        self._in_use[id(ens)] -= 1

    def _build(self, options: dict, down: frozenset[str]) -> Ensemble:
        cfg = self.cfg.with_overrides(**options, origin="tokenfuse")  # the one override rule (config.py)
        weights = [0.0 if mc.name in down else mc.weight for mc in cfg.members]
        if all(x <= 0 for x in weights):
            raise ConfigError("no member with a positive weight is left"
                              + (f" (unavailable: {', '.join(sorted(down))})" if down else ""))
        return self.base.variant(cfg.options, weights=weights)
