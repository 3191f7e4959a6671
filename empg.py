"""EMPG: Entropy-Modulated Policy Gradients (arXiv 2509.09265) on grpo_tools.py's multi-turn rollouts: each step's
advantage is rescaled by the step's entropy (confident steps get larger updates, uncertain ones smaller), plus a bonus
for a step followed by a confident one ("future clarity"). Step t of completion i is its t-th model turn (a run of
model tokens between tool outputs); H_it, its tokens' mean entropy under pi_old (the trainer's pass before the update).
Over the rollout batch's S steps, as the authors' pseudocode computes it (defaults k = k_f = 1, zeta = 0.1):

  Hn_it = (H_it - min H) / (max H - min H + 1e-8)             batch min-max normalization (eq. 12)
  g_it  = exp(-k Hn_it) / (1/S sum_steps exp(-k Hn) + 1e-8)   self-calibrating gradient scaling, mean 1 (eq. 10)
  f_it  = exp(-k_f Hn_it)                                      future clarity bonus (eq. 11)
  M_it  = g_it A_i + zeta f_i,t+1                              (no bonus on a completion's last step)
  A'_it = M_it - 1/S sum_steps M                               final normalization: zero mean over the steps

and step t's tokens take A'_it in grpo_tools.py's objective (m_it = 0 on tool output; r_it, KL_it, A_i as in grpo.py):

  J(theta) = 1/G sum_i 1/|o_i|_m sum_t m_it [ min( r_it A'_it, clip(r_it, 1 - eps, 1 + eps) A'_it ) - beta KL_it ]

Worked example: completion 1 (A = +1) has step entropies (0.2, 1.0), completion 2 (A = -1) has (0.6, 0.2, 1.4). Over
S = 5 steps Hn = (0, 2/3 | 1/3, 0, 1); exp(-Hn) = (1, 0.5134 | 0.7165, 1, 0.3679), mean 0.7196, so g = (1.3897,
0.7135 | 0.9958, 1.3897, 0.5113); M = (1.3897 + 0.1 * 0.5134, 0.7135 | -0.9958 + 0.1 * 1, -1.3897 + 0.1 * 0.3679,
-0.5113) = (1.4411, 0.7135 | -0.8958, -1.3529, -0.5113), mean -0.1211; A' = (1.5621, 0.8346 | -0.7747, -1.2319,
-0.3902): the success's confident step gains most, the failure's confident step loses most. A single-turn completion
is one step; equal entropies give g = 1 / (1 + 1e-8) and a bonus of zeta on every step but a last.

What `diff grpo_tools.py empg.py` shows: --k, --k_f, --zeta, modulate_advantages(), pi_old's entropies from a pass
before every update (as in high_entropy.py), the modulated advantages in main() and their metrics (empg/*).

Reading order (blocks whose header says "infrastructure" are what a first read skips): main(), rollout(), make_batch(),
batched_logprobs(), compute_advantages(), modulate_advantages(), update_policy(), compute_loss().
"""

import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch.utils.checkpoint import checkpoint

from plumbing.engine import HFDecoder, Sample, create_engine
from plumbing.evaluation import Evaluation
from plumbing.memory import print_memory_estimate
from plumbing.models import output_layer, resolve_model
from plumbing.parallel import clip_gradients, gradient_sync, load_models
from plumbing.tools import (TOOL_INSTRUCTION, TOOL_STOP, ToolArgs, check_tool_args, last_code_block, open_sandbox,
                            tool_metrics, tool_output_ids)
from plumbing.run import (RunArgs, check_batch_layout, check_fraction, check_positive, check_run_args,
                          largest_divisor, peak_memory, start_run, step_times, tail_fraction)
from utils.rewards import RewardScorer
from utils.rl import engine_is_weights, group_zscore, kl_k3
from utils.tasks import TOY_MODEL_DIR, TOY_TASKS, is_toy_shaped


