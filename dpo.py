"""DPO: Direct Preference Optimization (Rafailov et al., arXiv 2305.18290, eq. 7), with pairs from a file, from the
initial policy (offline) or from the current one (online, arXiv 2402.04792).

For pairs (x, y_w, y_l) of a prompt, a preferred (chosen) and a dispreferred (rejected) completion, minimize

  L(theta) = -1/N sum_(x, y_w, y_l) log sigmoid( beta [ (log pi_theta(y_w|x) - log pi_ref(y_w|x))
                                                       - (log pi_theta(y_l|x) - log pi_ref(y_l|x)) ] )

  log pi(y|x) = sum_t log pi(y_t | x, y_<t)   the completion's token log-probs summed (temperature 1)
  pi_ref                                      the frozen initial policy (under LoRA: the adapters switched off)
  N                                           the pairs of the optimizer mini-batch, over micro-batches and processes

beta r(x, y) = beta (log pi_theta(y|x) - log pi_ref(y|x)) is DPO's implicit reward; the loss is the Bradley-Terry
likelihood of the preferences under it. Its gradient is -beta/N sum sigmoid(-beta Delta) (grad log pi(y_w|x) - grad log
pi(y_l|x)), Delta the bracket: at theta = ref, Delta = 0, the loss is log 2 and the gradient -beta/(2N) sum (grad log
pi(y_w|x) - grad log pi(y_l|x)); a pair the policy already ranks right (Delta > 0) weighs less. Worked example (beta
0.1): a pair with log-prob ratios +1.5 (chosen) and -0.5 (rejected) has Delta = 2, loss -log sigmoid(0.2) = 0.5981,
dL/dDelta = -0.1 (1 - sigmoid(0.2)) = -0.04502; its implicit rewards are 0.15 and -0.05, margin 0.2.

Where the pairs come from (--data):
- file: preference data in TRL's format (--pairs: a local .jsonl/.parquet file or a hub dataset name; columns prompt,
  chosen, rejected; plain text, or conversational lists of {role, content} messages).
- offline: at the start, G samples of each of --offline_prompts training prompts from the initial policy (the paper's
  pi_SFT), scored by the task's verifiable reward: a correct sample chosen, an incorrect one rejected; a prompt without
  both makes no pair (--pairs_by reward: the sample of the highest reward chosen, of the lowest rejected, a pair
  wherever the two differ, as online iterative DPO's best-of-n and worst-of-n, arXiv 2405.07863; with the
  format reward, a formatted wrong answer is preferred to an unformatted one). The pool is saved in the run's folder
  (a resumed run reads it back); each step draws its pairs from it.
- online: pairs made the same way from the current policy's samples of each step's prompts (online DPO); a prompt
  without a pair keeps its place with weight 0. Offline and online differ in which policy sampled, what the question
  whether on-policy data forgets less needs (arXiv 2509.04259).
On the embedded toy, whose pairs differ in a digit or two, offline pairs at beta 0.1 collapse (the chosen log-probs
fall with the rejected ones: likelihood displacement, arXiv 2410.08847) and learn at --beta 3 --learning_rate 1e-4;
online pairs learn at the defaults (docs/algorithms.md).

Reading order, one step (blocks whose header says "infrastructure" are what a first read skips): main(), generate() and
choose_pairs() (or load_preferences(), utils/tasks.py), make_batch(), update_policy() with pair_micro_batches(),
token_logprobs() and compute_loss().

What `diff grpo.py dpo.py` shows: the DPO flags (beta 0.1, the pair sources), choose_pairs and compute_loss on the
pairs' summed log-probs, the batch of chosen then rejected rows and micro-batches that keep a pair together, the
update with its TRL-named metrics and no importance weights, and the training loop that makes, reads or loads the
pairs; the policy is never sampled for the loss (no ratio, no clip, no engine/trainer weights).
"""

import dataclasses
import os
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
from utils.tasks import TOY_MODEL_DIR, TOY_TASKS, is_toy_shaped, load_preferences


