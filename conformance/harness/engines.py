"""Servers to grade, each a process on a loopback port: `brass serve` (numpy) and llama.cpp's own,
through llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, its `server`
extra; pip install -e '.[record]'). For ci/grade_engines.py and conformance/tools/test_lm_eval.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the longest golden prompt (gemma3's window prompt, 575 + 32 tokens) with room to spare
N_CTX = 2048


class ServerFailed(RuntimeError):
    pass


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    """A server process on a loopback port, up once GET `ready` answers 200; its output goes to
    `logfile`. stop() ends it (terminate, then kill after 30 s)."""

    def __init__(self, cmd: list[str], port: int, logfile: Path, ready: str = "/v1/models",
                 timeout: float = 600):
        self.port, self.url, self.logfile = port, f"http://127.0.0.1:{port}", logfile
        self.out = open(logfile, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + ready, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = logfile.read_text(errors="replace")[-2000:]
                raise ServerFailed(f"{' '.join(cmd[:5])} did not start:\n{tail}")
            time.sleep(0.5)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def brass_serve(name: str, logdir: Path, n_ctx: int = N_CTX) -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "brass", "serve", name, "--backend", "numpy", "--port", str(port),
                   "--ctx", str(n_ctx), "--parallel", "2"], port, logdir / f"brass-{name}.log")


def llama_server(name: str, logdir: Path, n_ctx: int = N_CTX) -> Server:
    """llama-cpp-python's server on the catalog's file, its model id the catalog name."""
    from brass import catalog
    port = free_port()
    return Server([sys.executable, "-m", "llama_cpp.server", "--model", str(catalog.fetch(name, quiet=True)),
                   "--model_alias", name, "--port", str(port), "--n_ctx", str(n_ctx),
                   "--n_threads", str(os.cpu_count() or 2), "--verbose", "false"],
                  port, logdir / f"llama-{name}.log")


def llama_server_missing() -> str:
    """'' where llama-cpp-python's server imports here, else why not (a line)."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp.server.app"], capture_output=True, text=True)
    if r.returncode == 0:
        return ""
    last = (r.stderr.strip().splitlines() or ["?"])[-1]
    return f"llama-cpp-python's server does not import ({last}; pip install -e '.[record]')"
