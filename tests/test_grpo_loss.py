"""grpo.compute_loss against hand values, gradients, and an independent per-sample reference written here."""

import math

import pytest
import torch

from grpo import compute_advantages, compute_loss
from utils.rl import engine_is_weights


def reference_grpo_loss(logp, old_logp, ref_logp, adv, mask, eps_low, eps_high, beta):
    """The paper's J written as loops: (1/G) sum_i (1/|o_i|) sum_t [min(r A, clip(r) A) - beta k3]; loss = -J."""
    total = 0.0
    for i in range(len(adv)):
        n_i = int(sum(mask[i]))
        seq = 0.0
        for t in range(n_i):
            r = torch.exp(logp[i][t] - old_logp[i][t])
            surrogate = torch.min(r * adv[i], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i])
            x = ref_logp[i][t] - logp[i][t]
            seq = seq + surrogate - beta * (torch.exp(x) - x - 1)
        total = total + seq / n_i
    return -total / len(adv)


def random_batch(seed, B=5, T=6, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + spread * torch.randn(B, T, generator=g)).requires_grad_(True)
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.randn(B, generator=g)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_low, eps_high, beta", [(0.2, 0.2, 0.04), (0.2, 0.28, 0.0), (0.1, 0.3, 0.5)])
def test_loss_and_gradient_match_per_sample_reference(seed, eps_low, eps_high, beta):
    logp, old, ref, adv, mask = random_batch(seed)
    loss, _, _ = compute_loss(logp, old, adv, mask, ref, clip_eps_low=eps_low, clip_eps_high=eps_high, beta=beta,
                           kl_estimator="k3", loss_agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    expected = reference_grpo_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)


def test_on_policy_identity_and_gradient_by_hand():
    """ratio = 1: loss = -mean_i A_i = 0 for z-scored groups, yet d loss / d logp_it = -A_i / (|o_i| B)."""
    adv = compute_advantages(torch.tensor([1.0, 0, 0, 0]), 4, "group", 1e-6)
    lengths = torch.tensor([2, 4, 1, 3])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()
    old = -torch.rand(4, 4)
    logp = old.clone().requires_grad_(True)
    loss, metrics, maxes = compute_loss(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    assert torch.allclose(grad, -(adv / (lengths * 4))[:, None] * mask, atol=1e-7)
    assert grad.abs().sum() > 0  # "loss 0" is not "no gradient"


@pytest.mark.parametrize("ratio, adv, eps_high, loss_value, grad_flows", [  # PPO's clip, arXiv 1707.06347 eq. 7
    (1.25, 1.0, 0.2, -1.2, False),   # A > 0 above 1 + eps: clipped, no gradient
    (1.25, 1.0, 0.28, -1.25, True),  # DAPO's clip-higher lets it through
    (1.3, 1.0, 0.28, -1.28, False),
    (0.5, 1.0, 0.2, -0.5, True),     # A > 0 below 1 - eps: the min keeps the unclipped term
    (0.5, -1.0, 0.2, 0.8, False),    # A < 0 below 1 - eps: clipped, no gradient
    (5.0, -1.0, 0.2, 5.0, True),     # A < 0 far above: unbounded and the gradient flows (no dual clip)
    (1.1, -1.0, 0.2, 1.1, True),
])
def test_off_policy_clipping(ratio, adv, eps_high, loss_value, grad_flows):
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss, metrics, maxes = compute_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), clip_eps_high=eps_high)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(loss_value, abs=1e-5)
    assert (grad.abs().item() > 0) == grad_flows
    assert metrics["policy/clip_frac"].item() == (0.0 if grad_flows else 1.0)


@pytest.mark.parametrize("mode, per_token_weight", [
    ("seq-mean-token-mean", lambda n, B, N, L: 1 / (n * B)),
    ("token-mean", lambda n, B, N, L: 1 / N),
    ("seq-mean-token-sum", lambda n, B, N, L: 1 / B),
    ("seq-mean-token-sum-norm", lambda n, B, N, L: 1 / (B * L)),
])
def test_aggregation_modes_weight_tokens_as_documented(mode, per_token_weight):
    lengths = torch.tensor([1, 3, 6])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    old = torch.zeros(3, 6)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, 1.0])
    loss, _, _ = compute_loss(logp, old, adv, mask, loss_agg=mode, max_len=8)
    (grad,) = torch.autograd.grad(loss, logp)
    for i, n in enumerate(lengths.tolist()):
        assert grad[i, 0].item() == pytest.approx(-per_token_weight(n, 3, 10, 8), rel=1e-6)


