"""Checks of the arguments every algorithm script shares, run before any model loads: each bad value becomes a
one-line ValueError that says what to change. A script adds its own algorithm's checks (check_algorithm_args)."""

from utils.models import gguf_file, resolve_model
from utils.tasks import TOY_TASKS, check_model, check_task, is_toy_shaped

POSITIVE = ("num_generations", "prompts_per_step", "micro_batch_size", "num_minibatches", "num_epochs", "learning_rate",
            "max_new_tokens", "max_prompt_length", "temperature", "max_grad_norm", "reward_timeout", "eval_samples",
            "threads")
NON_NEGATIVE = ("eval_every", "save_every", "log_completions_every", "tis_cap", "eval_temperature", "reward_workers",
                "reward_memory_mb")

EMBEDDED_DEFAULTS = {"learning_rate": 5e-4, "max_new_tokens": 48, "micro_batch_size": 32}
REAL_MODEL_DEFAULTS = {"learning_rate": 1e-6, "max_new_tokens": 1024, "micro_batch_size": 16}


def resolve_args(args, check_algorithm_args, num_processes=1, embedded_defaults=None):
    """Fill the defaults that depend on the model (the embedded model's, also for a model trained from it, with a
    script's own embedded_defaults over them; or a real model's), then check every argument: the shared checks below,
    then the script's check_algorithm_args. Bad input becomes one line that says what to change, before any heavy work
    starts; the last step turns a GGUF model (--model smollm2-135m or a .gguf file) into its converted folder,
    converting it on first use."""
    embedded = {**EMBEDDED_DEFAULTS, **(embedded_defaults or {})}
    defaults = embedded if is_toy_shaped(args.model) else REAL_MODEL_DEFAULTS
    if args.micro_batch_size is None:  # the largest divisor of a process's mini-batch up to the default
        minibatch = args.prompts_per_step // num_processes * args.num_generations // max(1, args.num_minibatches)
        args.micro_batch_size = max(d for d in range(1, defaults["micro_batch_size"] + 1) if minibatch % d == 0)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.task in TOY_TASKS:
        args.answer_format = "answer_tags"
    check_args(args, num_processes)
    check_algorithm_args(args, num_processes)
    args.model = resolve_model(args.model)
    return args


def check_args(args, num_processes=1):
    """Sizes, ranges, task, model, and how a step's completions divide over processes and (micro-)batches."""
    for name in POSITIVE:
        if not getattr(args, name) > 0:  # temperature 0 would divide the trainer's logits by 0 (greedy is for eval)
            raise ValueError(f"--{name} {getattr(args, name)}: must be > 0")
    for name in NON_NEGATIVE:
        if not getattr(args, name) >= 0:
            raise ValueError(f"--{name} {getattr(args, name)}: must be >= 0")
    for name in ("top_p", "eval_top_p", "top_entropy_frac"):  # ppo.py has no top_entropy_frac
        if not 0 < getattr(args, name, 1.0) <= 1:
            raise ValueError(f"--{name} {getattr(args, name)}: must be in (0, 1]")
    if 0 < args.tis_cap <= 1:
        raise ValueError(f"--tis_cap {args.tis_cap}: must be > 1 (a bound on pi_old / pi_engine; 0 turns it off)")
    if args.total_steps < 1 and not args.eval_only:
        raise ValueError(f"--total_steps {args.total_steps}: must be >= 1 (use --eval_only to only evaluate)")
    if args.eval_size < 1 and (args.eval_every or args.eval_only):
        raise ValueError(f"--eval_size {args.eval_size}: must be >= 1, or pass --eval_every 0 to skip evaluation")
    check_task(args.task)
    if gguf_file(args.model) is None:  # a GGUF model is checked there: its file exists, or how to install it
        check_model(args.model)
    if args.prompts_per_step % num_processes:
        raise ValueError(f"--prompts_per_step {args.prompts_per_step} must divide by the {num_processes} processes")
    local_batch = args.prompts_per_step // num_processes * args.num_generations
    if local_batch % args.num_minibatches or (local_batch // args.num_minibatches) % args.micro_batch_size:
        raise ValueError(f"each process holds {local_batch} completions a step: it must divide into --num_minibatches "
                         f"{args.num_minibatches} mini-batches of whole --micro_batch_size {args.micro_batch_size} "
                         "chunks")


def check_lengths(args, tool_tokens=0):
    """Prompt plus completion (plus tool output, grpo_tools.py) must fit the model's positions (reads the model's
    config: after check_model)."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
    if limit is not None and args.max_prompt_length + args.max_new_tokens + tool_tokens > limit:
        raise ValueError(f"--max_prompt_length {args.max_prompt_length} + --max_new_tokens {args.max_new_tokens}"
                         + (f" + tool output {tool_tokens} (--max_turns * --max_tool_tokens)" if tool_tokens else "")
                         + f" exceeds the model's {limit} positions: lower one of them")
