"""dpo.py: DPO (arXiv 2305.18290, eq. 7) against TRL 1.16's DPOTrainer (its own loss code, on the same pairs), the
paper's identity at theta = ref, normalizers exact over micro-batches, the pairs chosen from a group's samples, the
preference-file loader and its one-line errors, and runs end to end (offline, online and file pairs; resume reads the
offline pairs back)."""

import copy
import json
import math
import os

import pytest
import torch
from accelerate import Accelerator

import dpo
from plumbing.engine import Sample
from plumbing.models import load_model, load_tokenizer
from tests.helpers import SMALL, resolved, run_grpo
from utils.tasks import TOY_MODEL_DIR, load_preferences

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PAIRS, CHAT_PAIRS = os.path.join(DATA, "toy_pairs.jsonl"), os.path.join(DATA, "toy_pairs_chat.jsonl")


def pair_batch(tokenizer, rows, dtype=torch.float32):
    """dpo.py's batch of rows {prompt_ids, chosen_ids, rejected_ids}: the chosen completions, then the rejected (its
    mask in the models' dtype)."""
    prompts = [r["prompt_ids"] for r in rows] * 2
    samples = [Sample(r["chosen_ids"], None, False) for r in rows] + [Sample(r["rejected_ids"], None, False)
                                                                       for r in rows]
    batch = dpo.make_batch(prompts, samples, tokenizer.pad_token_id, "cpu")
    batch.mask = batch.mask.to(dtype)
    return batch


def our_loss(model, ref_model, batch, weights, micro_batch_size, args):
    """dpo.py's loss over the whole batch as update_policy takes it (one mini-batch), its gradient accumulated."""
    accelerator = Accelerator(cpu=True)
    batch.ref_logp = dpo.batched_logprobs(ref_model, batch, 1.0, accelerator, len(batch), micro_batch_size)
    total = 0.0
    for pairs, mc in dpo.pair_micro_batches(batch, micro_batch_size):
        logp, _ = dpo.token_logprobs(model, mc, 1.0, accelerator)
        loss, _ = dpo.compute_loss(logp, mc.ref_logp, mc.mask, weights[pairs], weights.sum(), args)
        loss.backward()
        total += loss.item()
    return total


