"""high_entropy.py: training on the high-entropy tokens only (arXiv 2506.01939). The threshold is the quantile of the
valid tokens of every process (hand values, beyond torch.quantile's 2**24 elements), and it is the whole
mini-batch's, whatever the micro-batch size; the KL term keeps every token; a short run end to end."""

import copy
import dataclasses
import types

import numpy
import pytest
import torch
from accelerate import Accelerator

import high_entropy
from tests.helpers import SMALL, loss_of, resolved, run_grpo
from tests.test_engine import flat_update, rollout, setup, with_advantages
from utils.rl import kl_k3


def one_process():
    return Accelerator(cpu=True)


def other_process(*tokens):
    """A stand-in accelerator for 2 processes: the other one's valid tokens, NaN-padded as accelerate pads them."""
    other = torch.tensor(tokens)
    return types.SimpleNamespace(pad_across_processes=lambda t, pad_index: t,
                                 gather=lambda t: torch.cat([t, other.to(t.dtype)]))


def test_entropy_threshold_is_the_quantile_of_the_valid_tokens():
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 9.0], [0.6, 0.7, 0.8, 0.9, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])  # the 9.0s are padding
    threshold = high_entropy.entropy_threshold(entropy, mask, 0.2, one_process())
    assert threshold.item() == pytest.approx(torch.quantile(torch.arange(1, 10) / 10, 0.8).item())
    kept = (entropy >= threshold) & mask.bool()
    assert kept.sum().item() == 2 and entropy[kept].tolist() == pytest.approx([0.8, 0.9])
    # a second process's tokens (NaN-padded as accelerate pads them) join the quantile
    threshold = high_entropy.entropy_threshold(entropy, mask, 0.2, other_process(2.0, 3.0, float("nan")))
    assert threshold.item() == pytest.approx(
        torch.quantile(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 2.0, 3.0]), 0.8).item())
    # the threshold keeps the entropies' dtype (its interpolation weight follows them)
    assert high_entropy.entropy_threshold(entropy.double(), mask, 0.2, one_process()).dtype == torch.float64


def test_the_docstrings_worked_example():
    """rho = 0.5: tokens of entropies (0.1, 2.0, 0.3, 1.5) have tau = 0.9 (linear interpolation between 0.3 and
    1.5), so the tokens of entropy 2.0 and 1.5 are trained."""
    entropy = torch.tensor([[0.1, 2.0, 0.3, 1.5]])
    tau = high_entropy.entropy_threshold(entropy, torch.ones(1, 4), 0.5, one_process())
    assert tau.item() == pytest.approx(0.9)
    assert (entropy >= tau).tolist() == [[False, True, False, True]]
    assert "have tau = 0.9" in high_entropy.__doc__


@pytest.mark.parametrize("size", [1, 2, 7, 1000, 2**24 + 1])  # torch.quantile refuses more than 2**24 elements
def test_the_threshold_is_torch_quantile_without_its_size_limit(size):
    values = torch.rand(size, generator=torch.Generator().manual_seed(size))
    mask = torch.ones(1, size)
    for top_frac in (1.0, 0.8, 0.2, 0.001, 0.0):  # the 1 - top_frac quantile (0 is not a valid flag, only an end)
        q = 1 - top_frac
        threshold = high_entropy.entropy_threshold(values.view(1, -1), mask, top_frac, one_process()).item()
        # numpy's linear method in float64: float32 values, and an interpolation weight computed in another precision
        # than torch's, agree to float32 rounding, not bit for bit
        assert threshold == pytest.approx(numpy.quantile(values.double().numpy(), q), abs=1e-6)
        if size <= 2**24:
            assert threshold == pytest.approx(torch.quantile(values, q).item(), abs=1e-6)


