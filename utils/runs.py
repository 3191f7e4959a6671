"""Run plumbing every algorithm script shares, with nothing algorithmic in it: atomic checkpoints (a crash at any
moment leaves a complete one on disk), the Hugging Face model folder, and the one-sync-per-step metric reduction."""

import json
import os
import shutil

import torch


def save_checkpoint(accelerator, model, tokenizer, run_dir, step):
    """Write to checkpoint.tmp, then swap it in: a crash at any moment leaves a complete checkpoint on disk."""
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # model, optimizer, RNG states of every process
    save_model(accelerator, model, tokenizer, os.path.join(tmp, "hf"))
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "step.json"), "w") as f:
            json.dump({"step": step}, f)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_model(accelerator, model, tokenizer, path):
    """A Hugging Face folder (loadable with --model PATH --eval_only)."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)


def find_checkpoint(run_dir):
    for name in ("checkpoint", "checkpoint.old"):  # .old exists alone only if a crash hit the swap
        if os.path.exists(os.path.join(run_dir, name, "step.json")):
            return os.path.join(run_dir, name)
    return None


def reduce_metrics(accelerator, sums=(), means=(), maxes=()):
    """Combine each process's statistics into one value per key: `sums` are added (shares of a global mean, already
    divided by a global count), `means` averaged (values over as many items on every process), `maxes` maxed. One
    gather and one host sync per step."""
    groups = [(k, v, "sum") for k, v in dict(sums).items()] + [(k, v, "mean") for k, v in dict(means).items()] + [
        (k, v, "max") for k, v in dict(maxes).items()]
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=accelerator.device).reshape(())
                          for _, v, _ in groups])
    gathered = accelerator.gather(values.unsqueeze(0))  # (processes, keys)
    reduced = torch.stack([getattr(gathered[:, i], how)() for i, (_, _, how) in enumerate(groups)]).tolist()
    return {k: value for (k, _, _), value in zip(groups, reduced)}
