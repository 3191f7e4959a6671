"""dr_grpo.py (Dr. GRPO, arXiv 2503.20783) end to end; its advantages, its constant normalizer and their worked
examples are checked in tests/test_grpo_loss.py and tests/test_rl_utils.py."""

import pytest

from tests.helpers import SMALL, run_grpo


@pytest.mark.slow
def test_end_to_end(tmp_path):
    """Two steps at the paper's defaults: no reference model (beta 0: no KL logged), the policy trained."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", *SMALL], tmp_path, script="dr_grpo.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "losses/kl" not in r and r["policy/grad_norm"] > 0 and "charts/reward" in r
