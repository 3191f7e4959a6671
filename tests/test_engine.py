"""The HF rollout engine and the trainer's log-probs, in process on the embedded model: sampling log-probs agree with
the trainer's (temperature applied), the model's own sampling defaults do not leak in, padding does not change
log-probs, and stop tokens and truncation are reported."""

import dataclasses
import json
import shutil

import pytest
import torch
from accelerate import Accelerator

import grpo
from tests.helpers import resolved
from grpo import make_batch
from plumbing.engine import Engine
from plumbing.engine import HFDecoder, Sample, sample_tokens
from plumbing.models import load_model, load_tokenizer

PROMPTS = ["12+34=", "07+45=", "99+99=", "5+5="]  # the last one is shorter: left padding is exercised


def setup(model_dir=None, **overrides):
    args = resolved(grpo, **overrides)
    if model_dir is not None:
        args.model = str(model_dir)
    accelerator = Accelerator(cpu=True)
    tokenizer, stop_ids = load_tokenizer(args.model)
    assert stop_ids == [tokenizer.eos_token_id]  # the embedded model's: rollouts below pass it
    model = load_model(args.model, tokenizer).eval()
    return args, accelerator, tokenizer, model


def rollout(model, tokenizer, accelerator, temperature, n=4, max_new_tokens=48):
    torch.manual_seed(0)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = Engine([tokenizer.eos_token_id])  # the HF decode loop
    samples, _ = grpo.generate(engine, model, tokenizer, prompts, n, temperature, 1.0, max_new_tokens, accelerator,
                               policy_version=1)
    batch = make_batch([p for p in prompts for _ in range(n)], samples, tokenizer.pad_token_id, "cpu")
    return samples, batch, logprobs(model, batch, temperature, micro_batch_size=5)


def logprobs(model, batch, temperature, micro_batch_size):
    """The trainer's log-probs of a whole batch, as one mini-batch."""
    return grpo.batched_logprobs(model, batch, temperature, Accelerator(cpu=True), len(batch), micro_batch_size)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_sampling_logprobs_match_the_trainer(temperature):
    _, accelerator, tokenizer, model = setup()
    _, batch, trainer = rollout(model, tokenizer, accelerator, temperature)
    mask = batch.mask.bool()
    assert (batch.engine_logp - trainer).abs()[mask].max() < 1e-4
    if temperature != 1.0:  # the trainer without the temperature would not match: the test can tell
        untempered = logprobs(model, batch, 1.0, micro_batch_size=5)
        assert (batch.engine_logp - untempered).abs()[mask].max() > 1e-2


def test_model_sampling_defaults_do_not_leak(tmp_path):
    shutil.copytree(grpo.TOY_MODEL_DIR, tmp_path / "m")
    path = tmp_path / "m" / "generation_config.json"
    config = json.load(open(path))
    config.update(top_k=2, repetition_penalty=3.0, temperature=0.2, do_sample=False)
    json.dump(config, open(path, "w"))
    _, accelerator, tokenizer, model = setup(tmp_path / "m")
    _, batch, trainer = rollout(model, tokenizer, accelerator, 1.0)
    assert (batch.engine_logp - trainer).abs()[batch.mask.bool()].max() < 1e-4


def test_left_padding_does_not_change_logprobs():
    _, accelerator, tokenizer, model = setup()
    samples, batch, trainer = rollout(model, tokenizer, accelerator, 1.0)
    prompt = tokenizer(PROMPTS[-1])["input_ids"]  # the short, left-padded prompt
    ids = samples[-1].token_ids
    alone = make_batch([prompt], [Sample(ids, None, False)], tokenizer.pad_token_id, "cpu")
    single = logprobs(model, alone, 1.0, micro_batch_size=1)
    assert torch.allclose(single[0, :len(ids)], trainer[-1, :len(ids)], atol=1e-5)


def test_the_reference_computes_as_the_policy_under_bf16_mixed_precision():
    """On GPU both models run under accelerate's bf16 autocast (here on the CPU's): the reference, loaded as the policy
    is (float32 weights), gives the policy's log-probs exactly at step 1, so the KL starts at 0; a reference stored in
    bf16 computes differently (its residual stream and norms in bf16)."""
    from transformers import AutoModelForCausalLM

    from accelerate.state import AcceleratorState

    args, _, tokenizer, _ = setup()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    samples = [Sample(tokenizer(p[::-1])["input_ids"], None, False) for p in PROMPTS]  # any tokens will do
    batch = make_batch(prompts, samples, tokenizer.pad_token_id, "cpu")
    mask = batch.mask.bool()
    AcceleratorState._reset_state(True)  # one accelerator state per process: this test's has bf16
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        policy = accelerator.prepare_model(load_model(args.model, tokenizer).eval())
        reference = accelerator.prepare_model(load_model(args.model, tokenizer).eval(), evaluation_mode=True)
        in_bf16 = accelerator.prepare_model(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
                                            .eval(), evaluation_mode=True)
        plain = load_model(args.model, tokenizer).eval()  # float32 without autocast
        with torch.no_grad():
            logp, ref_logp, bf16_logp = (grpo.batched_logprobs(m, batch, 1.0, accelerator, len(batch), 4)[mask]
                                         for m in (policy, reference, in_bf16))
    finally:
        AcceleratorState._reset_state(True)  # the next test's Accelerator(cpu=True) starts afresh
    fp32_logp = logprobs(plain, batch, 1.0, 4)[mask]
    assert (logp - fp32_logp).abs().max() > 1e-4  # the autocast is on
    assert torch.equal(logp, ref_logp)  # the same computation: bit-equal
    assert (logp - bf16_logp).abs().max() > 1e-3


