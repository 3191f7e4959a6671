"""GRPO with a tool: multi-turn rollouts in which the policy runs Python (DeepSeekMath's GRPO, arXiv 2402.03300 §4.1;
the tool-call convention of ToRA, arXiv 2309.17452, as in ReTool, arXiv 2504.11536, and verl's agent loop).

A completion is a sequence of turns: the model writes, and when it closes a ```python block, the code runs in a
sandbox process (utils/tools.py) and its output, up to --max_tool_tokens tokens, follows in an ```output block in the
context; the model continues, from prompt + everything so far, until it stops, or after --max_turns tool calls, or
when its --max_new_tokens (its own tokens over all turns) run out. The reward is read from the model's own text. The
objective is GRPO's, with the sum over the model's tokens only (m_it = 1 for a sampled token, 0 for tool output):

  J(theta) = E[ 1/G sum_i 1/|o_i|_m sum_t m_it { min( r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i ) - beta KL_it } ]

  r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t), with o_i<t holding the tool output seen so far
  A_i  = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)

Tool output is context, not action: its tokens are in every forward pass but masked out of the loss, the KL, the
entropy and every per-token statistic (the policy did not choose them). All turns of a completion are sampled from the
same weights (one policy version per step). Run `python grpo_tools.py` (the embedded model warmed up to call the tool
sometimes, three-digit products, CPU), or see README.md for GPUs. Left in grpo.py (switches independent of the tool):
Clip-Cov, KL-Cov, GDPO, the KL in the reward and the KL estimators other than k3.
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
from utils.rewards import RewardScorer, default_reward_workers
from utils.rl import (LOSS_AGGREGATIONS, aggregate_loss, engine_is_weights, entropy_threshold, group_advantages,
                      kl_k3, make_batch, micro_batches, pass_at_k, slice_batch)
from utils.runs import (RunArgs, add_logprob_gap, close_metrics, load_checkpoint, log_step, open_metrics,
                        quiet_libraries, resume_checkpoint, save_checkpoint, save_model, step_metrics, write_eval_only)
from utils.tasks import TOY_MODEL_DIR, load_splits
from utils.tools import (TOOL_INSTRUCTION, TOOL_STOP, PythonSandbox, last_code_block, tool_metrics,
                         tool_output_ids)


@dataclass
class Args(RunArgs):  # + the flags every script shares: RunArgs in utils/runs.py
    # experiment
    exp_name: str = "grpo_tools"
    """name of the run; its folder is <output_dir>/<exp_name>__<seed>"""
    seed: int = 1
    """random seed"""
    # model and task
    model: str = os.path.join(TOY_MODEL_DIR, "tools")
    """model folder, hub id, .gguf file, or smollm2-135m (SmolLM2-135M-Instruct from pip); default: the embedded toy"""
    task: str = "toy_mul"
    """toy, gsm8k, math, rg:NAME[:key=value,...] (reasoning-gym), or a local .jsonl/.parquet file (or folder with
    train.* and test.*) of {prompt, answer} rows"""
    answer_format: Literal["boxed", "answer_tags"] = "boxed"
    """what the system prompt asks for and the reward extracts (the toy task always uses answer tags)"""
    instruction: Literal["system", "user"] = "system"
    """where the answer-format instruction goes: a system turn, or after the question (small models start better)"""
    max_prompt_length: int = 512
    """prompts longer than this (tokens) are dropped at load time, with a count"""
    max_new_tokens: Optional[int] = None
    """the model's tokens per completion over all turns (tool output not counted); None: 96 for the embedded model
    (a tool call and an answer), 1024 otherwise"""
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
    num_minibatches: int = 1
    """optimizer steps per pass over a rollout batch"""
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward pass (gradient accumulation); None: 32 for the embedded model, 16 otherwise"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    # GRPO
    clip_eps_low: float = 0.2
    """ratio clipped below at 1 - clip_eps_low"""
    clip_eps_high: float = 0.2
    """ratio clipped above at 1 + clip_eps_high (DAPO's clip-higher: 0.28)"""
    beta: float = 0.04
    """KL coefficient; 0 loads no reference model"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage = (R - group mean) / std of the group, of the whole batch, or not divided (Dr. GRPO)"""
    adv_eps: float = 1e-6
    """added to the std of the advantage normalization"""
    loss_agg: str = "seq-mean-token-mean"
    """seq-mean-token-mean (paper), token-mean (DAPO), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO)"""
    format_reward_weight: float = 0.1
    """reward = accuracy + weight * format (one answer in the asked-for form, nothing after it)"""
    # switches from other papers (their defaults leave the algorithm as its paper has it)
    top_entropy_frac: float = 1.0
    """train on the top fraction of tokens by entropy only (the policy gradient; 0.2 in arXiv 2506.01939; 1: all)"""
    tis_cap: float = 0.0
    """if > 0, weight the policy gradient by pi_old / pi_engine bounded by this cap (--tis_mode): the engine/trainer
    mismatch"""
    tis_mode: Literal["token-truncate", "token-mask", "seq-truncate", "seq-mask"] = "token-truncate"
    """per token or per sequence (the product of the ratios); truncate at the cap, or mask outside [1/cap, cap]"""
    # tools
    max_turns: int = 2
    """tool calls per completion at most; the model's turn after the last call is its last"""
    max_tool_tokens: int = 64
    """tokens of one tool output block at most (its text is cut to fit)"""
    tool_timeout: float = 5.0
    """seconds a tool call may run; past it, the process running it is killed and the call gets an error"""
    tool_memory_mb: int = 512
    """address-space limit of each sandbox process, on top of what it maps at start"""
    tool_modules: tuple[str, ...] = ("math", "fractions", "statistics")
    """modules each sandbox process imports at start: free to import in a call (a root trainer's sandbox runs as the
    user nobody, who may not be able to read others); add numpy sympy for math tools (each call then costs more)"""


# ---- Algorithm ------------------------------------------------------------------------------------------------------


EMBEDDED_DEFAULTS = {"max_new_tokens": 96}  # the embedded model's: a tool call (~38 tokens) and an answer (~23)


def check_algorithm_args(args, num_processes=1):
    """GRPO's own argument checks (called by resolve_args, which passes num_processes: dapo.py's checks use it)."""
    if args.num_generations < 2:
        raise ValueError(f"--num_generations {args.num_generations}: GRPO needs groups of >= 2 completions (a group "
                         "of one has advantage 0 and learns nothing)")
    if args.beta < 0:
        raise ValueError(f"--beta {args.beta}: must be >= 0 (0 turns the KL term off)")
    if args.clip_eps_low < 0 or args.clip_eps_high < 0 or args.adv_eps < 0:
        raise ValueError("--clip_eps_low, --clip_eps_high and --adv_eps must be >= 0")
    if args.loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"--loss_agg {args.loss_agg!r}: use one of {', '.join(LOSS_AGGREGATIONS)}")
    if args.max_turns < 0 or args.max_tool_tokens < 16 or args.tool_timeout <= 0 or args.tool_memory_mb < 64:
        raise ValueError("--max_turns must be >= 0, --max_tool_tokens >= 16, --tool_timeout > 0 and --tool_memory_mb "
                         ">= 64")
    missing = [name for name in args.tool_modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"--tool_modules: no module named {', '.join(missing)} here (install it, or leave it out)")