@dataclass
class Args:
    # GRPO with EMPG
    k: float = 1.0
    """k of the self-calibrating scaling g = exp(-k Hn) / (its mean over the batch's steps); 0: g = 1"""
    k_f: float = 1.0
    """k_f of the future-clarity bonus f = exp(-k_f Hn) of the next step's normalized entropy"""
    zeta: float = 0.1
    """zeta, the weight of the future-clarity bonus; 0: no bonus"""
    num_generations: int = 8
    """G, completions per prompt (a group)"""
    clip_eps: float = 0.2
    """the ratio is clipped to [1 - clip_eps, 1 + clip_eps] (it acts only when mu > 1)"""
    beta: float = 0.04
    """coefficient of the k3 KL to the initial policy in the loss; 0 loads no reference model"""
    adv_eps: float = 1e-6
    """added to the group's std in the advantage"""
    # model and task
    model: str = os.path.join(TOY_MODEL_DIR, "tools")
    """model folder, hub id, .gguf file, or smollm2-135m (SmolLM2-135M-Instruct from pip); default: the embedded toy"""
    task: str = "toy_mul"
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
    """the model's tokens per completion over all turns (tool output not counted); None: 96 for the embedded model
    (and models trained from it: a tool call and an answer), else 1024"""
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
    # tools
    max_turns: int = 2
    """tool calls per completion at most; the model's turn after the last call is its last"""
    tool: tyro.conf.OmitArgPrefixes[ToolArgs] = field(default_factory=ToolArgs)
    """the sandbox: --max_tool_tokens, --tool_timeout, --tool_memory_mb, --tool_modules (plumbing/tools.py ToolArgs)"""
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
    for name in ("k", "k_f", "zeta"):  # the paper's k, k' > 0 and zeta >= 0; 0 turns that part off
        if not 0 <= getattr(args, name) < float("inf"):
            raise ValueError(f"--{name} {getattr(args, name)}: must be a finite number >= 0")
    if args.max_turns < 0:
        raise ValueError(f"--max_turns {args.max_turns}: must be >= 0 (0: no tool call)")
    check_tool_args(args.tool)


def compute_advantages(rewards, args):
    """rewards (B,), consecutive groups of G = --num_generations -> advantages (B,):
    A_i = (R_i - mean of its group) / (std of its group + --adv_eps)."""
    return group_zscore(rewards.view(-1, args.num_generations), args.adv_eps).view(-1)


def modulate_advantages(advantages, entropy, mask, args, accelerator):
    """A'_it (the docstring's equations, in float64 over every process's steps) from every process's A_i (B,) and this
    process's pi_old token entropies and mask (B/W, T) -> (A'_it on step t's tokens, else 0, (B/W, T); metrics)."""
    turn = (mask * (1 - F.pad(mask[:, :-1], (1, 0)))).cumsum(-1).mul(mask).long()  # t on step t's tokens, else 0
    sums = torch.zeros(len(mask), args.max_turns + 2, dtype=torch.float64, device=mask.device)  # column 0: no step
    H = accelerator.gather((sums.scatter_add(1, turn, entropy.double() * mask) /  # (B, S) every process's steps'
                            sums.scatter_add(1, turn, mask.double()))[:, 1:])  # entropies; NaN (0 / 0): no step t
    valid = ~H.isnan()
    low, high = H[valid].min(), H[valid].max()
    norm = (H - low) / (high - low + 1e-8)  # eq. 12
    g = torch.exp(-args.k * norm) / (torch.exp(-args.k * norm[valid]).mean() + 1e-8)  # eq. 10
    bonus = F.pad(args.zeta * torch.exp(-args.k_f * norm[:, 1:]).nan_to_num(0.0), (0, 1))  # eq. 11 of step t + 1
    modulated = g * advantages.double()[:, None] + bonus
    shift = modulated[valid].mean()  # the final normalization: zero mean over the batch's steps
    mine = (modulated - shift).nan_to_num(0.0).view(accelerator.num_processes, len(mask), -1)[accelerator.process_index]
    metrics = {"empg/step_entropy_mean": H[valid].mean(), "empg/step_entropy_min": low, "empg/step_entropy_max": high,
               "empg/steps_per_completion": valid.double().sum(1).mean(), "empg/g_min": g[valid].min(),
               "empg/g_max": g[valid].max(), "empg/bonus_mean": bonus[valid].mean(), "empg/shift": shift,
               **{f"empg/step_entropy_turn{t + 1}": h for t, h in enumerate(H.nanmean(0))}}
    return F.pad(mine, (1, 0)).gather(1, turn).to(mask.dtype), {key: h.item() for key, h in metrics.items()}


