"""Peak memory and time of one trainer step at real models' shapes: the token log-probs computed a chunk of positions
at a time (grpo.py's token_logprobs) against the whole-vocabulary float32 log-softmax, and gradient checkpointing on and
off; and the estimate every run prints at start (plumbing/memory.py) against what was measured.

    python benchmarks/memory.py                          # Qwen2.5-0.5B and 1.5B widths, 2 layers, completions 512-4096
    python benchmarks/memory.py --layers 24 --lengths 1024 2048 --models qwen2.5-0.5b --name memory_full_depth
    LD_PRELOAD=libtcmalloc_minimal.so.4 python benchmarks/memory.py --layers 24 --lengths 1024 2048 \
        --models qwen2.5-0.5b --name memory_full_depth_tcmalloc    # the same under tcmalloc (the table says so)
    python benchmarks/memory.py --reuse                  # the measured cases read back, the estimate computed anew
    python benchmarks/memory.py --models tiny --lengths 64 128 --out /tmp/memory   # a check in seconds
    python benchmarks/memory.py --recipes                # the estimate docs/running.md's recipes print at start

Each case runs in a fresh process: a Qwen2 model of the shape with random weights (no hub), float32 on the CPU, one
micro-batch of --micro_batch sequences of 64 prompt tokens and T completion tokens: forward through the trainer's
token log-prob code, a policy-gradient loss, backward, and an AdamW step, three times. The log-prob pass's memory is
the peak RSS (VmHWM, reset once the model is built) of the first forward, loss and backward over the RSS with the
model loaded (activations, logits, gradients); the step's peak is the peak RSS of all three steps over the RSS before
the model existed (weights and Adam's moments too); the step time is the median of the last two. RSS counts what
glibc's allocator keeps of freed memory too (a preloaded allocator keeps less), so a fourth, untimed step runs
under torch's MemTracker: its tensor peak is the most bytes the step's tensors held at once (parameters, gradients,
optimizer state, activations, temporaries), what torch.cuda.max_memory_allocated measures on a GPU. The estimate is
checked against both; it is a function of the case alone, so --reuse recomputes it for measurements read back.
The per-token cost is the slope over T; it is the marginal cost only above a chunk's positions (grpo.py's
CHUNK_BYTES of float32 logits: 220 positions at these models' vocabulary), below which the log-prob chunk itself grows
with T. Cases run interleaved, so the time ratios compare steps measured
under the same load. The depth is cut to --layers on a CPU (the output layer and the per-layer
terms are the same at any depth; the estimate takes the depth into account).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # the models' configs (Hugging Face), vocabulary included
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,  # a check in
                 num_key_value_heads=2, vocab_size=131072, tie_word_embeddings=True),  # seconds (the tests); its
}  # vocabulary makes a log-prob chunk 256 positions, so 1024 completion tokens span four
MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b"]  # the default
RECIPES = {  # docs/running.md's recipes, on 8 GPUs (bf16, gradient checkpointing): what their runs print at start
    "gsm8k": ("qwen2.5-0.5b", dict(micro_batch=8, prompt=512, completion=512, reference=True, fsdp=False)),
    "math": ("qwen2.5-1.5b", dict(micro_batch=4, prompt=1024, completion=3000, reference=False, fsdp=True)),
}  # Qwen2.5-Math-1.5B has Qwen2.5-1.5B's shape
CASES = (("full", "off"), ("chunked", "off"), ("chunked", "on"))  # log-probs, gradient checkpointing
PROMPT = 64


def status(key):
    """VmRSS (resident now) or VmHWM (the peak since the last reset), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM starts again from VmRSS (Linux)
        f.write("5")


