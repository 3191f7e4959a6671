"""reinforce_pp.py: return-to-go with the KL in the reward, global token-weighted whitening (hand values),
the per-token loss and its gradient against a per-sample reference, the on-policy identity, and an end-to-end run."""

import math

import pytest
import torch

import reinforce_pp as rpp
from tests.helpers import SMALL, assert_same_loss_and_gradient, loss_of, run_grpo
from tests.test_grpo_loss import random_batch
from utils.rl import masked_whiten


def lengths_mask(lengths, width):
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).double()


def test_return_to_go_with_k1_in_the_reward():
    """Score on the last token, -beta * k1 on every token, summed from t to the end (gamma = 1); nothing after EOS."""
    mask = lengths_mask([3, 1], 4)
    kl = torch.tensor([[0.1, -0.2, 0.3, 9.0], [0.5, 9.0, 9.0, 9.0]], dtype=torch.float64)  # 9.0: padding, ignored
    adv = rpp.compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), mask, kl, rpp.Args(beta=0.5))
    assert adv[0].tolist() == pytest.approx([1 - 0.5 * 0.2, 1 - 0.5 * 0.1, 1 - 0.5 * 0.3, 0.0])
    assert adv[1].tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.0])
    no_kl = rpp.compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), mask, None, rpp.Args())
    assert no_kl[0].tolist() == [1.0, 1.0, 1.0, 0.0]  # without KL every token of a sequence gets its score


@pytest.mark.parametrize("unbiased, expected", [  # hand values; groups of lengths 2, 4, 6, 8 and 3, 3, 3, 3
    (False, [2.323790, -0.430331, 0.946729, -1.807392]),  # OpenRLHF (population variance)
    (True, [2.287193, -0.423554, 0.931819, -1.778928]),  # verl masked_whiten (Bessel on 32 tokens)
])
def test_baseline_advantages_reference_numbers(unbiased, expected):
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float64)
    mask = lengths_mask([2, 4, 6, 8, 3, 3, 3, 3], 8)
    centered = rpp.compute_advantages(rewards, mask, None, rpp.Args(num_generations=4, baseline=True))
    assert centered[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    adv = masked_whiten(centered, mask, unbiased=unbiased, eps=0.0, all_reduce=lambda sums: sums)  # one process
    assert adv[[0, 1, 4, 7], 0].tolist() == pytest.approx(expected, abs=1e-5)


def reference_loss(logp, old_logp, adv, mask, eps):
    """Token-level PPO surrogate with per-token advantages, as loops: -(1/N) sum_{i,t} min(r A_it, clip(r) A_it)."""
    total, count = 0.0, 0
    for i in range(len(adv)):
        for t in range(int(mask[i].sum())):
            r = torch.exp(logp[i][t] - old_logp[i][t])
            total = total + torch.min(r * adv[i][t], torch.clamp(r, 1 - eps, 1 + eps) * adv[i][t])
            count += 1
    return -total / count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_with_per_token_advantages(seed):
    logp, old, _, _, mask = random_batch(seed)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 10))
    loss, _, _ = loss_of(rpp, logp, old, adv, mask)
    assert_same_loss_and_gradient(loss, reference_loss(logp, old, adv, mask, 0.2), logp, 1e-7)


def test_on_policy_gradient_and_tokens_of_one_sequence_differ():
    """On-policy the gradient is -A_it / N per token; with the KL in the reward, a sequence's tokens get different
    advantages (GRPO gives all of them the same one)."""
    mask = lengths_mask([3, 2], 3).float()
    kl = torch.tensor([[0.4, 0.0, 0.2], [0.1, 0.3, 0.0]])
    adv = rpp.compute_advantages(torch.tensor([1.0, 0.0]), mask, kl, rpp.Args(beta=1.0))
    assert adv[0, 0] != adv[0, 2]
    old = -torch.rand(2, 3)
    logp = old.clone().requires_grad_(True)
    loss, means, _ = loss_of(rpp, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -adv * mask / mask.sum(), atol=1e-7) and means["policy/ratio_mean"].item() == 1.0
    clipped = math.log(1.5)  # off-policy, A > 0 above 1 + eps: the clip drops that token's gradient, as in PPO
    logp = (old + torch.tensor([[clipped, 0, 0], [0, 0, 0]])).requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_of(rpp, logp, old, adv.abs(), mask)[0], logp)
    assert grad[0, 0] == 0 and grad[0, 1] != 0


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--baseline", "--beta", "1e-3"]])
def test_script_runs_end_to_end(tmp_path, flags):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", "--num_minibatches", "2", *SMALL, *flags],
                       tmp_path, script="reinforce_pp.py")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy/first_minibatch_ratio_dev_max"] == 0.0 for r in rows)
    assert ("losses/kl" in rows[0]) == bool(flags)  # k2 loss with --baseline; k1 in the reward otherwise
    assert "eval/pass@1_greedy" in rows[1]


def test_the_docstrings_worked_example():
    """R = 1, k1 = (0.1, 0.2, 0.3), beta 0.01: returns-to-go (0.994, 0.995, 0.997)."""
    adv = rpp.compute_advantages(torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
                                 torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64), rpp.Args(beta=0.01))
    assert adv[0].tolist() == pytest.approx([0.994, 0.995, 0.997])
    assert "(0.994, 0.995, 0.997)" in rpp.__doc__
