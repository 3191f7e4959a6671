"""Answer extraction, math-verify equivalence, format reward, hostile and hedged completions (untrusted input), and
the persistent scorer: every failure kind scores 0, is counted, and never aborts the step."""

import os
import signal
import threading
import time

import pytest

from utils import rewards
from utils.rewards import (RewardScorer, extract_answer_tag, extract_boxed, format_reward, gold_parses, math_equal,
                           score_completions)


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer("math", "boxed", num_workers=2, timeout=5.0) as s:
        yield s


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{72}.", "72"),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{3}"),
    ("nested \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),  # several boxes: the last one counts
    ("\\fbox{5}", "5"),
    ("\\boxed{ 3 }", "3"),
    ("\\boxed{72\\}", None),  # an escaped brace does not close the box (it used to give "72\\")
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces inside are content
    ("\\boxed{72}" + "\u0301" * 5000, "72"),  # junk after the final answer (it used to be missed past 4,000 chars)
    ("\\boxed{" + "1" * 400 + "}", None),  # longer than MAX_ANSWER_CHARS: the scan stops there
    ("unclosed \\boxed{\\frac{1}{2}", None),  # a truncated completion
    ("no box at all", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<answer>052</answer>", "052"),
    ("think <answer> 1/3 </answer>", "1/3"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<answer>\n42\n</answer>", "42"),
    ("<answer>7", None),  # truncated
    ("", None),
])
def test_extract_answer_tag(text, expected):
    assert extract_answer_tag(text) == expected


@pytest.mark.parametrize("gold, answer", [  # equivalences that must hold (gold first, as math-verify requires)
    ("72", "72"), ("72", "72.0"), ("1000", "1,000"), ("\\frac{1}{3}", "\\frac{1}{3}"), ("\\frac{1}{3}", "1/3"),
    ("0.5", "\\frac12"), ("2\\sqrt{2}", "\\sqrt{8}"), ("x^2+1", "1+x^2"), ("72", "72 \\text{ dollars}"),
    ("72", "\\$72"), ("10", "10\\%"), ("5", "x=5"), ("\\pi", "\\pi"), ("(1,2)", "(1, 2)"),
])
def test_equivalences(gold, answer):
    assert math_equal(gold, answer)


@pytest.mark.parametrize("gold, answer", [  # near-misses that must not pass
    ("72", "73"), ("\\frac{1}{3}", "0.3333"), ("\\frac{1}{3}", "\\frac{1}{2}"), ("(1,2)", "(2,1)"),
    ("72", "720"), ("-5", "5"), ("x^2+1", "x^2-1"), ("72", ""), ("72", None),
])
def test_near_misses(gold, answer):
    assert not math_equal(gold, answer)


def test_gold_parses():
    assert gold_parses("72") and gold_parses("\\frac{1}{3}") and gold_parses("(3, \\frac{\\pi}{2})")
    assert not gold_parses("") and not gold_parses("x" * 1000)


@pytest.mark.parametrize("text, fmt, expected", [
    ("<answer>052</answer>", "answer_tags", 1.0),
    ("7+5=12 0+4+1=5 <answer>052</answer>\n", "answer_tags", 1.0),
    ("<answer>052</answer> and more", "answer_tags", 0.0),
    ("<answer>1</answer><answer>2</answer>", "answer_tags", 0.0),
    ("052", "answer_tags", 0.0),
    ("so \\boxed{3}", "boxed", 1.0),
    ("\\boxed{3} or \\boxed{4}", "boxed", 0.0),
    ("\\boxed{3", "boxed", 0.0),
])
def test_format_reward(text, fmt, expected):
    assert format_reward(text, fmt) == expected


def test_score_completions_toy_is_exact_match():
    completions = ["<answer>052</answer>", "<answer>52</answer>", "052", "<answer>052</answer>x"]
    acc, fmt, counts = score_completions(completions, ["052"] * 4, "toy", "answer_tags")
    assert acc == [1.0, 0.0, 0.0, 1.0] and fmt == [1.0, 1.0, 0.0, 0.0]
    assert counts["no_answer"] == 1 and counts["timeouts"] == 0


def test_score_completions_math(scorer):
    texts = ["so \\boxed{\\frac{1}{3}}", "\\boxed{0.5}", "I do not know", "<answer>1/3</answer>"]
    acc, fmt, counts = scorer.result(scorer.submit(texts, ["\\frac{1}{3}"] * 4))
    assert acc == [1.0, 0.0, 0.0, 0.0] and counts["no_answer"] == 2
    acc, _, _ = score_completions(texts, ["\\frac{1}{3}"] * 4, "gsm8k", "answer_tags")
    assert acc == [0.0, 0.0, 0.0, 1.0]


HEDGES = [  # each would be read as the gold 72 by a reward that picks a number out of the box
    "\\boxed{73 (I'm not sure, maybe 72)}", "\\boxed{72 @ 73}", "\\boxed{73 @ 72}", "\\boxed{72 & 73 & 74}",
    "\\boxed{74 & 73 & 72}", "\\boxed{72 \\text{ (or 73)}}", "\\boxed{72\\text{ maybe }73}", "\\boxed{print(72)}",
    "\\boxed{72 or 73}", "\\boxed{72, 73}", "\\boxed{72 73}", "\\boxed{73 72}", "\\boxed{72;73}", "\\boxed{72 \\\\ 73}",
    "\\boxed{return 72}", "\\boxed{x = 72 # 73}", "\\boxed{72?}",
]


def test_hedged_answers_score_zero_and_are_counted(scorer):
    acc, _, counts = scorer.result(scorer.submit(HEDGES, ["72"] * len(HEDGES)))
    assert acc == [0.0] * len(HEDGES), [h for h, a in zip(HEDGES, acc) if a]
    assert counts["unparsed"] >= 8  # the ones no parser could read (the rest parse to a set or a product != 72)


def test_answer_after_trailing_junk_counts_but_costs_the_format_reward(scorer):
    texts = ["so \\boxed{72}.", "so \\boxed{72}" + "\u0301" * 5000, "<answer>72</answer>" + " junk" * 2000]
    acc, fmt, _ = scorer.result(scorer.submit(texts[:2], ["72"] * 2))
    assert acc == [1.0, 1.0] and fmt == [1.0, 0.0]
    acc, fmt, _ = score_completions(texts[2:], ["72"], "gsm8k", "answer_tags")
    assert acc == [1.0] and fmt == [0.0]


HOSTILE = [
    "\\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}",  # a power tower: its exact value never fits in memory
    "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",  # deeply nested braces
    "\\boxed{" + "1" * 100_000 + "}",  # a huge number
    "x" * 2_000_000 + "\\boxed{1}",  # a very long completion: the scans are linear
    "\\boxed{\\frac{" * 300 + "1",  # unclosed nesting, truncated
    "<answer>" + "(" * 2000 + "</answer>",
    "\\boxed{10^{10^{10^{10}}}!}",
    "\\boxed{__import__('os').system('echo pwned')}",  # never eval'd
]


def test_hostile_completions_finish_in_bounded_time_and_score_zero(scorer):
    acc, fmt, counts = scorer.result(scorer.submit(HOSTILE, ["1"] * len(HOSTILE)))  # each bounded by its timeout
    assert acc[:3] + acc[4:] == [0.0] * (len(HOSTILE) - 1)
    assert acc[3] == 1.0  # the honest answer at the end of a long completion is still found
    assert counts["verify_timeouts"] + counts["timeouts"] >= 1  # math-verify's own 2 s time-outs are counted now


def test_a_stuck_check_is_killed_and_only_its_answer_scores_zero():
    tower = "\\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}"  # math-verify's own alarm gives up after 2 s
    texts = ["\\boxed{72}", tower, "\\boxed{72.0}", "\\boxed{73}", "\\boxed{72}"]
    with RewardScorer("math", "boxed", num_workers=1, timeout=0.5) as s:
        first = worker_pid(s)
        acc, _, counts = s.result(s.submit(texts, ["72", "1", "72", "72", "72"]))
        assert acc == [1.0, 0.0, 1.0, 0.0, 1.0] and counts["timeouts"] == 1
        assert worker_pid(s) != first  # replaced
        acc, _, counts = s.result(s.submit(["\\boxed{0.5}"], ["\\frac{1}{2}"]))
        assert acc == [1.0] and counts["timeouts"] == 0


def test_a_worker_that_dies_costs_one_answer_not_the_step():
    tower = "\\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}"
    with RewardScorer("math", "boxed", num_workers=1, timeout=30.0) as s:
        s.result(s.submit(["\\boxed{0.5}"], ["\\frac{1}{2}"]))  # warmed up
        pid = worker_pid(s)
        job = s.submit([tower, "\\boxed{0.5}", "\\boxed{0.25}"], ["1", "\\frac{1}{2}", "\\frac{1}{2}"])
        time.sleep(0.5)  # the tower is being checked
        os.kill(pid, signal.SIGKILL)  # what the kernel's OOM killer would do
        acc, _, counts = s.result(job)
        assert acc == [0.0, 1.0, 0.0] and counts["memory"] == 1


def test_workers_have_a_memory_limit():
    with RewardScorer("math", "boxed", num_workers=1, memory_mb=512) as s:
        assert s.result(s.submit(["\\boxed{0.5}"], ["\\frac{1}{2}"]))[0] == [1.0]  # the worker has started
        limits = open(f"/proc/{worker_pid(s)}/limits").read()
    line = next(row for row in limits.splitlines() if row.startswith("Max address space"))
    assert line.split()[3] != "unlimited"


def worker_pid(scorer):
    """The process id of a one-worker scorer's worker, asked of the worker itself."""
    return scorer.pool.schedule(os.getpid).result()


def check_in_this_process(gold, answers, rg_task=None):
    """The workers' check, run in this process (no limits), so a test can make its checker raise."""
    rewards._WORKER.clear()
    rewards._start_worker(0, rg_task)
    return [rewards._check(gold, answer) for answer in answers]


@pytest.mark.parametrize("exception, status", [(ValueError("checker bug"), "errors"), (MemoryError(), "memory")])
def test_a_checker_exception_is_counted_per_answer(monkeypatch, exception, status):
    real = rewards.parse_answer

    def flaky(answer):
        if answer == "13":
            raise exception
        return real(answer)

    monkeypatch.setattr(rewards, "parse_answer", flaky)
    assert check_in_this_process("72", ["72.0", "13", "73"]) == [("ok", 1.0), (status, 0.0), ("ok", 0.0)]


def test_gold_parses_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(gold_parses("\\frac{1}{3}")))
    thread.start()
    thread.join()
    assert results == [True]  # it raised before (math-verify's signal-based alarm works on the main thread only)


