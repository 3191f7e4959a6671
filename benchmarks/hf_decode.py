"""The HF engine's decode loop (plumbing.engine.HFDecoder) against transformers' generate(), same model and prompts.

    python benchmarks/hf_decode.py                       # embedded model: 32 prompts x 8 samples, 48 new tokens
    python benchmarks/hf_decode.py --repeats 9 --prompts 16

Both sample at temperature 1 without top-k/top-p from the same left-padded prompts, on one torch thread, alternating,
after one warm-up each; prints the median seconds per rollout batch, tokens per second and their ratio (same run).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
from plumbing.models import load_model, load_tokenizer  # noqa: E402
from plumbing.engine import HFDecoder  # noqa: E402
from plumbing.run import RunArgs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=grpo.TOY_MODEL_DIR)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from transformers import GenerationConfig

    args = grpo.resolve_args(grpo.Args(model=opts.model, run=RunArgs(engine="hf")), 1)
    accelerator = Accelerator(cpu=True)
    tokenizer, stop_ids = load_tokenizer(args.model)
    model = load_model(args.model, tokenizer).eval()
    prompts = [tokenizer(f"{i % 100:02d}+{(7 * i) % 100:02d}=", add_special_tokens=False)["input_ids"]
               for i in range(opts.prompts)]
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=opts.new_tokens, use_cache=True,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids)
    inputs = tokenizer.pad({"input_ids": [p for p in prompts for _ in range(opts.generations)]}, padding_side="left",
                           return_tensors="pt")

    def transformers_generate():
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=config)[:, inputs["input_ids"].shape[1]:]
        return int(sum(next((t + 1 for t, x in enumerate(row) if x in stop_ids), len(row))
                       for row in out.tolist()))

    def decode_loop():
        samples = HFDecoder(stop_ids).generate(model, tokenizer, prompts, opts.generations, 1.0, 1.0, opts.new_tokens,
                                               accelerator)
        return sum(len(sample.token_ids) for sample in samples)

    sides = {"transformers generate()": transformers_generate, "HFDecoder.generate": decode_loop}
    times, tokens = {name: [] for name in sides}, {name: [] for name in sides}
    for repeat in range(opts.repeats + 1):
        for name, fn in sides.items():
            torch.manual_seed(repeat)
            start = time.perf_counter()
            n = fn()
            if repeat:  # the first round warms up
                times[name].append(time.perf_counter() - start)
                tokens[name].append(n)
    base = statistics.median(times["transformers generate()"])
    print(f"{opts.prompts} prompts x {opts.generations} samples, <= {opts.new_tokens} new tokens, 1 thread, "
          f"median of {opts.repeats}:")
    for name in sides:
        t = statistics.median(times[name])
        print(f"  {name:24s} {t:.3f} s  {statistics.median(tokens[name]) / t:8.0f} tokens/s  {base / t:.2f}x")


if __name__ == "__main__":
    main()
