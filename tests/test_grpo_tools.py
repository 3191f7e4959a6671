"""grpo_tools.py: the HF decode loop stops at the tool's stop string, tool output is in the context but out of the
gradient, a rollout's turns are laid out as the model and the tool produced them, and the script runs end to end with
2 processes and resumes. The sandbox itself: test_sandbox.py and test_sandbox_attacks.py."""

import os

import pytest
import torch
from accelerate import Accelerator

import grpo_tools
from grpo_tools import Batch, make_batch, micro_batches
from tests.helpers import ROOT, SMALL, loss_of, resolved, run_grpo, two_processes
from plumbing.engine import HFDecoder
from plumbing.models import load_model
from plumbing.run import run_name
from plumbing.tools import TOOL_STOP, PythonSandbox, ToolArgs, last_code_block, output_block, tool_output_ids

TOOLS_MODEL = os.path.join(ROOT, "toy_model", "tools")


def test_code_and_output_blocks():
    text = "x ```python\nprint(1)\n```\nthen ```python\nprint(347 * 86)" + TOOL_STOP
    assert last_code_block(text) == "print(347 * 86)"
    assert last_code_block("no code:" + TOOL_STOP) is None
    assert output_block("29842\n", "", 100) == "```output\n29842\n```\n"
    assert output_block("partial\n", "ValueError: bad", 100) == "```output\npartial\nValueError: bad\n```\n"
    assert output_block("y" * 50, "", 10) == "```output\n" + "y" * 10 + "\n... (output truncated)\n```\n"
    from plumbing.models import load_tokenizer

    tokenizer, _ = load_tokenizer(TOOLS_MODEL)
    ids = tool_output_ids(tokenizer, "z" * 500, "RuntimeError: late", 60)
    text = tokenizer.decode(ids)
    assert len(ids) <= 60 and text.startswith("```output\nz") and "truncated" in text, text
    assert text.endswith("RuntimeError: late\n```\n"), text
    ids = tool_output_ids(tokenizer, "", "E" * 500, 40)  # an error longer than the block: cut, fenced
    assert len(ids) == 40 and tokenizer.decode(ids).endswith("EEE" + TOOL_STOP)


def test_hf_decode_loop_stops_at_the_tool_stop_string():
    from accelerate import Accelerator

    from plumbing.models import load_tokenizer
    from utils.tasks import toy_mul_problems

    torch.manual_seed(0)
    tokenizer, stop_ids = load_tokenizer(TOOLS_MODEL)
    model = load_model(TOOLS_MODEL, tokenizer).eval()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in toy_mul_problems("test")[:16]]
    samples = HFDecoder(stop_ids, [96] * 64, [TOOL_STOP]).generate(model, tokenizer, prompts, 4, 1.0, 1.0, 96,
                                                                  Accelerator(cpu=True))
    called = 0
    for sample in samples:
        text = tokenizer.decode(sample.token_ids)
        if sample.token_ids[-1] in stop_ids:
            assert TOOL_STOP not in text and not sample.truncated
        elif not sample.truncated:  # stopped by the string: it ends the text, and appears nowhere before
            called += 1
            assert text.endswith(TOOL_STOP) and text.count(TOOL_STOP) == 1, text
        else:
            assert len(sample.token_ids) == 96
    assert called > 0


def test_tool_output_is_context_not_action():
    """Tool output is masked out of the loss: changing the output tokens at a completion's end (nothing after them
    attends to them) leaves the gradient unchanged; without the mask it would change. Between two turns, the output
    does change the later tokens' log-probs (it is their context), as it should. micro_batches cuts each row after its
    last model token, not after mask.sum() tokens."""
    from plumbing.models import load_tokenizer

    torch.manual_seed(0)
    tokenizer, _ = load_tokenizer(TOOLS_MODEL)
    model, accelerator = load_model(TOOLS_MODEL, tokenizer), Accelerator(cpu=True)
    prompt = tokenizer("347*86=")["input_ids"]
    model_turn = tokenizer("```python\nprint(347*86)" + TOOL_STOP)["input_ids"]

    def gradient(output, masked=True):
        ids = model_turn + tokenizer(output)["input_ids"]
        mask = [1] * len(model_turn) + [0 if masked else 1] * (len(ids) - len(model_turn))
        sample = grpo_tools.Sample(ids, [0.0] * len(ids), False)
        batch = make_batch([prompt], [sample], tokenizer.pad_token_id, "cpu")
        batch.mask[0] = torch.tensor(mask, dtype=torch.float32)
        model.zero_grad()
        logp, _ = grpo_tools.token_logprobs(model, batch, 1.0, accelerator)
        loss, _, _ = loss_of(grpo_tools, logp, logp.detach() - 0.1, torch.tensor([1.0]), batch.mask, clip_eps=0.5,
                             beta=0.0)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    right, wrong = gradient(output_block("29842", "", 99)), gradient(output_block("11111", "", 99))
    assert torch.allclose(right, wrong, rtol=0, atol=1e-7)  # causal attention: equal up to kernel rounding
    assert not torch.allclose(gradient(output_block("29842", "", 99), masked=False),
                              gradient(output_block("11111", "", 99), masked=False), atol=1e-4)

    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    batch = Batch(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long), 2, mask, torch.zeros(2, 6))
    widths = [mc.mask.shape[1] for _, mc in micro_batches(batch, 1)]
    assert widths == [3, 5]  # the second row's model tokens end at position 5


