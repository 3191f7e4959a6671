"""What RL changes and what it costs: GRPO, SFT and RFT from the same start, the new task's accuracy against what the
model could already do (RL's Razor, arXiv 2509.04259: at matched new-task accuracy on-policy RL forgets less than
SFT, and the forward KL to the base policy on the new task predicts forgetting, whatever the method).

    python benchmarks/forgetting.py                       # the SmolLM2 settings below
    python benchmarks/forgetting.py --methods grpo:1e-5 sft:3e-6 sft:1e-6 rft:1e-5 --seeds 1 2 --steps 40

Every run is a script of this repository in a subprocess (`grpo.py`, `sft.py --data gold`, `sft.py --data rft`,
`dpo.py --data offline` (a pool of --steps x 4 prompts) and `--data online`, each also `--pairs_by reward`
(dpo_offline_reward, dpo_online_reward), `opd.py --teacher`) with the shared
settings, tracking the prior tasks and the forward KL at every evaluation (--prior_tasks, --kl_prompts:
plumbing/evaluation.py Tracking); the untrained model is evaluated once with --eval_only. A method is NAME:LR. Runs
go `--parallel` at a time, each on `--threads` threads. Writes benchmarks/results/<name>.md and .png: per method,
learning rate and evaluation step, the mean and standard error over seeds of the new task's greedy accuracy, each
prior task's lenient greedy accuracy and the forward KL; the points binned by new-task accuracy (matched accuracy);
and the correlation across every evaluation point of forgetting (the drop of the prior tasks' mean accuracy from the
untrained model's) with the forward KL, within and across methods.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.evaluation import prior_task_name  # noqa: E402
from toy_runs import pyplot, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1"
PRIOR_TASKS = ["rg:letter_counting", "rg:basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1"]
SETTINGS = ["--model", "smollm2-135m", "--task", TASK, "--instruction", "user", "--engine", "hf",
            "--prompts_per_step", "4", "--num_generations", "8", "--max_new_tokens", "64", "--eval_size", "50",
            "--eval_samples", "1", "--prior_eval_size", "50", "--kl_prompts", "32", "--save_every", "0",
            "--log_completions_every", "10"]
METHODS = {"grpo": ("grpo.py",), "sft": ("sft.py", "--data", "gold"), "rft": ("sft.py", "--data", "rft"),
           "dpo_offline": ("dpo.py", "--data", "offline"),  # pairs from the untrained model's samples (a pool of
           "dpo_online": ("dpo.py", "--data", "online"),  # --steps x 4 prompts), or from the current policy's
           "dpo_offline_reward": ("dpo.py", "--data", "offline", "--pairs_by", "reward"),  # the best and the worst
           "dpo_online_reward": ("dpo.py", "--data", "online", "--pairs_by", "reward"),  # sample by reward
           "opd": ("opd.py",)}  # distilling --teacher


def run(exp, script_flags, flags, out_dir, seed, reuse):
    """One run (or, with reuse, a finished run of the same command): its metrics rows and wall seconds."""
    run_dir = os.path.join(out_dir, f"{exp}__{seed}")
    done = os.path.join(run_dir, "benchmark.json")
    script, *method_flags = script_flags
    cmd = [sys.executable, os.path.join(ROOT, script), *method_flags, "--exp_name", exp, "--output_dir", out_dir,
           "--seed", str(seed), *flags]
    if not (reuse and os.path.exists(done) and json.load(open(done))["cmd"][1:] == cmd[1:]):
        shutil.rmtree(run_dir, ignore_errors=True)
        start = time.time()
        with open(os.path.join(out_dir, f"{exp}__{seed}.log"), "w") as log:
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
        with open(done, "w") as f:
            json.dump({"cmd": cmd, "wall_s": time.time() - start, "load_1min": os.getloadavg()[0]}, f)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "eval_only.jsonl" if "--eval_only" in flags
                                                           else "metrics.jsonl"))]
    return rows, json.load(open(done))["wall_s"]


def prior_keys(tasks):
    return [f"prior/{prior_task_name(task)}/pass@1_lenient" for task in tasks]


def mean_se(values):
    values = np.asarray(values, dtype=float)
    se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    return values.mean(), se


def fmt(values):
    mean, se = mean_se(values)
    return f"{mean:.3f}" + ("" if np.isnan(se) else f" ± {se:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["grpo:1e-5", "sft:3e-6", "sft:1e-6", "rft:1e-5"],
                        help="NAME:LEARNING_RATE, NAME one of " + ", ".join(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--prior_tasks", nargs="+", default=PRIOR_TASKS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--teacher", default=None, help="opd: the teacher model folder")
    parser.add_argument("--name", default="forgetting_smollm2")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same command")
    parser.add_argument("extra", nargs="*", help="after --: flags for every run (override the settings)")
    args = parser.parse_args()
    methods = []
    for method in args.methods:
        name, _, lr = method.partition(":")
        if name not in METHODS or not lr:
            raise SystemExit(f"error: --methods {method}: give NAME:LEARNING_RATE, NAME one of {', '.join(METHODS)}")
        methods.append((name, lr))
    out_dir = os.path.join(args.out_dir, args.name)
    os.makedirs(out_dir, exist_ok=True)
    shared = [*SETTINGS, "--prior_tasks", *args.prior_tasks, "--threads", str(args.threads), *args.extra]
    train = [*shared, "--total_steps", str(args.steps), "--eval_every", str(args.eval_every)]
    base_rows, _ = run("base", METHODS["grpo"], [*shared, "--eval_only"], out_dir, 1, args.reuse)
    base = base_rows[-1]
    if "opd" in dict(methods) and args.teacher is None:
        raise SystemExit("error: --methods opd distills a teacher: pass --teacher MODEL_FOLDER")
    offline_pool = ["--offline_prompts", str(args.steps * 4)]
    own = {"dpo_offline": offline_pool, "dpo_offline_reward": offline_pool, "opd": ["--teacher", str(args.teacher)]}
    jobs = [(name, lr, seed) for seed in args.seeds for name, lr in methods]  # every method once, then again
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda job: run(f"{job[0]}_lr{job[1]}", (*METHODS[job[0]], *own.get(job[0], [])), [
            *train, "--learning_rate", job[1]], out_dir, job[2], args.reuse), jobs))
    keys = prior_keys(args.prior_tasks)
    base_prior = np.mean([base[k] for k in keys])
    lines = [f"# {args.name}", "", "`python benchmarks/forgetting.py " + " ".join(sys.argv[1:]) + "`", "",
             f"Every run: `{' '.join(train)}`, plus the method's flags and `--learning_rate`; seeds "
             f"{', '.join(map(str, args.seeds))}; the untrained model: the same flags and `--eval_only`. New task: "
             "held-out greedy pass@1 as the reward checks it; prior tasks: greedy pass@1, lenient (the last number "
             "where no box); forward KL: nats per completion on the new task's prompts, samples of the untrained "
             "model. Mean ± standard error over seeds.", "",
             "| method | lr | step | new task | " + " | ".join(k.split("/")[1] for k in keys) +
             " | prior mean | forgetting | forward KL | wall min |",
             "|---" * (8 + len(keys)) + "|",
             f"| untrained | | 0 | {base['eval/pass@1_greedy']:.3f} | " +
             " | ".join(f"{base[k]:.3f}" for k in keys) + f" | {base_prior:.3f} | 0 | 0 | |"]
    points = []  # (method, new-task accuracy, forgetting, forward KL) of every evaluation of every run
    for name, lr in methods:
        runs = [results[jobs.index((name, lr, seed))] for seed in args.seeds]
        evals = [{row["step"]: row for row in rows if "eval/pass@1_greedy" in row} for rows, _ in runs]
        for step in sorted(set.intersection(*(set(e) for e in evals))):
            rows = [e[step] for e in evals]
            prior = [np.mean([row[k] for k in keys]) for row in rows]
            for row, p in zip(rows, prior):
                points.append((name, row["eval/pass@1_greedy"], base_prior - p, row.get("eval/forward_kl", np.nan)))
            lines.append(f"| {name} | {lr} | {step} | {fmt([r['eval/pass@1_greedy'] for r in rows])} | " +
                         " | ".join(fmt([r[k] for r in rows]) for k in keys) + f" | {fmt(prior)} | "
                         f"{fmt([base_prior - p for p in prior])} | "
                         f"{fmt([r.get('eval/forward_kl', np.nan) for r in rows])}"
                         f" | {np.mean([w for _, w in runs]) / 60:.1f} |")
    lines += ["", "Forgetting against the forward KL over every evaluation point (Pearson r, points):", ""]
    for label, chosen in [("all methods", points), *[(name, [p for p in points if p[0] == name])
                                                      for name in dict(methods)]]:
        x, y = np.array([p[3] for p in chosen]), np.array([p[2] for p in chosen])
        ok = np.isfinite(x) & np.isfinite(y)
        r = np.corrcoef(x[ok], y[ok])[0, 1] if ok.sum() > 2 and x[ok].std() > 0 and y[ok].std() > 0 else np.nan
        lines.append(f"- {label}: r = {r:.2f} over {int(ok.sum())} points")
    edges = [0.0, 0.05, 0.15, 0.3, 1.01]
    lines += ["", "At matched new-task accuracy (every evaluation point binned by its new-task accuracy; mean "
              "forgetting, points):", "", "| new-task accuracy | " + " | ".join(dict(methods)) + " |",
              "|---" * (1 + len(dict(methods))) + "|"]
    for lo, hi in zip(edges, edges[1:]):
        cells = []
        for name in dict(methods):
            chosen = [p[2] for p in points if p[0] == name and lo <= p[1] < hi]
            cells.append(f"{np.mean(chosen):.3f} ({len(chosen)})" if chosen else "")
        lines.append(f"| [{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'} | " + " | ".join(cells) + " |")
    lines += ["", "Per run (samples: the training rollouts' accuracy over every step; pairs: DPO's pairs made, and the "
              "steps that trained on one; logps/chosen: DPO's first and last evaluation step):", "",
              "| method | lr | seed | sample accuracy | pairs | steps trained | last eval: new task, forward KL | "
              "logps/chosen, rejected |", "|---" * 8 + "|"]
    for (name, lr, seed), (rows, _) in zip(jobs, results):
        evals = [row for row in rows if "eval/pass@1_greedy" in row]
        pairs = [row for row in rows if "dpo/pairs_made" in row]
        logps = [row for row in evals if "logps/chosen" in row]
        lines.append(f"| {name} | {lr} | {seed} | " + " | ".join([
            f"{np.mean([r['charts/accuracy'] for r in rows if 'charts/accuracy' in r]):.4f}" if any(
                "charts/accuracy" in r for r in rows) else "",
            f"{sum(r['dpo/pairs_made'] for r in pairs):.0f}" if pairs else "",
            f"{sum(r.get('dpo/pairs_trained', 0) > 0 for r in pairs)}" if pairs else "",
            f"{evals[-1]['eval/pass@1_greedy']:.3f}, {evals[-1].get('eval/forward_kl', np.nan):.2f}" if evals else "",
            " → ".join(f"{r['logps/chosen']:.2f}, {r['logps/rejected']:.2f}" for r in (logps[0], logps[-1]))
            if logps else ""]) + " |")
    path = write_results(args.name, lines)
    plt = pyplot()
    if plt is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for k, name in enumerate(dict(methods)):
            chosen = [p for p in points if p[0] == name]
            left.scatter([p[1] for p in chosen], [base_prior - p[2] for p in chosen], label=name, color=f"C{k}")
            right.scatter([p[3] for p in chosen], [p[2] for p in chosen], label=name, color=f"C{k}")
        left.axhline(base_prior, color="gray", linestyle=":", label="untrained")
        left.set(xlabel="new task: held-out greedy accuracy", ylabel="prior tasks: mean lenient accuracy")
        right.set(xlabel="forward KL to the untrained model (nats per completion)",
                  ylabel="forgetting (untrained - run)")
        left.legend()
        right.legend()
        fig.tight_layout()
        fig.savefig(path + ".png", dpi=110)


if __name__ == "__main__":
    main()
