"""Peak resident memory of a real run on the CPU: full fine-tuning against LoRA, under glibc's allocator as it comes,
with a fixed mmap threshold (--malloc_mmap_threshold), and under jemalloc and tcmalloc.

    python benchmarks/run_memory.py                     # the README's SmolLM2-135M run, 3 steps each
    python benchmarks/run_memory.py --ranks 0 1 64 --allocators glibc mmap_threshold=4194304 jemalloc tcmalloc
    python benchmarks/run_memory.py --steps 2 -- --num_generations 4       # the toy (grpo.py's defaults), other flags

Each configuration (--lora_rank R for R in --ranks, 0 being full fine-tuning; LoRA with --learning_rate 1e-4, 10x the
README's, after any flags given) runs grpo.py with the README's SmolLM2 flags (or the flags after --, instead) for
--steps steps (no evaluation; its weights are deleted once it finished) once under each of --allocators:
- glibc: glibc's default (--malloc_mmap_threshold 0, grpo.py's default). Its mmap threshold is dynamic and rises up
  to 32 MiB, so the freed blocks of tensors below it stay in the process's heap for reuse, and the heap fragments as
  tensors of other sizes come and go;
- mmap_threshold=N: --malloc_mmap_threshold N (set with mallopt at the run's start): every allocation above N bytes
  is mapped on its own and unmapped when freed, so resident memory follows what the tensors hold, and each large
  tensor's pages are faulted in afresh;
- jemalloc, tcmalloc: the library preloaded (LD_PRELOAD=libjemalloc.so.2, libtcmalloc_minimal.so.4; Debian's
  libjemalloc2, libtcmalloc-minimal4), checked to be loaded before the runs start (with --malloc_mmap_threshold 0,
  which only sets glibc's malloc).
The peak is the training process's `memory/rss_gb_max` at the last step (ru_maxrss, before the final checkpoint); the
step time is the median of the steps after the first (the .jsonl holds the rollout's and the training phase's too); an
allocator must not change what is computed, so each run's step metrics (reward, completion length, losses, gradient
norm) are compared with glibc default's, step by step. Ratios are against full fine-tuning under the same allocator and
against glibc's default for the same training, measured in the same invocation; a rank's allocators are started together
(--jobs as many as --allocators) so that they see the same load. --reuse reads the finished runs of an earlier
invocation back from the run folder (the same command and allocator, saved in its benchmark.json).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy_runs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_RUN = ["--model", "smollm2-135m", "--task", "rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1",
              "--instruction", "user", "--engine", "hf", "--prompts_per_step", "4", "--max_new_tokens", "64",
              "--learning_rate", "1e-5"]


PRELOADS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}


def allocator_setting(allocator):
    """The environment variables and grpo.py flags that select `allocator` -> (dict, list); a one-line error for a
    name it does not know."""
    if allocator.startswith("mmap_threshold=") and allocator.split("=", 1)[1].isdigit():
        return {}, ["--malloc_mmap_threshold", allocator.split("=", 1)[1]]
    if allocator == "glibc" or allocator in PRELOADS:
        return {"LD_PRELOAD": PRELOADS[allocator]} if allocator in PRELOADS else {}, ["--malloc_mmap_threshold", "0"]
    raise SystemExit(f"error: --allocators {allocator}: use glibc, mmap_threshold=BYTES, {', '.join(PRELOADS)}")


def check_loaded(allocator):
    """A preloaded allocator that is not installed is skipped by the loader with a warning: fail here instead."""
    env = {**os.environ, **allocator_setting(allocator)[0]}
    if allocator in PRELOADS:
        probe = "import sys; sys.exit(not any(sys.argv[1] in line for line in open('/proc/self/maps')))"
        if subprocess.run([sys.executable, "-c", probe, allocator], env=env, capture_output=True).returncode:
            package = "libjemalloc2" if allocator == "jemalloc" else "libtcmalloc-minimal4"
            raise SystemExit(f"error: --allocators {allocator}: {PRELOADS[allocator]} is not installed "
                             f"(apt-get install {package})")


SAME_KEYS = ["charts/reward", "charts/completion_length", "losses/policy", "losses/kl", "policy/grad_norm"]


def one_run(rank, allocator, steps, threads, out_dir, flags, reuse=False):
    """One configuration's run (or, with reuse, its finished run read back) -> its peak, step time and metrics."""
    name = f"r{rank}_{allocator.replace('=', '')}"
    run_dir = os.path.join(out_dir, f"{name}__1")
    lora = ["--lora_rank", str(rank), "--learning_rate", "1e-4"] if rank else []
    env_vars, allocator_flags = allocator_setting(allocator)
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), *flags, *lora, *allocator_flags, "--total_steps", str(steps),
           "--eval_every", "0", "--save_every", "0", "--threads", str(threads), "--output_dir", out_dir,
           "--exp_name", name]
    env = {key: value for key, value in os.environ.items() if key not in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")}
    env.update(env_vars)
    done = os.path.join(run_dir, "benchmark.json")  # written when the run finished: its command and allocator
    this = {"cmd": cmd[1:], "allocator": env_vars}
    reused = reuse and os.path.exists(done) and json.load(open(done)) == this
    if not reused:
        shutil.rmtree(run_dir, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        toy_runs.drop_weights(run_dir)
        with open(done, "w") as f:
            json.dump(this, f)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    phases = ("step", "rollout", "train")
    medians = {f"{phase}_s": statistics.median(r[f"time/{phase}"] for r in rows[1:]) for phase in phases}
    return {"rank": rank, "allocator": allocator, "reused": reused, "rss_gb": rows[-1]["memory/rss_gb_max"], **medians,
            "metrics": [{key: r[key] for key in SAME_KEYS if key in r} for r in rows]}


def largest_difference(run, baseline):
    """The largest absolute difference of SAME_KEYS over the steps of two runs of one training."""
    return max((abs(a[key] - b[key]) for a, b in zip(run["metrics"], baseline["metrics"]) for key in a if key in b),
               default=float("nan"))


def describe(allocator):
    if allocator.startswith("mmap_threshold="):
        threshold = int(allocator.split("=", 1)[1])
        return f"glibc, mmap threshold {threshold / 2**20:g} MiB"
    return "glibc default" if allocator == "glibc" else f"{allocator} (LD_PRELOAD)"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", nargs="+", type=int, default=[0, 1, 64])
    parser.add_argument("--allocators", nargs="+", default=["glibc", "mmap_threshold=4194304"],
                        help="glibc, mmap_threshold=BYTES, jemalloc, tcmalloc")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--name", default="smollm2_memory")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="folder of the results")
    parser.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "benchmarks"), help="folder of the runs")
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same command and allocator "
                        "in the run folder instead of running them again")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="after --: grpo.py's flags instead of the README's")
    args = parser.parse_args()
    flags = [a for a in args.flags if a != "--"] or README_RUN
    out_dir = os.path.join(args.output_dir, args.name)
    for allocator in args.allocators:
        check_loaded(allocator)
    cases = [(rank, allocator) for rank in args.ranks for allocator in args.allocators]  # a rank's together
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda case: one_run(*case, args.steps, args.threads, out_dir, flags, args.reuse),
                                cases))
    for r in results:
        print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    reused = sum(r["reused"] for r in results)
    load = (f"load average over the last 5 minutes at the end: {os.getloadavg()[1]:.1f} on {os.cpu_count()} cores"
            if reused < len(results) else f"{os.cpu_count()} cores")  # read back: the load they ran under is unknown
    described = "the README's SmolLM2 flags" if flags == README_RUN else " ".join(flags)
    lines = [f"`python benchmarks/run_memory.py {' '.join(sys.argv[1:])}` (grpo.py, {described}, "
             f"{args.steps} steps, {args.threads} thread(s) per run, {args.jobs} run(s) at a time; {load}"
             + (f"; {reused} of {len(results)} runs read back from an earlier invocation" if args.reuse else "")
             + ")", "",
             "| training | allocator | peak RSS GiB | peak RSS / full | median step s | step time / full | "
             "step time / glibc default's | step metrics, max abs difference from glibc default's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        full = next(b for b in results if b["rank"] == 0 and b["allocator"] == r["allocator"])
        glibc = next((b for b in results if b["rank"] == r["rank"] and b["allocator"] == "glibc"), None)
        vs_glibc = f"{r['step_s'] / glibc['step_s']:.2f}" if glibc else "-"
        same = f"{largest_difference(r, glibc):.1e}" if glibc else "-"
        lines.append(f"| {'full' if r['rank'] == 0 else 'LoRA rank ' + str(r['rank'])} | {describe(r['allocator'])} | "
                     f"{r['rss_gb']:.2f} | {r['rss_gb'] / full['rss_gb']:.2f} | {r['step_s']:.1f} | "
                     f"{r['step_s'] / full['step_s']:.2f} | {vs_glibc} | {same} |")
    toy_runs.write_results(args.name, lines, args.out)


if __name__ == "__main__":
    main()
