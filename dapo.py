"""DAPO: Decoupled clip and Dynamic sAmpling Policy Optimization (ByteDance Seed, arXiv 2503.14476): GRPO without KL,
with four changes for long chain-of-thought RL. For each prompt q, sample G completions o_i from pi_old and maximize

  J(theta) = E[ 1/(sum_i |o_i|) sum_i sum_t min( r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i ) ]
             subject to 0 < |{o_i correct}| < G
  r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)     per-token importance ratio
  A_i  = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)          GRPO's group z-score, R_i = task reward + R_length

1. Clip-higher: eps_high 0.28 > eps_low 0.2 lets low-probability tokens grow (against entropy collapse). It only acts
   off-policy, so each rollout batch gets 4 optimizer steps (the paper: 16).
2. Dynamic sampling: groups all right or all wrong are dropped (--filter_groups_by accuracy, the paper's rule; or
   reward: all of equal reward, advantage 0), and rounds of fresh prompts are generated until prompts_per_step groups
   are kept or max_num_gen_batches rounds ran; the step trains on what it kept (the metrics say how much).
3. Token-level loss: one normalizer for all tokens, so long completions weigh by their length. The formula puts
   1/sum_i |o_i| per prompt group (--loss_agg group-token-mean); the authors' released verl recipe, TRL and OpenRLHF
   divide by the tokens of the whole mini-batch (token-mean, the default here).
4. Overlong reward shaping: R_length = min(0, max(-1, (L_max - L_cache - |o|) / L_cache)), L_max = max_new_tokens;
   overlong filtering (mask truncated completions' loss) is a switch, off as in the paper's best run (the authors'
   recipe FAQ).
No KL term and no reference model (the paper removes it). `diff grpo.py dapo.py` shows exactly this.
"""

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch

from utils.checks import check_lengths, resolve_args
from utils.hf_engine import Sample, hf_generate
from utils.models import load_tokenizer
from utils.rewards import FAILURES, RewardScorer, default_reward_workers
from utils.rl import (LOSS_AGGREGATIONS, aggregate_loss, engine_is_weights, entropy_threshold, group_advantages,
                      make_batch, micro_batches, pass_at_k, slice_batch)
from utils.runs import (RunArgs, add_logprob_gap, close_metrics, load_checkpoint, log_step, open_metrics,
                        quiet_libraries, resume_checkpoint, save_checkpoint, save_model, step_metrics, write_eval_only)
from utils.tasks import TOY_MODEL_DIR, load_splits


