"""A script's step time and peak memory against another checkout's (e.g. the commit before a refactor), the two
checkouts' runs alternating on the same machine, so both meet the same load.

    git worktree add /tmp/base HEAD~1                   # the baseline checkout (any folder holding the scripts)
    python benchmarks/against_checkout.py --baseline /tmp/base --rounds 3 -- --total_steps 40 --eval_every 0 \\
        --save_every 0                                  # the toy, 40 steps, 3 rounds
    python benchmarks/against_checkout.py --baseline /tmp/base --rounds 3 --name smollm2 -- --model smollm2-135m ...

--env KEY=VALUE sets a variable for this checkout's runs alone: with `--baseline .` it times one checkout against
itself under another setting, e.g. bf16 autocast on the CPU against float32:

    python benchmarks/against_checkout.py --baseline . --env ACCELERATE_MIXED_PRECISION=bf16 --name bf16_toy -- ...

Each round runs `python SCRIPT FLAGS` in the baseline checkout, then in this one (the same Python), one at a time.
Per run: the median over steps (the first --skip left out) of time/step, time/train and time/rollout,
memory/rss_gb_max at the end, and the last step's reward and accuracy (a setting that learns differently shows
there); then the median over rounds of each, and this checkout's over the baseline's. Writes
benchmarks/results/<name>.md (TINYRL_RESULTS: another folder).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import ROOT, write_results  # noqa: E402

KEYS = ("time/step", "time/train", "time/rollout")


def one_run(checkout, script, flags, out_dir, skip, env=None):
    """Run the script of `checkout` into out_dir, with `env` added to the environment -> its medians over steps, its
    peak RSS and its last step's reward and accuracy."""
    shutil.rmtree(out_dir, ignore_errors=True)  # a rerun starts afresh: the script would refuse an existing run folder
    start = time.time()
    subprocess.run([sys.executable, os.path.join(checkout, script), *flags, "--output_dir", out_dir, "--exp_name",
                    "run"], cwd=checkout, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, **(env or {})})
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "run__1", "metrics.jsonl"))]
    kept = rows[skip:] or rows
    return {**{k: statistics.median(r[k] for r in kept) for k in KEYS}, "rss_gb": rows[-1]["memory/rss_gb_max"],
            "reward": rows[-1]["charts/reward"], "accuracy": rows[-1]["charts/accuracy"], "wall_s": time.time() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout (a folder with the script)")
    parser.add_argument("--script", default="grpo.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=1, help="leading steps left out of each run's medians")
    parser.add_argument("--name", default="against_checkout")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "benchmarks"))
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for this checkout's runs alone (repeatable)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the script's flags for every run")
    args = parser.parse_args()
    flags = [a for a in args.flags if a != "--"]
    env = dict(item.split("=", 1) for item in args.env)
    checkouts = {"baseline": os.path.abspath(args.baseline), "this": ROOT}
    runs = {side: [] for side in checkouts}
    for r in range(args.rounds):
        for side, checkout in checkouts.items():
            out = os.path.join(args.out_dir, args.name, side, str(r))
            runs[side].append(one_run(checkout, args.script, flags, out, args.skip, env if side == "this" else None))
            print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[side][-1].items()), flush=True)
    median = {side: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for side, rs in runs.items()}
    commit = subprocess.run(["git", "-C", checkouts["baseline"], "log", "-1", "--format=%h %s"], capture_output=True,
                            text=True).stdout.strip()[:100]
    env_flags = "".join(f" --env {item}" for item in args.env)
    lines = [f"# {args.name}", "", f"Command: `python benchmarks/against_checkout.py --baseline BASELINE --script "
             f"{args.script} --rounds {args.rounds} --skip {args.skip}{env_flags} --name {args.name} -- "
             f"{' '.join(flags)}`; "
             f"baseline: {commit or checkouts['baseline']}; runs one at a time, the checkouts alternating; 1-min load "
             f"average at the end {os.getloadavg()[0]:.2f}.", "",
             "| side | round | " + " | ".join(f"{k} s" for k in KEYS)
             + " | peak RSS GB | last reward | last accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for side, rs in runs.items():
        lines += [f"| {side} | {r + 1} | " + " | ".join(f"{run[k]:.3f}" for k in KEYS) + f" | {run['rss_gb']:.2f} | "
                  f"{run['reward']:.4f} | {run['accuracy']:.4f} |" for r, run in enumerate(rs)]
    lines += ["", "Medians over rounds, and this checkout over the baseline:", "",
              "| | " + " | ".join(f"{k} s" for k in KEYS) + " | peak RSS GB |", "|---|---|---|---|---|"]
    for side in checkouts:
        lines.append(f"| {side} | " + " | ".join(f"{median[side][k]:.3f}" for k in KEYS)
                     + f" | {median[side]['rss_gb']:.2f} |")
    lines.append("| this / baseline | " + " | ".join(f"{median['this'][k] / median['baseline'][k]:.3f}x"
                                                    for k in (*KEYS, "rss_gb")) + " |")
    write_results(args.name, lines)


if __name__ == "__main__":
    main()