@dataclass
class Args:
    # DPO
    beta: float = 0.1
    """beta: the implicit reward's scale, beta (log pi_theta - log pi_ref); the lower, the farther from pi_ref"""
    data: Literal["offline", "online", "file"] = "offline"
    """where the pairs come from: the initial policy's samples (offline), the current policy's (online), --pairs"""
    pairs: Optional[str] = None
    """--data file: a local .jsonl/.parquet file, or a hub dataset name, of prompt, chosen, rejected rows (TRL's
    format)"""
    num_generations: int = 8
    """G, samples per prompt that a pair is chosen from (offline, online)"""
    pairs_by: Literal["correctness", "reward"] = "correctness"
    """offline, online: a correct sample chosen and an incorrect one rejected, or (reward) the highest- and the
    lowest-reward sample of the G"""
    offline_prompts: int = 1024
    """offline: the training prompts whose samples make the pool of pairs at the start (each step draws its pairs
    from the pool)"""
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
    """prompts per step, over all processes: a pair each (offline, online: of G samples; a prompt may make none)"""
    temperature: float = 1.0
    """sampling temperature of the samples pairs are made of (the loss takes the model's log-probs at 1)"""
    top_p: float = 1.0
    """nucleus sampling of the samples pairs are made of"""
    # optimization
    learning_rate: Optional[float] = None
    """AdamW learning rate; None: 5e-4 for the embedded model (and models trained from it), else 1e-6"""
    total_steps: int = 200
    """training steps, each on a new batch of pairs"""
    num_epochs: int = 1
    """passes over each step's pairs; mu = num_epochs * num_minibatches optimizer steps per step"""
    num_minibatches: int = 1
    """optimizer steps per pass over a step's pairs"""
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward pass (gradient accumulation), two per pair; None: twice the largest divisor of a
    process's pairs per mini-batch (prompts_per_step / processes / num_minibatches) up to 16 for the embedded model,
    else 8"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
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
    """The algorithm's own one-line errors (resolve_args below runs the checks every script shares)."""
    if args.beta <= 0:
        raise ValueError(f"--beta {args.beta}: must be > 0 (the implicit reward's scale)")
    if (args.data == "file") != (args.pairs is not None):
        raise ValueError("--data file reads --pairs (a preference file or hub dataset); --pairs is --data file's only")
    if args.data == "file" and args.pairs_by != "correctness":
        raise ValueError(f"--pairs_by {args.pairs_by}: chooses among sampled completions (--data offline, online); "
                         "a --pairs file's pairs are given")
    if args.data != "file" and args.num_generations < 2:
        raise ValueError(f"--num_generations {args.num_generations}: a pair needs >= 2 samples of a prompt")
    if args.data == "offline" and args.offline_prompts < num_processes:
        raise ValueError(f"--offline_prompts {args.offline_prompts}: at least one per process ({num_processes})")


def choose_pairs(accuracy, rewards, num_generations, by="correctness"):
    """Per group of G = num_generations samples of one prompt: (chosen, rejected) sample indices, the correct sample
    of the highest reward and the incorrect one of the lowest (the first of equals), or None when the group has no
    correct or no incorrect sample. Example (G = 4): accuracy (0, 1, 1, 0), rewards (0.1, 1.1, 1.0, 0) -> (1, 3).
    by="reward": the highest- and the lowest-reward sample, or None when all rewards are equal; accuracy (0, 0, 0, 0),
    rewards (0, 0.1, 0, 0.1) -> (1, 0)."""
    pairs = []
    for start in range(0, len(accuracy), num_generations):
        group = range(start, start + num_generations)
        right, wrong = [i for i in group if accuracy[i] == 1], [i for i in group if accuracy[i] != 1]
        if by == "reward":  # the best of the group against its worst
            right = wrong = list(group) if len({rewards[i] for i in group}) > 1 else []
        pairs.append((max(right, key=lambda i: rewards[i]), min(wrong, key=lambda i: rewards[i]))
                     if right and wrong else None)
    return pairs