def compute_advantages(rewards, num_generations, scale, eps):
    """Scalar rewards of consecutive groups of G completions (flat) -> one advantage per completion (flat)."""
    return group_advantages(rewards.view(-1, num_generations), scale, eps).view(-1)


def loss_settings(args):
    """The algorithm's knobs of compute_loss, from the arguments (update_policy passes them through unchanged)."""
    settings = {"clip_eps_low": args.clip_eps_low, "clip_eps_high": args.clip_eps_high, "loss_agg": args.loss_agg,
                "beta": args.beta, "max_len": args.max_new_tokens}
    return settings


def compute_loss(logp, old_logp, advantages, mask, ref_logp=None, is_weights=None, *, clip_eps_low=0.2,
                 clip_eps_high=0.2, beta=0.0, loss_agg="seq-mean-token-mean", num_seqs=None,
                 num_tokens=None, max_len=None):
    """GRPO loss of one micro-batch: per-token clipped surrogate (+ beta * KL), aggregated with global counts.

    logp, old_logp, ref_logp, mask, is_weights: (B, T); advantages: (B,); mask is 0 on tool output and padding.
    num_seqs/num_tokens are the counts of the whole mini-batch over micro-batches and processes (default: this
    micro-batch), so summed micro-batch losses give the mini-batch loss exactly. Returns (loss, means, maxes): `means`
    are token means divided by the same global num_tokens, so they too add up over micro-batches and processes to the
    exact mini-batch mean; `maxes` are maxima.
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
    if beta > 0:
        kl = kl_k3(logp, ref_logp)  # the paper's estimator (grpo.py has the others)
        per_token = per_token + beta * kl
    loss = aggregate_loss(per_token, mask, loss_agg, num_seqs, num_tokens, max_len)
    with torch.no_grad():
        m = mask.bool()
        means = {"policy/clip_frac": (ratio * adv > clipped * adv)[m].float().sum() / num_tokens,
                 "policy/ratio_mean": ratio[m].sum() / num_tokens,
                 "policy/approx_kl": (ratio - 1 - log_ratio)[m].sum() / num_tokens}
        if beta > 0:
            means["losses/kl"] = kl[m].sum() / num_tokens
        maxes = {"policy/ratio_max": ratio[m].max()}  # every completion has at least one token
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
              dtype="bfloat16" if on_gpu else "float32",
              max_model_len=args.max_prompt_length + args.max_new_tokens + args.max_turns * args.max_tool_tokens,
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


def sample(engine, model, tokenizer, prompts, n, temperature, top_p, budgets, accelerator):
    """One turn: n completions per prompt (token-id lists), each ending at a stop token, at TOOL_STOP (its tokens
    kept) or after its own budget of new tokens -> n * len(prompts) Samples. The engine is awake (wake_engine)."""
    llm = engine["llm"]
    if llm is None:
        return hf_generate(model, tokenizer, prompts, n, temperature, top_p, max(budgets), accelerator,
                           engine["stop_ids"], budgets=[b for b in budgets for _ in range(n)], stop_strings=[TOOL_STOP])
    from vllm import SamplingParams

    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=budget, logprobs=0,
                             stop_token_ids=engine["stop_ids"], stop=[TOOL_STOP]) for budget in budgets]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
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
    sync_time, tool_time, open_rows = wake_engine(engine, model, accelerator, policy_version), 0.0, []
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
            called = not s.truncated and s.token_ids[-1] not in engine["stop_ids"]  # it ended at TOOL_STOP
            if called and turn < args.max_turns and sum(c["mask"]) < args.max_new_tokens:
                calls.append(i)
        start = time.time()
        codes = [last_code_block(tokenizer.decode(completions[i]["ids"][turn_start[i]:])) for i in calls]  # this turn's
        results = sandbox.run([code if code is not None else "" for code in codes])
        for i, code, (output, error) in zip(calls, codes, results):
            error = "error: no ```python block to run" if code is None else error
            ids = tool_output_ids(tokenizer, output, error, args.max_tool_tokens)
            c = completions[i]
            c["ids"] += ids
            c["logprobs"] += [0.0] * len(ids)
            c["mask"] += [0] * len(ids)
            c["calls"], c["errors"] = c["calls"] + 1, c["errors"] + bool(error)
        tool_time += time.time() - start
        open_rows = calls
    sleep_engine(engine)
    samples = [Sample(c["ids"], c["logprobs"] if temperature > 0 else None, c["truncated"]) for c in completions]
    return samples, [c["mask"] for c in completions], completions, sync_time, tool_time


def model_text(tokenizer, sample, mask):
    """What the model wrote, tool output left out: the reward reads the answer from this, so a printed answer tag
    in the tool's output pays nothing."""
    return tokenizer.decode([t for t, m in zip(sample.token_ids, mask) if m], skip_special_tokens=True)


