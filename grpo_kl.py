"""GRPO with a KL term whose gradient is the one its objective states ("On a few pitfalls in KL divergence gradient
estimation for RL", Tang & Munos, arXiv 2506.09477; DeepSeek-V3.2, arXiv 2512.02556, for k3_is).

GRPO's objective penalizes KL(pi_theta || pi_ref), the reverse KL, with the k3 estimator as a loss. On samples from
pi_theta (delta = log pi_theta - log pi_ref, s = grad log pi_theta), the expected gradient of each placement is:

  k3 in the loss (grpo.py)      E[(1 - pi_ref/pi_theta) s]    the forward KL's, KL(pi_ref || pi_theta): biased
  k2 = delta^2 / 2 in the loss   E[delta s]                    the reverse KL's, per token (the default here)
  k3+: k3's value, k2's gradient E[delta s]                    as k2, with k3's low-variance value logged (verl)
  k3_is = (pi_theta/pi_old) k3,  E[delta s]                    the reverse KL's, on- and off-policy (DeepSeek-V3.2)
    the ratio differentiable
  k1_reward: beta sum_t delta_t  E[delta s] per sequence       the reverse KL's over the whole sequence: k1 of pi_old
    subtracted from each reward     (score function)           (detached) taken from R_i before the advantages
    before the advantages

With k1_reward the penalized rewards then go through the group z-score, as verl's KL-in-reward does with GRPO: the
penalty is centred in its group and divided by the group's std, so the gradient is E[delta s] only up to that
scaling, and a group whose scores are all equal gets advantages from its completions' KL alone (instead of 0).
(k1 = delta as a loss has expected gradient 0: it regularizes nothing, so it is not offered.) Worked example: on a
token with log pi_theta = -1 and log pi_ref = -2 (delta = 1), k3 = e^-1 - 1 + 1 = 0.368 and its gradient with respect
to log pi_theta is 1 - e^-1 = 0.632; k2 = 0.5 with gradient delta = 1. Everything else is grpo.py's objective.

What `diff grpo.py grpo_kl.py` shows: --kl_estimator and kl_term in the loss; for k1_reward, the pi_old pass before
the update, the KL subtracted from the rewards, and its metric.

Reading order, one step (blocks whose header says "infrastructure" are what a first read skips): main(), generate(),
make_batch(), compute_advantages(), update_policy(), token_logprobs(), compute_loss() with kl_term().
"""

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import tyro
from torch.utils.checkpoint import checkpoint

from plumbing.engine import HFDecoder, Sample, create_engine
from plumbing.evaluation import Evaluation
from plumbing.memory import print_memory_estimate
from plumbing.models import output_layer, resolve_model
from plumbing.parallel import clip_gradients, gradient_sync, load_models
from plumbing.run import (RunArgs, check_batch_layout, check_fraction, check_positive, check_run_args,
                          largest_divisor, peak_memory, start_run, step_times, tail_fraction)
from utils.rewards import RewardScorer
from utils.rl import engine_is_weights, group_zscore, kl_k1, kl_k2, kl_k3
from utils.tasks import TOY_MODEL_DIR, TOY_TASKS, is_toy_shaped


@dataclass
class Args:
    # GRPO with another KL estimator
    kl_estimator: Literal["k2", "k3+", "k3_is", "k1_reward", "k3"] = "k2"
    """k2, k3+, k3_is: a loss with the reverse KL's gradient; k1_reward: in the reward; k3: grpo.py's (forward KL)"""
    num_generations: int = 8
    """G, completions per prompt (a group)"""
    clip_eps: float = 0.2
    """the ratio is clipped to [1 - clip_eps, 1 + clip_eps] (it acts only when mu > 1)"""
    beta: float = 0.04
    """coefficient of the KL to the initial policy (its estimator and place: --kl_estimator); 0 loads no reference
    model"""
    adv_eps: float = 1e-6
    """added to the group's std in the advantage"""
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
    """reward = accuracy + weight * format (one answer in the asked-for form: at most 49 characters after a box, none
    after answer tags)"""
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
    if args.beta < 0 or args.clip_eps < 0 or args.adv_eps < 0:
        raise ValueError("--beta, --clip_eps and --adv_eps must be >= 0 (--beta 0 turns the KL term off)")


