"""utils/rl.py and grpo.py's micro-batches against reference numbers computed by hand (NumPy, float64) from each
formula: the KL estimators of Schulman's "Approximating KL Divergence" and their placements (Tang & Munos arXiv
2506.09477; the estimators of grpo_kl.py: test_grpo_kl.py), GRPO's group z-score (arXiv 2402.03300 §4.1.2),
token-weighted whitening (REINFORCE++ arXiv 2501.03262), pass@k and plumbing/evaluation.py's pass rates, the
micro-batches; and the loss aggregations of the scripts' compute_loss: their values by hand and their invariance to
how a mini-batch is cut into micro-batches."""

import importlib

import pytest
import torch

from tests.helpers import loss_of, resolved
from grpo import Batch, micro_batches
from utils.rl import group_centered, group_zscore, kl_k1, kl_k2, kl_k3, masked_whiten, pass_at_k

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


@pytest.mark.parametrize("name, per_sample_loss, expected", [  # rho * k3 and k3+: grpo_kl.kl_term (test_grpo_kl.py)
    ("k2 as a loss", kl_k2, GRAD_REVERSE_KL),
    ("k1 in the reward", lambda lp, ref: kl_k1(lp, ref).detach() * lp, GRAD_REVERSE_KL),
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
    assert group_zscore(r, 1e-6)[0].tolist() == pytest.approx(group_eps6, abs=1e-5)
    assert group_zscore(r, 1e-4)[0].tolist() == pytest.approx(group_eps4, abs=1e-5)
    assert group_zscore(r)[0].tolist() == pytest.approx(group_eps6, abs=1e-5)  # the default eps is 1e-6
    assert group_centered(r)[0].tolist() == pytest.approx(mean_only, abs=1e-9)
    assert not torch.isnan(group_zscore(r, 0.0)).any() or r.std() == 0


def test_group_advantages_of_several_groups_are_each_groups():
    r = T([[1.0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    assert group_centered(r).tolist() == [[0.75, -0.25, -0.25, -0.25], [0.25, 0.25, 0.25, -0.75]]
    assert group_zscore(r).tolist() == [pytest.approx([1.499997, -0.499999, -0.499999, -0.499999], abs=1e-5),
                                        pytest.approx([0.499999, 0.499999, 0.499999, -1.499997], abs=1e-5)]


@pytest.mark.parametrize("value, size", [(0.1, 8), (1.1, 12), (0.1, 3), (1 / 3, 7)])
@pytest.mark.parametrize("normalize", [group_zscore, group_centered])  # the batch std (lite_ppo.py): test_lite_ppo.py
def test_all_equal_group_gets_exactly_zero_advantage(value, size, normalize):
    """float32: the mean of 8 x 0.1 is 1 ulp off, and / (std 0 + 1e-6) made it -0.00745 (12 x 1.1: 0.106)."""
    rewards = torch.tensor([[value] * size, [0.0] + [1.0] * (size - 1)], dtype=torch.float32)
    adv = normalize(rewards)
    assert adv[0].tolist() == [0.0] * size
    assert adv[1].abs().sum() > 0


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


def test_masked_whiten_single_token_is_finite():
    values, mask = T([[3.0, 7.0, 1.0]]), T([[0.0, 1.0, 0.0]])
    for unbiased in (True, False):
        out = masked_whiten(values, mask, unbiased=unbiased)
        assert torch.isfinite(out).all() and out[0, 1].item() == 0.0


# ---- The loss aggregations: each script's compute_loss -------------------------------------------------------------

LOSS = T([[1.0, 2, 3, 0, 0], [4, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
MASK = T([[1.0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize("script, flags, expected", [  # by hand from the three rows above
    ("dapo", {"loss_agg": "token-mean"}, 15 / 9),  # 1 / sum_i |o_i|
    ("grpo", {"beta": 0.0}, 7 / 3),  # the per-completion token mean, then the mean: 1/B sum_i 1/|o_i|
    ("dapo", {"loss_agg": "group-token-mean"}, 5.0),  # seq-mean-token-sum (the group weights ride in the advantages)
    ("dr_grpo", {"beta": 0.0, "max_new_tokens": 5}, 1.0),  # seq-mean-token-sum-norm: 1/B sum_i sum_t / L_max
])
def test_aggregation_values(script, flags, expected):
    """On-policy (ratio 1) with advantage -LOSS on each token, -min(r A, clip(r) A) is LOSS token by token; padding
    holds 99s that must not count."""
    module = importlib.import_module(script)
    logp = torch.zeros(3, 5)
    loss, _, _ = loss_of(module, logp, logp, -(LOSS + 99 * (1 - MASK)), MASK, **flags)
    assert loss.item() == pytest.approx(expected)


def test_dr_grpos_constant_is_always_set_at_run_start():
    """The L_max normalizer is --max_new_tokens, which resolve_args always fills in (the embedded model: 48)."""
    dr_grpo = importlib.import_module("dr_grpo")
    assert resolved(dr_grpo).max_new_tokens == 48
    assert resolved(dr_grpo, max_new_tokens=16).max_new_tokens == 16


@pytest.mark.parametrize("script, flags", [
    ("grpo", {"beta": 0.04}),  # 1/|o_i| per completion, then 1/B
    ("dapo", {"loss_agg": "token-mean"}),  # 1 / the mini-batch's tokens
    ("dr_grpo", {"beta": 0.0, "max_new_tokens": 7}),  # 1 / (B L_max)
])
def test_aggregation_micro_batch_invariance(script, flags):
    """Summing micro-batch losses divided by the global counts gives the full-batch loss and gradient exactly."""
    module = importlib.import_module(script)
    args = module.Args(**flags)
    torch.manual_seed(0)
    old = -torch.rand(6, 7) * 2
    logp = (old + 0.3 * torch.randn(6, 7)).requires_grad_(True)  # off-policy: some ratios are clipped
    ref = old + 0.2 * torch.randn(6, 7)
    adv = torch.randn(6)[:, None].expand(6, 7)
    mask = (torch.rand(6, 7) > 0.3).float()
    mask[:, 0] = 1
    counts = (torch.tensor(6.0), mask.sum())

    def loss(rows, counts):
        return module.compute_loss(logp[rows], old[rows], ref[rows], adv[rows] * mask[rows], mask[rows], counts,
                                   args)[0]

    full = loss(slice(0, 6), counts)
    (full_grad,) = torch.autograd.grad(full, logp)
    split = sum(loss(slice(i, i + 2), counts) for i in range(0, 6, 2))
    assert split.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(torch.autograd.grad(split, logp)[0], full_grad, atol=1e-7)
    assert full_grad.abs().max() > 0
    # the classic bug: averaging per-micro-batch token means is not the same thing
    if script == "dapo":
        wrong = sum(loss(slice(i, i + 2), (torch.tensor(2.0), mask[i:i + 2].sum())) for i in range(0, 6, 2)) / 3
        assert not torch.allclose(torch.autograd.grad(wrong, logp)[0], full_grad, atol=1e-4)


# ---- Micro-batches (grpo.py micro_batches) --------------------------------------------------------------------------


def test_micro_batches_group_similar_lengths_and_cut_the_padding():
    lengths = [5, 1, 9, 3, 7, 2, 0, 4]  # row 6: a completion masked out of the loss (DAPO's overlong filtering)
    mask = torch.tensor([[1.0] * n + [0.0] * (9 - n) for n in lengths])
    batch = Batch(input_ids=torch.arange(8 * 11).view(8, 11), attention_mask=torch.ones(8, 11, dtype=torch.long),
                  prompt_width=2, mask=mask, engine_logp=torch.randn(8, 9),
                  advantages=torch.arange(8.0)[:, None] * mask, old_logp=torch.randn(8, 9))
    chunks = list(micro_batches(batch, 3))
    assert [c.tolist() for c, _ in chunks] == [[6, 1, 5], [3, 7, 0], [4, 2]]  # sorted by length, stable
    for chunk, mc in chunks:
        width = max(1, max(lengths[i] for i in chunk))
        assert mc.mask.shape == mc.engine_logp.shape == mc.advantages.shape == mc.old_logp.shape == (len(chunk), width)
        assert mc.input_ids.shape == mc.attention_mask.shape == (len(chunk), 2 + width)
        assert mc.prompt_width == 2 and mc.ref_logp is None  # an absent tensor stays absent
        assert torch.equal(mc.input_ids, batch.input_ids[chunk, :2 + width])
        assert torch.equal(mc.engine_logp, batch.engine_logp[chunk, :width])
        assert torch.equal(mc.old_logp, batch.old_logp[chunk, :width])
        assert torch.equal(mc.advantages, batch.advantages[chunk, :width])
        assert mc.mask.sum() == mask[chunk].sum()  # no loss token is cut
        assert mc.advantages.sum() == batch.advantages[chunk].sum()
    # a mini-batch's rows: the micro-batches' rows index the mini-batch
    minibatch = batch.select(torch.tensor([7, 2]))
    assert len(minibatch) == 2 and minibatch.mask.shape == (2, 9)
    (rows, mc), = micro_batches(minibatch, 3)
    assert rows.tolist() == [0, 1] and mc.mask.sum(-1).tolist() == [4.0, 9.0]  # rows 7 and 2, shortest first


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 4, 1.0), (4, 0, 4, 0.0), (4, 2, 2, 5 / 6), (8, 3, 4, 13 / 14),
    (100, 3, 50, 1 - 50 * 49 * 48 / (100 * 99 * 98)),  # C(97, 50) / C(100, 50)
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):  # 1 - C(n - c, k) / C(n, k), by hand
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_rates_from_known_completions():
    """plumbing/evaluation.py on 3 toy problems, 4 samples each, 2 prompts per sampling call: problem 0 always right,
    problem 1 right in 1 sample of 4 and wrong greedy, problem 2 never right and unformatted greedy. By hand: greedy
    pass@1 1/3; sampled pass@1 (1 + 1/4 + 0)/3; pass@2 (1 + (1 - C(3,2)/C(4,2)) + 0)/3 = 1/2; pass@4 2/3; format 2/3."""
    from accelerate import Accelerator

    from plumbing.evaluation import pass_rates
    from plumbing.models import load_tokenizer
    from utils.rewards import RewardScorer
    from plumbing.run import RunArgs
    from utils.tasks import TOY_MODEL_DIR, toy_problems

    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    rows = toy_problems("test")[:3]
    right = {row["prompt"]: row["answer"] for row in rows}
    wrong = {prompt: f"{(int(answer) + 1) % 1000:03d}" for prompt, answer in right.items()}
    calls = []

    def sample_texts(prompts, n, temperature, top_p):
        calls.append((len(prompts), n, temperature, top_p))
        texts = []
        for ids in prompts:
            prompt = tokenizer.decode(ids)
            problem = [r["prompt"] for r in rows].index(prompt)
            if temperature == 0:
                texts.append([f"<answer>{right[prompt]}</answer>", f"<answer>{wrong[prompt]}</answer>", "no answer"]
                             [problem])
            else:
                texts += [f"<answer>{(right if i < [4, 1, 0][problem] else wrong)[prompt]}</answer>" for i in range(n)]
        return texts

    run = RunArgs(eval_size=3, eval_samples=4, eval_temperature=0.6, eval_top_p=0.9)
    result = pass_rates(sample_texts, RewardScorer("toy", "answer_tags"), tokenizer, rows, Accelerator(cpu=True), run,
                        chunk_size=2)
    assert calls == [(2, 1, 0.0, 1.0), (2, 4, 0.6, 0.9), (1, 1, 0.0, 1.0), (1, 4, 0.6, 0.9)]
    assert result == pytest.approx({"eval/pass@1_greedy": 1 / 3, "eval/pass@1_sampled_k4": 1.25 / 3,
                                    "eval/pass@2": 0.5, "eval/pass@4": 2 / 3, "eval/format_greedy": 2 / 3,
                                    "eval/problems": 3}, abs=1e-6)