def test_high_entropy_tokens_only_the_threshold_is_the_mini_batchs():
    """update_policy with --top_entropy_frac 0.2: the same threshold, kept fraction and update for micro-batches of 2,
    4 and 16 (the threshold is taken over the whole mini-batch, not per micro-batch); the kept tokens are the top 20 %
    of pi_old's entropies; and the update differs from training on every token."""
    _, accelerator, tokenizer, model = setup()
    args = dataclasses.replace(resolved(high_entropy, top_entropy_frac=0.2, max_grad_norm=1e9), num_minibatches=1)
    _, batch, old_logp = rollout(model, tokenizer, accelerator, 1.0)
    batch = high_entropy.Batch(**vars(with_advantages(batch, old_logp)))
    batch.old_logp, batch.old_entropy = high_entropy.batched_logprobs(
        model, batch, 1.0, accelerator, len(batch), 16, with_entropy=True)
    mask = batch.mask.bool()
    expected = torch.quantile(batch.old_entropy[mask], 0.8)
    updates = []
    for micro in (2, 4, 16):
        args.micro_batch_size, policy = micro, copy.deepcopy(model)
        stats, _ = high_entropy.update_policy(args, policy, torch.optim.SGD(policy.parameters(), lr=1.0),
                                           dataclasses.replace(batch), accelerator)
        updates.append(flat_update(model, policy))
        assert stats.means["policy/entropy_threshold"].item() == pytest.approx(expected.item(), rel=1e-6)
        kept = stats.sums["policy/entropy_kept_frac"].item()
        assert kept == pytest.approx((batch.old_entropy[mask] >= expected).float().mean().item(), rel=1e-6)
        assert 0.15 < kept <= 0.25
    assert updates[0].abs().max() > 0
    for update in updates[1:]:
        assert torch.allclose(updates[0], update, atol=1e-6, rtol=1e-4)
    args.top_entropy_frac, policy = 1.0, copy.deepcopy(model)
    stats, _ = high_entropy.update_policy(args, policy, torch.optim.SGD(policy.parameters(), lr=1.0),
                                       dataclasses.replace(batch), accelerator)
    assert stats.sums["policy/entropy_kept_frac"].item() == pytest.approx(1.0)  # rho = 1: every token
    assert not torch.allclose(updates[0], flat_update(model, policy), atol=1e-6)


def test_the_kl_term_keeps_every_token():
    """A token outside the kept set loses its policy-gradient term but keeps the KL term's gradient (update_policy
    multiplies the advantage by the 0/1 mask, as TRL's top_entropy_quantile multiplies the policy term)."""
    old = torch.tensor([[-1.0, -1.0]])
    logp = old.clone().requires_grad_(True)
    ref = torch.tensor([[-0.5, -0.5]])
    kept = torch.tensor([[1.0, 0.0]])
    loss, means, _ = loss_of(high_entropy, logp, old, torch.ones(1, 2) * kept, torch.ones(1, 2), ref, beta=0.1)
    (grad,) = torch.autograd.grad(loss, logp)
    (kl_grad,) = torch.autograd.grad(0.1 * kl_k3(logp, ref).sum() / 2, logp)
    assert grad[0, 1].item() == pytest.approx(kl_grad[0, 1].item()) and grad[0, 1] != 0
    assert grad[0, 0].item() == pytest.approx(kl_grad[0, 0].item() - 1 / 2)  # -A / |o_i| from the surrogate
    assert means["losses/kl"].item() == pytest.approx(kl_k3(old, ref).mean().item())  # every token


@pytest.mark.parametrize("frac", [0.0, -0.1, 1.5])
def test_arguments(frac):
    assert resolved(high_entropy).top_entropy_frac == 0.2  # the paper's rho
    assert resolved(high_entropy, top_entropy_frac=1.0).top_entropy_frac == 1.0
    with pytest.raises(ValueError) as error:
        resolved(high_entropy, top_entropy_frac=frac)
    assert f"--top_entropy_frac {frac}: must be in (0, 1]" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_end_to_end(tmp_path):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--top_entropy_frac", "0.2", *SMALL], tmp_path,
                       script="high_entropy.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.1 < r["policy/entropy_kept_frac"] <= 0.3 and r["policy/entropy_threshold"] > 0
        assert r["policy/first_minibatch_ratio_dev_max"] == 0.0  # pi_old's own pass computes as the update's
