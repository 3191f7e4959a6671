"""What a run's trainer will need: an estimate of its peak memory per process for one optimizer step on a micro-batch
of the longest sequences, from the models' sizes and the run's arguments, printed at start (and, on a GPU, with
the rollout engine's share). benchmarks/memory.py measures the same quantities and reports the estimate's error.

Per process, with P the parameters of the models trained (the policy; ppo.py's critic too), M the largest of them,
F those of the frozen reference, W the processes (FSDP2 shards every model over them; DDP does not), b x S tokens in
a micro-batch of which b x T are completion tokens, L decoder layers of width H, MLP width I, key/value width K:

  peak = weights + gradients + optimizer + max(activations + log-probs, scratch)

  weights      4 (P + F) / W          float32 master weights (GPU: bf16 autocast or FSDP2's bf16 compute copies)
  gradients    4 P / W                float32 (a second micro-batch's forward pass runs beside the first's gradients;
                                       DDP's all-reduce buckets hold them: make_accelerator's gradient_as_bucket_view)
  optimizer    8 P / W                AdamW's two moments
  activations  b S L a                 a = A (7 H + 2 K + 4 I) bytes per token and layer: the tensors a Llama/Qwen
                                       layer keeps for its backward pass (A = 4 in float32, 2 under bf16);
                                       with gradient checkpointing b S (L A' H + a), A' the residual stream's bytes
  log-probs    b T H 4 + 3 C V 4       the hidden states the output layer reads, and one chunk of C positions'
               (+ 4 V H)               float32 logits (C V 4 <= CHUNK_BYTES, and C <= b T), their log-softmax and its
                                       gradient (the chunk's backward pass, which recomputes them); where the output
                                       layer trains (not under LoRA) and b T > C, a later chunk's gradient of its
                                       weight before autograd adds it into the gradient (the first chunk's becomes
                                       the gradient itself; a step's later micro-batches hold it for one chunk too)
  scratch      8 M / W                 the step's temporaries once the activations are freed: AdamW's per-parameter
                                       step (a CPU's) holds two of the largest parameter's size (sqrt of the second
                                       moment, then its quotient), as a tied embedding's backward does (its two
                                       gradients meeting); on a GPU 4 P / W (AdamW's foreach step makes a
                                       temporary of every parameter at once)

The activations and the log-prob pass's tensors are freed before the end of the backward pass, where the scratch
begins: the peak is the larger of the two on top of the state. benchmarks/memory.py measures both phases' peak
(torch's MemTracker) and reports the estimate's error.
"""

import torch

CHUNK_BYTES = 2**27  # the scripts' CHUNK_BYTES: one chunk's float32 logits (a test keeps them equal)

GB = 2**30


def parameters(model):
    """Parameters of a model, counted on its full (unsharded) shapes."""
    return sum(p.numel() for p in model.parameters())


def estimate(config, trained, largest, frozen, micro_batch, seq_len, completion_len, checkpointing, bf16=False,
             processes=1, fsdp=False, cuda=False, head_trained=True):
    """Bytes of each part of one process's trainer peak (dict, and "total"), per the module docstring. config: the
    policy's model config; trained, frozen: parameter counts; largest: the largest trained parameter's count;
    head_trained: whether the output layer's weight takes a gradient."""
    shard = processes if fsdp else 1
    act_bytes = 2 if bf16 else 4
    H, I, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    K = getattr(config, "num_key_value_heads", config.num_attention_heads) * getattr(
        config, "head_dim", H // config.num_attention_heads)
    per_layer_token = act_bytes * (7 * H + 2 * K + 4 * I)
    tokens = micro_batch * seq_len
    activations = tokens * (L * 4 * H + per_layer_token) if checkpointing else tokens * L * per_layer_token
    V = config.vocab_size
    chunk = min(max(1, CHUNK_BYTES // (4 * V)), micro_batch * completion_len)
    parts = {"weights": 4 * (trained + frozen) / shard, "gradients": 4 * trained / shard,
             "optimizer": 8 * trained / shard, "activations": activations,
             "logprobs": micro_batch * completion_len * H * 4 + 3 * 4 * V * chunk +
             (4 * V * H if head_trained and micro_batch * completion_len > chunk else 0),
             "scratch": (4 * trained if cuda else 8 * largest) / shard}
    parts["total"] = (parts["weights"] + parts["gradients"] + parts["optimizer"] +
                      max(parts["activations"] + parts["logprobs"], parts["scratch"]))
    return parts


def device_memory():
    """Bytes of the device the trainer runs on: the GPU's, or the machine's available memory."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        info = dict(line.split(":") for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def memory_line(parts, engine_fraction=None, device=None):
    """One line for the console: the estimate, its largest parts, and, where it does not fit the device (beside the
    engine's share on a GPU), which flag to change."""
    device = device_memory() if device is None else device
    room = device * (1 - (engine_fraction or 0))
    largest = sorted((k for k in parts if k != "total"), key=parts.get, reverse=True)[:3]
    line = (f"memory: the trainer needs about {parts['total'] / GB:.1f} GB per process (" +
            ", ".join(f"{k} {parts[k] / GB:.1f}" for k in largest) + ")" +
            (f", beside the engine's {engine_fraction:.0%} of the GPU's {device / GB:.0f} GB" if engine_fraction
             else f", of {device / GB:.0f} GB available"))
    if parts["total"] > room:
        line += (": it does not fit; lower --micro_batch_size or --max_new_tokens, turn on --gradient_checkpointing, "
                 "use LoRA (--lora_rank), or shard over more GPUs (configs/fsdp2.yaml)")
    return line


def trainer_memory(accelerator, trained_models, frozen_models, micro_batch, seq_len, completion_len):
    """estimate() for a run's models as they were prepared: the parameters that train (peft's adapters only under
    LoRA) and the frozen ones (a reference model, LoRA's base weights), gradient checkpointing if the policy's layers
    are wrapped for it, bf16, the processes and FSDP2 from the accelerator."""
    models = [m for m in trained_models if m is not None]
    frozen = [m for m in frozen_models if m is not None]
    trainable = [p.numel() for m in models for p in m.parameters() if p.requires_grad]
    fixed = sum(p.numel() for m in models for p in m.parameters() if not p.requires_grad) + sum(map(parameters, frozen))
    checkpointing = any(type(module).__name__ == "CheckpointWrapper" for module in models[0].modules())
    policy = accelerator.unwrap_model(models[0])
    head_trained = policy.get_output_embeddings().weight.requires_grad
    return estimate(policy.config, sum(trainable), max(trainable), fixed, micro_batch, seq_len, completion_len,
                    checkpointing, accelerator.mixed_precision == "bf16", accelerator.num_processes,
                    accelerator.is_fsdp2, torch.cuda.is_available(), head_trained)


def print_memory_estimate(accelerator, engine, trained_models, frozen_models, micro_batch, seq_len, completion_len):
    """Print the run's memory_line at start: trainer_memory for its models and lengths, beside the engine's share of
    the GPU when it sleeps there."""
    accelerator.print(memory_line(trainer_memory(accelerator, trained_models, frozen_models, micro_batch, seq_len,
                                                 completion_len), engine.gpu_fraction if engine.asleep else None))
