"""Verifiable rewards. Completions are untrusted input, and under RL the policy searches for whatever the reward lets
through, so answers are read strictly and every check is bounded:

- "The final answer" is the last \\boxed{} (or <answer> tag) anywhere in the completion, found with linear scans
  (junk after it costs the format reward, not the answer); an answer over MAX_ANSWER_CHARS scores 0 unparsed.
- An answer is parsed as LaTeX; the plain-expression reader is tried only when the whole answer is digits and
  operators, and a \\text{} holding a number is a hedge: "73 (I'm not sure, maybe 72)", "72 @ 73", "72 & 73 & 74"
  and "72 \\text{ (or 73)}" score 0 instead of being read as a single number.
- Plain numbers (most GSM8K answers) are compared exactly in this process when they are equal or clearly apart.
  Everything else goes to math-verify in K warm worker processes (RewardScorer, a pebble process pool), started once
  through a fork server (never forked from a large CUDA process), each with a memory limit; a gold is parsed once per
  worker, each distinct answer checked once, and only the extracted answer (<= 300 characters) is sent. A check
  running past the hard time limit gets its worker killed and replaced (a killed process is the only bound that also
  stops C code, e.g. a huge integer power in sympy). Every failure kind scores 0 and is counted; none aborts the step.
- A reasoning-gym task (rg:NAME) is checked by its dataset's own score_answer in the same workers, under the same
  bounds; a completion is correct when it gets the full score (partial credit, e.g. for an answer that merely
  contains the gold, would pay for boxing many numbers).
- The format reward pays only for an answer that the accuracy check can read: one answer in the asked-for form,
  nothing long after it, not empty, and parsed by the checker (a number when the gold is a number). An empty box, a
  copy of the instruction or the question echoed in the box earns nothing: a real policy learns within minutes to
  emit whatever a format reward pays for.
- A stated probability (calibrated.py's format: the answer, then <confidence>q</confidence> ending the completion)
  is read by stated_confidence, strictly (one decimal in [0, 1], nothing after the tag), and set aside before the
  answer is checked, so a completion that states one is scored on its answer as any other.
"""

import collections
import contextlib
import functools
import logging
import multiprocessing
import os
import re
import resource
import signal
import threading
import time
from decimal import Decimal

MAX_ANSWER_CHARS = 300  # a longer "answer" scores 0 without being parsed
MAX_AFTER_BOX = 50  # a well-formatted ending: fewer characters than this after the box (at most 49)
PLAIN_EXPRESSION = re.compile(r"[-+*/^().0-9\s]+")  # what the plain-expression reader may see: digits and operators
SPACED_NUMBERS = re.compile(r"[0-9.]\s+[0-9]")  # "72 73": two answers, not one
NUMBER_IN_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*[0-9]")  # "72 \text{ (or 73)}": a hedge
PLAIN_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")  # 72, -3.5, 1,000 (not 1,2)
ANSWER_PLACEHOLDER = "ANSWER"  # where --instruction user says the answer goes: \boxed{ANSWER} (utils/tasks.py)
# the instruction's placeholder, copied: never an answer (math-verify would read it as the product A*N*S*W*E*R)
PLACEHOLDER = re.compile(rf"(?:\\(?:text|textbf|mathrm)\s*\{{\s*)?{ANSWER_PLACEHOLDER}\s*\}}?", re.IGNORECASE)
FAILURES = ("unparsed", "timeouts", "verify_timeouts", "errors", "memory")


def _last_boxed(text):
    """(start, end) of the content of the last \\boxed{...} (or \\fbox{...}): nested braces matched, escaped braces
    \\{ \\} skipped; None if there is none, it is unclosed, or it runs past MAX_ANSWER_CHARS (a bounded scan)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    start = text.index("{", start) + 1
    depth, i, end = 1, start, min(len(text), start + MAX_ANSWER_CHARS + 1)
    while i < end:
        if text[i] == "\\":  # an escaped character (\\{, \\}, \\\\) is content, never a brace
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, i
        i += 1
    return None


def extract_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), stripped; None if there is none or it is unclosed."""
    span = _last_boxed(text)
    return text[span[0]:span[1]].strip() if span else None