@dataclass
class Args(RunArgs):  # + the flags every script shares: RunArgs in utils/runs.py
    # experiment
    exp_name: str = "dapo"
    """name of the run; its folder is <output_dir>/<exp_name>__<seed>"""
    seed: int = 1
    """random seed"""
    # model and task
    model: str = TOY_MODEL_DIR
    """model folder, hub id, .gguf file, or smollm2-135m (SmolLM2-135M-Instruct from pip); default: the embedded toy"""
    task: str = "toy"
    """toy, gsm8k, math, rg:NAME[:key=value,...] (reasoning-gym), or a local .jsonl/.parquet file (or folder with
    train.* and test.*) of {prompt, answer} rows"""
    answer_format: Literal["boxed", "answer_tags"] = "boxed"
    """what the system prompt asks for and the reward extracts (the toy task always uses answer tags)"""
    instruction: Literal["system", "user"] = "system"
    """where the answer-format instruction goes: a system turn, or after the question (small models start better)"""
    max_prompt_length: int = 512
    """prompts longer than this (tokens) are dropped at load time, with a count"""
    max_new_tokens: Optional[int] = None
    """completion length limit; None: 48 for the embedded model, 1024 otherwise"""
    # rollout
    temperature: float = 1.0
    """sampling temperature of rollouts; the trainer divides its logits by it too"""
    top_p: float = 1.0
    """nucleus sampling of rollouts (keep 1.0 for an unbiased policy gradient)"""
    num_generations: int = 8
    """G, completions per prompt (a group)"""
    prompts_per_step: int = 32
    """prompts per rollout batch, over all processes; a batch holds prompts_per_step * G completions"""
    # optimization
    learning_rate: Optional[float] = None
    """AdamW learning rate; None: 5e-4 for the embedded model, 1e-6 for any other model"""
    total_steps: int = 200
    """rollout steps"""
    num_epochs: int = 1
    """passes over each rollout batch; mu = num_epochs * num_minibatches optimizer steps per rollout"""
    num_minibatches: int = 4
    """optimizer steps per pass over a rollout batch (several: clip-higher only acts off-policy)"""
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward pass (gradient accumulation); None: 32 for the embedded model, 16 otherwise"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    # DAPO
    clip_eps_low: float = 0.2
    """ratio clipped below at 1 - clip_eps_low"""
    clip_eps_high: float = 0.28
    """ratio clipped above at 1 + clip_eps_high (clip-higher)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage = (R - group mean) / std of the group, of the whole batch, or not divided (Dr. GRPO)"""
    adv_eps: float = 1e-6
    """added to the std of the advantage normalization"""
    loss_agg: str = "token-mean"
    """token-mean (the mini-batch's tokens: verl, TRL), group-token-mean (per prompt group, the formula), grpo.py's"""
    gen_prompts_per_step: Optional[int] = None
    """prompts per generation round, over all processes; None: prompts_per_step (the paper's recipe: 3x)"""
    dynamic_sampling: bool = True
    """drop the groups --filter_groups_by finds all equal and generate more (off: train on every group of one round)"""
    max_num_gen_batches: int = 10
    """generation rounds per step at most; then the step trains on the groups kept so far"""
    filter_groups_by: Literal["accuracy", "reward"] = "accuracy"
    """drop groups whose accuracy (the paper) or whole reward (format and overlong penalty too) is the same for all"""
    overlong_buffer: Optional[int] = None
    """L_cache: the last tokens before max_new_tokens cost reward; None: max_new_tokens // 5 (paper: 4096 of 20480)"""
    overlong_penalty: float = 1.0
    """the penalty at L_max (the paper: 1, against a +-1 accuracy reward; ours is 0/1)"""
    overlong_filtering: bool = False
    """mask the loss of truncated completions (the paper proposes it; its best run has it off)"""
    format_reward_weight: float = 0.1
    """reward = accuracy + weight * format (one answer in the asked-for form, nothing after it) + R_length"""
    # switches from other papers (their defaults leave the algorithm as its paper has it)
    top_entropy_frac: float = 1.0
    """train on the top fraction of tokens by entropy only (the policy gradient; 0.2 in arXiv 2506.01939; 1: all)"""
    tis_cap: float = 0.0
    """if > 0, weight the policy gradient by pi_old / pi_engine bounded by this cap (--tis_mode): the engine/trainer
    mismatch"""
    tis_mode: Literal["token-truncate", "token-mask", "seq-truncate", "seq-mask"] = "token-truncate"
    """per token or per sequence (the product of the ratios); truncate at the cap, or mask outside [1/cap, cap]"""


# ---- Algorithm ------------------------------------------------------------------------------------------------------


def check_algorithm_args(args, num_processes=1):
    """DAPO's own argument checks and defaults (called by resolve_args)."""
    args.gen_prompts_per_step = args.gen_prompts_per_step or args.prompts_per_step
    args.overlong_buffer = args.max_new_tokens // 5 if args.overlong_buffer is None else args.overlong_buffer
    if args.num_generations < 2:
        raise ValueError(f"--num_generations {args.num_generations}: DAPO needs groups of >= 2 completions (a group "
                         "of one has advantage 0 and learns nothing)")
    if args.clip_eps_low < 0 or args.clip_eps_high < 0 or args.adv_eps < 0 or args.overlong_penalty < 0:
        raise ValueError("--clip_eps_low, --clip_eps_high, --adv_eps and --overlong_penalty must be >= 0")
    if args.loss_agg not in (*LOSS_AGGREGATIONS, "group-token-mean"):
        raise ValueError(f"--loss_agg {args.loss_agg!r}: use group-token-mean or one of {', '.join(LOSS_AGGREGATIONS)}")
    if args.gen_prompts_per_step % num_processes or args.max_num_gen_batches < 1:
        raise ValueError(f"--gen_prompts_per_step {args.gen_prompts_per_step} must divide by the {num_processes} "
                         f"processes and --max_num_gen_batches {args.max_num_gen_batches} be >= 1")
    if not 0 <= args.overlong_buffer <= args.max_new_tokens:
        raise ValueError(f"--overlong_buffer {args.overlong_buffer}: must be in [0, --max_new_tokens]")


def compute_advantages(rewards, num_generations, scale, eps):
    """Scalar rewards of consecutive groups of G completions (flat) -> one advantage per completion (flat)."""
    return group_advantages(rewards.view(-1, num_generations), scale, eps).view(-1)


