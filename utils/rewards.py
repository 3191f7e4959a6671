"""Verifiable rewards. Completions are untrusted input: never eval'd, only the tail of a completion is looked at, an
extracted answer is capped in length, and every math-verify call runs in a forked worker with a hard time limit, so
a parse that hangs (even inside C code, where signal-based timeouts cannot reach) costs a zero reward and a counted
timeout, never the run.
"""

import multiprocessing
import re

MAX_TAIL_CHARS = 4000  # only the end of a completion is searched for its answer
MAX_ANSWER_CHARS = 300  # a longer "answer" scores 0 without being parsed
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces matched; None if there is none or it is unclosed."""
    text = text[-MAX_TAIL_CHARS:]
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    start = text.index("{", start) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def extract_answer_tag(text):
    """Content of the last <answer>...</answer>, or None."""
    matches = ANSWER_TAG.findall(text[-MAX_TAIL_CHARS:])
    return matches[-1].strip() if matches else None


def extract_gsm8k(text, strict=True):
    """GSM8K answers: strict takes the last '#### N'; flexible takes the last number in the text (verl's two modes)."""
    matches = (GSM8K_STRICT if strict else NUMBER).findall(text[-MAX_TAIL_CHARS:])
    return matches[-1].replace(",", "").replace("$", "").rstrip(".") if matches else None


EXTRACTORS = {
    "boxed": extract_boxed,
    "answer_tags": extract_answer_tag,
    "gsm8k_strict": extract_gsm8k,
    "gsm8k_flexible": lambda text: extract_gsm8k(text, strict=False),
}


def format_reward(text, answer_format):
    """1.0 if the completion gives exactly one answer in the asked-for form and nothing after it, else 0.0."""
    if answer_format == "boxed":
        return float(text.count("\\boxed{") == 1 and extract_boxed(text) is not None)
    tags = ANSWER_TAG.findall(text)
    return float(len(tags) == 1 and text.rstrip().endswith("</answer>"))


def _parse(expression):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # The extracted answer is wrapped in $...$ so the LaTeX extractor sees it; the expression extractor handles plain
    # numbers and fractions ("72", "1/3") that the LaTeX-only config of TRL drops.
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(f"${expression}$", extraction_config=configs, parsing_timeout=2)


def gold_parses(gold):
    """Whether a gold answer is checkable; unparseable gold rows are dropped at load time."""
    return bool(gold) and len(gold) <= MAX_ANSWER_CHARS and len(_parse(gold)) > 0


def math_equal(gold, answer):
    """math-verify equivalence of two answer strings, gold first (the argument order matters in math-verify)."""
    from math_verify import verify

    if answer is None or not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    gold_parsed, answer_parsed = _parse(gold), _parse(answer)
    return bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=2))


def _math_item(item):
    gold, text, answer_format = item
    return float(math_equal(gold, EXTRACTORS[answer_format](text)))


def map_with_timeout(fn, items, timeout):
    """[fn(x) for x in items] in a forked worker; an item running past `timeout` seconds gives None and the worker is
    replaced (a killed process is the only bound that also stops C code, e.g. a huge integer power in sympy)."""
    results, next_item = [None] * len(items), 0
    while next_item < len(items):
        with multiprocessing.get_context("fork").Pool(1) as pool:  # leaving the block terminates the worker
            pending = pool.imap(fn, items[next_item:])
            try:
                for k in range(next_item, len(items)):
                    results[k] = pending.next(timeout=timeout)
                    next_item = k + 1
            except multiprocessing.TimeoutError:
                next_item += 1  # skip the item that hung, restart a fresh worker on the rest
    return results


def score_completions(completions, golds, task, answer_format, timeout=5.0):
    """Accuracy and format rewards per completion, plus counts of unanswered and timed-out completions."""
    if task == "toy":  # exact match of the tag content: no parser involved
        answers = [extract_answer_tag(c) for c in completions]
        accuracy = [float(a == g) for a, g in zip(answers, golds)]
        timeouts = 0
    else:
        answers = [EXTRACTORS[answer_format](c) for c in completions]
        raw = map_with_timeout(_math_item, [(g, c, answer_format) for g, c in zip(golds, completions)], timeout)
        accuracy = [0.0 if r is None else r for r in raw]
        timeouts = sum(r is None for r in raw)
    formats = [format_reward(c, answer_format) for c in completions]
    return accuracy, formats, {"no_answer": sum(a is None for a in answers), "timeouts": timeouts}
