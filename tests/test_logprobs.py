"""utils/logprobs.py: token log-probs and entropies computed a chunk of positions at a time through the output layer
equal the whole-vocabulary computation's, in value and in gradient (with respect to the hidden states, the output
layer and every weight of the model), with temperature, padding, a bias and chunks that do not divide the positions;
and no tensor of the vocabulary's width outlives a chunk."""

import copy

import pytest
import torch

from tests.test_engine import rollout, setup
from utils.logprobs import _ChunkedHead, full_vocabulary_logprobs, token_logprobs


def reference_head(hidden, weight, bias, targets, temperature):
    z = (hidden @ weight.T + (bias if bias is not None else 0)).float() / temperature
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature, chunk, with_bias", [(1.0, 4, False), (0.7, 3, True), (1.3, 100, True)])
def test_the_chunked_head_is_the_full_head(temperature, chunk, with_bias):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 6, generator=g, requires_grad=True)
    weight = torch.randn(50, 6, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 50, (10,), generator=g)
    upstream = torch.randn(10, generator=g)  # any loss of the log-probs: a weighted sum
    logp, entropy = _ChunkedHead.apply(hidden, weight, bias, targets, temperature, torch.float32, chunk, True)
    expected_logp, expected_entropy = reference_head(hidden, weight, bias, targets, temperature)
    assert torch.allclose(logp, expected_logp, atol=1e-6) and torch.allclose(entropy, expected_entropy, atol=1e-5)
    wrt = [hidden, weight] + ([bias] if with_bias else [])
    grads = torch.autograd.grad((upstream * logp).sum(), wrt)
    expected = torch.autograd.grad((upstream * expected_logp).sum(), wrt)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_models_logprobs_entropies_and_gradients_are_the_full_vocabularys(temperature):
    """The embedded model (tied embeddings: the output layer's gradient meets the embedding's) on a rollout batch of
    16 completions of different lengths, left-padded prompts and right-padded completions; chunks of 7 positions."""
    args, accelerator, tokenizer, model = setup()
    _, batch, _ = rollout(model, tokenizer, accelerator, temperature)
    upstream = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    results = []
    for compute in (lambda m: token_logprobs(m, batch.input_ids, batch.attention_mask, batch.prompt_width,
                                             temperature, with_entropy=True, chunk_tokens=7),
                    lambda m: full_vocabulary_logprobs(m, batch.input_ids, batch.attention_mask, batch.prompt_width,
                                                       temperature, with_entropy=True)):
        copied = copy.deepcopy(model)
        logp, entropy = compute(copied)
        (upstream * logp).sum().backward()
        results.append((logp.detach(), entropy, {name: p.grad for name, p in copied.named_parameters()}))
    (logp, entropy, grads), (expected_logp, expected_entropy, expected_grads) = results
    mask = batch.mask.bool()
    assert torch.allclose(logp[mask], expected_logp[mask], atol=1e-5)
    assert torch.allclose(entropy[mask], expected_entropy[mask], atol=1e-4)
    assert grads.keys() == expected_grads.keys() and "model.embed_tokens.weight" in grads
    for name, grad in grads.items():  # float32 rounding, bounded relative to the gradient's scale (its largest
        # entry), not entry by entry: sums run in another order, and d log pi / d h = (W_t - sum_v p_v W_v) / T cancels
        # when the sampled token's probability is near 1 (both implementations; measured: <= 1.5e-5 of the scale)
        scale = expected_grads[name].abs().max()
        assert (grad - expected_grads[name]).abs().max() <= 5e-5 * scale, name


def test_the_output_layer_is_restored_and_no_grad_keeps_no_graph():
    _, accelerator, tokenizer, model = setup()
    _, batch, _ = rollout(model, tokenizer, accelerator, 1.0)
    head = model.lm_head
    with torch.no_grad():
        logp, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width, 1.0)
    assert model.lm_head is head and entropy is None and not logp.requires_grad
    with pytest.raises(RuntimeError, match="boom"):  # a failing forward still puts the output layer back
        model.model.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width, 1.0)
    assert model.lm_head is head


def test_gradient_checkpointing_gives_the_same_gradients_and_names():
    """Every decoder layer recomputed in the backward pass: the same log-probs and gradients bit for bit (the same
    kernels on the same shapes), the rollout's decode loop unchanged, and the state dict under the model's names."""
    from utils.models import gradient_checkpointing

    args, accelerator, tokenizer, model = setup()
    torch.manual_seed(0)
    _, batch, _ = rollout(model, tokenizer, accelerator, 1.0)
    checkpointed = gradient_checkpointing(copy.deepcopy(model), "on", args.model)
    assert gradient_checkpointing(model, "auto", args.model) is model  # the embedded model: off by default
    assert any("_checkpoint_wrapped_module" in name for name, _ in checkpointed.named_parameters())
    assert list(checkpointed.state_dict()) == list(model.state_dict())
    torch.manual_seed(0)
    _, batch_again, _ = rollout(checkpointed, tokenizer, accelerator, 1.0)  # the decode loop through the wrappers
    assert torch.equal(batch.input_ids, batch_again.input_ids)
    grads = []
    for m in (model, checkpointed):
        logp, _ = token_logprobs(m, batch.input_ids, batch.attention_mask, batch.prompt_width, 1.0)
        (logp * batch.mask).sum().backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in m.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
