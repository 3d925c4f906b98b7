"""The rows of a proper text score: each a distribution over byte strings (docs/methods.md, "Proper
scores of text"), computed from ``DocFeatures``.

Every token-level row is, before each of the primary member's tokens, a distribution over the
primary's next token made from the members' *components* (``components``):

- the primary's own distribution ``π_P = p_P``;
- for every other member ``j``, ``π_j(v) = e_j(v) + (1 − E_j) · p_P(v)``: ``j``'s probability of the exact
  bytes of each of the primary's ``K`` candidates (``e_j``, ``E_j`` their sum), the rest of the mass
  following the primary. ``Σ_v π_j(v) = 1``.

Rows (``ROWS``: one registry, each row declaring what it predicts and its mixer), their parameters fit
on dev documents only (``fit``, ``fit_bytes``; one ``Fitted`` type). Mixers are ``combiners.mixers``', the
same the ``byte`` method combines its members with:

- ``single:<member>``: the member alone on its own tokens (no parameter).
- ``doc-mix``: ``log Σ_i w_i p_i(doc)``, the document-level mixture (weights ``w``: EM on dev documents).
- ``gac``: ``q = Σ_i w_i π_i`` at every token (the ``mixture`` mixer; weights: EM on dev tokens).
- ``switch``: the same mixture with weights that follow the text (the ``switch`` mixer: Bayesian mixing
  with fixed share, Herbster & Warmuth 1998): after each token the weights become the posterior, then a
  share ``alpha`` of them goes back to the prior ``w`` (``w``: ``gac``'s; ``alpha``: the best of
  ``mixers.ALPHAS`` on dev).
- ``poe``: the renormalised weighted geometric mean ``q ∝ Π_i π_i^{β_i}``, ``Σ β = 1`` (``β``: the best
  point of a simplex grid on dev). Outside the candidates every component is a multiple of ``p_P``,
  so the normaliser is exact: ``Σ_{c∈C} Π_i π_i(c)^{β_i} + Π_j (1 − E_j)^{β_j} (1 − Σ_{c∈C} p_P(c))``.

On the members' byte models (alignment/bytemodel.py; every member's probability of each next byte given
the bytes before it, ``q[n, m]``), each row a distribution over the next byte:

- ``bytes:<member>``: the member's byte model alone (no parameter).
- ``byte-mix``: the ``mixture`` mixer, ``Σ_m w_m q[n, m]`` (weights: EM on the dev bytes).
- ``byte-switch``: the ``switch`` mixer on bytes (``alpha`` the best of ``ALPHAS`` on dev).
- ``byte-gate``: the ``gate`` mixer: ``softmax(b + A f[n])``, ``f[n]`` each member's exponential
  averages of its log-probability of the bytes so far; ``b`` and ``A`` minimise the dev bytes' log-loss
  (``mixers.fit_gate``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenfuse.combiners.mixers import Fitted, best_alpha, best_rate, em_weights, fit_gate, mixed_logprobs
from tokenfuse.engine.text_features import DocFeatures

POE_GRID = 0.05


@dataclass(frozen=True)
class Row:
    """What a row predicts (``document``: the whole text at once; ``tokens``: the primary member's next
    token; ``bytes``: the next byte) and, for a mixture of the members, its mixer (``combiners.mixers``)."""

    predicts: str
    mixer: str | None = None


ROWS = {"doc-mix": Row("document"), "gac": Row("tokens", "mixture"), "switch": Row("tokens", "switch"),
        "poe": Row("tokens"), "byte-mix": Row("bytes", "mixture"), "byte-switch": Row("bytes", "switch"),
        "byte-gate": Row("bytes", "gate"), "byte-online": Row("bytes", "online")}
TOKEN_ROWS = tuple(r for r, x in ROWS.items() if x.predicts == "tokens")
BYTE_ROWS = tuple(r for r, x in ROWS.items() if x.predicts == "bytes")
TEXT_ROWS = ("doc-mix",) + TOKEN_ROWS  # the rows of the ``text`` run besides each member's


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


def row_logprob(row: str, f: DocFeatures, names: Sequence[str], p: Fitted) -> float:
    """The row's natural-log probability of the document (``names``: the members, in order)."""
    n_members = len(names)
    if row.startswith("single:"):
        return float(np.sum(f.single[list(names).index(row.split(":", 1)[1])]))
    if row == "doc-mix":
        return doc_mix_logprob(np.array([np.sum(f.single[i]) for i in range(n_members)]), p.weights)
    true, cand = components(f, n_members)
    return float(np.sum(token_logprobs(row, true, cand, f, p)))


