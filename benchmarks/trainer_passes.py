"""Where a toy step's trainer time goes, and what the obvious speed knobs would buy: grpo.py's pi_ref pass
(batched_logprobs, no grad) and its policy update (update_policy: forward, loss, backward, AdamW at lr 0 so the weights
never move) on one rollout batch of the embedded model, timed in one process with the variants alternating.

    python benchmarks/trainer_passes.py                 # micro-batch sizes and SDPA backends, ~1 minute
    python benchmarks/trainer_passes.py --compile       # also torch.compile(dynamic=True): minutes of compiling

Variants: grpo.py's default (micro-batches of 32 sorted by completion length, SDPA's flash kernel, eager modules);
micro-batches of 16, 64, 128; SDPA's math backend; torch.compile. Prints, and writes to
benchmarks/results/trainer_passes.md, the median seconds per pass over the repeats and the ratio to the default, and
the compile time (the first call of each compiled pass, which a training run pays too).
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
from utils.checks import resolve_args  # noqa: E402
from utils.rl import make_batch  # noqa: E402
from utils.tasks import toy_problems  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=grpo.TOY_MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model, dynamic=True)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "trainer_passes.md"))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = resolve_args(grpo.Args(model=opts.model), grpo.check_algorithm_args)
    accelerator = Accelerator(cpu=True)
    tokenizer = grpo.load_tokenizer(args)
    model, ref_model = grpo.load_model(args, accelerator, tokenizer), grpo.load_model(args, accelerator, tokenizer)
    rows = toy_problems("train")[:args.prompts_per_step]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    torch.manual_seed(0)
    samples = grpo.hf_generate(model, tokenizer, prompts, args.num_generations, args.temperature, args.top_p,
                               args.max_new_tokens, accelerator)
    batch = make_batch([p for p in prompts for _ in range(args.num_generations)], samples, tokenizer.pad_token_id,
                       accelerator.device)
    batch["advantages"] = torch.randn(len(samples))
    lengths = batch["completion_mask"].sum(-1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)  # timing only: weights never move

    variants = {"default (32, flash, eager)": (32, SDPBackend.FLASH_ATTENTION, False),
                "micro-batches of 16": (16, SDPBackend.FLASH_ATTENTION, False),
                "micro-batches of 64": (64, SDPBackend.FLASH_ATTENTION, False),
                "micro-batches of 128": (128, SDPBackend.FLASH_ATTENTION, False),
                "SDPA math backend": (32, SDPBackend.MATH, False)}
    if opts.compile:
        variants["torch.compile(dynamic=True)"] = (32, SDPBackend.FLASH_ATTENTION, True)
    compiled = {}

    def passes(name):
        size, backend, use_compile = variants[name]
        policy, reference = model, ref_model
        if use_compile:
            if not compiled:
                compiled.update(policy=torch.compile(model, dynamic=True), ref=torch.compile(ref_model, dynamic=True))
            policy, reference = compiled["policy"], compiled["ref"]
        run_args = copy.copy(args)
        run_args.micro_batch_size = size
        seconds = {}
        with sdpa_kernel(backend):
            start = time.perf_counter()
            ref_logp = grpo.batched_logprobs(reference, batch, args.temperature, size)
            seconds["pi_ref pass"] = time.perf_counter() - start
            start = time.perf_counter()
            grpo.update_policy(run_args, policy, optimizer, dict(batch, ref_logp=ref_logp), accelerator)
            seconds["policy update"] = time.perf_counter() - start
        return seconds

    first_call = {name: passes(name) for name in variants}  # warm-up; a compiled variant compiles here
    times = {name: [] for name in variants}
    for repeat in range(opts.repeats):
        for name in (list(variants) if repeat % 2 == 0 else list(variants)[::-1]):
            times[name].append(passes(name))
    median = {name: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
    base = median["default (32, flash, eager)"]
    lines = [f"# trainer_passes\n\nCommand: `python benchmarks/trainer_passes.py{' --compile' if opts.compile else ''}`"
             f"; {len(samples)} completions of {os.path.relpath(opts.model, ROOT)}, mean length "
             f"{lengths.mean():.1f}, longest {int(lengths.max())}; one thread; median of {opts.repeats} repeats, the "
             f"variants alternating; 1-min load average at the end {os.getloadavg()[0]:.2f}.\n",
             "| variant | pi_ref pass s | policy update s | both | vs default | first call (compiles) s |",
             "|---|---|---|---|---|---|"]
    for name, m in median.items():
        both = sum(m.values())
        lines.append(f"| {name} | {m['pi_ref pass']:.4f} | {m['policy update']:.4f} | {both:.4f} | "
                     f"{both / sum(base.values()):.2f}x | {sum(first_call[name].values()):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(opts.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
