"""Verifiable rewards. Completions are untrusted input, and under RL the policy searches for whatever the reward lets
through, so answers are read strictly and every check is bounded:

- "The final answer" is the last \\boxed{} (or <answer> tag) anywhere in the completion, found with linear scans
  (junk after it costs the format reward, not the answer); an answer over MAX_ANSWER_CHARS scores 0 unparsed.
- An answer is parsed as LaTeX; the plain-expression reader is tried only when the whole answer is digits and
  operators, and a \\text{} holding a number is a hedge: "73 (I'm not sure, maybe 72)", "72 @ 73", "72 & 73 & 74"
  and "72 \\text{ (or 73)}" score 0 instead of being read as a single number.
- Plain numbers (most GSM8K answers) are compared exactly in this process when they are equal or clearly apart.
  Everything else goes to math-verify in K warm worker processes (RewardScorer), started once through a fork server
  (never forked from a large CUDA process), each with a memory limit; the gold is parsed once per group, each
  distinct answer checked once, and only the extracted answer (<= 300 characters) is sent. An item running past the hard time limit gets its worker killed and replaced (a
  killed process is the only bound that also stops C code, e.g. a huge integer power in sympy). Every failure kind
  scores 0 and is counted; none aborts the step.
"""

import collections
import logging
import multiprocessing
import os
import re
import resource
import threading
import time
from decimal import Decimal
from multiprocessing.connection import wait

MAX_ANSWER_CHARS = 300  # a longer "answer" scores 0 without being parsed
MAX_AFTER_BOX = 50  # characters after the box that still count as a well-formatted ending
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")
PLAIN_EXPRESSION = re.compile(r"[-+*/^().0-9\s]+")  # what the plain-expression reader may see: digits and operators
SPACED_NUMBERS = re.compile(r"[0-9.]\s+[0-9]")  # "72 73": two answers, not one
NUMBER_IN_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*[0-9]")  # "72 \text{ (or 73)}": a hedge
PLAIN_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")  # 72, -3.5, 1,000 (not 1,2)
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


def extract_gsm8k(text, strict=True):
    """GSM8K answers: strict takes the last '#### N'; flexible takes the last number in the text (verl's two modes)."""
    matches = (GSM8K_STRICT if strict else NUMBER).findall(text)
    return matches[-1].replace(",", "").replace("$", "").rstrip(".") if matches else None


EXTRACTORS = {
    "boxed": extract_boxed,
    "answer_tags": extract_answer_tag,
    "gsm8k_strict": extract_gsm8k,
    "gsm8k_flexible": lambda text: extract_gsm8k(text, strict=False),
}


def format_reward(text, answer_format):
    """1.0 if the completion gives exactly one answer in the asked-for form and nothing after it, else 0.0."""
    if answer_format == "boxed":  # a closing "$.", "\\]" or short sentence may follow the box
        span = _last_boxed(text)
        return float(text.count("\\boxed{") == 1 and span is not None and len(text) - span[1] <= MAX_AFTER_BOX)
    return float(text.count("<answer>") == 1 and text.count("</answer>") == 1 and text.rstrip().endswith("</answer>")
                 and extract_answer_tag(text) is not None)


def plain_number(text):
    """The exact value of a plain decimal number ("72", "-3.5", "1,000", "\\$72"), else None."""
    text = text.strip().replace("\\$", "").replace("$", "").rstrip(".")
    return Decimal(text.replace(",", "")) if PLAIN_NUMBER.fullmatch(text) else None


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


def _worker(conn, memory_bytes):
    """Worker process: receive (task id, gold, answers), send (task id, item index, status, value) per answer."""
    if memory_bytes:
        try:  # address-space limit on top of what the process already maps (Linux; elsewhere time limits only)
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
        except (OSError, ValueError):
            pass
    from math_verify import verify

    timeouts = _CountTimeouts()
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addHandler(timeouts)
        logging.getLogger(name).propagate = False  # counted, not printed
    math_equal("\\frac{1}{2}", "0.5")  # warm up: sympy imports its modules lazily (~0.7 s on the first comparison)
    conn.send("ready")
    while (task := conn.recv()) is not None:
        task_id, gold, answers = task
        try:
            gold_parsed = parse_gold(gold)  # once per group
        except Exception:  # noqa: BLE001 - golds are checked at load time; this is a last resort
            gold_parsed = []
        for j, answer in enumerate(answers):
            before = timeouts.count
            try:
                answer_parsed = parse_answer(answer)
                ok = bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed,
                                                                   timeout_seconds=_timeout(2)))
                status = "verify_timeouts" if timeouts.count > before else "ok" if answer_parsed else "unparsed"
            except MemoryError:
                ok, status = False, "memory"
            except Exception:  # noqa: BLE001 - a checker bug costs this answer its reward, never the run
                ok, status = False, "errors"
            conn.send((task_id, j, status, float(ok)))


