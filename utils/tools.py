"""The tool of grpo_tools.py: a Python interpreter for code the policy writes, run in sandbox processes.

The convention is ToRA's (arXiv 2309.17452) and Qwen2.5-Math's tool-integrated reasoning: the model writes a fenced
```python block; generation stops where the block closes (TOOL_STOP, a line holding only the fence), the block's code
runs, and the environment appends its output (capped) as an ```output block, after which the model continues:

    ```python
    print(347 * 86)
    ```
    ```output
    29842
    ```

Model output is untrusted input, so the code never runs in the trainer. It runs under `num_workers` sandbox
processes: fresh interpreters (not forks of the trainer, so they hold no torch and fork in milliseconds) that import
`modules` at start, each with an address-space limit, a file-size limit and stdout/stderr sent to /dev/null. Each
call runs in a child that a sandbox process forks for it, so nothing one completion's code does (replacing `print`,
changing a module) reaches another completion's call. The child of a root trainer becomes the unprivileged user
`nobody` (it can then signal no root process; root would ignore the process limit below). It keeps no inherited file
but its result pipe, may not start processes or threads (RLIMIT_NPROC 0: no fork bomb, no orphans), has timeout + 2 s
of CPU, runs the code as a script in a fresh empty folder (deleted afterwards), and is killed once it runs past
`timeout` seconds (the only bound that also stops C code: a regex backtracking, a huge integer power). A sandbox
process that dies or stops answering is replaced. Where nobody cannot read the Python installation (Python under
/root, mode 0700), a call can import only what its sandbox process imported: `modules` and what they import at start
(numpy.random or sympy's solve, loaded lazily, then fail; list them in `modules`). Every failure becomes the call's
output, an error message the model reads, and never stops the run. What this is not: a security boundary against a
deliberate attacker (the code can read files the user can, fill /tmp or /dev/shm with many files, open network
connections, and under a non-root trainer signal the trainer); for that, run the code in a container or a VM (e.g.
nsjail, gVisor, E2B).
"""

import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from utils.rewards import limit_process

TOOL_STOP = "\n```\n"  # a fence alone on its line: the end of a code block, where generation stops
CODE_FENCE = "```python"
MAX_CODE_CHARS = 50_000  # a model turn's code is far shorter
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding utils/
NOBODY = 65534  # the unprivileged user a root trainer's sandbox processes become
TOOL_INSTRUCTION = ("Compute with Python when it helps: write a ```python block that prints what you need; it runs "
                    "when the block closes, and its output follows in an ```output block.")  # for chat models


def last_code_block(text):
    """The code of the last ```python block of a model turn (up to its closing fence, or to the end), or None."""
    start = text.rfind(CODE_FENCE)
    if start < 0:
        return None
    code = text[start + len(CODE_FENCE):]
    end = code.find("```")
    return (code[:end] if end >= 0 else code).strip("\n")


def output_block(output, error, max_chars):
    """What the environment appends after a code block: its output (the first max_chars characters) and the error's
    last line, in an ```output block."""
    text = output if len(output) <= max_chars else output[:max_chars] + "\n... (output truncated)"
    text = "\n".join(part.strip("\n") for part in (text, error) if part.strip())
    return f"```output\n{text}\n```\n"