def compute_loss(logp, old_logp, ref_logp, advantages, mask, counts, args):
    """-J(theta) on one micro-batch, as its share of the optimizer mini-batch's loss: summed over the mini-batch's
    micro-batches and processes, the shares give that loss exactly.

    logp (B, T), with gradient; old_logp, ref_logp (None when beta = 0), mask, advantages: (B, T) (A'_it on the tokens
    of step t of completion i; 0 on tool output). counts = (num_seqs, num_tokens): the completions and tokens of
    the whole mini-batch, over every micro-batch and process. args: the flags of the loss (--clip_eps, --beta).
    Returns (loss, means: statistics as shares of their mini-batch mean, maxes)."""
    num_seqs, num_tokens = counts
    log_ratio = (logp - old_logp).clamp(-20, 20)  # exp() stays finite: an inf ratio, even masked, makes the loss NaN
    ratio = torch.exp(log_ratio)
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps) * advantages
    per_token = -torch.min(unclipped, clipped)
    if args.beta > 0:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + args.beta * kl
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs  # 1/|o_i| sum_t, then the mean
    with torch.no_grad():
        m = mask.bool()
        means = {"policy/clip_frac": (clipped < unclipped)[m].float().sum() / num_tokens,
                 "policy/ratio_mean": ratio[m].sum() / num_tokens,
                 "policy/approx_kl": (ratio - 1 - log_ratio)[m].sum() / num_tokens}
        if args.beta > 0:
            means["losses/kl"] = kl[m].sum() / num_tokens
    return loss, means, {"policy/ratio_max": ratio[m].max()}  # every completion has at least one token


# ---- Rollout: vLLM (colocated, sleep mode on GPU) or the HF decode loop ---------------------------------------------


def sample(engine, model, tokenizer, prompts, n, temperature, top_p, budgets, accelerator):
    """One turn: n completions per prompt (token-id lists), each ending at a stop token, at TOOL_STOP (its tokens
    kept) or after its own budget of new tokens -> n * len(prompts) Samples. The engine is awake (rollout())."""
    if engine.llm is None:
        decoder = HFDecoder(engine.stop_ids, [b for b in budgets for _ in range(n)], stop_strings=[TOOL_STOP])
        return decoder.generate(model, tokenizer, prompts, n, temperature, top_p, max(budgets), accelerator)
    from vllm import SamplingParams

    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=budget, logprobs=0,
                             stop_token_ids=engine.stop_ids, stop=[TOOL_STOP]) for budget in budgets]
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] if temperature > 0
                   else None, o.finish_reason == "length") for out in outputs for o in out.outputs]


# ---- Tool calls -----------------------------------------------------------------------------------------------------


def rollout(args, engine, model, tokenizer, sandbox, prompts, n, temperature, top_p, accelerator, policy_version):
    """n multi-turn completions per prompt: sample a turn for every open completion; those that ended at TOOL_STOP
    have their last ```python block run in the sandbox (all at once) and its output block appended, and go on to the
    next turn, at most args.max_turns calls. Returns (Samples holding every token after the prompt, model and tool
    output alike, the tool's log-probs 0; per completion a 0/1 list, 1 for the model's tokens; per completion its
    tool calls and failed calls; seconds pushing weights; seconds running tools)."""
    completions = [{"ids": [], "logprobs": [], "mask": [], "calls": 0, "errors": 0, "truncated": False}
                   for _ in range(len(prompts) * n)]
    context = [p for p in prompts for _ in range(n)]
    engine.wake("weights")  # as generate() in grpo.py, once around every turn: all turns sample from one version
    sync_time, tool_time, open_rows = engine.push_weights(model, accelerator, policy_version), 0.0, []
    engine.wake("kv_cache")
    for turn in range(args.max_turns + 1):
        # every rank samples every turn while any rank has an open completion (FSDP gathers weights in each pass)
        rows = list(range(len(completions))) if turn == 0 else open_rows
        more = accelerator.reduce(torch.tensor(float(len(rows)), device=accelerator.device), reduction="max")
        if more.item() == 0:
            break
        if turn == 0:
            samples = sample(engine, model, tokenizer, prompts, n, temperature, top_p,
                             [args.max_new_tokens] * len(prompts), accelerator)
        else:  # from prompt + every turn so far; a rank with none left samples one dummy token
            budgets = [args.max_new_tokens - sum(completions[i]["mask"]) for i in rows]
            samples = sample(engine, model, tokenizer, [context[i] + completions[i]["ids"] for i in rows] or
                             prompts[:1], 1, temperature, top_p, budgets or [1], accelerator)[:len(rows)]
        calls, turn_start = [], {}
        for i, s in zip(rows, samples):
            c = completions[i]
            turn_start[i] = len(c["ids"])
            c["ids"] += s.token_ids
            c["logprobs"] += s.logprobs or [0.0] * len(s.token_ids)
            c["mask"] += [1] * len(s.token_ids)
            c["truncated"] = s.truncated
            called = not s.truncated and s.token_ids[-1] not in engine.stop_ids  # it ended at TOOL_STOP
            if called and turn < args.max_turns and sum(c["mask"]) < args.max_new_tokens:
                calls.append(i)
        start = time.time()
        codes = [last_code_block(tokenizer.decode(completions[i]["ids"][turn_start[i]:])) for i in calls]  # this turn's
        results = sandbox.run([code if code is not None else "" for code in codes])
        for i, code, (output, error) in zip(calls, codes, results):
            error = "error: no ```python block to run" if code is None else error
            ids = tool_output_ids(tokenizer, output, error, args.tool.max_tool_tokens)
            c = completions[i]
            c["ids"] += ids
            c["logprobs"] += [0.0] * len(ids)
            c["mask"] += [0] * len(ids)
            c["calls"], c["errors"] = c["calls"] + 1, c["errors"] + bool(error)
        tool_time += time.time() - start
        open_rows = calls
    engine.sleep()
    samples = [Sample(c["ids"], c["logprobs"] if temperature > 0 else None, c["truncated"]) for c in completions]
    return samples, [c["mask"] for c in completions], completions, sync_time, tool_time


