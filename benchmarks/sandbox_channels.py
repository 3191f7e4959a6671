"""What the channels the tool sandbox leaves open carry from one call to a later one, measured on this machine
(docs/sandbox.md, "Shared kernel state: what is closed, what remains").

    python benchmarks/sandbox_channels.py [--trials N] [--bits K ...] [--below B ...] [--cpus N] [--pages N]
                                          [--reclaim_mb MB] [--slots N] [--slot_ms MS ...]

Each channel is used as a policy would use it: a sender call and a receiver call in grpo_tools.py's sandbox
(plumbing/tools.py with grpo_tools.py's defaults: 5 s of CPU, 512 MB, math, fractions and statistics preloaded), the
receiver printing what it observes, decoded here.

(a) The inode counter of pipes and sockets (the kernel's get_next_ino: per CPU, in batches of 1024). Calibration
    calls first: a call reads one pipe's number on each CPU and the next call does the same; the difference there is
    the offset a sender allows for (its spread, what the sandbox, the trainer and other processes make in between,
    is the noise). The sender pins itself to each CPU in turn and makes pipes until the number the next call's pipe
    there will take (its own last one plus the offset) holds its K-bit symbol with --below bits under it (more: fewer
    errors from the noise, twice the pipes a bit); the next call reads one pipe on each CPU. Per K and bits below:
    the sender's CPU seconds and pipes (medians), the symbols decoded, and the bits a call passes to the next one:
    the information of an M-ary symmetric channel, K - H(p) - p log2(2^K - 1) a CPU for a symbol error rate p. In the
    sandbox as it is (at most MAX_PIPES_SOCKETS pipes and sockets a call) and without that cap.
(b) The page cache of the view's files. The sender reads the pages of its 1 bits, pages no one has cached (checked
    here with mincore where this process may: root); a later call times a read of each page and reads a 1 where it
    took at most 10 times a cached read (the median of 32 reads of a page every call has cached; a read from the disk
    takes far longer); a second later call does the same. Settings: the sandbox as it is (RWF_DONTCACHE refused: the
    first receiver's reads cache every page); on the same pages, a later call of the same sandbox process that fills
    its memory cgroup (memory to its limit, its /tmp, then --reclaim_mb of uncached files: the kernel reclaims the
    cgroup's page cache, pages of earlier calls among it), then a second message; and the sandbox without its
    system-call filter, the receivers reading with RWF_DONTCACHE where the kernel has it (it leaves an uncached page
    uncached).
(c) CPU contention: two concurrent calls pinned to one CPU; in each slot of --slot_ms the sender spins (1) or sleeps
    (0), the receiver counts its own loop's iterations (1: fewer than a cut between the two groups of counts). Bits
    decoded and the binary symmetric channel's rate, (1 - H(p)) bits a slot.

Writes benchmarks/results/sandbox_channels.md.
"""

import argparse
import base64
import ctypes
import errno
import json
import math
import os
import random
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing.tools import (MAX_PIPES_SOCKETS, SYSTEM_FOLDERS, PythonSandbox, cpu_limit,  # noqa: E402
                            python_installation)

TIMEOUT, MEMORY_MB, MODULES = 5.0, 512, ("math", "fractions", "statistics")  # grpo_tools.py's defaults
REGION = 256 << 10  # one page of a file in each 256 KB (a read at random reads no other page: each is a bit)
RWF_DONTCACHE = 0x80