def tool_output_ids(tokenizer, output, error, max_tokens):
    """The output block's tokens, which grpo_tools.py appends to the context: at most max_tokens, a long output halved
    until the block fits, its error line and closing fence kept (an error too long for the block is cut, the fence
    kept)."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chars = len(output)
    while True:
        ids = encode(output_block(output, error, chars))
        if len(ids) <= max_tokens:
            return ids
        if chars == 0:
            fence = encode(TOOL_STOP)
            return ids[:max_tokens - len(fence)] + fence
        chars //= 2


def tool_metrics(completions, accuracy, tool_time, accelerator):
    """Tool use of a grpo_tools.py rollout (its completions, their accuracy) over every process: completions that
    called (call_frac), calls per completion, the fraction of calls that failed, the model's and the tool's tokens per
    completion, and accuracy with and without a call (NaN when no completion falls in a group)."""
    import torch  # here, not at the top: the sandbox processes import this module and need no torch

    called = [c["calls"] > 0 for c in completions]
    model_tokens = sum(sum(c["mask"]) for c in completions)
    counts = [len(completions), sum(called), sum(a for a, k in zip(accuracy, called) if k),
              sum(a for a, k in zip(accuracy, called) if not k), sum(c["calls"] for c in completions),
              sum(c["errors"] for c in completions), model_tokens,
              sum(len(c["mask"]) for c in completions) - model_tokens]
    n, n_called, right_called, right_direct, calls, errors, model_tokens, tool_tokens = accelerator.reduce(
        torch.tensor(counts, dtype=torch.float64, device=accelerator.device), reduction="sum").tolist()
    nan = float("nan")
    return {"tools/call_frac": n_called / n, "tools/calls_per_completion": calls / n,
            "tools/error_frac": errors / calls if calls else nan, "tools/model_tokens": model_tokens / n,
            "tools/output_tokens": tool_tokens / n, "time/tools": tool_time,
            "charts/accuracy_with_call": right_called / n_called if n_called else nan,
            "charts/accuracy_without_call": right_direct / (n - n_called) if n > n_called else nan}


class _CappedText(io.TextIOBase):
    """A stdout that keeps its first `cap` characters and drops the rest (a print loop cannot grow it)."""

    def __init__(self, cap):
        self.cap, self.parts, self.size = cap, [], 0

    def writable(self):
        return True

    def write(self, s):
        if self.size <= self.cap:
            self.parts.append(str(s)[:self.cap + 1 - self.size])
            self.size += len(self.parts[-1])
        return len(s)

    def getvalue(self):
        return "".join(self.parts)


def _serve(folder, modules, memory_bytes, file_bytes, max_chars, timeout):
    """A sandbox process, a fresh interpreter (not a fork of the trainer: it holds no torch, so forking it is cheap).
    It imports `modules` (a call's import of them is then free, and works even where the user nobody cannot read the
    Python installation), takes its limits, makes two test calls, answers [why it cannot run calls or "", a warning
    or ""] on stdout, then reads one JSON code string per line on stdin and answers each with one JSON [output, error]
    line, every call in a child of its own."""
    channel_in, channel_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # C-level writes (os.write, a crashing extension) go nowhere

    def answer(message):
        channel_out.write(json.dumps(message).encode() + b"\n")
        channel_out.flush()

    try:
        for name in modules:
            importlib.import_module(name)
        gc.freeze()  # the imported objects stay out of the children's garbage collections: fewer pages copied
        root = tempfile.mkdtemp(dir=folder)
        os.chmod(root, 0o711)  # a child that became nobody reaches its own folder in it, and lists none
        with contextlib.suppress(Exception):  # Linux: a child of the same user cannot reach this process's pipes
            ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: /proc/<pid>/fd is closed to it
        limit_process(memory_bytes, file_bytes)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except BaseException as e:  # noqa: BLE001 - e.g. a module that cannot be imported: the sandbox stops
        return answer([f"{type(e).__name__}: {e}", ""])

    def call(code, reply=None):
        folder = tempfile.mkdtemp(dir=root)
        result = _run_code(code, max_chars, timeout, folder)
        if reply:
            reply(result)
        _remove(folder)  # after the reply: a call that made many files does not delay it
        return result

    test = call("print(6 * 7)")  # a child that cannot take its limits or user never runs a call: the run stops
    if test != ("42\n", ""):
        return answer([f"a test call gave {test}", ""])
    readable = call("import sys\n__import__(next(name for name in ('colorsys', 'tabnanny', 'netrc', 'wave') "
                    "if name not in sys.modules))") == ("", "")  # a small module not imported yet
    answer(["", "" if readable else f"the sandbox's user cannot read the Python installation ({sys.prefix}): a tool "
                                    "call can import only the sandbox's modules and what they import at start"])
    for line in channel_in:  # until the trainer closes the pipe
        call(json.loads(line), reply=answer)


def _remove(folder):
    """Remove a folder whatever the code left in it (a tree too deep for shutil.rmtree's recursion, no permissions)."""
    try:
        shutil.rmtree(folder)
    except Exception:  # noqa: BLE001
        subprocess.run(["rm", "-rf", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _clean(text):
    """A string the tokenizer can take: a lone surrogate (print('\ud800')) becomes its escape."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _run_code(code, max_chars, timeout, folder):
    """One call, in a sandbox process: (output, error line or ""). The code runs in a child forked for this call, as a
    script in an empty folder; past `timeout` seconds the child is killed."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _child(code, max_chars, folder, write_end, parent, timeout)
        finally:
            os._exit(0)
    os.close(write_end)
    result, deadline, timed_out = b"", time.monotonic() + timeout, False
    while len(result) < 16 * max_chars + 1024:  # the child's answer is ~2 * max_chars; a flood is cut
        timed_out = not select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))[0]
        chunk = b"" if timed_out else os.read(read_end, 65536)
        if not chunk:
            break
        result += chunk
    os.kill(pid, signal.SIGKILL)  # it has answered, closed its pipe, or run out of time: nothing of it may stay
    _, status = os.waitpid(pid, 0)
    os.close(read_end)
    if timed_out:
        return "", f"TimeoutError: the code ran for more than {timeout:g} s and was stopped"
    try:
        output, error = json.loads(result)
        return _clean(output)[:max_chars + 1], _clean(error)[:max_chars]
    except Exception:  # noqa: BLE001 - no answer: the child died (a segfault, memory exhausted in C code), or junk
        code = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}"
        return "", f"the code ended without a result ({code})"


