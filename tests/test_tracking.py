"""What training changed beyond its task (plumbing/evaluation.py Tracking): the prior tasks' accuracy, strict and
lenient, and the forward KL to the initial policy; in every script, without changing what a run trains."""

import os

import pytest
import torch

import grpo
from plumbing.evaluation import Tracking, prior_task_name
from plumbing.run import RunArgs
from tests.helpers import SMALL, run_grpo
from utils.rewards import RewardScorer, lenient_extractor

@pytest.mark.parametrize("text, expected", [
    ("4 + 7 = 11", "11"),  # an untrained model's own form
    ("so \\boxed{12}, not 13", "12"),  # the asked-for form wins over a later number
    ("The letter appears 3 times.", "3"),
    ("-2 + -2 = -4.", "-4"),
    ("1,000 apples", "1,000"),
    ("no number here", None),
])
def test_the_lenient_extractor_reads_the_last_number_where_the_form_is_missing(text, expected):
    assert lenient_extractor("boxed")(text) == expected


def test_lenient_scoring_counts_an_unboxed_answer_and_never_a_wrong_one():
    rows = [{"answer": "11"}, {"answer": "11"}, {"answer": "11"}]
    texts = ["4 + 7 = 11", "4 + 7 = 12", "\\boxed{11}"]
    with RewardScorer("gsm8k", "boxed", 1, lenient=True) as lenient, RewardScorer("gsm8k", "boxed", 1) as strict:
        assert lenient.result(lenient.submit(texts, rows))[0] == [1.0, 0.0, 1.0]
        assert strict.result(strict.submit(texts, rows))[0] == [0.0, 0.0, 1.0]


def test_prior_task_names_are_metric_keys():
    assert prior_task_name("rg:chain_sum:min_terms=2,max_terms=3") == "rg-chain_sum-min_terms-2-max_terms-3"
    assert prior_task_name("toy_mul") == "toy_mul" and prior_task_name("/data/my_task.jsonl") == "my_task.jsonl"


def test_the_forward_kl_is_zero_at_the_start_and_the_monte_carlo_sum_after_an_update(tmp_path):
    """KL(pi_0 || pi_theta) on completions pi_0 sampled (grpo.py's evaluation, made before any update): 0 exactly
    before any update (the same computation), and after the weights move the mean over completions of sum_t log pi_0 -
    log pi_theta, computed here token by token; the samples are read back from the run's folder by a resumed run; the
    run's random stream is untouched."""
    from accelerate import Accelerator

    from plumbing.engine import create_engine
    from plumbing.models import load_model, load_tokenizer
    from plumbing.run import Run
    from utils.tasks import load_splits

    accelerator = Accelerator(cpu=True)
    args = grpo.resolve_args(grpo.Args(run=RunArgs(kl_prompts=6, output_dir=str(tmp_path))), 1)
    tokenizer, stop_ids = load_tokenizer(args.model)
    model = load_model(args.model, tokenizer)
    engine = create_engine(args.run, args.model, 0, 128, stop_ids)
    _, test_rows, _ = load_splits("toy", tokenizer, "answer_tags", "system", 512, 500, 0, 1)
    run = Run(accelerator, args, str(tmp_path / "run"), None, tokenizer, stop_ids, [], test_rows)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with RewardScorer("toy", "answer_tags") as scorer:
        evaluation = grpo.start_evaluation(args, run, engine, model, scorer)
    assert torch.equal(torch.get_rng_state(), state)  # sampling pi_0 did not move the run's random stream
    tracking, logprobs = evaluation.tracking, evaluation.sequence_logprobs
    result = tracking.evaluate(None, logprobs, tokenizer, accelerator)
    assert result.pop("time/eval_kl") > 0 and result == {"eval/forward_kl": 0.0, "eval/forward_kl_token": 0.0}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    kl = tracking.kl
    by_hand = []
    for prompt, completion, base in zip(kl["prompts"], kl["completions"], kl["base"]):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
        now = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).sum()
        by_hand.append(base.double() - now)
    result = tracking.evaluate(None, logprobs, tokenizer, accelerator)
    del result["time/eval_kl"]
    assert len(by_hand) == 6 and result["eval/forward_kl"] > 0
    assert result["eval/forward_kl"] == pytest.approx(torch.stack(by_hand).mean().item(), rel=1e-4)
    resumed = Tracking((), args.run, tokenizer, "answer_tags", "system", 512)
    resumed.start_kl(str(tmp_path / "run" / "forward_kl_base.0.pt"), True, test_rows, tokenizer, None, logprobs,
                     accelerator)
    again = resumed.evaluate(None, logprobs, tokenizer, accelerator)
    del again["time/eval_kl"]
    assert again == result


