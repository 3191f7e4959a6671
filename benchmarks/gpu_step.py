"""GRPO steps at a real model's shape: per-phase times, peak memory, what the vLLM engine's sleep frees, and the
engine/trainer log-prob gap, with the colocated vLLM engine (sleep mode) and with the HF engine (plumbing/engine.py's
decode loop), using grpo.py's own functions (generate, batched_logprobs, update_policy; the engine from
plumbing/engine.py).

The steps cycle through the vLLM sleep levels (--sleep_levels: 2 drops the weights, 1 keeps them in CPU memory) and
then the betas (--betas: 0 skips the reference pass); each step reports its phases' times and CUDA peaks (rollout,
reference, train). The trainer's peak is set against the estimate the runs print at start (plumbing/memory.py). The last
update is then repeated from a checkpoint saved before it: resume is exact when the loss and gradient norm are the
same. --fsdp also runs every engine under FSDP2 with one process (accelerate launch --config_file configs/fsdp2.yaml):
the sharded policy and reference, the weights gathered for the push, the sharded checkpoint. --lora_rank trains
LoRA adapters instead (under FSDP2 too: the checkpoint holds their shards alone). --self_check then runs
`grpo.py --self_check` (the embedded model's default run, or --self_check_flags). Every CUDA peak leaves out what
the sleeping engine still holds (Engine.cuda_bytes, reported). The tables go to stdout and, as one report, to --out's
name with .md.

    python benchmarks/gpu_step.py --fsdp                           # one GPU: Qwen2.5-0.5B shape, 256 x 256 tokens
    python benchmarks/gpu_step.py --shape tiny --engines hf --prompts 4 --new_tokens 16 --fsdp   # CPU check
    python benchmarks/gpu_step.py --tail --engines vllm          # grpo.py's rollout vs grpo_async.py's, long tail

--tail times rollouts only, on long-tailed lengths: a fraction --stop_frac of the vocabulary ends a completion, so with
random weights lengths are geometric (mean 1 / stop_frac, capped at --new_tokens); grpo.py's rollout (every group to
its end) against grpo_async.py's generate_partial with --overprovision groups in flight (stop once --prompts groups
are whole, continue the rest next step, drop groups older than one step). The weights do not change between steps
(no training), so both pay the same: no weight push, the same trainer.

No hub: the model is a Qwen2 config with Qwen2.5-0.5B's sizes and random weights, saved locally with a word-level
tokenizer of the same vocabulary; prompts are random token ids. Random weights almost never sample EOS (about
1/151,936 per token), so completions run to --new_tokens: every engine and step does the same, known amount of work.
One JSON object per engine goes to --out and a table to stdout.
"""

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import grpo_async  # noqa: E402
from grpo import make_batch  # noqa: E402
from plumbing.engine import create_engine  # noqa: E402
from plumbing.memory import trainer_memory  # noqa: E402
from plumbing.models import load_model, load_tokenizer  # noqa: E402
from plumbing.parallel import load_models, make_accelerator  # noqa: E402
from plumbing.run import RunArgs, load_checkpoint, quiet_libraries, save_checkpoint  # noqa: E402

SHAPES = {  # Qwen2.5-0.5B's config; tiny: the same architecture at a size a CPU runs in seconds
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=1024, max_position_embeddings=1024, rope_theta=1e4),  # head_dim 64
}


def build_model(shape, path):
    """A Qwen2 model of the shape with random weights (seed 0) and a word-level tokenizer over its whole vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    vocab = {f"<{i}>": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<3>")),
                                        bos_token="<0>", eos_token="<1>", pad_token="<2>", unk_token="<3>")
    tokenizer.save_pretrained(path)


def gpu_memory_gb():
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"used_gb": (total - free) / 2**30, "allocated_gb": torch.cuda.memory_allocated() / 2**30}


def phase_peak_gb(engine_bytes=0):
    """The CUDA allocator's peak since the last call less the engine's share (a sleeping vLLM engine's tensors stay
    allocated: plumbing/engine.py's cuda_bytes), GB (None on a CPU); the next phase's peak starts here."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - engine_bytes) / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def same_update(a, b):
    """Whether a repeated update gave the same loss and gradient norm: bit for bit on a CPU (the same kernels on the
    same data), within 1e-4 relative on a GPU, whose reductions (atomic adds in attention's and the embedding's
    backward) are not deterministic."""
    if not torch.cuda.is_available():
        return a == b
    return all(abs(x - y) <= 1e-4 * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))


