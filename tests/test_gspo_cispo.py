"""gspo.py (arXiv 2507.18071) and cispo.py (arXiv 2506.13585 §3.1): each loss and its gradient against the paper's
formula written as loops here, reference numbers computed by hand, the on-policy identity, the off-policy cases that
tell each apart from GRPO, and a short end-to-end run of each script."""

import math

import pytest
import torch

import cispo
import grpo
import gspo
from tests.helpers import SMALL, assert_same_loss_and_gradient, loss_of, run_grpo
from tests.test_grpo_loss import random_batch


def reference_gspo_loss(logp, old_logp, adv, mask, eps_low, eps_high):
    """The paper's sequence-level J: (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it); loss = -J."""
    total = 0.0
    for i in range(len(adv)):
        n_i = int(mask[i].sum())
        s_i = torch.exp(sum(logp[i][t] - old_logp[i][t] for t in range(n_i)) / n_i)
        total = total + torch.min(s_i * adv[i], torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * adv[i])
    return -total / len(adv)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_low, eps_high", [(3e-4, 4e-4), (0.05, 0.05), (0.2, 0.2)])
def test_gspo_token_form_matches_the_sequence_objective(seed, eps_low, eps_high):
    """GSPO-token (stop-gradient form) equals sequence-level GSPO in value and gradient for per-sequence advantages."""
    logp, old, _, adv, mask = random_batch(seed, spread=0.1)
    loss, _, _ = loss_of(gspo, logp, old, adv, mask, clip_eps_low=eps_low, clip_eps_high=eps_high)
    assert_same_loss_and_gradient(loss, reference_gspo_loss(logp, old, adv, mask, eps_low, eps_high), logp)


@pytest.mark.parametrize("adv, loss_value, grad_flows", [(1.0, -1.0004, False), (-1.0, 1.00075028, True)])
def test_gspo_reference_numbers(adv, loss_value, grad_flows):  # hand values
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.002, -0.001, 0.0005, 0.0015]], requires_grad=True)
    loss, means, _ = loss_of(gspo, logp, old, torch.tensor([adv]), torch.ones(1, 4))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(loss_value, abs=1e-7)
    assert means["policy/seq_ratio_mean"].item() == pytest.approx(math.exp(0.00075), abs=1e-7)
    if grad_flows:  # every token gets s_i * A / |o_i|
        assert torch.allclose(grad, torch.full((1, 4), math.exp(0.00075) / 4), atol=1e-7)
    else:
        assert grad.abs().max() == 0 and means["policy/seq_clip_frac"].item() == 1.0


def test_gspo_on_policy_identity():
    adv = grpo.compute_advantages(torch.tensor([1.0, 0, 0, 0]), grpo.Args(num_generations=4))
    lengths = torch.tensor([2, 4, 1, 3])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()
    old = -torch.rand(4, 4)
    logp = old.clone().requires_grad_(True)
    loss, means, _ = loss_of(gspo, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and means["policy/seq_ratio_mean"].item() == 1.0
    assert torch.allclose(grad, -(adv / (lengths * 4))[:, None] * mask, atol=1e-7)  # as GRPO's on-policy gradient


def test_gspo_differs_from_grpo_off_policy():
    """Token ratios 1.5 and 0.8 with A > 0: GRPO's clip drops the first token's gradient; GSPO's sequence ratio
    sqrt(1.2) = 1.095 is inside the clip range, so both tokens get the gradient s_i * A / 2."""
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.8)]], requires_grad=True)
    g_grpo = torch.autograd.grad(loss_of(grpo, logp, old, torch.ones(1), torch.ones(1, 2), beta=0.0)[0], logp)[0]
    g_gspo = torch.autograd.grad(loss_of(gspo, logp, old, torch.ones(1), torch.ones(1, 2), clip_eps_low=0.2,
                                                   clip_eps_high=0.2)[0], logp)[0]
    assert g_grpo[0, 0] == 0 and g_grpo[0, 1] != 0
    assert torch.allclose(g_gspo, torch.full((1, 2), -math.sqrt(1.2) / 2), atol=1e-6)


