"""grpo.compute_loss against hand values, gradients, and an independent per-sample reference written here; each
script's normalizer; the engine/trainer importance weights."""

import importlib
import math

import pytest
import torch

import grpo
from tests.helpers import loss_of
from utils.rl import engine_is_weights


def compute_advantages(rewards, num_generations, eps=1e-6):
    return grpo.compute_advantages(rewards, grpo.Args(num_generations=num_generations, adv_eps=eps))


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
@pytest.mark.parametrize("eps, beta", [(0.2, 0.04), (0.2, 0.0), (0.1, 0.5)])
def test_loss_and_gradient_match_per_sample_reference(seed, eps, beta):
    logp, old, ref, adv, mask = random_batch(seed)
    loss, _, _ = loss_of(grpo, logp, old, adv, mask, ref, clip_eps=eps, beta=beta)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = reference_grpo_loss(logp, old, ref, adv, mask, eps, eps, beta)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)


def test_on_policy_identity_and_gradient_by_hand():
    """ratio = 1: loss = -mean_i A_i = 0 for z-scored groups, yet d loss / d logp_it = -A_i / (|o_i| B)."""
    adv = compute_advantages(torch.tensor([1.0, 0, 0, 0]), 4)
    lengths = torch.tensor([2, 4, 1, 3])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()
    old = -torch.rand(4, 4)
    logp = old.clone().requires_grad_(True)
    loss, metrics, maxes = loss_of(grpo, logp, old, adv, mask, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    assert torch.allclose(grad, -(adv / (lengths * 4))[:, None] * mask, atol=1e-7)
    assert grad.abs().sum() > 0  # "loss 0" is not "no gradient"


@pytest.mark.parametrize("ratio, adv, loss_value, grad_flows", [  # PPO's clip, arXiv 1707.06347 eq. 7
    (1.25, 1.0, -1.2, False),   # A > 0 above 1 + eps: clipped, no gradient (dapo.py's clip-higher: test_dapo.py)
    (0.5, 1.0, -0.5, True),     # A > 0 below 1 - eps: the min keeps the unclipped term
    (0.5, -1.0, 0.8, False),    # A < 0 below 1 - eps: clipped, no gradient
    (5.0, -1.0, 5.0, True),     # A < 0 far above: unbounded and the gradient flows (no dual clip)
    (1.1, -1.0, 1.1, True),
])
def test_off_policy_clipping(ratio, adv, loss_value, grad_flows):
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss, metrics, maxes = loss_of(grpo, logp, old, torch.tensor([adv]), torch.ones(1, 1), beta=0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(loss_value, abs=1e-5)
    assert (grad.abs().item() > 0) == grad_flows
    assert metrics["policy/clip_frac"].item() == (0.0 if grad_flows else 1.0)


@pytest.mark.parametrize("script, per_token_weight", [  # n: the completion's tokens, B completions, N tokens, L_max
    ("grpo", lambda n, B, N, L: 1 / (n * B)),  # 1/G sum_i 1/|o_i| sum_t
    ("gspo", lambda n, B, N, L: 1 / (n * B)),
    ("high_entropy", lambda n, B, N, L: 1 / (n * B)),
    ("calibrated", lambda n, B, N, L: 1 / (n * B)),  # grpo.py's loss; its paper changes the reward
    ("dapo", lambda n, B, N, L: 1 / N),  # token-mean
    ("cispo", lambda n, B, N, L: 1 / N),
    ("aspo", lambda n, B, N, L: 1 / N),
    ("lite_ppo", lambda n, B, N, L: 1 / N),
    ("reinforce_pp", lambda n, B, N, L: 1 / N),
    ("ppo", lambda n, B, N, L: 1 / N),
    ("dr_grpo", lambda n, B, N, L: 1 / (B * L)),  # the constant L_max
])
def test_each_script_weights_tokens_as_its_docstring_says(script, per_token_weight):
    """d loss / d log pi on-policy with A = 1 is minus each token's weight in the normalizer."""
    module = importlib.import_module(script)
    lengths = torch.tensor([1, 3, 6])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    old = torch.zeros(3, 6)
    logp = old.clone().requires_grad_(True)
    flags = {"beta": 0.0} if "beta" in module.Args.__dataclass_fields__ else {}
    loss, _, _ = loss_of(module, logp, old, torch.ones(3), mask, max_new_tokens=8, **flags)
    (grad,) = torch.autograd.grad(loss, logp)
    for i, n in enumerate(lengths.tolist()):
        assert grad[i, 0].item() == pytest.approx(-per_token_weight(n, 3, 10, 8), rel=1e-6)


def test_truncated_importance_weights_scale_the_policy_term():
    """update_policy folds the weight w >= 0 into the advantage: min(r A w, clip(r) A w) = w min(r A, clip(r) A)."""
    for ratio in (0.5, 1.0, 1.3):
        old = torch.zeros(2, 2)
        logp = (old + math.log(ratio)).requires_grad_(True)
        weights = torch.tensor([[0.5, 2.0], [1.0, 0.0]])
        adv = torch.tensor([1.0, -1.0])[:, None].expand(2, 2)
        weighted, _, _ = loss_of(grpo, logp, old, adv * weights, torch.ones(2, 2), beta=0.0)
        per_token = [loss_of(grpo, logp[i:i + 1, t:t + 1], old[i:i + 1, t:t + 1], adv[i:i + 1, t:t + 1],
                             torch.ones(1, 1), beta=0.0)[0] for i in range(2) for t in range(2)]
        expected = sum(w * loss for w, loss in zip(weights.flatten(), per_token)) / 2 / 2  # 1/|o_i| = 1/2, 1/B = 1/2
        (grad,) = torch.autograd.grad(weighted, logp)
        (expected_grad,) = torch.autograd.grad(expected, logp)
        assert weighted.item() == pytest.approx(expected.item(), abs=1e-7)
        assert torch.allclose(grad, expected_grad, atol=1e-7)


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
    adv = torch.tensor([1.0, -1.0])[:, None] * mask
    loss, _, _ = loss_of(importlib.import_module("dapo"), logp, old, adv * got, mask)  # token-mean
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -(torch.tensor(weights) * adv) / 4, atol=1e-6)  # masked tokens: 0


def test_a_long_sequence_ratio_does_not_overflow():
    old, engine, mask = torch.full((1, 4000), 0.1), torch.zeros(1, 4000), torch.ones(1, 4000)  # rho = e^400
    for mode in ("seq-truncate", "seq-mask"):
        weights, bounded = engine_is_weights(old, engine, mask, 2.0, mode)
        assert torch.isfinite(weights).all() and bounded.all()
    with pytest.raises(ValueError, match="unknown importance-sampling mode 'token'"):
        engine_is_weights(old, engine, mask, 2.0, "token")


def test_group_advantages_from_flat_rewards():
    adv = compute_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0]), 4)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5], abs=1e-5)
    dr_grpo = importlib.import_module("dr_grpo")
    dr = dr_grpo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0]), dr_grpo.Args(num_generations=4))
    assert dr.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])


def test_the_docstrings_worked_examples():
    """The numbers grpo.py's and dr_grpo.py's docstrings work out, computed."""
    assert compute_advantages(torch.tensor([1.1, 0, 0, 1.1]), 4).tolist() == pytest.approx(
        [0.866, -0.866, -0.866, 0.866], abs=1e-3)
    assert compute_advantages(torch.tensor([1.1, 0, 0, 0]), 4).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5],
                                                                                          abs=1e-5)
    for text in ("(0.866, -0.866, -0.866, 0.866)", "(1.5, -0.5, -0.5, -0.5)"):
        assert text in grpo.__doc__
    dr_grpo = importlib.import_module("dr_grpo")
    dr = dr_grpo.compute_advantages(torch.tensor([1.1, 0, 0, 1.1]), dr_grpo.Args(num_generations=4))
    assert dr.tolist() == pytest.approx([0.55, -0.55, -0.55, 0.55], abs=1e-6)
    assert "(0.55, -0.55, -0.55, 0.55)" in dr_grpo.__doc__