def extract_answer_tag(text):
    """Content of the last <answer>...</answer>, or None."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    return text[start + len("<answer>"):end].strip() if end >= 0 and start >= 0 else None


EXTRACTORS = {"boxed": extract_boxed, "answer_tags": extract_answer_tag}  # the answer formats a completion is asked for
# a stated probability ending the completion: 0, 1, 0.7, .25, 1.0 (at most 6 decimals); not 70%, 1e-1, 0.7 or 0.8
STATED = re.compile(r"<confidence>\s*(0(?:\.[0-9]{1,6})?|1(?:\.0{1,6})?|\.[0-9]{1,6})\s*</confidence>\s*")
ABSTENTIONS = ("idk", "i don't know", "i do not know")  # an answer that abstains (calibrated.py's instruction: IDK)


def split_confidence(text):
    """The probability a completion states that its answer is correct (arXiv 2507.16806's and 2512.19920's format:
    the answer, then <confidence>q</confidence>, nothing after it but whitespace) -> (the text before the tag, q,
    "stated"); else (text, None, "missing") when no tag opens, or (text, None, "malformed"): more than one tag, a tag
    not closed at the end, or one that does not hold exactly one decimal in [0, 1]. Linear scans, no eval."""
    start = text.rfind("<confidence>")
    if start < 0:
        return text, None, "missing"
    match = STATED.fullmatch(text, start)
    if match is None or text.count("<confidence>") > 1:
        return text, None, "malformed"
    return text[:start], float(match.group(1)), "stated"


def stated_confidence(text, extract):
    """(q, kind) of a completion whose answer `extract` reads (EXTRACTORS): kind "abstained" (its answer is IDK, or
    I don't know: q None, whatever follows), else split_confidence's q and kind ("stated", "missing", "malformed")."""
    before, q, kind = split_confidence(text)
    answer = extract(before)
    if answer is not None and len(answer) <= 20 and answer.strip().lower().rstrip(".") in ABSTENTIONS:
        return None, "abstained"
    return q, kind


LAST_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def lenient_extractor(answer_format):
    """The asked-for form's answer, else the last number in the text (lm-evaluation-harness's "flexible-extract" of
    GSM8K): what a model can compute whatever form it answers in ("4 + 7 = 11" reads 11). The prior-task evaluation's
    measure (plumbing/evaluation.py); never a reward."""
    strict = EXTRACTORS[answer_format]

    def extract(text):
        answer = strict(text)
        if answer is not None:
            return answer
        numbers = LAST_NUMBER.findall(text[-2000:])  # a bounded scan: the end of the text is where answers are
        return numbers[-1].rstrip(",") if numbers else None
    return extract


def format_reward(text, answer_format):
    """1.0 if the completion gives exactly one answer in the asked-for form, else 0.0: one \\boxed{} followed by fewer
    than MAX_AFTER_BOX characters ("$.", "\\]", a short closing sentence), or one <answer>...</answer> that ends the
    text. Only the shape: the scorer also requires the answer to be readable (answer_is_readable and the workers'
    parse)."""
    if answer_format == "boxed":  # a closing "$.", "\\]" or short sentence may follow the box
        span = _last_boxed(text)
        return float(text.count("\\boxed{") == 1 and span is not None and len(text) - span[1] <= MAX_AFTER_BOX)
    return float(text.count("<answer>") == 1 and text.count("</answer>") == 1 and text.rstrip().endswith("</answer>")
                 and extract_answer_tag(text) is not None)


def plain_number(text):
    """The exact value of a plain decimal number ("72", "-3.5", "1,000", "\\$72"), else None."""
    text = text.strip().replace("\\$", "").replace("$", "").rstrip(".")
    return Decimal(text.replace(",", "")) if PLAIN_NUMBER.fullmatch(text) else None


def answer_is_readable(answer, gold):
    """For checkers that compare strings (the toy task, reasoning-gym): a non-empty answer, and a number when the gold
    is one (so that "\\boxed{x}", a copied instruction or an echoed question earns no format reward)."""
    if answer is None or not answer.strip():
        return False
    if _decimal(gold) is None:
        return True
    return _decimal(answer) is not None


def _decimal(text):
    """The value of a decimal number as reasoning-gym reads one ("+01,000.00", "-3.5", "7"), else None."""
    text = text.strip().replace(",", "")
    if len(text) > 100 or not re.fullmatch(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", text):
        return None
    return Decimal(text)


def numbers_decide(gold, answer):
    """1.0 / 0.0 when both are plain numbers that are equal or clearly apart (math-verify would agree), else None:
    most GSM8K answers are settled here, without a worker round trip."""
    g, a = plain_number(gold), plain_number(answer)
    if g is None or a is None:
        return None
    if a == g:
        return 1.0
    return 0.0 if abs(a - g) > Decimal("1e-4") * max(1, abs(g)) else None  # near ties: math-verify's rounding decides


# ---- math-verify, strictly (these run inside the worker processes) -------------------------------------------------


def _timeout(seconds):
    """math-verify's own (signal-based) time limit works on the main thread only; elsewhere the caller bounds time."""
    return seconds if threading.current_thread() is threading.main_thread() else None


