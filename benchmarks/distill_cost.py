"""What on-policy distillation costs against RL: opd.py and grpo.py from the same start, the steps and training seconds
each needs to reach the teacher's held-out accuracy (within --within), with the forward KL to the start and the prior
tasks' accuracy at that point (benchmarks/forgetting.py's columns).

    python benchmarks/distill_cost.py                          # the toy: a grpo.py teacher of 200 steps, 3 seeds
    python benchmarks/distill_cost.py --real --teacher runs/readme_smollm2/readme__1/final --seeds 1 2 --steps 40 \
        --eval_every 10 --name distill_cost_smollm2           # SmolLM2 on rg:chain_sum, a teacher trained here

The teacher is a grpo.py run of --teacher_steps from the same start (made first, or --teacher PATH: a model folder of
the student's vocabulary); its held-out greedy pass@1 is measured with --eval_only on the same test problems. Each
student run evaluates every --eval_every steps; a run reaches the teacher at its first evaluation whose greedy pass@1 is
at least the teacher's less --within, and its training seconds are the sum of its time/step up to that step
(evaluations excluded; the student runs go --parallel at a time, each on --threads, so both methods' seconds are
measured under the same load). Writes benchmarks/results/<name>.md: per method and seed, the step and seconds at which
it reached the teacher (or that it did not within --steps), its accuracy then and at the end, the forward KL and the
prior tasks' mean lenient accuracy then; and the medians over seeds, with the ratio of grpo.py's steps to opd.py's.
"""

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forgetting import ROOT, prior_keys, run  # noqa: E402
from toy_runs import write_results  # noqa: E402

REAL_TASK = "rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1"
TOY = ["--eval_size", "500", "--eval_samples", "1", "--save_every", "0", "--log_completions_every", "0",
       "--prior_eval_size", "200", "--kl_prompts", "64"]
REAL = ["--model", "smollm2-135m", "--task", REAL_TASK, "--instruction", "user", "--engine", "hf",
        "--prompts_per_step", "4", "--max_new_tokens", "64", "--learning_rate", "1e-5", "--eval_size", "50",
        "--eval_samples", "1", "--prior_eval_size", "50", "--kl_prompts", "32", "--save_every", "0",
        "--log_completions_every", "0"]
PRIOR = {"toy": ["toy_mul"], "real": ["rg:letter_counting",
                                      "rg:basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1"]}


def reached(rows, target):
    """(the step, training seconds to it, its row) of a run's first evaluation at or above target, or None."""
    seconds = 0.0
    for row in rows:
        seconds += row["time/step"]
        if row.get("eval/pass@1_greedy", -1.0) >= target:
            return row["step"], seconds, row
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct on rg:chain_sum")
    parser.add_argument("--teacher", default=None, help="a teacher model folder (default: trained here by grpo.py)")
    parser.add_argument("--teacher_steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--parallel", type=int, default=2, help="student runs at a time")
    parser.add_argument("--name", default=None, help="default: distill_cost_toy or distill_cost_smollm2")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same command")
    parser.add_argument("extra", nargs="*", help="after --: flags for every run (override the settings)")
    args = parser.parse_args()
    name = args.name or ("distill_cost_smollm2" if args.real else "distill_cost_toy")
    out_dir = os.path.join(args.out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    priors = PRIOR["real" if args.real else "toy"]
    shared = [*(REAL if args.real else TOY), "--prior_tasks", *priors, "--threads", str(args.threads), *args.extra]
    teacher = args.teacher
    if teacher is None:  # grpo.py from the same start, its final model
        run("teacher", ("grpo.py",), [*shared, "--total_steps", str(args.teacher_steps), "--eval_every", "0"],
            out_dir, 1, args.reuse)
        teacher = os.path.join(out_dir, "teacher__1", "final")
    teacher_rows, _ = run("teacher_eval", ("grpo.py",), [*shared, "--model", teacher, "--eval_only"], out_dir, 1,
                          args.reuse)
    base_rows, _ = run("base", ("grpo.py",), [*shared, "--eval_only"], out_dir, 1, args.reuse)
    teacher_accuracy, base = teacher_rows[-1]["eval/pass@1_greedy"], base_rows[-1]
    target = teacher_accuracy - args.within
    keys = prior_keys(priors)
    base_prior = np.mean([base[k] for k in keys])
    train = [*shared, "--total_steps", str(args.steps), "--eval_every", str(args.eval_every)]
    methods = {"opd": ("opd.py", "--teacher", teacher), "grpo": ("grpo.py",)}
    lines = [f"# {name}", "", "`python benchmarks/distill_cost.py " + " ".join(sys.argv[1:]) + "`", "",
             f"Every run: `{' '.join(train)}` and the method's flags; the teacher: `{teacher}`, held-out greedy pass@1 "
             f"{teacher_accuracy:.3f} (target: {target:.3f}); the untrained student {base['eval/pass@1_greedy']:.3f}, "
             f"prior tasks' mean lenient accuracy {base_prior:.3f} ({', '.join(priors)}).", "",
             "| method | seed | reached at step | training s | pass@1 then | pass@1 at the end | forward KL then | "
             "prior tasks then | forgetting then |", "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    jobs = [(method, seed) for method in methods for seed in args.seeds]
    with ThreadPoolExecutor(args.parallel) as pool:  # each run a subprocess; the table in the jobs' order
        results = list(pool.map(lambda job: run(job[0], methods[job[0]], train, out_dir, job[1], args.reuse)[0], jobs))
    for (method, seed), rows in zip(jobs, results):
        hit = reached(rows, target)
        end = [r for r in rows if "eval/pass@1_greedy" in r][-1]
        summary.setdefault(method, []).append(hit)
        if hit is None:
            lines.append(f"| {method} | {seed} | not within {args.steps} | | | {end['eval/pass@1_greedy']:.3f} | "
                         "| | |")
            continue
        step, seconds, row = hit
        prior = np.mean([row[k] for k in keys])
        lines.append(f"| {method} | {seed} | {step} | {seconds:.1f} | {row['eval/pass@1_greedy']:.3f} | "
                     f"{end['eval/pass@1_greedy']:.3f} | {row.get('eval/forward_kl', np.nan):.3f} | {prior:.3f} | "
                     f"{base_prior - prior:.3f} |")
    medians = {}
    for method, hits in summary.items():  # a seed that never reached the target counts as the slowest
        steps = [h[0] if h else np.inf for h in hits]
        seconds = [h[1] if h else np.inf for h in hits]
        medians[method] = (float(np.median(steps)), float(np.median(seconds)))
    lines += ["", "Medians over seeds (a seed that never reached the target counts as the slowest):", ""]
    lines += [f"- {method}: step {s:g}, {sec:.1f} training s" for method, (s, sec) in medians.items()]
    if all(np.isfinite(v[0]) for v in medians.values()):
        lines.append(f"- grpo.py / opd.py: {medians['grpo'][0] / medians['opd'][0]:.2f}x the steps, "
                     f"{medians['grpo'][1] / medians['opd'][1]:.2f}x the training seconds")
    write_results(name, lines)


if __name__ == "__main__":
    main()
