"""Where a toy step's trainer time goes, and what the obvious speed knobs would buy: grpo.py's pi_ref pass
(batched_logprobs, no grad) and its policy update (update_policy: forward, loss, backward, AdamW at lr 0 so the weights
never move) on one rollout batch of the embedded model, timed in one process with the variants alternating.

    python benchmarks/trainer_passes.py                 # micro-batch sizes and SDPA backends, ~1 minute
    python benchmarks/trainer_passes.py --compile       # also torch.compile(dynamic=True): minutes of compiling
    python benchmarks/trainer_passes.py --prompts 2 --repeats 1 --out /tmp/trainer_passes.md   # seconds: a check

Variants: grpo.py's default (micro-batches of 32 sorted by completion length, SDPA's flash kernel, eager modules);
micro-batches of 16, 64, 128; SDPA's math backend; two other ways to compute the same log-probs (functions
below: each prompt's forward shared by its rows in a micro-batch through the KV cache; no padding mask, which is exact
when no prompt is left-padded, and no input for the last token, whose logits predict nothing; both apply the output
layer as grpo.py does, a chunk of positions at a time: grpo.output_logprobs); torch.compile. Prints,
and writes to benchmarks/results/trainer_passes.md, the median seconds per pass over the repeats, the ratio to the
default, the largest difference of the pi_ref pass's log-probs from the default's, the compile time (the first call of
each compiled pass, which a training run pays too), and the cost of the same number of model calls on one short row
each: the part of the passes that does not shrink with the batch.
"""

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
from grpo import make_batch  # noqa: E402
from plumbing.models import load_model, load_tokenizer  # noqa: E402
from plumbing.engine import HFDecoder  # noqa: E402
from plumbing.run import RunArgs  # noqa: E402
from utils.tasks import toy_problems  # noqa: E402


def logprobs_prompt_shared(model, batch, temperature, accelerator, with_entropy=False):
    """grpo.token_logprobs with each distinct prompt of the micro-batch run once: its KV cache and last hidden state
    are repeated for the rows that share it, then the completions run on that cache."""
    input_ids, attention_mask, prompt_width = batch.input_ids, batch.attention_mask, batch.prompt_width
    completion = input_ids[:, prompt_width:]
    prompt = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width]], dim=1)
    unique, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    prompt_ids, prompt_mask = unique[:, :prompt_width], unique[:, prompt_width:]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(-1) - 1).clamp(
        min=0), use_cache=True, output_hidden_states=True, logits_to_keep=1)
    hidden = [out.hidden_states[-1][inverse, -1:]]  # the output layer's input: the head is applied after, in chunks
    if completion.shape[1] > 1:  # the last completion token is no input
        out.past_key_values.batch_select_indices(inverse)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden.append(model(input_ids=completion[:, :-1], attention_mask=attention_mask[:, :-1],
                            position_ids=position_ids[:, prompt_width:-1], past_key_values=out.past_key_values,
                            use_cache=True, output_hidden_states=True, logits_to_keep=1).hidden_states[-1])
    return grpo.output_logprobs(model, torch.cat(hidden, dim=1), completion, temperature, accelerator, with_entropy)


