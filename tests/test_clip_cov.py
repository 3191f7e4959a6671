"""clip_cov.py: Clip-Cov and KL-Cov (arXiv 2505.22617). The tokens they act on by hand, Clip-Cov dropping only its
tokens' gradient, KL-Cov's unclipped surrogate with a penalty that acts off-policy only, and both methods end to
end."""

import math

import pytest
import torch

import clip_cov
import grpo
from clip_cov import covariance_tokens
from tests.helpers import SMALL, assert_same_loss_and_gradient, loss_of, resolved, run_grpo

# 5 valid tokens; Cov_t = (log pi_t - mean log pi)(A_t - mean A), mean log pi = -1.16, mean A = 0.8
COV_LOGP = torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -0.2, -1.0]])
COV_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
COV_ADV = torch.tensor([2.0, -1.0])
TOKEN_ADV = COV_ADV[:, None] * COV_MASK  # as update_policy passes them: A_i on each token of completion i, 0 after
COV = [[1.272, -1.008, 0.792], [3.312, -1.728]]  # by hand; the two positive ones in (1, 5) both lower the entropy:
# a likely token with a positive advantage (0, 0), an unlikely one with a negative advantage (1, 0)
WEIGHT = torch.tensor([[1 / 6] * 3, [1 / 4] * 3]) * COV_MASK  # grpo.py's 1/|o_i| 1/B: rows of 3 and 2 tokens, B = 2


def positions(selected):
    return [tuple(ij) for ij in selected.nonzero().tolist()]


def test_covariance_tokens_hand_values():
    # KL-Cov: the k = int(frac * 5) tokens of highest covariance (at least one)
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4)) == [(0, 0), (1, 0)]
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.01)) == [(1, 0)]
    # Clip-Cov: drawn among the tokens with covariance in (1, 5); all of them when k covers them
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4, (1.0, 5.0))) == [(0, 0), (1, 0)]
    drawn = {positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.2, (1.0, 5.0)))[0] for _ in range(40)}
    assert drawn == {(0, 0), (1, 0)}  # one of the two, uniformly (both seen in 40 draws: fails with p = 2^-39)
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4, (1.0, 3.0))) == [(0, 0)]
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4, (1.25, 1.3))) == [(0, 0)]  # 1.272
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4, (3.3, 3.32))) == [(1, 0)]  # 3.312
    eligible = torch.ones(2, 3).index_put_((torch.tensor(1), torch.tensor(0)), torch.tensor(0.0))
    assert positions(covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4, (1.0, 5.0), eligible)) == [(0, 0)]
    masked_out, adv_out = COV_LOGP.clone(), TOKEN_ADV.clone()
    masked_out[1, 2], adv_out[1, 2] = 50.0, 7.0  # a padding position never counts, whatever its values
    assert positions(covariance_tokens(masked_out, adv_out, COV_MASK, 0.4)) == [(0, 0), (1, 0)]


def test_the_docstrings_worked_example():
    """Log-probs (-0.1, -2.0) on two tokens with advantages (1, -1): Cov = (0.95, 0.95)."""
    logp, adv, mask = torch.tensor([[-0.1], [-2.0]]), torch.tensor([[1.0], [-1.0]]), torch.ones(2, 1)
    assert positions(covariance_tokens(logp, adv, mask, 1.0, (0.94, 0.96))) == [(0, 0), (1, 0)]
    assert positions(covariance_tokens(logp, adv, mask, 1.0, (0.96, 5.0))) == []
    assert "(0.95 * 1, -0.95 * -1) = (0.95, 0.95)" in " ".join(clip_cov.__doc__.split())
    # below the paper's bounds (1, 5): Clip-Cov drops nothing, the loss is grpo.py's
    lp = logp.clone().requires_grad_(True)
    loss, means, _ = loss_of(clip_cov, lp, logp, adv, mask, beta=0.0)
    plain, _, _ = loss_of(grpo, lp, logp, adv, mask, beta=0.0)
    assert torch.equal(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(plain, lp)[0])
    assert means["policy/cov_selected_frac"].item() == 0.0 and clip_cov.CLIP_COV_BOUNDS == (1.0, 5.0)


def cov_grad(module, logp0, old, **flags):
    logp = logp0.clone().requires_grad_(True)
    loss, means, _ = loss_of(module, logp, old, COV_ADV, COV_MASK, beta=0.0, **flags)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, means, grad


def test_clip_cov_drops_the_gradient_of_its_tokens_only():
    _, _, plain = cov_grad(grpo, COV_LOGP, COV_LOGP)  # on-policy: ratio 1, nothing clipped
    torch.testing.assert_close(plain, -TOKEN_ADV * WEIGHT)
    loss, means, grad = cov_grad(clip_cov, COV_LOGP, COV_LOGP, method="clip_cov", clip_cov_frac=0.4)
    expected = plain.clone()
    expected[0, 0] = expected[1, 0] = 0.0
    torch.testing.assert_close(grad, expected)
    assert loss.item() == pytest.approx(-(2 * 2 / 3 - 1 / 2) / 2)  # -(1/B) sum_i (1/|o_i|) sum of the kept A r
    assert means["policy/cov_selected_frac"].item() == pytest.approx(2 / 5)
    # a token the ratio clip has already clipped is not drawn: off-policy, row 0 (A > 0) above 1 + eps
    old = COV_LOGP - torch.log(torch.tensor(1.5)) * torch.tensor([[1.0], [0.0]])
    _, means, grad = cov_grad(clip_cov, COV_LOGP, old, method="clip_cov", clip_cov_frac=0.4)
    assert grad[0].tolist() == [0.0] * 3 and grad[1, 0].item() == 0.0  # (1, 0) dropped, row 0 clipped
    assert grad[1, 1].item() == pytest.approx(1 / 4)
    assert means["policy/cov_selected_frac"].item() == pytest.approx(1 / 5)


