"""Tensor functions shared by the algorithm scripts: KL estimators, advantages, whitening, loss aggregation, the
rollout batch's layout (padding rows, cutting micro-batches), and the pass@k estimator of evaluation. No model and no
engine here; only micro_batches, the high-entropy threshold, the covariance tokens and explained_variance read values
back to the host.
"""

import numpy as np
import torch

# --- KL estimators, elementwise in log space: delta = logp - ref_logp, samples drawn from pi_theta --------------------
# Which gradient each one gives depends on where it is placed (Tang & Munos arXiv 2506.09477):
#   k1 in the reward (detached, score-function gradient): grad KL(pi||ref), correct; PPO, REINFORCE++ v1.
#   k1 as a loss: zero expected gradient: regularizes nothing.
#   k2 as a loss: grad KL(pi||ref) per token, correct.
#   k3 as a loss (GRPO paper): grad KL(ref||pi), the *forward* KL: biased for the stated objective.
#   rho * k3 as a loss with rho = pi/pi_old differentiable (DeepSeek-V3.2): grad KL(pi||ref), correct, off-policy too.
#   k3 value with the k2 gradient (verl's "k3+", straight-through): correct gradient, k3's low-variance value.


def kl_k1(logp, ref_logp):
    """k1 = log pi - log ref: unbiased value, high variance; belongs in the reward, not the loss."""
    return logp - ref_logp


def kl_k2(logp, ref_logp):
    """k2 = (log pi - log ref)^2 / 2: biased value; as a loss its gradient is the per-token reverse-KL gradient."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp, ref_logp, straight_through=False):
    """k3 = ref/pi - 1 - log(ref/pi) >= 0: unbiased, low-variance value; as a loss its gradient is the forward-KL
    gradient. straight_through=True keeps the k3 value but backpropagates the k2 gradient (correct reverse KL)."""
    log_ratio = (ref_logp - logp).clamp(-20, 20)
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    if straight_through:
        k2 = kl_k2(logp, ref_logp)
        return k2 - k2.detach() + k3.detach()
    return k3


def kl_k3_importance_weighted(logp, ref_logp, old_logp):
    """(pi/pi_old) * k3 with the ratio differentiable: the reverse-KL gradient, on- and off-policy (DeepSeek-V3.2)."""
    return torch.exp((logp - old_logp).clamp(-20, 20)) * kl_k3(logp, ref_logp)


# --- Advantages ------------------------------------------------------------------------------------------------------


def group_advantages(rewards, scale="group", eps=1e-6):
    """rewards (num_groups, G) -> advantages of the same shape.

    scale="group": (R - mean_G) / (std_G + eps), GRPO; "batch": (R - mean_G) / (std_batch + eps), Lite PPO;
    "none": R - mean_G, Dr. GRPO. The std is the unbiased (Bessel) one, as in verl, TRL and OpenRLHF. A group of
    equal rewards gets advantage 0 exactly: the float32 mean of equal values can be 1 ulp off, and dividing that by
    std + eps (std 0) would push every completion of an all-wrong group down a little each step.
    """
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    centered = torch.where(all_equal, 0.0, rewards - rewards.mean(dim=1, keepdim=True))
    if scale == "none":
        return centered
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.ones_like(rewards[:, :1])
    elif scale == "batch":
        std = rewards.std()
    else:
        raise ValueError(f"unknown reward scaling {scale!r}: use group, batch or none")
    return centered / (std + eps)


def decoupled_group_advantages(parts, weights, num_generations, eps=1e-6):
    """GDPO (arXiv 2601.05242): each reward function z-scored within its group first, then the weighted sum z-scored
    over the batch; parts (N, K): K rewards of N completions in consecutive groups, weights (K,) -> advantages (N,).

    GRPO z-scores the weighted sum instead, which gives every group with two distinct totals the same advantages
    (0/1 accuracy with 0/1 format: (0,0) vs (1,1) and (0,0) vs (1,0) both become -+0.707). As the paper: unbiased std
    plus eps at both levels, every completion weighing the same in the batch step (TRL's normalize_then_sum, with eps
    1e-4). The default eps 1e-6 is that of verl's GDPO group step; verl's batch step differs (rsqrt(var + 1e-8), and
    rollouts weighted by their token counts)."""
    per_reward = torch.stack([group_advantages(parts[:, k].reshape(-1, num_generations), "group", eps).reshape(-1)
                              for k in range(parts.shape[-1])], dim=-1)
    summed = per_reward @ weights.to(per_reward)  # weights may come from the CPU, the parts from the accelerator
    return (summed - summed.mean()) / (summed.std() + eps)


def entropy_threshold(entropy, mask, top_frac, gather_padded=None):
    """The entropy at or above which lie the top_frac fraction of valid tokens (their 1 - top_frac quantile), for
    training on high-entropy tokens only (arXiv 2506.01939). gather_padded, a function that collects every process's
    1-D tensor padded with NaN, makes it the threshold over all processes' tokens."""
    valid = entropy[mask.bool()].float()
    if gather_padded is not None:
        valid = gather_padded(valid)
        valid = valid[~torch.isnan(valid)]
    return linear_quantile(valid, 1 - top_frac)


