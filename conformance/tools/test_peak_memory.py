"""ci/peak_memory.py's accounting on process trees made for it, run as its users run it (a
script; the suite imports nothing of ci/): a child between vfork and exec, which /proc reports
at its parent's full RSS and PSS, is counted once (with its parent), and real processes, a
forked child as alike its parent as can be included, are all counted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024

# Parent holds N MiB (touched), vforks; the child sleeps S seconds in the parent's address
# space (as a subprocess child does between vfork and exec, only longer), then _exits.
VFORKER = r"""
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
int main(int argc, char **argv) {
    size_t n = (size_t)atol(argv[1]) << 20;
    char *p = malloc(n);
    memset(p, 1, n);
    pid_t c = vfork();
    if (c == 0) { sleep(atoi(argv[2])); _exit(0); }
    waitpid(c, 0, 0);
    return p[n - 1] == 1 ? 0 : 1;
}
"""

# Parent holds 150 MiB, forks a child (same executable and command line, its own address
# space) that adds 100 MiB of its own, and starts a program holding 60 MiB; all sleep.
TREE = """
import os, subprocess, sys, time
a = b"\\1" * (150 << 20)
pid = os.fork()
if pid == 0:
    b = b"\\2" * (100 << 20)
    time.sleep(3)
    os._exit(0)
p = subprocess.Popen([sys.executable, "-c", "import time; c = b'\\\\3' * (60 << 20); time.sleep(2.5)"])
os.waitpid(pid, 0)
p.wait()
"""


def peak(tmp_path, *cmd, no_kcmp=False) -> dict:
    out = tmp_path / "peak.json"
    args = [sys.executable, str(ROOT / "ci" / "peak_memory.py"), "--interval", "0.1", "--json", str(out)]
    r = subprocess.run(args + (["--no-kcmp"] if no_kcmp else []) + ["--", *map(str, cmd)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def vforker(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the vfork helper (Python cannot vfork and wait)")
    d = tmp_path_factory.mktemp("vfork")
    (d / "vforker.c").write_text(VFORKER)
    subprocess.run([cc, "-O0", "-o", str(d / "vforker"), str(d / "vforker.c")], check=True)
    return d / "vforker"


@pytest.mark.parametrize("no_kcmp", [False, True], ids=["kcmp", "same-image"])
def test_vfork_child_counted_once(tmp_path, vforker, no_kcmp):
    got = peak(tmp_path, vforker, 300, 2, no_kcmp=no_kcmp)
    # the parent's 300 MiB once, plus the C runtime's few MiB; counted twice it would be > 600
    assert 300 * MIB <= got["peak_kib"] < 330 * MIB, got
    assert 300 * MIB <= got["peak_pss_kib"] < 330 * MIB, got
    assert got["shared_left_out"] > 0, "the sampler never saw the child in its vfork window"


@pytest.mark.parametrize("no_kcmp", [False, True], ids=["kcmp", "same-image"])
def test_real_processes_all_counted(tmp_path, no_kcmp):
    got = peak(tmp_path, sys.executable, "-c", TREE, no_kcmp=no_kcmp)
    assert got["shared_left_out"] == 0, got
    # RSS: parent 150, forked child 150 (copy-on-write, still its parent's pages) + 100, the
    # program 60; PSS: the 150 shared once. Python's own few tens of MiB per process on top.
    assert got["peak_kib"] >= (150 + 250 + 60) * MIB, got
    assert got["peak_pss_kib"] >= (150 + 100 + 60) * MIB, got
    assert got["peak_pss_kib"] < got["peak_kib"] - 100 * MIB, got
