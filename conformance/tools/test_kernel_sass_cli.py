"""ci/kernel_sass.py as a user runs it (a command: the suite imports nothing of ci/). Its
machine code needs ptxas and nvdisasm; what it says of a source it does not have does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("source", ["nope.cu", "kernels/nope.cu"])
def test_an_unknown_source_is_refused_in_a_line(source):
    r = subprocess.run([sys.executable, "ci/kernel_sass.py", source, "attention"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "kernel_sass: no nope.cu in" in r.stderr and "attention.cu" in r.stderr


def test_without_arguments_it_prints_its_usage():
    r = subprocess.run([sys.executable, "ci/kernel_sass.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "python3 ci/kernel_sass.py SOURCE KERNEL" in r.stdout
