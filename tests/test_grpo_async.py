"""grpo_async.py: the HF decode loop that stops once enough groups are complete, partial completions continued from
prompt + tokens so far with their versions and engine log-probs, the on-policy limit (--max_staleness 0 is grpo.py
exactly), staleness bounds and metrics, an exact resume with the carried completions, and two processes."""

import json

import pytest
import torch

import grpo_async
from tests.helpers import SMALL, resolved, run_grpo, two_processes
from tests.test_engine import setup
from plumbing.engine import Engine
from plumbing.partial_rollouts import PartialDecoder


def new_groups(count, G):
    return [{"row": i, "version": 0, "completions": [
        {"token_ids": [], "logprobs": [], "versions": [], "finished": False, "truncated": False} for _ in range(G)]}
        for i in range(count)]


def test_hf_decode_loop_stops_once_enough_groups_are_complete():
    _, accelerator, tokenizer, model = setup()
    torch.manual_seed(0)
    prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "07+45=", "99+99=", "50+05=")]
    rows = [p for p in prompts for _ in range(3)]  # 4 groups of 3
    groups = [i // 3 for i in range(12)]
    decoder = PartialDecoder([tokenizer.eos_token_id], [48] * 12, groups, groups_needed=1)
    samples = decoder.generate(model, tokenizer, rows, 1, 1.0, 1.0, 48, accelerator)
    finished = decoder.finished.tolist()
    whole = [g for g in range(4) if all(finished[i] for i in range(3 * g, 3 * g + 3))]
    assert len(whole) >= 1 and not all(finished)  # stopped before the longest
    longest_done = max(len(s.token_ids) for s, done in zip(samples, finished) if done)
    assert decoder.decode_calls == longest_done  # it stopped at the step that completed the group
    for sample, done in zip(samples, finished):
        assert len(sample.logprobs) == len(sample.token_ids)
        if not done:  # every unfinished row has every step's token and no stop token
            assert len(sample.token_ids) == decoder.decode_calls and tokenizer.eos_token_id not in sample.token_ids
    # budgets: each row's own limit; at the limit a row is finished and truncated
    decoder = PartialDecoder([tokenizer.eos_token_id], [2, 48, 5], [0, 0, 0], groups_needed=1)
    capped = decoder.generate(model, tokenizer, rows[:3], 1, 1.0, 1.0, 48, accelerator)
    assert len(capped[0].token_ids) <= 2 and len(capped[2].token_ids) <= 5
    assert decoder.finished.all() and (capped[0].truncated or capped[0].token_ids[-1] == tokenizer.eos_token_id)


def test_generate_partial_continues_from_the_tokens_so_far():
    _, accelerator, tokenizer, model = setup()
    torch.manual_seed(0)
    engine = Engine([tokenizer.eos_token_id])
    prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "07+45=")]
    groups = new_groups(2, 2)
    sync_time, calls = grpo_async.generate_partial(engine, model, tokenizer, groups, prompts, 1, 1.0, 1.0, 48,
                                                   accelerator, policy_version=3)
    assert sync_time == 0.0 and calls >= 1
    for completion in (c for group in groups for c in group["completions"]):
        assert completion["versions"] == [3] * len(completion["token_ids"]) == [3] * len(completion["logprobs"])
    # a completion with tokens already: continued from them (its old tokens, versions and log-probs kept)
    old_tokens = tokenizer("<answer>0", add_special_tokens=False)["input_ids"]
    n = len(old_tokens)
    group = {"row": 0, "version": 1, "completions": [{"token_ids": list(old_tokens), "logprobs": [-0.5] * n,
                                                      "versions": [1] * n, "finished": False, "truncated": False}]}
    grpo_async.generate_partial(engine, model, tokenizer, [group], prompts[:1], 1, 1.0, 1.0, 48, accelerator,
                                policy_version=4)
    continued = group["completions"][0]
    assert continued["finished"] and continued["token_ids"][:n] == old_tokens and len(continued["token_ids"]) > n
    assert continued["versions"] == [1] * n + [4] * (len(continued["token_ids"]) - n)
    assert continued["logprobs"][:n] == [-0.5] * n and len(continued["logprobs"]) == len(continued["token_ids"])
    assert len(continued["token_ids"]) <= 48  # the budget counts the tokens it had