def compute_advantages(rewards, args):
    """rewards (B,), consecutive groups of G = --num_generations -> advantages (B,):
    A_i = (R_i - mean of its group) / (std of its group + --adv_eps)."""
    return group_zscore(rewards.view(-1, args.num_generations), args.adv_eps).view(-1)


def kl_term(logp, ref_logp, old_logp, estimator):
    """The per-token KL penalty of the loss, (B, T), for each estimator of the docstring but k1_reward."""
    if estimator == "k3_is":  # the ratio is differentiable: its gradient adds the score-function term
        return torch.exp((logp - old_logp).clamp(-20, 20)) * kl_k3(logp, ref_logp)
    if estimator == "k3+":  # straight-through: k3's value, k2's gradient
        k2 = kl_k2(logp, ref_logp)
        return k2 - k2.detach() + kl_k3(logp, ref_logp).detach()
    return {"k2": kl_k2, "k3": kl_k3}[estimator](logp, ref_logp)


def compute_loss(logp, old_logp, ref_logp, advantages, mask, counts, args):
    """-J(theta) on one micro-batch, as its share of the optimizer mini-batch's loss: summed over the mini-batch's
    micro-batches and processes, the shares give that loss exactly.

    logp (B, T), with gradient; old_logp, ref_logp (None when beta = 0), mask, advantages: (B, T) (A_i on each token
    of completion i). counts = (num_seqs, num_tokens): the completions and tokens of the whole mini-batch, over
    every micro-batch and process. args: the flags of the loss (--clip_eps, --beta, --kl_estimator). Returns (loss,
    means: statistics as shares of their mini-batch mean, maxes)."""
    num_seqs, num_tokens = counts
    log_ratio = (logp - old_logp).clamp(-20, 20)  # exp() stays finite: an inf ratio, even masked, makes the loss NaN
    ratio = torch.exp(log_ratio)
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps) * advantages
    per_token = -torch.min(unclipped, clipped)
    kl_in_loss = args.beta > 0 and args.kl_estimator != "k1_reward"
    if kl_in_loss:
        kl = kl_term(logp, ref_logp, old_logp, args.kl_estimator)
        per_token = per_token + args.beta * kl
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs  # 1/|o_i| sum_t, then the mean
    with torch.no_grad():
        m = mask.bool()
        means = {"policy/clip_frac": (clipped < unclipped)[m].float().sum() / num_tokens,
                 "policy/ratio_mean": ratio[m].sum() / num_tokens,
                 "policy/approx_kl": (ratio - 1 - log_ratio)[m].sum() / num_tokens}
        if kl_in_loss:
            means["losses/kl"] = kl[m].sum() / num_tokens
    return loss, means, {"policy/ratio_max": ratio[m].max()}  # every completion has at least one token


# ---- Rollout: vLLM (colocated, sleep mode on GPU) or the HF decode loop ---------------------------------------------


def generate(engine, model, tokenizer, prompts, n, temperature, top_p, max_new_tokens, accelerator, policy_version):
    """Sample n completions per prompt (token-id lists) -> (n * len(prompts) Samples, seconds spent pushing weights),
    each prompt's n together. A Sample is (token_ids: the completion's tokens, its stop token included when it has one;
    logprobs: the engine's log-prob of each under the distribution it was drawn from, softmax(logits / temperature)
    within the top-p nucleus, or None when greedy; truncated: it ran out of new tokens before a stop token).
    policy_version counts the training steps the policy's weights include: the engine is re-synced when it lags."""
    if engine.llm is None:  # the HF decode loop (no vLLM, --engine hf): the policy's own forward with a KV cache
        return HFDecoder(engine.stop_ids).generate(model, tokenizer, prompts, n, temperature, top_p, max_new_tokens,
                                                   accelerator), 0.0
    from vllm import SamplingParams

    engine.wake("weights")  # GPU sleep mode: the engine's weights back on the GPU (a no-op without sleep mode)
    sync_time = engine.push_weights(model, accelerator, policy_version)  # the policy's weights, if the engine's lag
    engine.wake("kv_cache")
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                            stop_token_ids=engine.stop_ids)
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine.sleep()  # the GPU's memory back to the trainer
    return [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] if temperature > 0
                   else None, o.finish_reason == "length") for out in outputs for o in out.outputs], sync_time