def logprobs_unmasked(model, batch, temperature, accelerator, with_entropy=False):
    """grpo.token_logprobs without the padding mask (right padding is invisible to a causal model at the positions
    read; the toy's prompts are never left-padded) and without the last token as an input."""
    assert bool(batch.attention_mask[:, 0].all()), "a left-padded prompt needs the mask"
    completion = batch.input_ids[:, batch.prompt_width:]
    hidden = model(input_ids=batch.input_ids[:, :-1], output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    return grpo.output_logprobs(model, hidden[:, batch.prompt_width - 1:], completion, temperature, accelerator,
                                with_entropy)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=grpo.TOY_MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts in the rollout batch, each with grpo.py's --num_generations completions "
                             "(default: its --prompts_per_step)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model, dynamic=True)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "trainer_passes.md"))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = grpo.resolve_args(grpo.Args(model=opts.model, run=RunArgs(engine="hf")), 1)
    accelerator = Accelerator(cpu=True)
    tokenizer, stop_ids = load_tokenizer(args.model)
    model, ref_model = load_model(args.model, tokenizer), load_model(args.model, tokenizer)
    rows = toy_problems("train")[:opts.prompts or args.prompts_per_step]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    torch.manual_seed(0)
    samples = HFDecoder(stop_ids).generate(model, tokenizer, prompts, args.num_generations, args.temperature,
                                           args.top_p, args.max_new_tokens, accelerator)
    batch = make_batch([p for p in prompts for _ in range(args.num_generations)], samples, tokenizer.pad_token_id,
                       accelerator.device)
    batch.advantages = torch.randn(len(samples))[:, None] * batch.mask  # A_i on each token of completion i
    lengths = batch.mask.sum(-1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)  # timing only: weights never move

    flash, default_logprobs = SDPBackend.FLASH_ATTENTION, grpo.token_logprobs
    variants = {"default (32, flash, eager)": (32, flash, False, default_logprobs),
                "micro-batches of 16": (16, flash, False, default_logprobs),
                "micro-batches of 64": (64, flash, False, default_logprobs),
                "micro-batches of 128": (128, flash, False, default_logprobs),
                "SDPA math backend": (32, SDPBackend.MATH, False, default_logprobs),
                "prompt forward shared in a micro-batch": (32, flash, False, logprobs_prompt_shared),
                "no padding mask, no last input": (32, flash, False, logprobs_unmasked)}
    if opts.compile:
        variants["torch.compile(dynamic=True)"] = (32, flash, True, default_logprobs)
    compiled, ref_logps = {}, {}

    def passes(name):
        size, backend, use_compile, grpo.token_logprobs = variants[name]  # update_policy calls grpo.token_logprobs
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
            ref_logp = grpo.batched_logprobs(reference, batch, args.temperature, accelerator, len(batch), size)
            seconds["pi_ref pass"] = time.perf_counter() - start
            ref_logps[name] = ref_logp
            start = time.perf_counter()
            grpo.update_policy(run_args, policy, optimizer, dataclasses.replace(batch, ref_logp=ref_logp), accelerator)
            seconds["policy update"] = time.perf_counter() - start
        grpo.token_logprobs = default_logprobs
        return seconds

    def one_row_calls():  # the default's model calls (a forward per micro-batch, twice; one backward) on 1 x 8 tokens
        ids, seconds = batch.input_ids[:1, :8], {}
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(0, len(samples), args.micro_batch_size):
                ref_model(input_ids=ids, logits_to_keep=1)
        seconds["pi_ref pass"] = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(0, len(samples), args.micro_batch_size):
            model(input_ids=ids, logits_to_keep=1).logits.sum().backward()
        seconds["policy update"] = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        return seconds

    first_call = {name: passes(name) for name in variants}  # warm-up; a compiled variant compiles here
    times, floor = {name: [] for name in variants}, []
    for repeat in range(opts.repeats):
        for name in (list(variants) if repeat % 2 == 0 else list(variants)[::-1]):
            times[name].append(passes(name))
        floor.append(one_row_calls())
    median = {name: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
    base = median["default (32, flash, eager)"]
    mask = batch.mask.bool()
    diff = {name: (ref_logps[name] - ref_logps["default (32, flash, eager)"])[mask].abs().max() for name in variants}
    floor = {k: statistics.median(t[k] for t in floor) for k in floor[0]}
    shown = [a for i, a in enumerate(sys.argv[1:]) if "--out" not in (a, sys.argv[i])]  # argv[i] precedes a
    lines = [f"# trainer_passes\n\nCommand: `{' '.join(['python benchmarks/trainer_passes.py'] + shown)}`"
             f"; {len(samples)} completions of {os.path.relpath(opts.model, ROOT)}, mean length "
             f"{lengths.mean():.1f}, longest {int(lengths.max())}; one thread; median of {opts.repeats} repeats, the "
             f"variants alternating; 1-min load average at the end {os.getloadavg()[0]:.2f}.\n",
             "| variant | pi_ref pass s | policy update s | both | vs default | max abs diff of pi_ref log-probs "
             "| first call (compiles) s |", "|---|---|---|---|---|---|---|"]
    for name, m in median.items():
        both = sum(m.values())
        lines.append(f"| {name} | {m['pi_ref pass']:.4f} | {m['policy update']:.4f} | {both:.4f} | "
                     f"{both / sum(base.values()):.2f}x | {diff[name]:.1e} | {sum(first_call[name].values()):.1f} |")
    calls = len(range(0, len(samples), args.micro_batch_size))
    lines.append(f"\nThe default's model calls on one row of 8 tokens each ({calls} forward "
                 f"passes of the reference model, as many forward and backward passes of the policy): "
                 f"{floor['pi_ref pass']:.4f} s + {floor['policy update']:.4f} s = {sum(floor.values()):.4f} s, "
                 f"{sum(floor.values()) / sum(base.values()):.0%} of the default's passes.")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(opts.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
