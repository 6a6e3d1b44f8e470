"""Peak memory of a command's whole process tree.

    python ci/peak_memory.py [--interval 0.5] [--json PATH] -- COMMAND [ARGS...]

Runs COMMAND and, every INTERVAL seconds, sums the resident set size (VmRSS in
/proc/<pid>/status) and the proportional set size (Pss in /proc/<pid>/smaps_rollup) of the
command and every process descended from it: pytest workers,
`brass serve` subprocesses, anything a test starts. A process that re-parents itself away
(a daemon that double-forks) is kept as long as it was seen once as a descendant. Prints the
peak sum, the sample it happened at and the largest processes at that moment, then exits with
the command's status.

Where the command runs in a cgroup (v2) of its own, memory.peak is the exact figure; on a
shared machine the cgroup holds other people's processes too, so this sampled sum is the one
the issue's bar ("<= 6 GB for the whole process tree") is measured with. Sampling can miss a
spike shorter than the interval. RSS counts shared pages (the page cache of an mmap'd model, a
forked child's pages still shared with its parent: pty.fork, fork-then-exec) once per process
that maps them, so its sum errs high; PSS divides each shared page among its sharers, so its
sum is the memory the tree holds.

A child between vfork and exec (how subprocess starts a program) runs in its parent's memory:
/proc reports the parent's RSS and PSS for it too, so counting it would count the parent twice
(on a worker holding 4 GiB, a 4 GiB spike as long as the sample lands in that window). A process
that shares its parent's address space (kcmp(KCMP_VM); where kcmp is refused, the same
executable, command line and virtual size as its parent) is left out of the sum; a forked child
with an address space of its own, however alike, is not.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time

_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_KCMP_VM = 1
_libc = None


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may hold spaces and parentheses: the fields after the last ')' are fixed
        fields = stat[stat.rindex(")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(name))
    return kids


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, virtual size in bytes) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()     # fields[0] is field 3 (state)
    return int(fields[1]), int(fields[20])


def _kcmp_vm(a: int, b: int) -> bool | None:
    """Whether processes a and b share one address space (kcmp KCMP_VM); None where the kernel
    or a seccomp filter refuses kcmp, or a process is gone."""
    global _libc
    if _SYS_KCMP is None:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    r = _libc.syscall(_SYS_KCMP, a, b, _KCMP_VM, 0, 0)
    return None if r < 0 else r == 0


def _same_image(a: int, b: int) -> bool:
    """Where kcmp is refused: same executable, command line and virtual size, as a child
    between vfork and exec has (it reads its parent's memory for all three)."""
    try:
        if os.readlink(f"/proc/{a}/exe") != os.readlink(f"/proc/{b}/exe"):
            return False
        with open(f"/proc/{a}/cmdline", "rb") as fa, open(f"/proc/{b}/cmdline", "rb") as fb:
            if fa.read() != fb.read():
                return False
    except OSError:
        return False
    sa, sb = _stat(a), _stat(b)
    return sa is not None and sb is not None and sa[1] == sb[1]


def shares_parent_memory(pid: int, use_kcmp: bool = True) -> bool:
    """Whether `pid` runs in its parent's address space (a vfork child before its exec): its
    RSS and PSS are then the parent's, counted with the parent."""
    st = _stat(pid)
    if st is None or st[0] <= 1:
        return False
    shared = _kcmp_vm(pid, st[0]) if use_kcmp else None
    return _same_image(pid, st[0]) if shared is None else shared


def _rss_kib(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    rss, name = 0, "?"
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("Name:"):
            name = line.split(None, 1)[1].strip() if len(line.split()) > 1 else "?"
    return rss, name


def _pss_kib(pid: int) -> int | None:
    """The process's proportional set size: each resident page divided by the number of processes
    that map it. A forked child's pages, still shared with its parent, and a model file mapped
    by two processes, count once in a sum of PSS, where a sum of RSS counts them in each."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def tree(root: int, known: set[int]) -> set[int]:
    kids = _children()
    seen, stack = set(), [root, *known]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(kids.get(pid, ()))
    return seen


def sample(pids, use_kcmp: bool = True) -> tuple[int, int, list, int]:
    """(RSS sum KiB, PSS sum KiB, [(rss KiB, pid, name)], processes left out as running in
    their parent's address space) of the processes `pids`."""
    total, pss, top, shared = 0, 0, [], 0
    for pid in pids:
        if shares_parent_memory(pid, use_kcmp):
            shared += 1
            continue
        got = _rss_kib(pid)
        if got is None:
            continue
        total += got[0]
        pss += _pss_kib(pid) or 0
        top.append((got[0], pid, got[1]))
    return total, pss, top, shared


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples (0.5)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--no-kcmp", action="store_true",
                    help="tell a process in its parent's address space without kcmp, as where "
                         "the kernel refuses it (same executable, command line, virtual size)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")

    proc = subprocess.Popen(cmd)
    known: set[int] = set()
    peak_kib, peak_t, peak_top, samples = 0, 0.0, [], 0
    peak_pss, peak_pss_t = 0, 0.0
    shared_seen = 0                 # (process, sample) pairs left out: a parent's memory
    t0 = time.monotonic()
    while True:
        done = proc.poll() is not None
        pids = tree(proc.pid, known) if not done else known
        known |= pids
        total, pss, top, shared = sample(pids, use_kcmp=not args.no_kcmp)
        shared_seen += shared
        samples += 1
        if pss > peak_pss:
            peak_pss, peak_pss_t = pss, time.monotonic() - t0
        if total > peak_kib:
            peak_kib, peak_t = total, time.monotonic() - t0
            top.sort(reverse=True)
            peak_top = [(kib, pid, name, _cmdline(pid)) for kib, pid, name in top[:5]]
        # forget pids that have exited so a recycled pid is not counted
        known = {pid for pid in known if os.path.exists(f"/proc/{pid}")}
        if done:
            break
        time.sleep(args.interval)
    rc = proc.returncode
    wall = time.monotonic() - t0
    print(f"peak_memory: peak RSS of the process tree {peak_kib / 1024**2:.2f} GiB "
          f"({peak_kib} KiB) at {peak_t:.0f} s of {wall:.0f} s, {samples} samples, rc={rc}",
          file=sys.stderr)
    for kib, pid, name, cmdline in peak_top:
        print(f"peak_memory:   {kib / 1024**2:6.2f} GiB  pid {pid} {name}: {cmdline}", file=sys.stderr)
    print(f"peak_memory: peak PSS of the process tree {peak_pss / 1024**2:.2f} GiB ({peak_pss} KiB) "
          f"at {peak_pss_t:.0f} s (pages shared between processes counted once)", file=sys.stderr)
    if shared_seen:
        print(f"peak_memory: left out {shared_seen} time(s) a process in its parent's address "
              f"space (between vfork and exec)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_kib": peak_kib, "peak_at_s": round(peak_t, 1), "wall_s": round(wall, 1),
                       "samples": samples, "rc": rc, "peak_pss_kib": peak_pss,
                       "peak_pss_at_s": round(peak_pss_t, 1), "shared_left_out": shared_seen,
                       "top": [{"kib": k, "pid": p, "name": n, "cmdline": c} for k, p, n, c in peak_top]},
                      f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