def test_stop_tokens_and_truncation():
    _, accelerator, tokenizer, model = setup()
    samples, batch, _ = rollout(model, tokenizer, accelerator, 1.0, max_new_tokens=5)
    assert all(s.truncated and len(s.token_ids) == 5 for s in samples)  # no answer fits in 5 tokens
    samples, _, _ = rollout(model, tokenizer, accelerator, 0.0)  # greedy: no sampling log-probs
    assert all(s.token_ids[-1] == tokenizer.eos_token_id and not s.truncated and s.logprobs is None for s in samples)
    assert batch.mask.sum(-1).tolist() == [5.0] * 16


def test_fsdp_ranks_keep_stepping_until_every_rank_is_done():
    """Under FSDP every rank must run every forward pass: a rank whose rows are all finished keeps decoding a dummy
    row while another rank is still busy, and its own completions are the same as when it stops."""
    import types

    from accelerate.utils import DistributedType

    _, accelerator, tokenizer, model = setup()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    rows_per_call = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows_per_call.append(
        len(kwargs["input_ids"])), with_kwargs=True)
    torch.manual_seed(0)
    alone = HFDecoder([tokenizer.eos_token_id]).generate(model, tokenizer, prompts, 2, 1.0, 1.0, 40, accelerator)
    calls_alone, rows_alone, rows_per_call[:] = len(rows_per_call), list(rows_per_call), []
    other_rank_busy = types.SimpleNamespace(distributed_type=DistributedType.FSDP, device=accelerator.device,
                                            unwrap_model=accelerator.unwrap_model,
                                            reduce=lambda t, reduction: torch.ones_like(t))
    torch.manual_seed(0)
    synced = HFDecoder([tokenizer.eos_token_id]).generate(model, tokenizer, prompts, 2, 1.0, 1.0, 40, other_rank_busy)
    hook.remove()
    assert synced == alone
    assert rows_alone[0] == len(PROMPTS) and rows_alone[1] <= 2 * len(PROMPTS)  # prefilled once per prompt
    assert calls_alone < 40 and len(rows_per_call) == 40 and rows_per_call[-1] == 1


def with_advantages(batch, old_logp):
    """The batch with advantages from -1 to 1 over its completions and a reference 0.1 below pi_old."""
    batch.advantages = torch.linspace(-1, 1, len(batch))[:, None] * batch.mask
    batch.ref_logp = old_logp - 0.1
    return batch


def flat_update(model, policy):
    return torch.cat([(p0 - p1).detach().flatten() for p0, p1 in zip(model.parameters(), policy.parameters())])


def test_single_update_reuses_the_forward_pass_exactly():
    """mu = 1: taking pi_old from the training forward pass (no separate pass) gives the same update, and the
    engine/trainer gap is measured against that pass's log-probs."""
    import copy

    args, accelerator, tokenizer, model = setup()
    _, batch, old_logp = rollout(model, tokenizer, accelerator, 1.0)
    batch = with_advantages(batch, old_logp)
    updated = []
    for precomputed in (False, True):
        policy = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        b = dataclasses.replace(batch, old_logp=old_logp.clone() if precomputed else None)
        stats, _ = grpo.update_policy(args, policy, optimizer, b, accelerator)
        # pi_old from the training pass itself or from a separate pass: the same model on micro-batches of other
        # shapes, whose kernels may round differently (AVX-512, AMX): equal to float32 rounding, not bit for bit
        assert stats.sums["rollout/logprob_gap_mean"] < 1e-5
        if precomputed:  # (from the training pass, the first mini-batch's ratio is exactly 1 by construction: the
            # metric is logged only when pi_old has a pass of its own)
            assert stats.maxes["policy/first_minibatch_ratio_dev_max"] < 1e-5
        else:
            assert "policy/first_minibatch_ratio_dev_max" not in stats.maxes
        updated.append(flat_update(model, policy))
    assert torch.allclose(updated[0], updated[1], atol=1e-7)
    assert updated[0].abs().max() > 0


