"""aspo.py (arXiv 2510.06062): the loss and its gradient against the paper's per-token rule written as a loop here,
reference numbers computed by hand, the on-policy identity with GRPO, the off-policy cases that tell it apart, the
argument check and a short end-to-end run."""

import math

import pytest
import torch

import aspo
import grpo
import lite_ppo
from tests.helpers import SMALL, assert_same_loss_and_gradient, loss_of, run_grpo
from tests.test_grpo_loss import random_batch


def reference_aspo_loss(logp, old_logp, adv, mask, eps_low, eps_high, c):
    """Token by token, the paper's rule as its authors' code computes it (token-mean, loss = -J): r = pi/pi_old,
    A >= 0: r_hat = min(r, 1 + eps_high), term -A * r_hat / sg(r_hat)^2 (value -A / r_hat, gradient -A / r);
    A < 0: r_hat = max(r, 1 - eps_low), term -A * r_hat (PPO's clipped surrogate);
    and where the weight (1 / r_hat for A >= 0, r_hat for A < 0) exceeds c, the term is -c * A * log pi instead."""
    total, count = 0.0, 0
    for i in range(len(adv)):
        for t in range(int(mask[i].sum())):
            r = torch.exp(logp[i][t] - old_logp[i][t])
            if adv[i] >= 0:
                r_hat = torch.clamp(r, max=1 + eps_high)
                weight, term = 1 / r_hat.item(), -adv[i] * r_hat / r_hat.detach() ** 2
            else:
                r_hat = torch.clamp(r, min=1 - eps_low)
                weight, term = r_hat.item(), -adv[i] * r_hat
            total = total + (-c * adv[i] * logp[i][t] if weight > c else term)
            count += 1
    return total / count


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_low, eps_high, c, spread", [(0.2, 0.2, 3.0, 0.3), (0.2, 0.28, 3.0, 1.5),
                                                          (0.1, 0.4, 1.5, 1.0)])
def test_loss_and_gradient_match_the_paper(seed, eps_low, eps_high, c, spread):
    """Spreads up to 1.5 nats put tokens in every region: flipped, clipped, and dual-clipped on both signs."""
    logp, old, _, adv, mask = random_batch(seed, spread=spread)
    loss, _, _ = loss_of(aspo, logp, old, adv, mask, clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=c,
                         beta=0.0)
    assert_same_loss_and_gradient(loss, reference_aspo_loss(logp, old, adv, mask, eps_low, eps_high, c), logp, 1e-6)


@pytest.mark.parametrize("adv, ratio, loss_value, grad, region", [
    (1.0, 0.8, -1.25, -1.25, "flipped: weight 1/r"),
    (1.0, 1.1, -1 / 1.1, -1 / 1.1, "flipped: weight 1/r"),
    (1.0, 1.5, -1 / 1.2, 0.0, "clipped at 1 + eps: no gradient"),
    (1.0, 0.2, -3 * math.log(0.1), -3.0, "dual: 1/r = 5 > 3, -c A log pi"),
    (-1.0, 0.7, 0.8, 0.0, "clipped at 1 - eps: no gradient"),
    (-1.0, 2.0, 2.0, 2.0, "ordinary: weight r"),
    (-1.0, 3.5, 3 * math.log(1.75), 3.0, "dual: r = 3.5 > 3, -c A log pi"),
])
def test_reference_numbers(adv, ratio, loss_value, grad, region):  # hand values, pi_old = 0.5, eps 0.2, c 3
    old = torch.tensor([[math.log(0.5)]])
    logp = torch.tensor([[math.log(0.5 * ratio)]], requires_grad=True)
    loss, means, _ = loss_of(aspo, logp, old, torch.tensor([adv]), torch.ones(1, 1), beta=0.0)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(loss_value, abs=1e-5), region
    assert g.item() == pytest.approx(grad, abs=1e-5), region
    assert means["policy/dual_clip_frac"].item() == float(region.startswith("dual"))
    assert means["policy/clip_frac"].item() == float(region.startswith("clipped"))


def test_on_policy_it_is_grpo_with_token_mean():
    """r = 1: every weight is 1, so ASPO's gradient is GRPO's clipped surrogate with token-mean and the same k3 KL
    term, which is lite_ppo.py's loss."""
    _, old, ref, adv, mask = random_batch(0)
    grads = []
    for module in (aspo, lite_ppo):
        logp = old.clone().requires_grad_(True)
        loss, _, _ = loss_of(module, logp, old, adv, mask, ref, beta=0.04)
        grads.append(torch.autograd.grad(loss, logp)[0])
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_off_policy_the_positive_tokens_weights_are_flipped():
    """A > 0 at r = 0.8 and 1.1: GRPO weighs grad log pi by r (0.8, 1.1), ASPO by 1/r (1.25, 0.909): the token the
    policy made less likely gets the larger push. A < 0 tokens keep GRPO's weight r."""
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(0.8), math.log(1.1)], [math.log(0.9), math.log(1.1)]], requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2)
    g_grpo = torch.autograd.grad(loss_of(grpo, logp, old, adv, mask, beta=0.0)[0], logp)[0]
    g_aspo = torch.autograd.grad(loss_of(aspo, logp, old, adv, mask, beta=0.0)[0], logp)[0]
    assert torch.allclose(g_grpo[0] * 4, torch.tensor([-0.8, -1.1]), atol=1e-6)
    assert torch.allclose(g_aspo[0] * 4, torch.tensor([-1 / 0.8, -1 / 1.1]), atol=1e-6)
    assert torch.allclose(g_aspo[1], g_grpo[1], atol=1e-7)


def test_dual_clip_keeps_the_gradient_ppo_dual_clip_would_cut():
    """A < 0, r = 5: the weight is capped at c = 3 and the token still gets the gradient -c A (not 0, not -A r)."""
    old = torch.zeros(1, 1)
    logp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    (g,) = torch.autograd.grad(loss_of(aspo, logp, old, torch.tensor([-2.0]), torch.ones(1, 1), beta=0.0)[0], logp)
    assert g.item() == pytest.approx(6.0)


def test_bad_dual_clip_is_one_line_before_any_model_loads():
    args = aspo.Args(dual_clip_c=1.0)
    with pytest.raises(ValueError, match=r"--dual_clip_c 1.0: must be > 1"):
        aspo.check_algorithm_args(args, 1)


@pytest.mark.slow
def test_script_runs_end_to_end_off_policy(tmp_path):
    """Four mini-batches per rollout (the default): the first is on-policy (ratio exactly 1), the later ones are not."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", *SMALL, "--micro_batch_size", "4"], tmp_path,
                       script="aspo.py")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy/first_minibatch_ratio_dev_max"] == 0.0 for r in rows)
    assert max(r["policy/ratio_max"] for r in rows) > 1.0 and "policy/dual_clip_frac" in rows[0]
    assert rows[0]["losses/kl"] >= 0 and "eval/pass@1_greedy" in rows[1]
    assert (tmp_path / "aspo__1" / "final" / "model.safetensors").exists()
