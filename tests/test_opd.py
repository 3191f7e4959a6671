"""opd.py: on-policy distillation's loss against TRL 1.16's _chunked_divergence_loss (its own code, on the same hidden
states and output layers), the generalized JSD's values and limits, the student equal to the teacher, the per-token
normalizer over micro-batches, the teacher's vocabulary checked in one line, and runs end to end."""

import copy
import math
import os
import shutil

import pytest
import torch
from accelerate import Accelerator

import opd
from plumbing.models import load_model, load_tokenizer
from tests.helpers import SMALL, resolved, run_grpo, two_processes
from tests.test_engine import rollout
from tests.test_logprobs import Head
from utils.tasks import TOY_MODEL_DIR


def heads(dtype, bias=True, seed=0):
    """A student's and a teacher's output layers (V = 50) over hidden widths 6 and 4 (a teacher may be wider or
    narrower: only the vocabulary must match), the hidden states of 2 x 5 positions, a mask with 3 padded positions:
    the same numbers in either dtype."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)  # noqa
    student_weight, student_bias = torch.nn.Parameter(draw(50, 6)), torch.nn.Parameter(draw(50)) if bias else None
    teacher_weight = torch.nn.Parameter(draw(50, 4), requires_grad=False)
    teacher_bias = torch.nn.Parameter(draw(50), requires_grad=False)
    hidden, teacher_hidden = draw(2, 5, 6, scale=2.0).requires_grad_(), draw(2, 5, 4, scale=2.0)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=dtype)
    tokens = torch.randint(0, 50, (2, 5), generator=g)
    return student_weight, student_bias, teacher_weight, teacher_bias, hidden, teacher_hidden, mask, tokens


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loss_and_its_gradients_are_trls(monkeypatch, beta, dtype, temperature):
    """TRL's _chunked_divergence_loss (its generalized JSD: m = beta p_T + (1 - beta) p_S; beta 0 the forward KL, 1
    the reverse; the temperature on both; a mean over the valid positions) and opd.py's output_divergence with
    compute_loss on the same hidden states and output layers (biases included; chunks of 3 positions): the same loss
    and the same gradients of the student's hidden states, weight and bias. TRL's CPU path rounds in float32 whatever
    the inputs' dtype (measured: its gradients up to 8e-6 of their scale off the float64 value at beta 0.5, opd.py's
    float32 ones within 2.2e-6): agreement within 1e-6 relative (loss) and 2e-5 of each gradient's scale."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    monkeypatch.setattr(opd, "CHUNK_BYTES", 8 * 50 * 3)  # 3 positions a chunk: chunks that do not divide the 10
    weight, bias, teacher_weight, teacher_bias, hidden, teacher_hidden, mask, tokens = heads(dtype)
    trl_loss, _, n_valid = _chunked_divergence_loss(hidden, teacher_hidden, weight, teacher_weight, mask, beta,
                                                    student_lm_head_bias=bias, teacher_lm_head_bias=teacher_bias,
                                                    temperature=temperature)
    trl_grads = torch.autograd.grad(trl_loss, [hidden, weight, bias])
    divergence, *_ = opd.output_divergence(Head(weight, bias), Head(teacher_weight, teacher_bias), hidden,
                                           teacher_hidden, tokens, temperature, beta, Accelerator(cpu=True))
    loss = opd.compute_loss(divergence, mask, mask.sum())
    grads = torch.autograd.grad(loss, [hidden, weight, bias])
    assert n_valid == 7 and loss.dtype == dtype and loss.item() > 0.05
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6)
    for ours, theirs in zip(grads, trl_grads):
        assert (ours - theirs).abs().max() <= 2e-5 * theirs.abs().max()


def test_the_divergence_is_the_docstrings_worked_example_and_its_limits_are_the_two_kls():
    """Two tokens, p_S = (0.9, 0.1), p_T = (0.5, 0.5): D_0.5 = 0.1018, the forward KL(p_T || p_S) 0.5108, the reverse
    KL(p_S || p_T) 0.3681; beta -> 0 and -> 1 tend to the two KLs scaled by beta and 1 - beta (generalized JSD's
    limits), which beta = 0 and 1 give unscaled."""
    student, teacher = torch.tensor([[math.log(0.9), math.log(0.1)]], dtype=torch.float64), torch.zeros(1, 2,
                                                                                                    dtype=torch.float64)
    value = lambda beta: opd.token_divergence(student, teacher, beta, 1.0).item()  # noqa: E731
    assert value(0.5) == pytest.approx(0.1018, abs=1e-4) and "D = 0.1018" in opd.__doc__
    assert value(0.0) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)) == pytest.approx(0.5108,
                                                                                                            abs=1e-4)
    assert value(1.0) == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)) == pytest.approx(0.3681,
                                                                                                            abs=1e-4)
    assert value(1e-6) / 1e-6 == pytest.approx(value(0.0), rel=1e-3)  # JSD_beta ~ beta KL(p_T || p_S) near 0
    assert value(1 - 1e-6) / 1e-6 == pytest.approx(value(1.0), rel=1e-3)  # ~ (1 - beta) KL(p_S || p_T) near 1


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_student_equal_to_its_teacher_has_loss_0_and_no_gradient(beta):
    weight, bias, _, _, hidden, _, mask, tokens = heads(torch.float64)
    divergence, entropy, teacher_logp, logp = opd.output_divergence(
        Head(weight, bias), Head(torch.nn.Parameter(weight.detach().clone(), requires_grad=False),
                                 torch.nn.Parameter(bias.detach().clone(), requires_grad=False)),
        hidden, hidden.detach(), tokens, 1.0, beta,
        Accelerator(cpu=True))
    loss = opd.compute_loss(divergence, mask, mask.sum())
    grads = torch.autograd.grad(loss, [hidden, weight, bias])
    assert abs(loss.item()) < 1e-14 and all(g.abs().max() < 1e-13 for g in grads)
    assert torch.equal(teacher_logp, logp) and (entropy > 0).all()