def trl_trainer(tmp_path, policy, reference, tokenizer, rows):
    """TRL 1.16's DPOTrainer, sigmoid loss (its default), beta 0.1, on these pairs in one batch, on the CPU."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(output_dir=str(tmp_path), beta=0.1, per_device_train_batch_size=len(rows), report_to="none",
                       use_cpu=True, bf16=False, gradient_checkpointing=False, max_length=None, save_strategy="no",
                       logging_strategy="no")
    trainer = DPOTrainer(model=policy, ref_model=reference, args=config, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(rows))
    assert trainer.loss_types == ["sigmoid"] and trainer.beta == 0.1
    return trainer


def moved_toy_models(dtype):
    """The embedded model as the reference, and a copy moved off it (every pair's sigmoid away from 1/2)."""
    torch.manual_seed(0)
    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    reference = load_model(TOY_MODEL_DIR, tokenizer).to(dtype)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tokenizer, policy, reference


def test_the_loss_and_its_gradient_are_trls_end_to_end_in_float32(tmp_path):
    """TRL 1.16's DPOTrainer whole (its tokenization of the file's pairs, its fused log-prob kernel, its loss code) and
    dpo.py on the same token ids: the same loss and the same gradient of every weight. Both compute in float32, the
    sums in other orders (TRL's kernel tiles the vocabulary): within 1e-6 relative (loss) and 1e-5 of each gradient's
    scale."""
    tokenizer, policy, reference = moved_toy_models(torch.float32)
    ours, ours_ref = copy.deepcopy(policy), copy.deepcopy(reference)
    rows = [json.loads(line) for line in open(PAIRS)][:6]
    trainer = trl_trainer(tmp_path, policy, reference, tokenizer, rows)
    tokenized = [trainer.train_dataset[i] for i in range(len(rows))]
    trl_loss = trainer._compute_loss(trainer.model, trainer.data_collator(tokenized), return_outputs=False)
    trl_loss.backward()
    loss = our_loss(ours, ours_ref, pair_batch(tokenizer, tokenized), torch.ones(len(rows)), 4, resolved(dpo))
    assert 0.3 < trl_loss.item() < 1.5 and abs(trl_loss.item() - math.log(2)) > 1e-3  # the policy moved
    assert loss == pytest.approx(trl_loss.item(), rel=1e-6)
    theirs = dict(trainer.model.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - theirs[name].grad).abs().max() <= 1e-5 * theirs[name].grad.abs().max(), name


def test_the_loss_and_its_gradient_are_trls_loss_code_in_float64(tmp_path):
    """TRL's loss code (DPOTrainer._compute_loss: the sums over completions, the log-ratios, -logsigmoid, the mean)
    in float64, fed the same float64 token log-probs as dpo.py computes (TRL's own kernel computes in float32 whatever
    the model's dtype, so it is replaced by an exact full-vocabulary log_softmax): the same loss and gradient to
    float64 rounding."""
    from trl.trainer.utils import FusedCausalLMOutput

    tokenizer, policy, reference = moved_toy_models(torch.float64)
    ours, ours_ref = copy.deepcopy(policy), copy.deepcopy(reference)
    rows = [json.loads(line) for line in open(PAIRS)][:6]
    trainer = trl_trainer(tmp_path, policy, reference, tokenizer, rows)

    def exact_head(module):  # what TRL's fused head returns, exactly: log pi(label) and its side statistics
        forward = type(module).forward

        def fused(input_ids=None, attention_mask=None, labels=None, fused_lm_head=False, **kwargs):
            logits = forward(module, input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            logp_all = torch.log_softmax(logits, -1)
            mask = labels[:, 1:] != -100
            logp = logp_all.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1) * mask
            return FusedCausalLMOutput(log_probs=logp, entropy=torch.zeros_like(logp), mean_logits=logits.mean(-1),
                                       is_top1=torch.zeros_like(mask))
        module.forward = fused

    exact_head(trainer.model)
    exact_head(trainer.ref_model)
    tokenized = [trainer.train_dataset[i] for i in range(len(rows))]
    trl_loss = trainer._compute_loss(trainer.model, trainer.data_collator(tokenized), return_outputs=False)
    trl_loss.backward()
    loss = our_loss(ours, ours_ref, pair_batch(tokenizer, tokenized, torch.float64),
                    torch.ones(len(rows), dtype=torch.float64), 4, resolved(dpo))
    assert trl_loss.dtype == torch.float64 and abs(trl_loss.item() - math.log(2)) > 1e-3
    assert loss == pytest.approx(trl_loss.item(), rel=1e-12)
    theirs = dict(trainer.model.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - theirs[name].grad).abs().max() <= 1e-10 * theirs[name].grad.abs().max(), name


def test_at_the_reference_the_loss_is_log_2_and_the_gradient_half_the_log_prob_difference():
    """theta = ref: Delta = 0 for every pair, so L = log 2 and grad L = -beta / (2N) sum (grad log pi(y_w|x) -
    grad log pi(y_l|x)) (sigma(0) = 1/2), checked against that gradient computed directly."""
    torch.manual_seed(0)
    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    model = load_model(TOY_MODEL_DIR, tokenizer).double()
    rows = [{"prompt_ids": tokenizer(r["prompt"])["input_ids"], "chosen_ids": tokenizer(r["chosen"])["input_ids"],
             "rejected_ids": tokenizer(r["rejected"])["input_ids"]} for r in map(json.loads, open(PAIRS))][:5]
    args = resolved(dpo)
    loss = our_loss(model, copy.deepcopy(model), pair_batch(tokenizer, rows, torch.float64),
                    torch.ones(5, dtype=torch.float64), 10, args)
    assert loss == pytest.approx(math.log(2), abs=1e-12)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    batch = pair_batch(tokenizer, rows, torch.float64)
    logp, _ = dpo.token_logprobs(model, batch, 1.0, Accelerator(cpu=True))
    chosen, rejected = (logp * batch.mask).sum(-1).chunk(2)
    (-args.beta / (2 * 5) * (chosen - rejected).sum()).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-14, rtol=1e-10), name


def test_the_worked_example_of_the_docstring():
    """beta 0.1, log-ratios +1.5 (chosen) and -0.5 (rejected): Delta 2, loss -log sigmoid(0.2) = 0.5981, dL/dDelta =
    -0.04502, implicit rewards 0.15 and -0.05; a placeholder pair (weight 0) adds nothing, and N counts pairs."""
    args = resolved(dpo)
    # rows: the chosen of pair 1 and of a placeholder, then their rejected; pi_ref's log-probs 0
    logp = torch.tensor([[1.0, 0.5], [0.3, 0.2], [-0.5, 0.0], [0.1, 0.0]], requires_grad=True)
    mask, ref = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]]), torch.zeros(4, 2)
    loss, means = dpo.compute_loss(logp, ref, mask, torch.tensor([1.0, 0.0]), torch.tensor(1.0), args)
    assert loss.item() == pytest.approx(0.5981, abs=1e-4) and "0.5981" in dpo.__doc__
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-0.04502] * 2, abs=1e-5)  # each token of the chosen completion
    assert grad[2, 0].item() == pytest.approx(0.04502, abs=1e-5) and grad[2, 1] == 0  # padding
    assert grad[1].abs().sum() == 0 and grad[3].abs().sum() == 0  # the placeholder pair
    assert means["rewards/chosen"].item() == pytest.approx(0.15) and means["rewards/rejected"].item() == pytest.approx(
        -0.05)
    assert means["rewards/margins"].item() == pytest.approx(0.2) and means["rewards/accuracies"].item() == 1.0