def reference_cispo_loss(logp, old_logp, adv, mask, eps_low, eps_high):
    """The paper's J: (1/sum_i |o_i|) sum_i sum_t sg(clip(r_it)) A_i log pi_it; loss = -J."""
    total, count = 0.0, 0
    for i in range(len(adv)):
        for t in range(int(mask[i].sum())):
            r = torch.exp(logp[i][t] - old_logp[i][t]).detach()
            total = total + torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i] * logp[i][t]
            count += 1
    return -total / count


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_low, eps_high", [(1.0, 4.0), (10.0, 0.2), (0.2, 0.28)])
def test_cispo_loss_and_gradient_match_the_paper(seed, eps_low, eps_high):
    logp, old, _, adv, mask = random_batch(seed, spread=0.5)
    loss, _, _ = loss_of(cispo, logp, old, adv, mask, clip_eps_low=eps_low, clip_eps_high=eps_high)
    assert_same_loss_and_gradient(loss, reference_cispo_loss(logp, old, adv, mask, eps_low, eps_high), logp, 1e-7)


@pytest.mark.parametrize("ratio, weight", [(0.1, 0.1), (0.5, 0.5), (1.0, 1.0), (1.2, 1.2), (1.5, 1.2), (3.0, 1.2),
                                           (6.0, 1.2)])
def test_cispo_weights_relative_convention(ratio, weight):  # paper/verl clip(r, 1 - 10, 1 + 0.2)
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss, _, _ = loss_of(cispo, logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_eps_low=10.0,
                                    clip_eps_high=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.item() == pytest.approx(-weight, abs=1e-6)  # never TRL's silent 0.2 cap at r = 1


def test_cispo_on_policy_is_reinforce_with_group_advantages():
    logp, old, _, adv, mask = random_batch(0)
    logp = old.clone().requires_grad_(True)
    loss, means, _ = loss_of(cispo, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -adv[:, None] * mask / mask.sum(), atol=1e-7)
    assert means["policy/clip_frac"].item() == 0.0


def test_cispo_keeps_the_gradient_grpo_drops_and_the_token_mask_recovers_ppo():
    """A > 0, r = 1.5 (eps 0.2): GRPO's clip zeroes the gradient; CISPO keeps it with weight 1.2; --token_mask drops
    it as PPO does. A token inside the range is the same in all three."""
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.ones(1)
    g_grpo = torch.autograd.grad(loss_of(grpo, logp, old, adv, mask, beta=0.0)[0], logp)[0]
    settings = dict(clip_eps_low=0.2, clip_eps_high=0.2)
    g_cispo = torch.autograd.grad(loss_of(cispo, logp, old, adv, mask, **settings)[0], logp)[0]
    g_masked = torch.autograd.grad(loss_of(cispo, logp, old, adv, mask, token_mask=True, **settings)[0], logp)[0]
    assert g_grpo[0, 0] == 0 and g_cispo[0, 0].item() == pytest.approx(-1.2 / 2) and g_masked[0, 0] == 0
    assert g_grpo[0, 1].item() == pytest.approx(-1.1 / 2) == g_cispo[0, 1].item() == g_masked[0, 1].item()
    # the mask is PPO's range (ppo_clip_eps 0.2), not the IS weight's: with the default weight clip (cap 5) r = 1.5
    # keeps its full weight unmasked, and is dropped with the mask
    loss, means, _ = loss_of(cispo, logp, old, adv, mask, token_mask=True)
    g_default = torch.autograd.grad(loss, logp)[0]
    assert g_default[0, 0] == 0 and g_default[0, 1].item() == pytest.approx(-1.1 / 2)
    assert means["policy/ppo_clip_frac"].item() == pytest.approx(0.5)
    g_unmasked = torch.autograd.grad(loss_of(cispo, logp, old, adv, mask)[0], logp)[0]
    assert g_unmasked[0, 0].item() == pytest.approx(-1.5 / 2)


@pytest.mark.slow
@pytest.mark.parametrize("script, key", [("gspo.py", "policy/seq_clip_frac"), ("cispo.py", "policy/ppo_clip_frac")])
def test_script_runs_end_to_end_off_policy(tmp_path, script, key):
    """Four mini-batches per rollout (the default): the first is on-policy (ratio exactly 1), the later ones are not."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", *SMALL, "--micro_batch_size", "4"], tmp_path,
                       script=script)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy/first_minibatch_ratio_dev_max"] == 0.0 for r in rows)
    assert max(r["policy/ratio_max"] for r in rows) > 1.0 and key in rows[0]
    assert "losses/kl" not in rows[0] and "eval/pass@1_greedy" in rows[1]
    assert (tmp_path / f"{script[:-3]}__1" / "final" / "model.safetensors").exists()