@pytest.mark.parametrize("script", ["grpo", "dapo", "dr_grpo"])  # three normalizers: 1/|o_i|, tokens, L_max
def test_micro_batch_size_does_not_change_the_update(script):
    """Gradient accumulation with global normalizer counts: micro-batches of 2 or 16 give the same gradient."""
    import copy
    import importlib

    module = importlib.import_module(script)
    args, accelerator, tokenizer, model = setup(max_grad_norm=1e9)
    args = dataclasses.replace(resolved(module, max_grad_norm=1e9), num_minibatches=1)
    _, batch, old_logp = rollout(model, tokenizer, accelerator, 1.0)
    batch = with_advantages(batch, old_logp)
    grads = []
    for micro in (2, 16):
        args.micro_batch_size, policy = micro, copy.deepcopy(model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)  # the update is minus the gradient
        module.update_policy(args, policy, optimizer, dataclasses.replace(batch), accelerator)
        grads.append(flat_update(model, policy))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_logged_statistics_are_exact_over_the_mini_batch():
    """Every statistic update_policy logs equals the one computed on the whole mini-batch at once, whatever the
    micro-batch size: the loss (it was logged divided by the number of micro-batches) and the token-weighted means
    (they were means of per-micro-batch means)."""
    import copy

    args, accelerator, tokenizer, model = setup()
    _, batch, old_logp = rollout(model, tokenizer, accelerator, 1.0)
    torch.manual_seed(1)  # off-policy, so clip fraction, ratio and approx KL are not trivially 0 or 1
    batch = with_advantages(batch, old_logp)
    batch.old_logp = old_logp - 0.3 * torch.rand_like(old_logp)
    with torch.no_grad():
        logp, entropy = grpo.token_logprobs(model, batch, 1.0, accelerator, with_entropy=True)
        counts = (torch.tensor(float(len(batch))), batch.mask.sum())
        loss, means, maxes = grpo.compute_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages, batch.mask,
                                               counts, args)
    mask = batch.mask.bool()
    expected = {**means, "losses/policy": loss, "losses/entropy": entropy[mask].mean()}
    assert 0 < expected["policy/clip_frac"] < 1
    for micro in (2, 4, 16):
        args.micro_batch_size = micro
        stats, _ = grpo.update_policy(args, copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0),
                                   dataclasses.replace(batch), accelerator)
        for key, value in expected.items():
            assert stats.sums[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), (micro, key)
        assert stats.maxes["policy/ratio_max"].item() == pytest.approx(maxes["policy/ratio_max"].item(), rel=1e-6)


def test_a_non_finite_loss_stops_before_the_optimizer_step():
    import copy

    args, accelerator, tokenizer, model = setup()
    _, batch, old_logp = rollout(model, tokenizer, accelerator, 1.0)
    batch = with_advantages(batch, old_logp)
    batch.advantages[3] = float("nan")
    policy = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    with pytest.raises(FloatingPointError, match="non-finite"):
        grpo.update_policy(args, policy, optimizer, batch, accelerator)
    for p0, p1 in zip(model.parameters(), policy.parameters()):
        assert torch.equal(p0, p1)  # the NaN never reached the weights


def test_sample_tokens_draws_from_the_tempered_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200_000, 1)
    torch.manual_seed(0)
    token, logp = sample_tokens(logits, 1.0, 1.0)
    frequencies = torch.bincount(token, minlength=4) / len(token)
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=4e-3)
    assert torch.allclose(logp, logits.gather(-1, token[:, None]).squeeze(-1), atol=1e-6)
    token, logp = sample_tokens(logits, 2.0, 1.0)  # T = 2: p ** 0.5, renormalized
    tempered = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(torch.bincount(token, minlength=4) / len(token), tempered / tempered.sum(), atol=4e-3)
    token, logp = sample_tokens(logits, 1.0, 0.7)  # nucleus {0, 1}: 0.5 / 0.8 and 0.3 / 0.8
    assert torch.allclose(torch.bincount(token, minlength=4) / len(token), torch.tensor([0.625, 0.375, 0, 0]),
                          atol=4e-3)
    assert torch.allclose(logp, torch.log(torch.tensor([0.625, 0.375]))[token], atol=1e-5)


@pytest.mark.parametrize("uniform, expected", [(0.0, 1), (1.0, 2)])
def test_sample_tokens_never_draws_a_zero_probability_token(monkeypatch, uniform, expected):
    """The uniform's ends, 0 and (by rounding) the total mass, still land on tokens of positive probability."""
    logits = torch.tensor([[-float("inf"), 0.0, 0.0, -float("inf")]])
    monkeypatch.setattr(torch, "rand_like", lambda x: torch.full_like(x, uniform))
    token, logp = sample_tokens(logits, 1.0, 1.0)
    assert token.tolist() == [expected] and torch.isfinite(logp).all()
