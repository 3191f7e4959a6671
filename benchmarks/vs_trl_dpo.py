"""dpo.py against TRL 1.16's DPOTrainer on the same preference pairs: the median seconds of an optimizer step, each
side run alone, the sides alternating, with the same settings (pairs per step, learning rate, beta 0.1, sigmoid loss,
float32 on the CPU, no gradient checkpointing, the reference's log-probs computed every step on both sides).

    python benchmarks/vs_trl_dpo.py                                # the embedded model, tests/data/toy_pairs.jsonl
    python benchmarks/vs_trl_dpo.py --real --name vs_trl_dpo_smollm2   # SmolLM2-135M-Instruct, rg:chain_sum pairs
    python benchmarks/vs_trl_dpo.py --steps 3 --rounds 1 --out /tmp/x  # a check in a minute

The toy's pairs are the shipped file's (plain rows: the embedded model has no chat template, so both sides see the
raw prompt). The real model's are written by this script: reasoning-gym chain_sum problems, conversational rows (a
user turn asking for a boxed answer; chosen the boxed gold answer, rejected a wrong one), so that both sides apply
the model's chat template. Each round runs dpo.py (`--data file`), then TRL (the order alternating between rounds);
per run, the median of time/step over the steps after the first (dpo.py's metrics.jsonl; TRL: a callback timing each
optimizer step, from its start to its end, as dpo.py's time/step does). Writes benchmarks/results/<name>.md."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOY_PAIRS = os.path.join(ROOT, "tests", "data", "toy_pairs.jsonl")
REAL_TASK = "rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=1"


def write_real_pairs(path, count):
    """`count` conversational pairs of the real-model task: the boxed gold answer over a boxed wrong one."""
    from utils.tasks import USER_INSTRUCTIONS, rg_rows

    entries, _ = rg_rows(REAL_TASK, "train")
    with open(path, "w") as f:
        for entry in entries[:count]:
            gold = str(entry["answer"])
            question = f"{entry['question'].rstrip()}\n{USER_INSTRUCTIONS['boxed'].replace('ANSWER', 'the answer')}"
            chosen, rejected = (f"The answer is \\boxed{{{answer}}}." for answer in (gold, int(gold) + 1))
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                "chosen": [{"role": "assistant", "content": chosen}],
                                "rejected": [{"role": "assistant", "content": rejected}]}) + "\n")


def dpo_side(model, pairs, steps, pairs_per_step, learning_rate, threads, out_dir):
    """dpo.py on the pairs -> its time/step per step."""
    name = "dpo"
    subprocess.run([sys.executable, os.path.join(ROOT, "dpo.py"), "--model", model, "--data", "file", "--pairs", pairs,
                    "--prompts_per_step", str(pairs_per_step), "--total_steps", str(steps), "--learning_rate",
                    str(learning_rate), "--threads", str(threads), "--gradient_checkpointing", "off", "--eval_every",
                    "0", "--save_every", "0", "--kl_prompts", "0", "--log_completions_every", "0", "--max_new_tokens",
                    "64", "--output_dir", out_dir, "--exp_name", name], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, f"{name}__1", "metrics.jsonl")) as f:
        return [json.loads(line)["time/step"] for line in f]


def trl_side(model, pairs, steps, pairs_per_step, learning_rate, threads, out_dir):
    """TRL's DPOTrainer on the pairs, in this process (run as a subprocess of the main invocation) -> seconds of each
    optimizer step."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from plumbing.models import resolve_model

    torch.set_num_threads(threads)
    model = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    config = DPOConfig(output_dir=out_dir, beta=0.1, per_device_train_batch_size=pairs_per_step, max_steps=steps,
                       learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                       optim="adamw_torch", max_grad_norm=1.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
                       max_length=None, report_to="none", save_strategy="no", logging_strategy="no",
                       disable_tqdm=True, dataloader_num_workers=0, seed=1)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=config, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_json(pairs), callbacks=[Timer()])
    trainer.train()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct and chain_sum pairs")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs_per_step", type=int, default=None, help="default: 32 (toy), 8 (real)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default=None, help="default: vs_trl_dpo_toy or vs_trl_dpo_smollm2")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: one TRL run, its times out
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    per_step = args.pairs_per_step or (8 if args.real else 32)
    learning_rate = 1e-6 if args.real else 5e-4
    if args.side == "trl":
        print(json.dumps(trl_side(args.model, args.pairs, args.steps, per_step, learning_rate, args.threads,
                                  args.run_dir)))
        return
    from utils.tasks import TOY_MODEL_DIR

    name = args.name or ("vs_trl_dpo_smollm2" if args.real else "vs_trl_dpo_toy")
    work = os.path.join(ROOT, "runs", "benchmarks", name)
    os.makedirs(work, exist_ok=True)
    model = "smollm2-135m" if args.real else TOY_MODEL_DIR
    pairs = TOY_PAIRS
    if args.real:
        pairs = os.path.join(work, "pairs.jsonl")
        write_real_pairs(pairs, per_step * (args.steps + 1))
    rows = []
    for round_ in range(args.rounds):
        for side in (("dpo", "trl") if round_ % 2 == 0 else ("trl", "dpo")):
            run_dir = os.path.join(work, f"{side}_{round_}")
            shutil.rmtree(run_dir, ignore_errors=True)  # a rerun measures afresh (dpo.py refuses a used folder)
            if side == "dpo":
                times = dpo_side(model, pairs, args.steps, per_step, learning_rate, args.threads, run_dir)
            else:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--side", "trl", "--model", model,
                                      "--pairs", pairs, "--steps", str(args.steps), "--pairs_per_step", str(per_step),
                                      "--threads", str(args.threads), "--run_dir", run_dir, *(["--real"] if args.real
                                                                                              else [])],
                                     check=True, cwd=ROOT, capture_output=True, text=True).stdout
                times = json.loads(out.strip().splitlines()[-1])
            rows.append({"side": side, "round": round_ + 1, "median_s": statistics.median(times[1:] or times),
                         "steps": len(times)})
    medians = {side: statistics.median(r["median_s"] for r in rows if r["side"] == side) for side in ("dpo", "trl")}
    command = f"python benchmarks/vs_trl_dpo.py{' --real' if args.real else ''} --steps {args.steps} --rounds " \
              f"{args.rounds} --pairs_per_step {per_step} --threads {args.threads} --name {name}"
    lines = [f"# {name}", "", f"Command: `{command}`; {'SmolLM2-135M-Instruct' if args.real else 'the embedded model'},"
             f" {per_step} pairs a step, {args.threads} threads, runs one at a time, the sides alternating; 1-min "
             f"load average at the end {os.getloadavg()[0]:.2f}.", "",
             "| side | round | median s a step (after the first) | steps |", "|---|---|---|---|"]
    lines += [f"| {'dpo.py' if r['side'] == 'dpo' else 'TRL DPOTrainer'} | {r['round']} | {r['median_s']:.4f} | "
              f"{r['steps']} |" for r in rows]
    lines += ["", f"Median over rounds: dpo.py {medians['dpo']:.4f} s, TRL {medians['trl']:.4f} s; dpo.py / TRL "
              f"{medians['dpo'] / medians['trl']:.2f}x."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
