"""Reward scorer speed: the persistent warm RewardScorer against the previous scorer (one forked worker per call, the
gold re-parsed for every completion), measured in one run on the same completions.

    python benchmarks/scorer.py [--repeats 3] [--out benchmarks/results/scorer.md]

512 GSM8K-like completions (~600 characters of worked steps ending in \\boxed{N}; groups of 8 per gold; correct,
reformatted, wrong and missing answers) and 512 MATH-like ones (fractions, roots, tuples, polynomials, intervals).
Each path scores them as one call of 512 and as 16 calls of 32; the new scorer with K = 1 and 2 workers, cold (start
included) and warm; and a batch with 4 pathological completions (power towers) mixed in. Warm times are medians over
--repeats. The previous scorer is loaded from git history (OLD_COMMIT), so both run in this process.
"""

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from utils.rewards import RewardScorer  # noqa: E402

OLD_COMMIT = "9bebb08"  # the last commit with the fork-per-call scorer
TOWER = "\\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}"


def load_old_scorer():
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:utils/rewards.py"], capture_output=True, text=True,
                            check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_rewards.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reasoning(rng, chars=560):
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        words.append(rng.choice([f"First, {a} + {b} = {a + b}.", f"Then {a} times {b} is {a * b}.",
                                 f"So we subtract {b} from {a * 3} to get {a * 3 - b}.", "Let me check the units.",
                                 f"Each box holds {a} items, and there are {b} boxes."]))
    return " ".join(words)


def gsm8k_like(rng, n=512, group=8):
    texts, golds = [], []
    for _ in range(n // group):
        gold = rng.randint(3, 5000)
        for _ in range(group):
            kind = rng.random()
            answer = (str(gold) if kind < 0.45 else f"{gold}.0" if kind < 0.55 else f"{gold:,}" if kind < 0.6 else
                      f"\\${gold}" if kind < 0.65 else str(gold + rng.choice([-10, -1, 1, 2, 100])) if kind < 0.92 else
                      None)
            tail = f" The answer is \\boxed{{{answer}}}." if answer is not None else " I am not sure."
            texts.append(reasoning(rng) + tail)
            golds.append(str(gold))
    return texts, golds


MATH_GOLDS = [("\\frac{3}{4}", ["\\frac{3}{4}", "0.75", "\\frac{6}{8}", "\\frac{4}{3}", "3/4"]),
              ("2\\sqrt{3}", ["2\\sqrt{3}", "\\sqrt{12}", "3\\sqrt{2}", "2 \\sqrt 3"]),
              ("(1, 2)", ["(1, 2)", "(1,2)", "(2, 1)"]),
              ("x^2 + 2x + 1", ["(x+1)^2", "x^2+2x+1", "x^2+1"]),
              ("\\frac{\\pi}{2}", ["\\frac{\\pi}{2}", "\\pi/2", "90", "\\frac{\\pi}{3}"]),
              ("[0, 1)", ["[0, 1)", "[0,1]", "(0, 1)"]),
              ("-\\frac{1}{5}", ["-\\frac15", "-0.2", "\\frac{1}{5}"]),
              ("12", ["12", "12.0", "13", "\\boxed{12}"])]


def math_like(rng, n=512, group=8):
    texts, golds = [], []
    for _ in range(n // group):
        gold, answers = rng.choice(MATH_GOLDS)
        for _ in range(group):
            texts.append(reasoning(rng, 400) + f" Therefore $\\boxed{{{rng.choice(answers)}}}$.")
            golds.append(gold)
    return texts, golds


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def old_calls(old, texts, golds, task, calls):
    size = len(texts) // calls
    return [a for k in range(0, len(texts), size)
            for a in old.score_completions(texts[k:k + size], golds[k:k + size], task, "boxed", 5.0)[0]]


def new_calls(scorer, texts, golds, calls):
    size = len(texts) // calls
    return [a for k in range(0, len(texts), size) for a in scorer.result(scorer.submit(texts[k:k + size],
                                                                                     golds[k:k + size]))[0]]


def cold_run(task, k, texts, golds):
    with RewardScorer(task, "boxed", k) as scorer:
        return new_calls(scorer, texts, golds, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/scorer.md")
    args = parser.parse_args()
    rng = random.Random(0)
    sets = {"gsm8k": gsm8k_like(rng), "math": math_like(rng)}
    texts, golds = sets["gsm8k"]
    spots = [50, 180, 300, 470]
    pathological = ([TOWER if i in spots else t for i, t in enumerate(texts)],
                    ["1" if i in spots else g for i, g in enumerate(golds)])
    old = load_old_scorer()
    rows, accuracy = [], {}

    def median(fn):
        times, out = zip(*(timed(fn) for _ in range(args.repeats)))
        return statistics.median(times), out[0]

    for name, (texts, golds) in sets.items():
        t1, accuracy[("old", name)] = median(lambda: old_calls(old, texts, golds, name, 1))
        t16, _ = median(lambda: old_calls(old, texts, golds, name, 16))
        rows.append((f"previous (fork per call), {name}", "-", t1, t16))
        for k in (1, 2):
            cold, _ = timed(lambda: cold_run(name, k, texts, golds))
            with RewardScorer(name, "boxed", k) as scorer:
                new_calls(scorer, texts[:64], golds[:64], 1)  # warm up
                t1, accuracy[(k, name)] = median(lambda: new_calls(scorer, texts, golds, 1))
                t16, _ = median(lambda: new_calls(scorer, texts, golds, 16))
            rows.append((f"RewardScorer K={k}, {name}", f"{cold:.2f}", t1, t16))
    bad_old, _ = timed(lambda: old_calls(old, *pathological, "gsm8k", 1))
    bad_new = {}
    for k in (1, 2):
        with RewardScorer("gsm8k", "boxed", k) as scorer:
            new_calls(scorer, texts[:64], golds[:64], 1)
            bad_new[k], _ = timed(lambda: new_calls(scorer, *pathological, 1))
    base = rows[0][2]
    lines = [f"# Reward scorer ({os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f} at the end; "
             f"median of {args.repeats})", "",
             "| path | cold: start + 512 (s) | one call of 512 (s) | 16 calls of 32 (s) | one call vs previous gsm8k |",
             "|---|---|---|---|---|"]
    for label, cold, t1, t16 in rows:
        lines.append(f"| {label} | {cold} | {t1:.3f} | {t16:.3f} | {t1 / base:.2f}x |")
    lines += ["", f"512 GSM8K-like with 4 power towers (one call): previous {bad_old:.2f} s, "
              + ", ".join(f"K={k} {t:.2f} s" for k, t in bad_new.items()), ""]
    for name in sets:
        same = accuracy[("old", name)] == accuracy[(1, name)] == accuracy[(2, name)]
        lines.append(f"- {name}: mean accuracy previous {statistics.mean(accuracy[('old', name)]):.3f}, new "
                     f"{statistics.mean(accuracy[(1, name)]):.3f} (identical per completion: {same})")
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