def test_many_small_calls_reuse_the_warm_workers(scorer):
    texts = [f"\\boxed{{{i % 7}}}" for i in range(64)]
    golds = [str(i % 5) for i in range(64)]
    one = scorer.result(scorer.submit(texts, golds))[0]
    small = [a for k in range(0, 64, 8) for a in scorer.result(scorer.submit(texts[k:k + 8], golds[k:k + 8]))[0]]
    assert small == one


# What a policy can learn to emit when a format reward pays for the shape alone (SmolLM2-135M-Instruct found the empty
# box within 30 steps): each must earn no format reward, and none is correct.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
LEARNABLE_NON_ANSWERS = [
    "\\boxed{}", "\\boxed{ }", "\\boxed{\n}", "\\boxed{\\text{}}", "\\boxed{\\text{ }}", "so the answer is \\boxed{}.",
    INSTRUCTION, "Please put your final answer within \\boxed{}.",  # a copy of the instruction
    # or of --instruction user
    "Give the final answer as \\boxed{ANSWER}.", "\\boxed{answer}", "\\boxed{\\text{ANSWER}}",
    "\\boxed{What is 4 + 3?}", "\\boxed{State the final answer to the following arithmetic problem:}",  # the question
    "\\boxed{7}\n\\boxed{8}\n\\boxed{9}",  # a box per line
]
NOT_A_NUMBER = ["\\boxed{x}", "\\boxed{y z}", "\\boxed{\\text{seven}}", "\\boxed{4 + 3}"]  # gold "7": format 0 for
# string checkers (math-verify reads x and 4 + 3 as expressions: a guessed number is as cheap and sometimes right)


