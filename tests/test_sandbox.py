"""plumbing/tools.py's sandbox as a tool: hostile code costs its call an error line and the run nothing, honest code
runs (preloaded and lazily imported modules, files in its own folder), a call's changes never reach the next call, the
start-up warning says what the machine lacks, and the sandbox keeps working without each mechanism. The attacks on
one call's world from another call are in test_sandbox_attacks.py."""

import os
import subprocess
import sys

import pytest

from plumbing.tools import LACKS, PythonSandbox, _view_plan, check_python_outside_tmp, python_installation

HOSTILE = {  # each costs its call an error message, and the run nothing
    "infinite loop": ("while True:\n    pass", "TimeoutError"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "BlockingIOError"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", "BlockingIOError"),
    "memory bomb": ("x = bytearray(8 * 2**30)", "MemoryError"),
    "huge print": ("print('x' * 10**7)", ""),  # capped, not an error
    "print loop": ("while True:\n    print('x' * 1000)", "TimeoutError"),
    "big file": ("open('f', 'w').write('x' * 3 * 2**20)", "File too large"),
    "C-level hang": ("import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')", "TimeoutError"),  # no signal stops it
    "exit": ("raise SystemExit(3)", "SystemExit: 3"),
    "segfault": ("import ctypes\nctypes.string_at(0)", "without a result (signal 11)"),
    "every pipe": ("import os\nfor fd in range(1024):\n    try:\n        os.write(fd, b'junk')\n    except OSError:\n"
                   "        pass", "without a result"),  # only its own result pipe gets the junk
    # its sandbox process is outside its PID namespace: getppid() is 0, and kill(0, ...) reaches the call alone, the
    # first process of its namespace, which takes no signal from inside it
    "kill the sandbox": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')", ""),
    "stop the sandbox": ("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nprint('alive')", ""),
    "outlive the sandbox": ("import ctypes, os, signal\nctypes.CDLL(None).prctl(1, 0)\n"  # no parent-death signal
                            "os.kill(os.getppid(), signal.SIGKILL)\nwhile True:\n    pass", "TimeoutError"),
    "lone surrogate": ("print('\\ud800')", ""),  # escaped: the tokenizer would raise on it
    "terminal escape": ("print('\\x1b[2J\\x1b]0;title\\x07\\r')", ""),  # escaped: the console log shows it as text
    "deep folders": ("import os\nwhile True:\n    os.mkdir('d')\n    os.chdir('d')", "No space left on device"),
    "huge code": ("#" * 60_000, "over 50000 characters"),
    "syntax": ("print(1", "SyntaxError"),
}


def test_the_sandbox_survives_hostile_code(tmp_path):
    with PythonSandbox(num_workers=1) as sandbox:
        lacks = sandbox.lacks
    hostile = dict(HOSTILE)
    if "view" in lacks:  # a tree in a folder of the machine's: it grows until its time is up
        hostile["deep folders"] = (hostile["deep folders"][0], "TimeoutError")
    if "pid" in lacks:  # its sandbox process is its parent, another user's (root) or its own user's (killed)
        expected = "PermissionError" if os.getuid() == 0 else "died or stopped answering"
        for name in ("kill the sandbox", "stop the sandbox", "outlive the sandbox"):
            hostile[name] = (hostile[name][0], expected)
    before = set(os.listdir(tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a relative write must not land in the trainer's folder
    try:
        with PythonSandbox(num_workers=2, timeout=1.0, max_output_chars=100) as sandbox:
            results = sandbox.run([code for code, _ in hostile.values()] + ["open('g', 'w').write('x')\nprint(6 * 7)"])
            for (name, (_, expected)), (output, error) in zip(hostile.items(), results):
                assert expected in error if expected else not error, (name, output, error)
            assert results[4][0] == "x" * 101  # the huge print: capped at max_output_chars (+1 to show the cut)
            assert "pid" in lacks or results[list(HOSTILE).index("kill the sandbox")] == ("alive\n", "")
            assert results[list(HOSTILE).index("lone surrogate")][0] == "\\ud800\n"
            assert results[list(HOSTILE).index("terminal escape")][0] == "\\x1b[2J\\x1b]0;title\\x07\\x0d\n"
            "".join(text for result in results for text in result).encode()  # valid UTF-8 throughout (or it raises)
            assert results[-1] == ("42\n", "")  # writing a small file in its own folder works
            assert sandbox.run(["import os\nprint(os.listdir('.'))"]) == [("[]\n", "")]  # a fresh folder per call
            assert sandbox.run(["print(sum(range(10)))"] * 8) == [("45\n", "")] * 8  # nothing of the above stays
    finally:
        os.chdir(cwd)
    assert not os.path.exists(sandbox.folder)
    assert set(os.listdir(tmp_path)) == before
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    assert len(children) <= 2, children  # no orphans of the fork bomb (the reward/forkserver helpers at most)


def test_a_call_cannot_change_what_the_next_call_sees():
    """Each call runs in a child forked for it: one completion's code that replaces print, lowers the recursion limit
    or changes a module leaves the next call on the same process as it was."""
    tamper = ["import builtins\nbuiltins.print = lambda *a, **k: None", "import sys\nsys.setrecursionlimit(40)",
              "import math\nmath.pi = 3"]
    with PythonSandbox(num_workers=1, timeout=5.0) as sandbox:
        assert sandbox.run(tamper) == [("", "")] * 3
        check = "import math\ndef f(n):\n    return n and f(n - 1)\nprint(f(100), math.pi)"
        assert sandbox.run([check]) == [("0 3.141592653589793\n", "")]


def test_the_sandbox_imports_its_modules_before_a_call_starts():
    """The modules imported at start are importable in every call, for free; a module that cannot be imported stops
    the start. A module not imported at start is imported from the Python installation, which is in the call's view
    (the warning says so where the call's user cannot read it)."""
    with PythonSandbox(num_workers=1, modules=("fractions", "sympy")) as sandbox:
        assert sandbox.run(["import fractions, sympy\nprint(fractions.Fraction(2, 6), sympy.factorint(12))"]) == [
            ("1/3 {2: 2, 3: 1}\n", "")]
        unreadable = sandbox.run(["import tabnanny"])[0][1] != ""  # a module it did not import at start
        assert ("cannot read the Python installation" in sandbox.warning) == unreadable, sandbox.warning
    with pytest.raises(RuntimeError, match="could not start: ModuleNotFoundError"):
        PythonSandbox(num_workers=1, modules=("no_such_module",))


def test_honest_code_runs_as_before():
    """What a math tool does works: numbers, stdlib modules loaded at start or lazily, numpy and sympy, files in its
    own folder, /tmp and /dev/shm, sleeping, randomness, the time."""
    codes = ["import numpy as np\nprint(np.arange(6).reshape(2, 3).sum(axis=0).tolist())",
             "import numpy.random\nprint(numpy.random.default_rng(0).integers(10, size=3).tolist())",  # lazily loaded
             "import sympy\nx = sympy.symbols('x')\nprint(sympy.solve(x**2 - 4, x))",
             "import colorsys, decimal, statistics\nprint(colorsys.rgb_to_hsv(1, 0, 0), decimal.Decimal(1) / 8, "
             "statistics.median([3, 1, 2]))",
             "open('a.txt', 'w').write('hi')\nimport os, tempfile\nwith tempfile.NamedTemporaryFile() as f:\n"
             "    pass\nopen('/dev/shm/b', 'w').write('x')\nprint(open('a.txt').read(), sorted(os.listdir('.')))",
             "import time, random, datetime\ntime.sleep(0.2)\nrandom.random()\n"
             "print(datetime.datetime.now().year > 2000)",
             "print('é ✓ 漢字')"]
    with PythonSandbox(num_workers=2, timeout=10.0, modules=("math", "numpy", "sympy")) as sandbox:
        assert sandbox.run(codes) == [("[3, 5, 7]\n", ""), ("[8, 6, 5]\n", ""), ("[-2, 2]\n", ""),
                                      ("(0.0, 1.0, 1) 0.125 2\n", ""), ("hi ['a.txt', 'b']\n", ""),
                                      ("True\n", ""), ("é ✓ 漢字\n", "")]


def test_a_python_environment_under_tmp_is_refused_at_start():
    """Each call's /tmp is its own, so an environment there would vanish from the calls (numpy missing, the checkout
    unlisted): one line that says what to change, before any process starts."""
    check_python_outside_tmp(python_installation())  # this suite's environment is not there
    for path in ("/tmp/clone/.venv/lib/python3.11/site-packages", "/dev/shm/env/lib/python3.11", "/var/tmp/x/lib"):
        with pytest.raises(ValueError, match="create the environment outside"):
            check_python_outside_tmp({"/usr/lib/python3.11", path})


def test_the_warning_says_what_the_run_lacks():
    """Each mechanism left out (as on a machine that does not allow it) is named in the one-line warning, and the
    sandbox still runs calls; with every mechanism left out it runs as a plain child per call."""
    for name in ("net", "ipc", "seccomp", "cgroup", "pipe cap"):
        with PythonSandbox(num_workers=1, timeout=2.0, _without=(name,)) as sandbox:
            assert LACKS[name] in sandbox.warning and "\n" not in sandbox.warning
            assert sandbox.run(["print(6 * 7)"]) == [("42\n", "")]
    everything = ("user namespace", "pid", "view", "net", "ipc", "uts", "seccomp", "uid", "cgroup")
    with PythonSandbox(num_workers=2, timeout=1.0, _without=everything) as sandbox:
        assert LACKS["view"] in sandbox.warning and LACKS["pid"] in sandbox.warning
        results = sandbox.run(["print(6 * 7)", "import os\nprint(os.listdir('.'))", "while True:\n    pass",
                               "import os\nos.fork()"])
        assert results[:2] == [("42\n", ""), ("[]\n", "")] and "TimeoutError" in results[2][1]
        assert "BlockingIOError" in results[3][1]
    with PythonSandbox(num_workers=1) as sandbox:  # this machine's whole set: said once, in one line
        assert "\n" not in sandbox.warning


def test_a_folder_hidden_inside_a_system_folder_is_empty_in_the_view(monkeypatch):
    """The trainer's folder, the checkout and $HOME stay out of a call's view even where they lie inside a folder the
    view shows (a checkout under /usr/src, a trainer started in /usr/share)."""
    plan = _view_plan(["/usr/share/doc", "/nonexistent/checkout"])
    assert ("hide", "/usr/share/doc") in plan and ("bind", "/usr") in plan
    assert not any(path.startswith("/nonexistent") for _, path in plan)
    monkeypatch.chdir("/usr/share/doc")
    with PythonSandbox(num_workers=1) as sandbox:
        if "view" in sandbox.lacks:
            pytest.skip(f"this machine lacks {LACKS['view']}")
        assert os.listdir("/usr/share/doc")
        assert sandbox.run(["import os\nprint(os.listdir('/usr/share/doc'), len(os.listdir('/usr/share')) > 1)"]) == [
            ("[] True\n", "")]


def test_a_call_writes_only_its_own_tmp():
    """A call's writable space is its private /tmp (also /dev/shm, /var/tmp, /run/lock, its working folder): the
    system folders, the view's root and the Python installation are read-only."""
    code = ("import os, sys\nfor path in ('/usr/x', '/bin/x', '/x', '/dev/x', sys.prefix + '/x', os.__file__):\n"
            "    try:\n        open(path, 'a').close()\n        print('wrote', path)\n"
            "    except OSError:\n        pass\n"
            "for path in ('/tmp/a', '/dev/shm/b', '/var/tmp/c', '/run/lock/d', 'e'):\n    open(path, 'w').close()\n"
            "print(sorted(os.listdir('/tmp')), os.getcwd())")
    with PythonSandbox(num_workers=1) as sandbox:
        if "view" in sandbox.lacks:
            pytest.skip(f"this machine lacks {LACKS['view']}")
        assert sandbox.run([code]) == [("['a', 'b', 'c', 'd', 'e'] /tmp\n", "")]


def test_a_call_is_timed_by_its_cpu_not_by_a_loaded_machine():
    """A call is limited by the CPU it uses, not by the wall clock (which on a machine whose cores are busy would cut
    an honest call waiting for one): ceil(timeout) seconds of CPU. Here 0.6 s of CPU work while a busy process shares
    its one core (both pinned to it) ends with its answer, an endless loop is stopped for its CPU, and code that only
    waits is stopped by the wall-clock bound (3 timeout + 5 s)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs CPU affinity")
    work = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\nprint('done')")
    own = os.sched_getaffinity(0)
    core = min(own)
    burners = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n"
                                 "    pass"]) for _ in range(2)]  # two busy processes: this call gets a third of it
    try:
        os.sched_setaffinity(0, {core})  # the sandbox processes and their calls inherit the one busy core
        try:
            with PythonSandbox(num_workers=1, timeout=1.0) as sandbox:
                results = sandbox.run([work, "while True:\n    pass", "import time\ntime.sleep(60)"])
        finally:
            os.sched_setaffinity(0, own)
    finally:
        for burner in burners:
            burner.kill()
    assert results[0] == ("done\n", ""), results[0]  # 0.6 s of CPU, some 2 s of wall clock
    assert "TimeoutError" in results[1][1] and "of CPU" in results[1][1], results[1]
    assert "waited for more than 8 s" in results[2][1], results[2]


def test_a_call_that_trickles_into_its_pipe_costs_the_trainer_nothing():
    """The trainer reads a call's pipe once (an honest answer is whole) and else waits for the call's end: a call
    that writes its pipe a byte at a time, or floods it, wakes the trainer twice, not once a byte. An answer larger
    than the pipe is cut to fit it (the child never waits on the trainer)."""
    import resource

    trickle = ("import os\nfor fd in range(3, 64):\n    try:\n        os.fstat(fd)\n        break\n"  # its pipe
               "    except OSError:\n        pass\nwhile True:\n    os.write(fd, b'x')\n")
    with PythonSandbox(num_workers=2, timeout=2.0) as sandbox:
        start = resource.getrusage(resource.RUSAGE_SELF)
        results = sandbox.run([trickle, trickle.replace("b'x'", "b'x' * 65536")])
        end = resource.getrusage(resource.RUSAGE_SELF)
    assert all("TimeoutError" in error for _, error in results), results
    assert end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime < 0.5
    with PythonSandbox(num_workers=1, max_output_chars=200_000) as sandbox:
        (output, error), = sandbox.run(["print('é' * 300_000)"])
    assert not error and 10_000 < len(output) <= 200_001 and set(output) == {"é"}, (len(output), error)


LINEAR_ALGEBRA = """import threading, time
import numpy as np
start = time.process_time()
rng = np.random.default_rng(0)
a, b = np.eye(200) + rng.random((200, 200)) / 200, rng.random(200)  # well conditioned, det of a few units
x = np.linalg.solve(a, b)
eigenvalues = np.linalg.eigvals(a)
det = np.linalg.det(a)
m = rng.random((1000, 1000))
product = m @ m
used = time.process_time() - start
try:  # BLAS runs in the calling thread: the call still gets no second one
    threading.Thread(target=print).start()
    thread = 'started'
except RuntimeError:
    thread = 'refused'
print(np.allclose(a @ x, b), np.isclose(np.prod(eigenvalues).real, det, rtol=1e-8),
      np.isclose(product[3, 5], m[3] @ m[:, 5]), used < 4, thread)"""


@pytest.mark.parametrize("modules", [("math", "fractions", "statistics"), ("numpy", "sympy")])
def test_numpy_linear_algebra_runs_within_the_cpu_limit(modules):
    """numpy imported by the call (grpo_tools.py's default modules) or preloaded with sympy (the documented setup for
    math tools): a 200 x 200 solve, det and eigenvalues and a 1000 x 1000 matmul give the right numbers within the
    call's CPU limit, in the calling thread (OpenBLAS could start no thread of its own in a call, and one made before
    the fork is not in the child: without one thread set at start the import fails and a large solve hangs)."""
    with PythonSandbox(num_workers=1, timeout=5.0, modules=modules) as sandbox:
        assert sandbox.run([LINEAR_ALGEBRA]) == [("True True True True refused\n", "")]


def test_what_math_tool_code_imports_runs():
    """sympy, mpmath and the standard library a tool call uses, each lazily imported with grpo_tools.py's default
    modules: algebra, calculus, number theory, high precision, exact fractions, combinatorics, asyncio (a socket pair),
    and sqlite3 on a file in /tmp (SQLite locks with a folder beside the file: fcntl locks are refused)."""
    codes = {
        "sympy": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), "
                 "sp.integrate(sp.sin(x)**2, (x, 0, sp.pi)), sp.factorint(2**32 + 1), "
                 "sp.Matrix([[1, 2], [3, 4]]).det(), sp.series(sp.exp(x), x, 0, 3), sp.nsimplify(0.125), "
                 "sp.isprime(2**31 - 1))",
        "mpmath": "import mpmath\nmpmath.mp.dps = 30\nprint(mpmath.mp.pi, "
                  "mpmath.almosteq(mpmath.quad(mpmath.exp, [0, 1]), mpmath.e - 1), "
                  "mpmath.findroot(lambda t: t**2 - 2, 1))",
        "standard library": "import bisect, cmath, collections, decimal, fractions, functools, heapq, itertools, json, "
                            "math, random, re, statistics, string\n"
                            "print(fractions.Fraction(3, 4) + fractions.Fraction(1, 6), math.comb(30, 15), "
                            "len(list(itertools.permutations(range(6)))), functools.reduce(math.lcm, range(1, 21)), "
                            "collections.Counter('mississippi').most_common(1), heapq.nsmallest(2, [5, 1, 4]), "
                            "bisect.bisect([1, 3, 5], 4), cmath.sqrt(-4), decimal.Decimal(1) / decimal.Decimal(7), "
                            "statistics.mean([1, 2, 4]), re.findall(r'\\d+', 'a1b22'), json.dumps({'k': [1]}), "
                            "random.Random(0).randint(1, 6), string.ascii_lowercase[:3])",
        "asyncio": "import asyncio\nasync def main():\n    await asyncio.sleep(0.01)\n    return 7\n"
                   "print(asyncio.run(main()))",
        "sqlite3": "import sqlite3\ndb = sqlite3.connect('/tmp/t.db')\ndb.execute('create table t (n integer)')\n"
                   "db.executemany('insert into t values (?)', [(i,) for i in range(100)])\ndb.commit()\n"
                   "print(sqlite3.connect('t.db').execute('select sum(n) from t').fetchone())",
    }
    expected = {
        "sympy": "[2, 3] pi/2 {641: 1, 6700417: 1} -2 1 + x + x**2/2 + O(x**3) 1/8 True\n",
        "mpmath": "3.14159265358979323846264338328 True 1.41421356237309504880168872421\n",
        "standard library": "11/12 155117520 720 232792560 [('i', 4)] [1, 4] 2 2j 0.1428571428571428571428571429 "
                            "2.3333333333333335 ['1', '22'] {\"k\": [1]} 4 abc\n",
        "asyncio": "7\n",
        "sqlite3": "(4950,)\n",
    }
    with PythonSandbox(num_workers=2, timeout=5.0, modules=("math", "fractions", "statistics")) as sandbox:
        results = dict(zip(codes, sandbox.run(list(codes.values()))))
    assert results == {name: (text, "") for name, text in expected.items()}, results


def test_an_sqlite_error_says_why_where_sqlite_keeps_its_file_locks():
    """Where the sandbox cannot give SQLite its dot-file locks (sqlite3 linked without its functions), a database in a
    file fails on the refused fcntl locks: the error line the model reads says why, in one line; other errors and
    SQLite's own where the locks were changed are left as they are."""
    import sqlite3

    from plumbing.tools import _error_line

    refused = sqlite3.OperationalError("access permission denied")
    assert _error_line(refused, sqlite_locks=False) == (
        "sqlite3.OperationalError: access permission denied (the sandbox refuses file locks, which SQLite takes on a "
        "file: use sqlite3.connect(':memory:'))")
    assert _error_line(refused) == "sqlite3.OperationalError: access permission denied"
    assert _error_line(ValueError("x"), sqlite_locks=False) == "ValueError: x"