# ---- The scorer: K warm workers, fed by a thread, so scoring overlaps the trainer's passes --------------------------


class ScoreJob:
    """One submitted batch: per-completion accuracy, filled in by the scorer's thread."""

    def __init__(self, completions, answer_format):
        self.formats = [format_reward(c, answer_format) for c in completions]
        self.accuracy = [0.0] * len(completions)
        self.counts = {"no_answer": 0, **{kind: 0 for kind in FAILURES}}
        self.targets = {}  # (task id, item index) -> the completions that share this answer
        self.pending, self.done = 0, threading.Event()
        self.submitted, self.finished = time.time(), None


class RewardScorer:
    """Accuracy and format rewards for a task: the toy task by exact match in this process, math answers by
    math-verify in `num_workers` persistent worker processes.

        job = scorer.submit(completions, golds)   # returns at once: extraction here, checks in the workers
        ...                                        # the trainer's log-prob passes run meanwhile
        accuracy, formats, counts = scorer.result(job)
    """

    def __init__(self, task, answer_format, num_workers=1, timeout=5.0, memory_mb=1024, compare_numbers=True):
        self.exact = task == "toy"  # exact match of the tag content: no parser involved
        self.compare_numbers = compare_numbers  # settle plain numbers here (False: every check goes to math-verify)
        self.extract = extract_answer_tag if self.exact else EXTRACTORS[answer_format]
        self.answer_format, self.timeout, self.memory_bytes = answer_format, timeout, memory_mb * 2**20
        self.queue, self.jobs, self.lock, self.next_id = collections.deque(), {}, threading.Lock(), 0
        self.workers, self.failure = [], None
        if self.exact:
            return
        self.context = multiprocessing.get_context("forkserver")  # workers fork from a fresh server, not from us
        self.context.set_forkserver_preload(["__main__", "utils.rewards", "math_verify"])
        self.wake_receiver, self.wake_sender = self.context.Pipe(duplex=False)
        self.workers = [self._start_worker() for _ in range(max(1, num_workers))]
        self.closed = False
        self.thread = threading.Thread(target=self._dispatch, daemon=True, name="reward-scorer")
        self.thread.start()

    def submit(self, completions, golds):
        job = ScoreJob(completions, self.answer_format)
        answers = [self.extract(c) for c in completions]
        job.counts["no_answer"] = sum(a is None for a in answers)
        groups = collections.defaultdict(dict)  # gold -> {distinct answer: [completion indices]}
        for i, (answer, gold) in enumerate(zip(answers, golds)):
            if answer is None:
                continue
            if answer == gold.strip():  # identical to the gold: correct without a parse (the gold parses)
                job.accuracy[i] = 1.0
            elif self.exact:
                continue
            elif len(answer) > MAX_ANSWER_CHARS:
                job.counts["unparsed"] += 1
            elif self.compare_numbers and (decided := numbers_decide(gold, answer)) is not None:
                job.accuracy[i] = decided
            else:
                groups[gold].setdefault(answer, []).append(i)
        with self.lock:
            for gold, by_answer in groups.items():
                task_id, self.next_id = self.next_id, self.next_id + 1
                self.jobs[task_id] = job
                for j, indices in enumerate(by_answer.values()):
                    job.targets[(task_id, j)] = indices
                job.pending += len(by_answer)
                self.queue.append((task_id, gold, list(by_answer)))
        if job.pending == 0 or self.failure:
            job.finished = time.time()
            job.done.set()
        else:
            self.wake_sender.send(None)
        return job

    def result(self, job):
        """(accuracy, formats, counts) of a job, waiting for it; job.waited is the part of scoring that was not
        hidden behind other work, job.hidden the rest."""
        start = time.time()
        job.done.wait()
        if self.failure:
            raise RuntimeError(f"reward scorer stopped: {self.failure}")
        job.waited = time.time() - start
        job.hidden = max(0.0, job.finished - job.submitted - job.waited)
        return job.accuracy, job.formats, job.counts

    def close(self):
        if self.exact or self.closed:
            return
        self.closed = True
        self.wake_sender.send(None)
        self.thread.join(timeout=5)
        for worker in self.workers:
            worker["process"].kill()
            worker["process"].join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the scorer's thread --

    def _start_worker(self):
        receiver, sender = self.context.Pipe()
        process = self.context.Process(target=_worker, args=(sender, self.memory_bytes), daemon=True)
        process.start()
        sender.close()
        return {"process": process, "conn": receiver, "ready": False, "task": None, "item": 0, "started": 0.0}

    def _record(self, task_id, j, status, value):
        job = self.jobs[task_id]
        for i in job.targets[(task_id, j)]:
            job.accuracy[i] = value
        if status != "ok":
            job.counts[status] += len(job.targets[(task_id, j)])
        job.pending -= 1
        if job.pending == 0:
            with self.lock:  # forget the finished job's tasks (a long run would keep every job alive otherwise)
                for key in [k for k, v in self.jobs.items() if v is job]:
                    del self.jobs[key]
            job.finished = time.time()
            job.done.set()

    def _replace(self, worker, status):
        """Kill a stuck (or dead) worker: its current answer gets `status`, the rest of its task goes back in line."""
        worker["process"].kill()
        worker["process"].join()
        self.workers[self.workers.index(worker)] = self._start_worker()
        task_id, gold, answers = worker["task"]
        rest = [(task_id, j) for j in range(worker["item"] + 1, len(answers))]
        if rest:  # the remaining answers keep their (task id, index) keys through a renumbered sub-task
            with self.lock:
                sub_id, self.next_id = self.next_id, self.next_id + 1
                job = self.jobs[sub_id] = self.jobs[task_id]
                for k, key in enumerate(rest):
                    job.targets[(sub_id, k)] = job.targets[key]
                self.queue.appendleft((sub_id, gold, answers[worker["item"] + 1:]))
        self._record(task_id, worker["item"], status, 0.0)  # last: it may complete the job

    def _fail(self, reason):
        """Stop scoring: every job waiting now or later raises `reason` in result()."""
        self.failure = reason
        with self.lock:
            for job in set(self.jobs.values()):
                job.done.set()

    def _dispatch(self):
        while not self.closed:
            for worker in self.workers:  # idle, warmed-up workers take the next task
                if worker["ready"] and worker["task"] is None and self.queue:
                    with self.lock:
                        worker["task"] = self.queue.popleft()
                    worker["item"], worker["started"] = 0, time.monotonic()
                    try:
                        worker["conn"].send(worker["task"])
                    except OSError:  # it died while idle: its first answer is charged to the memory limit
                        self._replace(worker, "memory")
            busy = [w for w in self.workers if w["task"] is not None]
            deadline = min((w["started"] + self.timeout for w in busy), default=time.monotonic() + 1.0)
            ready = wait([self.wake_receiver] + [w["conn"] for w in self.workers],
                         timeout=max(0.0, deadline - time.monotonic()))
            for conn in ready:
                if conn is self.wake_receiver:
                    conn.recv()
                    continue
                worker = next((w for w in self.workers if w["conn"] is conn), None)
                if worker is None:  # replaced earlier in this round
                    continue
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the worker died (the memory limit, most often)
                    if not worker["ready"]:  # it never started: respawning would fail the same way
                        self._fail(f"a reward worker exited during start-up (code {worker['process'].exitcode})")
                        return
                    if worker["task"] is not None:
                        self._replace(worker, "memory")
                    else:
                        self.workers[self.workers.index(worker)] = self._start_worker()
                    continue
                if message == "ready":
                    worker["ready"] = True
                    continue
                self._record(*message)
                worker["item"], worker["started"] = worker["item"] + 1, time.monotonic()
                if worker["item"] == len(worker["task"][2]):
                    worker["task"] = None
            now = time.monotonic()
            for worker in list(self.workers):
                if worker["task"] is not None and now - worker["started"] > self.timeout:
                    self._replace(worker, "timeouts")


def default_reward_workers():
    """A sensible K for a GPU node: this training process's share of the CPU cores, less one for it, from 1 to 8."""
    processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
    return max(1, min(8, (os.cpu_count() or 2) // processes_per_node - 1))


def score_completions(completions, golds, task, answer_format, timeout=5.0, num_workers=1):
    """One-off scoring (tests, scripts): starts a scorer, scores, stops it. Training loops keep one RewardScorer."""
    with RewardScorer(task, answer_format, num_workers, timeout) as scorer:
        return scorer.result(scorer.submit(completions, golds))
