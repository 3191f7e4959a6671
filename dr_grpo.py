"""Dr. GRPO: GRPO Done Right ("Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783, §3.2):
GRPO without its two normalizers, which bias it.

For each prompt q, sample a group of G completions o_1..o_G from pi_old and maximize

  J(theta) = 1/G sum_i sum_t min( r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i ) / L_max

  r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)   the per-token importance ratio
  A_i  = R_i - mean(R_1..R_G)                                   the group-centered reward, not divided by the std
  L_max = max_new_tokens                                         a constant: the generation budget

GRPO's 1/|o_i| gives a short correct answer a larger per-token step than a long one and punishes a long wrong answer
less than a short one, so wrong answers grow longer (length bias); dividing by the group's std up-weights the groups
that are almost all right or almost all wrong (difficulty bias). Dr. GRPO sums each completion's tokens and divides by
the constant L_max (the authors' code: a masked sum over the generation budget, then the batch mean; TRL's
loss_type="dr_grpo"), and only centers the rewards. Worked example (G = 4, format weight 0.1): rewards (1.1, 0, 0, 1.1)
give A = (0.55, -0.55, -0.55, 0.55) (grpo.py: +-0.866); a 10-token and a 40-token completion with the same A get the
same weight per token (grpo.py: 4x more per token for the short one). No KL (the paper: beta 0). The authors' code
also gives a truncated completion reward 0; here it keeps the reward its text earns.

What `diff grpo.py dr_grpo.py` shows: compute_advantages (no std, so no --adv_eps), the loss's normalizer, and beta 0.
"""

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import tyro

from utils.batch import make_batch, micro_batches
from utils.checks import (check_batch_layout, check_fraction, check_lengths, check_model_and_task, check_positive,
                          check_run_args, largest_divisor)
from utils.engine import create_engine
from utils.evaluation import pass_rates
from utils.hf_engine import HFDecoder, Sample
from utils.logprobs import token_logprobs as chunked_token_logprobs
from utils.lora import AdaptersOff
from utils.memory import memory_line, trainer_memory
from utils.models import for_training, load_tokenizer, resolve_model
from utils.parallel import clip_gradients, gradient_sync, make_accelerator, policy_weights, prepare_reference
from utils.rewards import RewardScorer, default_reward_workers
from utils.rl import engine_is_weights, group_centered, kl_k3
from utils.rollout_page import token_recorder
from utils.runs import (RunArgs, StepStats, check_logprob_gap, close_metrics, load_checkpoint, log_step, open_metrics,
                        quiet_libraries, resume_checkpoint, run_name, save_checkpoint, save_model, set_mmap_threshold,
                        step_metrics, write_eval_only)
from utils.selfcheck import self_check
from utils.tasks import TOY_MODEL_DIR, TOY_TASKS, is_toy_shaped, load_splits