def test_micro_batches_change_no_update():
    """The same pairs in micro-batches of 2, 4 and 12 sequences (1, 2 and 6 pairs, of different lengths) give one
    gradient: the mean is over the mini-batch's pairs, whichever pass holds them."""
    torch.manual_seed(0)
    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    reference = load_model(TOY_MODEL_DIR, tokenizer).double()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [{"prompt_ids": tokenizer(r["prompt"])["input_ids"], "chosen_ids": tokenizer(r["chosen"] + " ok" * (i % 3))[
        "input_ids"], "rejected_ids": tokenizer(r["rejected"])["input_ids"]}
        for i, r in enumerate(map(json.loads, open(PAIRS))) if i < 6]
    weights = torch.tensor([1.0, 1, 0, 1, 1, 1], dtype=torch.float64)
    grads = []
    for size in (2, 4, 12):
        model = copy.deepcopy(policy)
        our_loss(model, reference, pair_batch(tokenizer, rows, torch.float64), weights, size, resolved(dpo))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-13) and torch.allclose(grads[0], grads[2], atol=1e-13)


def test_a_pair_is_a_right_and_a_wrong_sample_of_one_prompt():
    pairs = dpo.choose_pairs([0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0], [0.1, 1.1, 1.0, 0.0] + [1.0] * 4 + [0.1] * 4, 4)
    assert pairs == [(1, 3), None, None]  # the docstring's example; all right; all wrong
    assert dpo.choose_pairs([1, 0, 1, 0], [1.0, 0.1, 1.1, 0.1], 2) == [(0, 1), (2, 3)]
    assert "-> (1, 3)" in dpo.choose_pairs.__doc__


def test_by_reward_a_pair_is_the_best_and_the_worst_sample():
    accuracy, rewards = [0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1, 1], [0, 0.1, 0, 0.1, 1.1, 0, 0.1, 1.0, 1.1, 1.1, 1.1, 1.1]
    assert dpo.choose_pairs(accuracy, rewards, 4, "reward") == [(1, 0), (4, 5), None]  # the docstring's; all equal
    assert dpo.choose_pairs(accuracy, rewards, 4) == [None, (4, 5), None]  # all wrong makes no correctness pair
    assert "-> (1, 0)" in dpo.choose_pairs.__doc__


def test_the_preference_file_loads_plain_and_conversational_rows():
    """TRL's format: a plain prompt gets the chat template and the answer instruction as every task's does (raw text
    for the template-less embedded model); a conversational one its messages; each completion ends with EOS;
    completions longer than the limit are cut and counted."""
    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    rows, summary = load_preferences(PAIRS, tokenizer, "answer_tags", "system", 512, 48)
    assert len(rows) == 256 and rows[0]["prompt"] == rows[0]["question"] == "00+00="
    assert rows[0]["prompt_ids"] == tokenizer("00+00=", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(rows[0]["chosen"]) == "<answer>000</answer>" + tokenizer.eos_token
    assert rows[0]["rejected"][-1] == tokenizer.eos_token_id and rows[0]["rejected"] != rows[0]["chosen"]
    chat, _ = load_preferences(CHAT_PAIRS, tokenizer, "answer_tags", "system", 512, 48)
    columns = ("prompt", "prompt_ids", "chosen", "rejected")
    assert [[r[c] for c in columns] for r in chat] == [[r[c] for c in columns] for r in rows[:32]]
    short, summary = load_preferences(PAIRS, tokenizer, "answer_tags", "system", 512, 8)
    assert len(short[0]["chosen"]) == 8 and summary.endswith("chosen 256, rejected 256")
    assert "256 rows" in summary


@pytest.mark.parametrize("edit, message", [
    (lambda r: {k: v for k, v in r.items() if k != "rejected"}, "no column rejected"),
    (lambda r: {**r, "chosen": " "}, "row 1's chosen is empty"),
    (lambda r: {**r, "rejected": []}, "row 1's rejected is empty"),
    (lambda r: {**r, "prompt": "1+1=" * 200}, "row 1's prompt has 800 tokens, over --max_prompt_length 512"),
])
def test_bad_preference_rows_are_one_line_errors(tmp_path, edit, message):
    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(edit(json.loads(line))) + "\n" for line in open(PAIRS).readlines()[:3]))
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        load_preferences(str(path), tokenizer, "answer_tags", "system", 512, 48)