def compute_loss(logp, ref_logp, mask, weights, num_pairs, args):
    """L(theta) on one micro-batch of n pairs, as its share of the optimizer mini-batch's loss: summed over the
    mini-batch's micro-batches and processes, the shares give that loss exactly.

    logp (2n, T), with gradient, and ref_logp (2n, T): token log-probs of the n chosen completions, then of the n
    rejected ones (pair i: rows i and n + i); mask (2n, T); weights (n,): 1 on a pair, 0 on a placeholder (a prompt
    without a pair keeps its place, so every process runs as many passes); num_pairs: the pairs of the whole
    mini-batch, over every micro-batch and process. args: --beta. Returns (loss, means: TRL's statistics as shares of
    their mini-batch mean)."""
    chosen, rejected = (logp * mask).sum(-1).chunk(2)  # log pi(y|x): the completion's tokens summed
    ref_chosen, ref_rejected = (ref_logp * mask).sum(-1).chunk(2)
    chosen_reward, rejected_reward = args.beta * (chosen - ref_chosen), args.beta * (rejected - ref_rejected)
    loss = -(torch.nn.functional.logsigmoid(chosen_reward - rejected_reward) * weights).sum() / num_pairs
    with torch.no_grad():
        share = lambda x: (x.detach() * weights).sum() / num_pairs  # noqa: E731
        means = {"rewards/chosen": share(chosen_reward), "rewards/rejected": share(rejected_reward),
                 "rewards/margins": share(chosen_reward - rejected_reward),
                 "rewards/accuracies": share((chosen_reward > rejected_reward).float()),
                 "logps/chosen": share(chosen), "logps/rejected": share(rejected)}
    return loss, means


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