def token_logprobs(row: str, true: np.ndarray, cand: np.ndarray, f: DocFeatures, p: Fitted) -> np.ndarray:
    """A token-level row's log-probability of each of the primary's tokens."""
    if row in TOKEN_ROWS and ROWS[row].mixer is not None:
        return mixed_logprobs(ROWS[row].mixer, true, p)
    if row == "poe":
        return poe_logprobs(true, cand, f, p.beta)
    raise ValueError(f"unknown token-level row {row!r}")


def doc_mix_logprob(totals: np.ndarray, weights: np.ndarray) -> float:
    """``doc-mix``: ``log Σ_i w_i exp(totals[i])`` (``totals``: each member's log-probability of the document)."""
    x = totals + _log(weights)
    top = np.max(x)
    if not np.isfinite(top):
        return float(top)
    return float(top + np.log(np.sum(np.exp(x - top))))


def byte_logprobs(row: str, q: np.ndarray, fitted: Fitted) -> np.ndarray:
    """A byte row's natural-log probability of each byte of one document (``q``: ``[n, M]``)."""
    if row not in BYTE_ROWS:
        raise ValueError(f"unknown byte row {row!r} (one of {', '.join(BYTE_ROWS)})")
    return mixed_logprobs(ROWS[row].mixer, q, fitted)


def simplex(n: int, step: float) -> list[np.ndarray]:
    m = round(1 / step)
    return [np.array(c, dtype=np.float64) / m for c in itertools.product(range(m + 1), repeat=n) if sum(c) == m]


def fit_doc_mix(totals: np.ndarray) -> Fitted:
    """``doc-mix``'s weights: EM on the dev documents' totals (``[documents, members]``: each member's
    log-probability of each document)."""
    return Fitted(weights=em_weights(totals))


def fit(dev: Sequence[DocFeatures], n_members: int) -> dict[str, Fitted]:
    """Every row's parameters from dev documents' features (nothing else)."""
    doc_ll = np.array([[np.sum(f.single[i]) for i in range(n_members)] for f in dev])
    comps = [components(f, n_members) for f in dev]
    true = np.concatenate([c[0] for c in comps])
    w_tok = em_weights(_log(true))
    alpha = best_alpha([c[0] for c in comps], w_tok)

    def poe_total(beta: np.ndarray) -> float:
        return float(sum(np.sum(poe_logprobs(c[0], c[1], f, beta)) for c, f in zip(comps, dev)))

    best_beta = max(simplex(n_members, POE_GRID), key=poe_total)
    return {"doc-mix": fit_doc_mix(doc_ll), "gac": Fitted(weights=w_tok),
            "switch": Fitted(weights=w_tok, alpha=alpha), "poe": Fitted(beta=best_beta)}


def fit_bytes(dev: list[np.ndarray]) -> dict[str, Fitted]:
    """Every byte row's parameters on the dev documents' ``q`` (one ``[n, M]`` array per document)."""
    w = em_weights(_log(np.concatenate(dev)))
    gate = fit_gate(dev, w)
    return {"byte-mix": Fitted(weights=w), "byte-switch": Fitted(weights=w, alpha=best_alpha(dev, w)),
            "byte-gate": Fitted(gate=gate), "byte-online": Fitted(gate=gate, rate=best_rate(dev, gate))}