INODES = """import json, os
inodes = []
for cpu in CPUS:
    os.sched_setaffinity(0, {cpu})
    read, write = os.pipe()
    inodes.append(os.fstat(read).st_ino)
    os.close(read)
    os.close(write)
print(json.dumps(inodes))
"""
SEND_INODES = """import json, os, time
start, made = time.process_time(), 0
for cpu, symbol, offset in zip(CPUS, SYMBOLS, OFFSETS):
    os.sched_setaffinity(0, {cpu})
    while True:
        read, write = os.pipe()
        inode = os.fstat(read).st_ino
        os.close(read)
        os.close(write)
        made += 1
        seen = inode + offset  # what the next call's pipe here will take
        if (seen >> SHIFT & MASK == symbol and seen & LOW == CENTER
                and (inode - 1) % 1024 + offset + SPREAD < 1024):  # and in this batch of 1024
            break
print(json.dumps([made, time.process_time() - start]))
"""
SEND_PAGES = """import os, time
start = time.monotonic()
for path, offset in PAGES:
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, 4096, offset)
    os.close(fd)
print(round(time.monotonic() - start, 3))
"""
RECEIVE_PAGES = """import json, os, time
buffer = bytearray(4096)
fd = os.open(os.__file__, os.O_RDONLY)
try:  # a read that leaves an uncached page uncached, where it is allowed
    os.preadv(fd, [buffer], 0, DONTCACHE)
    flags = DONTCACHE
except OSError as e:
    flags = -e.errno
cached = []  # a page every call has cached (its own module's first): what a cached read takes here
for _ in range(32):
    begin = time.perf_counter()
    os.preadv(fd, [buffer], 0)
    cached.append(time.perf_counter() - begin)
os.close(fd)
times, start = [], time.monotonic()
for path, offset in PAGES:
    fd = os.open(path, os.O_RDONLY)
    begin = time.perf_counter()
    os.preadv(fd, [buffer], offset, max(flags, 0))
    times.append(time.perf_counter() - begin)
    os.close(fd)
print(json.dumps([times, flags, time.monotonic() - start, sorted(cached)[16]]))
"""
FILL_MEMORY = """import os, time
start, buffer, held = time.monotonic(), bytearray(1 << 20), []
try:
    while True:
        held.append(b'x' * (16 << 20))  # written: each page counted in the cgroup
except MemoryError:
    pass
tmp = 0
try:
    for i in range(64):
        with open(f'/tmp/fill{i}', 'wb') as f:
            f.write(b'x' * (1 << 20))
        tmp += 1
except OSError:
    pass
read = 0
for path in FILES:
    fd = os.open(path, os.O_RDONLY)
    while read < READ_MB << 20:
        n = os.readv(fd, [buffer])
        if not n:
            break
        read += n
    os.close(fd)
print(len(held) * 16, tmp, read >> 20, round(time.monotonic() - start, 1))
"""
CONTEND_SEND = """import os, time
os.sched_setaffinity(0, CPU)
for i, bit in enumerate(BITS):
    end = START + (i + 1) * SLOT
    if bit:
        while time.time() < end:
            pass
    else:
        time.sleep(max(0.0, end - time.time()))
print('sent')
"""
CONTEND_RECEIVE = """import json, os, time
os.sched_setaffinity(0, CPU)
time.sleep(max(0.0, START - time.time()))
counts = []
for i in range(SLOTS):
    end, count = START + (i + 1) * SLOT, 0
    while time.time() < end:
        count += 1
    counts.append(count)
print(json.dumps(counts))
"""


def fill(template, **values):
    """The template's upper-case names replaced by the values' repr (the longest names first)."""
    for name in sorted(values, key=len, reverse=True):
        template = template.replace(name, repr(values[name]))
    return template


class Packed:
    """A list of pages (path, offset) as an expression that a call's code unpacks: the paths once, the list
    compressed, so that thousands of pages fit a call's 50,000 characters."""

    def __init__(self, pages):
        files = sorted({path for path, _ in pages})
        index = {path: i for i, path in enumerate(files)}
        data = json.dumps([files, [[index[path], offset] for path, offset in pages]]).encode()
        self.text = base64.b85encode(zlib.compress(data, 9)).decode()

    def __repr__(self):
        return (f"(lambda files, pages: [(files[i], offset) for i, offset in pages])(*__import__('json').loads("
                f"__import__('zlib').decompress(__import__('base64').b85decode({self.text!r}))))")


def entropy(p):
    return 0.0 if p <= 0 or p >= 1 else -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def symbol_information(bits, error_rate):
    """Bits a symbol of an M-ary symmetric channel carries (M = 2^bits, each wrong symbol equally likely): 0 at chance
    (error rate 1 - 1/M) and beyond."""
    if error_rate >= 1 - 2.0 ** -bits:
        return 0.0
    wrong = error_rate * math.log2(2 ** bits - 1) if error_rate > 0 else 0.0
    return bits - entropy(error_rate) - wrong


