"""utils/rl.py against reference numbers computed by hand (NumPy, float64) from each formula: the KL estimators of
Schulman's "Approximating KL Divergence" and their placements (Tang & Munos arXiv 2506.09477), GRPO's group z-score
(arXiv 2402.03300 §4.1.2), token-weighted whitening (REINFORCE++ arXiv 2501.03262) and the loss aggregations."""

import pytest
import torch

from utils.rl import (aggregate_loss, group_advantages, kl_k1, kl_k2, kl_k3, kl_k3_importance_weighted,
                      masked_whiten, micro_batches, pass_at_k)

T = torch.tensor


@pytest.mark.parametrize("logp, ref, expected", [
    (-1.0, -1.5, (0.5, 0.125, 0.106531)),
    (-2.0, -1.0, (-1.0, 0.5, 0.718282)),
    (-0.5, -3.0, (2.5, 3.125, 1.582085)),
    (-0.7, -0.7, (0.0, 0.0, 0.0)),
])
def test_kl_values(logp, ref, expected):  # k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d
    got = [f(T(logp), T(ref)).item() for f in (kl_k1, kl_k2, kl_k3)]
    assert got == pytest.approx(expected, abs=1e-6)
    assert kl_k3(T(logp), T(ref), straight_through=True).item() == pytest.approx(expected[2], abs=1e-6)


# pi = softmax(THETA), ref = softmax(REF_LOGITS); exact expectations over the 5 tokens, no sampling noise.
THETA = [0.5, -0.2, 1.0, 0.0, -1.0]
REF_LOGITS = [0.0, 0.3, 0.2, -0.5, 0.1]
GRAD_REVERSE_KL = [0.022720, -0.113646, 0.161891, 0.013780, -0.084745]  # grad KL(pi || ref)
GRAD_FORWARD_KL = [0.062287, -0.130584, 0.183580, 0.037779, -0.153061]  # grad KL(ref || pi) = pi - ref
GRAD_K3_IN_REWARD = [-0.039567, 0.016938, -0.021688, -0.023999, 0.068317]


def expected_gradient(per_sample_loss):
    """grad_theta of E_{x~pi}[loss(x)] with the samples held fixed: sum_x sg(pi(x)) * grad loss(x)."""
    theta = T(THETA, requires_grad=True)
    logp = torch.log_softmax(theta, 0)
    ref = torch.log_softmax(T(REF_LOGITS), 0)
    (logp.exp().detach() * per_sample_loss(logp, ref)).sum().backward()
    return theta.grad.tolist()


@pytest.mark.parametrize("name, per_sample_loss, expected", [
    ("k2 as a loss", kl_k2, GRAD_REVERSE_KL),
    ("k1 in the reward", lambda lp, ref: kl_k1(lp, ref).detach() * lp, GRAD_REVERSE_KL),
    ("rho * k3, rho differentiable", lambda lp, ref: kl_k3_importance_weighted(lp, ref, lp.detach()), GRAD_REVERSE_KL),
    ("k3 value, k2 gradient", lambda lp, ref: kl_k3(lp, ref, straight_through=True), GRAD_REVERSE_KL),
    ("k3 as a loss (GRPO)", kl_k3, GRAD_FORWARD_KL),
    ("k1 as a loss", kl_k1, [0.0] * 5),
    ("k3 in the reward", lambda lp, ref: kl_k3(lp, ref).detach() * lp, GRAD_K3_IN_REWARD),
])
def test_kl_placement_gradients(name, per_sample_loss, expected):
    assert expected_gradient(per_sample_loss) == pytest.approx(expected, abs=1e-6), name


@pytest.mark.parametrize("rewards, group_eps6, group_eps4, mean_only", [  # (r - mean) / (std + eps), unbiased std
    ([1, 0, 0, 0], [1.499997, -0.499999, -0.499999, -0.499999], [1.4997, -0.4999, -0.4999, -0.4999],
     [0.75, -0.25, -0.25, -0.25]),
    ([1, 1, 0, 0], [0.866024, 0.866024, -0.866024, -0.866024], [0.865875, 0.865875, -0.865875, -0.865875],
     [0.5, 0.5, -0.5, -0.5]),
    ([1, 0, 1, 1, 0, 0, 0, 0], [1.207612, -0.724567, 1.207612, 1.207612] + [-0.724567] * 4,
     [1.207381, -0.724429, 1.207381, 1.207381] + [-0.724429] * 4, [0.625, -0.375, 0.625, 0.625] + [-0.375] * 4),
    ([0, 0, 0, 0], [0.0] * 4, [0.0] * 4, [0.0] * 4),
    ([1, -1, -1, -1], [1.499999, -0.5, -0.5, -0.5], [1.49985, -0.49995, -0.49995, -0.49995], [1.5, -0.5, -0.5, -0.5]),
])
def test_group_advantages(rewards, group_eps6, group_eps4, mean_only):
    r = T([rewards], dtype=torch.float64)
    assert group_advantages(r, "group", 1e-6)[0].tolist() == pytest.approx(group_eps6, abs=1e-5)
    assert group_advantages(r, "group", 1e-4)[0].tolist() == pytest.approx(group_eps4, abs=1e-5)
    assert group_advantages(r, "none")[0].tolist() == pytest.approx(mean_only, abs=1e-9)
    assert not torch.isnan(group_advantages(r, "group", 0.0)).any() or r.std() == 0


