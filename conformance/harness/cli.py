"""The `brass` command line as a user runs it (a subprocess of this Python), and the structure
of its JSON for snapshots: what the CLI tests (conformance/tools/test_cli.py) and the bench
tests (conformance/tools/test_bench.py) share."""

from __future__ import annotations

import subprocess
import sys


def brass(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "brass", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def json_shape(obj):
    """The JSON's structure with values replaced by their type names (for snapshots)."""
    if isinstance(obj, dict):
        return {k: json_shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_shape(obj[0])] if obj else []
    return type(obj).__name__
