"""Answer extraction, math-verify equivalence, format reward, and hostile completions (untrusted input)."""

import time

import pytest

from utils.rewards import (EXTRACTORS, extract_answer_tag, extract_boxed, extract_gsm8k, format_reward, gold_parses,
                           map_with_timeout, math_equal, score_completions)


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{72}.", "72"),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{3}"),
    ("nested \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),  # several boxes: the last one counts
    ("\\fbox{5}", "5"),
    ("\\boxed{ 3 }", "3"),
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


@pytest.mark.parametrize("text, strict, flexible", [
    ("so she has 18 apples.\n#### 18", "18", "18"),
    ("#### 1,234", "1234", "1234"),
    ("#### -5", "-5", "-5"),
    ("The total is $3.50, then 7 more, so 10.", None, "10"),
    ("#### 7\nlater 9", "7", "9"),  # strict takes the marked answer, flexible the last number
    ("no numbers", None, None),
])
def test_extract_gsm8k(text, strict, flexible):
    assert extract_gsm8k(text, strict=True) == strict
    assert extract_gsm8k(text, strict=False) == flexible
    assert EXTRACTORS["gsm8k_flexible"](text) == flexible


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
    acc, fmt, counts = score_completions(["<answer>052</answer>", "<answer>52</answer>", "052", "<answer>052</answer>x"],
                                         ["052"] * 4, "toy", "answer_tags")
    assert acc == [1.0, 0.0, 0.0, 1.0] and fmt == [1.0, 1.0, 0.0, 0.0]
    assert counts == {"no_answer": 1, "timeouts": 0}


def test_score_completions_math():
    texts = ["so \\boxed{\\frac{1}{3}}", "\\boxed{0.5}", "I do not know", "<answer>1/3</answer>"]
    acc, fmt, counts = score_completions(texts, ["\\frac{1}{3}"] * 4, "math", "boxed")
    assert acc == [1.0, 0.0, 0.0, 0.0] and counts["no_answer"] == 2
    acc, _, _ = score_completions(texts, ["\\frac{1}{3}"] * 4, "gsm8k", "answer_tags")
    assert acc == [0.0, 0.0, 0.0, 1.0]


HOSTILE = [
    "\\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}",  # a power tower: its exact value never fits in memory
    "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",  # deeply nested braces
    "\\boxed{" + "1" * 100_000 + "}",  # a huge number
    "x" * 2_000_000 + "\\boxed{1}",  # a very long completion: only the tail is looked at
    "\\boxed{\\frac{" * 300 + "1",  # unclosed nesting, truncated
    "<answer>" + "(" * 2000 + "</answer>",
    "\\boxed{10^{10^{10^{10}}}!}",
    "\\boxed{__import__('os').system('echo pwned')}",  # never eval'd
]


def test_hostile_completions_finish_in_bounded_time_and_score_zero():
    start = time.time()
    acc, fmt, counts = score_completions(HOSTILE, ["1"] * len(HOSTILE), "math", "boxed", timeout=3.0)
    elapsed = time.time() - start
    assert acc[:3] + acc[4:] == [0.0] * (len(HOSTILE) - 1)
    assert acc[3] == 1.0  # the honest answer at the end of a long completion is still found
    assert elapsed < 3.0 * len(HOSTILE) + 10, elapsed  # each item is bounded by its timeout
    assert counts["timeouts"] <= len(HOSTILE)


def _sleep_or_square(x):
    if x < 0:
        time.sleep(60)  # a check that hangs
    return x * x


def test_map_with_timeout_replaces_a_hung_worker():
    start = time.time()
    assert map_with_timeout(_sleep_or_square, [1, -1, 3, -2, 5], timeout=1.0) == [1, None, 9, None, 25]
    assert time.time() - start < 10