@dataclass
class Args:
    # Dr. GRPO
    num_generations: int = 8
    """G, completions per prompt (a group)"""
    clip_eps: float = 0.2
    """the ratio is clipped to [1 - clip_eps, 1 + clip_eps] (it acts only when mu > 1)"""
    beta: float = 0.0
    """coefficient of grpo.py's k3 KL in the loss (the paper: 0); > 0 loads a reference model"""
    # model and task
    model: str = TOY_MODEL_DIR
    """model folder, hub id, .gguf file, or smollm2-135m (SmolLM2-135M-Instruct from pip); default: the embedded toy"""
    task: str = "toy"
    """toy, toy_mul, gsm8k, math, rg:NAME[:key=value,...] (reasoning-gym), or a local .jsonl/.parquet file (or folder
    with train.* and test.*) of {prompt, answer} rows"""
    answer_format: Literal["boxed", "answer_tags"] = "boxed"
    """what the prompt asks for and the reward extracts (the toy tasks always use answer tags)"""
    instruction: Literal["system", "user"] = "system"
    """where the answer-format instruction goes: a system turn, or after the question (small models start better)"""
    format_reward_weight: float = 0.1
    """reward = accuracy + weight * format (one answer in the asked-for form, nothing after it)"""
    max_prompt_length: int = 512
    """prompts longer than this (tokens) are dropped at load time, with a count"""
    max_new_tokens: Optional[int] = None
    """completion length limit; None: 48 for the embedded model (and models trained from it), else 1024"""
    # rollout
    prompts_per_step: int = 32
    """prompts per rollout batch, over all processes; a batch holds prompts_per_step * G completions"""
    temperature: float = 1.0
    """sampling temperature of rollouts; the trainer divides its logits by it too"""
    top_p: float = 1.0
    """nucleus sampling of rollouts (keep 1.0 for an unbiased policy gradient)"""
    # optimization
    learning_rate: Optional[float] = None
    """AdamW learning rate; None: 5e-4 for the embedded model (and models trained from it), else 1e-6"""
    total_steps: int = 200
    """rollout steps"""
    num_epochs: int = 1
    """passes over each rollout batch; mu = num_epochs * num_minibatches optimizer steps per rollout"""
    num_minibatches: int = 1
    """optimizer steps per pass over a rollout batch"""
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward pass (gradient accumulation); None: the largest divisor of a process's
    mini-batch (prompts_per_step / processes * G / num_minibatches) up to 32 for the embedded model, else 16"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    # engine/trainer mismatch
    tis_cap: float = 0.0
    """if > 0, weight the policy gradient by pi_old / pi_engine bounded by this cap (--tis_mode): the engine samples
    with other kernels (vLLM in bf16) than the trainer computes pi_old with"""
    tis_mode: Literal["token-truncate", "token-mask", "seq-truncate", "seq-mask"] = "token-truncate"
    """per token or per sequence (the product of the ratios); truncate at the cap, or mask outside [1/cap, cap]"""
    # experiment
    exp_name: Optional[str] = None
    """the run's name: its folder is <output_dir>/<exp_name>__<seed>; None: the script's name, then (other flags than
    the defaults) the model, the task and a hash of the changed flags"""
    seed: int = 1
    """random seed"""
    run: tyro.conf.OmitArgPrefixes[RunArgs] = field(default_factory=RunArgs)
    """logging, rollout engine, reward workers, evaluation, checkpoints"""


# ---- Algorithm ------------------------------------------------------------------------------------------------------


def check_algorithm_args(args, num_processes):
    """The algorithm's own one-line errors (resolve_args below runs the checks every script shares); num_processes:
    the processes a step's prompts divide over."""
    if args.num_generations < 2:
        raise ValueError(f"--num_generations {args.num_generations}: groups of >= 2 completions are needed (a group of "
                         "one has advantage 0 and learns nothing)")
    if args.beta < 0 or args.clip_eps < 0:
        raise ValueError("--beta and --clip_eps must be >= 0 (--beta 0 turns the KL term off)")


def compute_advantages(rewards, args):
    """rewards (B,), consecutive groups of G = --num_generations -> advantages (B,): A_i = R_i - mean of its group."""
    return group_centered(rewards.view(-1, args.num_generations)).view(-1)


def compute_loss(logp, old_logp, ref_logp, advantages, mask, counts, args):
    """-J(theta) on one micro-batch, as its share of the optimizer mini-batch's loss: summed over the mini-batch's
    micro-batches and processes, the shares give that loss exactly.

    logp (B, T), with gradient; old_logp, ref_logp (None when beta = 0), mask, advantages: (B, T) (A_i on each token
    of completion i). counts = (num_seqs, num_tokens): the completions and tokens of the whole mini-batch, over
    every micro-batch and process. args: the flags of the loss (--clip_eps, --beta, --max_new_tokens: L_max). Returns
    (loss, means: statistics as shares of their mini-batch mean, maxes)."""
    num_seqs, num_tokens = counts
    log_ratio = (logp - old_logp).clamp(-20, 20)  # exp() stays finite: an inf ratio, even masked, makes the loss NaN
    ratio = torch.exp(log_ratio)
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps) * advantages
    per_token = -torch.min(unclipped, clipped)
    if args.beta > 0:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + args.beta * kl
    loss = (per_token * mask).sum() / (num_seqs * args.max_new_tokens)  # sum_t / L_max, then the mean
    with torch.no_grad():
        m = mask.bool()
        means = {"policy/clip_frac": (clipped < unclipped)[m].float().sum() / num_tokens,
                 "policy/ratio_mean": ratio[m].sum() / num_tokens,
                 "policy/approx_kl": (ratio - 1 - log_ratio)[m].sum() / num_tokens}
        if args.beta > 0:
            means["losses/kl"] = kl[m].sum() / num_tokens
    return loss, means, {"policy/ratio_max": ratio[m].max()}  # every completion has at least one token


