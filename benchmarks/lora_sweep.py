"""Full fine-tuning against LoRA (--lora_rank) at a sweep of learning rates: the same prompts, steps and seeds.

    python benchmarks/lora_sweep.py --jobs 2                          # the toy: 3 seeds, 200 steps
    python benchmarks/lora_sweep.py --name lora_smollm2 --seeds 1 2 --steps 20 --full_lrs 1e-5 \\
        --lora_lrs 1e-4 --ranks 1 8 64 -- --model smollm2-135m --task rg:chain_sum:... --instruction user ...

Each configuration (full fine-tuning at each of --full_lrs, each rank of --ranks at each of --lora_lrs) runs grpo.py
for every seed through benchmarks/toy_runs.py's runner. The table gives, per configuration, the mean and standard
error over seeds of the last 10 steps' reward and of the final greedy pass@1, the median step time and peak RSS; the
best learning rate per rank (by final greedy pass@1, then reward); and each rank's difference from full fine-tuning at
their best learning rates with its standard error. The plot: reward (a moving average over a quarter of the run, at
most 10 steps, mean over seeds) and held-out greedy pass@1 against steps, each rank at its best learning rate.
"""

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy_runs  # noqa: E402


def config_name(rank, lr):
    return f"full_lr{lr:g}" if rank == 0 else f"r{rank}_lr{lr:g}"


def mean_sem(values):
    values = np.asarray(values, dtype=float)
    return values.mean(), (values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan"))


def pm(mean, sem, sign=""):
    """'mean ± sem', or the mean alone when one seed gives no standard error."""
    return f"{mean:{sign}.3f}" + ("" if np.isnan(sem) else f" ± {sem:.3f}")


def summarize(runs):
    """One configuration's seeds -> its row of numbers."""
    last_reward = [np.mean([r["charts/reward"] for r in run["rows"][-10:]]) for run in runs]
    final_greedy = [[r for r in run["rows"] if "eval/pass@1_greedy" in r][-1]["eval/pass@1_greedy"] for run in runs]
    return {"reward": mean_sem(last_reward), "greedy": mean_sem(final_greedy), "greedy_seeds": final_greedy,
            "step_s": float(np.median([r["time/step"] for run in runs for r in run["rows"]])),
            "rss_gb": float(np.median([max(r["memory/rss_gb_max"] for r in run["rows"]) for run in runs]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--full_lrs", nargs="+", type=float, default=[2.5e-4, 5e-4, 1e-3])
    parser.add_argument("--lora_lrs", nargs="+", type=float, default=[1.5e-3, 5e-3, 1.5e-2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--name", default="lora_toy")
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same command")
    parser.add_argument("--out_dir", default=os.path.join(toy_runs.ROOT, "runs", "benchmarks"))
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more grpo.py flags for every run")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    configs = [(0, lr) for lr in args.full_lrs] + [(rank, lr) for rank in args.ranks for lr in args.lora_lrs]
    for rank, lr in configs:
        toy_runs.VARIANTS[config_name(rank, lr)] = ("grpo.py", ["--learning_rate", f"{lr:g}", "--lora_rank", str(rank)])
    out_dir = os.path.join(args.out_dir, args.name)
    jobs = [(config_name(rank, lr), seed) for rank, lr in configs for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: toy_runs.run(*job, args.steps, out_dir, extra, args.reuse), jobs))
    by_config = {name: [r for r in results if r["variant"] == name] for name in dict.fromkeys(j[0] for j in jobs)}
    rows = {name: summarize(runs) for name, runs in by_config.items()}

    best = {}  # rank -> its best configuration by final greedy pass@1, then reward
    for rank, lr in configs:
        name = config_name(rank, lr)
        if rank not in best or (rows[name]["greedy"][0], rows[name]["reward"][0]) > (
                rows[best[rank]]["greedy"][0], rows[best[rank]]["reward"][0]):
            best[rank] = name
    full = rows[best[0]]
    command = (f"python benchmarks/lora_sweep.py --ranks {' '.join(map(str, args.ranks))} --full_lrs "
               f"{' '.join(f'{x:g}' for x in args.full_lrs)} --lora_lrs {' '.join(f'{x:g}' for x in args.lora_lrs)} "
               f"--seeds {' '.join(map(str, args.seeds))} --steps {args.steps} --jobs {args.jobs} --name {args.name}"
               + (" -- " + " ".join(extra) if extra else ""))
    lines = [f"# {args.name}", "", f"Command: `{command}`", "",
             f"grpo.py, {args.steps} steps, seeds {', '.join(map(str, args.seeds))}; mean ± standard error over "
             "seeds (the mean alone with one seed). Step time and peak RSS: medians, as ratios against full "
             f"fine-tuning at its best learning rate ({best[0]}), measured in this invocation ({args.jobs} run(s) at a "
             "time).", "",
             "| configuration | reward, last 10 steps | final greedy pass@1 | median step s | peak RSS GB | "
             "step time / full | peak RSS / full |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        mark = " **(best lr)**" if name in best.values() else ""
        lines.append(f"| {name}{mark} | {pm(*row['reward'])} | {pm(*row['greedy'])} | {row['step_s']:.3f} | "
                     f"{row['rss_gb']:.2f} | {row['step_s'] / full['step_s']:.2f} | "
                     f"{row['rss_gb'] / full['rss_gb']:.2f} |")
    lines += ["", "Each rank at its best learning rate against full fine-tuning at its best (difference of the "
              "means, ± the standard error of the difference):", "",
              "| rank | best lr config | Δ reward | Δ final greedy pass@1 |", "|---|---|---|---|"]
    for rank in args.ranks:
        row = rows[best[rank]]
        d_reward = row["reward"][0] - full["reward"][0], np.hypot(row["reward"][1], full["reward"][1])
        d_greedy = row["greedy"][0] - full["greedy"][0], np.hypot(row["greedy"][1], full["greedy"][1])
        lines.append(f"| {rank} | {best[rank]} | {pm(*d_reward, '+')} | {pm(*d_greedy, '+')} |")
    path = toy_runs.write_results(args.name, lines)
    plot(path, args.name, {rank: by_config[name] for rank, name in best.items()}, best)


def plot(path, name, runs_by_rank, best):
    plt = toy_runs.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = 10
    for marker, (rank, runs) in zip("osD^v", runs_by_rank.items()):
        label = f"{'full fine-tuning' if rank == 0 else f'LoRA rank {rank}'} ({best[rank].split('_')[-1]})"
        rewards = np.mean([[r["charts/reward"] for r in run["rows"]] for run in runs], axis=0)
        window = max(1, min(10, len(rewards) // 4))  # a short run: a quarter of it
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        (line,) = left.plot(np.arange(window, len(rewards) + 1), smooth, label=label)
        evals = [[(r["step"], r["eval/pass@1_greedy"]) for r in run["rows"] if "eval/pass@1_greedy" in r]
                 for run in runs]
        steps = [s for s, _ in evals[0]]
        right.plot(steps, np.mean([[v for _, v in e] for e in evals], axis=0), marker=marker, color=line.get_color(),
                   alpha=0.7, label=label)
    left.set(xlabel="step", ylabel=f"reward ({window}-step moving average, mean over seeds)")
    right.set(xlabel="step", ylabel="held-out greedy pass@1 (mean over seeds)")
    left.legend()
    right.legend()
    fig.suptitle(f"{name}: each at its best learning rate")
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=100)


if __name__ == "__main__":
    main()
