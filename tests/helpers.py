"""Running an algorithm script end to end in a subprocess, as a user would, and calling its loss as update_policy
does."""

import dataclasses
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts_per_step", "4", "--num_generations", "4", "--micro_batch_size", "8", "--eval_size", "16",
         "--eval_samples", "2", "--log_completions_every", "1", "--kl_prompts", "4"]  # (the forward KL on 4 prompts)


def two_processes(port):
    """The launcher of a 2-process CPU run (gloo): accelerate's --multi_gpu path (torchrun) starts several CPU
    processes, `accelerate launch --cpu` one. Each test has its own port: one a test just closed may still be taken."""
    return (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
            "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port))


def fsdp2(port):
    """The launcher of a 2-process FSDP2 run on the CPU: the GPU config, without its bf16."""
    return (sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(ROOT, "configs",
            "fsdp2.yaml"), "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(port))


def run_grpo(args, out_dir, timeout=600, launcher=(sys.executable,), check=True, script="grpo.py"):
    """Run an algorithm script (grpo.py by default) with `args` into out_dir; returns (completed process, metrics rows
    of its run). Every test names its run (--exp_name, default: the script's name): its folder is <exp_name>__<seed>."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    exp = args[args.index("--exp_name") + 1] if "--exp_name" in args else script[:-3]
    if "--exp_name" not in args:
        args = [*args, "--exp_name", exp]
    cmd = [*launcher, os.path.join(ROOT, script), "--output_dir", str(out_dir), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    seed = args[args.index("--seed") + 1] if "--seed" in args else "1"
    path = os.path.join(str(out_dir), f"{exp}__{seed}", "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return proc, rows


def resolved(module, num_processes=1, **overrides):
    """An algorithm script's Args with these overrides (a field of a nested flag group, RunArgs or ToolArgs, goes to
    that group), defaults filled and checked as at the start of a run."""
    groups = {field.name: field.default_factory for field in dataclasses.fields(module.Args)
              if dataclasses.is_dataclass(field.default_factory)}
    members = {name: {field.name for field in dataclasses.fields(group)} for name, group in groups.items()}
    args = module.Args(**{name: group(**{k: v for k, v in overrides.items() if k in members[name]})
                          for name, group in groups.items()},
                       **{k: v for k, v in overrides.items() if not any(k in names for names in members.values())})
    return module.resolve_args(args, num_processes)


def loss_of(module, logp, old_logp, advantages, mask, ref_logp=None, **flags):
    """module.compute_loss as update_policy calls it, on one micro-batch that is the whole mini-batch: advantages
    (B,) are put on every token of their completion; flags are the loss's Args fields (the script's defaults
    otherwise). Returns (loss, means, maxes)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None] * mask
    counts = (mask.new_tensor(float(len(mask))), mask.sum())
    return module.compute_loss(logp, old_logp, ref_logp, advantages, mask, counts, module.Args(**flags))


def assert_same_loss_and_gradient(loss, expected, wrt, atol=1e-6):
    """A loss and an independent reference written in the test agree in value and in gradient with respect to wrt."""
    import pytest
    import torch

    (grad,) = torch.autograd.grad(loss, wrt)
    (expected_grad,) = torch.autograd.grad(expected, wrt)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(grad, expected_grad, atol=atol), (grad - expected_grad).abs().max()