# ---- Run setup ------------------------------------------------------------------------------------------------------


def resolve_args(args, num_processes):
    """The defaults that depend on the model (each field's doc states its rule), then every check: bad input becomes
    one line that says what to change, before any model loads. A GGUF model is converted here on first use."""
    embedded = is_toy_shaped(args.model)
    if args.learning_rate is None:
        args.learning_rate = 5e-4 if embedded else 1e-6
    if args.max_new_tokens is None:
        args.max_new_tokens = 48 if embedded else 1024
    if args.micro_batch_size is None:
        minibatch = args.prompts_per_step // num_processes * args.num_generations // max(1, args.num_minibatches)
        args.micro_batch_size = largest_divisor(minibatch, 32 if embedded else 16)
    if args.task in TOY_TASKS:
        args.answer_format = "answer_tags"
    check_positive(args, "num_generations", "prompts_per_step", "micro_batch_size", "num_minibatches", "num_epochs",
                   "learning_rate", "max_new_tokens", "max_prompt_length", "temperature", "max_grad_norm")
    check_fraction(args, "top_p")  # (temperature > 0 above: the trainer divides its logits by it; greedy is for eval)
    if 0 < args.tis_cap <= 1:
        raise ValueError(f"--tis_cap {args.tis_cap}: must be > 1 (a bound on pi_old / pi_engine; 0 turns it off)")
    check_run_args(args.run, args.total_steps)
    check_model_and_task(args.model, args.task)
    check_batch_layout(args.prompts_per_step, args.num_generations, args.num_minibatches, args.micro_batch_size,
                       num_processes)
    check_algorithm_args(args, num_processes)
    args.model = resolve_model(args.model)
    return args


def start_run(args):
    """The accelerator, the checked arguments, the run's folder and the checkpoint to resume (None: a new run), the
    tokenizer and its stop tokens, the train and test rows; bad input is a one-line error before any model loads."""
    from accelerate.utils import set_seed

    torch.set_num_threads(args.run.threads)
    set_mmap_threshold(args.run.malloc_mmap_threshold)  # if > 0, glibc hands what tensors free back to the system
    quiet_libraries()
    accelerator = make_accelerator()  # bf16 on a GPU; DDP or FSDP2 (configs/) over GPUs or CPU processes
    script = os.path.splitext(os.path.basename(__file__))[0]
    run_dir = os.path.join(args.run.output_dir, run_name(script, args, args.exp_name, args.model, args.task, args.seed))
    try:
        args = resolve_args(args, accelerator.num_processes)
        check_lengths(args.model, args.max_prompt_length, args.max_new_tokens)  # reads the model's config
        checkpoint = resume_checkpoint(run_dir, args.run)
        tokenizer, stop_ids = load_tokenizer(args.model)
        train_rows, test_rows, summary = load_splits(
            args.task, tokenizer, args.answer_format, args.instruction, args.max_prompt_length, args.run.eval_size,
            0 if args.run.eval_only else args.prompts_per_step,
            accelerator.num_processes if args.run.eval_every or args.run.eval_only else 0)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    accelerator.print(f"{summary}; {accelerator.num_processes} process(es); run folder {run_dir}")
    set_seed(args.seed, device_specific=True)
    return accelerator, args, run_dir, checkpoint, tokenizer, stop_ids, train_rows, test_rows


# ---- Model ----------------------------------------------------------------------------------------------------------