# ---- Evaluation -----------------------------------------------------------------------------------------------------


def evaluate(args, engine, model, tokenizer, scorer, sandbox, rows, accelerator, policy_version):
    """pass@1 on this process's share of the test rows: greedy, and the mean over n = eval_samples samples (T=0.6,
    top-p 0.95); pass@k for k = 2, 4, ... <= n from the same samples (unbiased estimator); the greedy format rate;
    the greedy completions' tool calls. Every completion may call the tool, as in training."""
    world = accelerator.num_processes  # every rank gets as many problems: the same number of generate calls
    mine = rows[: min(args.eval_size, len(rows)) // world * world][accelerator.process_index::world]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in mine]
    ks = [2 ** i for i in range(1, args.eval_samples.bit_length())]  # 2, 4, ... up to eval_samples
    totals = torch.zeros(5 + len(ks), device=accelerator.device)  # greedy, sampled, problems, format, calls, pass@k
    for start in range(0, len(prompts), 64):
        chunk, chunk_rows = prompts[start:start + 64], mine[start:start + 64]
        for column, n, temperature in ((0, 1, 0.0), (1, args.eval_samples, args.eval_temperature)):
            out, masks, completions, _, _ = rollout(args, engine, model, tokenizer, sandbox, chunk, n, temperature,
                                                    args.eval_top_p if temperature else 1.0, accelerator,
                                                    policy_version)
            texts = [model_text(tokenizer, sample, mask) for sample, mask in zip(out, masks)]
            acc, formats, _ = scorer.result(scorer.submit(texts, [r for r in chunk_rows for _ in range(n)]))
            totals[column] += sum(acc) / n
            if column == 0:
                totals[3] += sum(formats)
                totals[4] += sum(c["calls"] for c in completions)
            for j, k in enumerate(ks if column == 1 else []):  # each problem's n samples are consecutive
                totals[5 + j] += sum(pass_at_k(n, int(sum(acc[i:i + n])), k) for i in range(0, len(acc), n))
        totals[2] += len(chunk)
    totals = accelerator.reduce(totals, reduction="sum")
    n = totals[2].clamp(min=1)
    return {"eval/pass@1_greedy": (totals[0] / n).item(), f"eval/pass@1_sampled_k{args.eval_samples}":
            (totals[1] / n).item(), **{f"eval/pass@{k}": (totals[5 + j] / n).item() for j, k in enumerate(ks)},
            "eval/format_greedy": (totals[3] / n).item(), "eval/tool_calls_greedy": (totals[4] / n).item(),
            "eval/problems": int(totals[2].item())}


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


CONSOLE_KEYS = ["charts/reward", "charts/accuracy", "tools/call_frac", "tools/error_frac", "losses/kl",
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
        args = resolve_args(args, check_algorithm_args, accelerator.num_processes, EMBEDDED_DEFAULTS)
        checkpoint = resume_checkpoint(run_dir, args)
        tokenizer, stop_ids = load_tokenizer(args.model)
        check_lengths(args, tool_tokens=args.max_turns * args.max_tool_tokens)
        train_rows, test_rows, summary = load_splits(args, tokenizer, accelerator.num_processes, TOOL_INSTRUCTION)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    accelerator.print(summary)
    set_seed(args.seed, device_specific=True)
    # The reward workers start now, before the models and the engine: they warm up while those load.
    scorer = RewardScorer(args.task, args.answer_format, args.reward_workers or default_reward_workers(),
                          args.reward_timeout, args.reward_memory_mb)
    # as many sandbox processes as reward workers: a turn's calls run in parallel
    sandbox = PythonSandbox(args.reward_workers or default_reward_workers(), args.tool_timeout, args.tool_memory_mb,
                            modules=args.tool_modules)
    if sandbox.warning:
        accelerator.print(f"warning: {sandbox.warning}")

    model = load_model(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_model = None
    if args.beta > 0 and not args.eval_only:
        ref_model = load_model(args, tokenizer).eval().requires_grad_(False)
        ref_model = accelerator.prepare_model(ref_model, evaluation_mode=True)
        accelerator._models.remove(ref_model)  # frozen: reloaded from --model on resume, never checkpointed
    model.eval()  # dropout off: the ratio must be exactly 1 on the first mini-batch
    engine = create_engine(args, accelerator, stop_ids)

    if args.eval_only:  # results go to their own file: a training run's metrics.jsonl is never touched
        result = evaluate(args, engine, model, tokenizer, scorer, sandbox, test_rows, accelerator, policy_version=0)
        write_eval_only(accelerator, run_dir, args.model, result)
        scorer.close()
        sandbox.close()
        return result

    start_step = load_checkpoint(accelerator, checkpoint) if checkpoint else 1
    metrics_file = open_metrics(accelerator, run_dir, args, start_step)

    rank, world, G = accelerator.process_index, accelerator.num_processes, args.num_generations
    prompts_local = args.prompts_per_step // world
    # pi_old needs its own pass only when the policy moves before the last use of pi_old (mu > 1); otherwise
    # update_policy's first forward pass gives it (one pass saved).
    old_logp_pass = args.num_epochs * args.num_minibatches > 1 or (
        args.top_entropy_frac < 1)  # the entropy threshold needs the whole batch's entropies before the update
    progress = tqdm(range(start_step, args.total_steps + 1), initial=start_step - 1, total=args.total_steps,
                    disable=not accelerator.is_main_process, dynamic_ncols=True)
    for step in progress:
        times = {"step": time.time()}
        # 1. Rollout: each process samples G completions for its own whole groups of the step's prompts, from the
        #    policy as it is after step - 1 training steps.
        # from (seed, step) alone: a resumed run draws the prompts an uninterrupted one would, no sampler state
        picks = np.random.default_rng([args.seed, step]).choice(len(train_rows), args.prompts_per_step, replace=False)
        rows = [train_rows[i] for i in picks[rank * prompts_local:(rank + 1) * prompts_local]]
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        times["rollout"] = time.time()
        samples, model_masks, completions, sync_time, tool_time = rollout(
            args, engine, model, tokenizer, sandbox, prompts, G, args.temperature, args.top_p, accelerator,
            policy_version=step - 1)
        # 2. Score the model's own text, in the reward workers, while the trainer computes the pi_old (if needed) and
        #    pi_ref log-probs; tool output is masked out of the batch: context, never trained.
        times["train"] = time.time()
        texts = [model_text(tokenizer, sample, mask) for sample, mask in zip(samples, model_masks)]
        scoring = scorer.submit(texts, [r for r in rows for _ in range(G)])  # rows: a task's verifier may need more
        batch = make_batch([p for p in prompts for _ in range(G)], samples, tokenizer.pad_token_id, accelerator.device)
        for row, model_mask in enumerate(model_masks):
            batch["completion_mask"][row, :len(model_mask)] = torch.tensor(model_mask, dtype=torch.float32)
        mask = batch["completion_mask"]
        if old_logp_pass:  # with pi_old's entropies when --top_entropy_frac needs them
            batch["old_logp"], batch["old_entropy"] = batched_logprobs(
                model, batch, args.temperature, args.micro_batch_size, args.num_minibatches, args.top_entropy_frac < 1)
        if ref_model is not None:
            batch["ref_logp"], _ = batched_logprobs(ref_model, batch, args.temperature, args.micro_batch_size,
                                                    args.num_minibatches)
        # 3. Rewards (accuracy + w * format); group advantages from every process's rewards.
        accuracy, formats, counts = scorer.result(scoring)
        task_rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
        all_rewards = accelerator.gather(task_rewards.to(accelerator.device))
        advantages = compute_advantages(all_rewards, G, args.scale_rewards, args.adv_eps)
        batch["advantages"] = advantages.view(world, -1)[rank]
        # 4. mu = num_epochs * num_minibatches optimizer steps on this batch; a NaN stops the run before it is saved.
        try:
            old_logp, train_stats = update_policy(args, model, optimizer, batch, accelerator)
        except FloatingPointError as e:
            raise SystemExit(f"error: step {step}: {e}; stopped before the optimizer step, nothing saved from this "
                             f"step (the last checkpoint in {run_dir} is intact)") from None
        # 5. Log, evaluate, checkpoint.
        add_logprob_gap(train_stats, batch["engine_logp"], old_logp, mask, accelerator)
        metrics = step_metrics(accelerator, train_stats, samples, accuracy, formats, task_rewards, counts, {
            "step": time.time() - times["step"], "rollout": times["train"] - times["rollout"],
            "weight_sync": sync_time, "score": scoring.waited, "score_hidden": scoring.hidden})
        metrics["charts/reward_std"] = all_rewards.std().item()
        metrics.update(tool_metrics(completions, accuracy, tool_time, accelerator))
        if args.eval_every and (step % args.eval_every == 0 or step == args.total_steps):
            start = time.time()
            metrics.update(evaluate(args, engine, model, tokenizer, scorer, sandbox, test_rows, accelerator,
                                    policy_version=step))
            metrics["time/eval"] = time.time() - start
        metrics["step"] = step
        if accelerator.is_main_process:
            log_step(metrics_file, metrics, args, progress.write, CONSOLE_KEYS, [
                (rows[i // G]["question"], tokenizer.decode(samples[i].token_ids, skip_special_tokens=True),
                 rows[i // G]["answer"], task_rewards[i])
                for i in range(0, len(texts), max(1, len(texts) // 3))[:3]])
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps:
            save_checkpoint(accelerator, model, tokenizer, run_dir, step)
    save_model(accelerator, model, tokenizer, os.path.join(run_dir, "final"))
    scorer.close()
    sandbox.close()
    if accelerator.is_main_process:
        close_metrics(metrics_file, args.track)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
