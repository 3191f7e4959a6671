"""LoRA (--lora_rank R): low-rank adapters on every linear layer of the model but its output layer, through peft.
Only the adapters train, so the optimizer holds state for them alone and the checkpoint stores them alone; the
reference model is the policy with its adapters switched off (no second copy in memory); the rollout engine and
final/ get the merged weights W + (alpha / R) B A, computed without touching the trainer's weights.
"""

import os

import torch

from plumbing.models import plain_name

PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's own parameter names


def apply_lora(model, rank, alpha, trainable=()):
    """The model with LoRA adapters of rank `rank` and scale alpha / rank on all its linear layers (peft's
    "all-linear": attention and MLP, not the output layer), B initialized to 0 (the adapted model starts as the base
    model); `trainable`: names of modules that train whole beside the adapters (ppo.py's value head)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0,
                        modules_to_save=list(trainable) or None)
    return get_peft_model(model, config)


def is_lora(model):
    return hasattr(model, "peft_config")


def base_name(name):
    """A peft parameter name as the base model names it."""
    name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def merged_weights(model, gather=lambda tensor: tensor, state=None):
    """(base model's name, tensor) of every weight of a peft model, each adapted linear layer's as W + scale B A, from
    `state` (a full state dict of the model) or the model's own, whose tensors `gather` makes full (FSDP2's DTensors:
    every process then runs the same gathers in the same order). One tensor at a time; the trainer's weights are
    untouched."""
    modules = {plain_name(name): module for name, module in model.named_modules()}  # by the state dict's names
    state = model.state_dict() if state is None else state
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:
            continue  # folded into their layer's weight below; peft's copy of a module that trains whole
        tensor = gather(tensor)
        if name.endswith(".base_layer.weight"):
            prefix = name[:-len(".base_layer.weight")]
            layer = modules[prefix.removeprefix("module.")]
            for adapter in ([] if layer.merged or layer.disable_adapters else layer.active_adapters):
                a = gather(state[f"{prefix}.lora_A.{adapter}.weight"])
                b = gather(state[f"{prefix}.lora_B.{adapter}.weight"])
                tensor = tensor + (b @ a).to(tensor.dtype) * layer.scaling[adapter]
        yield base_name(name.removeprefix("module.")), tensor


class AdaptersOff(torch.nn.Module):
    """The reference model of a LoRA run: the policy itself, called with its adapters switched off (pi_ref is the base
    model, no second copy: it holds no parameters of its own, so no estimate counts them twice). The policy is called
    as prepared (DDP, FSDP2), so its wrappers still run; its output layer and config are the base model's."""

    def __init__(self, policy, peft_model):
        super().__init__()
        self.models = [policy, peft_model]  # a list: neither is registered as a submodule

    def forward(self, *args, **kwargs):
        policy, peft_model = self.models
        with peft_model.disable_adapter():
            return policy(*args, **kwargs)

    def get_output_embeddings(self):
        return self.models[1].get_output_embeddings()

    @property
    def config(self):
        return self.models[1].config


def save_adapters_only(accelerator):
    """accelerate's checkpoints of a LoRA run keep the trained parameters alone (the adapters, a value head): the
    frozen base weights are the --model's, reloaded on resume (plumbing.run.load_checkpoint loads non-strictly and
    checks every trained parameter was in the checkpoint). Under FSDP2 the trained parameters' shards alone
    (trained_shards)."""
    if accelerator.is_fsdp2:  # accelerate saves and loads each FSDP model itself, calling the hook with no weights
        import accelerate.accelerator
        from accelerate.utils import fsdp_utils

        accelerate.accelerator.save_fsdp_model = trained_shards(fsdp_utils.save_fsdp_model, save=True)
        accelerate.accelerator.load_fsdp_model = trained_shards(fsdp_utils.load_fsdp_model, save=False)

    def keep_trained(models, weights, output_dir):
        for model, state in zip(models, weights):
            unwrapped = accelerator.unwrap_model(model)
            if is_lora(unwrapped):
                trained = {name.replace("_checkpoint_wrapped_module.", "") for name, p in unwrapped.named_parameters()
                           if p.requires_grad}
                for key in [key for key in state if key.removeprefix("module.") not in trained]:  # DDP's prefix
                    del state[key]
    accelerator.register_save_state_pre_hook(keep_trained)


def trained_shards(accelerate_function, save):
    """accelerate's save_fsdp_model or load_fsdp_model (save: which), for a LoRA model its trained parameters' shards
    alone, in the folder accelerate uses (torch.distributed.checkpoint's state dict without the frozen parameters: its
    names are the model's own under any wrapper, gradient checkpointing's too, which peft's adapter state dict, what
    accelerate's adapter_only mode uses, does not restore). A load of a checkpoint that lacks a trained parameter
    fails."""
    def call(plugin, accelerator, model, directory, index=0, **kwargs):
        if not is_lora(accelerator.unwrap_model(model)):
            return accelerate_function(plugin, accelerator, model, directory, index, **kwargs)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        folder = os.path.join(directory, f"pytorch_model_fsdp_{index}")
        trained = {name.replace("_checkpoint_wrapped_module.", "") for name, p in model.named_parameters()
                   if p.requires_grad}  # (a frozen tied output layer keeps its second name in the state dict)
        state = {"model": {name: tensor for name, tensor in get_model_state_dict(model, options=StateDictOptions(
            ignore_frozen_params=True)).items() if name in trained}}
        if len(state["model"]) != len(trained):  # names the state dict does not have would be saved and loaded never
            raise RuntimeError(f"LoRA checkpoint: {len(trained) - len(state['model'])} trained parameters have no "
                               "name in torch.distributed.checkpoint's state dict")
        if save:
            dcp.save(state, checkpoint_id=folder)
        else:
            dcp.load(state, checkpoint_id=folder)
            set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    return call


def check_adapter_checkpoint(accelerator, checkpoint):
    """After a non-strict load of a LoRA run's checkpoint: every parameter that trains was in it (one line if not)."""
    from safetensors import safe_open

    for i, model in enumerate(accelerator._models):
        unwrapped = accelerator.unwrap_model(model)
        path = f"{checkpoint}/model{f'_{i}' if i else ''}.safetensors"
        if not is_lora(unwrapped) or not os.path.exists(path):
            continue
        with safe_open(path, "pt") as f:
            saved = {key.removeprefix("module.") for key in f.keys()}
        missing = [name for name, p in unwrapped.named_parameters() if p.requires_grad and name.replace(
            "_checkpoint_wrapped_module.", "") not in saved]
        if missing:
            raise SystemExit(f"error: {checkpoint} has no {missing[0]} (and {len(missing) - 1} more): it is not this "
                             "run's LoRA checkpoint (--lora_rank and --model must be the run's)")
