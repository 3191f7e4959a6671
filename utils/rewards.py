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
- A reasoning-gym task (rg:NAME) is checked by its dataset's own score_answer in the same workers, under the same
  bounds; a completion is correct when it gets the full score (partial credit, e.g. for an answer that merely
  contains the gold, would pay for boxing many numbers).
- The format reward pays only for an answer that the accuracy check can read: one answer in the asked-for form,
  nothing long after it, not empty, and parsed by the checker (a number when the gold is a number). An empty box, a
  copy of the instruction or the question echoed in the box earns nothing: a real policy learns within minutes to
  emit whatever a format reward pays for.
"""

import collections
import logging
import multiprocessing
import os
import re
import resource
import signal
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
ANSWER_PLACEHOLDER = "ANSWER"  # where --instruction user says the answer goes: \boxed{ANSWER} (utils/tasks.py)
PLACEHOLDER = re.compile(rf"(?:\\(?:text|textbf|mathrm)\s*\{{\s*)?{ANSWER_PLACEHOLDER}\s*\}}?", re.IGNORECASE)  # copied,
# it is never an answer (math-verify would read it as the product A*N*S*W*E*R)
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
    """1.0 if the completion gives exactly one answer in the asked-for form and nothing after it, else 0.0. Only the
    shape: the scorer also requires the answer to be readable (see answer_is_readable and the workers' parse)."""
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


def _worker(conn, memory_bytes, rg_task=None):
    """Worker process: receive (task id, gold, answers), send (task id, item index, status, value) per answer. For a
    reasoning-gym task the gold is the row's entry and the dataset's score_answer checks each answer. memory_bytes 0:
    no process limits (the tests run this loop on a thread)."""
    if memory_bytes:
        try:  # address-space limit on top of what the process already maps (Linux; elsewhere time limits only)
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
            # no file writes: some reasoning-gym verifiers run sympy.parse_expr, i.e. Python's eval, on the answer
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        except (OSError, ValueError):
            pass
    from math_verify import verify

    timeouts = _CountTimeouts()
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addHandler(timeouts)
        logging.getLogger(name).propagate = False  # counted, not printed
    math_equal("\\frac{1}{2}", "0.5")  # warm up: sympy imports its modules lazily (~0.7 s on the first comparison)
    if rg_task:
        from utils.tasks import rg_dataset

        dataset = rg_dataset(rg_task, seed=0, size=1)  # its score_answer reads the options it was made with
    conn.send("ready")
    while (task := conn.recv()) is not None:
        task_id, gold, answers = task
        if rg_task:
            for j, answer in enumerate(answers):
                try:
                    conn.send((task_id, j, "ok", rg_score(dataset, answer, gold)))
                except MemoryError:
                    conn.send((task_id, j, "memory", 0.0))
                except Exception:  # noqa: BLE001 - a verifier bug costs this answer its reward, never the run
                    conn.send((task_id, j, "errors", 0.0))
            continue
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
    """One submitted batch: per-completion accuracy and readability, filled in by the scorer's thread."""

    def __init__(self, completions, answer_format):
        self.shapes = [format_reward(c, answer_format) for c in completions]  # the format's shape, before parsing
        self.readable = [False] * len(completions)  # the checker could read the answer (format needs both)
        self.accuracy = [0.0] * len(completions)
        self.counts = {"no_answer": 0, **{kind: 0 for kind in FAILURES}}
        self.targets = {}  # (task id, item index) -> the completions that share this answer
        self.pending, self.done = 0, threading.Event()
        self.submitted, self.finished = time.time(), None


class RewardScorer:
    """Accuracy and format rewards for a task: the toy task by exact match in this process, math answers by
    math-verify and reasoning-gym answers by their dataset's score_answer in `num_workers` persistent worker
    processes.

        job = scorer.submit(completions, golds)   # returns at once: extraction here, checks in the workers
        ...                                        # the trainer's log-prob passes run meanwhile
        accuracy, formats, counts = scorer.result(job)

    A gold is the gold answer string, or the task row ({"answer", and "entry" for a reasoning-gym task}).
    """

    def __init__(self, task, answer_format, num_workers=1, timeout=5.0, memory_mb=1024, compare_numbers=True):
        self.exact = task == "toy"  # exact match of the tag content: no parser involved
        self.rg_task = task if task.startswith("rg:") else None  # checked by reasoning-gym's own verifier
        self.compare_numbers = compare_numbers and not self.rg_task  # settle plain numbers here (False: every check
        # goes to the workers)
        self.extract = extract_answer_tag if self.exact else EXTRACTORS[answer_format]
        self.answer_format, self.timeout, self.memory_bytes = answer_format, timeout, memory_mb * 2**20
        self.queue, self.jobs, self.lock, self.next_id = collections.deque(), {}, threading.Lock(), 0
        self.workers, self.failure = [], None
        if self.exact:
            return
        self.context = multiprocessing.get_context("forkserver")  # workers fork from a fresh server, not from us
        self.context.set_forkserver_preload(["__main__", "utils.rewards", "math_verify"] +
                                            (["reasoning_gym"] if self.rg_task else []))
        self.wake_receiver, self.wake_sender = self.context.Pipe(duplex=False)
        self.workers = [self._start_worker() for _ in range(max(1, num_workers))]
        self.closed = False
        self.thread = threading.Thread(target=self._dispatch, daemon=True, name="reward-scorer")
        self.thread.start()

    def submit(self, completions, golds):
        job = ScoreJob(completions, self.answer_format)
        answers = [self.extract(c) for c in completions]
        groups = collections.defaultdict(dict)  # gold -> {distinct answer: [completion indices]}
        entries = {}  # for a reasoning-gym task: gold key -> the entry its verifier reads
        for i, (answer, row) in enumerate(zip(answers, golds)):
            gold = row if isinstance(row, str) else row["answer"]
            if answer is None or not answer.strip() or PLACEHOLDER.fullmatch(answer.strip()):  # none, empty, or the
                # instruction's placeholder: nothing to check or to read
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
                groups[key].setdefault(answer, []).append(i)
            else:
                groups[gold].setdefault(answer, []).append(i)
        with self.lock:
            for gold, by_answer in groups.items():
                task_id, self.next_id = self.next_id, self.next_id + 1
                self.jobs[task_id] = job
                for j, indices in enumerate(by_answer.values()):
                    job.targets[(task_id, j)] = indices
                job.pending += len(by_answer)
                self.queue.append((task_id, entries.get(gold, gold), list(by_answer)))
        if job.pending == 0 or self.failure:
            job.finished = time.time()
            job.done.set()
        else:
            self.wake_sender.send(None)
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
        process = self.context.Process(target=_worker, args=(sender, self.memory_bytes, self.rg_task), daemon=True)
        process.start()
        sender.close()
        return {"process": process, "conn": receiver, "ready": False, "task": None, "item": 0, "started": 0.0}

    def _record(self, task_id, j, status, value):
        job = self.jobs[task_id]
        for i in job.targets[(task_id, j)]:
            job.accuracy[i] = value
            if not self.rg_task:  # math-verify parsed the answer (reasoning-gym answers were judged at submit)
                job.readable[i] = status == "ok"
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