def overlong_reward(lengths, max_len, buffer, penalty=1.0):
    """R_length: 0 up to max_len - buffer tokens, then falling linearly to -penalty at max_len."""
    if buffer == 0:
        return torch.zeros(len(lengths))
    excess = (torch.as_tensor(lengths, dtype=torch.float32) - (max_len - buffer)) / buffer
    return -penalty * excess.clamp(0, 1)


def informative_groups(values, num_generations):
    """True for each group of G consecutive values (accuracies or rewards) that are not all equal."""
    groups = torch.as_tensor(values, dtype=torch.float32).view(-1, num_generations)
    return (groups != groups[:, :1]).any(-1)


def groups_to_train(fewest_kept, prompts_local, num_generations, num_minibatches):
    """Whole groups every process trains on: as many on each (the fewest any process kept), at most its share of
    prompts_per_step, and a count whose completions divide into num_minibatches mini-batches."""
    num_groups = min(fewest_kept, prompts_local)
    while num_groups * num_generations % num_minibatches:
        num_groups -= 1
    return num_groups


def group_token_weights(mask, num_generations):
    """Per-sequence weight G / (tokens of its prompt group): with seq-mean-token-sum aggregation it gives the paper's
    per-group normalizer 1/sum_i |o_i|, averaged over the mini-batch's groups."""
    group_tokens = mask.sum(-1).view(-1, num_generations).sum(-1, keepdim=True).clamp(min=1)
    return (num_generations / group_tokens).expand(-1, num_generations).reshape(-1)


def loss_settings(args):
    """The algorithm's knobs of compute_loss, from the arguments (update_policy passes them through unchanged)."""
    return {"clip_eps_low": args.clip_eps_low, "clip_eps_high": args.clip_eps_high, "max_len": args.max_new_tokens,
            "loss_agg": "seq-mean-token-sum" if args.loss_agg == "group-token-mean" else args.loss_agg}


def compute_loss(logp, old_logp, advantages, mask, ref_logp=None, is_weights=None, *, clip_eps_low=0.2,
                 clip_eps_high=0.28, loss_agg="token-mean", num_seqs=None, num_tokens=None, max_len=None):
    """DAPO loss of one micro-batch: per-token clipped surrogate, decoupled clip range, aggregated with global counts.

    logp, old_logp, mask, is_weights: (B, T); advantages: (B,) (ref_logp: unused, no KL). num_seqs/num_tokens are the
    counts of the whole mini-batch over micro-batches and processes (default: this micro-batch), so summed micro-batch
    losses give the mini-batch loss exactly. Returns (loss, means, maxes): `means` are token means divided by the same
    global num_tokens, so they too add up over micro-batches and processes to the exact mini-batch mean.
    """
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    log_ratio = (logp - old_logp).clamp(-20, 20)  # exp() stays finite: an inf ratio, even masked, makes the loss NaN
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate_loss(per_token, mask, loss_agg, num_seqs, num_tokens, max_len)
    with torch.no_grad():
        m = mask.bool()
        means = {"policy/clip_frac_high": ((adv > 0) & (ratio > 1 + clip_eps_high))[m].float().sum() / num_tokens,
                 "policy/clip_frac_low": ((adv < 0) & (ratio < 1 - clip_eps_low))[m].float().sum() / num_tokens,
                 "policy/ratio_mean": ratio[m].sum() / num_tokens,
                 "policy/approx_kl": (ratio - 1 - log_ratio)[m].sum() / num_tokens}
        means["policy/clip_frac"] = means["policy/clip_frac_high"] + means["policy/clip_frac_low"]
        maxes = {"policy/ratio_max": torch.where(m, ratio, 0.0).max()}  # rows masked by --overlong_filtering
    return loss, means, maxes


# ---- Model --------------------------------------------------------------------------------------------------------


def load_model(args, tokenizer):
    """The policy, or the frozen reference, with float32 weights (bf16 autocast on GPU: a 1e-6 update vanishes in bf16
    weights). The reference too: stored in bf16 it would not compute as the policy it starts as (KL > 0 at step 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False  # training passes build no KV cache (hf_generate asks for one itself)
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # saved with final/: generate() there pads with it
    return model


# ---- Token log-probs ------------------------------------------------------------------------------------------------


def token_logprobs(model, input_ids, attention_mask, prompt_width, temperature, with_entropy=False):
    """log pi(token) of every completion position (B, T), from logits divided by the sampling temperature.

    Sequences are [left-padded prompt | right-padded completion]; only the T+1 last positions' logits are computed,
    and the float32 full-vocabulary log-softmax exists for this micro-batch only.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion = input_ids[:, prompt_width:]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=completion.shape[1] + 1).logits[:, :-1]
    logits = logits.float()  # one float32 (B, T, V) copy; divided only when temperature != 1
    logp_all = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    logp = logp_all.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@torch.no_grad()
