"""lite_ppo.py (arXiv 2508.08221): group-mean / batch-std advantages against hand values, the token-level loss, and a
short run end to end."""

import pytest
import torch

import grpo
import lite_ppo
from tests.helpers import SMALL, loss_of, resolved, run_grpo


def advantages(rewards, num_generations, eps=1e-6):
    return lite_ppo.compute_advantages(torch.tensor(rewards), lite_ppo.Args(num_generations=num_generations,
                                                                            adv_eps=eps))


def test_batch_std_scaling_by_hand():
    """(R - mean of the group) / (unbiased std of the whole batch + eps): the batch [1, 0, 0, 0, 1, 1, 1, 0] has mean
    0.5 and std sqrt(2 / 7) = 0.534522; the groups' centered rewards are (0.75, -0.25, ...) and (0.25, ..., -0.75)."""
    got = advantages([1.0, 0, 0, 0, 1, 1, 1, 0], 4, eps=0.0)
    assert got.tolist() == pytest.approx([1.403122, -0.467707, -0.467707, -0.467707, 0.467707, 0.467707, 0.467707,
                                          -1.403122], abs=1e-6)
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    centered = rewards - rewards.mean(1, keepdim=True)
    assert torch.allclose(got, (centered / rewards.std()).view(-1))
    # grpo.py divides by each group's own std instead: the two groups get mirror-image advantages
    assert grpo.compute_advantages(rewards.view(-1), grpo.Args(num_generations=4)).tolist() == pytest.approx(
        [1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5], abs=1e-5)


def test_the_docstrings_worked_example():
    """Two groups of G = 2 with rewards (1, 0) and (1, 1): batch std 0.5, so A = (1, -1) and (0, 0) (grpo.py:
    (0.707, -0.707) and (0, 0))."""
    assert advantages([1.0, 0, 1, 1], 2).tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert grpo.compute_advantages(torch.tensor([1.0, 0, 1, 1]), grpo.Args(num_generations=2)).tolist() == \
        pytest.approx([0.707107, -0.707107, 0.0, 0.0], abs=1e-5)
    assert "A = (1, -1) and (0, 0)" in lite_ppo.__doc__ and "(0.707, -0.707) and\n(0, 0)" in lite_ppo.__doc__


@pytest.mark.parametrize("value, size", [(0.1, 8), (1.1, 12), (0.1, 3), (1 / 3, 7)])
def test_all_equal_group_gets_exactly_zero_advantage(value, size):
    """float32: the mean of 8 x 0.1 is 1 ulp off, and / (batch std + eps) made it a small non-zero advantage."""
    got = advantages([value] * size + [0.0] + [1.0] * (size - 1), size)
    assert got[:size].tolist() == [0.0] * size
    assert got[size:].abs().sum() > 0


def test_token_mean_loss_by_hand():
    """Every token of the mini-batch weighs the same: completions of 1 and 3 tokens with A = 1 and -1, on-policy:
    loss = -(1 * 1 - 1 * 3) / 4 = 0.5 and d loss / d log pi = -A / 4 on each token (grpo.py: -A / (|o_i| B)); no KL
    term by default (no reference model)."""
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    old = -torch.rand(2, 3)
    logp = old.clone().requires_grad_(True)
    assert lite_ppo.Args().beta == 0.0
    loss, means, _ = loss_of(lite_ppo, logp, old, torch.tensor([1.0, -1.0]), mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.5)
    assert torch.allclose(grad, torch.tensor([[-0.25, 0, 0], [0.25, 0.25, 0.25]]))
    assert "losses/kl" not in means
    grpo_loss, _, _ = loss_of(grpo, logp, old, torch.tensor([1.0, -1.0]), mask, beta=0.0)
    assert torch.allclose(torch.autograd.grad(grpo_loss, logp)[0], torch.tensor([[-0.5, 0, 0], [1 / 6] * 3]))


def test_arguments():
    assert resolved(lite_ppo).adv_eps == 1e-6
    with pytest.raises(ValueError, match="groups of >= 2 completions are needed"):
        resolved(lite_ppo, num_generations=1)


@pytest.mark.slow
def test_end_to_end(tmp_path):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", *SMALL], tmp_path, script="lite_ppo.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "losses/kl" not in r and r["losses/entropy"] > 0 and "charts/reward" in r