def case_config(shape, layers=None, length=0):
    """The Qwen2 config of a shape, cut to `layers` decoder layers (None: all), for PROMPT + length positions."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**SHAPES[shape], "num_hidden_layers": layers or SHAPES[shape]["num_hidden_layers"]},
                       max_position_embeddings=PROMPT + length)


def estimate_gb(config, micro_batch, prompt, completion, checkpointing, reference=False, **flags):
    """The estimate a run of this model prints at start (plumbing/memory.py): its parts in GB (and "total"). The
    parameters are counted on the meta device (no memory); `flags`: estimate()'s bf16, processes, fsdp, cuda."""
    import torch
    from transformers import Qwen2ForCausalLM

    from plumbing.memory import estimate

    with torch.device("meta"):
        sizes = [p.numel() for p in Qwen2ForCausalLM(config).parameters()]
    parts = estimate(config, sum(sizes), max(sizes), sum(sizes) if reference else 0, micro_batch, prompt + completion,
                     completion, checkpointing, **flags)
    return {k: v / 2**30 for k, v in parts.items()}


def full_vocabulary_logprobs(model, batch, temperature, accelerator=None, with_entropy=False):
    """grpo.token_logprobs's quantities from the whole (B, T, V) float32 log-softmax of the model's own logits: what a
    trainer without chunking computes (and the reference tests/test_logprobs.py holds the chunked path to)."""
    import torch

    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion = batch.input_ids[:, batch.prompt_width:]
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                   logits_to_keep=completion.shape[1] + 1).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def one_case(shape, layers, length, logprobs, checkpointing, micro_batch, threads):
    """Runs in its own process: the measurement of one case, as a dict."""
    import torch
    from accelerate import Accelerator
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import Qwen2ForCausalLM

    import grpo
    from plumbing.models import gradient_checkpointing

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    before = status("VmRSS")
    config = case_config(shape, layers, length)
    model = Qwen2ForCausalLM(config).eval()  # eval: as the trainer keeps the policy (no dropout)
    gradient_checkpointing(model, checkpointing, model_name="not-the-embedded-model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, config.vocab_size, (micro_batch, PROMPT + length))
    mask = torch.ones(micro_batch, length)
    batch = grpo.Batch(ids, torch.ones_like(ids), PROMPT, mask, torch.zeros_like(mask))
    advantages, accelerator = torch.randn(micro_batch, 1), Accelerator(cpu=True)
    compute = grpo.token_logprobs if logprobs == "chunked" else full_vocabulary_logprobs
    reset_peak()  # not the model's initialization, which holds temporaries
    loaded, seconds = status("VmRSS"), []
    for step in range(3):
        start = time.perf_counter()
        logp, _ = compute(model, batch, 1.0, accelerator)
        loss = -(advantages * logp).mean()
        loss.backward()
        if step == 0:  # the log-prob pass alone: forward, loss, backward (activations, logits, gradients)
            pass_peak = status("VmHWM") - loaded
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        del logp, loss
    peak = status("VmHWM") - before
    tracker = MemTracker()  # one more step, untimed: the peak of the bytes its tensors hold, whatever the allocator
    tracker.track_external(model, optimizer)
    with tracker:
        logp, _ = compute(model, batch, 1.0, accelerator)
        (-(advantages * logp).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tensor_peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    return {"shape": shape, "layers": layers, "length": length, "logprobs": logprobs, "checkpointing": checkpointing,
            "micro_batch": micro_batch, "pass_gb": pass_peak / 2**30, "peak_gb": peak / 2**30,
            "tensor_peak_gb": tensor_peak / 2**30, "step_s": statistics.median(seconds[1:])}


def slope(xs, ys):
    """The least-squares slope of ys over xs."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--micro_batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="memory")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="folder of the results")
    parser.add_argument("--reuse", action="store_true", help="read the measured cases back from NAME.jsonl in --out "
                        "and measure only those missing; the estimate is always computed anew")
    parser.add_argument("--recipes", action="store_true", help="print the estimate of docs/running.md's recipes")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case and print its JSON
    opts = parser.parse_args()
    if opts.recipes:
        for name, (shape, recipe) in RECIPES.items():
            parts = estimate_gb(case_config(shape), checkpointing=True, bf16=True, processes=8, cuda=True, **recipe)
            print(f"{name}: {parts['total']:.1f} GB per GPU (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()
                                                                        if k != "total") + ")")
        return
    if opts.case:
        print(json.dumps(one_case(**json.loads(opts.case))))
        return
    from toy_runs import write_results

    jsonl = os.path.join(opts.out, f"{opts.name}.jsonl")
    measured = [json.loads(line) for line in open(jsonl)] if opts.reuse and os.path.exists(jsonl) else []
    results = []
    for shape in opts.models:
        for length in opts.lengths:
            for logprobs, checkpointing in CASES:
                case = dict(shape=shape, layers=opts.layers, length=length, logprobs=logprobs,
                            checkpointing=checkpointing, micro_batch=opts.micro_batch, threads=opts.threads)
                result = next((r for r in measured if all(r[k] == v for k, v in case.items() if k != "threads")), None)
                if result is None:
                    proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True,
                                          text=True)
                    if proc.returncode != 0:
                        raise SystemExit(proc.stderr[-3000:])
                    result = json.loads(proc.stdout.strip().splitlines()[-1])
                result["estimate"] = estimate_gb(case_config(shape, opts.layers, length), opts.micro_batch, PROMPT,
                                                 length, checkpointing == "on")
                result["estimate_gb"] = result["estimate"]["total"]
                results.append(result)
                print(json.dumps(result), flush=True)
    os.makedirs(opts.out, exist_ok=True)
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    preload = f"LD_PRELOAD={os.environ['LD_PRELOAD']} " if os.environ.get("LD_PRELOAD") else ""  # an allocator
    lines = [f"`{preload}python benchmarks/memory.py {' '.join(sys.argv[1:])}` ({opts.layers} layers, micro-batch "
             f"{opts.micro_batch} x (64 + T) tokens, float32, {opts.threads} threads, one process per case)", "",
             "| model | T | log-probs | checkpointing | log-prob pass GB | step peak GB | tensor peak GB | "
             "estimate GB | estimate error (RSS / tensors) | step s | step time vs full, no checkpointing |",
             "|" + "---|" * 11]
    for r in results:
        base = next(b for b in results if b["shape"] == r["shape"] and b["length"] == r["length"] and
                    b["logprobs"] == "full")
        error = [(r["estimate_gb"] - r[key]) / r[key] for key in ("peak_gb", "tensor_peak_gb")]
        lines.append(f"| {r['shape']} | {r['length']} | {r['logprobs']} | {r['checkpointing']} | {r['pass_gb']:.2f} | "
                     f"{r['peak_gb']:.2f} | {r['tensor_peak_gb']:.2f} | {r['estimate_gb']:.2f} | "
                     f"{error[0]:+.0%} / {error[1]:+.0%} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x |")
    lines += ["", "Per completion token (the slope over T, least squares), MB: of the log-prob pass's resident memory, "
              "of the step's, and of the step's tensor peak:", "",
              "| model | log-probs | checkpointing | log-prob pass | step peak | tensor peak |",
              "|---|---|---|---|---|---|"]
    for shape in opts.models:
        for logprobs, checkpointing in CASES:
            points = [r for r in results if r["shape"] == shape and r["logprobs"] == logprobs and
                      r["checkpointing"] == checkpointing]
            lines.append(f"| {shape} | {logprobs} | {checkpointing} | " + " | ".join(
                f"{slope([r['length'] for r in points], [r[key] * 1024 for r in points]):.3f}"
                for key in ("pass_gb", "peak_gb", "tensor_peak_gb")) + " |")
    path = write_results(opts.name, lines, opts.out)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(opts.models), figsize=(6 * len(opts.models), 4), squeeze=False)
    for ax, shape in zip(axes[0], opts.models):
        for logprobs, checkpointing in CASES:
            points = [r for r in results if r["shape"] == shape and r["logprobs"] == logprobs and
                      r["checkpointing"] == checkpointing]
            ax.plot([r["length"] for r in points], [r["pass_gb"] for r in points], marker="o",
                    label=f"{logprobs} log-probs, checkpointing {checkpointing}")
        ax.set(title=f"{shape} width, {opts.layers} layers", xlabel="completion tokens T",
               ylabel="log-prob pass GB (forward, loss, backward)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=100)


if __name__ == "__main__":
    main()