def test_a_rollout_lays_out_model_and_tool_tokens():
    """HF engine, real sandbox: model tokens are sampled (their log-probs kept), tool tokens are the output block of
    the code the model wrote, at most max_turns calls, at most max_new_tokens model tokens; the reward text is the
    model's own."""
    from accelerate import Accelerator

    from plumbing.engine import create_engine
    from plumbing.models import load_tokenizer
    from utils.tasks import toy_mul_problems

    torch.manual_seed(0)
    args = resolved(grpo_tools, model=TOOLS_MODEL, max_new_tokens=96, max_turns=1, engine="hf")
    accelerator = Accelerator(cpu=True)
    tokenizer, stop_ids = load_tokenizer(TOOLS_MODEL)
    model = load_model(args.model, tokenizer).eval()
    engine = create_engine(args.run, args.model, args.seed, 0, stop_ids)  # the HF decode loop: no context limit
    rows = toy_mul_problems("test")[:16]
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    with PythonSandbox(num_workers=1, timeout=5.0) as sandbox:
        samples, masks, completions, _, _ = grpo_tools.rollout(args, engine, model, tokenizer, sandbox, prompts, 4,
                                                               1.0, 1.0, accelerator, policy_version=0)
    assert sum(c["calls"] for c in completions) > 0
    for i, (sample, mask, c) in enumerate(zip(samples, masks, completions)):
        assert len(sample.token_ids) == len(mask) == len(sample.logprobs) and sum(mask) <= 96 and c["calls"] <= 1
        tool = [t for t, m in zip(sample.token_ids, mask) if not m]
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(sample.logprobs, mask) if m)  # sampled at T=1: never log-prob 0
        if c["calls"]:
            code = last_code_block(tokenizer.decode(sample.token_ids[:mask.index(0)]))
            if code == f"print({rows[i // 4]['prompt'][:-1]})":  # the model copied the question: the product comes back
                a, b = rows[i // 4]["prompt"][:-1].split("*")
                assert tokenizer.decode(tool) == output_block(f"{int(a) * int(b)}\n", "", 512)
        else:
            assert not tool
        assert grpo_tools.model_text(tokenizer, sample, mask) == tokenizer.decode(
            [t for t, m in zip(sample.token_ids, mask) if m], skip_special_tokens=True)


def test_tool_arguments():
    for overrides, message in [({"max_turns": -1}, "--max_turns"), ({"max_tool_tokens": 4}, "--max_tool_tokens"),
                               ({"tool_timeout": 0}, "--tool_timeout"),
                               ({"tool_modules": ("math", "no_such_module")}, "--tool_modules: no module named no_")]:
        with pytest.raises(ValueError, match=message):
            resolved(grpo_tools, model=TOOLS_MODEL, **overrides)
    # the embedded model's default leaves room for a tool call (grpo.py's is 48); an explicit value stays
    assert resolved(grpo_tools, model=TOOLS_MODEL).max_new_tokens == 96
    assert resolved(grpo_tools, model=TOOLS_MODEL, max_new_tokens=40).max_new_tokens == 40
    assert resolved(grpo_tools, model=TOOLS_MODEL).learning_rate == 5e-4  # the other embedded defaults are kept
    # the sandbox's flags (args.tool) name the run as the algorithm's do
    names = {run_name("grpo_tools", a, None, a.model, a.task, 1) for a in
             (grpo_tools.Args(), grpo_tools.Args(tool=ToolArgs(tool_timeout=3.0)), grpo_tools.Args(max_turns=1))}
    assert len(names) == 3 and "grpo_tools__1" in names


@pytest.mark.slow
def test_two_processes_and_resume(tmp_path):
    launcher = two_processes(29542)
    flags = ["--eval_every", "2", "--save_every", "1", "--max_turns", "1", *SMALL]
    proc, rows = run_grpo(["--total_steps", "2", *flags], tmp_path, launcher=launcher, script="grpo_tools.py")
    assert [r["step"] for r in rows] == [1, 2] and "2 process(es)" in proc.stdout
    assert all(0 <= r["tools/call_frac"] <= 1 and r["tools/calls_per_completion"] <= 1 for r in rows)
    assert "eval/tool_calls_greedy" in rows[-1] and rows[-1]["eval/problems"] == 16
    proc, rows = run_grpo(["--total_steps", "3", "--resume", *flags], tmp_path, launcher=launcher,
                          script="grpo_tools.py")
    assert "resumed from" in proc.stdout and [r["step"] for r in rows] == [1, 2, 3]
