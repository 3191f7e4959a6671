"""grpo.py against TRL's GRPOTrainer, on the embedded toy task or a real model: the same prompts per step, rewards and
settings.

    (trl==1.16.0 is in the project's lock; elsewhere: pip install -r benchmarks/requirements.txt)
    python benchmarks/vs_trl.py                       # toy: 3 seeds x 250 steps, the sides alternating, one at a time
    python benchmarks/vs_trl.py --seeds 1 --steps 20 --name vs_trl_smoke
    python benchmarks/vs_trl.py --pool vs_trl vs_trl_repeat  # medians over the runs of several invocations together
    python benchmarks/vs_trl.py --real --seeds 1 2 3 --steps 30 --keep_runs --name vs_trl_smollm2  # SmolLM2-135M

Each seed runs `python grpo.py` and TRL 1.16's GRPOTrainer (this file with --side trl) in subprocesses, one at a time,
alternating which side goes first. TRL gets a dataset listing, step after step, exactly the prompts grpo.py draws at
that step (np.random.default_rng([seed, step])), with shuffling off, so both sides train on the same prompts in the
same order; both score with utils/rewards.py (accuracy + 0.1 x format). settings() below is the field-by-field
mapping, with what cannot be matched. --real runs both on benchmarks/real_model.py's model, task and sizes
(SmolLM2-135M-Instruct, 4 prompts x 8, 64 new tokens, lr 1e-5, 2 threads) with reward levels for that task.
Writes benchmarks/results/<name>.md and .png: median step time, training seconds until the 10-step moving-average
reward reaches each level (sum of step times: start-up, logging, checkpoints excluded on both sides), their ratios
(medians over seeds), and reward over wall time.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_model import MODEL_TASK  # noqa: E402
from toy_runs import pyplot, results_dir, seconds_to, step_reaching, write_results  # noqa: E402

TOY_LEVELS, REAL_LEVELS = [0.7, 0.8, 0.9], [0.1, 0.15, 0.2]  # reward (10-step moving average) levels to time
GRPO_FLAGS = ["--adv_eps", "1e-4", "--eval_every", "0", "--save_every", "0", "--log_completions_every", "0"]


def grpo_args(seed, flags):
    """grpo.py's Args for these flags, resolved as grpo.py resolves them: the one source of both sides' settings."""
    import tyro

    from grpo import Args, resolve_args

    return resolve_args(tyro.cli(Args, args=["--seed", str(seed), *flags]), 1)


def settings(a):
    """(what, grpo.py, TRL GRPOConfig) for grpo.py's resolved Args a: how each side is set, and what cannot match."""
    batch = a.prompts_per_step * a.num_generations
    return [
        ("model", f"{a.model}, float32", "the same folder, model_init_kwargs dtype float32, bf16=False"),
        ("task", f"{a.task}, prompts as grpo.py builds them (--instruction {a.instruction})", "the same prompt texts"),
        ("prompts per step x G", f"{a.prompts_per_step} x {a.num_generations}", f"per_device_train_batch_size {batch}, "
         f"num_generations {a.num_generations}, steps_per_generation 1, gradient_accumulation_steps 1"),
        ("prompt order", f"rng([seed, step]) picks {a.prompts_per_step} train rows", "a dataset listing those rows "
         "step by step, shuffle_dataset=False"),
        ("updates per rollout", "num_epochs 1 x num_minibatches 1", "num_iterations 1 (pi_old = detached pi_theta)"),
        ("optimizer", f"AdamW lr {a.learning_rate:g}, betas (0.9, 0.999), eps 1e-8, wd 0",
         "optim adamw_torch, the same numbers"),
        ("schedule", "constant", "lr_scheduler_type constant, warmup 0"),
        ("gradient clipping", f"max_grad_norm {a.max_grad_norm:g}", f"max_grad_norm {a.max_grad_norm:g}"),
        ("KL", f"beta {a.beta:g}, k3 in the loss", f"beta {a.beta:g}, use_bias_correction_kl=False (k3; True is "
         "k3_is's gradient)"),
        ("clipping", f"clip_eps {a.clip_eps:g}", f"epsilon {a.clip_eps:g}, epsilon_high {a.clip_eps:g}"),
        ("loss aggregation", "per-completion token mean, then the mean", "loss_type grpo"),
        ("advantages", "group z-score, unbiased std, --adv_eps 1e-4", "scale_rewards group (unbiased std + 1e-4, "
         "fixed)"),
        ("reward", f"accuracy + {a.format_reward_weight:g} format (utils/rewards.py)", "two reward functions over the "
         f"same scorer, reward_weights [1.0, {a.format_reward_weight:g}]"),
        ("sampling", f"T {a.temperature:g}, top-p {a.top_p:g}, no top-k, {a.max_new_tokens} new tokens, stop at the "
         "tokenizer's and the generation config's EOS", f"temperature {a.temperature:g}, top_p {a.top_p:g}, top_k 0, "
         f"max_completion_length {a.max_new_tokens}, the same stop tokens"),
        ("engine", f"--engine {a.run.engine}", "HF generate (use_vllm=False)"),
        ("threads", f"--threads {a.run.threads}",
         f"torch.set_num_threads({a.run.threads}) before the trainer is built"),
        ("glibc's mmap threshold", f"--malloc_mmap_threshold {a.run.malloc_mmap_threshold}",
         f"set_mmap_threshold({a.run.malloc_mmap_threshold}) (plumbing/run.py) before the trainer is built"),
        ("not matched: speed knobs", f"policy/reference passes in micro-batches of {a.micro_batch_size} sorted by "
         "length (the same update); its own decode loop", f"one pass of {batch} padded to the longest; "
         "transformers' generate()"),
        ("not matched: randomness", "its sampling stream", "its own (the same prompts, different samples)"),
        ("not matched: scoring", "a thread, overlapping the reference pass", "reward functions called inline"),
    ]


