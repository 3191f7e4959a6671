"""grpo.py's token log-probs (token_logprobs, output_logprobs): computed a chunk of positions at a time through the
output layer under torch.utils.checkpoint, they equal the whole-vocabulary computation's, in value and in gradient
(with respect to the hidden states, the output layer and every weight of the model), with temperature, padding, a bias,
a soft-capped output and chunks that do not divide the positions; the entropy is accurate to 1e-6 relative in float32
for peaked distributions; no tensor of the vocabulary's width is kept for the backward pass outside a chunk."""

import copy

import pytest
import torch
from accelerate import Accelerator

import grpo
from benchmarks.memory import full_vocabulary_logprobs
from tests.helpers import ROOT
from tests.test_engine import rollout, setup


def reference_head(hidden, weight, bias, targets, temperature):
    z = (hidden @ weight.T + (bias if bias is not None else 0)).float() / temperature
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


class Head(torch.nn.Module):
    """The smallest model output_logprobs reads: an output layer and a config."""

    def __init__(self, weight, bias, softcap=None):
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        self.lm_head.weight, self.config = weight, type("Config", (), {"final_logit_softcapping": softcap})()
        if bias is not None:
            self.lm_head.bias = bias

    def get_output_embeddings(self):
        return self.lm_head


@pytest.mark.parametrize("temperature, chunk, with_bias", [(1.0, 4, False), (0.7, 3, True), (1.3, 100, True)])
def test_the_chunked_output_layer_is_the_full_one(monkeypatch, temperature, chunk, with_bias):
    monkeypatch.setattr(grpo, "CHUNK_BYTES", 4 * 50 * chunk)  # `chunk` positions of 50 float32 logits
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 6, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(50, 6, generator=g))
    bias = torch.nn.Parameter(torch.randn(50, generator=g)) if with_bias else None
    targets = torch.randint(0, 50, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g)  # any loss of the log-probs: a weighted sum
    logp, entropy = grpo.output_logprobs(Head(weight, bias), hidden, targets, temperature, Accelerator(cpu=True), True)
    expected_logp, expected_entropy = reference_head(hidden.reshape(10, 6), weight, bias, targets.reshape(10),
                                                     temperature)
    assert torch.allclose(logp.reshape(10), expected_logp, atol=1e-6)
    assert torch.allclose(entropy.reshape(10), expected_entropy, atol=1e-5) and not entropy.requires_grad
    wrt = [hidden, weight] + ([bias] if with_bias else [])
    grads = torch.autograd.grad((upstream * logp).sum(), wrt)
    expected = torch.autograd.grad((upstream.reshape(10) * expected_logp).sum(), wrt)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_a_soft_capped_output_is_capped_before_the_softmax():
    """Gemma 2 caps its logits, cap tanh(z / cap), in its own forward: the chunks apply the same cap."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1, 7, 6, generator=g) * 5, torch.nn.Parameter(torch.randn(50, 6, generator=g))
    targets = torch.randint(0, 50, (1, 7), generator=g)
    logp, _ = grpo.output_logprobs(Head(weight, None, softcap=3.0), hidden, targets, 1.0, Accelerator(cpu=True))
    z = 3.0 * torch.tanh(hidden[0] @ weight.T / 3.0)
    assert torch.allclose(logp[0], torch.log_softmax(z, -1).gather(-1, targets[0, :, None]).squeeze(-1), atol=1e-6)
    uncapped, _ = grpo.output_logprobs(Head(weight, None), hidden, targets, 1.0, Accelerator(cpu=True))
    assert (uncapped - logp).abs().max() > 0.1  # the cap matters at these logits: the test can tell


def entropy_exactly(logits, temperature):
    """-sum_v p_v log p_v of softmax(z / T) at 40 digits (mpmath): float64's own log_softmax loses the entropy of
    rows as peaked as H ~ 1e-15 as float32's loses H ~ 1e-7."""
    import mpmath

    with mpmath.workdps(40):
        z = [mpmath.mpf(x) / mpmath.mpf(temperature) for x in logits]
        top = max(z)
        total = mpmath.fsum(mpmath.exp(x - top) for x in z)
        logp = [x - top - mpmath.log(total) for x in z]
        return float(-mpmath.fsum(mpmath.exp(lp) * lp for lp in logp))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_peaked_distributions_entropy_is_accurate_to_1e_6_in_float32(temperature):
    """The entropy of softmax(z / T) from float32 logits z, against its exact value from the same logits: within 1e-6
    relative on (77, 66, 60) (H = 2.0116e-4 at T = 1, where logsumexp(z) - sum_v p_v z_v in float32 gives 9.2e-5 and a
    float32 log_softmax 2.0111e-4, 2.7e-4 off) and on random rows peaked to every degree down to H ~ 1e-12 (a float32
    log_softmax is up to 5e-2 off there). Rows whose entropy is below float32's range of e^(z - max z) (H < 1e-30) are
    left out: no float32 logit tells them apart."""
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.tensor([[77.0, 66.0, 60.0] + [-1e4] * 21]), torch.randn(400, 24, generator=g) *
                      torch.logspace(0, 1.6, 400, dtype=torch.float32)[:, None]])  # spread 1 to 40: H from ~3 to ~0
    weight = torch.nn.Parameter(torch.eye(24))
    _, entropy = grpo.output_logprobs(Head(weight, None), rows[None], torch.zeros(1, len(rows), dtype=torch.long),
                                      temperature, Accelerator(cpu=True), with_entropy=True)
    exact = torch.tensor([entropy_exactly(row, temperature) for row in rows.tolist()], dtype=torch.float64)
    if temperature == 1.0:
        assert abs(exact[0] - 2.0116e-4) < 1e-8
    kept = exact > 1e-30
    assert kept.sum() > 380 and exact[kept].min() < 1e-12 and entropy.dtype == torch.float32
    relative = ((entropy[0].double() - exact) / exact)[kept].abs()
    assert relative.max() < 1e-6, relative.max()
    float32 = torch.log_softmax(rows / temperature, -1)  # the naive float32 formula is far off on the same rows
    assert ((-(float32.exp() * float32).sum(-1).double() - exact) / exact)[kept].abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_models_logprobs_entropies_and_gradients_are_the_full_vocabularys(monkeypatch, temperature):
    """The embedded model (tied embeddings: the output layer's gradient meets the embedding's) on a rollout batch of
    16 completions of different lengths, left-padded prompts and right-padded completions; chunks of 7 positions."""
    monkeypatch.setattr(grpo, "CHUNK_BYTES", 4 * 258 * 7)  # the embedded model's 258 tokens
    args, accelerator, tokenizer, model = setup()
    _, batch, _ = rollout(model, tokenizer, accelerator, temperature)
    upstream = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    results = []
    for compute in (grpo.token_logprobs, full_vocabulary_logprobs):
        copied = copy.deepcopy(model)
        logp, entropy = compute(copied, batch, temperature, accelerator, with_entropy=True)
        (upstream * logp).sum().backward()
        results.append((logp.detach(), entropy, {name: p.grad for name, p in copied.named_parameters()}))
    (logp, entropy, grads), (expected_logp, expected_entropy, expected_grads) = results
    mask = batch.mask.bool()
    assert torch.allclose(logp[mask], expected_logp[mask], atol=1e-5)
    assert torch.allclose(entropy[mask], expected_entropy[mask], atol=1e-4)
    assert grads.keys() == expected_grads.keys() and "model.embed_tokens.weight" in grads
    for name, grad in grads.items():  # float32 rounding, bounded relative to the gradient's scale (its largest
        # entry), not entry by entry: sums run in another order, and d log pi / d h = (W_t - sum_v p_v W_v) / T cancels
        # when the sampled token's probability is near 1 (measured: <= 1.5e-5 of the scale)
        scale = expected_grads[name].abs().max()
        assert (grad - expected_grads[name]).abs().max() <= 5e-5 * scale, name


