"""The rows of a proper text score: each a distribution over byte strings (docs/methods.md, "Proper
scores of text"), computed from ``DocFeatures``.

Every token-level row is, before each of the primary member's tokens, a distribution over the
primary's next token made from the members' *components* (``components``):

- the primary's own distribution ``π_P = p_P``;
- for every other member ``j``, ``π_j(v) = e_j(v) + (1 − E_j) · p_P(v)``: ``j``'s probability of the exact
  bytes of each of the primary's ``K`` candidates (``e_j``, ``E_j`` their sum), the rest of the mass
  following the primary. ``Σ_v π_j(v) = 1``.

Rows (``ROWS``), their parameters fit on dev documents only (``fit``):

- ``single:<member>``: the member alone on its own tokens (no parameter).
- ``doc-mix``: ``log Σ_i w_i p_i(doc)``, the document-level mixture (weights ``w``: EM on dev documents).
- ``gac``: ``q = Σ_i w_i π_i`` at every token (weights: EM on dev tokens).
- ``switch``: the same mixture with weights that follow the text (Bayesian mixing with fixed share,
  Herbster & Warmuth 1998): after each token the weights become the posterior, then a share
  ``alpha`` of them goes back to the prior ``w`` (``w``: ``gac``'s; ``alpha``: the best of ``ALPHAS``
  on dev).
- ``poe``: the renormalised weighted geometric mean ``q ∝ Π_i π_i^{β_i}``, ``Σ β = 1`` (``β``: the best
  point of a simplex grid on dev). Outside the candidates every component is a multiple of ``p_P``,
  so the normaliser is exact: ``Σ_{c∈C} Π_i π_i(c)^{β_i} + Π_j (1 − E_j)^{β_j} (1 − Σ_{c∈C} p_P(c))``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenfuse.engine.text_features import DocFeatures

ALPHAS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
POE_GRID = 0.05
EM_STEPS = 200
TOKEN_ROWS = ("gac", "switch", "poe")
ROWS = ("doc-mix",) + TOKEN_ROWS


def components(f: DocFeatures, n_members: int) -> tuple[np.ndarray, np.ndarray]:
    """``(true [n, N], cand [n, K, N])``: every component's probability of the true token and of each
    candidate, members in order."""
    n, kk = f.p_cand.shape
    true = np.zeros((n, n_members))
    cand = np.zeros((n, kk, n_members))
    for i in range(n_members):
        if i == f.primary:
            true[:, i], cand[:, :, i] = f.p_true, f.p_cand
            continue
        e = f.e[i]
        rest = np.clip(1.0 - e.sum(axis=1), 0.0, 1.0)
        hit = np.where(f.true_at >= 0, e[np.arange(n), np.maximum(f.true_at, 0)], 0.0)
        true[:, i] = np.where(f.true_at >= 0, hit, 0.0) + rest * f.p_true
        cand[:, :, i] = e + rest[:, None] * f.p_cand
    return true, cand


def _log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(x)


def mixture_logprobs(true: np.ndarray, w: np.ndarray) -> np.ndarray:
    return _log(true @ w)


def switch_logprobs(true: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
    """Per-token log-probabilities of the fixed-share mixture (weights start at ``w``, the prior)."""
    out = np.empty(true.shape[0])
    cur = w.copy()
    for t in range(true.shape[0]):
        joint = cur * true[t]
        q = joint.sum()
        out[t] = math.log(q) if q > 0 else -math.inf
        post = joint / q if q > 0 else cur
        cur = (1.0 - alpha) * post + alpha * w
    return out


def _weighted_log(x: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """``Σ_i β_i log x[..., i]`` with ``0 · log 0 = 0`` (a member with no weight does not veto)."""
    keep = beta > 0
    return _log(x[..., keep]) @ beta[keep]


def poe_logprobs(true: np.ndarray, cand: np.ndarray, f: DocFeatures, beta: np.ndarray) -> np.ndarray:
    lt = _weighted_log(true, beta)
    lc = _weighted_log(cand, beta)  # [n, K]
    rest_p = np.clip(1.0 - f.p_cand.sum(axis=1), 0.0, 1.0)
    rest_scale = np.zeros(true.shape[0])  # log Π_j (1 − E_j)^{β_j}
    for j, e in f.e.items():
        if beta[j] > 0:
            rest_scale += beta[j] * _log(np.clip(1.0 - e.sum(axis=1), 0.0, 1.0))
    stack = np.concatenate([lc, (rest_scale + _log(rest_p))[:, None]], axis=1)
    with np.errstate(invalid="ignore"):
        top = np.max(stack, axis=1, keepdims=True)
        z = top[:, 0] + np.log(np.exp(stack - top).sum(axis=1))
    return lt - z


@dataclass
class Fitted:
    """A row's parameters (fit on dev documents)."""

    weights: np.ndarray | None = None  # doc-mix, gac, switch (prior)
    alpha: float | None = None  # switch
    beta: np.ndarray | None = None  # poe

    @classmethod
    def from_dict(cls, d: dict) -> Fitted:
        """The inverse of ``as_dict`` (a ``text`` run's ``results.json`` ``fitted`` entry)."""
        return cls(weights=np.array(d["weights"]) if "weights" in d else None, alpha=d.get("alpha"),
                   beta=np.array(d["beta"]) if "beta" in d else None)

    def as_dict(self) -> dict:
        out = {}
        if self.weights is not None:
            out["weights"] = [round(float(x), 6) for x in self.weights]
        if self.alpha is not None:
            out["alpha"] = self.alpha
        if self.beta is not None:
            out["beta"] = [round(float(x), 6) for x in self.beta]
        return out