def run_engine(engine_name, opts, model_dir):
    """GRPO steps with grpo.py's functions, the steps cycling through the sleep levels (vLLM on a GPU) and the betas
    of --sleep_levels and --betas; then the resume check: the last step's update repeated on the same batch from a
    checkpoint saved before it must give the same loss and gradient norm."""
    on_gpu = torch.cuda.is_available()
    run = RunArgs(engine=engine_name, eval_every=0, vllm_gpu_memory_utilization=opts.gpu_memory_utilization,
                  lora_rank=opts.lora_rank)
    args = grpo.resolve_args(grpo.Args(model=model_dir, task="toy", max_new_tokens=opts.new_tokens,
                                       max_prompt_length=opts.prompt_len, num_generations=opts.generations,
                                       prompts_per_step=opts.prompts, micro_batch_size=opts.micro_batch_size,
                                       learning_rate=1e-6, beta=max(opts.betas), run=run), 1)
    accelerator = make_accelerator()  # bf16 on a GPU; FSDP2 under configs/fsdp2.yaml (--fsdp)
    tokenizer, stop_ids = load_tokenizer(args.model)
    model, optimizer, ref_model = load_models(args.model, args.learning_rate, args.run, tokenizer, accelerator,
                                              with_reference=max(opts.betas) > 0)
    seq_len = opts.prompt_len + opts.new_tokens
    estimate = trainer_memory(accelerator, [model], [ref_model], args.micro_batch_size, seq_len, opts.new_tokens)
    result = {"engine": engine_name, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
              "fsdp2": accelerator.is_fsdp2, "lora_rank": opts.lora_rank, "memory_trainer_loaded": gpu_memory_gb(),
              "trainer_estimate_gb": estimate["total"] / 2**30}
    start = time.time()
    engine = create_engine(args.run, args.model, args.seed + accelerator.process_index,
                           args.max_prompt_length + args.max_new_tokens, stop_ids)
    result["engine_start_s"] = time.time() - start
    result["engine_cuda_gb"] = engine.cuda_bytes / 2**30  # left out of every peak below
    held = engine.cuda_bytes
    if engine.llm is not None and engine.asleep:  # what sleep frees: the engine awake, then asleep again
        result["memory_engine_asleep"] = gpu_memory_gb()
        engine.llm.wake_up()
        result["memory_engine_awake"] = gpu_memory_gb()
        start = time.time()
        engine.sleep()
        result["sleep_s"] = time.time() - start
        result["memory_engine_slept"] = gpu_memory_gb()
    generator = torch.Generator().manual_seed(1)
    steps, checkpoint = [], None
    with tempfile.TemporaryDirectory() as run_dir:
        for step in range(1, opts.steps + 1):
            sleep_level = opts.sleep_levels[(step - 1) % len(opts.sleep_levels)]
            beta = opts.betas[(step - 1) // len(opts.sleep_levels) % len(opts.betas)]
            step_args = dataclasses.replace(args, beta=beta)
            engine.sleep_level = sleep_level
            phase_peak_gb(held)
            prompts = torch.randint(3, SHAPES[opts.shape]["vocab_size"], (opts.prompts, opts.prompt_len),
                                    generator=generator).tolist()
            times = {"start": time.time()}
            samples, sync_time = grpo.generate(engine, model, tokenizer, prompts, opts.generations, 1.0, 1.0,
                                               opts.new_tokens, accelerator, policy_version=step - 1)
            times["rollout"], peaks = time.time(), {"rollout": phase_peak_gb(held)}
            batch = make_batch([p for p in prompts for _ in range(opts.generations)], samples,
                               tokenizer.pad_token_id, accelerator.device)
            if beta > 0:
                batch.ref_logp = grpo.batched_logprobs(ref_model, batch, args.temperature, accelerator, len(batch),
                                                       args.micro_batch_size)
            times["reference"], peaks["reference"] = time.time(), phase_peak_gb(held)
            rewards = torch.randint(0, 2, (len(samples),), generator=generator).float().to(accelerator.device)
            batch.advantages = grpo.compute_advantages(rewards, args)[:, None] * batch.mask
            if step == opts.steps:  # the resume check's starting point: a checkpoint before the last update
                save_checkpoint(accelerator, model, tokenizer, run_dir, step - 1)
                checkpoint = os.path.join(run_dir, "checkpoint")
            stats, _ = grpo.update_policy(step_args, model, optimizer, batch, accelerator)
            times["train"], peaks["train"] = time.time(), phase_peak_gb(held)
            tokens = int(batch.mask.sum().item())
            steps.append({"step": step, "sleep_level": sleep_level if engine.asleep else None, "beta": beta,
                          "rollout_s": times["rollout"] - times["start"], "weight_sync_s": sync_time,
                          "reference_s": times["reference"] - times["rollout"],
                          "train_s": times["train"] - times["reference"], "step_s": times["train"] - times["start"],
                          "tokens": tokens, "tokens_per_s": tokens / (times["rollout"] - times["start"]),
                          "truncated_frac": sum(t for *_, t in samples) / len(samples),
                          "logprob_gap_mean": float(stats.sums["rollout/logprob_gap_mean"]),
                          "logprob_gap_max": float(stats.maxes["rollout/logprob_gap_max"]),
                          "loss": float(stats.sums["losses/policy"]),
                          "grad_norm": float(stats.means["policy/grad_norm"]),
                          **{f"peak_{phase}_gb": gb for phase, gb in peaks.items()}})
        load_checkpoint(accelerator, checkpoint)  # the last update again, from the checkpoint before it
        again, _ = grpo.update_policy(step_args, model, optimizer, batch, accelerator)
        loss, grad_norm = float(again.sums["losses/policy"]), float(again.means["policy/grad_norm"])
        result["resume"] = {"loss": loss, "grad_norm": grad_norm,
                            "equal": same_update((loss, grad_norm), (steps[-1]["loss"], steps[-1]["grad_norm"]))}
    result["steps"] = steps
    later = steps[1:] or steps  # the first step pays compilation and allocator warm-up
    result["median"] = {k: statistics.median(s[k] for s in later) for k in
                        ("rollout_s", "weight_sync_s", "reference_s", "train_s", "step_s", "tokens_per_s",
                         "logprob_gap_mean")}
    trained = [s["peak_train_gb"] for s in steps if s["peak_train_gb"] is not None]
    result["trainer_peak_gb"] = max(trained) if trained else None  # against trainer_estimate_gb
    engine.llm = None
    return result


def run_tail(engine_name, opts, model_dir):
    """grpo.py's synchronous rollout against grpo_async.py's partial rollouts on the same long-tailed lengths."""
    import math

    from accelerate import Accelerator

    on_gpu = torch.cuda.is_available()
    run = RunArgs(engine=engine_name, eval_every=0, vllm_gpu_memory_utilization=opts.gpu_memory_utilization)
    args = grpo_async.resolve_args(grpo_async.Args(model=model_dir, task="toy", max_new_tokens=opts.new_tokens,
                                                   max_prompt_length=opts.prompt_len, num_generations=opts.generations,
                                                   prompts_per_step=opts.prompts,
                                                   micro_batch_size=opts.micro_batch_size, run=run), 1)
    accelerator = Accelerator(cpu=not on_gpu, mixed_precision="bf16" if on_gpu else "no")
    tokenizer, _ = load_tokenizer(args.model)
    model = accelerator.prepare(load_model(args.model, tokenizer).eval())
    vocab = SHAPES[opts.shape]["vocab_size"]
    stop_ids = list(range(3, 3 + max(1, round(opts.stop_frac * vocab))))  # not the special ids 0-2
    engine = create_engine(args.run, args.model, args.seed, args.max_prompt_length + args.max_new_tokens, stop_ids)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)  # the HF engine's sampling
    G, need, result = opts.generations, opts.prompts, {"engine": engine_name, "shape": opts.shape,
                                                       "device": torch.cuda.get_device_name() if on_gpu else "cpu"}
    for mode, overprovision in (("sync", 1.0), ("async", opts.overprovision)):
        carry, steps = [], []
        for step in range(1, opts.steps + 1):
            carry = [group for group in carry if step - 1 - group["version"] <= 1]  # --max_staleness 1
            new = math.ceil(overprovision * need) - len(carry)
            carry += [{"version": step - 1, "prompt": torch.randint(3, vocab, (opts.prompt_len,), generator=generator)
                       .tolist(), "completions": [{"token_ids": [], "logprobs": [], "versions": [], "finished": False,
                                                   "truncated": False} for _ in range(G)]} for _ in range(new)]
            prompts = [group["prompt"] for group in carry]
            before = sum(len(c["token_ids"]) for group in carry for c in group["completions"])
            start = time.time()
            if mode == "sync":  # grpo.py's rollout: every group to its end, each prompt's G completions together
                samples, _ = grpo.generate(engine, model, tokenizer, prompts, G, 1.0, 1.0, opts.new_tokens,
                                           accelerator, policy_version=0)
                for completion, sample in zip([c for group in carry for c in group["completions"]], samples):
                    completion.update(token_ids=sample.token_ids, finished=True)
                calls = max(len(sample.token_ids) for sample in samples)
            else:
                whole = sum(all(c["finished"] for c in group["completions"]) for group in carry)
                _, calls = grpo_async.generate_partial(engine, model, tokenizer, carry, prompts, max(0, need - whole),
                                                       1.0, 1.0, opts.new_tokens, accelerator, policy_version=0)
            if on_gpu:
                torch.cuda.synchronize()
            seconds = time.time() - start
            complete = [group for group in carry if all(c["finished"] for c in group["completions"])]
            chosen = sorted(complete, key=lambda group: group["version"])[:need]
            carry = [group for group in carry if not any(group is c for c in chosen)]
            trained = [len(c["token_ids"]) for group in chosen for c in group["completions"]]
            steps.append({"rollout_s": seconds, "decode_calls": calls, "trained_tokens": sum(trained),
                          "generated_tokens": sum(len(c["token_ids"]) for group in chosen + carry
                                                  for c in group["completions"]) - before,
                          "longest": max(trained), "mean_length": sum(trained) / len(trained)})
        later = steps[2:] or steps  # the first steps fill the carry (and pay warm-up)
        result[mode] = {"steps": steps, **{k: statistics.median(s[k] for s in later) for k in steps[0]}}
    result["rollout_ratio"] = result["async"]["rollout_s"] / result["sync"]["rollout_s"]
    engine.llm = None
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (x --generations sequences)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=32)
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sleep_levels", nargs="+", type=int, default=[2, 1], choices=[1, 2],
                        help="the steps cycle through these vLLM sleep levels (a GPU's sleep mode)")
    parser.add_argument("--betas", nargs="+", type=float, default=[0.04, 0.0],
                        help="then through these betas (0: no reference pass, no KL term)")
    parser.add_argument("--fsdp", action="store_true", help="also run each engine under FSDP2 with one process "
                        "(accelerate launch --config_file configs/fsdp2.yaml)")
    parser.add_argument("--lora_rank", type=int, default=0, help="train LoRA adapters of this rank (0: the whole "
                        "model); with --fsdp, under FSDP2 too (its checkpoint: the adapters alone)")
    parser.add_argument("--self_check", action="store_true", help="then run `grpo.py --self_check` (the embedded "
                        "model's default run, its engine vLLM where installed), its table in the report")
    parser.add_argument("--self_check_flags", default="", help="--self_check: grpo.py's flags, one string")
    parser.add_argument("--tail", action="store_true", help="time grpo.py's rollout against grpo_async.py's")
    parser.add_argument("--stop_frac", type=float, default=1 / 64, help="--tail: the vocabulary fraction that stops")
    parser.add_argument("--overprovision", type=float, default=1.5, help="--tail: grpo_async.py's groups in flight")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_step.jsonl"))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    quiet_libraries()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the H200 wheel set
    results = []
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)

    def keep(r):  # each engine's result is written as it ends: a later failure (FSDP2's launch) loses none of them
        results.append(r)
        with open(opts.out, "a") as f:
            f.write(json.dumps({"shape": opts.shape, **vars(opts), **r}) + "\n")

    with tempfile.TemporaryDirectory() as model_dir:
        build_model(opts.shape, model_dir)
        for engine_name in opts.engines:
            keep((run_tail if opts.tail else run_engine)(engine_name, opts, model_dir))
    if opts.fsdp and not opts.tail:
        for r in under_fsdp2(opts):
            keep(r)
    checked = self_check(shlex.split(opts.self_check_flags)) if opts.self_check and not opts.tail else None
    if opts.tail:
        print("| engine | device | rollout s sync | async | ratio | decode calls sync | async | trained tokens sync | "
              "async |\n|" + "---|" * 9)
        for r in results:
            s, a = r["sync"], r["async"]
            print(f"| {r['engine']} | {r['device']} | {s['rollout_s']:.2f} | {a['rollout_s']:.2f} | "
                  f"{r['rollout_ratio']:.2f}x | {s['decode_calls']:.0f} | {a['decode_calls']:.0f} | "
                  f"{s['trained_tokens']:.0f} | {a['trained_tokens']:.0f} |")
        return results
    lines = [f"`python benchmarks/gpu_step.py {' '.join(sys.argv[1:])}`", "",
             "| engine | FSDP2 | LoRA rank | device | step s | rollout s | weight sync s | reference s | train s | "
             "tokens/s | gap mean | engine start s | engine GB (left out) | trainer peak / estimate GB | resume "
             "same |", "|" + "---|" * 15]
    for r in results:
        m = r["median"]
        peak = "-" if r["trainer_peak_gb"] is None else f"{r['trainer_peak_gb']:.2f}"
        lines.append(f"| {r['engine']} | {r['fsdp2']} | {r['lora_rank']} | {r['device']} | {m['step_s']:.2f} | "
                     f"{m['rollout_s']:.2f} | {m['weight_sync_s']:.3f} | {m['reference_s']:.2f} | "
                     f"{m['train_s']:.2f} | {m['tokens_per_s']:.0f} | {m['logprob_gap_mean']:.2e} | "
                     f"{r['engine_start_s']:.1f} | {r['engine_cuda_gb']:.2f} | {peak} / "
                     f"{r['trainer_estimate_gb']:.2f} | {r['resume']['equal']} |")
    if checked is not None:
        lines += ["", f"`grpo.py --self_check {opts.self_check_flags}`: exit code {checked['returncode']}", "",
                  *checked["table"]]
    print("\n".join(lines))
    with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:  # the report: both tables
        f.write("\n".join(lines) + "\n")
    return results


