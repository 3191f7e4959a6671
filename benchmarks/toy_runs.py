"""Learning curves on the embedded toy task: each variant over several seeds, as a table and a PNG.

    python benchmarks/toy_runs.py                       # grpo (paper defaults), 3 seeds, 200 steps
    python benchmarks/toy_runs.py --variants grpo dr_grpo lite_ppo --seeds 1 2 3
    python benchmarks/toy_runs.py --variants grpo vllm_cpu --seeds 1 --steps 60   # engine step-time ratio
    python benchmarks/toy_runs.py --variants grpo dapo gspo cispo aspo reinforce_pp reinforce_pp_baseline ppo --jobs 2
    python benchmarks/toy_runs.py --variants ppo ppo_groups ppo_256_prompts ppo_1_epoch --steps 80 --jobs 2

Runs the algorithm scripts in subprocesses (one CPU thread each; --jobs N at a time), reads each run's metrics.jsonl,
and writes benchmarks/results/<name>.md (+ .png when matplotlib is installed). Timings are medians over steps, compared
as ratios against the first variant measured in the same invocation.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name: (script, flags)
    "grpo": ("grpo.py", []),  # the paper: group z-score, per-completion token mean, k3 KL in the loss (beta 0.04)
    "dr_grpo": ("dr_grpo.py", []),  # unnormalized group-centered advantages, token sums over a constant, no KL
    "lite_ppo": ("lite_ppo.py", []),  # group-mean, batch-std advantages, token-mean
    "grpo_kl": ("grpo_kl.py", []),  # the KL term's gradient made unbiased (k2 in the loss)
    "k3_is": ("grpo_kl.py", ["--kl_estimator", "k3_is"]),  # k3 weighted by pi_theta / pi_old
    "no_kl": ("grpo.py", ["--beta", "0"]),
    "vllm_cpu": ("grpo.py", ["--engine", "vllm"]),
    "dapo": ("dapo.py", []),  # each script with its own defaults
    "gspo": ("gspo.py", []),
    "cispo": ("cispo.py", []),
    "aspo": ("aspo.py", []),
    "reinforce_pp": ("reinforce_pp.py", []),
    "reinforce_pp_baseline": ("reinforce_pp.py", ["--baseline"]),
    "gdpo": ("gdpo.py", []),  # accuracy and format normalized separately, then summed
    "top_entropy": ("high_entropy.py", []),  # the policy gradient of the top 20 % tokens only
    "grpo_tools": ("grpo_tools.py", []),  # the tool task (three-digit products, the Python tool), multi-turn
    "empg": ("empg.py", []),  # grpo_tools.py with each turn's advantage modulated by its entropy (k 1, k_f 1, zeta 0.1)
    # the entropy-mechanism paper's methods act off-policy: 4 mini-batches (KL-Cov's penalty is 0 on the first)
    "grpo_mu4": ("grpo.py", ["--num_minibatches", "4"]),
    "clip_cov": ("clip_cov.py", ["--num_minibatches", "4"]),
    "kl_cov": ("clip_cov.py", ["--method", "kl_cov", "--num_minibatches", "4"]),
    "grpo_async": ("grpo_async.py", []),  # partial rollouts: 1.5x groups in flight, staleness <= 1, TIS cap 2
    "grpo_async_vllm": ("grpo_async.py", ["--engine", "vllm"]),
    "async_no_is": ("grpo_async.py", ["--tis_cap", "0"]),  # the older tokens uncorrected
    "async_token_mask": ("grpo_async.py", ["--tis_mode", "token-mask"]),  # IcePop-style: outside [1/2, 2] masked
    "async_seq_mask": ("grpo_async.py", ["--tis_mode", "seq-mask"]),  # MIS: a sequence outside [1/2, 2] masked
    "sft": ("sft.py", []),  # the gold answers' log-likelihood
    "rft": ("sft.py", ["--data", "rft"]),  # the policy's own correct samples
    "dpo_offline": ("dpo.py", ["--data", "offline"]),  # pairs from the initial policy's samples
    "dpo_online": ("dpo.py", ["--data", "online"]),  # pairs from the current policy's samples
    "dpo_offline_lr1e-4": ("dpo.py", ["--data", "offline", "--learning_rate", "1e-4"]),  # offline at a lower rate
    "dpo_offline_beta1": ("dpo.py", ["--data", "offline", "--learning_rate", "1e-4", "--beta", "1"]),  # nearer pi_ref
    "dpo_offline_beta3": ("dpo.py", ["--data", "offline", "--learning_rate", "1e-4", "--beta", "3"]),
    "dpo_online_lr1e-4": ("dpo.py", ["--data", "online", "--learning_rate", "1e-4"]),  # online at the same rate
    "dpo_offline_beta3_lr5e-4": ("dpo.py", ["--data", "offline", "--beta", "3"]),
    "dpo_online_beta3": ("dpo.py", ["--data", "online", "--learning_rate", "1e-4", "--beta", "3"]),
    "calibrated": ("calibrated.py", []),  # a stated probability paid by 2 c q - q^2 (toy_model/calibrated, 80 tokens)
    "grpo_stating": ("grpo.py", ["--model", "toy_model/calibrated", "--max_new_tokens", "80"]),  # the same start
    "ppo": ("ppo.py", []),  # 128 prompts x 1 completion, 2 epochs of 2 mini-batches
    "ppo_groups": ("ppo.py", ["--num_generations", "8", "--prompts_per_step", "16"]),  # as many completions, in groups
    "ppo_256_prompts": ("ppo.py", ["--prompts_per_step", "256"]),  # twice the batch
    "ppo_1_epoch": ("ppo.py", ["--prompts_per_step", "256", "--num_epochs", "1", "--num_minibatches", "4"]),
}
PHASES = ["time/rollout", "time/score", "time/train", "time/step"]


def run(variant, seed, steps, out_dir, extra, reuse=False):
    exp = f"{variant}"
    run_dir = os.path.join(out_dir, f"{exp}__{seed}")
    done = os.path.join(run_dir, "benchmark.json")  # written when a run finished: its command and wall time
    script, flags = VARIANTS[variant]
    cmd = [sys.executable, os.path.join(ROOT, script), "--exp_name", exp, "--seed", str(seed), "--total_steps",
           str(steps), "--eval_every", str(max(1, steps // 4)), "--output_dir", out_dir, *flags, *extra]
    if reuse and os.path.exists(done) and json.load(open(done))["cmd"][1:] == cmd[1:]:
        wall = json.load(open(done))["wall_s"]  # --reuse: a finished run of the same command is read, not rerun
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
        start = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.time() - start
        with open(done, "w") as f:
            json.dump({"cmd": cmd, "wall_s": wall}, f)
        drop_weights(run_dir)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"variant": variant, "seed": seed, "wall_s": wall, "rows": rows}


def drop_weights(run_dir):
    """A benchmark reads a finished run's metrics, never its weights: its checkpoint/ and final/ go (2.6 GB for a
    SmolLM2 run: a sweep would fill the disk)."""
    for folder in ("checkpoint", "final"):
        shutil.rmtree(os.path.join(run_dir, folder), ignore_errors=True)


def step_reaching(rows, target, window=10):
    """The step (1-based) at which the `window`-step moving average of the reward first reaches `target`; None if it
    never does."""
    rewards = np.array([r.get("charts/reward", np.nan) for r in rows])  # (nan never reaches a target)
    return next((end for end in range(window, len(rows) + 1) if rewards[end - window:end].mean() >= target), None)


def seconds_to(rows, target, window=10):
    """Training seconds (step times, evaluation excluded) until the `window`-step moving average of the reward first
    reaches `target`; None if it never does."""
    end = step_reaching(rows, target, window)
    return None if end is None else float(np.sum([r["time/step"] for r in rows[:end]]))


def pyplot():
    """matplotlib's pyplot without a display, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def results_dir():
    """benchmarks/results, or the folder in the environment variable TINYRL_RESULTS (as the tests set it)."""
    return os.environ.get("TINYRL_RESULTS") or os.path.join(ROOT, "benchmarks", "results")