def model_text(tokenizer, sample, mask):
    """What the model wrote, tool output left out: the reward reads the answer from this, so a printed answer tag
    in the tool's output pays nothing."""
    return tokenizer.decode([t for t, m in zip(sample.token_ids, mask) if m], skip_special_tokens=True)


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
def batched_logprobs(model, batch, temperature, accelerator, minibatch_size, micro_batch_size, with_entropy=False):
    """The trainer's log-probs of a whole rollout batch, (B, T), without gradient (pi_old before the update, pi_ref),
    over the micro-batches of update_policy's first epoch: pi_old equals the first mini-batch's pi_theta bit for bit.
    with_entropy: (the log-probs, each position's entropy)."""
    logp, entropy = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)
    for minibatch in torch.arange(len(batch), device=logp.device).split(minibatch_size):
        for rows, micro in micro_batches(batch.select(minibatch), micro_batch_size):
            micro_logp, entropies = token_logprobs(model, micro, temperature, accelerator, with_entropy=with_entropy)
            logp[minibatch[rows], :micro_logp.shape[1]] = micro_logp
            if with_entropy:
                entropy[minibatch[rows], :micro_logp.shape[1]] = entropies
    return (logp, entropy) if with_entropy else logp


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


CONSOLE_KEYS = ["charts/reward", "charts/accuracy", "tools/call_frac", "tools/error_frac", "losses/kl",
                "rollout/logprob_gap_mean", "eval/pass@1_greedy"]


