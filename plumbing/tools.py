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

Model output is untrusted input, and under RL the policy finds whatever route a sandbox leaves open; some pay (a call
that kills or freezes its group-mates' calls raises its own advantage). So each call runs in a world of its own, made
of Linux's mechanisms (docs/sandbox.md states each guarantee and what it rests on):

- `num_workers` sandbox processes: fresh interpreters started isolated (python -I: no current folder or user site on
  sys.path, PYTHON* variables ignored; an environment of THREADS alone: one BLAS and OpenMP thread), never forks of
  the trainer, so they hold none of its data or secrets. Each imports `modules` and sqlite3 (its locks: a folder
  beside the database, since fcntl's are refused) and builds the calls' view once, then only forks: a call's code
  reaches its child in a memfd and the answer goes to the trainer through a pipe, neither read by the sandbox
  process, so no child holds another call's data.
- A call's child is the first process of fresh PID, mount, IPC, UTS and network namespaces (NETWORK): it sees no
  other process (and can signal none), no network but a loopback that is down, and a read-only view of /usr, /bin,
  /lib*, the Python installation and five devices (read-only binds: their timestamps stay the machine's), with a
  private tmpfs of TMP_MB and TMP_FILES at /tmp (/dev/shm, /var/tmp and /run/lock point to it) that the kernel frees
  with the call, whatever is in it. The checkout, the run folders, $HOME, /etc, /proc and /sys are not there.
- A root trainer's call runs as a user no other running call has (UID_BASE + its sandbox process's pid); a non-root
  trainer's calls run as its user, in a user namespace, without capabilities.
- Limits: address space, file size, no process or thread (RLIMIT_NPROC 0), MAX_OPEN_FILES, at most
  MAX_PIPES_SOCKETS pipes and sockets made (the counting filter: their inode numbers come from a machine-wide
  counter, which a call that makes many sets for a later call to read), `timeout` seconds of CPU (RLIMIT_CPU, whole
  seconds: it also stops C code, a regex backtracking, a huge integer power), and a kill past wall_limit(timeout)
  seconds for code that waits instead (a sleep, a blocking read). A call is timed by the CPU it uses, not by the
  wall clock: on a loaded machine an honest call that waits for a core is not cut.
- A system-call filter (seccomp) refuses keyrings, SysV IPC, POSIX message queues, memfds, ptrace and other
  processes' memory, new user namespaces (no capability comes back), unmount, pivot_root and chroot, sockets but
  Unix, IPv4 and IPv6 ones, and kernel interfaces no tool needs; and the kernel state calls would otherwise share:
  disk I/O a call does not wait for and page-cache eviction (AIO, io_uring, readahead, fadvise, O_DIRECT, sync), the
  machine-wide AIO quota and counters (sysinfo, socket cookies), locks, leases and notifications on the view's
  files, shared futexes, page-cache probes (RWF_NOWAIT, RWF_DONTCACHE, mincore, cachestat), socket buffers above the
  default size, IPv6 flow labels (they outlive their socket and are counted machine-wide).
- Cgroups (a root trainer): each sandbox process's calls run in a memory cgroup of their own (memory_mb, copies of
  the sandbox process's pages, the call's /tmp and its kernel memory, socket buffers included: a call past it is
  killed, a MemoryError line), and in a pids cgroup (the call alone) and a blkio cgroup (IO_READ_BPS, IO_READ_IOPS a
  disk) of their sandbox process.
- A call ends when its answer arrives: the trainer has its sandbox process kill and reap its child (its PID
  namespace's first process: the namespace dies with it) and starts no call anywhere until then.
- The answer is capped, valid UTF-8, without control characters but newline and tab; the trainer tokenizes it as
  plain text (tool_output_ids: special-token text such as <|im_end|> stays text).

Every failure becomes the call's output, an error line the model reads, and never stops the run. Where the machine
lacks a mechanism (a non-root trainer without user namespaces, a container that forbids namespaces, an architecture
without a system-call table here, no cgroups it may make), the sandbox runs without it and `PythonSandbox.warning`
says so in one line, which grpo_tools.py prints at start. What this is not: a virtual machine. The calls share the
machine's kernel (a kernel bug is a way out), read what their view holds, use CPU, memory, disk reads and time up to
their limits, and can observe timing (the CPU's load, the page cache) and the inode numbers of their pipes and sockets
(a machine-wide counter): docs/sandbox.md says what a policy could gain from these.
"""

import contextlib
import ctypes
import errno
import fcntl
import gc
import importlib.util
import io
import json
import math
import os
import platform
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from utils.rewards import default_reward_workers, limit_process

TOOL_STOP = "\n```\n"  # a fence alone on its line: the end of a code block, where generation stops
CODE_FENCE = "```python"
MAX_CODE_CHARS = 50_000  # a model turn's code is far shorter
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: the folder holding plumbing/
NOBODY = 65534  # the unprivileged user of a root trainer's calls where no user of their own can be had
TOOL_INSTRUCTION = ("Compute with Python when it helps: write a ```python block that prints what you need; it runs "
                    "when the block closes, and its output follows in an ```output block.")  # for chat models


@dataclass
class ToolArgs:
    """The sandbox's flags, the same in grpo_tools.py and empg.py: their Args hold them as `tool` (flat flags)."""
    max_tool_tokens: int = 64
    """tokens of one tool output block at most (its text is cut to fit)"""
    tool_timeout: float = 5.0
    """CPU seconds a tool call may use (code that waits instead is stopped at 3x this + 5 s of wall time); past it, the
    process running it is killed and the call gets an error"""
    tool_memory_mb: int = 512
    """address-space limit of each sandbox process, on top of what it maps at start"""
    tool_modules: tuple[str, ...] = ("math", "fractions", "statistics")
    """modules each sandbox process imports at start: free to import in a call (a call runs as an unprivileged user,
    which may not be able to read others); add numpy sympy for math tools (each call then costs more)"""


def check_tool_args(tool):
    """ToolArgs' one-line errors, before any model loads."""
    if tool.max_tool_tokens < 16 or tool.tool_timeout <= 0 or tool.tool_memory_mb < 64:
        raise ValueError("--max_tool_tokens must be >= 16, --tool_timeout > 0 and --tool_memory_mb >= 64")
    missing = [name for name in tool.tool_modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"--tool_modules: no module named {', '.join(missing)} here (install it, or leave it out)")


def open_sandbox(tool, num_workers, say):
    """The PythonSandbox of these flags with num_workers processes; say() prints what its calls' world lacks here."""
    sandbox = PythonSandbox(num_workers, tool.tool_timeout, tool.tool_memory_mb, modules=tool.tool_modules)
    if sandbox.warning:
        say(f"warning: {sandbox.warning}")
    return sandbox


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
    # plain text: special-token text a call prints ("<|im_end|>") stays text, never a control token in the context
    encode = lambda text: tokenizer(text, add_special_tokens=False,  # noqa: E731
                                    split_special_tokens=True)["input_ids"]
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


# ---- Linux mechanisms, through the C library ------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
_LOCKED_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                 (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))  # kept on a remount
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NAME = 1, 4, 15
PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 22, 24, 38
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032  # fcntl has them from Python 3.10
_LIBC = ctypes.CDLL(None, use_errno=True)


def _function(name, *argtypes):
    function = getattr(_LIBC, name)
    function.restype, function.argtypes = ctypes.c_int, argtypes
    return function


_UNSHARE = _function("unshare", ctypes.c_int)
_SETNS = _function("setns", ctypes.c_int, ctypes.c_int)
_MOUNT = _function("mount", ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_UMOUNT2 = _function("umount2", ctypes.c_char_p, ctypes.c_int)
_PRCTL = _function("prctl", ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_CAPSET = _function("capset", ctypes.c_void_p, ctypes.c_void_p)

# The system-call filter refuses (EPERM) kernel keyrings and SysV/POSIX IPC (state that could outlive a call), memfds
# (memory outside its limits), other processes' memory, mounts and namespaces other than those its sandbox process
# makes (no user namespace: a call never gets capabilities back), sockets but Unix, IPv4 and IPv6 ones (vsock and
# netlink-like families are not confined by a network namespace), and kernel interfaces no tool needs. It also
# refuses what would let a call reach the others through state the kernel shares between them (docs/sandbox.md,
# "Shared kernel state"): asynchronous and background disk I/O and page-cache eviction (AIO, io_uring, readahead,
# fadvise, O_DIRECT, sync), machine-wide quotas and counters (AIO contexts, sysinfo), file locks, leases and
# notifications on the view's files (flock, fcntl's lock commands, inotify, fanotify, dnotify), shared futexes (a
# futex without FUTEX_PRIVATE_FLAG keys on the file page, shared with every call that maps it), page-cache probes
# (mincore, cachestat, RWF_NOWAIT, RWF_DONTCACHE), madvise's advice that evicts or fills file pages, socket buffers
# beyond the machine's default size (SO_SNDBUF, SO_RCVBUF), socket cookies (SO_COOKIE, SO_NETNS_COOKIE: numbers from
# machine-wide counters) and IPv6 flow labels (IPV6_FLOWLABEL_MGR: a label lingers seconds after its socket, and the
# kernel counts them machine-wide).
_DENIED = ("keyctl", "add_key", "request_key", "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl",
           "semtimedop", "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
           "mq_timedreceive", "mq_notify", "mq_getsetattr", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
           "pidfd_open", "pidfd_getfd", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
           "fsconfig", "fsmount", "fspick", "mount_setattr", "perf_event_open", "bpf", "userfaultfd",
           "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
           "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "syslog", "vhangup", "quotactl",
           "lookup_dcookie", "name_to_handle_at", "open_by_handle_at", "fanotify_init", "personality", "memfd_create",
           "memfd_secret",
           # shared kernel state: disk I/O a call does not wait for, page-cache eviction and probes, quotas, locks
           "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents", "readahead",
           "fadvise64", "sync", "syncfs", "mincore", "cachestat", "process_madvise", "migrate_pages", "move_pages",
           "sysinfo", "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
           "fanotify_mark")
_ENOSYS = ("clone3", "openat2", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue")  # glibc falls back or
# never calls them; openat2 and the new futex calls would pass flags the filter cannot read (a struct, per waiter)
F_GETLK, F_SETLK, F_SETLKW, F_SETFL, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW = 5, 6, 7, 4, 36, 37, 38
F_SETLEASE, F_GETLEASE, F_NOTIFY = 1024, 1025, 1026
FUTEX_PRIVATE_FLAG, RWF_NOWAIT, RWF_DONTCACHE = 128, 8, 0x80
MADV_WILLNEED, MADV_REMOVE, MADV_COLD, MADV_PAGEOUT, MADV_POPULATE_READ, MADV_POPULATE_WRITE, MADV_COLLAPSE = (
    3, 9, 20, 21, 22, 23, 25)  # advice that reads file pages in the background or evicts them
SOL_SOCKET, SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE = 1, 7, 8, 32, 33
SO_COOKIE, SO_NETNS_COOKIE = 57, 71  # a socket's and its namespace's cookie: numbers from machine-wide counters
IPPROTO_IPV6, IPV6_FLOWLABEL_MGR = 41, 32  # IPv6 flow labels: they linger after their socket, in a machine-wide count
_NEW_SYSCALLS = dict(io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429,
                     fsopen=430, fsconfig=431, fsmount=432, fspick=433, pidfd_open=434, clone3=435, openat2=437,
                     pidfd_getfd=438, process_madvise=440, mount_setattr=442, memfd_secret=447, futex_waitv=449,
                     cachestat=451, futex_wake=454, futex_wait=455, futex_requeue=456)  # the same on every arch
_SYSCALLS = {  # machine: (seccomp's AUDIT_ARCH, system-call numbers, O_DIRECT)
    "x86_64": (0xC000003E, dict(
        keyctl=250, add_key=248, request_key=249, shmget=29, shmat=30, shmctl=31, shmdt=67, semget=64, semop=65,
        semctl=66, semtimedop=220, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240, mq_unlink=241,
        mq_timedsend=242, mq_timedreceive=243, mq_notify=244, mq_getsetattr=245, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, kcmp=312, unshare=272, clone=56, socket=41, socketpair=53, umount2=166,
        pivot_root=155, chroot=161, perf_event_open=298, bpf=321, userfaultfd=323, kexec_load=246,
        kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169, swapon=167,
        swapoff=168, acct=163, syslog=103, vhangup=153, quotactl=179, lookup_dcookie=212, name_to_handle_at=303,
        open_by_handle_at=304, fanotify_init=300, personality=135, memfd_create=319, io_setup=206, io_destroy=207,
        io_getevents=208, io_submit=209, io_cancel=210, io_pgetevents=333, readahead=187, fadvise64=221, sync=162,
        syncfs=306, mincore=27, migrate_pages=256, move_pages=279, sysinfo=99, flock=73, inotify_init=253,
        inotify_init1=294, inotify_add_watch=254, inotify_rm_watch=255, fanotify_mark=301, fcntl=72, open=2,
        openat=257, futex=202, madvise=28, preadv2=327, pwritev2=328, setsockopt=54, getsockopt=55, pipe=22,
        pipe2=293, accept=43, accept4=288, seccomp=317,
        **_NEW_SYSCALLS), 0o40000),
    "aarch64": (0xC00000B7, dict(
        keyctl=219, add_key=217, request_key=218, shmget=194, shmat=196, shmctl=195, shmdt=197, semget=190, semop=193,
        semctl=191, semtimedop=192, msgget=186, msgsnd=189, msgrcv=188, msgctl=187, mq_open=180, mq_unlink=181,
        mq_timedsend=182, mq_timedreceive=183, mq_notify=184, mq_getsetattr=185, ptrace=117, process_vm_readv=270,
        process_vm_writev=271, kcmp=272, unshare=97, clone=220, socket=198, socketpair=199, umount2=39,
        pivot_root=41, chroot=51, perf_event_open=241, bpf=280, userfaultfd=282, kexec_load=104, kexec_file_load=294,
        init_module=105, finit_module=273, delete_module=106, reboot=142, swapon=224, swapoff=225, acct=89,
        syslog=116, vhangup=58, quotactl=60, lookup_dcookie=18, name_to_handle_at=264, open_by_handle_at=265,
        fanotify_init=262, personality=92, memfd_create=279, io_setup=0, io_destroy=1, io_submit=2, io_cancel=3,
        io_getevents=4, io_pgetevents=292, readahead=213, fadvise64=223, sync=81, syncfs=267, mincore=232,
        migrate_pages=238, move_pages=239, sysinfo=179, flock=32, inotify_init1=26, inotify_add_watch=27,
        inotify_rm_watch=28, fanotify_mark=263, fcntl=25, openat=56, futex=98, madvise=233, preadv2=286,
        pwritev2=287, setsockopt=208, getsockopt=209, pipe2=59, accept=202, accept4=242, seccomp=277,
        **_NEW_SYSCALLS), 0o200000),
}
SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)


def _check(result, what):
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _unshare(flags):
    _check(_UNSHARE(flags), "unshare")


def _mount(source, target, fstype, flags, data=None):
    encode = lambda text: None if text is None else os.fsencode(text)  # noqa: E731
    _check(_MOUNT(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _prctl(option, arg=0, arg3=0):
    _check(_PRCTL(option, arg, arg3, 0, 0), "prctl")


def _syscall(name, *args):
    number = _SYSCALLS[platform.machine()][1][name]
    return _check(_LIBC.syscall(ctypes.c_long(number), *[a if isinstance(a, bytes) else ctypes.c_long(a)
                                                         for a in args]), name)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program():
    """The classic-BPF program of the system-call filter (see _DENIED), or None on an architecture without a table:
    a call of another architecture kills the process; on x86_64 every x32 call is refused. A test jumps to its
    label through `ja` (a 32-bit offset: the list may grow past the 255 instructions of a conditional jump)."""
    if platform.machine() not in _SYSCALLS:
        return None
    arch, nr, o_direct = _SYSCALLS[platform.machine()]
    load, ja, jeq, jge, jset, ret = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | errno.EPERM

    def when(op, k, label):  # jump to label where the test holds, else go on
        return [(op, 0, 1, k), (ja, 0, 0, label)]

    def arg(i):  # the low 32 bits of argument i (seccomp_data: nr, arch, ip, then 8 bytes an argument)
        return (load, 0, 0, 16 + 8 * i)

    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x80000000), (load, 0, 0, 0)]  # wrong arch: kill
    checked = {  # system calls allowed or refused by an argument: their label (the section below)
        "futex": "futex", "fcntl": "fcntl", "openat": "openat", "open": "open", "madvise": "madvise",
        "preadv2": "nowait", "pwritev2": "nowait", "setsockopt": "setsockopt", "getsockopt": "getsockopt",
        "unshare": "no user namespace", "clone": "no user namespace", "socket": "socket", "socketpair": "socket"}
    for name, label in checked.items():
        if name in nr:
            program += when(jeq, nr[name], label)
    if platform.machine() == "x86_64":
        program += when(jge, 0x40000000, "deny")
    program += [step for name in _DENIED if name in nr for step in when(jeq, nr[name], "deny")]
    program += [step for name in _ENOSYS if name in nr for step in when(jeq, nr[name], "enosys")]
    program.append((ret, 0, 0, allow))
    sections = {
        # a futex without FUTEX_PRIVATE_FLAG is keyed on the page it lies in, a file's page for every process that
        # maps the file: shared with the other calls through the view (glibc uses private ones for its own locks)
        "futex": [arg(1), *when(jset, FUTEX_PRIVATE_FLAG, "allow"), (ret, 0, 0, eperm)],
        "fcntl": [arg(1), *[step for cmd in (F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW,
                                             F_SETLEASE, F_GETLEASE, F_NOTIFY) for step in when(jeq, cmd, "deny")],
                  *when(jeq, F_SETFL, "direct 2"), (ret, 0, 0, allow)],
        "openat": [(ja, 0, 0, "direct 2")],
        "open": [(ja, 0, 0, "direct 1")],
        "direct 1": [arg(1), *when(jset, o_direct, "deny"), (ret, 0, 0, allow)],  # O_DIRECT: reads the disk
        "direct 2": [arg(2), *when(jset, o_direct, "deny"), (ret, 0, 0, allow)],  # each time, past the page cache
        "madvise": [arg(2), *[step for advice in (MADV_WILLNEED, MADV_REMOVE, MADV_COLD, MADV_PAGEOUT,
                                                  MADV_POPULATE_READ, MADV_POPULATE_WRITE, MADV_COLLAPSE)
                              for step in when(jeq, advice, "deny")], (ret, 0, 0, allow)],
        # page-cache probes: a read that fails where the page is not cached, or one that leaves it uncached (so that
        # a page carries a bit to every later reader, not to the first)
        "nowait": [arg(5), *when(jset, RWF_NOWAIT | RWF_DONTCACHE, "deny"), (ret, 0, 0, allow)],
        "setsockopt": [arg(1), *when(jeq, SOL_SOCKET, "buffer"), *when(jeq, IPPROTO_IPV6, "flow label"),
                       (ret, 0, 0, allow)],
        "flow label": [arg(2), *when(jeq, IPV6_FLOWLABEL_MGR, "deny"), (ret, 0, 0, allow)],
        "getsockopt": [arg(1), *when(jeq, SOL_SOCKET, "cookie"), (ret, 0, 0, allow)],
        "cookie": [arg(2), *when(jeq, SO_COOKIE, "deny"), *when(jeq, SO_NETNS_COOKIE, "deny"), (ret, 0, 0, allow)],
        "buffer": [arg(2), *[step for name in (SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE)
                             for step in when(jeq, name, "deny")], (ret, 0, 0, allow)],
        "no user namespace": [arg(0), *when(jset, CLONE_NEWUSER, "deny"), (ret, 0, 0, allow)],  # flags: first arg
        "socket": [arg(0), *[step for family in SOCKET_FAMILIES for step in when(jeq, family, "allow")],
                   (ret, 0, 0, 0x00050000 | errno.EAFNOSUPPORT)],
        "allow": [(ret, 0, 0, allow)], "deny": [(ret, 0, 0, eperm)],
        "enosys": [(ret, 0, 0, 0x00050000 | errno.ENOSYS)],  # clone3: ENOSYS makes glibc use clone
    }
    labels = {}
    for label, steps in sections.items():
        labels[label] = len(program)
        program += steps
    program = [(op, jt, jf, labels[k] - i - 1 if isinstance(k, str) else k) for i, (op, jt, jf, k) in
               enumerate(program)]
    instructions = (_SockFilter * len(program))(*[_SockFilter(*i) for i in program])
    return _SockFprog(len(program), ctypes.cast(instructions, ctypes.POINTER(_SockFilter))), instructions


# Pipes and sockets take their inode numbers from a counter the machine shares (get_next_ino, per CPU): a call that
# makes many moves it to a value a later call reads (docs/sandbox.md). A second filter, installed in the sandbox
# process once it needs no more pipes or sockets of its own, hands each system call that makes one to the sandbox
# process (seccomp user notification), which counts them and lets the call go on (CONTINUE) up to MAX_PIPES_SOCKETS a
# call, and stops the call past it. A call that makes none costs nothing: the kernel allows every other system call
# without running this filter (its verdict depends on the number alone).
MAX_PIPES_SOCKETS = 256  # pipes and sockets (inode numbers) a call may make; tool code makes a few (asyncio: 2)
_COUNTED = ("pipe", "pipe2", "socket", "socketpair", "accept", "accept4")
SECCOMP_RET_USER_NOTIF, SECCOMP_FILTER_FLAG_NEW_LISTENER, SECCOMP_USER_NOTIF_FLAG_CONTINUE = 0x7FC00000, 8, 1
SECCOMP_IOCTL_NOTIF_RECV, SECCOMP_IOCTL_NOTIF_SEND = 0xC0502100, 0xC0182101  # struct seccomp_notif: 80 bytes


def _counting_program():
    """The classic-BPF program of the counting filter: a system call of _COUNTED goes to the listener, every other
    one (and every call of another architecture, which the first filter refuses or kills) is allowed."""
    arch, nr, _ = _SYSCALLS[platform.machine()]
    counted = [nr[name] for name in _COUNTED if name in nr]
    program = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, 0x7FFF0000), (0x20, 0, 0, 0)]
    program += [(0x15, len(counted) - i, 0, number) for i, number in enumerate(counted)]
    program += [(0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, SECCOMP_RET_USER_NOTIF)]
    instructions = (_SockFilter * len(program))(*[_SockFilter(*i) for i in program])
    return _SockFprog(len(program), ctypes.cast(instructions, ctypes.POINTER(_SockFilter))), instructions


class _Counter:
    """The sandbox process's side of the counting filter: `fd` is its listener; answer() takes one notification,
    counts it against the current call and lets the system call run, or returns True where the call is now past
    MAX_PIPES_SOCKETS: then it leaves it waiting, and its sandbox process kills it (an error the code could catch
    would leave its answer to say something else)."""

    def __init__(self):
        program = _counting_program()
        self.fd = _syscall("seccomp", 1, SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.addressof(program[0]))
        self.made = 0
        self.socketpair = _SYSCALLS[platform.machine()][1]["socketpair"]

    def answer(self):
        notice = bytearray(80)  # the kernel wants it zeroed
        try:
            fcntl.ioctl(self.fd, SECCOMP_IOCTL_NOTIF_RECV, notice)
        except OSError:  # the caller died meanwhile
            return False
        number = int.from_bytes(notice[16:20], "little")
        self.made += 2 if number == self.socketpair else 1
        if self.made > MAX_PIPES_SOCKETS:
            return True
        reply = notice[:8] + struct.pack("=qiI", 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)  # seccomp_notif_resp: its
        try:  # id, a value and an error (unused), CONTINUE: the system call runs as made
            fcntl.ioctl(self.fd, SECCOMP_IOCTL_NOTIF_SEND, reply)
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: the caller died meanwhile
                raise
        return False


def _counting_works():
    """Whether the kernel has the counting filter (user notification with CONTINUE: Linux 5.5): a child installs it
    and its own child makes a pipe, which it lets through."""
    counter = _Counter()
    pid = os.fork()
    if pid == 0:
        os.pipe()
        os._exit(0)
    try:
        if not select.select([counter.fd], [], [], 5)[0] or counter.answer() or counter.made != 1:
            raise OSError("no notification")
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        status = os.waitpid(pid, 0)[1]
    if status != 0:
        raise OSError("the pipe was refused")


_CAP_HEADER, _CAP_DATA = ctypes.c_uint32 * 2, ctypes.c_uint32 * 6  # made here, not in every call's child


def _drop_capabilities():
    """A process of a user namespace gives up every capability it holds there (it keeps its user, not root there)."""
    for cap in range(64):
        if _PRCTL(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability
    _check(_CAPSET(_CAP_HEADER(0x20080522, 0), _CAP_DATA()), "capset")  # version 3, every set empty


def _fresh_keyrings():
    """Without the system-call filter: a new session keyring, and the user's keyrings emptied of what an earlier call
    of this user left there."""
    with contextlib.suppress(OSError, KeyError):
        _syscall("keyctl", 1, 0)  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
        for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
            _syscall("keyctl", 7, keyring)  # KEYCTL_CLEAR


# ---- The calls' world -----------------------------------------------------------------------------------------------

SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # read-only in a call's view
DEVICES = ("null", "zero", "full", "random", "urandom")
TMP_MB, TMP_FILES = 16, 4096  # a call's private /tmp (also /dev/shm, /var/tmp, /run/lock): its only writable space
MAX_OPEN_FILES = 64  # each may hold kernel memory outside the address-space limit (a pipe, a socket's buffers)
UID_BASE = 2_000_000_000  # a root trainer's calls run as UID_BASE + their sandbox process's pid: a user of their own
CGROUP = "/sys/fs/cgroup"
IO_READ_BPS, IO_READ_IOPS = 32 << 20, 1000  # a call's disk reads at most (its sandbox process's cgroup, each disk)
KERNEL_SLACK_MB = 32  # a call's cgroup holds its memory_mb, copies of its sandbox process's pages, its /tmp and this
LACKS = {  # what a call's world is without each mechanism, said once at start when the mechanism is not available
    "user namespace": "user namespaces (a non-root trainer needs one for every other namespace)",
    "view": "its own read-only view of the files (a call reads what its user can read, and files it leaves in /tmp "
            "or /dev/shm reach later calls)",
    "pid": "a PID namespace (a call sees other processes and can signal those of its user)",
    "net": "a network namespace (a call can reach the machine's loopback services)",
    "ipc": "an IPC namespace",
    "uts": "a UTS namespace",
    "seccomp": "the system-call filter (keyrings, SysV IPC, ptrace and other socket families stay open to a call)",
    "uid": "a user of its own per call (calls share the user nobody)",
    "root": "a user of its own per call (a non-root trainer's calls all run as its user)",
    "pipe cap": f"a cap of {MAX_PIPES_SOCKETS} pipes and sockets a call (a call that makes many passes more bits to a "
                "later call through the machine's inode counter)",
    "cgroup": "a cgroup per call (a call's kernel memory, such as socket buffers, and its disk reads are not bounded "
              "by the kernel: a call can hold memory outside its limit and slow its group-mates' disk reads)",
}


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def python_installation():
    import sysconfig

    return {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}


def check_python_outside_tmp(paths):
    """Every call mounts a /tmp of its own (and /dev/shm, /var/tmp, /run/lock point to it): a Python installation
    under the machine's would vanish from the calls' view (numpy, the standard library), so it is refused at start."""
    for path in paths:
        for tmp in ("/tmp", "/dev/shm", "/var/tmp", "/run/lock"):
            if _inside(os.path.realpath(path), tmp) or _inside(os.path.abspath(path), tmp):
                raise ValueError(f"the Python environment {path} lies under {tmp}, which each tool call replaces with "
                                 f"a folder of its own: create the environment outside {tmp} (e.g. clone elsewhere)")


def _view_plan(hidden):
    """The mounts of a call's view: [(kind, path)] in mount order; kind is "link" (a symlink as on the machine),
    "bind" (a folder as on the machine, read-only), "hide" (an empty folder over a hidden one inside a bound folder)
    or "dev" (a device)."""
    plan = [("link", p) if os.path.islink(p) else ("bind", p) for p in SYSTEM_FOLDERS if os.path.lexists(p)]
    install = python_installation()
    for path in [*sys.path, *install]:  # the Python installation; in the checkout only where it holds one (a venv)
        path = os.path.abspath(path) if path else ""
        if (os.path.isdir(path) and not _inside(ROOT, path)
                and (not _inside(path, ROOT) or path in install or path.endswith(("-packages", "/lib-dynload")))):
            plan.append(("bind", path))
    hidden = sorted({os.path.realpath(h) for h in hidden})
    bound = [os.path.realpath(p) for kind, p in plan if kind == "bind"]
    plan += [("hide", h) for h in hidden if any(_inside(h, b) and h != b for b in bound)]
    plan.sort(key=lambda op: (op[1].count("/"), op[1]))
    kept, mounted = [], []  # a bind inside another is left out, unless a hidden folder lies between them
    for kind, path in plan:
        real = os.path.realpath(path)
        if kind == "bind" and any(_inside(real, outer) and not any(_inside(h, outer) and _inside(real, h) and h != outer
                                                                  for h in hidden) for outer in mounted):
            continue
        if kind == "bind":
            mounted.append(real)
        if (kind, path) not in kept:
            kept.append((kind, path))
    return kept + [("dev", f"/dev/{name}") for name in DEVICES if os.path.exists(f"/dev/{name}")]


def _build_view(mountpoint, hidden):
    """Mount a call's world on mountpoint in this process's (private) mount namespace and make it this process's
    root: a small read-only tmpfs holding read-only binds of SYSTEM_FOLDERS and the Python installation, the DEVICES,
    and /tmp, where each call mounts its own tmpfs (/dev/shm, /var/tmp and /run/lock point to it). Nothing else of
    the machine is there: not the checkout, the run folders, $HOME, /etc, /proc or /sys."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the machine's mount namespace
    _mount("tinyrl-sandbox", mountpoint, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    devices = []
    for kind, path in _view_plan(hidden):
        target = mountpoint + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if kind == "link":
            os.symlink(os.readlink(path), target)
        elif kind == "dev":
            open(target, "w").close()
            _mount(path, target, None, MS_BIND)
            devices.append(target)
        else:
            os.makedirs(target, exist_ok=True)
            if kind == "bind":
                _mount(path, target, None, MS_BIND | MS_REC)
            else:
                _mount("tinyrl-hidden", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=64,mode=0755")
    for folder in ("tmp", "var", "run"):
        os.makedirs(f"{mountpoint}/{folder}", exist_ok=True)
    for link in ("/dev/shm", "/var/tmp", "/run/lock"):
        os.symlink("/tmp", mountpoint + link)
    with open("/proc/self/mountinfo") as f:  # every mount of the view read-only (submounts of a bound folder too)
        targets = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in f]
    for target in targets:
        if _inside(target, mountpoint):
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID | sum(ms for st, ms in _LOCKED_FLAGS
                                                              if os.statvfs(target).f_flag & st)
            # the devices are the machine's own nodes: read-only binds (a write to /dev/null still works, a utime()
            # that would set the node's timestamps for every call gets EROFS), and the only mounts that keep devices
            _mount(None, target, None, flags | MS_RDONLY | (MS_NOEXEC if target in devices else MS_NODEV))
    os.chdir(mountpoint)
    _syscall("pivot_root", b".", b".")  # the view becomes this process's root, the machine's is stacked under it
    _check(_UMOUNT2(b".", 2), "umount2")  # MNT_DETACH: the machine's root is detached
    os.chdir("/")


def _own_cgroup(controller):
    """This process's cgroup in the hierarchy of that controller ("" for cgroup2's), from /proc/self/cgroup."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return path
    raise OSError(f"no {controller or 'cgroup2'} hierarchy")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def make_cgroups():
    """The trainer's side: a folder for this sandbox's cgroups in each hierarchy the calls use, inside the trainer's own
    cgroups ({"v1": {controller: folder}} or {"v2": folder}), where the trainer may make them (root). Each sandbox
    process makes its own cgroups in them (_Cgroups); remove_cgroups removes them. Raises OSError where it cannot."""
    name = f"tinyrl-sandbox-{os.getpid()}-{os.urandom(4).hex()}"
    made = []
    try:
        if os.path.exists(f"{CGROUP}/memory/cgroup.procs"):  # cgroup v1 (or a hybrid machine)
            folders = {}
            for controller in ("memory", "pids", "blkio"):
                folders[controller] = f"{CGROUP}/{controller}{_own_cgroup(controller).rstrip('/')}/{name}"
                os.mkdir(folders[controller])
                made.append(folders[controller])
            return {"v1": folders}
        own = f"{CGROUP}{_own_cgroup('').rstrip('/')}"
        for base in dict.fromkeys((own, CGROUP)):  # the trainer's own, else the root (where the own holds processes)
            folder = f"{base}/{name}"
            try:
                os.mkdir(folder)
                made.append(folder)
                with open(f"{base}/cgroup.subtree_control") as f:
                    enabled = f.read().split()
                for controller in ("memory", "pids", "io"):
                    if controller not in enabled:
                        _write(f"{base}/cgroup.subtree_control", f"+{controller}")
                _write(f"{folder}/cgroup.subtree_control", "+memory +pids +io")
                return {"v2": folder}
            except OSError:
                remove_cgroups({"v2": folder})
                made.remove(folder)
        raise OSError("no cgroup2 folder with the memory, pids and io controllers")
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def remove_cgroups(cgroups, leaf=None):
    """Remove a sandbox process's cgroups (leaf), or all of them and their folders; retried for a second while the
    kernel still holds a dying call."""
    if not cgroups:
        return
    folders = list(cgroups["v1"].values()) if "v1" in cgroups else [cgroups["v2"]]
    paths = []
    for folder in folders:
        if leaf is not None:
            paths.append(f"{folder}/{leaf}")
        else:
            with contextlib.suppress(OSError):
                paths += [entry.path for entry in os.scandir(folder) if entry.is_dir()]
            paths.append(folder)
    deadline = time.monotonic() + 1
    for path in paths:
        while os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def _disks():
    """The machine's block devices ("major:minor"), whole disks only (the I/O limits take no partition)."""
    disks = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/sys/block"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/sys/block/{name}/size") as f:
                    if int(f.read()) == 0:
                        continue
                with open(f"/sys/block/{name}/dev") as f:
                    disks.append(f.read().strip())
    return disks


class _Cgroups:
    """A sandbox process's side (made before its view, which has no /sys): its calls' cgroups. Cgroup v1: the calls'
    memory cgroup (each call's child joins it: its own memory, its copies of this process's pages, its /tmp and its
    kernel memory, socket buffers included, bounded by `limit`, and no swap), and a pids and a blkio cgroup that this
    process joins once its start-up probes are done, so its calls inherit them: this process and one child at most
    (its call), and reads from each disk of at most IO_READ_BPS and IO_READ_IOPS. Cgroup2: one cgroup with all of
    these, which each call's child joins. `join_fds` are the cgroup.procs files the child writes "0" to; a kill by
    the memory limit shows in `oom_kills()`."""

    def __init__(self, cgroups, leaf, limit):
        self.join_fds, self.own_fds, self.events = [], [], None
        io = [(disk, f"rbps={IO_READ_BPS} riops={IO_READ_IOPS}") for disk in _disks()]
        if "v1" in cgroups:
            memory, pids, blkio = (f"{cgroups['v1'][c]}/{leaf}" for c in ("memory", "pids", "blkio"))
            for folder in (memory, pids, blkio):
                os.mkdir(folder)
            _write(f"{memory}/memory.limit_in_bytes", str(limit))
            for name in ("memory.memsw.limit_in_bytes", "memory.swappiness"):  # no swap (where the kernel has it)
                with contextlib.suppress(OSError):
                    _write(f"{memory}/{name}", str(limit) if "memsw" in name else "0")
            _write(f"{pids}/pids.max", "2")
            throttled = 0
            for disk, _ in io:
                for name, value in (("read_bps_device", IO_READ_BPS), ("read_iops_device", IO_READ_IOPS)):
                    with contextlib.suppress(OSError):
                        _write(f"{blkio}/blkio.throttle.{name}", f"{disk} {value}")
                        throttled += 1
            if io and not throttled:
                raise OSError("no disk takes an I/O limit")
            self.join_fds = [os.open(f"{memory}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)]
            self.own_fds = [os.open(f"{folder}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for folder in (pids, blkio)]
            self.events = os.open(f"{memory}/memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        else:
            folder = f"{cgroups['v2']}/{leaf}"
            os.mkdir(folder)
            _write(f"{folder}/memory.max", str(limit))
            with contextlib.suppress(OSError):
                _write(f"{folder}/memory.swap.max", "0")
            _write(f"{folder}/pids.max", "1")
            throttled = 0
            for disk, value in io:
                with contextlib.suppress(OSError):
                    _write(f"{folder}/io.max", f"{disk} {value}")
                    throttled += 1
            if io and not throttled:
                raise OSError("no disk takes an I/O limit")
            self.join_fds = [os.open(f"{folder}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)]
            self.events = os.open(f"{folder}/memory.events", os.O_RDONLY | os.O_CLOEXEC)

    def join_own(self):
        for fd in self.own_fds:
            os.write(fd, b"0")
            os.close(fd)
        self.own_fds = []

    def oom_kills(self):
        """How many of this process's calls the kernel killed at their memory limit so far."""
        found = re.search(rb"oom_kill (\d+)", os.pread(self.events, 4096, 0))
        return int(found[1]) if found else 0


def _probe(test):
    """Whether test() runs without an exception in a child of this process."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            test()
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1] == 0


NETWORK = """Each call's child enters a fresh network namespace: one interface, a loopback that is down, which it has no
capability to bring up (no connection is ever made). A call's sockets, abstract Unix socket names among them, stay in
its own namespace, whatever outlives its processes (Unix sockets in a cycle of descriptors in flight, freed only when
the kernel's collector runs): the next call of the sandbox process starts in another. The sandbox process has a
namespace of its own too (none of the machine's interfaces)."""


class _World:
    """What a sandbox process sets up once, in this order, and what each of its calls then enters: a user namespace
    (for a non-root trainer: every other namespace needs one), a PID namespace of its own (it becomes its first
    process), a mount namespace holding the calls' read-only view (its own root), a network namespace, the call's
    user, and the system-call filter (its own too: its children inherit it). Each call's child is the first process
    of a fresh PID namespace and enters fresh mount (its private /tmp), IPC, UTS and network (NETWORK) namespaces.
    `lacks` names what this machine does not allow (see LACKS)."""

    def __init__(self, folder, hidden, without, cgroups=None):
        self.root = os.geteuid() == 0
        self.cgroups = cgroups
        self.uid, self.gid = (NOBODY, NOBODY) if self.root else (os.getuid(), os.getgid())
        self.lacks, self.flags, self.view, self.pid_fd, self.seccomp = [], 0, False, None, None
        self.calls = tempfile.mkdtemp(dir=folder)  # the mount point of the view, or the calls' folders without one
        os.chmod(self.calls, 0o711)  # a call that switched users reaches its own folder in it, and lists none
        uid = UID_BASE + os.getpid()  # no other running sandbox process of this machine has it
        caps, self.userns = self.root, False
        if not self.root:
            try:
                if "user namespace" in without:
                    raise OSError("disabled")
                _unshare(CLONE_NEWUSER)
                for name, text in (("setgroups", "deny"), ("uid_map", f"{self.uid} {self.uid} 1"),
                                   ("gid_map", f"{self.gid} {self.gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                caps = self.userns = True
            except OSError:
                self.lacks.append("user namespace")
        self.pid_fd = self._pid_namespace() if caps and "pid" not in without else None
        if self.pid_fd is None:
            self.lacks.append("pid")
        try:
            if not caps or "view" in without:
                raise OSError("disabled")
            _unshare(CLONE_NEWNS)
            _build_view(self.calls, hidden)
            self.view = True
        except OSError:
            self.lacks.append("view")
            _UMOUNT2(os.fsencode(self.calls), 2)  # a view half built is dropped (where it was mounted at all)
        try:  # its own network namespace (none of the machine's interfaces), and a fresh one per call: see NETWORK
            if not caps or "net" in without:
                raise OSError("disabled")
            _unshare(CLONE_NEWNET)
        except OSError:
            self.lacks.append("net")
        for name, flag in (("uts", CLONE_NEWUTS), ("ipc", CLONE_NEWIPC), ("net", CLONE_NEWNET)):
            if name in self.lacks:
                continue
            if caps and name not in without and _probe(lambda: _unshare(flag)):  # noqa: B023
                self.flags |= flag
            else:
                self.lacks.append(name)
        if self.view:
            self.flags |= CLONE_NEWNS
            if not _probe(lambda: (_unshare(CLONE_NEWNS), self.mount_tmp())):
                raise RuntimeError("a call could not mount its /tmp")
        if not self.root:
            self.lacks.append("root")
        elif "uid" not in without and _probe(lambda: self.become(uid, uid)):
            self.uid = self.gid = uid
        else:
            self.lacks.append("uid")
        self.seccomp = _seccomp_program() if "seccomp" not in without else None
        if self.seccomp is not None and _probe(lambda: self._filter(check=True)):
            self._filter()  # this process's too: every call inherits it, at no cost per call
        else:
            self.seccomp = None
            self.lacks.append("seccomp")
        self.counting = self.seccomp is not None and "pipe cap" not in without and _probe(_counting_works)
        if not self.counting:
            self.lacks.append("pipe cap")
        if self.cgroups is not None and not _probe(lambda: [os.write(fd, b"0") for fd in self.cgroups.join_fds]):
            self.cgroups = None  # a child cannot join the calls' cgroup (e.g. a cgroup2 tree that refuses it)
        if self.cgroups is None:
            self.lacks.append("cgroup")
        else:
            self.cgroups.join_own()  # its pids and blkio cgroups, once its probes' children are gone

    def _pid_namespace(self):
        """Become the first process of a PID namespace of our own (the started process stays outside, waits for us
        and ends with us). Returns its file descriptor, or None where that cannot be done."""
        try:
            _unshare(CLONE_NEWPID)
            pid = os.fork()
        except OSError:
            return None
        if pid:
            os.closerange(3, 65536)
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            self.pid_fd = os.open("/proc/self/ns/pid", os.O_RDONLY)  # before the view, which has no /proc
        except OSError:
            return None
        if not _probe(lambda: (self.new_pid_namespace(), os.waitpid(os.fork() or os._exit(0), 0),
                               self.new_pid_namespace(), os.waitpid(os.fork() or os._exit(0), 0))):
            os.close(self.pid_fd)
            return None
        return self.pid_fd

    def new_pid_namespace(self):
        """The next child of this process is the first process of a fresh PID namespace. A process can unshare one
        only from its own: it enters its own again first (setns), after its last call's child (which ended)."""
        _check(_SETNS(self.pid_fd, CLONE_NEWPID), "setns")
        _unshare(CLONE_NEWPID)

    def mount_tmp(self):
        _mount("tinyrl-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={TMP_MB}m,nr_inodes={TMP_FILES},mode=1777,uid={self.uid},gid={self.gid}")

    @staticmethod
    def become(uid, gid):
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)

    def _filter(self, check=False):
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no set-user-ID program gives privileges back; the filter needs it
        _prctl(PR_SET_SECCOMP, 2, ctypes.addressof(self.seccomp[0]))  # SECCOMP_MODE_FILTER
        if check:  # it holds: refused what it refuses, allowed what a call needs
            for test, refused in ((lambda: _syscall("keyctl", 0, -4, 0), errno.EPERM),
                                  (lambda: _unshare(CLONE_NEWUSER), errno.EPERM),
                                  (lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW), errno.EAFNOSUPPORT)):
                try:
                    test()
                except OSError as e:
                    if e.errno != refused:
                        raise
                else:
                    raise OSError("the filter does not hold")
            socket.socket(socket.AF_UNIX).close()
            _unshare(self.flags)

    def warning(self):
        return "the tool sandbox runs without " + "; ".join(LACKS[k] for k in self.lacks) if self.lacks else ""


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


# ---- A sandbox process ----------------------------------------------------------------------------------------------


def _serve(channel_fd, config, leaf):
    """A sandbox process: a fresh interpreter, started isolated (python -I, an environment of THREADS alone, not in
    the trainer's folder), never a fork of the trainer. It imports `modules` and sqlite3, takes its limits, sets up
    its _World, makes two test calls, installs the counting filter (_Counter), answers [why it cannot run calls or "",
    a warning or "", what it lacks] on its channel (a Unix socket to the trainer), then serves calls (_serve_calls)."""
    modules, memory_bytes, file_bytes, max_chars, timeout, folder, hidden, without, cgroups = json.loads(config)
    channel = socket.socket(fileno=channel_fd)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # C-level writes (os.write, a crashing extension) go nowhere
    os.close(devnull)
    try:
        for name in modules:
            importlib.import_module(name)
        sqlite_locks = _sqlite_dot_file_locks()
        os.environ.clear()  # calls see THREADS alone
        os.environ.update(THREADS)
        limit_process(memory_bytes, file_bytes)  # here: the view has no /proc
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        calls_cgroups = None
        if cgroups and "cgroup" not in without:
            with open("/proc/self/statm") as f:  # a child may copy each page this process holds, and no more
                resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with contextlib.suppress(OSError):
                calls_cgroups = _Cgroups(cgroups, leaf, memory_bytes + resident + (TMP_MB + KERNEL_SLACK_MB) * 2**20)
        world = _World(folder, hidden, set(without), calls_cgroups)
        world.sqlite_locks = sqlite_locks
        world.alive_r, world.alive_w = os.pipe()  # a child sees this process gone when alive_r reads end-of-file
        compile("", "<tool>", "exec")  # its first compile() makes Python's AST types: here, not in every child
        gc.freeze()  # the imported objects stay out of the children's garbage collections: fewer pages copied
        with contextlib.suppress(OSError):  # a call's child of the same user cannot reach this process's memory
            _prctl(PR_SET_DUMPABLE, 0)
    except BaseException as e:  # noqa: BLE001 - e.g. a module that cannot be imported: the sandbox stops
        return channel.send(json.dumps([f"{type(e).__name__}: {e}", "", []]).encode())
    test = _own_call(world, "print(6 * 7)", max_chars, timeout)
    if test != ("42\n", ""):  # a child that cannot take its limits or user never runs a call: the run stops
        return channel.send(json.dumps([f"a test call gave {test}", "", []]).encode())
    readable = _own_call(world, "import sys\n__import__(next(name for name in ('colorsys', 'tabnanny', 'netrc', "
                                "'wave') if name not in sys.modules))", max_chars, timeout) == ("", "")
    wake = os.pipe()  # made before the counting filter: past it this process makes no pipe (it would wait on itself)
    counter = None
    if world.counting:
        try:
            counter = _Counter()
        except OSError:
            world.lacks.append("pipe cap")
    warnings = [world.warning()] if world.lacks else []
    if not readable:
        warnings.append(f"the sandbox's user cannot read the Python installation ({sys.prefix}): a tool call can "
                        "import only the sandbox's modules and what they import at start")
    channel.send(json.dumps(["", "; ".join(warnings), world.lacks]).encode())
    _serve_calls(world, channel, max_chars, timeout, wake, counter)


def _serve_calls(world, channel, max_chars, timeout, wake, counter):
    """The loop of a sandbox process, until the trainer closes the channel. A message "c" brings a call's code (a
    memfd) and the write end of its result pipe: a child forked for the call reads the code and writes the result,
    and this process, which reads neither, kills the child at its time limit, past MAX_PIPES_SOCKETS (`counter`, the
    counting filter's listener, or None), or when the next call comes while it still runs (it closed its pipe early:
    the trainer has its answer). Calls run one at a time.
    Once a child has ended, its status goes to the trainer: "s" + timeout, pipes, memory, cpu, signal N, exit code N
    or not started, one message per call, in order."""
    name = ctypes.create_string_buffer(b"tool-sandbox")  # in ps and top: this process and its calls' children
    _PRCTL(PR_SET_NAME, ctypes.addressof(name), 0, 0, 0)
    wake_r, wake_w = wake
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes the select below
    call = None  # [pid, deadline, folder, why it was killed: None, "timeout" or "pipes"]
    waits = [channel, wake_r] + ([counter.fd] if counter else [])
    oom_kills = [world.cgroups.oom_kills() if world.cgroups else 0]  # calls killed at their memory limit so far

    def end(block):
        nonlocal call
        pid, status, usage = os.wait4(call[0], 0 if block else os.WNOHANG)
        if pid:
            if call[2]:
                _remove(call[2])
            # RLIMIT_CPU's SIGKILL: the kernel checks that limit against CPU time sampled at scheduler ticks, wait4
            # reports the exact run time, and on a loaded machine the two can differ by more than 0.05 s: half the
            # limit tells a CPU-bound call from one killed early for another reason
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            used_cpu = killed and usage.ru_utime + usage.ru_stime >= cpu_limit(timeout) / 2
            memory = killed and world.cgroups is not None and world.cgroups.oom_kills() > oom_kills[0]
            if memory:
                oom_kills[0] = world.cgroups.oom_kills()
            channel.send(b"s" + (call[3] or ("memory" if memory else "cpu" if used_cpu
                                             else _status(status))).encode())
            call = None

    while True:
        wait = None if call is None or call[3] else max(0.0, call[1] - time.monotonic())
        readable = select.select(waits, [], [], wait)[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
        if counter and counter.fd in readable and counter.answer() and call and not call[3]:
            call[3] = "pipes"
            os.kill(call[0], signal.SIGKILL)
        if call and not call[3] and time.monotonic() >= call[1]:
            call[3] = "timeout"
            os.kill(call[0], signal.SIGKILL)
        if call:
            end(block=False)
        if channel not in readable:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(channel, 16, 2)
        except OSError:
            message, fds = b"", []
        if not message:
            return  # the trainer closed the channel
        if message == b"k" and call:  # the trainer has its answer: the call ends now, and its whole PID namespace
            os.kill(call[0], signal.SIGKILL)  # (it is the namespace's first process) before any other call starts
            end(block=True)
        if message == b"c":
            if call:  # (the trainer always waits for a call's end first)
                os.kill(call[0], signal.SIGKILL)
                end(block=True)
            try:
                if len(fds) != 2:
                    raise OSError("a call without its code and pipe")
                if counter:
                    counter.made = 0  # (the last call's child is reaped: none of its notices is left)
                pid, folder = _start_call(world, *fds, max_chars, timeout)
                call = [pid, time.monotonic() + wall_limit(timeout), folder, None]
            except OSError:  # e.g. no memory for a new namespace: this call fails, the next one is tried
                channel.send(b"snot started")
        for fd in fds:
            os.close(fd)  # the child has its own copies: its pipe ends when the child closes it or ends


def _status(status):
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}"


def _start_call(world, code_fd, result_fd, max_chars, timeout):
    """Fork the child of one call, the first process of a fresh PID namespace. Returns (its pid, its folder, or None
    where it has a private /tmp)."""
    folder = None
    if not world.view:
        folder = tempfile.mkdtemp(dir=world.calls)
        os.chown(folder, world.uid, world.gid)
    if world.pid_fd is not None:
        world.new_pid_namespace()
    pid = os.fork()
    if pid == 0:
        try:
            _child(world, code_fd, result_fd, folder, max_chars, timeout)
        finally:
            os._exit(0)
    return pid, folder


def _own_call(world, code, max_chars, timeout):
    """A call of the sandbox process's own (its test calls at start), run as any other (its code in a pipe)."""
    code_fd, code_write = os.pipe()
    os.write(code_write, code.encode())
    os.close(code_write)
    read_end, write_end = os.pipe()
    pid, folder = _start_call(world, code_fd, write_end, max_chars, timeout)
    os.close(code_fd)
    os.close(write_end)
    result, deadline = b"", time.monotonic() + wall_limit(timeout)
    while select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        result += chunk
    timed_out = time.monotonic() >= deadline
    os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    os.close(read_end)
    if folder:
        _remove(folder)
    return _outcome(result, "timeout" if timed_out else _status(status), max_chars, timeout)


def _child(world, code_fd, result_fd, folder, max_chars, timeout):
    """The child of one call, forked by its sandbox process as the first process of a fresh PID namespace. It dies
    with its sandbox process, takes a session of its own, reads its code, enters fresh mount, IPC, UTS and network
    namespaces, mounts its private /tmp (its working folder), becomes the call's user (a root trainer's: one no other
    running call has; in a user namespace: no capability left), keeps no file but its result pipe, may start no
    process or thread (RLIMIT_NPROC 0), has cpu_limit(timeout) s of CPU, runs the code with its output capped (under
    its sandbox process's system-call filter), and writes (output, error) as JSON to its result pipe."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([world.alive_r], [], [], 0)[0]:
            return  # its sandbox process died before the line above: nothing may outlive it
        signal.set_wakeup_fd(-1)
        os.setsid()  # kill(0, ...) reaches this process only
        for fd in world.cgroups.join_fds if world.cgroups else ():
            os.write(fd, b"0")  # the call's cgroup: its memory, kernel memory included, counted and bounded
        code = b""
        while chunk := os.read(code_fd, 1 << 16):
            code += chunk
        code = code.decode("utf-8", "surrogatepass")
        if world.flags:
            _unshare(world.flags)
        if world.flags & CLONE_NEWUTS:
            socket.sethostname("sandbox")  # not the machine's name
        if world.view:
            world.mount_tmp()
            os.chdir("/tmp")
        else:
            os.chdir(folder)
        if world.root:
            world.become(world.uid, world.gid)
        elif world.userns:
            _drop_capabilities()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of user clears it
        if select.select([world.alive_r], [], [], 0)[0]:
            return
        if world.seccomp is None:
            _fresh_keyrings()
            _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no set-user-ID program gives privileges back
        os.closerange(3, result_fd)  # its sandbox process's channel among them: the code cannot answer in its place
        os.closerange(result_fd + 1, 65536)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # fork and threads fail: no fork bomb, no orphans
        cpu = cpu_limit(timeout)  # the kernel kills it at that much CPU (SIGKILL: as its PID namespace's first
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # process it would ignore SIGXCPU)
        resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    except BaseException as e:  # noqa: BLE001 - the code is not run outside its world
        data = json.dumps(["", f"SandboxError: the call could not be isolated ({type(e).__name__}: {e})"])
        with contextlib.suppress(OSError):
            os.write(result_fd, data.encode())
        return
    stdout, error = _CappedText(max_chars), ""
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the call ends with an error
        error = _error_line(e, world.sqlite_locks)
    output, error = stdout.getvalue(), error[:max_chars]
    encode = lambda: json.dumps([output, error], ensure_ascii=False).encode("utf-8", "surrogatepass")  # noqa: E731
    data, room = encode(), fcntl.fcntl(result_fd, F_GETPIPE_SZ)
    while len(data) > room:  # the whole answer fits its pipe: it never waits on the trainer
        output, error = (output[:len(output) // 2], error) if output else ("", error[:len(error) // 2])
        data = encode()  # the trainer cleans what it reads
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(result_fd, data):]
        os.close(result_fd)  # the trainer has the answer now, not once this process's memory is freed


def _sqlite_dot_file_locks():
    """SQLite locks a database file with fcntl's byte-range locks, which the filter refuses (on the view's files they
    would be a channel between calls): its default becomes its own unix-dotfile VFS, which locks with a `<file>.lock`
    folder beside the database, in the call's /tmp, where no other process reaches. A call's connections to one file
    keep each other out as with fcntl locks. Imports sqlite3 (a call then imports it for free). Returns whether the
    library's functions were found (not where sqlite3 is missing, or linked without its symbols)."""
    try:
        import sqlite3  # noqa: F401
        with open("/proc/self/maps") as f:  # the library _sqlite3 loaded (or _sqlite3 itself, linked statically)
            paths = dict.fromkeys(line.split()[-1] for line in f if "sqlite3" in line.rsplit("/", 1)[-1])
        for path in paths:
            library = ctypes.CDLL(path)
            if not hasattr(library, "sqlite3_vfs_find"):
                continue
            library.sqlite3_vfs_find.restype, library.sqlite3_vfs_find.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
            library.sqlite3_vfs_register.argtypes = [ctypes.c_void_p, ctypes.c_int]
            vfs = library.sqlite3_vfs_find(b"unix-dotfile")
            if vfs and library.sqlite3_vfs_register(vfs, 1) == 0:  # 1: the default from now on
                return True
    except (ImportError, OSError):
        pass
    return False


def _error_line(exception, sqlite_locks=True):
    """The last line of a call's exception, which the model reads; where SQLite could not be given its dot-file locks,
    its errors say why a database in a file fails."""
    line = traceback.format_exception_only(type(exception), exception)[-1].strip()
    if not sqlite_locks and type(exception).__module__ == "sqlite3":
        line += " (the sandbox refuses file locks, which SQLite takes on a file: use sqlite3.connect(':memory:'))"
    return line


def _remove(folder):
    """Remove a folder whatever the code left in it (a tree too deep for shutil.rmtree's recursion, no permissions)."""
    try:
        shutil.rmtree(folder)
    except Exception:  # noqa: BLE001 - posix_spawn makes no pipe (a sandbox process past its counting filter may not)
        with contextlib.suppress(OSError):
            quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
            os.waitpid(os.posix_spawnp("rm", ["rm", "-rf", "--", folder], {}, file_actions=quiet), 0)


_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)] if chr(c) not in "\n\t"}
_CONTROLS.update({c: f"\\u{c:04x}" for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]})  # bidi overrides


def _clean(text):
    """A string the tokenizer and a console can take: a lone surrogate (print('\ud800')) becomes its escape, and so
    do control characters but newline and tab (a terminal escape sequence, a carriage return, a bidi override)."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8").translate(_CONTROLS)


def _answer(data, max_chars):
    """(output, error) from a child's answer, or None where it is none (not JSON: junk, cut, or nothing)."""
    try:
        output, error = json.loads(data.decode("utf-8", "surrogatepass"))
        return _clean(output)[:max_chars + 1], _clean(error)[:max_chars]
    except Exception:  # noqa: BLE001
        return None


# BLAS and OpenMP libraries start a pool of threads where they are loaded (numpy's OpenBLAS: one per CPU). A call may
# start no thread (RLIMIT_NPROC 0): OpenBLAS loaded in a call fails its import, and a pool made in the sandbox process
# before the fork is gone in the child, where a large solve then waits for it forever. One thread each, set before
# anything is loaded (the sandbox process's environment, kept for its calls), runs every BLAS routine in the calling
# thread: a call gains no thread, and none is made in the sandbox process.
THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cpu_limit(timeout):
    """Seconds of CPU a call may use (RLIMIT_CPU counts whole seconds)."""
    return max(1, math.ceil(timeout))


def wall_limit(timeout):
    """Wall-clock seconds a call may take: room for `timeout` seconds of CPU on a loaded machine, a bound on code that
    waits instead of computing."""
    return 3 * timeout + 5


def _outcome(data, status, max_chars, timeout):
    """(output, error) of a call from what its child wrote and, where that is no answer, the status of its end."""
    answer = _answer(data, max_chars)
    if answer is not None:
        return answer
    if status == "cpu":
        return "", f"TimeoutError: the code used {cpu_limit(timeout)} s of CPU and was stopped"
    if status == "timeout":
        return "", f"TimeoutError: the code waited for more than {wall_limit(timeout):g} s and was stopped"
    if status == "pipes":
        return "", (f"OSError: the code made more than {MAX_PIPES_SOCKETS} pipes and sockets (the sandbox's limit "
                    "for a call) and was stopped")
    if status == "memory":
        return "", ("MemoryError: the code's memory (kernel buffers and /tmp included) passed its limit and it was "
                    "stopped")
    if status == "not started":
        return "", "the sandbox could not start the call"
    return "", f"the code ended without a result ({status})"  # a segfault, memory exhausted in C code, junk


def _environment():
    """The sandbox processes' environment: nothing of the trainer's but what starts the interpreter, and THREADS."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **THREADS}
    if "LD_LIBRARY_PATH" in os.environ:
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


class PythonSandbox:
    """Run model-written code in sandbox processes, many calls at once, each call in a fresh child and a fresh world:

        with PythonSandbox(num_workers=2, timeout=5.0) as sandbox:
            results = sandbox.run(["print(6 * 7)", "while True: pass"])   # [("42\\n", ""), ("", "TimeoutError: ...")]

    `warning` says in one line what the calls' world lacks on this machine ("" when nothing), `lacks` the names of
    those mechanisms (keys of LACKS). `_without` (tests) leaves mechanisms out by those names.
    """

    def __init__(self, num_workers=1, timeout=5.0, memory_mb=512, file_mb=1, max_output_chars=512, modules=(),
                 _without=()):
        check_python_outside_tmp(python_installation())
        self.timeout, self.max_chars = timeout, max_output_chars
        self.cap = 32 * max_output_chars + 1024  # bytes of a child's answer at most (12 a character at worst)
        self.folder = tempfile.mkdtemp(prefix="tinyrl-sandbox-")  # each process's folder is made in it
        os.chmod(self.folder, 0o711)
        hidden = [ROOT, os.getcwd(), os.path.expanduser("~")]  # never in a call's view, even inside a bound folder
        self.cgroups, self.started = None, 0
        if os.geteuid() == 0 and "cgroup" not in _without:
            with contextlib.suppress(OSError):
                self.cgroups = make_cgroups()
        self.config = json.dumps([list(modules), memory_mb * 2**20, file_mb * 2**20, max_output_chars, timeout,
                                  self.folder, hidden, list(_without), self.cgroups])
        self.warning, self.lacks, self.processes = "", [], []
        try:
            for _ in range(num_workers or default_reward_workers()):  # 0: as many as the reward workers
                self.processes.append(self._start())
            for process in self.processes:
                self._ready(process)
        except BaseException:
            self.close()
            raise

    def _start(self):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from plumbing.tools import _serve; del sys.path[0]; "
                "_serve(int(sys.argv[2]), sys.argv[3], sys.argv[4])")
        leaf, self.started = f"p{self.started}", self.started + 1  # the name of its cgroups
        try:
            process = subprocess.Popen([sys.executable, "-I", "-c", code, ROOT, str(child.fileno()), self.config, leaf],
                                       pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True, env=_environment(), cwd="/")
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        process.channel, process.dead, process.sent, process.received, process.status = parent, False, 0, 0, (-1, "")
        process.leaf = leaf
        return process

    def _ready(self, process):
        """Wait for a new sandbox process's first answer (["", warning, lacks] once its limits hold); keep its
        warning and the names of the mechanisms it lacks."""
        answer = None
        if select.select([process.channel], [], [], 60)[0]:
            with contextlib.suppress(Exception):
                why, warning, lacks = json.loads(process.channel.recv(1 << 16))
                answer = (str(why), str(warning), list(lacks))
        why, self.warning, self.lacks = answer or (
            "it ended before it was ready" if process.poll() is not None else "it did not start within 60 s", "", [])
        if why:
            raise RuntimeError(f"the Python sandbox could not start: {why}")

    def _send(self, k, code):
        """Give sandbox process k a call: the code in a memfd, the write end of a new result pipe. Returns the read
        end, or None where the process cannot take it (it died, or stopped with its channel full)."""
        process = self.processes[k]
        self._statuses(k)  # those of its calls answered before: its channel never fills
        if process.dead:
            return None
        code_fd, (read_end, write_end) = os.memfd_create("tool-call", os.MFD_CLOEXEC), os.pipe()
        try:
            data = code.encode("utf-8", "surrogatepass")
            while data:
                data = data[os.write(code_fd, data):]
            os.lseek(code_fd, 0, os.SEEK_SET)  # the child reads it from the start
            for size in (self.cap, 1 << 20) if self.cap > 65536 else ():  # room for the whole answer (else it is cut)
                with contextlib.suppress(OSError):
                    fcntl.fcntl(write_end, F_SETPIPE_SZ, size)
                    break
            socket.send_fds(process.channel, [b"c"], [code_fd, write_end], socket.MSG_DONTWAIT)
        except OSError:
            os.close(read_end)
            return None
        finally:
            os.close(code_fd)
            os.close(write_end)
        process.sent += 1
        return read_end

    def run(self, codes):
        """[(output, error)] of each code, in order, the calls spread over the processes; error is "" on success.
        A call's answer is taken from its pipe's first read where it is whole (an honest child writes it at once),
        else once its sandbox process says the child ended: a call that writes a byte at a time wakes the trainer
        twice, not once a byte. A call ends when its answer arrives: its sandbox process is told to kill its child
        (the first process of its PID namespace: the namespace dies with it), and no call starts anywhere until the
        child is reaped; run() returns once every call's child has ended."""
        results = [("", f"the code is over {MAX_CODE_CHARS} characters and was not run") if len(code) > MAX_CODE_CHARS
                   else None for code in codes]
        todo = [i for i in reversed(range(len(codes))) if results[i] is None]
        busy = {}  # a process's index -> its call: [index, backstop deadline, read end, its number, ended, first read,
        # its answer (once read whole)]
        while todo or busy:
            # no call starts while the child of an answered call may still run: nothing of a call meets a later one
            ending = any(call[6] is not None for call in busy.values())
            for k in range(len(self.processes)):
                while k not in busy and todo and not ending:
                    i = todo.pop()
                    read_end = self._send(k, codes[i])
                    if read_end is None:
                        results[i] = ("", "the sandbox process died or stopped answering; it was replaced")
                        self._replace(k)
                    else:  # a backstop: each call is timed by its sandbox process; the slack covers a replacement
                        busy[k] = [i, time.monotonic() + wall_limit(self.timeout) + 10, read_end,
                                   self.processes[k].sent - 1, False, b"", None]
            wait = max(0.0, min(call[1] for call in busy.values()) - time.monotonic())
            waits = {call[2] if not call[4] else self.processes[k].channel: k for k, call in busy.items()}
            for ready in select.select(list(waits), [], [], wait)[0]:
                k = waits[ready]
                call = busy[k]
                if not call[4]:  # its first read
                    call[5] = os.read(call[2], self.cap + 1)
                    call[6] = _answer(call[5], self.max_chars)
                    call[4] = True  # wait for its end: at once where it answered (its child is killed now)
                    if call[6] is not None:
                        self._end(k)
                else:
                    status = self._statuses(k, call[3])
                    if status is not None or self.processes[k].dead:
                        results[call[0]] = call[6] if call[6] is not None else self._ended(k, call, status)
                        if status is None and call[6] is not None:  # the process died: its children with it
                            self._replace(k)
            for k, call in list(busy.items()):
                if results[call[0]] is None and time.monotonic() >= call[1]:  # the process stopped answering
                    results[call[0]] = ("", "the sandbox process died or stopped answering; it was replaced")
                    self._replace(k)
                if results[call[0]] is not None:
                    os.close(call[2])
                    del busy[k]
        return results

    def _end(self, k):
        """Tell sandbox process k that its call has answered: it kills the call's child (if it still runs) and
        reaps it, then sends the call's status as for any end."""
        with contextlib.suppress(OSError):
            self.processes[k].channel.send(b"k", socket.MSG_DONTWAIT)

    def _statuses(self, k, wanted=None):
        """Read process k's status messages sent so far (one per call, in order, once the call's child has ended).
        Returns that of call number `wanted`, or None."""
        process = self.processes[k]
        while not process.dead and select.select([process.channel], [], [], 0)[0]:
            try:
                message = process.channel.recv(256)
            except OSError:
                message = b""
            if not message.startswith(b"s"):  # end of file: the process died
                process.dead = True
                break
            process.status = (process.received, message[1:].decode("utf-8", "replace"))
            process.received += 1
        return process.status[1] if process.status[0] == wanted else None

    def _ended(self, k, call, status):
        """(output, error) of a call whose child ended: what the child left in its pipe (read without waiting, at most
        `cap` bytes), else what its status says."""
        if status is None:  # the process died mid-call (its child with it)
            self._replace(k)
            return "", "the sandbox process died or stopped answering; it was replaced"
        os.set_blocking(call[2], False)
        data = call[5]  # its first read
        with contextlib.suppress(BlockingIOError):
            while len(data) <= self.cap and (chunk := os.read(call[2], self.cap + 1 - len(data))):
                data += chunk
        return _outcome(data, status, self.max_chars, self.timeout)

    def _replace(self, k):
        self._stop(self.processes[k])
        remove_cgroups(self.cgroups, self.processes[k].leaf)
        self.processes[k] = self._start()
        self._ready(self.processes[k])

    @staticmethod
    def _stop(process):
        process.channel.close()
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # its group: the started process and the sandbox process
        process.wait()

    def close(self):
        for process in self.processes:
            self._stop(process)
        self.processes = []
        _remove(self.folder)
        remove_cgroups(self.cgroups)
        self.cgroups = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