def test_kl_cov_no_clip_and_a_penalty_that_acts_off_policy_only():
    # on-policy: |log pi - log pi_old| has gradient 0 at 0, so KL-Cov is the plain policy gradient
    _, _, plain = cov_grad(grpo, COV_LOGP, COV_LOGP)
    _, means, grad = cov_grad(clip_cov, COV_LOGP, COV_LOGP, method="kl_cov", kl_cov_frac=0.4)
    torch.testing.assert_close(grad, plain)
    assert means["policy/cov_selected_frac"].item() == pytest.approx(2 / 5)
    # off-policy: every token has ratio 1.5 (A > 0: GRPO clips row 0 at 1.2, no gradient)
    old = COV_LOGP - math.log(1.5)
    _, _, clipped = cov_grad(grpo, COV_LOGP, old)
    assert clipped[0].tolist() == [0.0] * 3
    loss, means, grad = cov_grad(clip_cov, COV_LOGP, old, method="kl_cov", kl_cov_frac=0.4)
    selected = covariance_tokens(COV_LOGP, TOKEN_ADV, COV_MASK, 0.4)  # the same ranking: old differs by a constant
    assert positions(selected) == [(0, 0), (1, 0)]
    expected = (-TOKEN_ADV * 1.5 + clip_cov.KL_COV_COEF * selected.float()) * WEIGHT  # d|log r|/d log pi = +1
    torch.testing.assert_close(grad, expected)
    per_token = -TOKEN_ADV * 1.5 + clip_cov.KL_COV_COEF * math.log(1.5) * selected.float()
    assert loss.item() == pytest.approx((per_token * WEIGHT).sum().item(), abs=1e-6)
    assert means["policy/cov_selected_frac"].item() == pytest.approx(2 / 5) and clip_cov.KL_COV_COEF == 1.0


def test_arguments():
    args = resolved(clip_cov)
    assert (args.method, args.clip_cov_frac, args.kl_cov_frac) == ("clip_cov", 2e-4, 2e-3)  # the paper's
    assert resolved(clip_cov, method="kl_cov", kl_cov_frac=0.01).kl_cov_frac == 0.01
    for bad in ({"kl_cov_frac": 1.0}, {"clip_cov_frac": -0.1}, {"clip_cov_frac": 0.0}, {"kl_cov_frac": 0.0}):
        with pytest.raises(ValueError, match="--clip_cov_frac and --kl_cov_frac are fractions"):
            resolved(clip_cov, **bad)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_both_methods_end_to_end(tmp_path, method):
    """KL-Cov with --tis_cap: the weights reach the loss apart from A, and the rollout page recomputes them."""
    tis = ["--tis_cap", "1.5", "--html_every", "2"] if method == "kl_cov" else []
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--method", method, f"--{method}_frac",
                        "0.01", "--num_minibatches", "2", *tis, *SMALL], tmp_path, script="clip_cov.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["policy/cov_selected_frac"] < 0.2
        assert ("policy/tis_bounded_frac" in r) == bool(tis)
    if tis:
        assert "importance weight" in open(tmp_path / "clip_cov__1" / "rollouts" / "step_2.html").read()


def test_the_importance_weights_multiply_the_loss_after_a_selection_on_the_advantages_alone():
    """--tis_cap's weights w go to the loss apart from A: KL-Cov ranks Cov(log pi, A) (arXiv 2505.22617 §4), then w
    multiplies each token's whole loss, the |log r| penalty too, as verl's kl_cov loss applies rollout_is_weights.
    Ranked on A w instead, the selection below would be token (1, 0) (loss 0.49469764)."""
    logp = torch.tensor([[-0.2, -3.0], [-2.5, -0.4]], dtype=torch.float64, requires_grad=True)
    old, mask = logp.detach() - 0.1, torch.ones(2, 2, dtype=torch.float64)
    adv, w = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64), torch.tensor([[0.3, 1.0], [2.0, 1.0]])
    counts = (mask.new_tensor(2.0), mask.sum())
    args = clip_cov.Args(method="kl_cov", kl_cov_frac=0.25, beta=0.0)  # k = 1
    assert positions(covariance_tokens(logp, adv, mask, 0.25)) == [(0, 0)]
    loss, means, _ = clip_cov.compute_loss(logp, old, None, adv, mask, counts, args, w.double())
    selected = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    log_ratio = logp - old
    expected = ((-adv * log_ratio.exp() + clip_cov.KL_COV_COEF * log_ratio.abs() * selected) * w).mean()
    assert loss.item() == pytest.approx(0.47719764, abs=1e-8)
    assert_same_loss_and_gradient(loss, expected, logp, atol=1e-12)
    # Clip-Cov: the weights scale the surviving tokens' gradient; the drawn tokens still get none
    old = logp.detach()
    torch.manual_seed(0)
    loss, means, _ = clip_cov.compute_loss(logp, old, None, adv, mask, counts,
                                           clip_cov.Args(method="clip_cov", clip_cov_frac=0.5, beta=0.0), w.double())
    torch.manual_seed(0)
    dropped = covariance_tokens(logp, adv, mask, 0.5, clip_cov.CLIP_COV_BOUNDS, torch.ones(2, 2, dtype=torch.bool))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -adv * w.double() * (~dropped).double() / 4)
