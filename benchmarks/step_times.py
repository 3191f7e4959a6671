"""Per-phase step-time breakdown of one or more runs, from their metrics.jsonl (medians over steps).

    python benchmarks/step_times.py runs/grpo__1/metrics.jsonl [more runs ...] [--skip 5]

Prints a markdown table: median seconds per phase (rollout includes the weight sync), each phase's share of the step,
rollout tokens/s, the median of the steps' mean and longest completion lengths (the decode loop runs as many steps as
the longest), the largest engine/trainer log-prob gap and peak memory. The first --skip steps (engine warm-up,
compilation) are left out. The first run is the baseline of the `step vs first` column, so compare runs measured on the
same machine.
"""

import argparse
import json

import numpy as np

PHASES = ["time/rollout", "time/weight_sync", "time/score", "time/train"]


def summarize(path, skip):
    rows = [row for row in map(json.loads, open(path)) if "step" in row][skip:]  # training steps only
    if not rows:
        raise SystemExit(f"{path}: no steps after skipping {skip}")
    median = {k: float(np.median([r.get(k, 0.0) for r in rows])) for k in PHASES + [
        "time/step", "rollout/tokens_per_s", "charts/completion_length", "charts/completion_length_max"]}
    memory = max(r.get("memory/cuda_allocated_gb_max", r.get("memory/rss_gb_max", 0.0)) for r in rows)
    return {**median, "steps": len(rows), "gap_max": max(r["rollout/logprob_gap_max"] for r in rows), "memory": memory}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    parser.add_argument("--skip", type=int, default=5, help="leading steps to leave out")
    args = parser.parse_args()
    runs = [(path, summarize(path, args.skip)) for path in args.metrics]
    base = runs[0][1]["time/step"]
    print("| run | steps | " + " | ".join(p[5:] + " s (share)" for p in PHASES) + " | step s | step vs first | "
          "tokens/s | completion length mean / longest | max logprob gap | peak memory GB |")
    print("|" + "---|" * (len(PHASES) + 8))
    for path, s in runs:
        shares = " | ".join(f"{s[p]:.3f} ({s[p] / s['time/step']:.0%})" for p in PHASES)
        print(f"| {path} | {s['steps']} | {shares} | {s['time/step']:.3f} | {s['time/step'] / base:.2f}x | "
              f"{s['rollout/tokens_per_s']:.0f} | {s['charts/completion_length']:.1f} / "
              f"{s['charts/completion_length_max']:.0f} | {s['gap_max']:.1e} | {s['memory']:.2f} |")


if __name__ == "__main__":
    main()
