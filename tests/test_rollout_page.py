"""--html_every (plumbing/rollout_page.py): the page's numbers are the batch's, and each token's weight is the gradient
its algorithm's formula gives, checked here against the formula written out (GRPO off-policy, with its clip and KL
term; the high-entropy selection); the page is self-contained and shows every number it holds."""

import html
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT
from plumbing.rollout_page import number, token_flags, token_style


def run_one_step(tmp_path, script, *flags):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, script, "--total_steps", "1", "--eval_every", "0", "--exp_name", "page",
                           "--prompts_per_step", "4", "--num_generations", "4", "--html_every", "1",
                           "--output_dir", str(tmp_path), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    page = open(tmp_path / "page__1" / "rollouts" / "step_1.html").read()
    data = json.loads(re.search(r"<script type='application/json' id='data'>(.*?)</script>", page, re.S).group(1))
    return page, data


@pytest.mark.slow  # a one-step run
def test_grpo_page_weights_are_the_clipped_objectives_gradient(tmp_path):
    """Two mini-batches: the page shows the second (its rows trained after one optimizer step), where ratios differ
    from 1. Each token's weight is -dL/dlogp * N of the GRPO loss (arXiv 2402.03300, eq. 3, k3 KL with beta 0.04):
    N / (B |o_i|) (r A 1[the unclipped term is the min] - beta (1 - pi_ref / pi_theta))."""
    page, data = run_one_step(tmp_path, "grpo.py", "--num_minibatches", "2", "--html_groups", "2")
    rows = data["rows"]
    assert [row["row"] for row in rows] == list(range(8, 16))  # the last two groups: the second mini-batch
    B, N = len(rows), sum(sum(row["mask"]) for row in rows)
    beta, eps, off_policy = 0.04, 0.2, 0
    rewards = torch.tensor([row["reward"] for row in rows]).view(2, 4)
    for row in rows:
        assert row["num_seqs"] == B and row["num_tokens"] == N  # the mini-batch's counts (one process)
        assert row["reward"] == pytest.approx(row["accuracy"] + 0.1 * row["format"])
        length = sum(row["mask"])
        for t in range(len(row["mask"])):
            r, A = math.exp(row["logp"][t] - row["old_logp"][t]), row["advantage"][t]
            unclipped_is_min = r * A <= min(max(r, 1 - eps), 1 + eps) * A
            kl_grad = beta * (1 - math.exp(row["ref_logp"][t] - row["logp"][t]))
            expected = N / (B * length) * (r * A * unclipped_is_min - kl_grad)
            assert row["weight"][t] == pytest.approx(expected, rel=1e-4, abs=1e-6)  # float32 autograd vs float64
            assert row["pg_weight"][t] == pytest.approx(N / (B * length) * r * A * unclipped_is_min, rel=1e-4,
                                                        abs=1e-6)
            off_policy += abs(r - 1) > 1e-4
    assert off_policy > 0  # one optimizer step moved the policy
    expected_advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    assert torch.allclose(torch.tensor([row["advantage"][0] for row in rows]), expected_advantages.flatten(),
                          atol=1e-5)
    # the page shows what its data holds: a span per token, its title with the weight, grey when flagged
    for row in rows:
        spans = re.search(rf"<div class='completion' id='row{row['row']}'>(.*?)</div>", page, re.S).group(1)
        titles = re.findall(r"<span style='([^']*)' title='([^']*)'>", spans)
        assert len(titles) == len(row["mask"])
        for t, (style, title) in enumerate(titles):
            assert f"weight {number(row['weight'][t])} " in html.unescape(title)
            assert ("#e4e4e4" in style) == bool(token_flags(row, t) or row["weight"][t] == 0)
    assert not re.search(r"(src|href)=|https?://|<link|<script(?! type='application/json')", page)  # self-contained


@pytest.mark.slow  # a one-step run
def test_high_entropy_page_trains_the_top_entropy_tokens_only(tmp_path):
    """high_entropy.py (arXiv 2506.01939): the policy gradient flows through the top 20 % tokens by entropy; on the
    page every other token with an advantage is flagged and has weight 0 (on-policy, beta 0.04: the KL gradient is 0
    at step 1)."""
    page, data = run_one_step(tmp_path, "high_entropy.py", "--html_groups", "4")
    tokens = [(row["entropy"][t], row["pg_weight"][t], token_flags(row, t)) for row in data["rows"]
              for t in range(len(row["mask"])) if row["mask"][t] and row["advantage"][t] != 0]
    kept = [entropy for entropy, weight, _ in tokens if weight != 0]
    dropped = [entropy for entropy, weight, flags in tokens if weight == 0 and flags]
    assert kept and dropped and len(kept) + len(dropped) == len(tokens)
    assert min(kept) >= max(dropped) - 1e-5  # the threshold lies between them (pi_old's entropy: same weights)
    all_tokens = sum(sum(row["mask"]) for row in data["rows"])
    assert len(kept) <= math.ceil(0.2 * all_tokens) + 2  # the top 20 % of every token (ties aside)


def test_token_flags_name_the_mask_and_grey_the_token():
    row = {"mask": [1, 0, 1, 1, 1], "advantage": [1.0, 0.0, 1.0, 1.0, -1.0],
           "advantage_used": [1.0, 0.0, 0.0, 1.0, -1.0], "weight": [0.5, 0.0, 0.0, 0.0, -0.5],
           "pg_weight": [0.5, 0.0, 0.0, 0.0, -0.5]}
    assert token_flags(row, 0) == [] and token_flags(row, 4) == []
    assert "tool output" in token_flags(row, 1)[0]
    assert "advantage zeroed" in token_flags(row, 2)[0]
    assert "clipped" in token_flags(row, 3)[0]
    assert all("#e4e4e4" in token_style(row, t, 1.0) for t in (1, 2, 3))
    assert "0,170,60" in token_style(row, 0, 1.0) and "220,40,40" in token_style(row, 4, 1.0)
    filtered = dict(row, mask=[0] * 5)
    assert "left the loss" in token_flags(filtered, 0)[0]
