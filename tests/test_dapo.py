"""dapo.py (arXiv 2503.14476): the loss and its gradient against the paper's formula written as loops here (both
normalizers), reference numbers computed by hand for clip-higher and the overlong reward, the on-policy identity,
dynamic sampling (which groups are kept, how many each process trains on, the give-up path) and end-to-end runs with 1
and 2 processes."""

import json
import math

import pytest
import torch

import dapo
import grpo
from tests.helpers import SMALL, assert_same_loss_and_gradient, loss_of, resolved, run_grpo, two_processes
from tests.test_grpo_loss import random_batch

DAPO_SMALL = [*SMALL, "--micro_batch_size", "4"]  # 16 completions a step, 4 mini-batches of 4


def reference_dapo_loss(logp, old_logp, adv, mask, eps_low, eps_high, group_size=None):
    """-J of the paper: sum over tokens of min(r A, clip(r) A), divided by all tokens (token-mean) or, per prompt group
    of group_size completions, by the group's tokens and then averaged over groups (the formula read literally)."""
    groups = [range(len(adv))] if group_size is None else [
        range(k, k + group_size) for k in range(0, len(adv), group_size)]
    total = 0.0
    for members in groups:
        group_sum, group_tokens = 0.0, 0
        for i in members:
            for t in range(int(mask[i].sum())):
                r = torch.exp(logp[i][t] - old_logp[i][t])
                group_sum = group_sum + torch.min(r * adv[i], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i])
                group_tokens += 1
        total = total + group_sum / group_tokens
    return -total / len(groups)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.28), (0.2, 0.2), (0.1, 0.5)])
def test_token_mean_loss_and_gradient_match_the_paper(seed, eps_low, eps_high):
    logp, old, _, adv, mask = random_batch(seed)
    loss, _, _ = loss_of(dapo, logp, old, adv, mask, clip_eps_low=eps_low, clip_eps_high=eps_high)
    assert_same_loss_and_gradient(loss, reference_dapo_loss(logp, old, adv, mask, eps_low, eps_high), logp)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_token_mean_is_the_per_group_normalizer(seed):
    """--loss_agg group-token-mean: the per-sequence weight folded into the advantage gives the literal formula."""
    logp, old, _, adv, mask = random_batch(seed, B=6)
    weights = dapo.group_token_weights(mask, 3)
    loss, _, _ = loss_of(dapo, logp, old, adv * weights, mask, loss_agg="group-token-mean")
    assert_same_loss_and_gradient(loss, reference_dapo_loss(logp, old, adv, mask, 0.2, 0.28, group_size=3), logp)


@pytest.mark.parametrize("ratio, value, grad_flows", [(0.5, -0.5, True), (0.9, -0.9, True), (1.0, -1.0, True),
                                                      (1.1, -1.1, True), (1.25, -1.25, True), (1.3, -1.28, False),
                                                      (5.0, -1.28, False)])
def test_clip_higher_reference_numbers(ratio, value, grad_flows):  # A = +1, DAPO (0.2, 0.28)
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss, means, _ = loss_of(dapo, logp, old, torch.tensor([1.0]), torch.ones(1, 1))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(value, abs=1e-6)
    assert (grad.abs().item() > 0) == grad_flows
    assert means["policy/clip_frac_high"].item() == float(not grad_flows) and means["policy/clip_frac_low"] == 0


def test_clip_higher_lets_1_25_through_where_grpo_clips():
    old = torch.zeros(1, 1)
    logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
    g_grpo = torch.autograd.grad(loss_of(grpo, logp, old, torch.ones(1), torch.ones(1, 1), beta=0.0)[0], logp)[0]
    g_dapo = torch.autograd.grad(loss_of(dapo, logp, old, torch.ones(1), torch.ones(1, 1))[0], logp)[0]
    assert g_grpo.item() == 0 and g_dapo.item() == pytest.approx(-1.25)
    # A < 0 below 1 - 0.2 is clipped by both, and counted as the low clip fraction
    logp = torch.tensor([[math.log(0.7)]], requires_grad=True)
    loss, means, _ = loss_of(dapo, logp, old, -torch.ones(1), torch.ones(1, 1))
    assert torch.autograd.grad(loss, logp)[0].item() == 0 and means["policy/clip_frac_low"].item() == 1.0


def test_on_policy_identity():
    _, old, _, adv, mask = random_batch(0)
    logp = old.clone().requires_grad_(True)
    loss, means, maxes = loss_of(dapo, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item() / mask.sum().item(), abs=1e-6)
    assert torch.allclose(grad, -adv[:, None] * mask / mask.sum(), atol=1e-7)
    assert means["policy/clip_frac"].item() == 0.0 and maxes["policy/ratio_max"].item() == 1.0


@pytest.mark.parametrize("length, penalty", [(1000, 0.0), (16384, 0.0), (16385, -0.000244), (18432, -0.5),
                                             (20479, -0.999756), (20480, -1.0), (20481, -1.0)])
def test_overlong_reward_reference_numbers(length, penalty):  # overlong shaping, L_max 20480, L_cache 4096
    assert dapo.overlong_reward([length], 20480, 4096).item() == pytest.approx(penalty, abs=1e-6)