def test_format_pays_only_for_an_answer_the_math_checker_reads(scorer):
    acc, fmt, counts = scorer.result(scorer.submit(LEARNABLE_NON_ANSWERS, ["7"] * len(LEARNABLE_NON_ANSWERS)))
    assert fmt == [0.0] * len(LEARNABLE_NON_ANSWERS), [t for t, f in zip(LEARNABLE_NON_ANSWERS, fmt) if f]
    assert acc == [0.0] * len(LEARNABLE_NON_ANSWERS)  # the box per line ends with a wrong 9
    assert counts["no_answer"] == 9  # the empty boxes, copied instructions and placeholders are no answer at all
    acc, fmt, _ = scorer.result(scorer.submit(["so \\boxed{7}.", "\\boxed{8}", "\\boxed{\\frac{14}{2}}"], ["7"] * 3))
    assert acc == [1.0, 0.0, 1.0] and fmt == [1.0, 1.0, 1.0]  # a readable wrong answer keeps its format reward


def test_format_pays_only_for_a_readable_toy_answer():
    texts = ["<answer></answer>", "<answer> </answer>", "<answer>abc</answer>", "<answer>052</answer>",
             "<answer>53</answer>", "<answer>07+45</answer>"]
    acc, fmt, counts = score_completions(texts, ["052"] * len(texts), "toy", "answer_tags")
    assert acc == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0] and fmt == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert counts["no_answer"] == 2


