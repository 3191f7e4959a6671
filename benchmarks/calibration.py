"""Calibration on the toy task: calibrated.py (a stated probability paid by a proper scoring rule, arXiv 2512.19920)
against grpo.py (the binary reward) from the same start, the embedded model taught to state a probability
(toy_model/calibrated/), over seeds: does RL with the binary reward degrade calibration, as RLCR (arXiv 2507.16806)
reports, and does the calibrated reward keep or improve it?

    python benchmarks/calibration.py                       # seeds 1 2 3, 200 steps each, one run at a time
    python benchmarks/calibration.py --seeds 1 --steps 20  # a quick look
    python benchmarks/calibration.py --reuse               # runs that finished earlier are read, not rerun

Runs benchmarks/toy_runs.py's variants `calibrated` (`python calibrated.py`, its defaults) and `grpo_stating`
(`python grpo.py --model toy_model/calibrated --max_new_tokens 80`: grpo.py's reward, accuracy + 0.1 format, on the
same model and lengths), each for the same steps, evaluating every steps / 4, after an --eval_only of the start; and
writes benchmarks/results/<name>.md: the held-out greedy evaluation's calibration keys (eval/calibration/*,
plumbing/evaluation.py calibration_metrics, at --eval_risk_threshold 0.5) per variant, seed and evaluation, and their
means over seeds at the start and the end.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import ROOT, run, write_results  # noqa: E402

VARIANTS = ["calibrated", "grpo_stating"]
KEYS = [("eval/pass@1_greedy", "greedy pass@1"), ("eval/calibration/accuracy", "accuracy @0.5"),
        ("eval/calibration/hallucination", "hallucination @0.5"), ("eval/calibration/abstention", "abstention @0.5"),
        ("eval/calibration/ahr", "AHR @0.5"), ("eval/calibration/log_ahr_gain", "log AHR gain"),
        ("eval/calibration/ece", "ECE"), ("eval/calibration/brier", "Brier"), ("eval/calibration/auroc", "AUROC"),
        ("eval/calibration/confidence_mean", "mean q"), ("eval/calibration/stated_frac", "stated")]


def start_evaluation(out_dir, extra):
    """The start's evaluation: calibrated.py --eval_only on its default model (greedy: the same for every seed)."""
    cmd = [sys.executable, os.path.join(ROOT, "calibrated.py"), "--eval_only", "--exp_name", "start", "--output_dir",
           out_dir, *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(open(os.path.join(out_dir, "start__1", "eval_only.jsonl")).readlines()[-1])


def cells(row):
    return " | ".join(f"{row.get(key, np.nan):.3f}" for key, _ in KEYS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--name", default="toy_calibration")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("--reuse", action="store_true", help="read runs of the same command that finished earlier "
                        "in --out_dir instead of rerunning them (toy_runs.py's --reuse)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more flags for every run (both scripts)")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    out_dir = os.path.join(args.out_dir, args.name)
    os.makedirs(out_dir, exist_ok=True)
    start = start_evaluation(out_dir, extra)
    results = [run(variant, seed, args.steps, out_dir, extra, args.reuse) for variant in VARIANTS
               for seed in args.seeds]
    header = "| " + " | ".join(label for _, label in KEYS) + " |"
    seeds = " ".join(map(str, args.seeds))
    lines = [f"# {args.name}", "", f"Command: `python benchmarks/calibration.py --seeds {seeds} --steps {args.steps}"
             f"{' --reuse' if args.reuse else ''}{' -- ' + ' '.join(extra) if extra else ''}`: "
             "benchmarks/toy_runs.py's variants "
             f"{' and '.join(VARIANTS)} ({args.steps} steps, evaluated every {max(1, args.steps // 4)}), after "
             "`calibrated.py --eval_only` of the start (toy_model/calibrated/). Held-out greedy completions, one per "
             "problem (`eval/problems` of them); AHR: answered and right over answered and wrong at risk threshold "
             "0.5 (a stated q < 0.5 abstains); ECE over 10 equal-width bins of q; plumbing/evaluation.py "
             "calibration_metrics.", "", "| variant | seed | step " + header, "|" + "---|" * (3 + len(KEYS)),
             f"| start | - | 0 | {cells(start)} |"]
    for result in results:
        for row in (r for r in result["rows"] if "eval/pass@1_greedy" in r):
            lines.append(f"| {result['variant']} | {result['seed']} | {row['step']} | {cells(row)} |")
    lines += ["", f"Means over seeds {seeds} at the start and at step {args.steps}:", "",
              "| variant | step " + header, "|" + "---|" * (2 + len(KEYS)), f"| start | 0 | {cells(start)} |"]
    for variant in VARIANTS:
        ends = [[r for r in res["rows"] if "eval/pass@1_greedy" in r][-1] for res in results
                if res["variant"] == variant]
        mean = {key: np.mean([e.get(key, np.nan) for e in ends]) for key, _ in KEYS}
        lines.append(f"| {variant} | {args.steps} | {cells(mean)} |")
    write_results(args.name, lines)


if __name__ == "__main__":
    main()
