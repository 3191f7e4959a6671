"""grpo_tools.py's default run on the toy task (three-digit products, the Python tool): accuracy and tool use against
steps and wall time, over seeds.

    python benchmarks/tool_use.py                          # seeds 1 2 3, 60 steps each, one run at a time
    python benchmarks/tool_use.py --seeds 1 --steps 200    # the default run's length

Runs `python grpo_tools.py --seed S --total_steps N` (every other flag at its default) in a subprocess, one CPU thread,
and writes benchmarks/results/<name>.md: per seed, the accuracy and tool-use metrics at a few steps, the wall time to
them (training only, evaluation excluded), and held-out greedy pass@1 at the start and at the end.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import ROOT, write_results  # noqa: E402

KEYS = [("charts/accuracy", "accuracy"), ("tools/call_frac", "call rate"), ("charts/accuracy_with_call",
        "accuracy with a call"), ("charts/accuracy_without_call", "accuracy without"), ("tools/error_frac",
        "failed calls"), ("tools/model_tokens", "model tokens")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--name", default="toy_tool_use")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    args = parser.parse_args()
    out_dir = os.path.join(args.out_dir, args.name)
    marks = sorted({1, 5, 10, 20, args.steps // 2, args.steps} - {0})
    lines = [f"# {args.name}", "", f"Command: `python benchmarks/tool_use.py --seeds {' '.join(map(str, args.seeds))} "
             f"--steps {args.steps}`; each run: `python grpo_tools.py --seed S --total_steps {args.steps} "
             f"--eval_every {args.steps} --threads 1`. Metrics are the step's rollout (256 completions, T=1); the "
             "seconds are the training steps' sum up to that step.", "",
             "| seed | step | s | " + " | ".join(label for _, label in KEYS) + " |", "|" + "---|" * (3 + len(KEYS))]
    summary = []
    for seed in args.seeds:
        run_dir = os.path.join(out_dir, f"grpo_tools__{seed}")
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, os.path.join(ROOT, "grpo_tools.py"), "--seed", str(seed), "--total_steps",
               str(args.steps), "--eval_every", str(args.steps), "--threads", "1", "--output_dir", out_dir]
        start = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.time() - start
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        seconds = np.cumsum([r["time/step"] for r in rows])
        for step in marks:
            r = rows[step - 1]
            lines.append(f"| {seed} | {step} | {seconds[step - 1]:.0f} | " + " | ".join(
                f"{r[key]:.3f}" if key != "tools/model_tokens" else f"{r[key]:.1f}" for key, _ in KEYS) + " |")
        summary.append((seed, rows[-1].get("eval/pass@1_greedy"), rows[-1].get("eval/tool_calls_greedy"), wall))
    lines += ["", "| seed | greedy pass@1 at the end (500 held-out problems) | greedy calls per completion | "
              "wall s (with evaluation) |", "|---|---|---|---|"]
    lines += [f"| {seed} | {greedy:.3f} | {calls:.3f} | {wall:.0f} |" for seed, greedy, calls, wall in summary]
    write_results(args.name, lines)


if __name__ == "__main__":
    main()