def pair_micro_batches(batch, size):
    """Yield (pairs, micro-batch) for a Batch of n chosen rows then n rejected rows: micro-batches of size // 2 pairs
    of similar lengths (the pairs are reordered), each holding its pairs' chosen rows then their rejected rows, cut to
    its longest completion: a pair's two completions always share a pass (the loss needs both)."""
    n = len(batch) // 2
    positions = torch.arange(1, batch.mask.shape[1] + 1, device=batch.mask.device, dtype=batch.mask.dtype)
    lengths = (batch.mask * positions).amax(-1)
    _, order = torch.sort(torch.maximum(lengths[:n], lengths[n:]), stable=True)
    for pairs in order.split(max(1, size // 2)):
        rows = torch.cat([pairs, pairs + n])
        yield pairs, batch.select(rows, max(1, int(lengths[rows].max())))


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


def update_policy(args, model, optimizer, batch, weights, accelerator):
    """mu = num_epochs * num_minibatches optimizer steps on one batch of pairs (batch: n chosen rows, then their n
    rejected rows; batch.ref_logp: pi_ref's token log-probs; weights (n,): 1 on a pair, 0 on a placeholder) -> the
    step's StepStats. The loss's normalizer counts the mini-batch's pairs over its micro-batches and processes; a
    mini-batch with none takes no optimizer step (AdamW's moments would move the weights on a zero gradient). A
    non-finite gradient norm raises FloatingPointError before the optimizer step: NaN never reaches the weights."""
    stats, n = StepStats(), len(weights)
    size, mu = n // args.num_minibatches, args.num_epochs * args.num_minibatches
    for epoch in range(args.num_epochs):
        order = torch.arange(n) if epoch == 0 else torch.randperm(n)
        for k, pairs in enumerate(order.to(accelerator.device).split(size)):
            minibatch, minibatch_weights = batch.select(torch.cat([pairs, pairs + n])), weights[pairs]
            num_pairs = accelerator.reduce(minibatch_weights.sum(), reduction="sum")
            if num_pairs == 0:  # no pair on any process: nothing to learn from (one host sync per mini-batch)
                continue
            micro = list(pair_micro_batches(minibatch, args.micro_batch_size))
            for j, (micro_pairs, mc) in enumerate(micro):
                with gradient_sync(accelerator, model, last_micro_batch=j == len(micro) - 1):  # DDP: in the last only
                    logp, entropy = token_logprobs(model, mc, 1.0, accelerator, with_entropy=True)
                    w = minibatch_weights[micro_pairs]
                    loss, means = compute_loss(logp, mc.ref_logp, mc.mask, w, num_pairs, args)
                    accelerator.backward(loss * accelerator.num_processes)  # DDP/FSDP average; normalizers are global
                trained = mc.mask * torch.cat([w, w])[:, None]  # statistics: the mean over the mu optimizer steps
                tokens = accelerator.reduce(trained.sum(), reduction="sum").clamp(min=1)
                stats.add({**means, "losses/dpo": loss.detach(), "losses/entropy": (entropy * trained).sum() / tokens},
                          1 / mu)
                if epoch == 0 and k == 0:  # at step 1 pi_theta = pi_ref: every log-ratio exactly 0 (the self-check's)
                    logratio = ((logp.detach() - mc.ref_logp) * mc.mask).sum(-1)
                    stats.max({"policy/first_minibatch_logratio_max": logratio.abs().max()})
            grad_norm = clip_gradients(accelerator, model, args.max_grad_norm)
            if not torch.isfinite(grad_norm):  # one host sync per optimizer step
                raise FloatingPointError(f"non-finite gradient norm in epoch {epoch}, mini-batch {k}")
            stats.mean({"policy/grad_norm": grad_norm}, 1 / mu)
            stats.add({"dpo/pairs_trained": num_pairs / accelerator.num_processes})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return stats


# ---- Training loop --------------------------------------------------------------------------------------------------


CONSOLE_KEYS = ["losses/dpo", "rewards/margins", "rewards/accuracies", "dpo/pairs_made", "eval/pass@1_greedy",
                "eval/forward_kl"]


def main(args):
    run = start_run(__file__, args, resolve_args)  # --self_check; checked flags, processes, tokenizer, the task's rows
    args, accelerator, tokenizer, G = run.args, run.accelerator, run.tokenizer, args.num_generations
    preferences = None
    if args.data == "file":  # the pairs' rows, checked before any model loads
        try:
            preferences, summary = load_preferences(args.pairs, tokenizer, args.answer_format, args.instruction,
                                                    args.max_prompt_length, args.max_new_tokens)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        accelerator.print(summary)
    scorer = RewardScorer(args.task, args.answer_format, args.run.reward_workers, args.run.reward_timeout,
                          args.run.reward_memory_mb)  # workers (math, rg:) warm up meanwhile
    model, optimizer, ref_model = load_models(args.model, args.learning_rate, args.run, tokenizer, accelerator,
                                              with_reference=True)  # AdamW; pi_ref frozen
    engine = create_engine(args.run, args.model, args.seed + accelerator.process_index,
                           args.max_prompt_length + args.max_new_tokens, run.stop_ids)
    print_memory_estimate(accelerator, engine, [model], [ref_model], args.micro_batch_size, args.max_prompt_length +
                          args.max_new_tokens, args.max_new_tokens)
    evaluation = start_evaluation(args, run, engine, model, scorer)  # before any update: pi_0's samples for the KL
    if args.run.eval_only:
        return run.eval_only(evaluation, scorer)
    rank, world = accelerator.process_index, accelerator.num_processes
    local_prompts = args.prompts_per_step // world

    def step_rows(step):  # this process's prompts of a step, drawn from (seed, step) alone (so a resumed run too)
        rows = preferences or run.train_rows
        picks = np.random.default_rng([args.seed, step]).choice(len(rows), args.prompts_per_step, replace=False)
        return [rows[i] for i in picks[rank * local_prompts:(rank + 1) * local_prompts]]

    def sample_pairs(rows, policy_version):  # G samples of each prompt, scored: its pair, or None, and the rollout
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        samples, sync_time = generate(engine, model, tokenizer, prompts, G, args.temperature, args.top_p,
                                      args.max_new_tokens, accelerator, policy_version)
        texts = tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True)
        scoring = scorer.submit(texts, [r for r in rows for _ in range(G)])
        accuracy, formats, failures = scorer.result(scoring)
        rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
        pairs = [(prompt, pair and [samples[pair[0]], samples[pair[1]]])
                 for prompt, pair in zip(prompts, choose_pairs(accuracy, rewards.tolist(), G, args.pairs_by))]
        return pairs, dict(samples=samples, accuracy=accuracy, formats=formats, rewards=rewards, failures=failures,
                           scoring=scoring, sync_time=sync_time, rows=[r for r in rows for _ in range(G)], texts=texts)

    pool = None
    if args.data == "offline":  # the pool of pairs from the initial policy, made once (or read back on --resume)
        order = np.random.default_rng([args.seed, 0]).permutation(len(run.train_rows))
        mine = [run.train_rows[i] for i in order[:args.offline_prompts // world * world][rank::world]]  # its share
        pool = offline_pool(run, lambda: [pair for start in range(0, len(mine), local_prompts)
                                          for pair in sample_pairs(mine[start:start + local_prompts], 0)[0] if pair[1]])
    for step in run.steps():  # from the checkpoint's step with --resume
        seconds = {"start": time.time(), "weight_sync": 0.0, "score": 0.0, "score_hidden": 0.0}
        # 1. Pairs: per prompt of this process, (prompt, [chosen, rejected]), or None when its samples hold no pair.
        rollout = None
        if args.data == "file":
            pairs = [(r["prompt_ids"], [r["chosen"], r["rejected"]]) for r in step_rows(step)]
        elif args.data == "offline":  # this process's share of the pool, drawn from (seed, step) alone
            picks = np.random.default_rng([args.seed, step]).choice(len(pool), local_prompts, len(pool) < local_prompts)
            pairs = [pool[i] for i in picks]
        else:  # online: from the policy after step - 1 updates
            pairs, rollout = sample_pairs(step_rows(step), step - 1)
            seconds.update(weight_sync=rollout["sync_time"], score=rollout["scoring"].waited,
                           score_hidden=rollout["scoring"].hidden)
        seconds["rollout"] = time.time() - seconds["start"] - seconds["score"]
        # 2. The batch: n chosen rows then their n rejected rows (a prompt without a pair keeps its place with a
        #    one-token placeholder of weight 0), and pi_ref's log-probs of them.
        made = [pair is not None for _, pair in pairs]
        chosen, rejected = zip(*[pair or [run.stop_ids[:1]] * 2 for _, pair in pairs])
        samples = [s if isinstance(s, Sample) else Sample(s, None, False) for s in chosen + rejected]  # (token ids)
        batch = make_batch([prompt for prompt, _ in pairs] * 2, samples, tokenizer.pad_token_id, accelerator.device)
        weights = torch.tensor(made, dtype=torch.float32, device=accelerator.device)
        batch.ref_logp = batched_logprobs(ref_model, batch, 1.0, accelerator, len(batch), args.micro_batch_size)
        if rollout is not None:  # online: the engine sampled from this policy; its log-probs against the trainer's
            policy_logp = batched_logprobs(model, batch, args.temperature, accelerator, len(batch),
                                           args.micro_batch_size)
            rollout["gap"] = engine_gap(batch, weights, policy_logp, accelerator)
        # 3. mu optimizer steps on the pairs; a NaN stops the run before it reaches the weights or a checkpoint.
        try:
            stats = update_policy(args, model, optimizer, batch, weights, accelerator)
        except FloatingPointError as e:
            raise run.stopped(step, e) from None
        # 4. Log (every process's statistics, combined), evaluate, checkpoint.
        stats.add({"dpo/pairs_made": sum(made), "dpo/prompts_skipped": len(made) - sum(made)})
        if rollout is not None:  # online: the samples the pairs came from, as every RL script logs its rollout
            rollout_stats(stats, rollout["samples"], rollout["accuracy"], rollout["formats"], rollout["rewards"],
                          rollout["failures"])
            stats.add({"rollout/logprob_gap_mean": rollout["gap"][0]})
            stats.max({"rollout/logprob_gap_max": rollout["gap"][1]})
        stats.mean(step_times(seconds, None, rollout["samples"] if rollout else samples))  # time/*, tokens/s
        stats.max(peak_memory(engine))  # memory/*
        metrics = {"step": step, **stats.reduce(accelerator)}
        metrics.update(evaluation(step))  # every --eval_every steps and at the end
        run.log(metrics, CONSOLE_KEYS, *([rollout[k] for k in ("rows", "texts", "rewards")] if rollout else [[]] * 3))
        run.save(step, model)  # every --save_every steps and at the end
    run.finish(model, scorer, evaluation)  # final/: the trained policy


def engine_gap(batch, weights, logp, accelerator):
    """The engine/trainer alarm on online pairs: |log pi_engine - log pi_theta| over their tokens, logp the trainer's at
    the sampling temperature before the update -> (the mean, as this process's share over every process's tokens;
    the max)."""
    mask = batch.mask * torch.cat([weights, weights])[:, None]
    gap = (batch.engine_logp - logp).abs() * mask
    return gap.sum() / accelerator.reduce(mask.sum(), reduction="sum").clamp(min=1), gap.max()


def offline_pool(run, make):
    """This process's pool of offline pairs, [(prompt, [chosen, rejected])]: made by make() before any update and saved
    in the run's folder (offline_pairs.<rank>.pt); a resumed run reads it back (the initial policy is gone)."""
    path = os.path.join(run.run_dir, f"offline_pairs.{run.accelerator.process_index}.pt")
    if run.checkpoint is not None:
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} is missing: the offline pairs this run trained on cannot be made again")
        return torch.load(path)
    pool = [(prompt, [chosen.token_ids, rejected.token_ids]) for prompt, (chosen, rejected) in make()]
    if not pool:
        raise SystemExit("error: the initial policy's samples held no pair (a right and a wrong answer to one prompt): "
                         "raise --offline_prompts or --num_generations, or use --data online")
    os.makedirs(run.run_dir, exist_ok=True)
    torch.save(pool, path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"offline pool: {len(pool)} pairs on process {run.accelerator.process_index}, saved to {path}")
    return pool


# ---- Run setup (infrastructure: skip on a first read) ---------------------------------------------------------------


def resolve_args(args, num_processes):
    """The defaults that depend on the model (each field's doc states its rule), then every check: bad input becomes
    one line that says what to change, before any model loads (plumbing/run.py start_run calls it). A GGUF model is
    converted here on first use. A step's batch
    holds two completions per prompt (its pair); the rollout page's flags are refused (its colours are per-token
    policy-gradient weights; DPO's gradient is per pair)."""
    embedded = is_toy_shaped(args.model)
    if args.learning_rate is None:
        args.learning_rate = 5e-4 if embedded else 1e-6
    if args.max_new_tokens is None:
        args.max_new_tokens = 48 if embedded else 1024
    if args.micro_batch_size is None:  # sequences: two per pair
        minibatch = args.prompts_per_step // num_processes // max(1, args.num_minibatches)
        args.micro_batch_size = 2 * largest_divisor(minibatch, 16 if embedded else 8)
    if args.task in TOY_TASKS:
        args.answer_format = "answer_tags"
    check_positive(args, "num_generations", "prompts_per_step", "micro_batch_size", "num_minibatches", "num_epochs",
                   "learning_rate", "max_new_tokens", "max_prompt_length", "temperature", "max_grad_norm")
    check_fraction(args, "top_p")  # (temperature > 0 above: the engine samples the pairs; greedy is for eval)
    if args.micro_batch_size % 2:
        raise ValueError(f"--micro_batch_size {args.micro_batch_size}: must be even (a pair's two completions share "
                         "a micro-batch)")
    unused = [name for name in ("html_every", "html_groups") if getattr(args.run, name) != getattr(RunArgs(), name)]
    if unused:
        raise ValueError(f"--{unused[0]}: dpo.py has no rollout page (its gradient is per pair, not per token): leave "
                         "it out")
    check_run_args(args.run, args.total_steps, args.model, args.task)
    check_batch_layout(args.prompts_per_step, 2, args.num_minibatches, args.micro_batch_size, num_processes)
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