def linear_quantile(values, q):
    """torch.quantile(values, q) for a 1-D tensor (linear interpolation between the two nearest ranks) without its
    limit of 2**24 elements, which one paper-scale mini-batch of tokens over all processes exceeds."""
    position = q * (values.numel() - 1)
    lower = int(position)  # floor: position >= 0
    below = torch.kthvalue(values, lower + 1).values  # kthvalue counts from 1
    above = torch.kthvalue(values, min(lower + 2, values.numel())).values
    return torch.lerp(below, above, torch.tensor(position - lower, dtype=values.dtype, device=values.device))


def covariance_tokens(logp, advantages, mask, frac, bounds=None, eligible=None):
    """The tokens the entropy-mechanism paper's Clip-Cov and KL-Cov act on (arXiv 2505.22617, §4), by the token-wise
    covariance of log-prob and advantage, Cov_t = (log pi_t - mean log pi) (A_t - mean A), means over the valid
    tokens: k = max(1, int(frac * valid tokens)) of them, the k of highest Cov_t (KL-Cov), or with bounds = (low,
    high) k drawn uniformly among the eligible tokens whose Cov_t lies inside (low, high) (Clip-Cov; fewer when fewer
    qualify). logp, mask, eligible (default: mask): (B, T); advantages: (B,). Returns a (B, T) bool mask. Like the
    authors' code (in verl), a call sees one micro-batch: its means and k are the micro-batch's."""
    valid = mask.bool()
    logp = logp.detach()
    adv = advantages.detach().unsqueeze(-1).expand_as(logp)
    cov = (logp - logp[valid].mean()) * (adv - adv[valid].mean())
    k = max(1, int(frac * int(valid.sum())))  # one host sync
    if bounds is None:
        candidates = valid.nonzero()  # row-major, as cov[valid]
        chosen = candidates[cov[valid].topk(min(k, len(candidates))).indices]
    else:
        inside = valid & (cov > bounds[0]) & (cov < bounds[1])
        candidates = (inside if eligible is None else inside & eligible.bool()).nonzero()
        chosen = candidates[torch.randperm(len(candidates), device=cov.device)[:k]]
    selected = torch.zeros_like(valid)
    selected[chosen[:, 0], chosen[:, 1]] = True
    return selected