def row_logprob(row: str, f: DocFeatures, names: Sequence[str], p: Fitted) -> float:
    """The row's natural-log probability of the document (``names``: the members, in order)."""
    n_members = len(names)
    if row.startswith("single:"):
        return float(np.sum(f.single[list(names).index(row.split(":", 1)[1])]))
    if row == "doc-mix":
        lls = np.array([np.sum(f.single[i]) for i in range(n_members)])
        return float(_logsumexp(lls + _log(p.weights)))
    true, cand = components(f, n_members)
    return float(np.sum(token_logprobs(row, true, cand, f, p)))


def token_logprobs(row: str, true: np.ndarray, cand: np.ndarray, f: DocFeatures, p: Fitted) -> np.ndarray:
    """A token-level row's log-probability of each of the primary's tokens."""
    if row == "gac":
        return mixture_logprobs(true, p.weights)
    if row == "switch":
        return switch_logprobs(true, p.weights, p.alpha)
    if row == "poe":
        return poe_logprobs(true, cand, f, p.beta)
    raise ValueError(f"unknown token-level row {row!r}")


def _logsumexp(x: np.ndarray) -> float:
    top = np.max(x)
    if not np.isfinite(top):
        return float(top)
    return float(top + np.log(np.sum(np.exp(x - top))))


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


def simplex(n: int, step: float) -> list[np.ndarray]:
    m = round(1 / step)
    return [np.array(c, dtype=np.float64) / m for c in itertools.product(range(m + 1), repeat=n) if sum(c) == m]


def fit(dev: Sequence[DocFeatures], n_members: int) -> dict[str, Fitted]:
    """Every row's parameters from dev documents' features (nothing else)."""
    doc_ll = np.array([[np.sum(f.single[i]) for i in range(n_members)] for f in dev])
    comps = [components(f, n_members) for f in dev]
    true = np.concatenate([c[0] for c in comps])
    w_tok = em_weights(_log(true))
    best_alpha = max(ALPHAS, key=lambda a: sum(np.sum(switch_logprobs(c[0], w_tok, a)) for c in comps))

    def poe_total(beta: np.ndarray) -> float:
        return float(sum(np.sum(poe_logprobs(c[0], c[1], f, beta)) for c, f in zip(comps, dev)))

    best_beta = max(simplex(n_members, POE_GRID), key=poe_total)
    return {"doc-mix": Fitted(weights=em_weights(doc_ll)), "gac": Fitted(weights=w_tok),
            "switch": Fitted(weights=w_tok, alpha=float(best_alpha)), "poe": Fitted(beta=best_beta)}
