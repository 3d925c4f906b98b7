"""Mixers: how the members' predictions are combined one symbol at a time, with weights that may follow
the text. One implementation for the ``byte`` method's steps (``combiners/bytemix.py``: a symbol is a
byte or the end) and for the rows of the text scores (``engine/text_rows.py``: a symbol is a byte, or
one of the primary member's tokens).

Before each symbol a ``Mixer`` gives the members' weights (``weights``); after it, ``update`` takes
each member's probability of the symbol that came, so the weights depend only on the symbols before
(a mixture of distributions with such weights is a distribution: a proper score). The kinds
(``MIXERS``):

- ``mixture``: fixed weights ``w``, ``Σ_m w_m p_m``;
- ``product``: the same weights as exponents, ``Π_m p_m^{w_m}`` renormalised over the outcomes (only
  where the whole next distribution is given: a step of the ``byte`` method);
- ``switch``: after each symbol the weights become the posterior, then a share ``alpha`` of them goes
  back to ``w`` (fixed share, Herbster & Warmuth 1998);
- ``gate``: ``softmax(b + A f)``, ``f`` each member's exponential averages (``RATES``) of its own
  log-probabilities of the symbols so far (clipped at ``FLOOR``; 0 before the first);
- ``online``: the gate whose bias also learns from the text as it goes, as context-mixing compressors
  do: after each symbol a gradient step on its log loss, ``b += rate · w ⊙ (p / (w·p) − 1)`` (the
  gradient of ``log Σ_m w_m p_m`` in the softmax's logits; ``w`` the weights that predicted it).

Their numbers (``Fitted``: ``weights``, ``alpha``, ``gate`` = ``b`` then ``A`` row-major, ``rate``;
``beta`` of the token-level ``poe`` row) are fit on dev text only: ``em_weights``, ``best_alpha``,
``fit_gate``, ``best_rate``. On the 25 dev documents of the text-bytes run (5-fold by document, each
fold's numbers fit on the other four) ``online`` gave 7.09 % fewer bits than the best member against
the gate's 6.92 % (docs/methods.md, "The byte method").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIXERS = ("mixture", "product", "switch", "gate", "online")
ALPHAS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)  # ``switch``: the shares ``best_alpha`` tries
RATES = (0.3, 0.03)  # ``gate``: the rates of each member's running averages
ONLINE_RATES = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # ``online``: the bias's step sizes ``best_rate`` tries
FLOOR = -12.0  # ``gate``: a feature's log-probability is clipped here (a symbol a member gives ~0 says little more)
GATE_L2 = 1e-4  # ``fit_gate``: L2 penalty per symbol
EM_STEPS = 200


def _log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(x)


def _array(x: Sequence[float] | None) -> np.ndarray | None:
    return None if x is None else np.asarray(x, dtype=np.float64)


@dataclass
class Fitted:
    """A row's or a mixer's numbers, fit on dev text (``None``: not used by it)."""

    weights: np.ndarray | None = None  # mixture, switch (prior), product, doc-mix
    alpha: float | None = None  # switch
    gate: np.ndarray | None = None  # gate, online: b (M) then A (M × M·len(RATES)), row-major
    beta: np.ndarray | None = None  # the token-level poe row
    rate: float | None = None  # online: the bias's step size

    @classmethod
    def from_dict(cls, d: dict) -> Fitted:
        """The inverse of ``as_dict`` (a run's ``results.json`` ``fitted`` entry; ``w`` is the older
        runs' spelling of ``weights``)."""
        return cls(weights=_array(d.get("weights", d.get("w"))), alpha=d.get("alpha"), gate=_array(d.get("gate")),
                   beta=_array(d.get("beta")), rate=d.get("rate"))

    def as_dict(self) -> dict:
        out: dict = {}
        for key in ("weights", "alpha", "gate", "beta", "rate"):
            v = getattr(self, key)
            if v is not None:
                out[key] = float(v) if key in ("alpha", "rate") else [float(x) for x in v]
        return out


class Mixer:
    """One text's mixer of ``m`` members (module docstring): ``weights`` before each symbol, ``update``
    after it."""

    def __init__(self, kind: str, fitted: Fitted, m: int) -> None:
        if kind not in MIXERS:
            raise ValueError(f"unknown mixer {kind!r} (one of {', '.join(MIXERS)})")
        self.kind, self.m = kind, m
        if kind in ("gate", "online"):
            if fitted.gate is None or len(fitted.gate) != m + m * m * len(RATES):
                raise ValueError(f"mixer {kind}: needs {m + m * m * len(RATES)} fitted numbers for {m} members")
            if kind == "online" and fitted.rate is None:
                raise ValueError("mixer online: needs its fitted rate")
            self.b, self.a = fitted.gate[:m].copy(), fitted.gate[m:].reshape(m, m * len(RATES))
            self.rate = float(fitted.rate or 0.0)
            self.f = np.zeros(m * len(RATES))  # member-major: member i's averages at f[i*R : (i+1)*R]
            self.rates = np.tile(RATES, m)
        else:
            if fitted.weights is None or len(fitted.weights) != m:
                raise ValueError(f"mixer {kind}: needs {m} weights")
            self.prior = np.asarray(fitted.weights, dtype=np.float64)
            self.cur = self.prior.copy()
            self.alpha = float(fitted.alpha or 0.0)

    def weights(self) -> np.ndarray:
        """The members' weights for the next symbol (summing to 1 for every kind but ``product``'s given
        exponents)."""
        if self.kind not in ("gate", "online"):
            return self.cur
        z = self.b + self.a @ self.f
        e = np.exp(z - z.max())
        return e / e.sum()

    def update(self, p: np.ndarray) -> None:
        """Each member's probability of the symbol that came (``float64[m]``)."""
        if self.kind == "switch":
            joint = self.cur * p
            q = joint.sum()
            post = joint / q if q > 0 else self.cur
            self.cur = (1.0 - self.alpha) * post + self.alpha * self.prior
        elif self.kind in ("gate", "online"):
            if self.kind == "online" and self.rate > 0:
                w = self.weights()
                q = float(w @ p)
                if q > 0:
                    self.b += self.rate * w * (p / q - 1.0)
            x = np.repeat(np.maximum(_log(np.maximum(p, 1e-300)), FLOOR), len(RATES))
            self.f = (1.0 - self.rates) * self.f + self.rates * x

    def logprobs(self, p: np.ndarray) -> np.ndarray:
        """The natural-log probability of each symbol of a text, from each member's probability of it
        (``p``: ``[n, m]``): ``log Σ_m w_m p[t, m]`` with the weights before symbol ``t``, updating after
        each."""
        if self.kind == "product":
            raise ValueError("mixer product: needs each member's whole next distribution, not its probability "
                             "of one symbol")
        if self.kind == "mixture":  # fixed weights: at once
            return _log(p @ self.cur)
        out = np.empty(p.shape[0])
        for t in range(p.shape[0]):
            q = float(self.weights() @ p[t])
            out[t] = math.log(q) if q > 0 else -math.inf
            self.update(p[t])
        return out

    def combine(self, logps: Sequence[np.ndarray]) -> np.ndarray:
        """The next symbol's probabilities (summing to 1) from the members' natural-log distributions
        over all outcomes (one array each), with this symbol's ``weights``; members of weight 0 left out.
        ``product`` where some outcome has mass under every member, else the mixture; no mass at all:
        uniform."""
        w = self.weights()
        total = float(w[w > 0].sum())
        live = [(lp, x / total) for lp, x in zip(logps, w) if x > 0]
        if self.kind == "product":
            logq = sum(x * lp for lp, x in live)
            top = float(np.max(logq))
            if np.isfinite(top):
                q = np.exp(logq - top)
                return q / q.sum()
        q = sum(x * np.exp(lp) for lp, x in live)
        mass = float(q.sum())
        return q / mass if mass > 0 else np.full(len(logps[0]), 1 / len(logps[0]))


def mixed_logprobs(kind: str, p: np.ndarray, fitted: Fitted) -> np.ndarray:
    """A mixer's natural-log probability of each symbol of one text (``Mixer.logprobs``)."""
    return Mixer(kind, fitted, p.shape[1]).logprobs(p)


def em_weights(log_lik: np.ndarray, steps: int = EM_STEPS) -> np.ndarray:
    """Mixture weights maximising ``Σ_t log Σ_i w_i exp(log_lik[t, i])`` (EM from uniform)."""
    n = log_lik.shape[1]
    w = np.full(n, 1.0 / n)
    for _ in range(steps):
        a = log_lik + _log(w)
        top = np.max(a, axis=1, keepdims=True)
        resp = np.exp(a - top)
        resp /= resp.sum(axis=1, keepdims=True)
        w = np.maximum(resp.mean(axis=0), 1e-12)
        w /= w.sum()
    return w


def best_alpha(texts: Sequence[np.ndarray], w: np.ndarray) -> float:
    """``switch``'s share: the one of ``ALPHAS`` that gives the texts (``p``, one ``[n, m]`` each) the most
    log-probability from the prior ``w``."""
    return float(max(ALPHAS, key=lambda a: sum(float(mixed_logprobs("switch", p, Fitted(w, a)).sum())
                                              for p in texts)))


def best_rate(texts: Sequence[np.ndarray], gate: np.ndarray, starts: Sequence[int] | None = None) -> float:
    """``online``'s step size: the one of ``ONLINE_RATES`` that gives the texts (``p``, one ``[n, m]`` each;
    from ``starts``, as ``fit_gate``) the most log-probability from the gate's numbers ``gate``."""
    starts = starts or [0] * len(texts)
    return float(max(ONLINE_RATES, key=lambda r: sum(
        float(mixed_logprobs("online", p, Fitted(gate=gate, rate=r))[s:].sum()) for p, s in zip(texts, starts))))


def gate_features(p: np.ndarray) -> np.ndarray:
    """The gate's ``f`` before each symbol of one text (``[n, m·len(RATES)]``), as ``Mixer.update`` keeps it."""
    m = p.shape[1]
    mixer = Mixer("gate", Fitted(gate=np.zeros(m + m * m * len(RATES))), m)
    out = np.empty((p.shape[0], m * len(RATES)))
    for t in range(p.shape[0]):
        out[t] = mixer.f
        mixer.update(p[t])
    return out


def fit_gate(texts: Sequence[np.ndarray], init: np.ndarray, starts: Sequence[int] | None = None) -> np.ndarray:
    """``b, A`` of the gate on the texts (``p``, one ``[n, m]`` each), from ``b = log init`` and ``A = 0``:
    the least log-loss with an L2 penalty ``GATE_L2`` per symbol (L-BFGS). ``starts``: per text, the first
    symbol the loss counts (the features read every symbol from the first: a context before an answer)."""
    from scipy.optimize import minimize

    starts = starts or [0] * len(texts)
    m = texts[0].shape[1]
    q = np.concatenate([p[s:] for p, s in zip(texts, starts)])
    f = np.concatenate([gate_features(p)[s:] for p, s in zip(texts, starts)])
    count = q.shape[0]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = theta[:m] + f @ theta[m:].reshape(m, f.shape[1]).T
        s = np.exp(z - z.max(axis=1, keepdims=True))
        s /= s.sum(axis=1, keepdims=True)
        joint = s * q
        tot = np.maximum(joint.sum(axis=1), 1e-300)
        g = s - joint / tot[:, None]  # d(−log q)/dz
        grad = np.concatenate([g.sum(axis=0), (g.T @ f).ravel()]) / count + 2 * GATE_L2 * theta
        return float(-np.log(tot).sum() / count + GATE_L2 * theta @ theta), grad

    theta0 = np.concatenate([np.log(np.maximum(init, 1e-6)), np.zeros(m * f.shape[1])])
    return minimize(loss, theta0, jac=True, method="L-BFGS-B").x
