"""pass@k of a model before and after RL on the same held-out problems: does training solve problems the base model
could not solve within k samples, or solve the same problems more often ("Does Reinforcement Learning Really
Incentivize Reasoning Capacity in LLMs Beyond the Base Model?", arXiv 2504.13837)?

    python benchmarks/pass_at_k.py                        # the toy: the embedded model, then `python grpo.py`'s
    python benchmarks/pass_at_k.py --samples 64 --name toy_pass_at_k_64
    python benchmarks/pass_at_k.py --base smollm2-135m --trained runs/.../final --name smollm2_pass_at_k \\
        -- --task rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1 --instruction user --eval_size 100

Without --trained it first trains the base model with `python grpo.py` (its defaults plus the flags after --) and
evaluates that run's final/ model. Each evaluation is `python grpo.py --eval_only --eval_samples N` on the test split,
whose pass@k for k = 1, 2, 4, ..., N is the unbiased estimator from the same N samples per problem. Writes
benchmarks/results/<name>.md and .png (pass@k of both models against k, log scale).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import pyplot, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, log_path):
    """`python grpo.py ARGS` with its output in log_path; returns the wall seconds."""
    start = time.time()
    with open(log_path, "w") as log:
        subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *args], cwd=ROOT, check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    return time.time() - start


def pass_at_k_curve(result, samples):
    """{k: pass@k} from one evaluation's metrics (pass@1 is the sampled pass@1)."""
    curve = {1: result[f"eval/pass@1_sampled_k{samples}"]}
    curve.update({int(key.split("@")[1]): value for key, value in result.items()
                  if key.startswith("eval/pass@") and key.split("@")[1].isdigit()})
    return dict(sorted(curve.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="the base model (default: grpo.py's default model)")
    parser.add_argument("--trained", default=None, help="a trained model folder (default: train one with grpo.py)")
    parser.add_argument("--samples", type=int, default=16, help="samples per problem: pass@k for k up to this")
    parser.add_argument("--name", default="toy_pass_at_k")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more flags for every grpo.py call")
    opts = parser.parse_args()
    extra = [a for a in opts.extra if a != "--"]
    out_dir = os.path.relpath(os.path.join(opts.out_dir, opts.name), ROOT)  # the commands run in ROOT: shown as such
    shutil.rmtree(os.path.join(ROOT, out_dir), ignore_errors=True)
    os.makedirs(os.path.join(ROOT, out_dir))
    base = ["--model", opts.base] if opts.base else []
    commands, walls = {}, {}
    trained = opts.trained
    if trained is None:
        flags = [*base, "--exp_name", "train", "--output_dir", out_dir, *extra]
        walls["train"] = run(flags, os.path.join(ROOT, out_dir, "train.log"))
        commands["train"] = " ".join(["python grpo.py", *flags])
        trained = os.path.join(out_dir, "train__1", "final")
    curves = {}
    for label, model in (("base", base), ("trained", ["--model", trained])):
        flags = [*model, "--eval_only", "--eval_samples", str(opts.samples), "--exp_name", label, "--output_dir",
                 out_dir, *extra]
        walls[label] = run(flags, os.path.join(ROOT, out_dir, f"{label}.log"))
        commands[label] = " ".join(["python grpo.py", *flags])
        result = [json.loads(line) for line in open(os.path.join(ROOT, out_dir, f"{label}__1", "eval_only.jsonl"))][-1]
        curves[label] = (pass_at_k_curve(result, opts.samples), result)
    ks = list(curves["base"][0])
    lines = [f"# {opts.name}", "",
             f"Command: `python benchmarks/pass_at_k.py --samples {opts.samples} --name {opts.name}"
             f"{' --base ' + opts.base if opts.base else ''}{' --trained ' + opts.trained if opts.trained else ''}"
             f"{' -- ' + ' '.join(extra) if extra else ''}`", ""]
    lines += [f"- {label}: `{command}` ({walls[label]:.0f} s)" for label, command in commands.items()]
    lines += ["", "| model | greedy pass@1 | " + " | ".join(f"pass@{k}" for k in ks) + " | problems |",
              "|" + "---|" * (len(ks) + 3)]
    for label, (curve, result) in curves.items():
        lines.append(f"| {label} | {result['eval/pass@1_greedy']:.3f} | "
                     + " | ".join(f"{curve[k]:.3f}" for k in ks) + f" | {result['eval/problems']} |")
    path = write_results(opts.name, lines)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (curve, _) in curves.items():
        ax.plot(ks, [curve[k] for k in ks], "o-", label=label)
    ax.set(xscale="log", xlabel="k (samples per problem)", ylabel="pass@k (unbiased estimate)", title=opts.name)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=110)


if __name__ == "__main__":
    main()
