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

Model output is untrusted input, so the code never runs in the trainer. It runs in `num_workers` warm sandbox
processes (pebble's ProcessPool, forked from a fork server like the reward workers), each with: an address-space limit,
no child processes (RLIMIT_NPROC 0; a root trainer's workers first drop to the unprivileged user `nobody`, since root
ignores that limit), a file-size limit, stdout/stderr of the process sent to /dev/null, and a fresh empty working
directory for every call, deleted afterwards. A call that runs past `timeout` seconds has its process killed and
replaced (the only bound that also stops C code: a regex backtracking, a huge integer power); a process that dies
costs only its call. Every failure becomes the call's output, an error message the model reads, and never stops the
run. What this is not: a security boundary against a deliberate attacker (the code can read files the user can, and
open network connections); for that, run the code in a container or a VM (e.g. nsjail, gVisor, E2B).
"""

import contextlib
import io
import multiprocessing
import os
import resource
import shutil
import tempfile
import traceback

from utils.rewards import limit_process

TOOL_STOP = "\n```\n"  # a fence alone on its line: the end of a code block, where generation stops
CODE_FENCE = "```python"
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


_SANDBOX = {}  # a sandbox process's state, set once by _start_sandbox


def _start_sandbox(parent, memory_bytes, file_bytes):
    """Each sandbox process's initializer: its own folder, no output to the terminal, the limits, then (if root) the
    user nobody. A failure is kept and reported by every call: the pool then stops the run (a sandbox without its
    limits must not run code)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # C-level writes to fds 1 and 2 (os.write, a crashing extension) go nowhere
        os.dup2(devnull, 2)
        root = tempfile.mkdtemp(dir=parent)
        if os.getuid() == 0:
            os.chown(root, NOBODY, NOBODY)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        limit_process(memory_bytes, file_bytes)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # fork and threads fail: no fork bomb, no orphans
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _SANDBOX["root"] = root
    except BaseException as e:  # noqa: BLE001 - e.g. setuid refused in a restricted container
        _SANDBOX["failed"] = f"{type(e).__name__}: {e}"


def _run_code(code, max_chars):
    """One call, in a sandbox process: (output, error line or ""), the code run as a script in an empty folder."""
    if "failed" in _SANDBOX:
        return "", f"startup: {_SANDBOX['failed']}"
    folder = tempfile.mkdtemp(dir=_SANDBOX["root"])
    stdout = _CappedText(max_chars)
    error = ""
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the call ends, the process stays
        error = traceback.format_exception_only(type(e), e)[-1].strip()
    finally:
        with contextlib.suppress(OSError):
            os.chdir(_SANDBOX["root"])
            shutil.rmtree(folder, ignore_errors=True)
    return stdout.getvalue(), error[:max_chars]


class PythonSandbox:
    """Run model-written code in warm sandbox processes, many calls at once:

        with PythonSandbox(num_workers=2, timeout=5.0) as sandbox:
            results = sandbox.run(["print(6 * 7)", "while True: pass"])   # [("42\\n", ""), ("", "TimeoutError: ...")]
    """

    def __init__(self, num_workers=1, timeout=5.0, memory_mb=512, file_mb=1, max_output_chars=512):
        from pebble import ProcessPool

        self.timeout, self.max_output_chars = timeout, max_output_chars
        context = multiprocessing.get_context("forkserver")  # never forked from a large trainer process
        context.set_forkserver_preload(["utils.tools"])
        self.folder = tempfile.mkdtemp(prefix="tinyrl-sandbox-")  # each process's folder is made in it
        os.chmod(self.folder, 0o711)  # a process that became nobody can reach its own folder, not list the others
        self.pool = ProcessPool(max(1, num_workers), initializer=_start_sandbox, context=context,
                                initargs=(self.folder, memory_mb * 2**20, file_mb * 2**20))

    def run(self, codes):
        """[(output, error)] of each code, in order, the calls spread over the processes; error is "" on success."""
        from pebble import ProcessExpired

        futures = [self.pool.schedule(_run_code, (code, self.max_output_chars), timeout=self.timeout)
                   for code in codes]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except TimeoutError:  # pebble killed the process and started another
                results.append(("", f"TimeoutError: the code ran for more than {self.timeout:g} s and was stopped"))
            except ProcessExpired as e:  # the process died: a memory limit hit in C code, a segfault
                results.append(("", f"the interpreter died (exit code {e.exitcode})"))
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result: the call fails, never the run
                results.append(("", f"{type(e).__name__}: {e}"[:self.max_output_chars]))
        for _, error in results:
            if error.startswith("startup: "):
                raise RuntimeError(f"the Python sandbox could not start with its limits ({error[9:]})")
        return results

    def close(self):
        self.pool.stop()
        self.pool.join()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
