"""How well a model starts on a task under each placement of the answer-format instruction (--instruction): a system
turn, or after the question in the user turn. Greedy and sampled (T = 1, the rollouts' temperature) accuracy and format
rate of the untrained model on held-out problems, through grpo.py's generate(), plumbing/engine.py's engine and the
reward scorer.

    python benchmarks/prompt_start.py --model smollm2-135m --task rg:chain_sum:min_terms=2,max_terms=2,max_digits=2

Results: benchmarks/results/prompt_start.md (appended, one table per invocation, with the command and the load).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
from plumbing.models import load_model, load_tokenizer  # noqa: E402
from plumbing.engine import create_engine  # noqa: E402
from utils.rewards import RewardScorer  # noqa: E402
from plumbing.run import RunArgs  # noqa: E402
from utils.tasks import format_prompt, load_task  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=2")
    parser.add_argument("--answer_format", default="boxed")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "prompt_start.md"))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    from accelerate import Accelerator

    args = grpo.resolve_args(grpo.Args(model=opts.model, task=opts.task, answer_format=opts.answer_format,
                                       max_new_tokens=opts.max_new_tokens, run=RunArgs(engine="hf")), 1)
    accelerator = Accelerator(cpu=True)
    tokenizer, stop_ids = load_tokenizer(args.model)
    model = load_model(args.model, tokenizer).eval()
    engine = create_engine(args.run, args.model, args.seed, args.max_prompt_length + args.max_new_tokens, stop_ids)
    rows = load_task(args.task, "test", tokenizer, args.answer_format, args.max_prompt_length)[0][:opts.problems]
    lines = [f"\n`python benchmarks/prompt_start.py --model {opts.model} --task {opts.task} --problems {opts.problems}"
             f" --samples {opts.samples} --max_new_tokens {opts.max_new_tokens}`\n",
             "| --instruction | greedy accuracy | greedy format | sampled accuracy (T=1) | sampled format "
             "| mean length |",
             "|---|---|---|---|---|---|"]
    run = args.run
    with RewardScorer(args.task, args.answer_format, 1, run.reward_timeout, run.reward_memory_mb) as scorer:
        for placement in ("system", "user"):  # --instruction
            prompts = [tokenizer(format_prompt(tokenizer, r["question"], args.answer_format, placement),
                                 add_special_tokens=False)["input_ids"] for r in rows]
            cells, lengths = [], []
            for n, temperature in ((1, 0.0), (opts.samples, 1.0)):
                out, _ = grpo.generate(engine, model, tokenizer, prompts, n, temperature, 1.0, args.max_new_tokens,
                                       accelerator, 0)
                texts = tokenizer.batch_decode([sample.token_ids for sample in out], skip_special_tokens=True)
                acc, fmt, _ = scorer.result(scorer.submit(texts, [r for r in rows for _ in range(n)]))
                cells += [f"{sum(acc) / len(acc):.3f}", f"{sum(fmt) / len(fmt):.3f}"]
                lengths += [len(sample.token_ids) for sample in out]
                print(placement, temperature, repr(texts[0][-150:]), flush=True)
            lines.append(f"| {placement} | " + " | ".join(cells) + f" | {sum(lengths) / len(lengths):.1f} |")
    lines.append(f"\n1-minute load average at the end: {os.getloadavg()[0]:.2f}; {opts.threads} torch threads.")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