@pytest.mark.parametrize("estimator, reverse_kl", [("k3", False), ("k2", True), ("k3+", True), ("k3_is", True)])
def test_kl_estimators_in_the_loss(estimator, reverse_kl):
    """The KL part of the loss gradient, token by token: the reverse-KL estimators give beta * (logp - ref)."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    logp = old.clone().requires_grad_(True)
    beta = 0.5
    loss, metrics, maxes = compute_loss(logp, old, torch.zeros(1), torch.ones(1, 3), ref, beta=beta, kl_estimator=estimator,
                                 loss_agg="seq-mean-token-sum")
    (grad,) = torch.autograd.grad(loss, logp)
    delta = old - ref
    expected = beta * delta if reverse_kl else beta * (1 - torch.exp(-delta))  # d k3 / d logp = 1 - ref/pi
    assert torch.allclose(grad, expected, atol=1e-6)
    assert metrics["losses/kl"].item() == pytest.approx((torch.exp(-delta) - 1 + delta).mean().item(), abs=1e-6) \
        or estimator == "k2"


def test_k3_importance_weighted_is_differentiable_through_the_ratio():
    """Off-policy (logp != old), rho * k3 still gives the reverse-KL gradient rho * (k3 + 1 - ref/pi)... per token."""
    old = torch.tensor([[-1.2]])
    ref = torch.tensor([[-1.5]])
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, _, _ = compute_loss(logp, old, torch.zeros(1), torch.ones(1, 1), ref, beta=1.0, kl_estimator="k3_is")
    (grad,) = torch.autograd.grad(loss, logp)
    rho, x = math.exp(-1.0 + 1.2), -1.5 + 1.0
    k3 = math.exp(x) - x - 1
    assert grad.item() == pytest.approx(rho * k3 + rho * (1 - math.exp(x)), abs=1e-6)


def test_truncated_importance_weights_scale_the_policy_term():
    old = torch.zeros(2, 2)
    logp = old.clone().requires_grad_(True)
    weights = torch.tensor([[0.5, 2.0], [1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, _, _ = compute_loss(logp, old, adv, torch.ones(2, 2), is_weights=weights, loss_agg="token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -(weights * adv[:, None]) / 4)


@pytest.mark.parametrize("mode, weights, bounded", [  # ratios 2, 1/4, 1 and 6/5 (then padding); cap 3/2
    ("token-truncate", [[1.5, 0.25, 1.0], [1.2, 0.0, 0.0]], [[1, 0, 0], [0, 0, 0]]),
    ("token-mask", [[0.0, 0.0, 1.0], [1.2, 0.0, 0.0]], [[1, 1, 0], [0, 0, 0]]),  # kept in [2/3, 3/2]
    ("seq-truncate", [[0.5, 0.5, 0.5], [1.2, 0.0, 0.0]], [[0, 0, 0], [0, 0, 0]]),  # rho = 2 * 1/4 * 1 = 1/2
    ("seq-mask", [[0.0, 0.0, 0.0], [1.2, 0.0, 0.0]], [[1, 1, 1], [0, 0, 0]]),  # 1/2 < 2/3: the sequence is dropped
])
def test_engine_mismatch_weights_each_mode_by_hand(mode, weights, bounded):
    engine = torch.tensor([[0.0, 0.0, 0.0], [0.0, 5.0, -5.0]])  # padding holds anything
    old = engine + torch.log(torch.tensor([[2.0, 0.25, 1.0], [1.2, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    got, got_bounded = engine_is_weights(old, engine, mask, 1.5, mode)
    assert torch.allclose(got * mask, torch.tensor(weights), atol=1e-6)
    assert got_bounded.tolist() == torch.tensor(bounded).bool().tolist()
    logp = old.clone().requires_grad_(True)  # on-policy for the trainer: the gradient is the weight times A / N
    adv = torch.tensor([1.0, -1.0])
    loss, _, _ = compute_loss(logp, old, adv, mask, is_weights=got, loss_agg="token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -(torch.tensor(weights) * adv[:, None]) / 4, atol=1e-6)  # masked tokens: 0


def test_a_long_sequence_ratio_does_not_overflow():
    old, engine, mask = torch.full((1, 4000), 0.1), torch.zeros(1, 4000), torch.ones(1, 4000)  # rho = e^400
    for mode in ("seq-truncate", "seq-mask"):
        weights, bounded = engine_is_weights(old, engine, mask, 2.0, mode)
        assert torch.isfinite(weights).all() and bounded.all()
    with pytest.raises(ValueError, match="unknown importance-sampling mode 'token'"):
        engine_is_weights(old, engine, mask, 2.0, "token")


def test_group_advantages_from_flat_rewards():
    adv = compute_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0]), 4, "group", 1e-6)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5], abs=1e-5)
    dr = compute_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0]), 4, "none", 1e-6)
    assert dr.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