@pytest.mark.parametrize("overrides, message", [
    (dict(data="file"), "--data file reads --pairs"),
    (dict(pairs=PAIRS), "--pairs is --data file's only"),
    (dict(data="file", pairs=PAIRS, pairs_by="reward"), "--pairs_by reward: chooses among sampled completions"),
    (dict(beta=0.0), "--beta 0.0: must be > 0"),
    (dict(micro_batch_size=3), "must be even"),
    (dict(num_generations=1), "a pair needs >= 2 samples"),
    (dict(html_every=2), "dpo.py has no rollout page"),
])
def test_bad_flags_are_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolved(dpo, **overrides)


@pytest.mark.slow
def test_a_missing_preference_file_stops_the_run_before_any_model_loads(tmp_path):
    proc, _ = run_grpo(["--data", "file", "--pairs", str(tmp_path / "none.jsonl")], tmp_path, check=False,
                       script="dpo.py")
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: --pairs"), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("data", ["offline", "online", "file"])
def test_each_pair_source_runs_and_the_first_step_is_at_the_reference(tmp_path, data):
    offline = ["--offline_prompts", "32", "--pairs_by", "reward"]  # (the resume test below runs the default rule)
    flags = ["--data", data, "--total_steps", "2", "--eval_every", "2", *SMALL] + (
        ["--pairs", PAIRS] if data == "file" else offline if data == "offline" else [])
    _, rows = run_grpo(flags, tmp_path, script="dpo.py")
    first = rows[0]
    assert first["losses/dpo"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == 0
    assert first["policy/first_minibatch_logratio_max"] == 0.0  # pi_theta = pi_ref, computed alike
    assert first["dpo/pairs_made"] + first["dpo/prompts_skipped"] == 4 and rows[-1]["eval/problems"] == 16
    assert ("rollout/logprob_gap_mean" in first) == (data == "online")  # the engine samples the pairs online only
    if data == "online":
        assert first["rollout/logprob_gap_mean"] < 1e-4 and "charts/accuracy" in first
    if data == "offline":
        assert os.path.exists(tmp_path / "dpo__1" / "offline_pairs.0.pt")


@pytest.mark.slow
def test_a_resumed_offline_run_reads_its_pairs_back_and_trains_as_an_uninterrupted_one(tmp_path):
    common = ["--total_steps", "3", "--eval_every", "0", "--offline_prompts", "32", *SMALL]
    _, straight = run_grpo([*common, "--exp_name", "straight"], tmp_path, script="dpo.py")
    run_grpo([*common, "--exp_name", "resumed", "--total_steps", "2", "--save_every", "1"], tmp_path, script="dpo.py")
    saved = torch.load(tmp_path / "resumed__1" / "offline_pairs.0.pt")
    assert saved == torch.load(tmp_path / "straight__1" / "offline_pairs.0.pt")  # the same pool, from the same start
    _, resumed = run_grpo([*common, "--exp_name", "resumed", "--resume"], tmp_path, script="dpo.py")
    for key in ("losses/dpo", "rewards/margins", "policy/grad_norm", "dpo/pairs_made"):
        assert resumed[2][key] == straight[2][key], key


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ddp", "fsdp2"])
def test_two_processes_train_as_one_on_the_same_pairs(tmp_path, launcher):
    """2 CPU processes (gloo; DDP, and FSDP2 with the policy and pi_ref sharded), each with half of a step's file
    pairs, against one process with all of them: the loss is the mean over the mini-batch's pairs on every process,
    so the losses, margins and gradient norms of 2 steps agree to float32 rounding (the processes' sums are reduced in
    another order)."""
    from tests.helpers import fsdp2, two_processes

    flags = ["--data", "file", "--pairs", PAIRS, "--total_steps", "2", "--eval_every", "0", "--save_every", "0",
             "--prompts_per_step", "8", "--micro_batch_size", "4", "--kl_prompts", "0", "--log_completions_every", "0"]
    _, one = run_grpo([*flags, "--exp_name", "one"], tmp_path, script="dpo.py")
    start = two_processes(29574) if launcher == "ddp" else fsdp2(29575)
    _, two = run_grpo([*flags, "--exp_name", "two"], tmp_path, script="dpo.py", launcher=start)
    for a, b in zip(one, two):
        assert a["dpo/pairs_made"] == b["dpo/pairs_made"] == 8
        for key in ("losses/dpo", "rewards/margins", "logps/chosen", "policy/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