def test_a_group_finished_before_is_not_counted_again():
    """The training loop asks for prompts_local - (groups already complete) more groups: a carried complete group has
    no rows in the call and must not count as one of them (on either engine: vLLM counts the groups that finish)."""
    _, accelerator, tokenizer, model = setup()
    torch.manual_seed(0)
    engine = Engine([tokenizer.eos_token_id])
    prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "07+45=", "99+99=")]
    groups = new_groups(3, 2)
    for completion in groups[1]["completions"]:  # the middle group finished in an earlier step
        completion.update(token_ids=[tokenizer.eos_token_id], logprobs=[-0.1], versions=[0], finished=True)
    grpo_async.generate_partial(engine, model, tokenizer, groups, prompts, 1, 1.0, 1.0, 48, accelerator, 1)
    new = [group for group in (groups[0], groups[2]) if all(c["finished"] for c in group["completions"])]
    assert len(new) >= 1, [[len(c["token_ids"]) for c in g["completions"]] for g in groups]


def test_async_arguments():
    assert resolved(grpo_async, max_staleness=0).overprovision == 1.5  # ignored at 0: nothing can be carried
    for bad in ({"overprovision": 0.5}, {"max_staleness": -1}):
        with pytest.raises(ValueError, match="--overprovision .* must be >= 1 and --max_staleness"):
            resolved(grpo_async, **bad)


KEYS = ("charts/reward", "charts/completion_length", "losses/policy", "policy/grad_norm", "losses/kl")


@pytest.mark.slow
def test_max_staleness_0_is_grpo_exactly(tmp_path):
    """The same computation as grpo.py (same prompts, same decode calls, same update): bit-equal metrics."""
    flags = ["--total_steps", "3", "--eval_every", "0", *SMALL]
    _, sync = run_grpo(flags, tmp_path)
    _, limit = run_grpo([*flags, "--max_staleness", "0", "--tis_cap", "0"], tmp_path, script="grpo_async.py")
    assert len(sync) == len(limit) == 3
    for key in KEYS:
        assert [r[key] for r in limit] == [r[key] for r in sync], key
    assert all(r["async/groups_carried"] == 0 and r["async/tokens_staleness_0"] == 1.0 for r in limit)


@pytest.mark.slow
def test_partial_rollouts_carry_bound_and_resume_exactly(tmp_path):
    flags = ["--eval_every", "0", "--save_every", "2", "--overprovision", "3", *SMALL]  # 3: some groups wait too long
    _, straight = run_grpo(["--total_steps", "4", "--exp_name", "straight", *flags], tmp_path,
                           script="grpo_async.py")
    assert any(r["async/groups_carried"] > 0 for r in straight)  # over-provisioned groups wait
    assert any(r["async/tokens_staleness_1"] > 0 for r in straight)  # and are trained a version later
    assert sum(r["async/groups_dropped"] for r in straight) > 0  # some waited too long (checked below)
    for r in straight:  # groups started more than --max_staleness (1) versions ago are dropped: no older token
        assert "async/tokens_staleness_2" not in r
        assert r["async/tokens_staleness_0"] + r["async/tokens_staleness_1"] == pytest.approx(1.0)
        assert r["rollout/decode_calls"] <= 48 and 0 <= r["rollout/tail_frac"] < 1
    carried = json.load(open(tmp_path / "straight__1" / "checkpoint" / "carry_0.json"))
    assert carried == [] or {"row", "version", "completions"} <= set(carried[0])
    # interrupted after step 2's checkpoint, resumed: steps 3 and 4 as the straight run's (carry, RNG, weights)
    run_grpo(["--total_steps", "2", *flags], tmp_path, script="grpo_async.py")
    proc, resumed = run_grpo(["--total_steps", "4", "--resume", *flags], tmp_path, script="grpo_async.py")
    assert "resumed from" in proc.stdout
    for key in (*KEYS, "async/groups_carried", "async/tokens_staleness_1"):
        assert [r[key] for r in resumed[2:]] == pytest.approx([r[key] for r in straight[2:]], rel=1e-5), key


@pytest.mark.slow
def test_two_processes(tmp_path):
    launcher = two_processes(29541)
    proc, rows = run_grpo(["--total_steps", "3", "--eval_every", "3", "--overprovision", "2", *SMALL,
                           "--micro_batch_size", "4"], tmp_path, launcher=launcher, script="grpo_async.py")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["eval/problems"] == 16
    assert any(r["async/groups_carried"] > 0 for r in rows)