def load_model(model_name, tokenizer):
    """The policy, or the frozen reference, with float32 weights (bf16 autocast on GPU: a 1e-6 update vanishes in bf16
    weights). The reference too: stored in bf16 it would not compute as the policy it starts as (KL > 0 at step 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    model.config.use_cache = False  # training passes build no KV cache (the HF decode loop asks for one itself)
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # saved with final/: generate() there pads with it
    return model


def load_models(args, tokenizer, accelerator, with_reference):
    """The policy and its optimizer over the parameters that train, prepared (DDP or FSDP2), and the frozen reference
    model (None without)."""
    model = for_training(load_model(args.model, tokenizer), args.run, args.model)  # LoRA, gradient checkpointing
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.eval()  # dropout off: the ratio must be exactly 1 on the first mini-batch
    ref_model = None
    if with_reference and not args.run.eval_only:  # frozen: reloaded from --model on resume, never checkpointed;
        # with LoRA the policy itself with its adapters switched off
        ref_model = AdaptersOff(model, accelerator.unwrap_model(model)) if args.run.lora_rank else (
            prepare_reference(accelerator, load_model(args.model, tokenizer)))
    return model, optimizer, ref_model


# ---- Token log-probs ------------------------------------------------------------------------------------------------


def token_logprobs(model, batch, temperature, with_entropy=False):
    """log pi(token) at every completion position, (B, T), from logits divided by the sampling temperature; and the
    entropy of each position's distribution (B, T) with_entropy (else None). The output layer is applied a chunk of
    positions at a time and recomputed in the backward pass (utils/logprobs.py): no (B, T, vocabulary) float32 tensor
    exists, whatever the completion length."""
    return chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature,
                                  with_entropy)


@torch.no_grad()
def batched_logprobs(model, batch, temperature, minibatch_size, micro_batch_size):
    """The trainer's log-probs of a whole rollout batch, (B, T), without gradient (pi_old before the update, pi_ref),
    over the micro-batches of update_policy's first epoch: pi_old equals the first mini-batch's pi_theta bit for bit."""
    logp = torch.zeros_like(batch.mask)
    for minibatch in torch.arange(len(batch), device=logp.device).split(minibatch_size):
        for rows, micro in micro_batches(batch.select(minibatch), micro_batch_size):
            micro_logp, _ = token_logprobs(model, micro, temperature)
            logp[minibatch[rows], :micro_logp.shape[1]] = micro_logp
    return logp


# ---- Rollout engine: vLLM (colocated, sleep mode on GPU) or the HF decode loop --------------------------------------


def push_weights(engine, model, accelerator):
    """Copy the policy's full weights into vLLM, one gathered tensor at a time (FSDP2 DTensors are all-gathered)."""
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model, accelerator)})
    engine.llm.reset_prefix_cache()  # stale prefix-cache entries would serve the old weights' KV


def wake_engine(engine, model, accelerator, policy_version):
    """Before sampling: wake the engine (GPU sleep mode) and push the policy's weights if they lag it (policy_version
    counts the training steps the weights include) -> seconds spent pushing. A caller that makes several engine calls
    of one rollout wakes it once around them (grpo_tools.py's turns): every call then samples from the same weights."""
    sync_time = 0.0
    if engine.llm is None:
        return sync_time
    if engine.asleep:
        torch.cuda.empty_cache()  # the trainer's cached blocks: without this the weights may find no room
        engine.llm.wake_up(tags=["weights"])
    if engine.weights_version != policy_version:  # the first call always pushes; never stale or dropped weights
        start = time.time()
        push_weights(engine, model, accelerator)
        engine.weights_version, sync_time = policy_version, time.time() - start
    if engine.asleep:
        torch.cuda.empty_cache()  # hand the trainer's cached blocks to the KV cache
        engine.llm.wake_up(tags=["kv_cache"])
    return sync_time


def sleep_engine(engine):
    """After sampling: give the GPU memory back to the trainer (a level-2 sleep drops the weights too)."""
    if engine.llm is not None and engine.asleep:
        engine.llm.sleep(level=engine.sleep_level)
        if engine.sleep_level == 2:
            engine.weights_version = None