# ---- Rollout batch --------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """B completions as the trainer sees them: row i is [prompt i, left-padded to P positions | completion i,
    right-padded to T]. Example (P = 3, T = 4, pad 0): prompt [5, 6] with completion [7, 8, eos] is the row
    input_ids [0, 5, 6, 7, 8, eos, 0], attention_mask [0, 1, 1, 1, 1, 1, 0], mask [1, 1, 1, 0]. Every tensor field is
    cut by rows (select), the (B, T) ones with the completions."""
    input_ids: torch.Tensor  # (B, P + T) token ids, pad outside the attention mask
    attention_mask: torch.Tensor  # (B, P + T) 1 on real tokens
    prompt_width: int  # P
    mask: torch.Tensor  # (B, T) float, 1 on the completion's tokens: the ones the loss trains on
    engine_logp: torch.Tensor  # (B, T) the engine's log-prob of each sampled token (0 on padding)
    advantages: Optional[torch.Tensor] = None  # (B, T) per token (GRPO: the completion's advantage on each token)
    old_logp: Optional[torch.Tensor] = None  # (B, T) pi_old, when the trainer computes it before the update (mu > 1)
    ref_logp: Optional[torch.Tensor] = None  # (B, T) pi_ref, when there is a KL term

    def __len__(self):
        return len(self.mask)

    def select(self, rows, width=None):
        """The rows `rows` (an index tensor), with completions cut to their first `width` positions."""
        width = self.mask.shape[1] if width is None else width
        cut = {"input_ids": self.prompt_width + width, "attention_mask": self.prompt_width + width}
        return dataclasses.replace(self, **{f.name: value[rows][:, :cut.get(f.name, width)] if value.dim() == 2 else
                                            value[rows] for f in dataclasses.fields(self)
                                            if torch.is_tensor(value := getattr(self, f.name))})


def make_batch(prompts, samples, pad_id, device):
    """Prompt token-id lists and the engine's Samples (one prompt per sample) -> a Batch."""
    prompt_width = max(len(p) for p in prompts)
    width = max(len(sample.token_ids) for sample in samples)
    ids, attention, mask, engine_logp = [], [], [], []
    for prompt, sample in zip(prompts, samples):
        left, right = prompt_width - len(prompt), width - len(sample.token_ids)
        ids.append([pad_id] * left + prompt + sample.token_ids + [pad_id] * right)
        attention.append([0] * left + [1] * (len(prompt) + len(sample.token_ids)) + [0] * right)
        mask.append([1] * len(sample.token_ids) + [0] * right)
        engine_logp.append((sample.logprobs or [0.0] * len(sample.token_ids)) + [0.0] * right)
    return Batch(torch.tensor(ids, device=device), torch.tensor(attention, device=device), prompt_width,
                 torch.tensor(mask, dtype=torch.float32, device=device),
                 torch.tensor(engine_logp, dtype=torch.float32, device=device))


def micro_batches(batch, size):
    """Yield (rows, micro-batch): `batch` cut into micro-batches of `size` rows of similar completion lengths (the rows
    are reordered), each cut to its own longest completion, so that no pass pads a 10-token completion to the batch's
    48 (about half of the trainer's compute on the toy). Which rows share a micro-batch does not change the summed
    gradient. A completion's length is its last trained token's position + 1 (grpo_tools.py masks tool output)."""
    positions = torch.arange(1, batch.mask.shape[1] + 1, device=batch.mask.device, dtype=batch.mask.dtype)
    lengths, order = torch.sort((batch.mask * positions).amax(-1), stable=True)
    widths = lengths[size - 1::size].tolist() + lengths[-1:].tolist()  # one host sync
    for rows, width in zip(order.split(size), widths):
        yield rows, batch.select(rows, max(1, int(width)))  # >= 1: dapo.py's filtering can mask whole rows


# ---- Token log-probs ------------------------------------------------------------------------------------------------


