"""The reading-list switches of grpo.py (and of the scripts sharing its blocks): GDPO's decoupled reward normalization
(arXiv 2601.05242, against hand values), training on high-entropy tokens only (arXiv 2506.01939), whose threshold
is the whole mini-batch's, whatever the micro-batch size, and grpo.py's Clip-Cov and KL-Cov (arXiv 2505.22617)."""

import copy

import numpy
import pytest
import torch

import grpo
from tests.helpers import SMALL, resolved, run_grpo
from tests.test_engine import rollout, setup
from utils.rl import (covariance_tokens, decoupled_group_advantages, entropy_threshold, group_advantages,
                      linear_quantile)

PARTS = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])  # 2 prompts x G = 2, (accuracy, format)


def test_gdpo_reference_numbers_and_what_grpo_collapses():  # hand values, unbiased std
    grpo_adv = group_advantages((PARTS @ torch.ones(2)).view(2, 2), "group", 1e-4).view(-1)
    assert grpo_adv.tolist() == pytest.approx([-0.707057, 0.707057, -0.707007, 0.707007], abs=1e-6)
    gdpo_adv = decoupled_group_advantages(PARTS, torch.ones(2), 2, eps=1e-4)  # TRL's eps
    assert gdpo_adv.tolist() == pytest.approx([-1.095360, 1.095360, -0.547680, 0.547680], abs=1e-6)
    assert decoupled_group_advantages(PARTS, torch.ones(2), 2, eps=1e-6)[1].item() == pytest.approx(1.095445, abs=1e-6)
    # GRPO gives (1, 1) over (0, 0) the same advantage as (1, 0) over (0, 0); GDPO gives it twice as much
    assert grpo_adv[1].item() == pytest.approx(grpo_adv[3].item(), abs=1e-4)
    assert gdpo_adv[1].item() == pytest.approx(2 * gdpo_adv[3].item(), rel=1e-6)


def test_gdpo_weights_and_equal_groups():
    weighted = decoupled_group_advantages(PARTS, torch.tensor([1.0, 0.1]), 2)
    assert weighted[1] / weighted[3] == pytest.approx(1.1)  # each part's z-score, weighted
    assert decoupled_group_advantages(torch.ones(4, 2), torch.ones(2), 2).tolist() == [0.0] * 4


def test_gdpo_weights_follow_the_rewards_device():  # the weights are built on the CPU, the rewards live on the GPU
    parts = PARTS.to("meta")  # a non-CPU device on any machine: a device mismatch raises as it would on CUDA
    assert decoupled_group_advantages(parts, torch.tensor([1.0, 0.1]), 2).device.type == "meta"


def test_gdpo_arguments():
    assert resolved(grpo, reward_norm="normalize_then_sum").reward_norm == "normalize_then_sum"
    for bad in ({"kl_in_reward": True, "kl_estimator": "k1"}, {"scale_rewards": "none"}):
        with pytest.raises(ValueError, match="normalize_then_sum z-scores each reward in its group"):
            resolved(grpo, reward_norm="normalize_then_sum", **bad)


def test_entropy_threshold_is_the_quantile_of_the_valid_tokens():
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 9.0], [0.6, 0.7, 0.8, 0.9, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])  # the 9.0s are padding
    threshold = entropy_threshold(entropy, mask, 0.2)
    assert threshold.item() == pytest.approx(torch.quantile(torch.arange(1, 10) / 10, 0.8).item())
    kept = (entropy >= threshold) & mask.bool()
    assert kept.sum().item() == 2 and entropy[kept].tolist() == pytest.approx([0.8, 0.9])
    # a second process's tokens (NaN-padded as accelerate pads them) join the quantile
    other = torch.tensor([2.0, 3.0, float("nan")])
    gather = lambda t: torch.cat([t, other])  # noqa: E731
    assert entropy_threshold(entropy, mask, 0.2, gather).item() == pytest.approx(
        torch.quantile(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 2.0, 3.0]), 0.8).item())


@pytest.mark.parametrize("size", [1, 2, 7, 1000, 2**24 + 1])  # torch.quantile refuses more than 2**24 elements
def test_linear_quantile_is_torch_quantile_without_its_size_limit(size):
    values = torch.rand(size, generator=torch.Generator().manual_seed(size))
    for q in (0.0, 0.2, 0.8, 0.999, 1.0):
        # numpy's linear method in float64: float32 values, and an interpolation weight computed in another precision
        # than torch's, agree to float32 rounding, not bit for bit
        expected = numpy.quantile(values.double().numpy(), q)
        assert linear_quantile(values, q).item() == pytest.approx(expected, abs=1e-6)
        if size <= 2**24:
            assert linear_quantile(values, q).item() == pytest.approx(torch.quantile(values, q).item(), abs=1e-6)
    assert linear_quantile(values.to("meta"), 0.8).device.type == "meta"


