"""Token log-probs and entropies without a batch x length x vocabulary float32 tensor.

A causal LM's last step turns each position's hidden state h (H numbers) into V logits, W h; log pi(token) =
(W h)_token / T - logsumexp(W h / T). With V = 151,936 (Qwen) the float32 logits of a micro-batch of 4 x 4,096 tokens
take 10 GB, and the log-softmax and its backward two more copies. Here the model runs as usual up to its output
layer, which is swapped for one that hands back h; the output layer is then applied a chunk of CHUNK_TOKENS positions
at a time, keeping per position only log pi(token), the log-sum-exp and (when asked) the entropy, and the backward
pass recomputes each chunk's logits from h. Values and gradients are those of the whole-vocabulary computation to
float32 rounding (tests/test_logprobs.py); the output layer's matmul runs in the dtype the model's own would (bf16
under autocast or FSDP2's mixed precision, float32 on a CPU), its softmax in float32.

The swap keeps the model's own forward call, so what wraps it still runs: DDP's gradient hooks, FSDP2's all-gathers
(the output layer's weight is gathered for the forward and, as FSDP2 keeps the root's weights unsharded until the
backward, used here and in the backward), accelerate's autocast, peft's adapters, gradient checkpointing."""

import contextlib

import torch

CHUNK_TOKENS = 1024  # positions whose full-vocabulary logits exist at once (prime-rl's and SkyRL's default)


def token_logprobs(model, input_ids, attention_mask, prompt_width, temperature, with_entropy=False,
                   chunk_tokens=CHUNK_TOKENS):
    """log pi(token) at every completion position (B, T) of [left-padded prompt (P = prompt_width) | completion (T)]
    rows, from logits divided by the temperature, with gradient when grad mode is on; and each position's entropy
    (B, T) without gradient when with_entropy (else None)."""
    if getattr(causal_lm(model).config, "final_logit_softcapping", None):  # (Gemma 2) a softcap the chunks do not apply
        return full_vocabulary_logprobs(model, input_ids, attention_mask, prompt_width, temperature, with_entropy)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion = input_ids[:, prompt_width:]

    def forward():  # from the last prompt position on; the last position, which predicts past the completion, goes
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     logits_to_keep=completion.shape[1] + 1).logits[:, :-1]

    return chunked_output_layer(model, forward, completion, temperature, with_entropy, chunk_tokens)


def chunked_output_layer(model, forward, completion, temperature, with_entropy=False, chunk_tokens=CHUNK_TOKENS):
    """(log pi(token), entropy or None), (B, T), of the completion tokens (B, T), as token_logprobs defines them.
    forward() calls the model; while it runs the output layer is swapped for one that hands back its input, so its
    .logits are the hidden states (B, T, H) at the positions that predict the completion. The output layer is then
    applied to them chunk_tokens positions at a time."""
    lm = causal_lm(model)
    head, capture = lm.lm_head, _HiddenStates(completion.device.type)
    lm.lm_head = capture  # the model's forward returns the hidden states where it would return logits
    try:
        hidden = forward()
    finally:
        lm.lm_head = head
    B, T, H = hidden.shape
    bias = head.bias if getattr(head, "bias", None) is not None else None
    logp, entropy = _ChunkedHead.apply(hidden.reshape(B * T, H), head.weight, bias, completion.reshape(-1),
                                       temperature, capture.dtype, chunk_tokens, with_entropy)
    return logp.view(B, T), entropy.view(B, T) if with_entropy else None


def full_vocabulary_logprobs(model, input_ids, attention_mask, prompt_width, temperature, with_entropy=False):
    """The same quantities from the whole (B, T, V) float32 log-softmax: the reference the chunked path is tested
    against, and the path of a model whose logits are soft-capped."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion = input_ids[:, prompt_width:]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=completion.shape[1] + 1).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    logp = logp_all.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def causal_lm(model):
    """The module whose forward applies the output layer (lm_head), under any wrapper: DDP, torch.compile, peft."""
    while hasattr(model, "module"):  # DDP; a LoRA run's reference (the policy with its adapters off)
        model = model.module
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


class _HiddenStates(torch.nn.Module):
    """Stands in for the output layer during one forward: returns its input, and notes the dtype the output layer's
    matmul would have run in there (autocast's, else the hidden states')."""

    def __init__(self, device_type):
        super().__init__()
        self.device_type, self.dtype = device_type, None

    def forward(self, hidden):
        autocast = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type) if autocast else hidden.dtype
        return hidden


class _ChunkedHead(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias (V,) or None, targets (N,)) -> (log pi(target) (N,), entropy (N,) or
    empty), chunk_tokens positions at a time; backward recomputes each chunk's logits. The gradient of log pi(t) with
    respect to the logits z is (onehot(t) - softmax(z / T)) / T. A chunk's (chunk_tokens, V) float32 buffer is reused
    in place for its softmax and gradient, and freed before the next chunk's."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype, chunk_tokens, with_entropy):
        logp, lse = hidden.new_empty(len(hidden), dtype=torch.float32), hidden.new_empty(len(hidden),
                                                                                         dtype=torch.float32)
        entropy = hidden.new_empty(len(hidden) if with_entropy else 0, dtype=torch.float32)
        w = weight.to(dtype)
        for start in range(0, len(hidden), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z = _logits(hidden[rows], w, bias, dtype, temperature)
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:  # H = logsumexp(z) - sum_v p_v z_v, p = exp(z - logsumexp(z))
                entropy[rows] = lse[rows] - (z - lse[rows, None]).exp_().mul_(z).sum(-1)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.dtype, ctx.chunk_tokens = temperature, dtype, chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, len(hidden), ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            g = grad_logp[rows, None]
            grad_z = _logits(hidden[rows], w, bias, ctx.dtype, ctx.temperature)  # z, then in place:
            grad_z.sub_(lse[rows, None]).exp_().mul_(-g)  # -g softmax(z) ...
            grad_z.scatter_add_(-1, targets[rows, None], g).div_(ctx.temperature)  # ... + g onehot(t), over T
            with _no_autocast(hidden):
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad_z.to(ctx.dtype) @ w).to(hidden.dtype)
                if grad_weight is not None:
                    if ctx.dtype == torch.float32:
                        grad_weight.addmm_(grad_z.T, hidden[rows].float())
                    else:
                        grad_weight += (grad_z.to(ctx.dtype).T @ hidden[rows].to(ctx.dtype)).float()
            if grad_bias is not None:
                grad_bias += grad_z.sum(0)
            del grad_z
        return (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None, None, None)


def _logits(hidden, weight, bias, dtype, temperature):
    """(hidden W^T (+ b)) / T, the matmul in `dtype` as the model's output layer computes it, in float32."""
    with _no_autocast(hidden):
        z = hidden.to(dtype) @ weight.T
        if bias is not None:
            z += bias.to(dtype)
    z = z.float()
    return z.div_(temperature) if temperature != 1.0 else z


def _no_autocast(tensor):
    return torch.autocast(tensor.device.type, enabled=False) if torch.is_autocast_enabled(tensor.device.type) else (
        contextlib.nullcontext())