def test_micro_batches_change_no_update():
    """The embedded model distilling a perturbed copy of itself on a rollout batch of 16 completions: one gradient
    for micro-batches of 3, 8 and 16 (the mean is over the mini-batch's tokens, whichever pass holds them)."""
    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    student = load_model(TOY_MODEL_DIR, tokenizer).eval()
    teacher = copy.deepcopy(student)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    accelerator = Accelerator(cpu=True)
    _, batch, _ = rollout(student, tokenizer, accelerator, 1.0)
    grads = []
    for size in (3, 8, 16):
        model = copy.deepcopy(student)
        num_tokens = batch.mask.sum()
        for _, micro in opd.micro_batches(batch, size):
            divergence, *_ = opd.distillation_loss(model, teacher, micro, 1.0, 0.5, accelerator)
            opd.compute_loss(divergence, micro.mask, num_tokens).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_a_teacher_of_another_vocabulary_is_refused_in_one_line(tmp_path):
    """A teacher whose tokenizer maps strings to other ids (one token renamed here) cannot be compared token by
    token: resolve_args stops with one line before any model loads; the same tokenizer passes."""
    teacher = tmp_path / "teacher"
    shutil.copytree(TOY_MODEL_DIR, teacher)
    resolved(opd, teacher=str(teacher))  # the same vocabulary: accepted
    tokenizer_file = teacher / "tokenizer.json"
    text = tokenizer_file.read_text()
    assert '"a": ' in text
    tokenizer_file.write_text(text.replace('"a": ', '"ä": ', 1))
    with pytest.raises(ValueError, match="its vocabulary .* is not the student's"):
        resolved(opd, teacher=str(teacher))
    with pytest.raises(ValueError, match="--teacher: opd.py distills a teacher"):
        resolved(opd)
    with pytest.raises(ValueError, match="--beta 1.5: must be in"):
        resolved(opd, teacher=TOY_MODEL_DIR, beta=1.5)
    with pytest.raises(ValueError, match="no rollout page"):
        resolved(opd, teacher=TOY_MODEL_DIR, html_every=1)


@pytest.mark.slow
def test_a_run_distills_and_resumes_exactly(tmp_path):
    """A student of the embedded model distilling a teacher trained from it (a few GRPO steps): the divergence is
    positive and logged with the teacher's log-prob, the reward is logged, and a run resumed from its checkpoint gives
    the uninterrupted run's step."""
    run_grpo(["--total_steps", "4", "--eval_every", "0", "--exp_name", "teacher", *SMALL], tmp_path)
    teacher = str(tmp_path / "teacher__1" / "final")
    common = ["--teacher", teacher, "--total_steps", "3", "--eval_every", "0", *SMALL]  # (an evaluation at the
    # first leg's end would draw from the random stream the straight run samples step 3 with)
    _, straight = run_grpo([*common, "--exp_name", "straight"], tmp_path, script="opd.py")
    assert all(r["losses/divergence"] > 0 for r in straight) and "charts/accuracy" in straight[0]
    assert straight[0]["rollout/logprob_gap_mean"] < 1e-4
    run_grpo([*common, "--exp_name", "resumed", "--total_steps", "2", "--save_every", "1"], tmp_path, script="opd.py")
    _, resumed = run_grpo([*common, "--exp_name", "resumed", "--resume"], tmp_path, script="opd.py")
    for key in ("losses/divergence", "distill/teacher_logprob", "policy/grad_norm"):
        assert resumed[2][key] == straight[2][key], key


@pytest.mark.slow
def test_two_processes_run(tmp_path):
    """2 CPU processes (DDP, gloo), each with half the prompts and its own teacher copy: the run completes, its
    divergence 0 where the teacher is the student itself (the normalizers' exactness over processes is the micro-batch
    test's: a process's share is a micro-batch's)."""
    flags = ["--teacher", TOY_MODEL_DIR, "--total_steps", "1", "--eval_every", "0", *SMALL]
    _, rows = run_grpo(flags, tmp_path, script="opd.py", launcher=two_processes(29571))
    assert os.path.exists(tmp_path / "opd__1" / "final") and rows[0]["charts/completion_length"] > 0
    assert abs(rows[0]["losses/divergence"]) < 1e-5  # (rounding may leave it a hair below 0)
