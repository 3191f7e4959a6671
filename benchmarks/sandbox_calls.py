"""What a tool call costs in grpo_tools.py's sandbox (utils/tools.py), by the modules its processes import at start.

    python benchmarks/sandbox_calls.py

Each call runs in a child forked for it, so the call's cost grows with the size of the sandbox process it is forked
from. For each module set: start the sandbox (two processes, as grpo_tools.py has on a 2-core machine), then time
`sandbox.run` of 256 one-line calls (a late toy step's count), median over 5 repeats, and the ratio to the first set,
measured in the same run. Writes benchmarks/results/sandbox_calls.md.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import write_results  # noqa: E402
from utils.tools import PythonSandbox  # noqa: E402

MODULE_SETS = [(), ("math", "fractions", "statistics"), ("math", "fractions", "statistics", "numpy", "sympy")]


def main():
    rows, baseline = [], None
    for modules in MODULE_SETS:
        start = time.perf_counter()
        with PythonSandbox(num_workers=2, timeout=5.0, modules=modules) as sandbox:
            started = time.perf_counter() - start
            assert sandbox.run(["print(347 * 86)"]) == [("29842\n", "")]
            times = []
            for _ in range(5):
                start = time.perf_counter()
                sandbox.run(["print(347 * 86)"] * 256)
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        baseline = baseline or median
        rows.append(f"| {', '.join(modules) or '(none)'} | {started:.2f} | {median:.2f} | {median / 256 * 1e3:.1f} | "
                    f"{median / baseline:.2f} |")
    load = os.getloadavg()[0]
    write_results("sandbox_calls", [
        "# sandbox_calls", "", f"Command: `python benchmarks/sandbox_calls.py` ({os.cpu_count()} CPUs, load average "
        f"{load:.2f} at the end). Two sandbox processes; 256 calls of `print(347 * 86)` per `run`, median of 5.", "",
        "| modules imported at start | start s | s per 256 calls | ms per call | ratio |", "|---|---|---|---|---|",
        *rows])


if __name__ == "__main__":
    main()