def batched_logprobs(model, batch, temperature, micro_batch_size, num_minibatches=1, with_entropy=False):
    """Trainer log-probs (pi_old, pi_ref) of a rollout batch, and their entropies with_entropy (else None). The
    micro-batches are update_policy's first epoch's, so pi_old here and the first mini-batch's pi_theta are equal."""
    logp = torch.zeros_like(batch["completion_mask"])
    entropy = torch.zeros_like(logp) if with_entropy else None
    for minibatch in torch.arange(len(logp), device=logp.device).chunk(num_minibatches):
        for rows, mc in micro_batches(batch, minibatch, micro_batch_size):
            mc_logp, mc_entropy = token_logprobs(model, mc["input_ids"], mc["attention_mask"], mc["prompt_width"],
                                                 temperature, with_entropy)
            logp[rows, :mc_logp.shape[1]] = mc_logp
            if with_entropy:
                entropy[rows, :mc_logp.shape[1]] = mc_entropy
    return logp, entropy


# ---- Rollout engine: vLLM (colocated, sleep mode on GPU) or the HF decode loop --------------------------------------


def create_engine(args, accelerator, stop_ids):
    """One in-process vLLM engine per rank (external_launcher), or {"llm": None} for the HF decode loop; both end a
    completion at its first stop token (stop_ids)."""
    vllm_installed = importlib.util.find_spec("vllm") is not None
    if args.engine == "hf" or (args.engine == "auto" and not (vllm_installed and torch.cuda.is_available())):
        return {"llm": None, "stop_ids": stop_ids}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(key, value)  # a plain `python grpo.py` is a world of one
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    extra = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization, "enable_sleep_mode": True} if on_gpu else {
        "kv_cache_memory_bytes": 256 * 2**20, "enforce_eager": True}  # CPU build: no sleep mode, small explicit KV
    # cache, no torch.compile (its start takes longer than a CPU run's generation saves: benchmarks/vllm_start.py)
    llm = LLM(args.model, distributed_executor_backend="external_launcher", seed=args.seed + accelerator.process_index,
              dtype="bfloat16" if on_gpu else "float32", max_model_len=args.max_prompt_length + args.max_new_tokens,
              logprobs_mode="processed_logprobs", enable_prefix_caching=True, **extra)
    if on_gpu:
        llm.sleep(level=args.vllm_sleep_level)
    # weights_version: how many training steps the engine's weights include (None: never pushed, or dropped by a
    # level-2 sleep); generate() pushes whenever it differs from the policy's version
    return {"llm": llm, "stop_ids": stop_ids, "weights_version": None, "asleep": on_gpu,
            "sleep_level": args.vllm_sleep_level}


def push_weights(engine, model, accelerator):
    """Copy the policy's full weights into vLLM, one gathered tensor at a time (FSDP2 DTensors are all-gathered)."""
    state_dict = accelerator.unwrap_model(model).state_dict()
    weights = ((name, t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in state_dict.items())
    engine["llm"].collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    engine["llm"].reset_prefix_cache()  # stale prefix-cache entries would serve the old weights' KV


def wake_engine(engine, model, accelerator, policy_version):
    """Before sampling: wake the engine (GPU sleep mode) and push the policy's weights if they lag it (policy_version
    counts the training steps the weights include) -> seconds spent pushing. A caller that makes several engine calls
    of one rollout wakes it once around them (grpo_tools.py's turns): every call then samples from the same weights."""
    llm, sync_time = engine["llm"], 0.0
    if llm is None:
        return sync_time
    if engine["asleep"]:
        llm.wake_up(tags=["weights"])
    if engine["weights_version"] != policy_version:  # the first call always pushes; never stale or dropped weights
        start = time.time()
        push_weights(engine, model, accelerator)
        engine["weights_version"], sync_time = policy_version, time.time() - start
    if engine["asleep"]:
        torch.cuda.empty_cache()  # hand the trainer's cached blocks to the KV cache
        llm.wake_up(tags=["kv_cache"])
    return sync_time


def sleep_engine(engine):
    """After sampling: give the GPU memory back to the trainer (a level-2 sleep drops the weights too)."""
    if engine["llm"] is not None and engine["asleep"]:
        engine["llm"].sleep(level=engine["sleep_level"])
        if engine["sleep_level"] == 2:
            engine["weights_version"] = None


def generate(engine, model, tokenizer, prompts, n, temperature, top_p, max_new_tokens, accelerator, policy_version):
    """Sample n completions per prompt (token-id lists) -> (n * len(prompts) Samples, seconds spent pushing weights).
    policy_version counts the training steps the policy's weights include: the engine is re-synced when it lags."""
    llm = engine["llm"]
    if llm is None:
        return hf_generate(model, tokenizer, prompts, n, temperature, top_p, max_new_tokens, accelerator,
                           engine["stop_ids"]), 0.0
    from vllm import SamplingParams

    sync_time = wake_engine(engine, model, accelerator, policy_version)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                            stop_token_ids=engine["stop_ids"])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sleep_engine(engine)
    return [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] if temperature > 0
                   else None, o.finish_reason == "length") for out in outputs for o in out.outputs], sync_time