def trl_side(seed, steps, out_dir, flags):
    """One TRL run, logging {step, charts/reward, time/step} per step to <out_dir>/trl__<seed>/metrics.jsonl."""
    import torch

    from plumbing.run import set_mmap_threshold

    args = grpo_args(seed, flags)
    torch.set_num_threads(args.run.threads)
    set_mmap_threshold(args.run.malloc_mmap_threshold)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from utils.rewards import RewardScorer
    from utils.tasks import load_splits

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_rows, _, _ = load_splits(args.task, tokenizer, args.answer_format, args.instruction, args.max_prompt_length,
                                   args.run.eval_size, args.prompts_per_step, 0)
    rows = []
    for step in range(1, steps + 1):  # exactly grpo.py's draw
        picks = np.random.default_rng([args.seed, step]).choice(len(train_rows), args.prompts_per_step, replace=False)
        rows += [{"prompt": train_rows[i]["prompt"], "row": int(i)} for i in picks]  # the row: gold (and a
        # reasoning-gym task's entry for its verifier) as grpo.py's scorer reads it
    scorer, last = RewardScorer(args.task, args.answer_format), {}

    def scored(completions, row):  # TRL calls both reward functions on the same completions: score them once
        if last.get("key") != (completions, row):
            last.update(key=(list(completions), list(row)),
                        value=scorer.result(scorer.submit(completions, [train_rows[i] for i in row])))
        return last["value"]

    def accuracy(completions, row, **kwargs):
        return scored(completions, row)[0]

    def answer_format(completions, row, **kwargs):
        return scored(completions, row)[1]

    run_dir = os.path.join(out_dir, f"trl__{seed}")
    os.makedirs(run_dir, exist_ok=True)
    config = GRPOConfig(
        output_dir=run_dir, seed=seed, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        model_init_kwargs={"dtype": torch.float32}, max_steps=steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        gradient_accumulation_steps=1, num_generations=args.num_generations, steps_per_generation=1,
        num_iterations=1, shuffle_dataset=False, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
        max_grad_norm=args.max_grad_norm, beta=args.beta, use_bias_correction_kl=False, epsilon=args.clip_eps,
        epsilon_high=args.clip_eps, loss_type="grpo", scale_rewards="group",
        reward_weights=[1.0, args.format_reward_weight], temperature=args.temperature, top_p=args.top_p, top_k=0,
        max_completion_length=args.max_new_tokens, use_vllm=False, logging_steps=1, save_strategy="no",
        eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False)

    class Record(TrainerCallback):
        def __init__(self):
            self.start, self.times, self.file = None, {}, open(os.path.join(run_dir, "metrics.jsonl"), "w")

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # before the step's logging, like grpo.py's time/step
            self.times[state.global_step] = time.perf_counter() - self.start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.file.write(json.dumps({"step": state.global_step, "charts/reward": logs["reward"],
                                            "time/step": self.times[state.global_step]}) + "\n")
                self.file.flush()

    trainer = GRPOTrainer(model=args.model, reward_funcs=[accuracy, answer_format], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Record()])
    trainer.train()


