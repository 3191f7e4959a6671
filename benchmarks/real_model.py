"""Learning runs on a real pretrained model on this CPU: an algorithm script on SmolLM2-135M-Instruct and a
reasoning-gym task, with a held-out greedy evaluation of the untrained model before and evaluations during the run.

    python benchmarks/real_model.py                                   # grpo.py, the settings below, 150 steps
    python benchmarks/real_model.py --scripts grpo dapo gspo cispo reinforce_pp ppo --steps 150
    python benchmarks/real_model.py --scripts gspo dapo --script_flags gspo "--beta 0.04"  # flags for one script

Each run is `python SCRIPT.py` in a subprocess with the flags printed in the results; the base model's evaluation is
`--eval_only` on the same test rows. Writes benchmarks/results/<name>.md and .png: per script, the held-out greedy
accuracy and format rate before and at each evaluation, with the wall time (steps plus evaluations) at which it was
reached, and the curves of accuracy and format over steps and of held-out accuracy over steps and over wall time.
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
from toy_runs import pyplot, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1"
MODEL_TASK = ["--model", "smollm2-135m", "--task", TASK, "--instruction", "user", "--engine", "hf",
              "--prompts_per_step", "4", "--num_generations", "8", "--max_new_tokens", "64", "--learning_rate", "1e-5",
              "--threads", "2"]  # also benchmarks/vs_trl.py --real's
SETTINGS = [*MODEL_TASK, "--eval_size", "100", "--eval_samples", "1", "--log_completions_every", "10"]


def run(script, exp, flags, out_dir, reuse):
    """Run a script, or with reuse read a run of the same command: finished, or the steps it logged before it was
    stopped; returns (metrics rows, wall seconds or None for a stopped run, command, run folder)."""
    run_dir = os.path.join(out_dir, f"{exp}__{flags[flags.index('--seed') + 1] if '--seed' in flags else 1}")
    done, started = os.path.join(run_dir, "benchmark.json"), os.path.join(out_dir, f"{exp}.started.json")
    cmd = [sys.executable, os.path.join(ROOT, script), "--exp_name", exp, "--output_dir", out_dir, *flags]
    same = lambda path: os.path.exists(path) and json.load(open(path))["cmd"][1:] == cmd[1:]  # noqa: E731
    if reuse and same(done):
        wall = json.load(open(done))["wall_s"]
    elif reuse and same(started) and not os.path.exists(done) and os.path.exists(f"{run_dir}/metrics.jsonl"):
        wall = None  # stopped before its end: its logged steps are reported as such
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        with open(started, "w") as f:
            json.dump({"cmd": cmd}, f)
        start = time.time()
        with open(os.path.join(out_dir, f"{exp}.log"), "w") as log:
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
        wall = time.time() - start
        with open(done, "w") as f:
            json.dump({"cmd": cmd, "wall_s": wall, "load_1min": os.getloadavg()[0]}, f)
    name = "eval_only.jsonl" if "--eval_only" in flags else "metrics.jsonl"
    rows = [json.loads(line) for line in open(os.path.join(run_dir, name))]
    return rows, wall, " ".join(["python", script, *flags]), run_dir


def wall_minutes(rows):
    """Wall minutes at the end of each logged step: the steps' and the evaluations' times (model loading excluded)."""
    return np.cumsum([r["time/step"] + r.get("time/eval", 0.0) for r in rows]) / 60


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=["grpo"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--name", default="smollm2_chain_sum")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same command")
    parser.add_argument("--script_flags", nargs=2, action="append", default=[], metavar=("SCRIPT", "FLAGS"),
                        help='more flags for one script\'s run, e.g. --script_flags gspo "--beta 0.04"')
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more flags for every run")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    script_flags = {script: [] for script in args.scripts}
    for script, flags in args.script_flags:
        if script not in script_flags:
            parser.error(f"--script_flags {script}: not among --scripts {' '.join(args.scripts)}")
        script_flags[script] += flags.split()
    shown_flags = "".join(f' --script_flags {script} "{flags}"' for script, flags in args.script_flags)
    out_dir = os.path.join(args.out_dir, args.name)
    os.makedirs(out_dir, exist_ok=True)
    base, base_wall, base_cmd, _ = run("grpo.py", "base", [*SETTINGS, "--eval_only", *extra], out_dir, args.reuse)
    lines = [f"# {args.name}", "", f"Command: `python benchmarks/real_model.py --scripts {' '.join(args.scripts)} "
             f"--steps {args.steps} --eval_every {args.eval_every} --name {args.name}{shown_flags}"
             f"{' -- ' + ' '.join(extra) if extra else ''}`", "",
             f"Untrained model (`{base_cmd}`, {base_wall:.0f} s): held-out greedy accuracy "
             f"{base[-1]['eval/pass@1_greedy']:.3f}, greedy format {base[-1]['eval/format_greedy']:.3f}, sampled "
             f"(T 0.6) accuracy {base[-1]['eval/pass@1_sampled_k1']:.3f} on {base[-1]['eval/problems']} problems.", "",
             "| script | step | wall min | held-out greedy accuracy | greedy format | train reward (10-step mean) | "
             "train accuracy | train format | completion length |", "|" + "---|" * 9]
    results = {}
    for script in args.scripts:
        flags = [*SETTINGS, "--total_steps", str(args.steps), "--eval_every", str(args.eval_every), *extra,
                 *script_flags[script]]
        rows, wall, cmd, run_dir = run(f"{script}.py", script, flags, out_dir, args.reuse)
        results[script] = rows
        elapsed = wall_minutes(rows)
        lines.append(f"| {script} | 0 | 0 | {base[-1]['eval/pass@1_greedy']:.3f} | "
                     f"{base[-1]['eval/format_greedy']:.3f} | | | | |")
        for k, r in enumerate(rows):
            if "eval/pass@1_greedy" in r:
                window = rows[max(0, k - 9):k + 1]
                lines.append(f"| {script} | {r['step']} | {elapsed[k]:.1f} | {r['eval/pass@1_greedy']:.3f} | "
                             f"{r['eval/format_greedy']:.3f} | {np.mean([w['charts/reward'] for w in window]):.3f} | "
                             f"{np.mean([w['charts/accuracy'] for w in window]):.3f} | "
                             f"{np.mean([w['charts/format'] for w in window]):.3f} | "
                             f"{np.mean([w['charts/completion_length'] for w in window]):.1f} |")
        ending = (f"stopped at step {rows[-1]['step']}" if wall is None else f"wall {wall / 60:.1f} min in all (model "
                  f"loading included), 1-minute load at the end "
                  f"{json.load(open(os.path.join(run_dir, 'benchmark.json')))['load_1min']:.2f}")
        median = lambda key: np.median([r[key] for r in rows if key in r])  # noqa: E731
        # the HF loop's forward passes: grpo_async.py counts them, elsewhere one per token of the longest completion
        calls = median("rollout/decode_calls" if "rollout/decode_calls" in rows[-1] else "charts/completion_length_max")
        lines += ["", f"{script}: `{cmd}`; {ending}; median step {median('time/step'):.1f} s (rollout "
                  f"{median('time/rollout'):.1f} s, {calls:.0f} decode calls, long-tail share "
                  f"{median('rollout/tail_frac'):.2f}; training {median('time/train'):.1f} s).", ""]
    path = write_results(args.name, lines)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(22, 4))
    for script, rows in results.items():
        steps = [r["step"] for r in rows]
        window = min(10, len(rows))  # a 10-step mean (fewer in a shorter run)
        smooth = lambda key: np.convolve([r[key] for r in rows], np.ones(window) / window, mode="valid")  # noqa: E731
        for ax, key in zip(axes[:2], ("charts/accuracy", "charts/format")):
            ax.plot(steps[window - 1:], smooth(key), label=script)
        evals = [k for k, r in enumerate(rows) if "eval/pass@1_greedy" in r]
        accuracy = [base[-1]["eval/pass@1_greedy"]] + [rows[k]["eval/pass@1_greedy"] for k in evals]
        axes[2].plot([0] + [rows[k]["step"] for k in evals], accuracy, "o-", label=script)
        axes[3].plot([0] + [wall_minutes(rows)[k] for k in evals], accuracy, "o-", label=script)
    axes[0].set(xlabel="step", ylabel="train accuracy (10-step mean)", title="SmolLM2-135M-Instruct, rg:chain_sum")
    axes[1].set(xlabel="step", ylabel="train format rate (10-step mean)", title="boxed, readable answers")
    axes[2].set(xlabel="step", ylabel="held-out greedy accuracy", title="held-out greedy pass@1")
    axes[3].set(xlabel="wall minutes (steps and evaluations)", ylabel="held-out greedy accuracy",
                title="held-out greedy pass@1 over wall time")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=110)


if __name__ == "__main__":
    main()