def masked_whiten(values, mask, shift_mean=True, unbiased=True, eps=1e-8, all_reduce=None):
    """Token-weighted whitening over all valid tokens (REINFORCE++, PPO): long sequences weigh more.

    unbiased=True applies Bessel's correction on the token count (verl masked_whiten); False is OpenRLHF's population
    variance. shift_mean=False keeps the mean and scales the spread around it, (v - mean) / std + mean, as
    lm-human-preferences' whiten(shift_mean=False) does to rewards. all_reduce (a function summing a tensor over
    processes) makes the statistics those of every process's tokens: one all-reduce of three float64 sums.
    A single valid token has variance 0 (no Bessel correction on a count of 1): it whitens to 0, not NaN.
    """
    mask = mask.to(values.dtype)
    sums = torch.stack([mask.sum(), (values * mask).sum(), (values ** 2 * mask).sum()]).double()
    if all_reduce is not None:
        sums = all_reduce(sums)
    count, total, squares = sums
    mean = total / count
    var = (squares - count * mean ** 2).clamp(min=0) / ((count - 1).clamp(min=1) if unbiased else count)
    whitened = ((values - mean) * torch.rsqrt(var + eps)).to(values.dtype)
    return whitened if shift_mean else whitened + mean.to(values.dtype)


def token_rewards(scores, mask, kl=None, beta=0.0):
    """(B, T) per-token rewards of REINFORCE++ and PPO: each completion's score on its last token (EOS, or where it
    was cut), -beta * KL (detached) on every token, 0 after the end."""
    last = mask.sum(-1).long() - 1
    rewards = torch.zeros_like(mask).scatter(-1, last.unsqueeze(-1), scores.unsqueeze(-1).to(mask.dtype))
    if kl is not None:
        rewards = rewards - beta * kl.detach()
    return rewards * mask


def explained_variance(predictions, targets, mask, all_reduce=None):
    """1 - Var(targets - predictions) / Var(targets) over the valid tokens (of every process with all_reduce): 1 when
    a critic predicts its returns exactly, 0 when it predicts no better than their mean; NaN when the targets are
    constant."""
    diff = targets - predictions
    sums = torch.stack([mask.sum(), (targets * mask).sum(), (targets ** 2 * mask).sum(), (diff * mask).sum(),
                        (diff ** 2 * mask).sum()]).double()
    count, t1, t2, d1, d2 = all_reduce(sums) if all_reduce is not None else sums
    var_targets = t2 / count - (t1 / count) ** 2
    return (1 - (d2 / count - (d1 / count) ** 2) / var_targets).item() if var_targets > 1e-12 else float("nan")


# --- Loss aggregation ------------------------------------------------------------------------------------------------

LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(per_token, mask, mode, num_seqs, num_tokens, max_len=None):
    """Reduce a (B, T) per-token loss over the mask, dividing by counts of the whole optimizer mini-batch.

    num_seqs / num_tokens are the sequence and token counts of the whole mini-batch across micro-batches and ranks,
    so summing the results of every micro-batch (and ranks) gives exactly the full-batch loss:
      token-mean:              sum(M l) / num_tokens                              (DAPO, verl/TRL default)
      seq-mean-token-mean:     sum_i (sum_t M l / |o_i|) / num_seqs              (GRPO paper, GSPO)
      seq-mean-token-sum:      sum(M l) / num_seqs
      seq-mean-token-sum-norm: sum(M l) / (num_seqs * max_len)                   (Dr. GRPO's constant normalizer)
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("loss aggregation seq-mean-token-sum-norm needs max_len (Dr. GRPO's constant: the "
                             "generation budget, max_new_tokens)")
        return masked.sum() / (num_seqs * max_len)
    raise ValueError(f"unknown loss aggregation {mode!r}: use one of {LOSS_AGGREGATIONS}")


# --- The engine/trainer mismatch: importance weights pi_old / pi_engine, bounded -------------------------------------
IS_MODES = ("token-truncate", "token-mask", "seq-truncate", "seq-mask")


def engine_is_weights(old_logp, engine_logp, mask, cap, mode="token-truncate"):
    """Weights for tokens sampled by an engine whose probabilities differ from the trainer's (vLLM in bf16, another
    kernel): r_t = pi_old(o_t) / pi_engine(o_t) per token, rho = prod_t r_t per sequence, bounded by cap C:
        token-truncate  w_t = min(r_t, C)                          truncated IS (TIS)
        token-mask      w_t = r_t if 1/C <= r_t <= C, else 0       masked IS per token (IcePop, arXiv 2510.18855)
        seq-truncate    w_t = min(rho, C)                          sequence-level TIS
        seq-mask        w_t = rho if 1/C <= rho <= C, else 0       sequence-level masked IS (MIS)
    Returns (weights (B, T), detached; bounded (B, T): the valid tokens whose weight was truncated or masked). The
    ratios are taken in log space and bounded at e^+-20 (beyond any useful cap), so a long sequence never overflows.
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}: use one of {', '.join(IS_MODES)}")
    log_ratio = (old_logp - engine_logp) * mask
    if mode.startswith("seq"):
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_logp)
    ratio = torch.exp(log_ratio.clamp(-20, 20)).detach()
    if mode.endswith("truncate"):
        bounded = ratio > cap
        weights = ratio.clamp(max=cap)
    else:
        bounded = (ratio > cap) | (ratio < 1 / cap)
        weights = ratio * ~bounded
    return weights, bounded & mask.bool()