def parse_gold(gold):
    """Gold answers are trusted: LaTeX, or a plain expression ("72", "1/3")."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(f"${gold}$", extraction_config=configs, parsing_timeout=_timeout(2))


def parse_answer(answer):
    """A model's extracted answer, strictly: [] (unreadable, scores 0) unless LaTeX parses it, or the whole answer is a
    plain number or arithmetic expression. Never a number picked out of a hedge."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if not answer or len(answer) > MAX_ANSWER_CHARS or NUMBER_IN_TEXT.search(answer):
        return []
    parsed = parse(f"${answer}$", extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                   parsing_timeout=_timeout(2))
    if any(not isinstance(p, str) for p in parsed):  # a failed parse returns only the matched string
        return parsed
    if PLAIN_EXPRESSION.fullmatch(answer) and not SPACED_NUMBERS.search(answer):
        return parse(answer, extraction_config=[ExprExtractionConfig()], parsing_timeout=_timeout(2))
    return []


def gold_parses(gold):
    """Whether a gold answer is checkable; unparseable gold rows are dropped at load time."""
    return bool(gold) and len(gold) <= MAX_ANSWER_CHARS and len(parse_gold(gold)) > 0


def math_equal(gold, answer):
    """math-verify equivalence of two answer strings, gold first (the argument order matters in math-verify)."""
    from math_verify import verify

    if answer is None:
        return False
    gold_parsed, answer_parsed = parse_gold(gold), parse_answer(answer)
    return bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=_timeout(2)))


class _CountTimeouts(logging.Handler):
    """math-verify reports its own time-outs only as a log warning and returns False: count them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Timeout during")


def rg_score(dataset, answer, entry):
    """1.0 when a reasoning-gym dataset's own verifier gives the answer its full score, else 0.0."""
    return float(dataset.score_answer(answer, entry) >= 1.0)


def limit_process(memory_bytes, file_bytes):
    """Limits of a worker or sandbox process (Linux): an address space of what it maps already plus memory_bytes, and
    files of at most file_bytes (a write past it fails with OSError instead of killing the process)."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))


_WORKER = {}  # a worker process's warm state, set once by _start_worker


def _start_worker(memory_bytes, rg_task=None):
    """Each worker's initializer: process limits, math-verify warmed up, and for a reasoning-gym task its dataset
    (whose score_answer reads the options it was made with). memory_bytes 0: no process limits (tests call this in
    their own process). A failure is kept and reported by every check: the scorer then stops the run."""
    try:
        if memory_bytes:  # no file writes: some reasoning-gym verifiers run sympy.parse_expr (Python's eval) on answers
            with contextlib.suppress(OSError, ValueError):  # Linux; elsewhere the time limits only
                limit_process(memory_bytes, file_bytes=0)
        timeouts = _CountTimeouts()
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addHandler(timeouts)
            logging.getLogger(name).propagate = False  # counted, not printed
        math_equal("\\frac{1}{2}", "0.5")  # warm up: sympy imports its modules lazily (~0.7 s on the first comparison)
        dataset = None
        if rg_task:
            from utils.tasks import rg_dataset

            dataset = rg_dataset(rg_task, seed=0, size=1)
        _WORKER.update(timeouts=timeouts, dataset=dataset)
    except BaseException as e:  # noqa: BLE001 - e.g. a memory limit too small to import the checker
        _WORKER["failed"] = f"{type(e).__name__}: {e}"


@functools.lru_cache(maxsize=4096)
def _parsed_gold(gold):
    """A gold parsed once per worker (every answer of its group reuses it)."""
    try:
        return parse_gold(gold)
    except Exception:  # noqa: BLE001 - golds are checked at load time; this is a last resort
        return []


def _check(gold, answer):
    """One answer, in a worker: (status, value). For a reasoning-gym task the gold is the row's entry and the
    dataset's score_answer checks the answer; otherwise math-verify, strictly."""
    from math_verify import verify

    if "failed" in _WORKER:
        return "startup", _WORKER["failed"]
    if _WORKER["dataset"] is not None:
        try:
            return "ok", rg_score(_WORKER["dataset"], answer, gold)
        except MemoryError:
            return "memory", 0.0
        except Exception:  # noqa: BLE001 - a verifier bug costs this answer its reward, never the run
            return "errors", 0.0
    timeouts = _WORKER["timeouts"]
    before = timeouts.count
    try:
        gold_parsed, answer_parsed = _parsed_gold(gold), parse_answer(answer)
        ok = bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=_timeout(2)))
        return "verify_timeouts" if timeouts.count > before else "ok" if answer_parsed else "unparsed", float(ok)
    except MemoryError:
        return "memory", 0.0
    except Exception:  # noqa: BLE001 - a checker bug costs this answer its reward, never the run
        return "errors", 0.0


