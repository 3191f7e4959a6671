"""gdpo.py: GDPO's decoupled reward normalization (arXiv 2601.05242) against hand values (unbiased std), what GRPO's
normalization of the summed reward collapses, and a short run end to end."""

import pytest
import torch

import gdpo
import grpo
from tests.helpers import SMALL, resolved, run_grpo

PARTS = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])  # 2 prompts x G = 2, (accuracy, format)


def gdpo_advantages(parts, format_reward_weight=1.0, eps=1e-6, num_generations=2):
    return gdpo.compute_advantages(parts, gdpo.Args(num_generations=num_generations,
                                                    format_reward_weight=format_reward_weight, adv_eps=eps))


def test_gdpo_reference_numbers_and_what_grpo_collapses():  # hand values, unbiased std
    grpo_adv = grpo.compute_advantages(PARTS @ torch.ones(2), grpo.Args(num_generations=2, adv_eps=1e-4))
    assert grpo_adv.tolist() == pytest.approx([-0.707057, 0.707057, -0.707007, 0.707007], abs=1e-6)
    gdpo_adv = gdpo_advantages(PARTS, eps=1e-4)  # TRL's eps
    assert gdpo_adv.tolist() == pytest.approx([-1.095360, 1.095360, -0.547680, 0.547680], abs=1e-6)
    assert gdpo_advantages(PARTS, eps=1e-6)[1].item() == pytest.approx(1.095445, abs=1e-6)
    # GRPO gives (1, 1) over (0, 0) the same advantage as (1, 0) over (0, 0); GDPO gives it twice as much
    assert grpo_adv[1].item() == pytest.approx(grpo_adv[3].item(), abs=1e-4)
    assert gdpo_adv[1].item() == pytest.approx(2 * gdpo_adv[3].item(), rel=1e-6)


def test_gdpo_weights_and_equal_groups():
    weighted = gdpo_advantages(PARTS, format_reward_weight=0.1)  # the accuracy's weight is 1
    assert (weighted[1] / weighted[3]).item() == pytest.approx(1.1)  # each part's z-score, weighted
    assert gdpo_advantages(torch.ones(4, 2)).tolist() == [0.0] * 4
    assert gdpo_advantages(torch.tensor([[1.0, 1.0]] * 4 + [[0.0, 1.0], [1.0, 1.0]] * 2), num_generations=4)[
        :4].tolist() == [0.0] * 4  # an all-equal group in a batch that is not: its own z-scores are exactly 0


def test_gdpo_weights_follow_the_rewards_device():  # the weights are built on the CPU, the rewards live on the GPU
    parts = PARTS.to("meta")  # a non-CPU device on any machine: a device mismatch raises as it would on CUDA
    assert gdpo_advantages(parts, format_reward_weight=0.1).device.type == "meta"


def test_the_docstrings_worked_example():
    """Weights 1 and 1: the groups (0, 0) vs (1, 1) and (0, 0) vs (1, 0) get (-1.095, 1.095) and (-0.548, 0.548);
    GRPO gives both (-0.707, 0.707)."""
    assert gdpo_advantages(PARTS).tolist() == pytest.approx([-1.095, 1.095, -0.548, 0.548], abs=5e-4)
    grpo_adv = grpo.compute_advantages(PARTS.sum(-1), grpo.Args(num_generations=2))
    assert grpo_adv.tolist() == pytest.approx([-0.707, 0.707, -0.707, 0.707], abs=5e-4)
    text = " ".join(gdpo.__doc__.split())
    for quoted in ("(-1.095, 1.095) and (-0.548, 0.548)", "advantages (-0.707, 0.707)"):
        assert quoted in text


def test_gdpo_arguments():
    assert resolved(gdpo, format_reward_weight=0.5).format_reward_weight == 0.5
    with pytest.raises(ValueError, match="groups of >= 2 completions are needed"):
        resolved(gdpo, num_generations=1)
    with pytest.raises(ValueError, match="--adv_eps must be >= 0"):
        resolved(gdpo, adv_eps=-1.0)


@pytest.mark.slow
def test_end_to_end(tmp_path):
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", *SMALL], tmp_path, script="gdpo.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "charts/format" in r and "charts/accuracy" in r and r["losses/entropy"] > 0