def median(values):
    """Median where a run that never got there (None) counts as infinitely slow; None if the median is one of them."""
    middle = float(np.median([np.inf if v is None else v for v in values]))
    return None if np.isinf(middle) else middle


def pool(names, seeds, levels):
    """Print the medians over the finished runs of several invocations together (runs/benchmarks/<name>/<side>__<seed>),
    per side, and their ratio: repeated runs of the same seeds average out the machine's drift between runs."""
    medians = {}
    for side in ("grpo", "trl"):
        runs = [[json.loads(line) for line in open(os.path.join(ROOT, "runs", "benchmarks", name, f"{side}__{seed}",
                                                                 "metrics.jsonl"))] for name in names for seed in seeds]
        medians[side] = [median([np.median([r["time/step"] for r in rows]) for rows in runs]),
                         *(median([seconds_to(rows, level) for rows in runs]) for level in levels)]
        print(f"{side}: {len(runs)} runs, median step {medians[side][0]:.3f} s, "
              + ", ".join(f"s to {level} {'never' if t is None else f'{t:.1f}'}" for level, t in zip(levels,
                                                                                               medians[side][1:])))
    print("grpo / trl: " + ", ".join(f"{what} {g / t:.3f}x" if g and t else f"{what} n/a" for what, g, t in zip(
        ["median step", *(f"s to {level}" for level in levels)], *medians.values())))