def test_high_entropy_tokens_only_the_threshold_is_the_mini_batchs():
    """update_policy with --top_entropy_frac 0.2: the same threshold, kept fraction and update for micro-batches of 2,
    4 and 16 (the threshold is taken over the whole mini-batch, not per micro-batch); the kept tokens are the top 20 %
    of pi_old's entropies; and the update differs from training on every token."""
    args, accelerator, tokenizer, model = setup(top_entropy_frac=0.2, max_grad_norm=1e9)
    _, batch, _ = rollout(model, tokenizer, accelerator, 1.0)
    old_logp, old_entropy = grpo.batched_logprobs(model, batch, 1.0, 16, with_entropy=True)
    batch.update(advantages=torch.linspace(-1, 1, len(batch["input_ids"])), ref_logp=old_logp - 0.1,
                 old_logp=old_logp, old_entropy=old_entropy)
    mask = batch["completion_mask"].bool()
    expected = torch.quantile(old_entropy[mask], 0.8)
    updates, stats_seen = [], []
    for micro in (2, 4, 16):
        args.micro_batch_size, policy = micro, copy.deepcopy(model)
        _, stats = grpo.update_policy(args, policy, torch.optim.SGD(policy.parameters(), lr=1.0), dict(batch),
                                      accelerator)
        updates.append(torch.cat([(p0 - p1).detach().flatten() for p0, p1 in zip(model.parameters(),
                                                                                 policy.parameters())]))
        stats_seen.append(stats)
        assert stats["means"]["policy/entropy_threshold"].item() == pytest.approx(expected.item(), rel=1e-6)
        kept = stats["sums"]["policy/entropy_kept_frac"].item()
        assert kept == pytest.approx((old_entropy[mask] >= expected).float().mean().item(), rel=1e-6)
        assert 0.15 < kept <= 0.25
    for update in updates[1:]:
        assert torch.allclose(updates[0], update, atol=1e-6, rtol=1e-4)
    args.top_entropy_frac, policy = 1.0, copy.deepcopy(model)
    grpo.update_policy(args, policy, torch.optim.SGD(policy.parameters(), lr=1.0), dict(batch, old_entropy=None),
                       accelerator)
    every_token = torch.cat([(p0 - p1).detach().flatten() for p0, p1 in zip(model.parameters(), policy.parameters())])
    assert not torch.allclose(updates[0], every_token, atol=1e-6)


def test_the_kl_term_keeps_every_token():
    """A token outside the kept set loses its policy-gradient term but keeps the KL term's gradient."""
    old = torch.tensor([[-1.0, -1.0]])
    logp = old.clone().requires_grad_(True)
    ref = torch.tensor([[-0.5, -0.5]])
    kept = torch.tensor([[1.0, 0.0]])
    loss, _, _ = grpo.compute_loss(logp, old, torch.ones(1), torch.ones(1, 2), ref, is_weights=kept, beta=0.1,
                                   loss_agg="token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    (kl_grad,) = torch.autograd.grad(0.1 * grpo.kl_term(logp, ref, old, "k3").sum() / 2, logp)
    assert grad[0, 1].item() == pytest.approx(kl_grad[0, 1].item()) and grad[0, 1] != 0
    assert grad[0, 0].item() == pytest.approx(kl_grad[0, 0].item() - 1 / 2)  # -A / num_tokens from the surrogate


# Clip-Cov / KL-Cov: 5 valid tokens; Cov_t = (log pi_t - mean log pi)(A_t - mean A), mean log pi = -1.16, mean A = 0.8
COV_LOGP = torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -0.2, -1.0]])
COV_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
COV_ADV = torch.tensor([2.0, -1.0])
COV = [[1.272, -1.008, 0.792], [3.312, -1.728]]  # by hand; the two positive ones in (1, 5) both lower the entropy:
# a likely token with a positive advantage (0, 0), an unlikely one with a negative advantage (1, 0)


def positions(selected):
    return [tuple(ij) for ij in selected.nonzero().tolist()]