def test_batch_std_scaling():
    r = T([[1.0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    centered = r - r.mean(1, keepdim=True)
    assert torch.allclose(group_advantages(r, "batch", 0.0), centered / r.std())
    with pytest.raises(ValueError, match="unknown reward scaling"):
        group_advantages(r, "sequence")


def test_masked_whiten_token_weighted():  # REINFORCE++-baseline, two groups with lengths 2..8 and 3
    scalar = T([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75], dtype=torch.float64)
    lengths = [2, 4, 6, 8, 3, 3, 3, 3]
    mask = (torch.arange(8)[None, :] < T(lengths)[:, None]).double()
    values = scalar[:, None].expand(8, 8)
    verl = masked_whiten(values, mask, unbiased=True)[:, 0]
    openrlhf = masked_whiten(values, mask, unbiased=False)[:, 0]
    assert verl[[0, 1, 4, 7]].tolist() == pytest.approx([2.287193, -0.423554, 0.931819, -1.778928], abs=1e-5)
    assert openrlhf[[0, 1, 4, 7]].tolist() == pytest.approx([2.323790, -0.430331, 0.946729, -1.807392], abs=1e-5)
    scaled = masked_whiten(values, mask, shift_mean=False)
    assert (scaled * mask).sum() / mask.sum() == pytest.approx((values * mask).sum().item() / 32, abs=1e-9)


LOSS = T([[1.0, 2, 3, 0, 0], [4, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
MASK = T([[1.0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize("mode, expected", [  # by hand from the three rows below
    ("token-mean", 15 / 9), ("seq-mean-token-mean", 7 / 3), ("seq-mean-token-sum", 5.0),
    ("seq-mean-token-sum-norm", 1.0),
])
def test_aggregation_values(mode, expected):
    assert aggregate_loss(LOSS + 99 * (1 - MASK), MASK, mode, 3, MASK.sum(), max_len=5).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregation_micro_batch_invariance(mode):
    """Summing micro-batch losses divided by the global counts gives the full-batch gradient exactly."""
    torch.manual_seed(0)
    x = torch.randn(6, 7, requires_grad=True)
    mask = (torch.rand(6, 7) > 0.3).float()
    mask[:, 0] = 1
    full = torch.autograd.grad(aggregate_loss(x ** 2, mask, mode, 6, mask.sum(), 7), x)[0]
    split = sum(aggregate_loss(x[i:i + 2] ** 2, mask[i:i + 2], mode, 6, mask.sum(), 7) for i in range(0, 6, 2))
    assert torch.allclose(torch.autograd.grad(split, x)[0], full, atol=1e-7)
    # the classic bug: averaging per-micro-batch token means is not the same thing
    if mode == "token-mean":
        wrong = sum(aggregate_loss(x[i:i + 2] ** 2, mask[i:i + 2], mode, 2, mask[i:i + 2].sum()) for i in range(0, 6, 2)) / 3
        assert not torch.allclose(torch.autograd.grad(wrong, x)[0], full, atol=1e-4)


@pytest.mark.parametrize("value, size", [(0.1, 8), (1.1, 12), (0.1, 3), (1 / 3, 7)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_gets_exactly_zero_advantage(value, size, scale):
    """float32: the mean of 8 x 0.1 is 1 ulp off, and / (std 0 + 1e-6) made it -0.00745 (12 x 1.1: 0.106)."""
    rewards = torch.tensor([[value] * size, [0.0] + [1.0] * (size - 1)], dtype=torch.float32)
    adv = group_advantages(rewards, scale, 1e-6)
    assert adv[0].tolist() == [0.0] * size
    assert adv[1].abs().sum() > 0


def test_masked_whiten_single_token_is_finite():
    values, mask = T([[3.0, 7.0, 1.0]]), T([[0.0, 1.0, 0.0]])
    for unbiased in (True, False):
        out = masked_whiten(values, mask, unbiased=unbiased)
        assert torch.isfinite(out).all() and out[0, 1].item() == 0.0


def test_sum_norm_aggregation_without_max_len_says_so():
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", 3, MASK.sum())


def test_micro_batches_group_similar_lengths_and_cut_the_padding():
    lengths = [5, 1, 9, 3, 7, 2, 0, 4]  # row 6: a completion masked out of the loss (DAPO's overlong filtering)
    mask = torch.tensor([[1.0] * n + [0.0] * (9 - n) for n in lengths])
    batch = {"input_ids": torch.arange(8 * 11).view(8, 11), "attention_mask": torch.ones(8, 11, dtype=torch.long),
             "completion_mask": mask, "engine_logp": torch.randn(8, 9), "advantages": torch.arange(8.0),
             "prompt_width": 2}
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    chunks = list(micro_batches(batch, rows, 3))
    assert [c.tolist() for c, _ in chunks] == [[6, 1, 5], [3, 7, 0], [4, 2]]  # sorted by length, stable
    for chunk, mc in chunks:
        width = max(1, max(lengths[i] for i in chunk))
        assert mc["completion_mask"].shape == mc["engine_logp"].shape == (len(chunk), width)
        assert mc["input_ids"].shape == mc["attention_mask"].shape == (len(chunk), 2 + width)
        assert torch.equal(mc["input_ids"], batch["input_ids"][chunk, :2 + width])
        assert torch.equal(mc["engine_logp"], batch["engine_logp"][chunk, :width])
        assert torch.equal(mc["advantages"], batch["advantages"][chunk])  # per-sequence tensors are not cut
        assert mc["completion_mask"].sum() == mask[chunk].sum()  # no loss token is cut
    assert [c.tolist() for c, _ in micro_batches(batch, torch.tensor([7, 2]), 3)] == [[7, 2]]


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 4, 1.0), (4, 0, 4, 0.0), (4, 2, 2, 5 / 6), (8, 3, 4, 13 / 14),
    (100, 3, 50, 1 - 50 * 49 * 48 / (100 * 99 * 98)),  # C(97, 50) / C(100, 50)
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):  # 1 - C(n - c, k) / C(n, k), by hand
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