RG_TASK = "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=2"


@pytest.fixture(scope="module")
def rg_rows():
    from utils.tasks import rg_rows as make_rows

    entries, _ = make_rows(RG_TASK, "test")
    return [{"answer": e["answer"], "entry": e} for e in entries[:4]]


def test_reasoning_gym_answers_are_checked_by_the_task_verifier(rg_rows):
    row = rg_rows[0]
    gold = int(row["answer"])
    texts = [f"\\boxed{{{gold}}}", f"\\boxed{{+{gold}.0}}", f"\\boxed{{{gold + 1}}}", f"\\boxed{{{gold}1}}",
             f"\\boxed{{{gold} or {gold + 1}}}", f"\\boxed{{{row['entry']['metadata']['expression']}}}"]
    with RewardScorer(RG_TASK, "boxed", num_workers=1) as s:
        junk = LEARNABLE_NON_ANSWERS + NOT_A_NUMBER
        acc, fmt, counts = s.result(s.submit(texts + junk, [row] * (len(texts) + len(junk))))
    # exact and the verifier's own equivalences score 1; its partial credit (the gold inside a longer answer) is not
    # a correct answer; an echoed expression is not a number
    assert acc[:len(texts)] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert fmt[:len(texts)] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert fmt[len(texts):] == [0.0] * len(junk) and acc[len(texts):] == [0.0] * len(junk)
    assert counts["errors"] == counts["timeouts"] == 0


def test_a_hanging_verifier_costs_one_answer_and_writes_nothing(tmp_path):
    from utils.tasks import rg_rows as make_rows

    task = "rg:polynomial_multiplication"  # its verifier runs sympy.parse_expr on the answer: a tower never ends
    entry = make_rows(task, "test")[0][0]
    row = {"answer": entry["answer"], "entry": entry}
    target = tmp_path / "written_by_the_answer"
    texts = ["\\boxed{9**9**9**9**9}", f"\\boxed{{{entry['answer']}}}", "\\boxed{(}",
             f"\\boxed{{open('{target}', 'w').write('x' * 100)}}"]  # eval'd by the verifier: no file writes there
    with RewardScorer(task, "boxed", num_workers=1, timeout=2.0) as s:
        acc, _, counts = s.result(s.submit(texts, [row] * len(texts)))
    assert acc == [0.0, 1.0, 0.0, 0.0] and counts["timeouts"] == 1
    assert not target.exists() or target.stat().st_size == 0


def test_a_verifier_exception_is_counted(monkeypatch, rg_rows):
    def broken(dataset, answer, entry):
        raise RuntimeError("verifier bug")

    monkeypatch.setattr(rewards, "rg_score", broken)
    assert check_in_this_process(rg_rows[0]["entry"], ["1", "2"], RG_TASK) == [("errors", 0.0), ("errors", 0.0)]


def test_a_worker_that_cannot_start_stops_the_run_with_its_reason():
    """A worker whose start-up raised (e.g. a memory limit too small for the checker) answers every check with its
    reason, and the scorer's result() raises it in one line instead of scoring every answer 0."""
    from concurrent.futures import Future

    rewards._WORKER.clear()
    rewards._WORKER["failed"] = "MemoryError: "
    future = Future()
    future.set_result(rewards._check("1", "1"))
    job, scorer = rewards.ScoreJob(["\\boxed{1}"], "boxed"), RewardScorer("toy", "answer_tags")
    job.pending = 1
    scorer._record(job, [0], future)
    with pytest.raises(RuntimeError, match=r"a reward worker failed to start \(MemoryError: \)"):
        scorer.result(job)
    rewards._WORKER.clear()