# ---- The scorer: K warm workers (a pebble process pool), so scoring overlaps the trainer's passes -------------------


class ScoreJob:
    """One submitted batch: per-completion accuracy and readability, filled in as the workers' checks finish."""

    def __init__(self, completions, answer_format):
        self.shapes = [format_reward(c, answer_format) for c in completions]  # the format's shape, before parsing
        self.readable = [False] * len(completions)  # the checker could read the answer (format needs both)
        self.accuracy = [0.0] * len(completions)
        self.counts = {"no_answer": 0, **{kind: 0 for kind in FAILURES}}
        self.pending, self.done = 0, threading.Event()
        self.submitted, self.finished = time.time(), None


class RewardScorer:
    """Accuracy and format rewards for a task: the toy task by exact match in this process, math answers by
    math-verify and reasoning-gym answers by their dataset's score_answer in `num_workers` persistent worker
    processes (pebble's ProcessPool: a check running past `timeout` seconds has its worker killed and replaced, a
    worker that dies costs only the answer it was checking).

        job = scorer.submit(completions, golds)   # returns at once: extraction here, checks in the workers
        ...                                        # the trainer's log-prob passes run meanwhile
        accuracy, formats, counts = scorer.result(job)

    A gold is the gold answer string, or the task row ({"answer", and "entry" for a reasoning-gym task}).
    """

    def __init__(self, task, answer_format, num_workers=1, timeout=5.0, memory_mb=1024, compare_numbers=True,
                 lenient=False):
        from utils.tasks import TOY_TASKS  # here: utils/tasks.py imports this module

        num_workers = num_workers or default_reward_workers()  # 0: this process's share of the cores
        self.exact = task in TOY_TASKS  # exact match of the tag content
        self.rg_task = task if task.startswith("rg:") else None  # checked by reasoning-gym's own verifier
        # settle plain numbers here (False: every check goes to the workers)
        self.compare_numbers = compare_numbers and not self.rg_task
        self.extract = extract_answer_tag if self.exact else EXTRACTORS[answer_format]
        if lenient:  # the last number where the asked-for form is missing (prior tasks' evaluation, never a reward)
            self.extract = lenient_extractor("answer_tags" if self.exact else answer_format)
        self.answer_format, self.timeout = answer_format, timeout
        self.lock, self.failure, self.pool = threading.Lock(), None, None
        if self.exact:
            return
        from pebble import ProcessPool

        context = multiprocessing.get_context("forkserver")  # workers fork from a fresh server, not from us
        context.set_forkserver_preload(["utils.rewards", "math_verify"] + (["reasoning_gym"] if self.rg_task else []))
        self.pool = ProcessPool(max(1, num_workers), initializer=_start_worker, context=context,
                                initargs=(memory_mb * 2**20, self.rg_task))
        self.pool.schedule(os.getpid)  # the workers start now and warm up while the caller loads its models

    def submit(self, completions, golds):
        completions = [split_confidence(c)[0] for c in completions]  # a stated probability is not the answer's part
        job = ScoreJob(completions, self.answer_format)
        answers = [self.extract(c) for c in completions]
        checks = collections.defaultdict(list)  # (gold key, distinct answer) -> the completions that gave it
        entries = {}  # for a reasoning-gym task: gold key -> the entry its verifier reads
        for i, (answer, row) in enumerate(zip(answers, golds)):
            gold = row if isinstance(row, str) else row["answer"]
            # none, empty, or the instruction's placeholder: nothing to check or to read
            if answer is None or not answer.strip() or PLACEHOLDER.fullmatch(answer.strip()):
                job.counts["no_answer"] += 1
                continue
            if self.exact or self.rg_task:  # string checkers: the format needs a non-empty answer of the gold's kind
                job.readable[i] = answer_is_readable(answer, gold)
            if answer == gold.strip() and not self.rg_task:  # identical to the gold: correct, no parse (it parses)
                job.accuracy[i], job.readable[i] = 1.0, True
            elif self.exact:
                continue
            elif len(answer) > MAX_ANSWER_CHARS:
                job.counts["unparsed"] += 1
            elif self.compare_numbers and (decided := numbers_decide(gold, answer)) is not None:
                job.accuracy[i], job.readable[i] = decided, True
            elif self.rg_task:
                key = id(row["entry"])  # the same row object for every completion of its group
                entries[key] = row["entry"]
                checks[(key, answer)].append(i)
            else:
                checks[(gold, answer)].append(i)
        job.pending = len(checks)  # set before the first check can finish
        if job.pending == 0:
            job.finished = time.time()
            job.done.set()
        for (gold, answer), indices in checks.items():
            future = self.pool.schedule(_check, (entries.get(gold, gold), answer), timeout=self.timeout)
            future.add_done_callback(functools.partial(self._record, job, indices))
        return job

    def result(self, job):
        """(accuracy, formats, counts) of a job, waiting for it; job.waited is the part of scoring that was not
        hidden behind other work, job.hidden the rest. A format counts only for an answer the checker could read."""
        start = time.time()
        job.done.wait()
        if self.failure:
            raise RuntimeError(f"reward scorer stopped: {self.failure}")
        job.waited = time.time() - start
        job.hidden = max(0.0, job.finished - job.submitted - job.waited)
        formats = [shape * readable for shape, readable in zip(job.shapes, job.readable)]
        return job.accuracy, formats, job.counts

    def close(self):
        if self.pool is not None:
            self.pool.stop()
            self.pool.join()
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _record(self, job, indices, future):
        """A finished check (in the pool's thread): its answer's accuracy, readability and failure count."""
        from pebble import ProcessExpired

        try:
            status, value = future.result()
        except TimeoutError:  # past the hard limit: pebble killed and replaced the worker
            status, value = "timeouts", 0.0
        except ProcessExpired:  # the worker died (the memory limit, most often)
            status, value = "memory", 0.0
        except Exception:  # noqa: BLE001 - the pool's own failure costs the answer, never the run
            status, value = "errors", 0.0
        with self.lock:
            if status == "startup":
                self.failure, status, value = f"a reward worker failed to start ({value})", "errors", 0.0
            for i in indices:
                job.accuracy[i] = value
                if not self.rg_task:  # math-verify parsed the answer (reasoning-gym answers were judged at submit)
                    job.readable[i] = status == "ok"
            if status != "ok":
                job.counts[status] += len(indices)
            job.pending -= 1
            if job.pending == 0:
                job.finished = time.time()
                job.done.set()


def default_reward_workers():
    """A sensible K for a GPU node: this training process's share of the CPU cores, less one for it, from 1 to 8."""
    processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
    return max(1, min(8, (os.cpu_count() or 2) // processes_per_node - 1))


def score_completions(completions, golds, task, answer_format, timeout=5.0, num_workers=1):
    """One-off scoring (tests, scripts): starts a scorer, scores, stops it. Training loops keep one RewardScorer."""
    with RewardScorer(task, answer_format, num_workers, timeout) as scorer:
        return scorer.result(scorer.submit(completions, golds))
