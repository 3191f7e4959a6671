"""Statistics over finished toy_runs.py runs that benchmarks/README.md quotes beside the tables: seconds until the
5-step mean reward is 0.2 above the first 5 steps', and per-algorithm metrics (DAPO's generation rounds, PPO's
critic, the high-entropy-token threshold and kept fraction, accuracy and format over the first 5 steps), and the steps
at which the 10-step mean reward reached 0.7, 0.8 and 0.9.

    python benchmarks/run_stats.py runs/benchmarks/toy_family runs/benchmarks/toy_papers
"""

import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import step_reaching  # noqa: E402


def stats(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    reward = np.array([r["charts/reward"] for r in rows])
    elapsed = np.cumsum([r["time/step"] + r.get("time/eval", 0.0) for r in rows])
    gain = next((i for i in range(5, len(rows) + 1) if reward[i - 5:i].mean() >= reward[:5].mean() + 0.2), None)
    out = {"s_to_gain_0.2": None if gain is None else round(float(elapsed[gain - 1])),
           "step_reaching_0.7_0.8_0.9": [step_reaching(rows, level) for level in (0.7, 0.8, 0.9)],
           "accuracy_first5": round(float(np.mean([r["charts/accuracy"] for r in rows[:5]])), 3),
           "format_first5": round(float(np.mean([r["charts/format"] for r in rows[:5]])), 3),
           "entropy_first_last": (round(rows[0]["losses/entropy"], 3), round(rows[-1]["losses/entropy"], 3))}
    if "dapo/gen_rounds" in rows[0]:
        rounds = [r["dapo/gen_rounds"] for r in rows]
        out.update(gen_rounds_median=float(np.median(rounds)), gen_rounds_max=max(rounds),
                   informative_frac_last20=round(float(np.mean([r["dapo/informative_group_frac"]
                                                                for r in rows[-20:]])), 2))
    if "critic/explained_variance" in rows[0]:
        out.update(explained_variance_max=round(max(r["critic/explained_variance"] for r in rows), 3),
                   value_loss_first_last=(round(rows[0]["critic/value_loss"], 3),
                                          round(rows[-1]["critic/value_loss"], 3)))
    if "policy/entropy_threshold" in rows[0]:
        kept = [r["policy/entropy_kept_frac"] for r in rows]
        out.update(kept_frac_range=(round(min(kept), 3), round(max(kept), 3)),
                   threshold_first_last=(round(rows[0]["policy/entropy_threshold"], 3),
                                         round(rows[-1]["policy/entropy_threshold"], 3)))
    return out


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        for run_dir in sorted(glob.glob(os.path.join(folder, "*__*"))):
            print(os.path.relpath(run_dir), json.dumps(stats(run_dir)))