def _child(code, max_chars, folder, write_end, parent, timeout):
    """The forked child of one call: as root it becomes nobody (it can then signal no root process, its sandbox
    process among them), it dies with its sandbox process, keeps no file of it but its result pipe, starts no process
    or thread, has timeout + 2 s of CPU, runs the code with its output capped, and writes (output, error) as JSON to
    write_end."""
    if os.getuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    with contextlib.suppress(Exception):  # Linux, after setuid (which clears it): killed if its sandbox process dies
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return
    os.closerange(3, write_end)  # the sandbox process's channel among them: the code cannot answer in its place
    os.closerange(write_end + 1, 65536)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # fork and threads fail: no fork bomb, no orphans
    cpu = int(timeout) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # a child that escaped its sandbox process still stops
    stdout, error = _CappedText(max_chars), ""
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the call ends with an error
        error = traceback.format_exception_only(type(e), e)[-1].strip()
    data = json.dumps([stdout.getvalue(), error[:max_chars]]).encode()  # its sandbox process cleans what it reads
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(write_end, data):]


def _parse_answer(line):
    """(output, error) from a sandbox process's answer line; None for no line (it died or stopped) or junk."""
    try:
        output, error = json.loads(line)
        return str(output), str(error)
    except Exception:  # noqa: BLE001
        return None


class PythonSandbox:
    """Run model-written code in sandbox processes, many calls at once, each call in a fresh child:

        with PythonSandbox(num_workers=2, timeout=5.0) as sandbox:
            results = sandbox.run(["print(6 * 7)", "while True: pass"])   # [("42\\n", ""), ("", "TimeoutError: ...")]
    """

    def __init__(self, num_workers=1, timeout=5.0, memory_mb=512, file_mb=1, max_output_chars=512, modules=()):
        self.timeout = timeout
        self.config = json.dumps([list(modules), memory_mb * 2**20, file_mb * 2**20, max_output_chars, timeout])
        self.folder = tempfile.mkdtemp(prefix="tinyrl-sandbox-")  # each process's folder is made in it
        os.chmod(self.folder, 0o711)  # a process that became nobody can reach its own folder, not list the others
        self.processes = [self._start() for _ in range(max(1, num_workers))]
        for process in self.processes:
            self._ready(process)

    def _start(self):
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from utils.tools import _serve; "
                "_serve(sys.argv[2], *json.loads(sys.argv[3]))")
        return subprocess.Popen([sys.executable, "-c", code, ROOT, self.folder, self.config], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)

    def _ready(self, process):
        """Wait for a new sandbox process's first answer (["", warning] once its limits hold); keep its warning."""
        line = process.stdout.readline() if select.select([process.stdout], [], [], 60)[0] else b""
        why, self.warning = _parse_answer(line) or (
            "it ended before it was ready" if process.poll() is not None else "it did not start within 60 s", "")
        if why:
            self.close()
            raise RuntimeError(f"the Python sandbox could not start: {why}")

    def run(self, codes):
        """[(output, error)] of each code, in order, the calls spread over the processes; error is "" on success."""
        results = [("", f"the code is over {MAX_CODE_CHARS} characters and was not run") if len(code) > MAX_CODE_CHARS
                   else None for code in codes]  # a longer one could fill a pipe to a stopped process
        todo = [i for i in reversed(range(len(codes))) if results[i] is None]
        busy = {}  # a process's index -> (its call's index, the backstop deadline)
        while todo or busy:
            for k in range(len(self.processes)):
                if k not in busy and todo:
                    # a backstop: each call times itself; the slack covers removing the folders of the call before
                    busy[k] = (todo.pop(), time.monotonic() + self.timeout + 10)
                    with contextlib.suppress(OSError):  # a process that died answers nothing, and is replaced below
                        self.processes[k].stdin.write(json.dumps(codes[busy[k][0]]).encode() + b"\n")
                        self.processes[k].stdin.flush()
            wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            readable = select.select([self.processes[k].stdout for k in busy], [], [], wait)[0]
            for k, (call, deadline) in list(busy.items()):
                stdout = self.processes[k].stdout  # asked again: a replacement just now may have taken a while
                line = stdout.readline() if stdout in readable or select.select([stdout], [], [], 0)[0] else None
                if line is None and time.monotonic() < deadline:
                    continue  # still running
                results[call] = _parse_answer(line)
                if results[call] is None:  # it died (its child may kill it), stopped answering, or wrote junk
                    results[call] = ("", "the sandbox process died or stopped answering; it was replaced")
                    self._stop(self.processes[k])
                    self.processes[k] = self._start()
                    self._ready(self.processes[k])
                del busy[k]
        return results

    @staticmethod
    def _stop(process):
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # its group: itself and a running child (which also has PDEATHSIG)
        process.wait()
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()

    def close(self):
        for process in self.processes:
            self._stop(process)
        _remove(self.folder)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
