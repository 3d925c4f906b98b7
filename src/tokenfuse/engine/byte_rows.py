"""Text rows on the members' byte-level views (alignment/byteview.py): every member gives its probability
of each next byte given the bytes before it, ``q[n, m]``; every row is, before each byte, a distribution
over the next byte made from those (so a proper score of the byte string: docs/methods.md, "Proper
scores of text").

Rows (``BYTE_ROWS``), their parameters fit on dev documents only (``fit_bytes``):

- ``bytes:<member>``: the member's view alone (no parameter).
- ``byte-mix``: ``Σ_m w_m q[n, m]`` (weights ``w``: EM on the dev bytes).
- ``byte-switch``: the same mixture, its weights following the text: after each byte the weights become
  the posterior, then a share ``alpha`` of them goes back to ``w`` (fixed share, Herbster & Warmuth 1998;
  ``alpha`` the best of ``ALPHAS`` on dev).
- ``byte-gate``: weights that depend on the members' state before each byte: ``softmax(b + A f[n])``
  where ``f[n]`` holds, for each member, exponential averages of its log-probability of the bytes so
  far at the rates ``RATES`` (past bytes only); ``b`` and ``A`` minimise the dev bytes' log-loss
  (L-BFGS, an L2 penalty ``GATE_L2`` per byte).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenfuse.engine.text_rows import ALPHAS, em_weights, switch_logprobs

RATES = (0.3, 0.03)
FLOOR = -12.0  # a feature's log-probability is clipped here (a byte a member gives ~0 says little more)
GATE_L2 = 1e-4
BYTE_ROWS = ("byte-mix", "byte-switch", "byte-gate")


@dataclass
class ByteFitted:
    w: list[float] = field(default_factory=list)
    alpha: float = 0.0
    gate: list[float] = field(default_factory=list)  # b (M) then A (M × M·len(RATES)), row-major

    def as_dict(self) -> dict:
        return {k: v for k, v in {"w": self.w, "alpha": self.alpha, "gate": self.gate}.items() if v}

    @classmethod
    def from_dict(cls, d: dict) -> ByteFitted:
        return cls(list(d.get("w", [])), float(d.get("alpha", 0.0)), list(d.get("gate", [])))


def gate_features(logq: np.ndarray) -> np.ndarray:
    """``f[n]``: each member's exponential averages (``RATES``) of its clipped log-probabilities of the
    bytes before ``n`` (0 before the first), ``[n, M·len(RATES)]``."""
    x = np.maximum(logq, FLOOR)
    n, m = x.shape
    out = np.zeros((n, m * len(RATES)))
    for k, r in enumerate(RATES):
        acc = np.zeros(m)
        col = out[:, k::len(RATES)]
        for t in range(n):
            col[t] = acc
            acc = (1.0 - r) * acc + r * x[t]
    return out


def gate_weights(f: np.ndarray, theta: np.ndarray, m: int) -> np.ndarray:
    b, a = theta[:m], theta[m:].reshape(m, f.shape[1])
    z = b + f @ a.T
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def fit_gate(docs: list[np.ndarray], init: np.ndarray) -> np.ndarray:
    """``b, A`` of ``byte-gate`` on the dev documents' ``q`` (one array per document), from ``b = log w``."""
    from scipy.optimize import minimize

    m = docs[0].shape[1]
    q = np.concatenate(docs)
    f = np.concatenate([gate_features(np.log(np.maximum(d, 1e-300))) for d in docs])
    count = q.shape[0]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        s = gate_weights(f, theta, m)
        joint = s * q
        tot = np.maximum(joint.sum(axis=1), 1e-300)
        post = joint / tot[:, None]
        g = s - post  # d(−log q)/dz
        grad = np.concatenate([g.sum(axis=0), (g.T @ f).ravel()]) / count + 2 * GATE_L2 * theta
        return float(-np.log(tot).sum() / count + GATE_L2 * theta @ theta), grad

    theta0 = np.concatenate([np.log(np.maximum(init, 1e-6)), np.zeros(m * f.shape[1])])
    return minimize(loss, theta0, jac=True, method="L-BFGS-B").x


def byte_logprobs(row: str, q: np.ndarray, fitted: ByteFitted) -> np.ndarray:
    """Row ``row``'s natural-log probability of each byte of one document (``q``: ``[n, M]``)."""
    with np.errstate(divide="ignore"):
        if row == "byte-mix":
            return np.log(q @ np.array(fitted.w))
        if row == "byte-switch":
            return switch_logprobs(q, np.array(fitted.w), fitted.alpha)
        if row == "byte-gate":
            s = gate_weights(gate_features(np.log(np.maximum(q, 1e-300))), np.array(fitted.gate), q.shape[1])
            return np.log((s * q).sum(axis=1))
    raise ValueError(f"unknown byte row {row!r} (one of {', '.join(BYTE_ROWS)})")


def fit_bytes(dev: list[np.ndarray]) -> dict[str, ByteFitted]:
    """Every byte row's parameters on the dev documents' ``q`` (one ``[n, M]`` array per document)."""
    with np.errstate(divide="ignore"):
        w = em_weights(np.log(np.concatenate(dev)))
    best = max(ALPHAS, key=lambda a: sum(float(switch_logprobs(d, w, a).sum()) for d in dev))
    gate = fit_gate(dev, w)
    return {"byte-mix": ByteFitted(w.tolist()), "byte-switch": ByteFitted(w.tolist(), best),
            "byte-gate": ByteFitted(gate=gate.tolist())}