def test_covariance_tokens_hand_values():
    # KL-Cov: the k = int(frac * 5) tokens of highest covariance (at least one)
    assert positions(covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.4)) == [(0, 0), (1, 0)]
    assert positions(covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.01)) == [(1, 0)]
    # Clip-Cov: drawn among the tokens with covariance in (1, 5); all of them when k covers them
    assert positions(covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.4, (1.0, 5.0))) == [(0, 0), (1, 0)]
    drawn = {positions(covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.2, (1.0, 5.0)))[0] for _ in range(40)}
    assert drawn == {(0, 0), (1, 0)}  # one of the two, uniformly (both seen in 40 draws: fails with p = 2^-39)
    assert positions(covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.4, (1.0, 3.0))) == [(0, 0)]
    eligible = torch.ones(2, 3).index_put_((torch.tensor(1), torch.tensor(0)), torch.tensor(0.0))
    assert positions(covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.4, (1.0, 5.0), eligible)) == [(0, 0)]
    masked_out = COV_LOGP.clone()
    masked_out[1, 2] = 50.0  # a padding position never counts, whatever its value
    assert positions(covariance_tokens(masked_out, COV_ADV, COV_MASK, 0.4)) == [(0, 0), (1, 0)]


def cov_grad(logp0, old, **settings):
    logp = logp0.clone().requires_grad_(True)
    loss, means, _ = grpo.compute_loss(logp, old, COV_ADV, COV_MASK, loss_agg="token-mean", **settings)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, means, grad


def test_clip_cov_drops_the_gradient_of_its_tokens_only():
    _, _, plain = cov_grad(COV_LOGP, COV_LOGP)  # on-policy: ratio 1, nothing clipped
    assert plain[0].tolist() == pytest.approx([-2 / 5] * 3) and plain[1, :2].tolist() == pytest.approx([1 / 5] * 2)
    loss, means, grad = cov_grad(COV_LOGP, COV_LOGP, clip_cov_frac=0.4)
    expected = plain.clone()
    expected[0, 0] = expected[1, 0] = 0.0
    torch.testing.assert_close(grad, expected)
    assert loss.item() == pytest.approx((-2 * 2 + 1) / 5)  # -(sum of the 3 kept A r) / 5 tokens
    assert means["policy/cov_selected_frac"].item() == pytest.approx(2 / 5)


def test_kl_cov_no_clip_and_a_penalty_that_acts_off_policy_only():
    # on-policy: |log pi - log pi_old| has gradient 0 at 0, so KL-Cov is the plain policy gradient
    _, _, plain = cov_grad(COV_LOGP, COV_LOGP)
    _, _, grad = cov_grad(COV_LOGP, COV_LOGP, kl_cov_frac=0.4)
    torch.testing.assert_close(grad, plain)
    # off-policy: every token has ratio 1.5 (A > 0: GRPO clips row 0 at 1.2, no gradient)
    old = COV_LOGP - torch.log(torch.tensor(1.5))
    _, _, clipped = cov_grad(COV_LOGP, old)
    assert clipped[0].tolist() == [0.0] * 3
    _, means, grad = cov_grad(COV_LOGP, old, kl_cov_frac=0.4)
    selected = covariance_tokens(COV_LOGP, COV_ADV, COV_MASK, 0.4)  # the same ranking: old differs by a constant
    adv = COV_ADV.unsqueeze(-1).expand(2, 3)
    expected = (-adv * 1.5 + grpo.KL_COV_COEF * selected.float()) / 5 * COV_MASK  # d|log r|/d log pi = sign = +1
    torch.testing.assert_close(grad, expected)
    assert means["policy/cov_selected_frac"].item() == pytest.approx(2 / 5)


def test_cov_arguments():
    assert resolved(grpo, clip_cov_frac=2e-4).clip_cov_frac == 2e-4
    for bad in ({"clip_cov_frac": 2e-4, "kl_cov_frac": 2e-3}, {"kl_cov_frac": 1.0}, {"clip_cov_frac": -0.1}):
        with pytest.raises(ValueError, match="--clip_cov_frac and --kl_cov_frac are fractions"):
            resolved(grpo, **bad)


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["--clip_cov_frac", "--kl_cov_frac"])
def test_cov_switches_end_to_end(tmp_path, switch):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", switch, "0.01", "--num_minibatches", "2", *SMALL],
                       tmp_path)
    for r in rows:
        assert 0 < r["policy/cov_selected_frac"] < 0.2


@pytest.mark.slow
def test_both_switches_end_to_end(tmp_path):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--reward_norm", "normalize_then_sum",
                        "--top_entropy_frac", "0.2", *SMALL], tmp_path)
    for r in rows:
        assert 0.1 < r["policy/entropy_kept_frac"] <= 0.3 and r["policy/entropy_threshold"] > 0
        assert r["policy/first_minibatch_ratio_dev_max"] == 0.0 and "charts/format" in r