def write_results(name, lines, out=None):
    """Print a results table and write it to <out>/<name>.md (out: results_dir()); returns the path without its
    suffix."""
    out = out or results_dir()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def summarize(result, target):
    rows = result["rows"]
    mean = lambda key, part: np.mean([r.get(key, np.nan) for r in part])  # noqa: E731  (nan: a script that samples
    # no rollout, dpo.py --data offline or file, logs no charts/*)
    evals = [r for r in rows if "eval/pass@1_greedy" in r]
    sampled_key = next(k for k in evals[-1] if k.startswith("eval/pass@1_sampled"))
    return {
        "reward_first5": mean("charts/reward", rows[:5]), "reward_last5": mean("charts/reward", rows[-5:]),
        "accuracy_last5": mean("charts/accuracy", rows[-5:]), "format_last5": mean("charts/format", rows[-5:]),
        "length_first5": mean("charts/completion_length", rows[:5]),
        "length_last5": mean("charts/completion_length", rows[-5:]),
        "greedy_end": evals[-1]["eval/pass@1_greedy"], "sampled_end": evals[-1][sampled_key],
        "gap_max": max(r.get("rollout/logprob_gap_max", 0.0) for r in rows),  # dapo: absent when nothing trained
        **{p: np.median([r[p] for r in rows]) for p in PHASES},
        "wall_s": result["wall_s"], "to_target_s": seconds_to(rows, target),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["grpo"], choices=sorted(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses one CPU thread)")
    parser.add_argument("--name", default=None, help="results file name (default: the variants joined)")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("--target", type=float, default=0.9, help="reward level for the time-to-reward column")
    parser.add_argument("--reuse", action="store_true", help="read runs of the same command that finished earlier in "
                        "--out_dir instead of rerunning them (their timings were measured then, under that load)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more grpo.py flags for every run")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    name = args.name or "toy_" + "_".join(args.variants)
    out_dir = os.path.join(args.out_dir, name)
    with ThreadPoolExecutor(args.jobs) as pool:  # --jobs 2 on 2 cores: one thread per run, two runs at a time
        results = list(pool.map(lambda vs: run(*vs, args.steps, out_dir, extra, args.reuse),
                                [(v, s) for v in args.variants for s in args.seeds]))
    table = [{"variant": r["variant"], "seed": r["seed"], **summarize(r, args.target)} for r in results]

    base = [t for t in table if t["variant"] == args.variants[0]]
    lines = [f"# {name}", "", f"Command: `python benchmarks/toy_runs.py --variants {' '.join(args.variants)} --seeds "
             f"{' '.join(map(str, args.seeds))} --steps {args.steps} --jobs {args.jobs}"
             f"{' --name ' + args.name if args.name else ''}{' --reuse' if args.reuse else ''}"
             f"{f' --target {args.target}' if args.target != 0.9 else ''}{' -- ' + ' '.join(extra) if extra else ''}`",
             "",
             "| variant | seed | reward first 5 | reward last 5 | accuracy last 5 | format last 5 | length first 5 | "
             f"length last 5 | greedy pass@1 end | sampled pass@1 end | max logprob gap | median step s | wall s | "
             f"s to reward {args.target} |", "|" + "---|" * 14]
    for t in table:
        lines.append(f"| {t['variant']} | {t['seed']} | {t['reward_first5']:.3f} | {t['reward_last5']:.3f} | "
                     f"{t['accuracy_last5']:.3f} | {t['format_last5']:.3f} | {t['length_first5']:.1f} | "
                     f"{t['length_last5']:.1f} | {t['greedy_end']:.3f} | "
                     f"{t['sampled_end']:.3f} | {t['gap_max']:.1e} | {t['time/step']:.3f} | {t['wall_s']:.0f} | "
                     f"{'never' if t['to_target_s'] is None else round(t['to_target_s'])} |")
    lines += ["", f"Median phase times relative to `{args.variants[0]}` (same invocation, medians over steps, "
              f"then over seeds; time to reward: median over seeds of the seconds until the 10-step mean reward "
              f"reached {args.target}):", "", "| variant | " + " | ".join(p[5:] for p in PHASES) + " | to reward |",
              "|" + "---|" * (len(PHASES) + 2)]

    def median_to_target(rows):  # None when a seed never reached it
        times = [t["to_target_s"] for t in rows]
        return None if None in times else np.median(times)

    for v in args.variants:
        rows = [t for t in table if t["variant"] == v]
        ratios = [np.median([t[p] for t in rows]) / np.median([t[p] for t in base]) for p in PHASES]
        to_v, to_base = median_to_target(rows), median_to_target(base)
        lines.append(f"| {v} | " + " | ".join(f"{x:.2f}x" if np.isfinite(x) else "n/a" for x in ratios) + " | " +
                     (f"{to_v / to_base:.2f}x" if to_v is not None and to_base else "n/a") + " |")
    path = write_results(name, lines)
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_reward, ax_parts, ax_length, ax_wall) = plt.subplots(1, 4, figsize=(21, 4))
    for v in args.variants:
        mine = [res["rows"] for res in results if res["variant"] == v]
        if "charts/reward" not in mine[0][0]:  # no rollout to plot (dpo.py --data offline or file)
            continue
        curves = np.array([[r["charts/reward"] for r in rows] for rows in mine])
        lengths = np.array([[r["charts/completion_length"] for r in rows] for rows in mine])
        wall = np.array([np.cumsum([r["time/step"] + r.get("time/eval", 0.0) for r in rows]) for rows in mine])
        steps = np.arange(1, curves.shape[1] + 1)
        for ax, data in ((ax_reward, curves), (ax_length, lengths)):
            ax.plot(steps, data.mean(0), label=f"{v} ({len(data)} seeds)")
            ax.fill_between(steps, data.min(0), data.max(0), alpha=0.2)
        ax_wall.plot(wall.mean(0), curves.mean(0), label=v)
        for key, style in (("charts/accuracy", "-"), ("charts/format", "--")):
            part = np.array([[r[key] for r in rows] for rows in mine]).mean(0)
            ax_parts.plot(steps, part, style, color=ax_wall.lines[-1].get_color(), label=f"{v} {key[7:]}")
    ax_reward.set(xlabel="step", ylabel="mean reward (accuracy + 0.1 format)", title="toy addition, reward")
    ax_length.set(xlabel="step", ylabel="completion tokens", title="completion length")
    ax_parts.set(xlabel="step", ylabel="mean over seeds", title="accuracy (solid) and format (dashed)")
    ax_wall.set(xlabel="seconds (sum of step and eval times)", ylabel="mean reward", title="reward over wall time")
    ax_reward.legend()
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=110)


if __name__ == "__main__":
    main()