# ---- Evaluation -----------------------------------------------------------------------------------------------------


def evaluate(args, engine, model, tokenizer, scorer, rows, accelerator, policy_version):
    """pass@1 on this process's share of the test rows: greedy, and the mean over n = eval_samples samples (T=0.6,
    top-p 0.95); pass@k for k = 2, 4, ... <= n from the same samples (unbiased estimator); the greedy format rate."""
    world = accelerator.num_processes  # every rank gets as many problems: the same number of generate calls
    mine = rows[: min(args.eval_size, len(rows)) // world * world][accelerator.process_index::world]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in mine]
    ks = [2 ** i for i in range(1, args.eval_samples.bit_length())]  # 2, 4, ... up to eval_samples
    totals = torch.zeros(4 + len(ks), device=accelerator.device)  # greedy, sampled, problems, format, pass@k sums
    size = 64 if engine["llm"] is None else max(1, len(prompts))  # vLLM batches itself: one wake and push per call
    for start in range(0, len(prompts), size):
        chunk, chunk_rows = prompts[start:start + size], mine[start:start + size]
        for column, n, temperature in ((0, 1, 0.0), (1, args.eval_samples, args.eval_temperature)):
            out, _ = generate(engine, model, tokenizer, chunk, n, temperature, args.eval_top_p if temperature else 1.0,
                              args.max_new_tokens, accelerator, policy_version)
            texts = tokenizer.batch_decode([sample.token_ids for sample in out], skip_special_tokens=True)
            acc, formats, _ = scorer.result(scorer.submit(texts, [r for r in chunk_rows for _ in range(n)]))
            totals[column] += sum(acc) / n
            if column == 0:
                totals[3] += sum(formats)
            for j, k in enumerate(ks if column == 1 else []):  # each problem's n samples are consecutive
                totals[4 + j] += sum(pass_at_k(n, int(sum(acc[i:i + n])), k) for i in range(0, len(acc), n))
        totals[2] += len(chunk)
    totals = accelerator.reduce(totals, reduction="sum")
    n = totals[2].clamp(min=1)
    return {"eval/pass@1_greedy": (totals[0] / n).item(), f"eval/pass@1_sampled_k{args.eval_samples}":
            (totals[1] / n).item(), **{f"eval/pass@{k}": (totals[4 + j] / n).item() for j, k in enumerate(ks)},
            "eval/format_greedy": (totals[3] / n).item(), "eval/problems": int(totals[2].item())}


# ---- Policy update --------------------------------------------------------------------------------------------------


def update_policy(args, model, optimizer, batch, accelerator):
    """num_epochs passes of num_minibatches optimizer steps over one rollout batch.

    pi_old's log-probs are batch["old_logp"] when the loop computed them (old_logp_pass). Without them the policy has
    not moved since the rollout, so this forward pass's own detached log-probs are pi_old's, as in verl and TRL: one
    forward pass saved. The first mini-batch sees the rollout order unshuffled, so its ratio is exactly 1. Normalizers
    count the whole mini-batch over all processes. With pi_old's entropies in the batch (--top_entropy_frac), the
    policy gradient flows through the mini-batch's top tokens by entropy only, the threshold taken over all its
    tokens on every process (the KL term keeps every token). Returns (the pi_old log-probs the loss used, statistics
    grouped by how processes combine them: "sums", "means", "maxes"). Raises FloatingPointError before an optimizer
    step whose loss or gradient norm is not finite, so NaN never reaches the weights.
    """
    n = len(batch["advantages"])
    size = n // args.num_minibatches
    old_logp_used = batch["old_logp"] if "old_logp" in batch else torch.zeros_like(batch["engine_logp"])
    sums, maxes, grad_norms, thresholds = {}, {}, [], []
    for epoch in range(args.num_epochs):
        order = (torch.arange(n) if epoch == 0 else torch.randperm(n)).to(accelerator.device)
        for mb_start in range(0, n, size):
            mb_rows = order[mb_start:mb_start + size]
            mb = slice_batch(batch, mb_rows)
            num_seqs, num_tokens = accelerator.reduce(torch.stack([torch.tensor(
                float(size), device=accelerator.device), mb["completion_mask"].sum()]), reduction="sum").clamp(min=1)
            if mb.get("old_entropy") is not None:
                thresholds.append(entropy_threshold(mb["old_entropy"], mb["completion_mask"], args.top_entropy_frac,
                                                    lambda t: accelerator.gather(accelerator.pad_across_processes(
                                                        t, pad_index=float("nan")))))
                mb["pg_mask"] = (mb["old_entropy"] >= thresholds[-1]).float()
            mb_loss = 0.0
            for mc_start, (mc_rows, mc) in zip(range(0, size, args.micro_batch_size), micro_batches(
                    mb, torch.arange(size, device=accelerator.device), args.micro_batch_size)):
                last_micro_batch = mc_start + args.micro_batch_size >= size
                # DDP/FSDP all-reduce gradients in the backward of the mini-batch's last micro-batch only
                grad_sync = contextlib.nullcontext() if last_micro_batch else accelerator.no_sync(model)
                with grad_sync:
                    logp, entropy = token_logprobs(model, mc["input_ids"], mc["attention_mask"], mc["prompt_width"],
                                                   args.temperature, with_entropy=True)
                    old_logp = mc["old_logp"] if "old_logp" in mc else logp.detach()
                    is_weights, bounded = None, None
                    if args.tis_cap > 0:  # the engine/trainer mismatch: pi_old / pi_engine, bounded
                        is_weights, bounded = engine_is_weights(old_logp, mc["engine_logp"], mc["completion_mask"],
                                                                args.tis_cap, args.tis_mode)
                    if "pg_mask" in mc:  # compute_loss weighs the surrogate by is_weights, not the KL term
                        is_weights = mc["pg_mask"] * (1.0 if is_weights is None else is_weights)
                    loss, token_means, mc_maxes = compute_loss(
                        logp, old_logp, mc["advantages"], mc["completion_mask"], mc.get("ref_logp"), is_weights,
                        **loss_settings(args), num_seqs=num_seqs, num_tokens=num_tokens)
                    accelerator.backward(loss * accelerator.num_processes)  # DDP/FSDP average; normalizers are global
                if "old_logp" not in batch:
                    old_logp_used[mb_rows[mc_rows], :old_logp.shape[1]] = old_logp
                m = mc["completion_mask"].bool()
                mb_loss = mb_loss + loss.detach()
                token_means["losses/policy"] = loss.detach()  # divided by global counts: it adds up like the means
                token_means["losses/entropy"] = entropy[m].sum() / num_tokens
                if bounded is not None:  # tokens whose mismatch weight was truncated or masked
                    token_means["policy/tis_bounded_frac"] = bounded.sum() / num_tokens
                if "pg_mask" in mc:
                    token_means["policy/entropy_kept_frac"] = mc["pg_mask"][m].sum() / num_tokens
                if epoch == 0 and mb_start == 0 and "old_logp" in batch:  # pi_old from its own pass must match
                    mc_maxes["policy/first_minibatch_ratio_dev_max"] = (torch.exp(logp.detach() - old_logp) - 1).abs(
                    ).mul(m).max()
                for k, v in token_means.items():  # summed over micro-batches, averaged over optimizer steps
                    sums[k] = sums.get(k, 0.0) + v / (args.num_epochs * args.num_minibatches)
                for k, v in mc_maxes.items():
                    maxes[k] = torch.maximum(maxes[k], v) if k in maxes else v
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            mb_loss = accelerator.reduce(mb_loss, reduction="sum")
            if not (torch.isfinite(mb_loss) and torch.isfinite(grad_norm)):  # one host sync per optimizer step
                raise FloatingPointError(f"non-finite loss ({mb_loss.item():.4g}) or gradient norm "
                                         f"({grad_norm.item():.4g}) in epoch {epoch}, mini-batch {mb_start // size}")
            grad_norms.append(grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    means = {"policy/grad_norm": torch.stack(grad_norms).mean()}
    if thresholds:  # the same on every process
        means["policy/entropy_threshold"] = torch.stack(thresholds).mean()
    return old_logp_used, {"sums": sums, "means": means, "maxes": maxes}


# ---- Training loop --------------------------------------------------------------------------------------------------


CONSOLE_KEYS = ["charts/reward", "charts/accuracy", "charts/completion_length", "dapo/gen_rounds", "policy/clip_frac",
                "rollout/logprob_gap_max", "eval/pass@1_greedy"]


def main(args):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    quiet_libraries()
    on_gpu = torch.cuda.is_available()  # without CUDA: CPU processes, gloo (MULTI_CPU) when launched as several
    # `accelerate launch` passes its config's mixed precision in this variable; a plain `python` run on a GPU gets bf16
    mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "bf16")
    accelerator = Accelerator(cpu=not on_gpu, mixed_precision=mixed_precision if on_gpu else "no")
    run_dir = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}")
    # Bad input fails here, in one line, before the models load.
    try:
        args = resolve_args(args, check_algorithm_args, accelerator.num_processes)
        checkpoint = resume_checkpoint(run_dir, args)
        tokenizer, stop_ids = load_tokenizer(args.model)
        check_lengths(args)
        train_rows, test_rows, summary = load_splits(args, tokenizer, accelerator.num_processes)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    accelerator.print(summary)
    set_seed(args.seed, device_specific=True)
    # The reward workers start now, before the models and the engine: they warm up while those load.
    scorer = RewardScorer(args.task, args.answer_format, args.reward_workers or default_reward_workers(),
                          args.reward_timeout, args.reward_memory_mb)

    model = load_model(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.eval()  # dropout off: the ratio must be exactly 1 on the first mini-batch
    engine = create_engine(args, accelerator, stop_ids)

    if args.eval_only:  # results go to their own file: a training run's metrics.jsonl is never touched
        result = evaluate(args, engine, model, tokenizer, scorer, test_rows, accelerator, policy_version=0)
        write_eval_only(accelerator, run_dir, args.model, result)
        scorer.close()
        return result

    start_step = load_checkpoint(accelerator, checkpoint) if checkpoint else 1
    metrics_file = open_metrics(accelerator, run_dir, args, start_step)

    rank, world, G = accelerator.process_index, accelerator.num_processes, args.num_generations
    prompts_local, round_local = args.prompts_per_step // world, args.gen_prompts_per_step // world
    # pi_old needs its own pass only when the policy moves before the last use of pi_old (mu > 1); otherwise
    # update_policy's first forward pass gives it (one pass saved).
    old_logp_pass = args.num_epochs * args.num_minibatches > 1 or (
        args.top_entropy_frac < 1)  # the entropy threshold needs the whole batch's entropies before the update
    progress = tqdm(range(start_step, args.total_steps + 1), initial=start_step - 1, total=args.total_steps,
                    disable=not accelerator.is_main_process, dynamic_ncols=True)
    for step in progress:
        times = {"step": time.time()}
        # 1. Rollout with dynamic sampling: rounds of fresh prompts, each process sampling G completions for its share,
        #    scored at once (the filter needs the rewards). Groups all equal by --filter_groups_by are dropped. The stop
        #    test is collective (the fewest groups any process kept), so every process runs as many rounds.
        seen, kept, waited, rounds, num_informative, sync_time = [], [], 0.0, 0, 0, 0.0
        counts = dict.fromkeys(["no_answer", *FAILURES], 0)
        while True:
            rounds += 1
            # from (seed, step, round) alone: a resumed run draws the prompts an uninterrupted one would
            picks = np.random.default_rng([args.seed, step, rounds]).choice(len(train_rows), args.gen_prompts_per_step,
                                                                             replace=False)
            rows = [train_rows[i] for i in picks[rank * round_local:(rank + 1) * round_local]]
            prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
            samples, round_sync_time = generate(engine, model, tokenizer, prompts, G, args.temperature, args.top_p,
                                                args.max_new_tokens, accelerator, policy_version=step - 1)
            sync_time += round_sync_time  # only the first round pushes the weights
            texts = tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True)
            scoring = scorer.submit(texts, [r for r in rows for _ in range(G)])
            accuracy, formats, round_counts = scorer.result(scoring)
            waited, counts = waited + scoring.waited, {k: v + round_counts[k] for k, v in counts.items()}
            task_rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
            length_rewards = overlong_reward([len(sample.token_ids) for sample in samples], args.max_new_tokens,
                                             args.overlong_buffer, args.overlong_penalty)
            rewards = task_rewards + length_rewards
            informative = informative_groups(accuracy if args.filter_groups_by == "accuracy" else rewards, G)
            num_informative += int(informative.sum())
            for j, row in enumerate(rows):
                group = slice(j * G, (j + 1) * G)
                seen.append({"prompt": prompts[j], "samples": samples[group], "accuracy": accuracy[group],
                             "formats": formats[group], "task": task_rewards[group], "length": length_rewards[group],
                             "reward": rewards[group]})
                if informative[j] or not args.dynamic_sampling:
                    kept.append(seen[-1])
            fewest = accelerator.gather(torch.tensor([len(kept)], device=accelerator.device)).min().item()
            if not args.dynamic_sampling or fewest >= prompts_local or rounds == args.max_num_gen_batches:
                break
        num_groups = groups_to_train(fewest, prompts_local, G, args.num_minibatches)
        kept = kept[:num_groups]
        # 2. The kept groups' batch: advantages from every process's kept rewards, then mu optimizer steps.
        times["train"] = time.time()
        train_stats, trained = {"sums": {}, "means": {}, "maxes": {}}, {"dapo/trained_groups": num_groups * world}
        if num_groups > 0:
            prompts, samples = [g["prompt"] for g in kept for _ in range(G)], [s for g in kept for s in g["samples"]]
            batch = make_batch(prompts, samples, tokenizer.pad_token_id, accelerator.device)
            mask = batch["completion_mask"]
            if args.overlong_filtering:  # truncated completions leave the loss (token-mean: its normalizer too)
                batch["completion_mask"] = mask * torch.tensor([[not s.truncated] for s in samples], device=mask.device)
            if old_logp_pass:  # with pi_old's entropies when --top_entropy_frac needs them
                batch["old_logp"], batch["old_entropy"] = batched_logprobs(model, batch, args.temperature,
                                                                           args.micro_batch_size, args.num_minibatches,
                                                                           args.top_entropy_frac < 1)
            all_rewards = accelerator.gather(torch.cat([g["reward"] for g in kept]).to(accelerator.device))
            advantages = compute_advantages(all_rewards, G, args.scale_rewards, args.adv_eps).view(world, -1)[rank]
            if args.loss_agg == "group-token-mean":  # a positive per-sequence weight: -min(rA, clip(r)A) scales with A
                advantages = advantages * group_token_weights(batch["completion_mask"], G)
            batch["advantages"] = advantages
            try:  # a NaN stops the run before it is saved
                old_logp, train_stats = update_policy(args, model, optimizer, batch, accelerator)
            except FloatingPointError as e:
                raise SystemExit(f"error: step {step}: {e}; stopped before the optimizer step, nothing saved from this "
                                 f"step (the last checkpoint in {run_dir} is intact)") from None
            add_logprob_gap(train_stats, batch["engine_logp"], old_logp, batch["completion_mask"], accelerator)
            trained["charts/reward_std"] = all_rewards.std().item()
        # 3. Log (the rollout's statistics are over every completion generated), evaluate, checkpoint.
        train_stats["means"].update({"dapo/informative_group_frac": num_informative / len(seen),
                                     "charts/overlong_reward": torch.cat([g["length"] for g in seen]).mean()})
        seconds = {"step": time.time() - times["step"], "rollout": times["train"] - times["step"] - waited,
                   "weight_sync": sync_time, "score": waited, "score_hidden": 0.0}  # the filter needs every round's
        # rewards before training: no overlap
        metrics = step_metrics(accelerator, train_stats, [s for g in seen for s in g["samples"]],
                               [a for g in seen for a in g["accuracy"]], [f for g in seen for f in g["formats"]],
                               torch.cat([g["task"] for g in seen]), counts, seconds)
        metrics.update(trained, **{"dapo/gen_rounds": rounds})
        if args.eval_every and (step % args.eval_every == 0 or step == args.total_steps):
            start = time.time()
            metrics.update(evaluate(args, engine, model, tokenizer, scorer, test_rows, accelerator,
                                    policy_version=step))
            metrics["time/eval"] = time.time() - start
        metrics["step"] = step
        if accelerator.is_main_process:
            log_step(metrics_file, metrics, args, progress.write, CONSOLE_KEYS, [
                (rows[i // G]["question"], texts[i], rows[i // G]["answer"], task_rewards[i])
                for i in range(0, len(texts), max(1, len(texts) // 3))[:3]])
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps:
            save_checkpoint(accelerator, model, tokenizer, run_dir, step)
    save_model(accelerator, model, tokenizer, os.path.join(run_dir, "final"))
    scorer.close()
    if accelerator.is_main_process:
        close_metrics(metrics_file, args.track)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
