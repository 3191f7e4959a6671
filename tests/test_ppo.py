"""ppo.py: GAE and the per-token rewards against hand values (masks, a sequence that ends
before the batch's longest), the clipped value loss, the whitening, the policy loss and its gradient against a loop,
the on-policy identity, the adaptive KL controller, the zero-initialized critic, exact resume (critic, its optimizer
and beta restored) and end-to-end runs with 1 and 2 processes."""

import json

import pytest
import torch

import ppo
from tests.helpers import assert_same_loss_and_gradient, loss_of, resolved, run_grpo, two_processes
from tests.test_grpo_loss import random_batch
from tests.test_reinforce_pp import reference_loss  # the token-level surrogate as loops
from utils.rl import explained_variance, masked_whiten, token_rewards

def assert_close(tensor, expected, atol=1e-6):
    expected = torch.tensor(expected, dtype=tensor.dtype)
    assert torch.allclose(tensor, expected, atol=atol), (tensor, expected)


PPO_SMALL = ["--prompts_per_step", "8", "--micro_batch_size", "2", "--eval_size", "16", "--eval_samples", "2",
             "--log_completions_every", "1"]  # 8 completions a step: 2 epochs of 2 mini-batches of 4


def test_reward_assembly_and_gae_reference_numbers():  # by hand: r_t, delta_t, A_t = delta_t + gamma lambda A_{t+1}
    logp, ref = torch.tensor([[-1, -0.5, -2, -0.3]]), torch.tensor([[-1.2, -0.5, -1, -0.4]])
    mask, values = torch.ones(1, 4), torch.tensor([[0.2, 0.3, 0.5, 0.6]])
    rewards = token_rewards(torch.tensor([1.0]), mask, logp - ref, beta=0.1)  # k1 on every token, score on the last
    assert_close(rewards, [[-0.02, 0.0, 0.1, 0.99]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert_close(advantages, [[0.784876, 0.741975, 0.5705, 0.39]])
    assert_close(returns, [[0.984876, 1.041975, 1.0705, 0.99]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(advantages, [[0.87, 0.79, 0.59, 0.39]])
    assert_close(returns, [[1.07, 1.09, 1.09, 0.99]])


def test_gae_stops_at_the_end_of_a_shorter_sequence():
    """Row 2 ends after 2 tokens: its score sits on token 2, nothing after it is rewarded, and whatever the critic says
    on padding does not leak into the advantages (V after the last token is 0)."""
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    kl = torch.full((2, 4), 0.5)
    rewards = token_rewards(torch.tensor([1.0, 2.0]), mask, kl, beta=0.1)
    assert_close(rewards, [[-0.05, -0.05, -0.05, 0.95], [-0.05, 1.95, 0, 0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 99.0, -99.0]])  # garbage on row 2's padding
    advantages, returns = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand, row 2: delta_2 = 1.95 - 0.6, delta_1 = -0.05 + 0.9 * 0.6 - 0.5, A_1 = delta_1 + 0.72 * A_2
    a2 = 1.95 - 0.6
    assert advantages[1].tolist() == pytest.approx([-0.05 + 0.54 - 0.5 + 0.72 * a2, a2, 0, 0], abs=1e-6)
    assert returns[1].tolist() == pytest.approx([advantages[1, 0].item() + 0.5, a2 + 0.6, 0, 0], abs=1e-6)
    a4 = 0.95 - 0.4  # row 1 is unaffected by row 2
    assert advantages[0, 3].item() == pytest.approx(a4) and returns[0, 3].item() == pytest.approx(0.95)


def test_value_loss_and_its_clipping():
    """V_old = 0.2, target 1, c = 0.2: V = 0.3 is inside the clip range (gradient V - R = -0.7); V = 0.5 is clipped
    to 0.4, whose error is larger, so the max takes the clipped branch and the gradient is 0."""
    old, target, mask = torch.tensor([[0.2, 0.2]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    values = torch.tensor([[0.3, 0.5]], requires_grad=True)
    loss, means = ppo.value_loss(values, old, target, mask, 0.2, mask.sum())
    assert loss.item() == pytest.approx((0.5 * 0.49 + 0.5 * 0.36) / 2)
    (grad,) = torch.autograd.grad(loss, values)
    assert_close(grad, [[-0.7 / 2, 0.0]])
    assert means["critic/value_clip_frac"].item() == 0.5
    # a padded token adds nothing; the normalizer is the global token count when given
    loss, _ = ppo.value_loss(values, old, target, torch.tensor([[1.0, 0.0]]), 0.2, 4)
    assert loss.item() == pytest.approx(0.5 * 0.49 / 4)


def test_advantage_whitening_over_the_batch_tokens():
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    advantages = torch.tensor([[1.0, 2, 3, 4], [5, 6, 100, 100]])
    whitened = masked_whiten(advantages, mask) * mask
    valid = whitened[mask.bool()]
    assert valid.mean().item() == pytest.approx(0, abs=1e-6) and valid.std().item() == pytest.approx(1, abs=1e-4)
    assert whitened[1, 2:].tolist() == [0, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_and_gradient_match_a_per_token_loop(seed):
    logp, old, _, _, mask = random_batch(seed)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    loss, _, _ = loss_of(ppo, logp, old, adv, mask)
    assert_same_loss_and_gradient(loss, reference_loss(logp, old, adv, mask, 0.2), logp)


def test_on_policy_identity():
    _, old, _, _, mask = random_batch(0)
    adv = torch.randn(mask.shape)
    logp = old.clone().requires_grad_(True)
    loss, means, maxes = loss_of(ppo, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -adv * mask / mask.sum(), atol=1e-7)
    assert means["policy/clip_frac"].item() == 0 and maxes["policy/ratio_max"].item() == 1.0


def test_the_docstrings_worked_example():
    """gamma = lam = 1, beta = 0, reward 1 on 3 tokens: V_old = 0 gives A = (1, 1, 1); V_old = (0.5, 0.6, 0.8) gives
    A = (0.5, 0.4, 0.2), returns (1, 1, 1)."""
    mask = torch.ones(1, 3)
    rewards = token_rewards(torch.tensor([1.0]), mask)
    assert ppo.gae(rewards, torch.zeros(1, 3), mask, 1.0, 1.0)[0].tolist() == [[1.0, 1.0, 1.0]]
    advantages, returns = ppo.gae(rewards, torch.tensor([[0.5, 0.6, 0.8]]), mask, 1.0, 1.0)
    assert_close(advantages, [[0.5, 0.4, 0.2]])
    assert_close(returns, [[1.0, 1.0, 1.0]])
    assert "A = (0.5, 0.4, 0.2) and returns (1, 1, 1)" in ppo.__doc__


def test_explained_variance():
    mask = torch.tensor([[1.0, 1, 1, 0]])
    returns = torch.tensor([[1.0, 2, 3, 50]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0, abs=1e-9)
    assert explained_variance(torch.zeros_like(returns), returns, mask) == pytest.approx(0.0, abs=1e-9)


def test_kl_controller():
    fixed = ppo.KLController(0.05, target=0.0, horizon=10000)
    fixed.update(100.0, 256)
    assert fixed.beta == 0.05
    adaptive = ppo.KLController(0.1, target=6.0, horizon=10000)
    adaptive.update(12.0, 500)  # KL twice the target: the error is clipped at +0.2
    assert adaptive.beta == pytest.approx(0.1 * (1 + 0.2 * 500 / 10000))
    adaptive.update(5.4, 1000)  # 10 % below the target
    assert adaptive.beta == pytest.approx(0.1 * 1.01 * (1 - 0.1 * 0.1))
    restored = ppo.KLController(0.1, 6.0, 10000)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.beta == adaptive.beta


def test_the_critic_starts_at_zero_with_the_policy_backbone():
    from transformers import AutoModelForCausalLM

    args = resolved(ppo)
    critic = ppo.load_critic(args.model).eval()
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    batch = ppo.Batch(torch.tensor([[5, 6, 7, 8, 9]]), torch.ones(1, 5, dtype=torch.long), 2, torch.ones(1, 3),
                      torch.zeros(1, 3))
    assert ppo.token_values(critic, batch).tolist() == [[0.0, 0.0, 0.0]]  # one value per completion token
    assert torch.equal(critic.model.layers[0].mlp.up_proj.weight, policy.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("overrides, message", [
    ({"lam": 1.5}, "--gamma and --lam must be in [0, 1]"),
    ({"value_clip": -1.0}, "--value_clip -1.0: must be >= 0"),
    ({"kl_target": 6.0, "beta": 0.0}, "pass --beta > 0"),
])
def test_bad_arguments(overrides, message):
    with pytest.raises(ValueError) as error:
        resolved(ppo, **overrides)
    assert message in str(error.value)
    assert resolved(ppo, learning_rate=3e-4).critic_learning_rate == 3e-4  # None: the policy's


@pytest.mark.slow
def test_one_process_and_exact_resume(tmp_path):
    """Resume restores the policy, the critic, both optimizers, beta and the RNG: a run stopped after step 2 and
    resumed logs the same steps 3 and 4 as a straight run (adaptive KL on, so beta changes every step)."""
    flags = ["--eval_every", "0", "--kl_target", "0.5", "--kl_horizon", "100", *PPO_SMALL]
    _, rows = run_grpo(["--total_steps", "2", "--save_every", "2", *flags], tmp_path, script="ppo.py")
    _, rows = run_grpo(["--total_steps", "4", "--resume", *flags], tmp_path, script="ppo.py")
    _, straight = run_grpo(["--total_steps", "4", "--exp_name", "straight", *flags], tmp_path, script="ppo.py")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["policy/first_minibatch_ratio_dev_max"] == 0.0
        for key in ("critic/value_loss", "critic/explained_variance", "critic/value_clip_frac", "critic/return_mean",
                    "critic/advantage_mean", "policy/kl_coef", "losses/kl"):
            assert key in r, key
    assert rows[0]["policy/kl_coef"] == 0.01 and rows[3]["policy/kl_coef"] != 0.01  # adapted
    for key in ("charts/reward", "losses/policy", "critic/value_loss", "policy/kl_coef", "policy/grad_norm"):
        assert [r[key] for r in rows[2:]] == pytest.approx([r[key] for r in straight[2:]], rel=1e-5), key


@pytest.mark.slow
def test_two_processes(tmp_path):
    launcher = two_processes(29535)
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", "--save_every", "2", *PPO_SMALL], tmp_path,
                       launcher=launcher, script="ppo.py")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["eval/problems"] == 16
    assert all(r["policy/first_minibatch_ratio_dev_max"] == 0.0 for r in rows)
    assert (tmp_path / "ppo__1" / "checkpoint" / "model_1.safetensors").exists()  # the critic is checkpointed
    assert json.load(open(tmp_path / "ppo__1" / "checkpoint" / "step.json"))["step"] == 2