def main(args):
    tool_tokens = args.max_turns * args.tool.max_tool_tokens  # room for the tool's output; the prompt says how to
    run = start_run(__file__, args, resolve_args, tool_tokens=tool_tokens, tool_instruction=TOOL_INSTRUCTION)  # call it
    args, accelerator, tokenizer, G = run.args, run.accelerator, run.tokenizer, args.num_generations
    scorer = RewardScorer(args.task, args.answer_format, args.run.reward_workers, args.run.reward_timeout,
                          args.run.reward_memory_mb)  # workers (math, rg:) warm up meanwhile
    sandbox = open_sandbox(args.tool, args.run.reward_workers, accelerator.print)  # a turn's calls run at once
    model, optimizer, ref_model = load_models(args.model, args.learning_rate, args.run, tokenizer, accelerator,
                                              with_reference=args.beta > 0)  # AdamW; pi_ref frozen
    completion_len = args.max_new_tokens + tool_tokens  # the model's tokens and the tool's
    engine = create_engine(args.run, args.model, args.seed + accelerator.process_index,
                           args.max_prompt_length + completion_len, run.stop_ids)
    print_memory_estimate(accelerator, engine, [model], [ref_model], args.micro_batch_size, args.max_prompt_length +
                          completion_len, completion_len)
    evaluation = start_evaluation(args, run, engine, model, scorer, sandbox)  # before any update: pi_0's samples
    if args.run.eval_only:  # (the forward KL's, the tool's output masked)
        return run.eval_only(evaluation, scorer, sandbox)
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
        samples, model_masks, completions, seconds["weight_sync"], tool_time = rollout(
            args, engine, model, tokenizer, sandbox, prompts, G, args.temperature, args.top_p, accelerator,
            policy_version=step - 1)
        seconds["rollout"] = time.time() - seconds["start"]
        # 2. Reward from the model's own text, in the reward workers, while the trainer computes pi_ref (and pi_old
        #    when mu > 1); tool output is masked out of the batch: context, never trained.
        texts = [model_text(tokenizer, sample, mask) for sample, mask in zip(samples, model_masks)]
        scoring = scorer.submit(texts, [r for r in rows for _ in range(G)])  # rows: a task's verifier may need more
        batch = make_batch([p for p in prompts for _ in range(G)], samples, tokenizer.pad_token_id, accelerator.device)
        for row, model_mask in enumerate(model_masks):
            batch.mask[row, :len(model_mask)] = torch.tensor(model_mask, dtype=torch.float32)
        # pi_old and its entropies before the update: each step's advantage depends on every step's entropy
        batch.old_logp, old_entropy = batched_logprobs(model, batch, args.temperature, accelerator, minibatch_size,
                                                       args.micro_batch_size, with_entropy=True)
        if ref_model is not None:
            batch.ref_logp = batched_logprobs(ref_model, batch, args.temperature, accelerator, minibatch_size,
                                              args.micro_batch_size)
        accuracy, formats, failures = scorer.result(scoring)  # failures: answers that could not be checked, by kind
        rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
        # 3. Advantages, from every process's rewards (each process holds whole groups), modulated per step: A'_it.
        all_rewards = accelerator.gather(rewards.to(accelerator.device))
        batch.advantages, empg_metrics = modulate_advantages(compute_advantages(all_rewards, args), old_entropy,
                                                             batch.mask, args, accelerator)
        # 4. mu optimizer steps on this batch; a NaN stops the run before it reaches the weights or a checkpoint.
        try:
            stats, last_epoch = update_policy(args, model, optimizer, batch, accelerator)
        except FloatingPointError as e:
            raise run.stopped(step, e) from None
        # 5. Log (every process's statistics, combined), evaluate, checkpoint.
        rollout_stats(stats, samples, accuracy, formats, rewards, failures)
        stats.mean(step_times(seconds, scoring, samples))  # time/*, rollout/tokens_per_s (plumbing/run.py)
        stats.max(peak_memory(engine))  # memory/*
        metrics = {"step": step, **stats.reduce(accelerator), "charts/reward_std": all_rewards.std().item()}
        metrics.update(tool_metrics(completions, accuracy, tool_time, accelerator))
        metrics.update(empg_metrics)  # empg/*: the steps' entropies, g and the bonus
        metrics.update(evaluation(step))  # every --eval_every steps and at the end
        run.page(step, batch, last_epoch, page_losses, samples, dict(accuracy=accuracy, format=formats, reward=rewards))
        run.log(metrics, CONSOLE_KEYS, [r for r in rows for _ in range(G)],  # a few examples, tool output too
                tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True), rewards)
        run.save(step, model)  # every --save_every steps and at the end
    run.finish(model, scorer, evaluation, sandbox)  # final/: the trained policy


# ---- Run setup (infrastructure: skip on a first read) ---------------------------------------------------------------


def resolve_args(args, num_processes):
    """The defaults that depend on the model (each field's doc states its rule), then every check: bad input becomes
    one line that says what to change, before any model loads (plumbing/run.py start_run calls it). A GGUF model is
    converted here on first use."""
    embedded = is_toy_shaped(args.model)
    if args.learning_rate is None:
        args.learning_rate = 5e-4 if embedded else 1e-6
    if args.max_new_tokens is None:
        args.max_new_tokens = 96 if embedded else 1024
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


def start_evaluation(args, run, engine, model, scorer, sandbox):
    """What main() calls at each step (plumbing/evaluation.py Evaluation): held-out pass@1 greedy and sampled, pass@k,
    the greedy format rate and tool calls per greedy completion, and what training changed beyond its task
    (--prior_tasks; the forward KL to pi_0 over the model's own tokens, whose samples it draws now); completions may
    call the tool, as in training."""
    tokenizer, accelerator = run.tokenizer, run.accelerator

    def sample(prompts, n, temperature, top_p, policy_version):  # -> texts, Samples, masks, tool calls
        samples, masks, completions, _, _ = rollout(args, engine, model, tokenizer, sandbox, prompts, n, temperature,
                                                    top_p, accelerator, policy_version)
        return ([model_text(tokenizer, sample, mask) for sample, mask in zip(samples, masks)], samples, masks,
                {"tool_calls": sum(c["calls"] for c in completions)})

    def sequence_logprobs(prompts, samples, masks):  # log pi(completion | prompt) over the policy's own tokens; counts
        batch = make_batch(prompts, samples, tokenizer.pad_token_id, accelerator.device)
        batch.mask = batch.mask * torch.tensor([m + [0] * (batch.mask.shape[1] - len(m)) for m in masks],
                                               dtype=batch.mask.dtype, device=batch.mask.device)  # (tool output: 0)
        logp = batched_logprobs(model, batch, args.temperature, accelerator, len(batch), args.micro_batch_size)
        return (logp * batch.mask).sum(-1), batch.mask.sum(-1)

    return Evaluation(run, scorer, sample, sequence_logprobs, chunk_size=64)


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
