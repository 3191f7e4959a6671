"""Compute-scaling fits (ScaleRL, "The Art of Scaling Reinforcement Learning Compute for LLMs", arXiv 2510.13786,
eq. 1): per run, the sigmoid of reward against training compute C,

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

A is the asymptote (the reward the method tends to), B the slope (how fast it gets there in compute), C_mid the
compute at half the gain, R0 the run's starting reward (the mean of its first 5 steps, held fixed). Two methods can
trade one for the other: a higher A with a lower B reaches more but later. A is bounded by --max_reward (the paper's
pass rate is bounded by 1): a run still rising at its end does not identify A, and its fit says so by A at the bound
and a midpoint near or past its last step.

    python benchmarks/scaling_fit.py runs/benchmarks/toy_family --name toy_family_scaling

C is the run's training seconds (the sum of its time/step up to each step: the CPU-time analogue of the paper's GPU
hours; evaluations excluded), R the per-step mean reward. The fit: a grid over B and C_mid (log-spaced) with A from
linear least squares at each point, then standard errors of A, B and C_mid from the Jacobian at the optimum (the
linearized covariance sigma^2 (J^T J)^-1); the fit's error is its RMSE. numpy only. Per script: the median A and B
over seeds with their range. Writes benchmarks/results/<name>.md (and .png with matplotlib).
"""

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import pyplot, write_results  # noqa: E402


def sigmoid(compute, r0, a, b, c_mid):
    return r0 + (a - r0) / (1 + (c_mid / compute) ** b)


def fit_sigmoid(compute, reward, r0, a_max=None, grid=160):
    """Least-squares (A, B, C_mid) of sigmoid() with R0 fixed and R0 <= A <= a_max (the most reward there is: a run
    that has not bent over yet would otherwise get an asymptote no policy can reach); returns {"A", "B", "C_mid",
    "A_se", "B_se", "C_mid_se", "rmse"}."""
    compute, reward = np.asarray(compute, float), np.asarray(reward, float)
    y = reward - r0
    best = None
    for b in np.logspace(-1, 1, grid):
        for c_mid in np.logspace(np.log10(compute.min() / 10), np.log10(compute.max() * 10), grid):
            s = 1 / (1 + (c_mid / compute) ** b)
            gain = float(np.clip(s @ y / (s @ s), 0, np.inf if a_max is None else a_max - r0))  # A - R0: linear
            # given B and C_mid, so the bounded optimum is the clipped one
            sse = float(((y - gain * s) ** 2).sum())
            if best is None or sse < best[0]:
                best = (sse, r0 + gain, b, c_mid)
    sse, a, b, c_mid = best
    params = np.array([a, b, c_mid])
    steps = np.diag([1e-6, 1e-6 * b, 1e-6 * c_mid])  # central differences, one parameter at a time
    jacobian = np.stack([(sigmoid(compute, r0, *(params + d)) - sigmoid(compute, r0, *(params - d))) / (2 * d.sum())
                         for d in steps], axis=1)
    dof = max(1, len(y) - 3)
    try:
        errors = np.sqrt(np.diag(sse / dof * np.linalg.inv(jacobian.T @ jacobian)))
    except np.linalg.LinAlgError:  # a flat run: the slope and midpoint are not identified
        errors = np.full(3, np.inf)
    return {"A": a, "B": b, "C_mid": c_mid, "A_se": errors[0], "B_se": errors[1], "C_mid_se": errors[2],
            "rmse": float(np.sqrt(sse / len(y)))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", help="a folder of run folders <script>__<seed> (e.g. runs/benchmarks/toy_family)")
    parser.add_argument("--name", default="toy_family_scaling")
    parser.add_argument("--max_reward", type=float, default=1.1, help="the asymptote's bound: the most reward there "
                        "is (1.1 on the toy: accuracy 1 plus 0.1 x format 1)")
    args = parser.parse_args()
    fits = defaultdict(list)
    curves = {}
    for path in sorted(glob.glob(os.path.join(args.runs, "*__*", "metrics.jsonl"))):
        run = os.path.basename(os.path.dirname(path))
        rows = [json.loads(line) for line in open(path)]
        compute = np.cumsum([r["time/step"] for r in rows])
        reward = np.array([r["charts/reward"] for r in rows])
        r0 = float(reward[:5].mean())
        fit = fit_sigmoid(compute, reward, r0, args.max_reward)
        fits[run.split("__")[0]].append((run, r0, fit))
        curves[run] = (compute, reward, r0, fit)
    lines = [f"# {args.name}", "", f"Command: `python benchmarks/scaling_fit.py {args.runs} --name {args.name} "
             f"--max_reward {args.max_reward:g}`. Fit of R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) (arXiv "
             "2510.13786, eq. 1) to each run's per-step reward against its training seconds C; R0 = the mean reward "
             f"of its first 5 steps; R0 <= A <= {args.max_reward:g}; ± one standard error (linearized).", "",
             "| script | runs | A (median, range) | B (median, range) | C_mid s (median) | RMSE (median) |",
             "|---|---|---|---|---|---|"]
    for script, runs in sorted(fits.items()):
        a, b = [f["A"] for _, _, f in runs], [f["B"] for _, _, f in runs]
        lines.append(f"| {script} | {len(runs)} | {np.median(a):.3f} ({min(a):.3f}-{max(a):.3f}) | {np.median(b):.2f} "
                     f"({min(b):.2f}-{max(b):.2f}) | {np.median([f['C_mid'] for _, _, f in runs]):.1f} | "
                     f"{np.median([f['rmse'] for _, _, f in runs]):.3f} |")
    lines += ["", "Per run:", "", "| run | R0 | A | B | C_mid s | RMSE |", "|---|---|---|---|---|---|"]
    for script, runs in sorted(fits.items()):
        for run, r0, f in runs:
            lines.append(f"| {run} | {r0:.3f} | {f['A']:.3f} ± {f['A_se']:.3f} | {f['B']:.2f} ± {f['B_se']:.2f} | "
                         f"{f['C_mid']:.1f} ± {f['C_mid_se']:.1f} | {f['rmse']:.3f} |")
    path = write_results(args.name, lines)
    plt = pyplot()
    if plt is None:
        return
    scripts = sorted(fits)
    fig, axes = plt.subplots(1, len(scripts), figsize=(4 * len(scripts), 3.5), squeeze=False)
    for ax, script in zip(axes[0], scripts):
        for k, (run, _, _) in enumerate(fits[script]):
            compute, reward, r0, fit = curves[run]
            ax.plot(compute, reward, ".", color=f"C{k}", alpha=0.3, ms=3)
            ax.plot(compute, sigmoid(compute, r0, fit["A"], fit["B"], fit["C_mid"]), color=f"C{k}",
                    label=f"A {fit['A']:.2f}, B {fit['B']:.1f}")
        ax.set(xscale="log", xlabel="training seconds", ylabel="reward", title=script)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=100)


if __name__ == "__main__":
    main()
