"""grpo_kl.py: the KL estimators of Tang & Munos (arXiv 2506.09477) and DeepSeek-V3.2 (k3_is) in GRPO's loss: the
gradient each one gives (exact expectations, and token by token in the loss), the logged KL, k1_reward's KL paid
from the rewards instead of the loss, and short runs end to end."""

import math

import pytest
import torch

import grpo_kl
from tests.helpers import SMALL, loss_of, resolved, run_grpo
from tests.test_rl_utils import GRAD_FORWARD_KL, GRAD_REVERSE_KL, expected_gradient
from utils.rl import kl_k2, kl_k3

ESTIMATORS = ["k2", "k3+", "k3_is", "k3"]  # the ones in the loss; k1_reward is in the reward


@pytest.mark.parametrize("estimator, expected", [
    ("k2", GRAD_REVERSE_KL),
    ("k3+", GRAD_REVERSE_KL),  # k3's value, k2's gradient (verl)
    ("k3_is", GRAD_REVERSE_KL),  # rho * k3 with rho = pi / pi_old differentiable (DeepSeek-V3.2), on-policy
    ("k3", GRAD_FORWARD_KL),  # grpo.py's: the forward KL's gradient
])
def test_kl_placement_gradients(estimator, expected):
    """Exact expectations over a 5-token distribution (test_rl_utils.py's table): every estimator but k3 gives the
    gradient of KL(pi || ref), the objective's."""
    got = expected_gradient(lambda lp, ref: grpo_kl.kl_term(lp, ref, lp.detach(), estimator))
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_estimators_in_the_loss(estimator):
    """The KL part of the loss gradient, token by token (A = 0, on-policy): the reverse-KL estimators give
    beta * (log pi - log ref), k3 gives beta * (1 - ref/pi), each times grpo.py's 1/|o_i| 1/B; losses/kl is the
    estimator's value (k3's for all but k2)."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    logp = old.clone().requires_grad_(True)
    beta = 0.5
    loss, means, _ = loss_of(grpo_kl, logp, old, torch.zeros(1), torch.ones(1, 3), ref, beta=beta,
                             kl_estimator=estimator)
    (grad,) = torch.autograd.grad(loss, logp)
    delta = old - ref
    expected = beta * delta if estimator != "k3" else beta * (1 - torch.exp(-delta))  # d k3 / d logp = 1 - ref/pi
    assert torch.allclose(grad, expected / 3, atol=1e-6)
    value = 0.5 * delta ** 2 if estimator == "k2" else torch.exp(-delta) - 1 + delta
    assert means["losses/kl"].item() == pytest.approx(value.mean().item(), abs=1e-6)
    assert loss.item() == pytest.approx(beta * value.mean().item(), abs=1e-6)


def test_k3_importance_weighted_is_differentiable_through_the_ratio():
    """Off-policy (logp != old), rho * k3 still gives the reverse-KL gradient: rho * k3 + rho * (1 - ref/pi)."""
    old = torch.tensor([[-1.2]])
    ref = torch.tensor([[-1.5]])
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, means, _ = loss_of(grpo_kl, logp, old, torch.zeros(1), torch.ones(1, 1), ref, beta=1.0,
                             kl_estimator="k3_is")
    (grad,) = torch.autograd.grad(loss, logp)
    rho, x = math.exp(-1.0 + 1.2), -1.5 + 1.0
    k3 = math.exp(x) - x - 1
    assert grad.item() == pytest.approx(rho * k3 + rho * (1 - math.exp(x)), abs=1e-6)
    assert means["losses/kl"].item() == pytest.approx(rho * k3, abs=1e-6)  # the importance-weighted value
    detached = grpo_kl.kl_term(logp, ref, old, "k3+")  # without the ratio: k3's value, the on-policy gradient
    assert torch.autograd.grad(detached.sum(), logp)[0].item() == pytest.approx(-1.0 + 1.5)  # delta


def test_k1_reward_puts_no_kl_in_the_loss():
    """--kl_estimator k1_reward: the KL is paid from the rewards before the advantages (main), so the loss is the
    policy term alone, whatever beta and pi_ref, and logs no losses/kl of its own."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    logp = (old + 0.1).requires_grad_(True)
    adv = torch.tensor([0.7])
    loss, means, _ = loss_of(grpo_kl, logp, old, adv, torch.ones(1, 3), ref, beta=0.5, kl_estimator="k1_reward")
    plain, _, _ = loss_of(grpo_kl, logp, old, adv, torch.ones(1, 3), None, beta=0.0)
    assert loss.item() == pytest.approx(plain.item())
    assert torch.equal(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(plain, logp)[0])
    assert "losses/kl" not in means
    loss, _, _ = loss_of(grpo_kl, logp, old, adv, torch.ones(1, 3), None, beta=0.5, kl_estimator="k1_reward")
    assert loss.item() == pytest.approx(plain.item())  # no pi_ref needed in the loss


def test_the_docstrings_worked_example():
    """log pi = -1, log ref = -2 (delta = 1): k3 = e^-1 - 1 + 1 = 0.368, gradient 1 - e^-1 = 0.632; k2 = 0.5,
    gradient delta = 1."""
    ref = torch.tensor(-2.0)
    for estimator, value, gradient in (("k3", 0.368, 0.632), ("k2", 0.5, 1.0), ("k3+", 0.368, 1.0),
                                       ("k3_is", 0.368, 1.0)):
        logp = torch.tensor(-1.0, requires_grad=True)
        kl = grpo_kl.kl_term(logp, ref, logp.detach(), estimator)
        (grad,) = torch.autograd.grad(kl, logp)
        assert (kl.item(), grad.item()) == pytest.approx((value, gradient), abs=5e-4), estimator
    logp = torch.tensor(-1.0)
    assert kl_k3(logp, ref).item() == pytest.approx(math.exp(-1), abs=1e-6)
    assert kl_k2(logp, ref).item() == 0.5
    text = " ".join(grpo_kl.__doc__.split())
    assert "k3 = e^-1 - 1 + 1 = 0.368" in text and "1 - e^-1 = 0.632" in text and "k2 = 0.5 with gradient delta = 1" \
        in text


def test_arguments():
    assert resolved(grpo_kl).kl_estimator == "k2"  # the default: the reverse KL's gradient
    assert resolved(grpo_kl, kl_estimator="k1_reward", beta=0.1).kl_estimator == "k1_reward"


@pytest.mark.slow
def test_kl_in_the_reward_end_to_end(tmp_path):
    """--kl_estimator k1_reward: each completion's detached k1 sum is subtracted from its reward and logged as
    losses/kl: 0 while the policy is the reference (step 1), not once it has moved."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--kl_estimator", "k1_reward", "--beta", "0.1",
                        "--learning_rate", "3e-3", *SMALL], tmp_path, script="grpo_kl.py")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["losses/kl"] == pytest.approx(0, abs=1e-6) and abs(rows[1]["losses/kl"]) > 1e-6, rows


@pytest.mark.slow
def test_k3_is_end_to_end(tmp_path):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--kl_estimator", "k3_is", "--learning_rate",
                        "3e-3", *SMALL], tmp_path, script="grpo_kl.py")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["losses/kl"] == pytest.approx(0, abs=1e-6) and rows[1]["losses/kl"] > 1e-6, rows
