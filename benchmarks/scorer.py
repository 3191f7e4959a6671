"""Reward scorer speed: the persistent warm RewardScorer against math-verify called inline, one completion at a time
in the calling process (what a reward function usually does), measured in one run on the same completions.

    python benchmarks/scorer.py [--repeats 3] [--out benchmarks/results/scorer.md]
    python benchmarks/scorer.py --completions 32 --repeats 1 --out /tmp/scorer.md    # seconds: a check

512 GSM8K-like completions (~600 characters of worked steps ending in \\boxed{N}; groups of 8 per gold; correct,
reformatted, wrong and missing answers) and 512 MATH-like ones (fractions, roots, tuples, polynomials, intervals).
Each path scores them as one call of 512 and as 16 calls of 32; RewardScorer with K = 1 and 2 workers, cold (start
included) and warm; and a batch with 4 pathological completions (power towers) mixed in. Warm times are medians over
--repeats. Inline is unbounded but for math-verify's own 2 s alarm (main thread only) and holds the trainer while it
runs; the scorer's workers overlap the trainer's passes, kill a stuck check and cap memory.
"""

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from utils.rewards import RewardScorer, extract_boxed, math_equal  # noqa: E402

TOWER = "\\boxed{" + "9^{" * 6 + "TOP" + "}" * 6 + "}"  # a power tower; TOP differs each time (no dedup)


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


def math_answers(rng):
    """A gold in one of eight MATH styles, with equivalent and wrong answers for it."""
    a, b = rng.randint(1, 40), rng.randint(41, 90)
    k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
    return rng.choice([
        (f"\\frac{{{a}}}{{{b}}}", [f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\frac{{{2 * a}}}{{{2 * b}}}",
                                   f"\\frac{{{b}}}{{{a}}}"]),
        (f"{k}\\sqrt{{{m}}}", [f"{k}\\sqrt{{{m}}}", f"\\sqrt{{{k * k * m}}}", f"{m}\\sqrt{{{k}}}"]),
        (f"({a}, {b})", [f"({a}, {b})", f"({a},{b})", f"({b}, {a})"]),
        (f"x^2 + {2 * a}x + {a * a}", [f"(x+{a})^2", f"x^2+{2 * a}x+{a * a}", f"x^2+{a * a}"]),
        (f"\\frac{{\\pi}}{{{k}}}", [f"\\frac{{\\pi}}{{{k}}}", f"\\pi/{k}", f"\\frac{{\\pi}}{{{k + 1}}}"]),
        (f"[{a}, {b})", [f"[{a}, {b})", f"[{a},{b}]", f"({a}, {b})"]),
        (f"-\\frac{{{a}}}{{{b}}}", [f"-\\frac{{{a}}}{{{b}}}", f"-{a}/{b}", f"\\frac{{{a}}}{{{b}}}"]),
        (str(a * b), [str(a * b), f"{a * b}.0", str(a * b + 1)]),
    ])


def math_like(rng, n=512, group=8):
    texts, golds = [], []
    for _ in range(n // group):
        gold, answers = math_answers(rng)
        for _ in range(group):
            texts.append(reasoning(rng, 400) + f" Therefore $\\boxed{{{rng.choice(answers)}}}$.")
            golds.append(gold)
    return texts, golds


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def inline_calls(texts, golds):
    """math-verify in this process, one completion at a time (as many calls as completions: no per-call cost)."""
    return [float(math_equal(gold, extract_boxed(text))) for text, gold in zip(texts, golds)]


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
    parser.add_argument("--completions", type=int, default=512, help="per set (a multiple of 16)")
    args = parser.parse_args()
    n = args.completions
    rng = random.Random(0)
    sets = {"gsm8k": gsm8k_like(rng, n), "math": math_like(rng, n)}
    texts, golds = sets["gsm8k"]
    spots = [n * s // 512 for s in (50, 180, 300, 470)]
    pathological = ([TOWER.replace("TOP", str(i)) if i in spots else t for i, t in enumerate(texts)],
                    [str(i) if i in spots else g for i, g in enumerate(golds)])
    rows, accuracy = [], {}

    def median(fn):
        times, out = zip(*(timed(fn) for _ in range(args.repeats)))
        return statistics.median(times), out[0]

    for name, (texts, golds) in sets.items():
        t1, accuracy[("inline", name)] = median(lambda: inline_calls(texts, golds))
        base = t1
        rows.append((f"inline math-verify, {name}", "-", t1, t1, base))
        for k in (1, 2):
            cold, _ = timed(lambda: cold_run(name, k, texts, golds))
            with RewardScorer(name, "boxed", k) as scorer:
                new_calls(scorer, texts[:64], golds[:64], 1)  # warm up
                t1, accuracy[(k, name)] = median(lambda: new_calls(scorer, texts, golds, 1))
                t16, _ = median(lambda: new_calls(scorer, texts, golds, 16))
            rows.append((f"RewardScorer K={k}, {name}", f"{cold:.2f}", t1, t16, base))
            if name == "gsm8k":  # the same, every non-identical answer through math-verify (no plain-number path)
                with RewardScorer(name, "boxed", k, compare_numbers=False) as scorer:
                    new_calls(scorer, texts[:64], golds[:64], 1)
                    t1, accuracy[(k, "gsm8k, math-verify only")] = median(lambda: new_calls(scorer, texts, golds, 1))
                    t16, _ = median(lambda: new_calls(scorer, texts, golds, 16))
                rows.append((f"RewardScorer K={k}, {name}, math-verify only", "-", t1, t16, base))
    bad_inline, _ = timed(lambda: inline_calls(*pathological))
    bad_new = {}
    for k in (1, 2):
        with RewardScorer("gsm8k", "boxed", k) as scorer:
            new_calls(scorer, texts[:64], golds[:64], 1)
            bad_new[k], _ = timed(lambda: new_calls(scorer, *pathological, 1))
    lines = [f"# Reward scorer ({os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f} at the end; "
             f"median of {args.repeats})", "",
             f"| path | cold: start + {n} (s) | one call of {n} (s) | 16 calls of {n // 16} (s) | one call vs inline, "
             "same set |",
             "|---|---|---|---|---|"]
    for label, cold, t1, t16, base in rows:
        lines.append(f"| {label} | {cold} | {t1:.3f} | {t16:.3f} | {t1 / base:.2f}x |")
    lines += ["", "Cold: scorer start (K=1's includes starting the fork server, once per process) and the first call.",
              f"{n} GSM8K-like with 4 different power towers (one call): inline {bad_inline:.2f} s, "
              + ", ".join(f"K={k} {t:.2f} s" for k, t in bad_new.items()), ""]
    for name in sets:
        same = accuracy[("inline", name)] == accuracy[(1, name)] == accuracy[(2, name)] == accuracy.get(
            (1, f"{name}, math-verify only"), accuracy[(1, name)])
        lines.append(f"- {name}: mean accuracy inline {statistics.mean(accuracy[('inline', name)]):.3f}, scorer "
                     f"{statistics.mean(accuracy[(1, name)]):.3f} (identical per completion: {same})")
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