def test_overlong_reward_scale_and_off():
    assert dapo.overlong_reward([48, 40, 10], 48, 8, penalty=0.5).tolist() == [-0.5, 0.0, 0.0]
    assert dapo.overlong_reward([48, 44], 48, 8).tolist() == [-1.0, -0.5]
    assert dapo.overlong_reward([48], 48, 0).tolist() == [0.0]


def test_informative_groups_and_how_many_each_process_trains_on():
    rewards = [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0.1, 0.1, 0.1, 0.2]
    assert dapo.informative_groups(rewards, 4).tolist() == [False, False, True, True]
    # the fewest kept over processes, at most the process's share, whole mini-batches
    assert dapo.groups_to_train(fewest_kept=7, prompts_local=4, num_generations=2, num_minibatches=4) == 4
    assert dapo.groups_to_train(fewest_kept=3, prompts_local=4, num_generations=2, num_minibatches=4) == 2
    assert dapo.groups_to_train(fewest_kept=3, prompts_local=4, num_generations=8, num_minibatches=4) == 3
    assert dapo.groups_to_train(fewest_kept=0, prompts_local=4, num_generations=8, num_minibatches=4) == 0


@pytest.mark.parametrize("overrides, message", [
    ({"overlong_buffer": 100}, "--overlong_buffer 100: must be in [0, --max_new_tokens]"),
    ({"max_num_gen_batches": 0}, "--max_num_gen_batches 0 be >= 1"),
    ({"num_generations": 1, "micro_batch_size": 8}, "groups of >= 2 completions are needed"),
])
def test_bad_arguments(overrides, message):
    with pytest.raises(ValueError) as error:
        resolved(dapo, **overrides)
    assert message in str(error.value)
    with pytest.raises(ValueError, match="must divide by the 2 processes"):
        resolved(dapo, 2, prompts_per_step=4, gen_prompts_per_step=5, num_generations=4, micro_batch_size=2)
    args = resolved(dapo)
    assert (args.gen_prompts_per_step, args.overlong_buffer, args.max_new_tokens) == (32, 9, 48)


@pytest.mark.slow
def test_one_process_dynamic_sampling_off_policy(tmp_path):
    """Rounds of fresh prompts until 4 informative groups; 4 mini-batches, the first on-policy (ratio exactly 1);
    16 new tokens, so most completions are cut and overlong filtering masks them."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", "--filter_groups_by", "reward",
                        "--loss_agg", "group-token-mean", "--overlong_filtering", "--max_new_tokens", "16",
                        *DAPO_SMALL], tmp_path, script="dapo.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["policy/first_minibatch_ratio_dev_max"] == 0.0 and 1 <= r["dapo/gen_rounds"] <= 10
        assert 0 < r["dapo/trained_groups"] <= 4 and 0 <= r["dapo/informative_group_frac"] <= 1
        assert r["policy/clip_frac"] == pytest.approx(r["policy/clip_frac_high"] + r["policy/clip_frac_low"])
        assert "charts/overlong_reward" in r and "losses/kl" not in r
        assert r["charts/truncated_frac"] > 0.5 and r["rollout/logprob_gap_max"] < 1e-4  # over trained tokens only
    assert max(r["policy/ratio_max"] for r in rows) > 1.0 and "eval/pass@1_greedy" in rows[1]


@pytest.mark.slow
def test_give_up_path_trains_on_nothing_when_no_group_is_informative(tmp_path):
    """Golds the model never writes: every group's accuracy is all 0, so max_num_gen_batches rounds run, no group is
    kept, the step says so in its metrics and the weights do not move."""
    from safetensors.torch import load_file

    from utils.tasks import TOY_MODEL_DIR

    path = tmp_path / "never.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i:02d}+01=", "answer": "\\frac{1}{7}"}) + "\n" for i in range(30)))
    _, rows = run_grpo(["--task", str(path), "--total_steps", "1", "--eval_every", "0", "--max_num_gen_batches", "2",
                        *DAPO_SMALL], tmp_path, script="dapo.py")
    assert rows[0]["dapo/gen_rounds"] == 2 and rows[0]["dapo/trained_groups"] == 0
    assert rows[0]["dapo/informative_group_frac"] == 0 and rows[0]["charts/accuracy"] == 0
    before, after = load_file(f"{TOY_MODEL_DIR}/model.safetensors"), load_file(
        str(tmp_path / "dapo__1" / "final" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in after)


@pytest.mark.slow
def test_two_processes(tmp_path):
    """Each process keeps its own groups; the stop test and the trained count are collective, so both run the same
    rounds, train on as many groups, and the run ends (a rank waiting forever would hit the timeout)."""
    launcher = two_processes(29534)
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--gen_prompts_per_step", "2", *DAPO_SMALL,
                        "--num_minibatches", "2"],
                       tmp_path, launcher=launcher, timeout=600, script="dapo.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["dapo/trained_groups"] in (0, 2, 4) and r["dapo/gen_rounds"] >= 1
        assert r.get("policy/first_minibatch_ratio_dev_max", 0.0) == 0.0  # absent in a step that trained nothing