def generate(engine, model, tokenizer, prompts, n, temperature, top_p, max_new_tokens, accelerator, policy_version):
    """Sample n completions per prompt (token-id lists) -> (n * len(prompts) Samples, seconds spent pushing weights).
    policy_version counts the training steps the policy's weights include: the engine is re-synced when it lags."""
    if engine.llm is None:
        return HFDecoder(engine.stop_ids).generate(model, tokenizer, prompts, n, temperature, top_p, max_new_tokens,
                                                   accelerator), 0.0
    from vllm import SamplingParams

    sync_time = wake_engine(engine, model, accelerator, policy_version)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                            stop_token_ids=engine.stop_ids)
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sleep_engine(engine)
    return [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] if temperature > 0
                   else None, o.finish_reason == "length") for out in outputs for o in out.outputs], sync_time


# ---- Evaluation -----------------------------------------------------------------------------------------------------


def evaluate(args, engine, model, tokenizer, scorer, rows, accelerator, policy_version):
    """Held-out pass@1 (greedy and sampled), pass@k and the greedy format rate over every process's share of the
    test rows (utils/evaluation.py), each process sampling its share through generate(), as the rollouts do."""

    def sample_texts(prompts, n, temperature, top_p):
        samples, _ = generate(engine, model, tokenizer, prompts, n, temperature, top_p, args.max_new_tokens,
                              accelerator, policy_version)
        return tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True)

    # the HF decode loop takes 64 prompts at a time; vLLM batches itself (a greedy and a sampled call: one wake each)
    return pass_rates(sample_texts, scorer, tokenizer, rows, accelerator, args.run, 64 if engine.llm is None else None)


# ---- Policy update --------------------------------------------------------------------------------------------------


def update_policy(args, model, optimizer, batch, accelerator, page=None):
    """mu = num_epochs * num_minibatches optimizer steps on one rollout batch -> the step's StepStats. pi_old is
    batch.old_logp when the loop computed it (mu > 1), else this pass's own detached log-probs (the policy has not moved
    since the rollout: a forward pass saved, as verl and TRL do); the first mini-batch comes in the rollout's order, so
    its ratio is exactly 1. Normalizers count the mini-batch over its micro-batches and processes. A non-finite
    gradient norm raises FloatingPointError before the optimizer step: NaN never reaches the weights."""
    stats, size, mu = StepStats(), len(batch) // args.num_minibatches, args.num_epochs * args.num_minibatches
    batch_tokens = accelerator.reduce(batch.mask.sum(), reduction="sum").clamp(min=1)
    for epoch in range(args.num_epochs):
        order = torch.arange(len(batch)) if epoch == 0 else torch.randperm(len(batch))
        for k, rows in enumerate(order.to(accelerator.device).split(size)):
            minibatch = batch.select(rows)
            num_seqs, num_tokens = accelerator.reduce(torch.stack([minibatch.mask.new_tensor(size),
                                                                   minibatch.mask.sum()]), reduction="sum").clamp(min=1)
            micro = list(micro_batches(minibatch, args.micro_batch_size))
            for j, (micro_rows, mc) in enumerate(micro):
                with gradient_sync(accelerator, model, last_micro_batch=j == len(micro) - 1):  # DDP: in the last only
                    logp, entropy = token_logprobs(model, mc, args.temperature, with_entropy=True)
                    old_logp = logp.detach() if mc.old_logp is None else mc.old_logp
                    advantages = mc.advantages
                    if args.tis_cap > 0:  # ---- engine/trainer mismatch: the policy gradient weighted by a bounded
                        # pi_old / pi_engine (a weight w >= 0 on every token factors out of the clipped min)
                        w, bounded = engine_is_weights(old_logp, mc.engine_logp, mc.mask, args.tis_cap, args.tis_mode)
                        advantages = advantages * w
                        stats.add({"policy/tis_bounded_frac": bounded.sum() / num_tokens}, 1 / mu)
                    loss, means, maxes = compute_loss(logp, old_logp, mc.ref_logp, advantages, mc.mask,
                                                      (num_seqs, num_tokens), args)
                    if page is not None and epoch == args.num_epochs - 1:  # --html_every: what the loss saw
                        page.record(rows[micro_rows], mc, logp, entropy, old_logp, advantages, compute_loss,
                                    (num_seqs, num_tokens), args)
                    accelerator.backward(loss * accelerator.num_processes)  # DDP/FSDP average; normalizers are global
                m = mc.mask.bool()  # statistics: the mean over the mu optimizer steps, the max over all
                stats.add({**means, "losses/policy": loss.detach(), "losses/entropy": entropy[m].sum() / num_tokens},
                          1 / mu)
                stats.max(maxes)
                if epoch == 0:  # every token once: the engine's sampling log-probs against the trainer's pi_old
                    gap = (mc.engine_logp - old_logp).abs() * mc.mask
                    stats.add({"rollout/logprob_gap_mean": gap.sum() / batch_tokens})
                    stats.max({"rollout/logprob_gap_max": gap.max()})
                if epoch == 0 and k == 0 and mc.old_logp is not None:  # pi_old from its own pass must equal pi_theta
                    stats.max({"policy/first_minibatch_ratio_dev_max": ((logp.detach() - old_logp).exp() - 1).abs()
                               .mul(mc.mask).max()})
            grad_norm = clip_gradients(accelerator, model, args.max_grad_norm)
            if not torch.isfinite(grad_norm):  # one host sync per optimizer step
                raise FloatingPointError(f"non-finite gradient norm in epoch {epoch}, mini-batch {k}")
            stats.mean({"policy/grad_norm": grad_norm}, 1 / mu)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return stats