def logprobs_from_logits(logits, tokens, temperature):
    """log pi(t | context) = log_softmax(z / T)_t: the logits z (n, V) of n positions, divided by the sampling
    temperature T (the engine sampled from softmax(z / T)), at the sampled tokens t (n,) -> (n,)."""
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def token_logprobs(model, batch, temperature, accelerator, with_entropy=False):
    """log pi(token) at every completion position of a (micro-)batch, (B, T), with gradient when grad mode is on; and
    each position's entropy, (B, T) without gradient, when with_entropy (else None). The model's own call (its wrappers
    run: DDP, FSDP2, LoRA, checkpointing) gives the last hidden states h, (B, P + T, H); h at position P + t - 1
    predicts completion token t, through the output layer (output_logprobs)."""
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # left-padded prompts: each row counts from 0
    hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                   output_hidden_states=True, logits_to_keep=1).hidden_states[-1]  # (the logits of one position)
    return output_logprobs(model, hidden[:, batch.prompt_width - 1:-1], batch.input_ids[:, batch.prompt_width:],
                           temperature, accelerator, with_entropy)


CHUNK_BYTES = 2**27  # a chunk's float32 logits: 128 MiB (220 positions of Qwen's 151,936-token vocabulary)


def output_logprobs(model, hidden, tokens, temperature, accelerator, with_entropy=False):
    """logprobs_from_logits (and token_entropy) of the hidden states (B, T, H) that predict `tokens` (B, T), a chunk of
    positions at a time, each chunk under torch.utils.checkpoint: a chunk's (positions, V) logits exist while it is
    computed and again in its backward pass; the batch's (B, T, V) never do (10 GB at B x T = 16K and Qwen's V =
    151,936). The same values and gradients as one pass over every position (tests/test_logprobs.py)."""
    logits, vocab_size = output_layer(model, accelerator)  # h (n, H) -> z (n, V), float32, as the model computes it

    def chunk(h, t):  # (n, H), (n,) -> log pi(t) (n,), entropy (n,) or None
        z = logits(h)
        return logprobs_from_logits(z, t, temperature), token_entropy(z, temperature) if with_entropy else None

    (B, T, H), size = hidden.shape, max(1, CHUNK_BYTES // (4 * vocab_size))  # positions per chunk
    chunks = [checkpoint(chunk, h, t, use_reentrant=False) if torch.is_grad_enabled() else chunk(h, t) for h, t in
              zip(hidden.reshape(B * T, H).split(size), tokens.reshape(B * T).split(size))]
    logp = torch.cat([logp for logp, _ in chunks]).view(B, T)
    return logp, torch.cat([entropy for _, entropy in chunks]).view(B, T) if with_entropy else None


@torch.no_grad()
def token_entropy(logits, temperature):
    """H = -sum_v p_v log p_v of p = softmax(z / T) at each position (n,), accurate to ~1e-7 relative where one p_v is
    near 1 (the loss never takes it: a statistic). With d_v = (z_v - max z) / T and s = sum of e^d_v over every v but
    the argmax (whose term is 1): log p_v = d_v - log1p(s) and H = log1p(s) - sum_v e^d_v d_v / (1 + s), two terms
    >= 0, where logsumexp(z) - sum p_v z_v cancels; in float64 pieces of CHUNK_BYTES / 2 bytes, whatever the chunk's
    length (glibc maps a piece that size on its own and hands it back when freed; smaller ones fragment its heap and
    stay resident)."""
    parts = []
    for z in logits.split(max(1, CHUNK_BYTES // (16 * logits.shape[-1]))):
        d = (z.double() - z.amax(-1, keepdim=True)) / temperature
        e = d.exp().scatter_(-1, d.argmax(-1, keepdim=True), 0.0)
        s = e.sum(-1)
        parts.append((torch.log1p(s) - torch.linalg.vecdot(e, d) / (1 + s)).float())
    return torch.cat(parts)


@torch.no_grad()
def batched_logprobs(model, batch, temperature, accelerator, minibatch_size, micro_batch_size):
    """The trainer's log-probs of a whole rollout batch, (B, T), without gradient (pi_old before the update, pi_ref),
    over the micro-batches of update_policy's first epoch: pi_old equals the first mini-batch's pi_theta bit for bit."""
    logp = torch.zeros_like(batch.mask)
    for minibatch in torch.arange(len(batch), device=logp.device).split(minibatch_size):
        for rows, micro in micro_batches(batch.select(minibatch), micro_batch_size):
            micro_logp, _ = token_logprobs(model, micro, temperature, accelerator)
            logp[minibatch[rows], :micro_logp.shape[1]] = micro_logp
    return logp


# ---- Policy update --------------------------------------------------------------------------------------------------


def update_policy(args, model, optimizer, batch, accelerator):
    """mu = num_epochs * num_minibatches optimizer steps on one rollout batch -> (the step's StepStats, what the loss
    took in the last epoch: per micro-batch, its rows and compute_loss's inputs, which the rollout page draws). pi_old
    is batch.old_logp when the loop computed it (mu > 1), else this pass's own detached log-probs (the policy has not
    moved since the rollout: a forward pass saved, as verl and TRL do); the first mini-batch comes in the rollout's
    order, so its ratio is exactly 1. Normalizers count the mini-batch over its micro-batches and processes. A
    non-finite gradient norm raises FloatingPointError before the optimizer step: NaN never reaches the weights."""
    stats, last_epoch = StepStats(), []
    size, mu = len(batch) // args.num_minibatches, args.num_epochs * args.num_minibatches
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
                    logp, entropy = token_logprobs(model, mc, args.temperature, accelerator, with_entropy=True)
                    old_logp = logp.detach() if mc.old_logp is None else mc.old_logp
                    advantages = mc.advantages
                    if args.tis_cap > 0:  # engine/trainer mismatch: a bounded weight w >= 0 on each token's advantage
                        w, bounded = engine_is_weights(old_logp, mc.engine_logp, mc.mask, args.tis_cap, args.tis_mode)
                        advantages = advantages * w
                        stats.add({"policy/tis_bounded_frac": bounded.sum() / num_tokens}, 1 / mu)
                    loss, means, maxes = compute_loss(logp, old_logp, mc.ref_logp, advantages, mc.mask,
                                                      (num_seqs, num_tokens), args)
                    accelerator.backward(loss * accelerator.num_processes)  # DDP/FSDP average; normalizers are global
                if epoch == args.num_epochs - 1:
                    last_epoch.append(dict(rows=rows[micro_rows], logp=logp.detach(), entropy=entropy,
                                           old_logp=old_logp, advantages=advantages, counts=(num_seqs, num_tokens)))
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
    return stats, last_epoch


# ---- Training loop --------------------------------------------------------------------------------------------------


CONSOLE_KEYS = ["charts/reward", "charts/accuracy", "charts/completion_length", "losses/kl", "policy/clip_frac",
                "rollout/logprob_gap_mean", "eval/pass@1_greedy"]


def main(args):
    run = start_run(__file__, args, resolve_args)  # --self_check; checked flags, processes, tokenizer, the task's rows
    args, accelerator, tokenizer, G = run.args, run.accelerator, run.tokenizer, args.num_generations
    scorer = RewardScorer(args.task, args.answer_format, args.run.reward_workers, args.run.reward_timeout,
                          args.run.reward_memory_mb)  # workers (math, rg:) warm up meanwhile
    model, optimizer, ref_model = load_models(args.model, args.learning_rate, args.run, tokenizer, accelerator,
                                              with_reference=args.beta > 0)  # AdamW; pi_ref frozen
    engine = create_engine(args.run, args.model, args.seed + accelerator.process_index,
                           args.max_prompt_length + args.max_new_tokens, run.stop_ids)
    print_memory_estimate(accelerator, engine, [model], [ref_model], args.micro_batch_size, args.max_prompt_length +
                          args.max_new_tokens, args.max_new_tokens)
    evaluation = start_evaluation(args, run, engine, model, scorer)  # before any update: pi_0's samples for the KL
    if args.run.eval_only:
        return run.eval_only(evaluation, scorer)
    page_losses = {"weight": functools.partial(compute_loss, args=args),  # the rollout page's colours: each token's
                   "pg_weight": functools.partial(compute_loss, args=dataclasses.replace(args, beta=0.0))}  # weight
    rank, world = accelerator.process_index, accelerator.num_processes
    local_prompts = args.prompts_per_step // world
    minibatch_size = local_prompts * G // args.num_minibatches  # update_policy's, which pi_old's and pi_ref's follow
    for step in run.steps():  # from the checkpoint's step with --resume
        seconds = {"start": time.time()}
        # 1. Rollout: this process's groups of the step's prompts, drawn from (seed, step) alone (so a resumed run too)
        picks = np.random.default_rng([args.seed, step]).choice(len(run.train_rows), args.prompts_per_step,
                                                                replace=False)
        rows = [run.train_rows[i] for i in picks[rank * local_prompts:(rank + 1) * local_prompts]]
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        samples, seconds["weight_sync"] = generate(engine, model, tokenizer, prompts, G, args.temperature, args.top_p,
                                                   args.max_new_tokens, accelerator, policy_version=step - 1)
        seconds["rollout"] = time.time() - seconds["start"]
        # 2. Reward (checked in workers; the toy at submit) while the trainer computes pi_ref (and pi_old if mu > 1).
        texts = tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True)
        scoring = scorer.submit(texts, [r for r in rows for _ in range(G)])  # rows: a task's verifier may need more
        batch = make_batch([p for p in prompts for _ in range(G)], samples, tokenizer.pad_token_id, accelerator.device)
        kl_in_reward = ref_model is not None and args.kl_estimator == "k1_reward"  # it needs pi_old before the update
        if args.num_epochs * args.num_minibatches > 1 or kl_in_reward:  # or the policy moves before pi_old's last use
            batch.old_logp = batched_logprobs(model, batch, args.temperature, accelerator, minibatch_size,
                                              args.micro_batch_size)
        if ref_model is not None:
            batch.ref_logp = batched_logprobs(ref_model, batch, args.temperature, accelerator, minibatch_size,
                                              args.micro_batch_size)
        accuracy, formats, failures = scorer.result(scoring)  # failures: answers that could not be checked, by kind
        rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
        # 3. Advantages, from every process's rewards (each process holds whole groups).
        if kl_in_reward:  # k1 summed over each completion's tokens, detached, paid from its reward (not logged in it)
            kl = kl_k1(batch.old_logp, batch.ref_logp) * batch.mask
        all_rewards = accelerator.gather(rewards.to(accelerator.device) - (args.beta * kl.sum(-1) if kl_in_reward
                                                                            else 0))
        advantages = compute_advantages(all_rewards, args).view(world, -1)[rank]
        batch.advantages = advantages[:, None] * batch.mask  # A_i on each token of completion i, (B, T)
        # 4. mu optimizer steps on this batch; a NaN stops the run before it reaches the weights or a checkpoint.
        try:
            stats, last_epoch = update_policy(args, model, optimizer, batch, accelerator)
        except FloatingPointError as e:
            raise run.stopped(step, e) from None
        # 5. Log (every process's statistics, combined), evaluate, checkpoint.
        rollout_stats(stats, samples, accuracy, formats, rewards, failures)
        stats.mean(step_times(seconds, scoring, samples))  # time/*, rollout/tokens_per_s (plumbing/run.py)
        stats.max(peak_memory(engine))  # memory/*
        if kl_in_reward:  # the KL the rewards paid, per token (the loss has none)
            stats.add({"losses/kl": kl.sum() / accelerator.reduce(batch.mask.sum(), reduction="sum").clamp(min=1)})
        metrics = {"step": step, **stats.reduce(accelerator), "charts/reward_std": all_rewards.std().item()}
        metrics.update(evaluation(step))  # every --eval_every steps and at the end
        run.page(step, batch, last_epoch, page_losses, samples, dict(accuracy=accuracy, format=formats, reward=rewards))
        run.log(metrics, CONSOLE_KEYS, [r for r in rows for _ in range(G)], texts, rewards)  # a few examples too
        run.save(step, model)  # every --save_every steps and at the end
    run.finish(model, scorer, evaluation)  # final/: the trained policy


# ---- Run setup (infrastructure: skip on a first read) ---------------------------------------------------------------


def resolve_args(args, num_processes):
    """The defaults that depend on the model (each field's doc states its rule), then every check: bad input becomes
    one line that says what to change, before any model loads (plumbing/run.py start_run calls it). A GGUF model is
    converted here on first use."""
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
    check_run_args(args.run, args.total_steps, args.model, args.task)
    check_batch_layout(args.prompts_per_step, args.num_generations, args.num_minibatches, args.micro_batch_size,
                       num_processes)
    check_algorithm_args(args, num_processes)
    args.model = resolve_model(args.model)  # a GGUF file: converted to a model folder on first use
    return args


# ---- Evaluation (infrastructure: skip on a first read) --------------------------------------------------------------


def start_evaluation(args, run, engine, model, scorer):
    """What main() calls at each step (plumbing/evaluation.py Evaluation): held-out pass@1 greedy and sampled, pass@k,
    the greedy format rate, and what training changed beyond its task (--prior_tasks; the forward KL to pi_0, whose
    samples it draws now), every process sampling through generate() as the rollouts do."""
    tokenizer, accelerator = run.tokenizer, run.accelerator

    def sample(prompts, n, temperature, top_p, policy_version):  # -> texts, Samples, masks (None: every token's)
        samples, _ = generate(engine, model, tokenizer, prompts, n, temperature, top_p, args.max_new_tokens,
                              accelerator, policy_version)
        return tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True), samples, None

    def sequence_logprobs(prompts, samples, masks):  # log pi(completion | prompt), summed over its tokens; token counts
        batch = make_batch(prompts, samples, tokenizer.pad_token_id, accelerator.device)
        logp = batched_logprobs(model, batch, args.temperature, accelerator, len(batch), args.micro_batch_size)
        return (logp * batch.mask).sum(-1), batch.mask.sum(-1)

    # the HF decode loop takes 64 prompts at a time; vLLM batches itself (a greedy and a sampled call: one wake each)
    return Evaluation(run, scorer, sample, sequence_logprobs, chunk_size=64 if engine.llm is None else None)


# ---- Step statistics (infrastructure: what each logged key is, and how processes combine it) ------------------------


class StepStats:
    """A step's statistics, kept by how processes combine them (docs/metrics.md has every key). add(): shares of a mean
    over every process, already divided by the global count, so the shares add up to it (a clip fraction: clipped
    tokens / the mini-batch's tokens over all processes), or counts to total. mean(): one value per process, averaged
    over processes (a gradient norm: the same on every process). max(): maxima."""

    def __init__(self):
        self.sums, self.means, self.maxes = {}, {}, {}

    def add(self, values, scale=1.0):
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * scale

    def mean(self, values, scale=1.0):
        for key, value in values.items():
            self.means[key] = self.means.get(key, 0.0) + value * scale

    def max(self, values):
        for key, value in values.items():
            self.maxes[key] = torch.maximum(self.maxes[key], value) if key in self.maxes else value

    def reduce(self, accelerator):
        """{key: value} over every process, in one gather: one host sync."""
        how = {**{k: "sum" for k in self.sums}, **{k: "mean" for k in self.means}, **{k: "max" for k in self.maxes}}
        values = {**self.sums, **self.means, **self.maxes}
        stacked = torch.stack([torch.as_tensor(values[k], dtype=torch.float32, device=accelerator.device).reshape(())
                               for k in how])
        gathered = accelerator.gather(stacked[None])  # (processes, keys)
        return dict(zip(how, torch.stack([getattr(gathered[:, i], h)() for i, h in enumerate(how.values())]).tolist()))


def rollout_stats(stats, samples, accuracy, formats, rewards, failures):
    """The rollout's statistics, averaged over processes: the reward and its parts, completion lengths (EOS included),
    the fraction cut at --max_new_tokens and with no answer to check, the long tail's idle share of the decode steps;
    answers that could not be checked, by kind, counted over processes."""
    lengths = torch.tensor([float(len(sample.token_ids)) for sample in samples])
    stats.mean({"charts/reward": rewards.mean(), "charts/accuracy": np.mean(accuracy),
                "charts/format": np.mean(formats), "charts/completion_length": lengths.mean(),
                "charts/truncated_frac": np.mean([sample.truncated for sample in samples]),
                "charts/no_answer_frac": failures["no_answer"] / len(samples),
                "rollout/tail_frac": tail_fraction(lengths.tolist())})
    stats.max({"charts/completion_length_max": lengths.max()})
    stats.add({f"charts/reward_{kind}": n for kind, n in failures.items() if kind != "no_answer"})


if __name__ == "__main__":
    main(tyro.cli(Args))
