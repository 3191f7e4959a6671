"""benchmarks/scaling_fit.py: the compute-scaling sigmoid (arXiv 2510.13786, eq. 1) fitted to data made from known
parameters recovers them, and its standard errors cover the truth."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from scaling_fit import fit_sigmoid, sigmoid  # noqa: E402


@pytest.mark.parametrize("a, b, c_mid", [(0.9, 1.5, 40.0), (0.6, 0.7, 30.0), (1.0, 3.0, 15.0)])  # midpoints the
# data pass (a run still far from its midpoint does not identify A: the paper fits runs past it)
def test_the_fit_recovers_known_parameters(a, b, c_mid):
    compute = np.cumsum(np.full(200, 0.5))  # 200 steps of 0.5 s
    rng = np.random.default_rng(0)
    reward = sigmoid(compute, 0.1, a, b, c_mid) + rng.normal(0, 0.02, len(compute))  # per-step noise
    fit = fit_sigmoid(compute, reward, 0.1)
    for key, truth in (("A", a), ("B", b), ("C_mid", c_mid)):  # within 10 %, or within 3 of its standard errors
        assert abs(fit[key] - truth) <= max(0.1 * truth, 3 * fit[key + "_se"]), (key, fit[key], fit[key + "_se"])
    assert fit["rmse"] == pytest.approx(0.02, abs=0.005)  # the noise, no more


def test_a_flat_run_has_its_asymptote_at_its_start():
    compute = np.arange(1, 101, dtype=float)
    fit = fit_sigmoid(compute, np.full(100, 0.3), 0.3)
    assert fit["A"] == pytest.approx(0.3, abs=1e-9) and fit["rmse"] < 1e-9


def test_the_asymptote_stays_below_the_most_reward_there_is():
    """A run still rising at its end: unbounded, its asymptote runs off past any reachable reward; bounded, it stops at
    the bound."""
    compute = np.arange(1, 101, dtype=float)
    reward = 0.2 + 0.008 * compute  # a straight line: no bend, no asymptote in the data
    assert fit_sigmoid(compute, reward, 0.2)["A"] > 1.1
    assert fit_sigmoid(compute, reward, 0.2, a_max=1.1)["A"] == pytest.approx(1.1)