def sandbox(**kwargs):
    return PythonSandbox(num_workers=kwargs.pop("workers", 2), timeout=TIMEOUT, memory_mb=MEMORY_MB, modules=MODULES,
                         max_output_chars=1 << 16, **kwargs)  # room for a receiver's observations


# ---- (a) the inode counter ------------------------------------------------------------------------------------------


def calibrate(box, cpus, calls):
    """Per CPU the offset between a call's last pipe and the next call's first (the median over `calls` pairs), and
    the largest deviation from it over all CPUs and pairs."""
    read = fill(INODES, CPUS=cpus)
    differences = []
    for _ in range(calls):
        (first, _), = box.run([read])
        (second, _), = box.run([read])
        differences.append([b - a for a, b in zip(json.loads(first), json.loads(second))])
    offsets = [int(statistics.median(column)) for column in zip(*differences)]
    spread = max(abs(d - o) for row in differences for d, o in zip(row, offsets))
    return offsets, spread


def inode_sweep(box, cpus, offsets, spread, shift, bits_list, trials, rng):
    """Rows of the inode counter's table for one sandbox and shift (the bits left below the symbol): per K, what the
    senders spent and the receivers decoded. Stops after a K at which every sender was stopped."""
    rows = []
    for bits in bits_list:
        cpu_seconds, pipes, right, stopped = [], [], 0, 0
        for _ in range(trials):
            symbols = [rng.randrange(2 ** bits) for _ in cpus]
            code = fill(SEND_INODES, CPUS=cpus, SYMBOLS=symbols, OFFSETS=offsets, SHIFT=shift, MASK=2 ** bits - 1,
                        LOW=2 ** shift - 1, CENTER=2 ** (shift - 1), SPREAD=spread)
            (output, error), = box.run([code])
            (seen, _), = box.run([fill(INODES, CPUS=cpus)])
            if error:  # stopped at the CPU limit (those seconds spent) or at the cap: its symbols count as wrong
                stopped += 1
                cpu_seconds += [cpu_limit(TIMEOUT)] if "CPU" in error else []
                continue
            made, seconds = json.loads(output)
            pipes.append(made)
            cpu_seconds.append(seconds)
            right += sum((inode >> shift) % 2 ** bits == symbol for inode, symbol in zip(json.loads(seen), symbols))
        error_rate = 1 - right / (trials * len(cpus))
        nan = float("nan")
        rows.append(dict(bits=bits, shift=shift, cpu=statistics.median(cpu_seconds) if cpu_seconds else nan,
                         pipes=statistics.median(pipes) if pipes else nan, right=right, symbols=trials * len(cpus),
                         stopped=stopped, passed=len(cpus) * symbol_information(bits, error_rate)))
        if stopped == trials:
            break
    return rows


# ---- (b) the page cache ---------------------------------------------------------------------------------------------


def view_files(min_size, enough):
    """Regular files of the calls' view (system folders and the Python installation) of at least min_size bytes that
    every user may read, each once, in a fixed order, until their sizes add up to `enough` bytes (a walk of the whole
    view takes seconds)."""
    seen, files, total = set(), [], 0
    folders = sorted({os.path.abspath(f) for f in [*SYSTEM_FOLDERS, *python_installation()] if os.path.isdir(f)})
    tops = {os.path.realpath(folder) for folder in folders}
    for folder in folders:
        for top, children, names in os.walk(folder):
            children[:] = [c for c in children if os.path.realpath(os.path.join(top, c)) not in tops]  # walked
            for name in names:
                path = os.path.join(top, name)
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                if (os.path.stat.S_ISREG(info.st_mode) and info.st_mode & 0o004 and info.st_size >= min_size
                        and (info.st_dev, info.st_ino) not in seen):
                    seen.add((info.st_dev, info.st_ino))
                    files.append(path)
                    total += info.st_size
                    if total >= enough:
                        return sorted(files)
    return sorted(files)


