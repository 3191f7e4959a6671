"""What a tool call costs in grpo_tools.py's sandbox (plumbing/tools.py), by the modules its processes import at start.

    python benchmarks/sandbox_calls.py [--baseline PATH] [--rounds N] [--name NAME]

Each call runs in a child forked for it (in namespaces of its own), so the call's cost grows with the size of the
sandbox process it is forked from. For each module set: start the sandbox (two processes, as grpo_tools.py has on a
2-core machine), then time `sandbox.run` of 256 one-line calls (a late toy step's count), median over 5 repeats, and
the ratio to the first set. With --baseline, another checkout's sandbox (e.g. `git worktree add /tmp/base HEAD~3`) is
timed in the same run, each measurement a fresh process, the two checkouts alternating for --rounds rounds (medians
over rounds), and the ratio of this checkout's cost to the baseline's is added. Writes
benchmarks/results/NAME.md (sandbox_calls.md).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE_SETS = [(), ("math", "fractions", "statistics"), ("math", "fractions", "statistics", "numpy", "sympy")]
MEASURE = """
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from plumbing.tools import PythonSandbox
rows = []
for modules in json.loads(sys.argv[2]):
    start = time.perf_counter()
    with PythonSandbox(num_workers=2, timeout=5.0, modules=modules) as sandbox:
        started = time.perf_counter() - start
        assert sandbox.run(["print(347 * 86)"]) == [("29842\\n", "")]
        times = []
        for _ in range(int(sys.argv[4])):
            start = time.perf_counter()
            sandbox.run(["print(347 * 86)"] * int(sys.argv[3]))
            times.append(time.perf_counter() - start)
    rows.append([started, statistics.median(times)])
print(json.dumps(rows))
"""


def measure(checkout, calls, repeats):
    """[(start s, s per `calls` calls)] of each module set, in a fresh process importing that checkout's sandbox."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, checkout, json.dumps(MODULE_SETS), str(calls), str(repeats)],
                          capture_output=True, text=True, cwd="/", check=True)
    return json.loads(proc.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another checkout whose sandbox is timed in the same run")
    parser.add_argument("--baseline_label", help="what the baseline is, for the results (default: its last commit)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of alternating measurements (with --baseline)")
    parser.add_argument("--calls", type=int, default=256, help="calls per run (256: a late toy step's count)")
    parser.add_argument("--repeats", type=int, default=5, help="runs timed per module set (the median)")
    parser.add_argument("--name", default="sandbox_calls", help="the results file's name")
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    runs = {name: [] for name in checkouts}
    for _ in range(args.rounds if args.baseline else 1):
        for name, checkout in checkouts.items():
            runs[name].append(measure(checkout, args.calls, args.repeats))
    median = {name: [[statistics.median(r[i][j] for r in rounds) for j in range(2)] for i in range(len(MODULE_SETS))]
              for name, rounds in runs.items()}
    rows = []
    for i, modules in enumerate(MODULE_SETS):
        started, seconds = median["this"][i]
        row = (f"| {', '.join(modules) or '(none)'} | {started:.2f} | {seconds:.2f} | "
               f"{seconds / args.calls * 1e3:.1f} | "
               f"{seconds / median['this'][0][1]:.2f} |")
        if args.baseline:
            base = median["baseline"][i][1]
            row += f" {base / args.calls * 1e3:.1f} | {seconds / base:.2f} |"
        rows.append(row)
    load = os.getloadavg()[0]
    header = (f"| modules imported at start | start s | s per {args.calls} calls | ms per call | ratio to the first "
              "set |")
    sizes = (f" --calls {args.calls}" if args.calls != 256 else "") + (f" --repeats {args.repeats}" if args.repeats != 5
                                                                       else "")
    command = "python benchmarks/sandbox_calls.py" + sizes + (f" --baseline BASELINE --rounds {args.rounds}"
                                                              if args.baseline else "")
    command += f" --name {args.name}" if args.name != "sandbox_calls" else ""
    lines = [f"# {args.name}", "", f"Command: `{command}` ({os.cpu_count()} CPUs, load average {load:.2f} at the "
             f"end). Two sandbox processes; {args.calls} calls of `print(347 * 86)` per `run`, median of {args.repeats}"
             + (f", then the median over {args.rounds} rounds alternating with the baseline checkout's sandbox "
                "(each measurement a fresh process)" if args.baseline else "") + ".", ""]
    if args.baseline:
        header += " baseline ms per call | ratio to the baseline |"
        commit = subprocess.run(["git", "-C", checkouts["baseline"], "log", "-1", "--format=%h %s"],
                                capture_output=True, text=True).stdout.strip()[:100]
        lines += [f"Baseline: {args.baseline_label or commit or checkouts['baseline']}.", ""]
    lines += [header, "|---|---|---|---|---|" + ("---|---|" if args.baseline else ""), *rows]
    write_results(args.name, lines)


if __name__ == "__main__":
    main()