def test_no_vocabulary_wide_tensor_is_kept_for_the_backward_pass():
    """Every tensor autograd keeps for the backward pass, outside the checkpointed chunks (which keep only their
    inputs and recompute the rest): none holds more than one row of V numbers per sequence (the model's own output
    layer runs on one position, logits_to_keep=1), so the kept memory grows with B x T x H, not B x T x V."""
    _, accelerator, tokenizer, model = setup()
    _, batch, _ = rollout(model, tokenizer, accelerator, 1.0)
    V, kept = model.config.vocab_size, []

    def pack(tensor):
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, _ = grpo.token_logprobs(model, batch, 1.0, accelerator)
    parameters = {p.data_ptr() for p in model.parameters()}
    wide = [tuple(t.shape) for t in kept if t.shape and t.shape[-1] == V and t.data_ptr() not in parameters
            and t.numel() > len(batch) * V]
    assert kept and not wide, wide
    with torch.no_grad():
        logp, entropy = grpo.token_logprobs(model, batch, 1.0, accelerator)
    assert entropy is None and not logp.requires_grad


RESIDENT_PEAK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import grpo
from accelerate import Accelerator
from tests.test_logprobs import Head
def vm(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) // 1024
torch.set_num_threads(1)
torch.manual_seed(0)
head = Head(torch.nn.Parameter(torch.randn(49152, 576) * 0.05), None)  # SmolLM2's width and vocabulary
hidden, tokens = torch.randn(16, 64, 576, requires_grad=True), torch.randint(0, 49152, (16, 64))
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
before = vm("VmRSS")
for _ in range(4):
    logp, _ = grpo.output_logprobs(head, hidden, tokens, 0.7, Accelerator(cpu=True), sys.argv[2] == "1")
    logp.sum().backward()
print(vm("VmHWM") - before)
"""


@pytest.mark.slow
def test_the_entropy_adds_no_resident_memory_to_the_log_prob_pass():
    """update_policy asks for the entropy with the log-probs: the training pass's resident peak (fresh processes,
    glibc's allocator, 4 passes over 1024 positions at SmolLM2's width: chunks of 682 and 342 positions) is the same
    with it as without, within 64 MiB (one float64 piece of token_entropy, CHUNK_BYTES / 2). Pieces of a quarter of
    each chunk (33 MB for the short chunk, under glibc's 32 MiB ceiling for mapping a block on its own) fragmented
    the heap: 350 MiB more."""
    import subprocess
    import sys

    peaks = [int(subprocess.run([sys.executable, "-c", RESIDENT_PEAK, ROOT, entropy], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout) for entropy in ("0", "1")]
    assert peaks[1] <= peaks[0] + 64, peaks


def test_gradient_checkpointing_gives_the_same_gradients_and_names():
    """Every decoder layer recomputed in the backward pass: the same log-probs and gradients bit for bit (the same
    kernels on the same shapes), the rollout's decode loop unchanged, and the state dict under the model's names."""
    from plumbing.models import gradient_checkpointing

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
        logp, _ = grpo.token_logprobs(m, batch, 1.0, accelerator)
        (logp * batch.mask).sum().backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in m.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])


def test_every_script_and_the_memory_estimate_chunk_alike():
    """The start-up estimate (plumbing/memory.py) counts the chunk every script computes."""
    import importlib

    from plumbing import memory
    from tests.test_shared_blocks import SCRIPTS

    for script in SCRIPTS:
        assert importlib.import_module(script[:-3]).CHUNK_BYTES == memory.CHUNK_BYTES, script