class PageCheck:
    """Whether a page of a file is in the page cache, without reading it (mincore on a mapping of it); None where this
    process may not ask (mincore answers "cached" for a file it neither owns nor may write, unless it is root)."""

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.works = os.geteuid() == 0

    def cached(self, fd, offset):
        if not self.works:
            return None
        address = self.libc.mmap(None, 4096, 1, 1, fd, offset)  # PROT_READ, MAP_SHARED: maps, reads nothing
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        vector = (ctypes.c_ubyte * 1)()
        try:
            return None if self.libc.mincore(address, 4096, vector) else bool(vector[0] & 1)
        finally:
            self.libc.munmap(address, 4096)


def uncached_pages(files, count, check, rng, taken, must=True):
    """`count` pages (path, offset), one in a region (REGION) of a file, past its first region, not cached (where the
    check can tell); their regions join `taken` (path, region), and are left out. Fewer where the files have fewer,
    or an error where it `must`."""
    pages = []
    for path in rng.sample(files, len(files)):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for region in range(1, size // REGION):
                offset = region * REGION + rng.randrange(REGION // 8192) * 4096  # the region's first half
                if (path, region) not in taken and check.cached(f.fileno(), offset) is not True:
                    pages.append((path, offset))
                    taken.add((path, region))
                if len(pages) == count:
                    return pages
    if must:
        raise RuntimeError(f"only {len(pages)} uncached pages in the view's files")
    return pages


def uncached_files(files, used, size, check):
    """Files not in `used`, the largest first, of which none of 16 pages spread over each is cached (where the check
    can tell), until their sizes add up to `size`: a call that reads them reads the disk, its page cache grows."""
    chosen, total = [], 0
    for path in sorted(files, key=os.path.getsize, reverse=True):
        if path in used or total >= size:
            continue
        with open(path, "rb") as f:
            length = os.fstat(f.fileno()).st_size
            if any(check.cached(f.fileno(), length * i // 16 & ~4095) for i in range(16)):
                continue
        chosen.append(path)
        total += length
    return chosen


def message(count, rng):
    """count bits, half of them ones, in a random order."""
    bits = [1] * (count // 2) + [0] * (count - count // 2)
    rng.shuffle(bits)
    return bits


CACHED_TIMES = 10  # a read of more than 10 times the median of a cached page's reads came from the disk


def page_round(box, pages, bits, receivers):
    """Send `bits` on `pages` (a sender call), then read them back (`receivers` later calls, one after the other), each
    page a 1 where its read took at most CACHED_TIMES the receiver's cached read. Returns the seconds the sender took,
    [(bits right, seconds)] of the receivers and whether they read with RWF_DONTCACHE."""
    ones = [page for page, bit in zip(pages, bits) if bit]
    (sent, error), = box.run([fill(SEND_PAGES, PAGES=Packed(ones))])
    assert not error, error
    received = []
    for _ in range(receivers):
        (output, error), = box.run([fill(RECEIVE_PAGES, PAGES=Packed(pages), DONTCACHE=RWF_DONTCACHE)])
        assert not error, error
        times, flags, seconds, cached = json.loads(output)
        received.append((sum((t <= CACHED_TIMES * cached) == bool(bit) for t, bit in zip(times, bits)), seconds))
    dontcache = ("yes" if flags == RWF_DONTCACHE else "no (refused)" if flags == -errno.EPERM
                 else f"no (the kernel: {errno.errorcode.get(-flags, flags)})")
    return float(sent), received, dontcache


def page_cache(pages_count, reclaim_mb, rng):
    """The page cache's rows (setting, message, receiver, sender s, bits right, receiver s, RWF_DONTCACHE) and notes:
    the sandbox (two receivers of one message), a message on other pages, a later call's memory-cgroup reclaim and a
    second message on the same pages (all calls of one sandbox process), and the sandbox without its filter."""
    check, taken = PageCheck(), set()
    files = view_files(2 * REGION, 32 * pages_count * REGION + (4 * reclaim_mb << 20))  # pages, reads to reclaim
    if len(uncached_pages(files, 3 * pages_count, check, random.Random(0), set(), must=False)) < 3 * pages_count:
        files = view_files(2 * REGION, float("inf"))  # (a machine that has read much of its view: all of it)
    rows, notes = [], []
    with sandbox(workers=1) as box:  # one sandbox process: every call below shares its memory cgroup
        sent, received, dontcache = page_round(box, uncached_pages(files, pages_count, check, rng, taken),
                                               message(pages_count, rng), 2)
        rows += [("the sandbox", "1", "the next call", sent, *received[0], dontcache),
                 ("the sandbox", "1", "the call after it", sent, *received[1], dontcache)]
        pages = uncached_pages(files, pages_count, check, rng, taken)
        sent, received, dontcache = page_round(box, pages, message(pages_count, rng), 1)
        rows.append(("the sandbox, other pages", "2", "the next call", sent, *received[0], dontcache))
        used = {path for path, _ in taken}  # its reads would cache the pages of the messages
        (filled, error), = box.run([fill(FILL_MEMORY, FILES=uncached_files(files, used, 2 * reclaim_mb << 20, check),
                                         READ_MB=reclaim_mb)])
        held, tmp, read, seconds = filled.split() if not error else ("?", "?", "?", "?")
        notes.append(f"The reclaiming call held {held} MB, wrote {tmp} MB to its /tmp and read {read} MB of the "
                     f"view's files in {seconds} s{' (' + error + ')' if error else ''}.")
        sent, received, dontcache = page_round(box, pages, message(pages_count, rng), 1)
        rows.append(("the same pages, after a later call's memory-cgroup reclaim", "3", "the next call", sent,
                     *received[0], dontcache))
    with sandbox(workers=1, _without=("seccomp",)) as box:  # (so, without the cap of pipes and sockets either)
        sent, received, dontcache = page_round(box, uncached_pages(files, pages_count, check, rng, taken),
                                               message(pages_count, rng), 2)
        rows += [("the sandbox without its system-call filter", "4", "the next call", sent, *received[0], dontcache),
                 ("the sandbox without its system-call filter", "4", "the call after it", sent, *received[1],
                  dontcache)]
    if not check.works:
        notes.append("The pages were not checked to be uncached (mincore needs root here).")
    return rows, notes


# ---- (c) CPU contention ---------------------------------------------------------------------------------------------


def contention(box, cpu, slots, slot_s, rng):
    """Bits right of `slots` random bits sent by one call to a concurrent one through their shared CPU."""
    bits = [rng.randrange(2) for _ in range(slots)]
    start = time.time() + 0.5  # both calls have started by then
    values = dict(CPU={cpu}, START=start, SLOT=slot_s)
    sent, received = box.run([fill(CONTEND_SEND, BITS=bits, **values), fill(CONTEND_RECEIVE, SLOTS=slots, **values)])
    assert not sent[1] and not received[1], (sent, received)
    counts = json.loads(received[0])
    cut = statistics.mean(counts)
    for _ in range(20):  # two means: the cut halfway between the slots below it and those above
        low, high = [c for c in counts if c < cut], [c for c in counts if c >= cut]
        if not low or not high:
            break
        cut = (statistics.mean(low) + statistics.mean(high)) / 2
    return sum((count < cut) == bool(bit) for count, bit in zip(counts, bits))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="sender and receiver calls per K (inode counter)")
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 6, 8, 10, 12, 14, 16],
                        help="bits a CPU the inode counter's sender sends (K)")
    parser.add_argument("--below", type=int, nargs="+", default=[1, 3, 5, 7],
                        help="bits the inode counter's sender leaves below its symbol (for the noise)")
    parser.add_argument("--cpus", type=int, default=0, help="CPUs the inode counter's calls use (0: all)")
    parser.add_argument("--calibration", type=int, default=5, help="pairs of calls that measure the offset")
    parser.add_argument("--pages", type=int, default=2048, help="bits a message through the page cache")
    parser.add_argument("--reclaim_mb", type=int, default=128, help="MB of files the reclaiming call reads")
    parser.add_argument("--slots", type=int, default=64, help="bits a message through CPU contention")
    parser.add_argument("--slot_ms", type=float, nargs="+", default=[10.0, 25.0, 50.0], help="its slots' length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    load = os.getloadavg()[0]
    cpus = sorted(os.sched_getaffinity(0))[:args.cpus or None]
    lines = ["# sandbox_channels", ""]

    # (a)
    inode_rows, lacks = {}, []
    for name, without in (("without the cap", ("pipe cap",)), ("the sandbox", ())):
        with sandbox(_without=without) as box:
            lacks = box.lacks if not without else lacks
            offsets, spread = calibrate(box, cpus, args.calibration)
            rows = []  # more bits below the symbol: fewer errors, more pipes
            for below in args.below:
                rows += inode_sweep(box, cpus, offsets, spread, below, args.bits, args.trials, rng)
            inode_rows[name] = (offsets, spread, rows)
    measured = "; ".join(f"{name}: {offsets}, ±{spread}" for name, (offsets, spread, _) in inode_rows.items())
    lines += ["## The inode counter of pipes and sockets", "",
              f"{len(cpus)} CPUs; a sender call, then the next call of the same sandbox process; {args.trials} "
              f"trials a row. Offsets between two calls' pipes, a CPU (median of {args.calibration} pairs), and the "
              f"largest deviation from them: {measured}.", "",
              "| sandbox | bits a CPU (K) | below the symbol | sender CPU s | pipes made | symbols right | senders "
              "stopped | bits a call passes to the next |", "|---|---|---|---|---|---|---|---|"]
    for name, (_, _, rows) in inode_rows.items():
        lines += [(f"| {name} | {r['bits']} | {r['shift']} | {r['cpu']:.2f} | {r['pipes']:.0f} | {r['right']}/"
                   f"{r['symbols']} | {r['stopped']}/{args.trials} | {r['passed']:.1f} |").replace("nan", "-")
                  for r in rows]
    best = {name: max(rows, key=lambda r: r["passed"]) for name, (_, _, rows) in inode_rows.items()}
    lines += ["", "The most a call passed to the next: " + "; ".join(
        f"{name}, {r['passed']:.1f} bits ({r['bits']} a CPU, {r['shift']} below, the sender's CPU {r['cpu']:.2f} s)"
        for name, r in best.items()) + "."]
    bound = math.log2(math.comb(MAX_PIPES_SOCKETS + len(cpus), len(cpus)))
    lines += ["", f"The cap: {MAX_PIPES_SOCKETS} pipes and sockets a call; the CPU limit {cpu_limit(TIMEOUT)} s (a "
              "sender stopped at it counts those seconds). Whatever the noise, a call that makes n_c of them on CPU c "
              f"(their sum at most {MAX_PIPES_SOCKETS}) leaves the next call one of at most C({MAX_PIPES_SOCKETS} + "
              f"{len(cpus)}, {len(cpus)}) states of these CPUs' counters to tell apart: {bound:.1f} bits.", ""]

    # (b)
    page_rows, notes = page_cache(args.pages, args.reclaim_mb, rng)
    lines += ["## The page cache", "", f"{args.pages} pages (bits) a message.", "",
              "| setting | message | receiver | sender s | bits right | receiver s | read with RWF_DONTCACHE |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {sent} | {receiver} | {sender_s:.2f} | {right}/{args.pages} | {receiver_s:.2f} | {how} |"
              for name, sent, receiver, sender_s, right, receiver_s, how in page_rows]
    lines += ["", f"Half of each message's bits are ones: {args.pages // 2}/{args.pages} right is what a receiver "
              "that reads nothing gets.", *notes, ""]

    # (c)
    lines += ["## CPU contention", "", f"Two concurrent calls pinned to CPU {cpus[0]}; {args.slots} slots a row.", "",
              "| slot ms | bits right | bits a second (1 - H(p)) / slot |", "|---|---|---|"]
    with sandbox() as box:
        for slot_ms in args.slot_ms:
            right = contention(box, cpus[0], args.slots, slot_ms / 1e3, rng)
            rate = (1 - entropy(1 - right / args.slots)) / (slot_ms / 1e3)
            lines.append(f"| {slot_ms:g} | {right}/{args.slots} | {rate:.1f} |")

    sizes = "".join(f" --{name} " + " ".join(f"{v:g}" for v in (value if isinstance(value, list) else [value]))
                    for name, value in vars(args).items() if value != parser.get_default(name))
    lines[1:1] = ["", f"Command: `python benchmarks/sandbox_channels.py{sizes}` ({os.cpu_count()} CPUs, Linux "
                  f"{os.uname().release}, load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; the sandbox "
                  f"lacks: {', '.join(lacks) or 'nothing'})."]
    write_results("sandbox_channels", lines)


if __name__ == "__main__":
    main()
