"""The math the algorithm scripts share, as small pure functions that read like their formulas: KL estimators,
advantage normalization, whitening and per-token rewards, the engine/trainer importance weights, pass@k. Tensors in,
tensors out; no model, no engine, no process group (a function that needs a global statistic takes a function that
sums over processes)."""

import numpy as np
import torch

# --- KL estimators, elementwise in log space: delta = logp - ref_logp, samples drawn from pi_theta --------------------
# Which gradient each one gives depends on where it is placed (Tang & Munos arXiv 2506.09477):
#   k1 in the reward (detached, score-function gradient): grad KL(pi||ref), correct; PPO, REINFORCE++ v1.
#   k1 as a loss: zero expected gradient: regularizes nothing.
#   k2 as a loss: grad KL(pi||ref) per token, correct.
#   k3 as a loss (GRPO paper): grad KL(ref||pi), the *forward* KL: biased for the stated objective.
#   rho * k3 as a loss with rho = pi/pi_old differentiable (DeepSeek-V3.2), or k3's value with k2's gradient (verl's
#   "k3+"): grad KL(pi||ref), correct (both in grpo_kl.py).


def kl_k1(logp, ref_logp):
    """k1 = log pi - log ref: unbiased value, high variance; belongs in the reward, not the loss."""
    return logp - ref_logp


def kl_k2(logp, ref_logp):
    """k2 = (log pi - log ref)^2 / 2: biased value; as a loss its gradient is the per-token reverse-KL gradient."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp, ref_logp):
    """k3 = ref/pi - 1 - log(ref/pi) >= 0: unbiased, low-variance value; as a loss its gradient is the forward-KL
    gradient (grpo_kl.py has the estimators whose gradient is the reverse KL's)."""
    log_ratio = (ref_logp - logp).clamp(-20, 20)
    return torch.exp(log_ratio) - 1 - log_ratio


# --- Advantages ------------------------------------------------------------------------------------------------------


def group_centered(rewards):
    """rewards (num_groups, G) -> R - mean of its group, (num_groups, G). A group of equal rewards gets exactly 0: the
    float32 mean of equal values can be 1 ulp off, and that error divided by a std of 0 (+ eps) would push every
    completion of an all-wrong group down a little each step."""
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, 0.0, rewards - rewards.mean(dim=1, keepdim=True))


def group_zscore(rewards, eps=1e-6):
    """rewards (num_groups, G) -> (R - mean of its group) / (std of its group + eps), (num_groups, G): GRPO's
    advantage. The std is the unbiased (Bessel) one, as in verl, TRL and OpenRLHF."""
    return group_centered(rewards) / (rewards.std(dim=1, keepdim=True) + eps)


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


# --- Evaluation ------------------------------------------------------------------------------------------------------


def pass_at_k(num_samples, num_correct, k):
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al., arXiv 2107.03374, eq. 1):
    1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement include a correct one,
    computed as a product so no binomial overflows. pass@1 is c / n."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))