def test_an_evaluation_is_due_every_eval_every_steps_and_at_the_end_and_times_itself(tmp_path):
    """plumbing/evaluation.py Evaluation, as every script's main() calls it once per step: {} when no evaluation is
    due, else pass@1 and the rest with time/eval; a script's own per-completion sums (grpo_tools.py's tool calls)
    logged per greedy completion of the training task, prior tasks' completions left out."""
    from accelerate import Accelerator

    from plumbing.engine import Sample
    from plumbing.evaluation import Evaluation
    from plumbing.models import load_tokenizer
    from plumbing.run import Run
    from utils.tasks import load_splits

    args = grpo.resolve_args(grpo.Args(total_steps=7, run=RunArgs(eval_every=3, eval_size=4, eval_samples=2,
                                                                  kl_prompts=0, prior_tasks=("toy_mul",),
                                                                  prior_eval_size=2)), 1)
    tokenizer, stop_ids = load_tokenizer(args.model)
    _, test_rows, _ = load_splits("toy", tokenizer, "answer_tags", "system", 512, 500, 0, 1)
    run = Run(Accelerator(cpu=True), args, str(tmp_path), None, tokenizer, stop_ids, [], test_rows)
    drawn = []

    def sample(prompts, n, temperature, top_p, policy_version):  # every answer right, two "calls" per completion
        drawn.append((len(prompts), n, temperature, policy_version))
        texts = ["<answer>" + r["answer"] + "</answer>" for r in test_rows[:len(prompts)] for _ in range(n)]
        return texts, [Sample([5], None, False)] * len(texts), None, {"calls": 2 * len(texts)}

    with RewardScorer("toy", "answer_tags") as scorer:
        evaluation = Evaluation(run, scorer, sample, None)
        assert [evaluation(step) == {} for step in range(1, 8)] == [True, True, False, True, True, False, False]
        metrics = evaluation(7)
        evaluation.close()
    assert metrics["eval/pass@1_greedy"] == 1.0 and metrics["eval/problems"] == 4 and metrics["time/eval"] > 0
    assert metrics["eval/calls_greedy"] == 2.0  # the training task's greedy completions only (not the prior task's)
    assert "prior/toy_mul/pass@1_greedy" in metrics and "eval/forward_kl" not in metrics
    assert drawn[-1] == (2, 1, 0.0, 7) and drawn[0] == (4, 1, 0.0, 3)  # greedy first, at the step's policy version


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_tools.py", "sft.py"])  # (grpo.py: below) the evaluation's other text; no RL
def test_a_run_tracks_prior_tasks_and_the_forward_kl(tmp_path, script):
    flags = ["--total_steps", "1", "--eval_every", "1", "--eval_size", "2", "--eval_samples", "1", "--prompts_per_step",
             "4", "--num_generations", "2", "--prior_tasks", "toy_mul", "rg:chain_sum", "--prior_eval_size", "2",
             "--kl_prompts", "2", "--log_completions_every", "0"]
    _, rows = run_grpo(flags, tmp_path, script=script)
    for key in ("pass@1_greedy", "pass@1_lenient", "format_greedy"):
        assert 0 <= rows[0][f"prior/toy_mul/{key}"] <= 1 and 0 <= rows[0][f"prior/rg-chain_sum/{key}"] <= 1
    assert rows[0]["eval/forward_kl"] == rows[0]["eval/forward_kl"]  # a number (one step may leave it near 0)
    assert os.path.exists(tmp_path / f"{script[:-3]}__1" / "forward_kl_base.0.pt")
    assert 0 < rows[0]["time/eval_prior"] < rows[0]["time/eval"] and 0 < rows[0]["time/eval_kl"] < rows[0]["time/eval"]


@pytest.mark.slow
def test_tracking_does_not_change_what_a_run_trains(tmp_path):
    """grpo.py with two prior tasks and the forward KL trains bit for bit as without them, and logs their keys."""
    common = ["--total_steps", "3", "--eval_every", "1", *SMALL]
    _, plain = run_grpo([*common, "--kl_prompts", "0", "--exp_name", "plain"], tmp_path)
    _, tracked = run_grpo([*common, "--prior_tasks", "toy_mul", "rg:chain_sum", "--prior_eval_size", "4",
                           "--kl_prompts", "4", "--exp_name", "tracked"], tmp_path)
    for key in ("charts/reward", "losses/policy", "policy/grad_norm", "eval/pass@1_greedy"):
        assert [r[key] for r in plain] == [r[key] for r in tracked], key
    assert "eval/forward_kl" not in plain[0] and not any(key.startswith("prior/") for key in plain[0])
    for row in tracked:
        for key in ("pass@1_greedy", "pass@1_lenient", "format_greedy"):
            assert 0 <= row[f"prior/toy_mul/{key}"] <= 1 and 0 <= row[f"prior/rg-chain_sum/{key}"] <= 1
        assert row["eval/forward_kl"] == row["eval/forward_kl"] and 0 < row["time/eval_kl"] < row["time/eval"]
    assert tracked[-1]["eval/forward_kl"] > 0  # three updates moved the policy
    assert os.path.exists(tmp_path / "tracked__1" / "forward_kl_base.0.pt")