def self_check(flags):
    """grpo.py --self_check with `flags`, in a temporary folder -> {"returncode", "table": the report's lines}."""
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), "--self_check", "--output_dir", folder,
                               *flags], cwd=ROOT, capture_output=True, text=True)
        table = [line for line in proc.stdout.splitlines() if line.startswith(("|", "self-check"))]
        if proc.returncode and not table:
            table = [f"self-check: {(proc.stderr.strip().splitlines() or [''])[-1]}"]
    return {"returncode": proc.returncode, "table": table}


def under_fsdp2(opts):
    """The same steps under FSDP2 with one process, each engine in its own launch of this script: yields each
    launch's results as it ends."""
    for engine_name in opts.engines:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "fsdp2.jsonl")
            argv = [a for a in sys.argv[1:] if a not in ("--fsdp", "--self_check")]  # the self-check: the first's
            if "--self_check_flags" in argv:  # one value, which may start with "--"
                del argv[argv.index("--self_check_flags"):argv.index("--self_check_flags") + 2]
            for flag in ("--engines", "--out"):  # this launch's own
                if flag in argv:
                    i = argv.index(flag)
                    j = next((k for k in range(i + 1, len(argv)) if argv[k].startswith("--")), len(argv))
                    del argv[i:j]
            subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            os.path.join(ROOT, "configs", "fsdp2.yaml"), "--num_processes", "1", "--num_machines",
                            "1", "--mixed_precision", "bf16" if torch.cuda.is_available() else "no",
                            "--dynamo_backend", "no", os.path.abspath(__file__), *argv, "--engines", engine_name,
                            "--out", out], check=True)
            yield from (json.loads(line) for line in open(out))


if __name__ == "__main__":
    main()