# --- The rollout batch: [left-padded prompt | right-padded completion] rows ---------------------------------------


def make_batch(prompts, samples, pad_id, device):
    """Pad [prompt | completion] rows (prompt token ids, utils.hf_engine.Sample): prompts left-padded to one width,
    completions right-padded to another."""
    prompt_width = max(len(p) for p in prompts)
    completion_width = max(len(sample.token_ids) for sample in samples)
    rows, attn, cmask, engine_logp = [], [], [], []
    for prompt, (ids, logprobs) in zip(prompts, ((sample.token_ids, sample.logprobs) for sample in samples)):
        left, right = prompt_width - len(prompt), completion_width - len(ids)
        rows.append([pad_id] * left + prompt + ids + [pad_id] * right)
        attn.append([0] * left + [1] * (len(prompt) + len(ids)) + [0] * right)
        cmask.append([1] * len(ids) + [0] * right)
        engine_logp.append((logprobs or [0.0] * len(ids)) + [0.0] * right)
    as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
    return {"input_ids": as_tensor(rows, torch.long), "attention_mask": as_tensor(attn, torch.long),
            "completion_mask": as_tensor(cmask, torch.float32), "engine_logp": as_tensor(engine_logp, torch.float32),
            "prompt_width": prompt_width}


def slice_batch(batch, idx):
    return {k: v[idx] if torch.is_tensor(v) else v for k, v in batch.items()}


def micro_batches(batch, rows, micro_batch_size):
    """Split `rows` (one mini-batch) into micro-batches of similar completion lengths, each cut to its own longest
    completion: with lengths sorted, no pass pads a 10-token completion to the batch's 48 (that compute was about half
    of the trainer's on the toy). Which rows share a micro-batch does not change the accumulated gradient. Yields
    (the micro-batch's rows, the micro-batch); [prompt | completion] tensors are cut after prompt_width + width, the
    per-token (B, T) ones after width. A completion's length is its last masked-in token's position + 1 (tool output
    in grpo_tools.py is masked out between trained tokens)."""
    mask = batch["completion_mask"][rows]
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=mask.dtype)
    lengths, order = torch.sort((mask * positions).amax(-1), stable=True)
    widths = lengths[micro_batch_size - 1::micro_batch_size].tolist() + lengths[-1:].tolist()  # one host sync
    for chunk, width in zip(rows[order].split(micro_batch_size), widths):
        width = max(1, int(width))  # >= 1: DAPO's filtering can mask whole rows
        cut = {"input_ids": batch["prompt_width"] + width, "attention_mask": batch["prompt_width"] + width}
        yield chunk, {k: v[:, :cut.get(k, width)] if torch.is_tensor(v) and v.dim() == 2 else v
                      for k, v in slice_batch(batch, chunk).items()}


def pass_at_k(num_samples, num_correct, k):
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al., arXiv 2107.03374, eq. 1):
    1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement include a correct one,
    computed as a product so no binomial overflows. pass@1 is c / n."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))