def cpu_name():
    """The CPU's model name and its widest vector extension: step times of runs on different CPUs do not compare."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return f"{name}, " + next((ext for flag, ext in [("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")]
                               if flag in flags), "no AVX2")


def run_side(side, seed, steps, out_dir, reuse, real, kept):
    """One side's run of one seed, or (reuse) the finished run of the same command in out_dir or in `kept`, the folder
    where --keep_runs copies each finished run's metrics and benchmark.json (a table of several invocations' runs)."""
    run_dir = os.path.join(out_dir, f"{side}__{seed}")
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--exp_name", "grpo", "--seed", str(seed), "--total_steps",
           str(steps), "--output_dir", out_dir, *GRPO_FLAGS, *(MODEL_TASK if real else [])] if side == "grpo" else [
        sys.executable, os.path.abspath(__file__), "--side", "trl", "--seeds", str(seed), "--steps", str(steps),
        "--out_dir", out_dir, *(["--real"] if real else [])]

    def in_root(args):  # a command without its interpreter, with paths in this checkout relative to it
        return [os.path.relpath(a, ROOT) if a.startswith(ROOT + os.sep) else a for a in args[1:]]

    def finished(folder):  # a finished run of this command
        done = os.path.join(folder, "benchmark.json")
        return os.path.exists(done) and in_root(json.load(open(done))["cmd"]) == in_root(cmd)

    kept_dir = kept and os.path.join(kept, f"{side}__{seed}")
    if reuse and not finished(run_dir) and kept_dir and finished(kept_dir):
        run_dir = kept_dir
    elif not (reuse and finished(run_dir)):
        shutil.rmtree(run_dir, ignore_errors=True)
        start = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(run_dir, "benchmark.json"), "w") as f:
            json.dump({"cmd": cmd, "wall_s": time.time() - start, "loadavg_1min": os.getloadavg()[0],
                       "cpu": cpu_name()}, f)
    if kept_dir and run_dir != kept_dir:
        os.makedirs(kept_dir, exist_ok=True)
        for name in ("metrics.jsonl", "benchmark.json"):
            shutil.copy(os.path.join(run_dir, name), kept_dir)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"side": side, "seed": seed, "rows": rows, "cpu": "?", **json.load(open(os.path.join(run_dir,
                                                                                               "benchmark.json")))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=250, help="250: on the toy TRL's runs reach 0.9 at step 150-200 "
                        "or later")
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct on rg:chain_sum (benchmarks/"
                        "real_model.py's settings), reward levels 0.1, 0.15, 0.2")
    parser.add_argument("--name", default="vs_trl", help="results file name")
    parser.add_argument("--out_dir", default=None, help="default: runs/benchmarks/<name>")
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same command (from --out_dir, "
                        "else from the --keep_runs copies)")
    parser.add_argument("--keep_runs", action="store_true", help="copy each finished run's metrics.jsonl and "
                        "benchmark.json to benchmarks/results/<name>_runs/<side>__<seed>/, where --reuse finds them: "
                        "a table of runs made by several invocations (--real's runs take hours)")
    parser.add_argument("--pool", nargs="+", metavar="NAME", help="print the medians over the finished runs of these "
                        "names' invocations together (with --seeds), and exit")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: one TRL run
    args = parser.parse_args()
    levels = REAL_LEVELS if args.real else TOY_LEVELS
    flags = [*GRPO_FLAGS, *(MODEL_TASK if args.real else [])]
    if args.pool:
        return pool(args.pool, args.seeds, levels)
    out_dir = args.out_dir or os.path.join(ROOT, "runs", "benchmarks", args.name)
    if args.side == "trl":
        return trl_side(args.seeds[0], args.steps, out_dir, flags)

    results = []
    for i, seed in enumerate(args.seeds):  # one run at a time; the side that goes first alternates
        for side in (("grpo", "trl") if i % 2 == 0 else ("trl", "grpo")):
            results.append(run_side(side, seed, args.steps, out_dir, args.reuse, args.real,
                                    args.keep_runs and os.path.join(results_dir(), f"{args.name}_runs")))
            print(f"{side} seed {seed}: {results[-1]['wall_s']:.0f} s", flush=True)

    def per_seed(side, fn):
        return [fn(r["rows"]) for r in results if r["side"] == side]

    summary = {side: {"step_s": median(per_seed(side, lambda rows: np.median([r["time/step"] for r in rows]))),
                      "reward_first5": median(per_seed(side, lambda rows: np.mean(
                          [r["charts/reward"] for r in rows[:5]]))),
                      "reward_last5": median(per_seed(side, lambda rows: np.mean(
                          [r["charts/reward"] for r in rows[-5:]]))),
                      "step_at": median(per_seed(side, lambda rows: step_reaching(rows, levels[-1]))),
                      **{level: median(per_seed(side, lambda rows: seconds_to(rows, level))) for level in levels}}
               for side in ("grpo", "trl")}
    loads, cpus = [r["loadavg_1min"] for r in results], {r["cpu"]: [] for r in results}
    for r in results:
        cpus[r["cpu"]].append(f"{r['side']} {r['seed']}")
    lines = [f"# {args.name}", "", f"Command: `python benchmarks/vs_trl.py --seeds {' '.join(map(str, args.seeds))} "
             f"--steps {args.steps}{' --real' * args.real} --name {args.name}`; runs one at a time, 1-min load "
             f"average at the end of each run {min(loads):.2f}-{max(loads):.2f}; CPU: "
             + "; ".join(f"{cpu} ({', '.join(runs)})" for cpu, runs in cpus.items()) + ".", "",
             "| side | seed | reward first 5 | reward last 5 | median step s | "
             + " | ".join(f"s to {level}" for level in levels) + f" | step at {levels[-1]} | wall s |",
             "|" + "---|" * (7 + len(levels))]
    for r in results:
        rows = r["rows"]
        to = [seconds_to(rows, level) for level in levels]
        lines.append(f"| {r['side']} | {r['seed']} | {np.mean([x['charts/reward'] for x in rows[:5]]):.3f} | "
                     f"{np.mean([x['charts/reward'] for x in rows[-5:]]):.3f} | "
                     f"{np.median([x['time/step'] for x in rows]):.3f} | "
                     + " | ".join("never" if t is None else f"{t:.0f}" for t in to)
                     + f" | {step_reaching(rows, levels[-1]) or 'never'} | {r['wall_s']:.0f} |")
    lines += ["", "Medians over seeds (a seed that never reached a level counts as slowest), and grpo.py / TRL:", "",
              "| | median step s | " + " | ".join(f"s to {level}" for level in levels) + f" | step at {levels[-1]} |",
              "|" + "---|" * (3 + len(levels))]
    for side in ("grpo", "trl"):
        lines.append(f"| {side} | {summary[side]['step_s']:.3f} | " + " | ".join(
            "never" if summary[side][key] is None else f"{summary[side][key]:.0f}" for key in [*levels, "step_at"])
            + " |")
    ratio = lambda key: "n/a" if not (summary["grpo"][key] and summary["trl"][key]) else (  # noqa: E731
        f"{summary['grpo'][key] / summary['trl'][key]:.2f}x")
    lines.append("| grpo / trl | " + " | ".join(ratio(key) for key in ["step_s", *levels, "step_at"]) + " |")
    lines += ["", "Settings, field by field:", "", "| | grpo.py | TRL 1.16 GRPOConfig |", "|---|---|---|"]
    lines += [f"| {what} | {ours} | {theirs} |" for what, ours, theirs in settings(grpo_args(args.seeds[0], flags))]
    path = write_results(args.name, lines)
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_step, ax_wall) = plt.subplots(1, 2, figsize=(12, 4))
    for r in results:
        color = "C0" if r["side"] == "grpo" else "C1"
        reward = np.array([x["charts/reward"] for x in r["rows"]])
        if len(reward) < 10:  # no 10-step average to draw
            continue
        smooth = np.convolve(reward, np.ones(10) / 10, mode="valid")
        label = f"{'grpo.py' if r['side'] == 'grpo' else 'TRL GRPOTrainer'}" if r["seed"] == args.seeds[0] else None
        ax_step.plot(np.arange(10, len(reward) + 1), smooth, color=color, label=label, alpha=0.8)
        ax_wall.plot(np.cumsum([x["time/step"] for x in r["rows"]])[9:], smooth, color=color, label=label, alpha=0.8)
    task = "SmolLM2-135M, rg:chain_sum" if args.real else "toy addition"
    ax_step.set(xlabel="step", ylabel="reward, 10-step moving average", title=f"{task}: per step")
    ax_wall.set(xlabel="training seconds (sum of step times)", ylabel="reward, 10-step moving average",
                title="over wall time (one run at a time)")
    ax_wall.axhline(levels[-1], color="gray", lw=0.5)
    ax_step.legend()
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=110)


if __name__ == "__main__":
    main()