# ---- Training loop --------------------------------------------------------------------------------------------------


CONSOLE_KEYS = ["charts/reward", "charts/accuracy", "charts/completion_length", "losses/kl", "policy/clip_frac",
                "rollout/logprob_gap_mean", "eval/pass@1_greedy"]


def main(args):
    from tqdm import tqdm

    if args.run.self_check:  # this configuration for a few steps in a temporary folder, checked (utils/selfcheck.py)
        raise SystemExit(self_check(__file__, args, sys.argv[1:], resolve_args))
    accelerator, args, run_dir, checkpoint, tokenizer, stop_ids, train_rows, test_rows = start_run(args)
    scorer = RewardScorer(args.task, args.answer_format, args.run.reward_workers or default_reward_workers(),
                          args.run.reward_timeout, args.run.reward_memory_mb)  # workers (math, rg:) warm up meanwhile
    model, optimizer, ref_model = load_models(args, tokenizer, accelerator, with_reference=args.beta > 0)
    engine = create_engine(args.run, args.model, args.seed + accelerator.process_index,
                           args.max_prompt_length + args.max_new_tokens, stop_ids)
    accelerator.print(memory_line(trainer_memory(accelerator, [model], [ref_model], args.micro_batch_size,
                                                 args.max_prompt_length + args.max_new_tokens, args.max_new_tokens),
                                  args.run.vllm_gpu_memory_utilization if engine.asleep else None))
    if args.run.eval_only:  # results go to their own file: a training run's metrics.jsonl is never touched
        result = evaluate(args, engine, model, tokenizer, scorer, test_rows, accelerator, policy_version=0)
        write_eval_only(accelerator, run_dir, args.model, result)
        return scorer.close()
    start_step = load_checkpoint(accelerator, checkpoint) if checkpoint else 1
    metrics_file = open_metrics(accelerator, run_dir, args, start_step)
    rank, world, G = accelerator.process_index, accelerator.num_processes, args.num_generations
    local_prompts = args.prompts_per_step // world
    minibatch_size = local_prompts * G // args.num_minibatches  # update_policy's, which pi_old's own pass follows
    for step in tqdm(range(start_step, args.total_steps + 1), initial=start_step - 1, total=args.total_steps,
                     disable=not accelerator.is_main_process, dynamic_ncols=True):
        times = {"step": time.time()}
        # 1. Rollout: this process's whole groups of the step's prompts, drawn from (seed, step) alone (a resumed run
        #    draws what an uninterrupted one would), sampled from the policy after step - 1 updates.
        picks = np.random.default_rng([args.seed, step]).choice(len(train_rows), args.prompts_per_step, replace=False)
        rows = [train_rows[i] for i in picks[rank * local_prompts:(rank + 1) * local_prompts]]
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        samples, sync_time = generate(engine, model, tokenizer, prompts, G, args.temperature, args.top_p,
                                      args.max_new_tokens, accelerator, policy_version=step - 1)
        times["rollout"] = time.time() - times["step"]
        # 2. Reward (checked in workers; the toy at submit) while the trainer computes pi_ref (and pi_old if mu > 1).
        texts = tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True)
        scoring = scorer.submit(texts, [r for r in rows for _ in range(G)])  # rows: a task's verifier may need more
        batch = make_batch([p for p in prompts for _ in range(G)], samples, tokenizer.pad_token_id, accelerator.device)
        if args.num_epochs * args.num_minibatches > 1:  # the policy moves before pi_old's last use: its own pass
            batch.old_logp = batched_logprobs(model, batch, args.temperature, minibatch_size, args.micro_batch_size)
        if ref_model is not None:
            batch.ref_logp = batched_logprobs(ref_model, batch, args.temperature, minibatch_size,
                                              args.micro_batch_size)
        accuracy, formats, failures = scorer.result(scoring)  # failures: answers that could not be checked, by kind
        rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
        # 3. Advantages, from every process's rewards (each process holds whole groups).
        all_rewards = accelerator.gather(rewards.to(accelerator.device))
        advantages = compute_advantages(all_rewards, args).view(world, -1)[rank]
        batch.advantages = advantages[:, None] * batch.mask  # A_i on each token of completion i, (B, T)
        # 4. mu optimizer steps on this batch; a NaN stops the run before it reaches the weights or a checkpoint.
        page = token_recorder(args.run, step, len(batch), G, accelerator.is_main_process)  # --html_every
        try:
            stats = update_policy(args, model, optimizer, batch, accelerator, page)
        except FloatingPointError as e:
            raise SystemExit(f"error: step {step}: {e}; stopped before the optimizer step, nothing saved from this "
                             f"step (the last checkpoint in {run_dir} is intact)") from None
        # 5. Log, evaluate, checkpoint.
        if page is not None:
            page.write(run_dir, step, tokenizer, [r["prompt"] for r in rows for _ in range(G)], {"accuracy": accuracy,
                       "format": formats, "reward": rewards}, [sample.truncated for sample in samples], G)
        metrics = step_metrics(accelerator, stats, samples, accuracy, formats, rewards, failures, {
            "step": time.time() - times["step"], "rollout": times["rollout"], "weight_sync": sync_time,
            "score": scoring.waited, "score_hidden": scoring.hidden})
        metrics.update({"step": step, "charts/reward_std": all_rewards.std().item()})
        if args.run.eval_every and (step % args.run.eval_every == 0 or step == args.total_steps):
            start = time.time()
            metrics.update(evaluate(args, engine, model, tokenizer, scorer, test_rows, accelerator, step))
            metrics["time/eval"] = time.time() - start
        if accelerator.is_main_process:
            log_step(metrics_file, metrics, args.run, args.total_steps, tqdm.write, CONSOLE_KEYS, [
                (rows[i // G]["question"], texts[i], rows[i // G]["answer"], rewards[i])
                for i in range(0, len(texts), max(1, len(texts) // 3))[:3]])
        check_logprob_gap(metrics, args.run, tqdm.write, run_dir)  # an engine on stale weights stops the run here
        if (args.run.save_every and step % args.run.save_every == 0) or step == args.total_steps:
            save_checkpoint(accelerator, model, tokenizer, run_dir, step)
    save_model(accelerator, model, tokenizer, os.path.join(run_dir, "final"))
    scorer.close()
    if accelerator.is_main_process:
        close_metrics(metrics_file, args.run.track)


if __name__ == "__main__":
    main(tyro.cli(Args))
