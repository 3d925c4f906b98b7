"""The mixers (``tokenfuse.combiners.mixers``): the online gate against the gate it starts from, its
step on the log loss, its rate's fit, and its numbers' round trip."""

from __future__ import annotations

import numpy as np
import pytest

from tokenfuse.combiners.mixers import (
    ONLINE_RATES,
    RATES,
    Fitted,
    Mixer,
    best_rate,
    mixed_logprobs,
)


def _texts(seed: int, n: int = 300, m: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(8), size=(n, m))[..., 0]  # each member's probability of the symbol that came


def _gate(m: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.3, size=m + m * m * len(RATES))


def test_online_at_rate_zero_is_the_gate():
    p, g = _texts(1), _gate()
    np.testing.assert_array_equal(mixed_logprobs("online", p, Fitted(gate=g, rate=0.0)),
                                  mixed_logprobs("gate", p, Fitted(gate=g)))


def test_online_steps_its_bias_up_the_log_loss_gradient():
    """After one symbol the bias moves by ``rate · w ⊙ (p / (w·p) − 1)`` (``w``: the weights that predicted
    it), and the member that gave it more than the mixture gains weight against the plain gate."""
    g = _gate()
    p = np.array([0.9, 0.1, 0.05])
    online, gate = Mixer("online", Fitted(gate=g, rate=0.5), 3), Mixer("gate", Fitted(gate=g), 3)
    w = online.weights()
    q = float(w @ p)
    online.update(p)
    gate.update(p)
    np.testing.assert_allclose(online.b, g[:3] + 0.5 * w * (p / q - 1.0), rtol=1e-12)
    assert online.weights()[0] > gate.weights()[0] and np.isclose(online.weights().sum(), 1.0)
    np.testing.assert_array_equal(g[:3], _gate()[:3])  # the fitted numbers are not written


def test_online_weights_depend_only_on_the_symbols_before():
    """Over every next symbol of a full distribution the mixture sums to 1 at each step (a proper score)."""
    rng = np.random.default_rng(3)
    mixer = Mixer("online", Fitted(gate=_gate(), rate=0.3), 3)
    for _ in range(20):
        dists = [np.log(rng.dirichlet(np.ones(257))) for _ in range(3)]
        assert mixer.combine(dists).sum() == pytest.approx(1.0, abs=1e-12)
        mixer.update(np.array([np.exp(d[7]) for d in dists]))


def test_best_rate_follows_a_text_whose_best_member_changes():
    """A text where member 0 is better for the first half and member 1 after: the fixed gate (rate 0)
    loses to a rate above 0, and ``best_rate`` picks one."""
    n = 400
    p = np.full((n, 2), 0.05)
    p[: n // 2, 0] = p[n // 2:, 1] = 0.6
    g = np.zeros(2 + 2 * 2 * len(RATES))
    rate = best_rate([p], g)
    assert rate in ONLINE_RATES and rate > 0
    assert (mixed_logprobs("online", p, Fitted(gate=g, rate=rate)).sum()
            > mixed_logprobs("gate", p, Fitted(gate=g)).sum() + 10)
    with pytest.raises(ValueError, match="mixer online: needs its fitted rate"):
        Mixer("online", Fitted(gate=g), 2)


def test_fitted_round_trip_keeps_the_rate():
    f = Fitted(gate=_gate(), rate=0.1)
    back = Fitted.from_dict(f.as_dict())
    assert back.rate == 0.1 and np.array_equal(back.gate, f.gate)
