"""Servers to grade, each a process on a loopback port: `brass serve` (numpy); llama.cpp's own
`llama-server` (built by ci/build_llama_server.py), started with the settings the goldens were
recorded with; and llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, its
`server` extra; pip install -e '.[record]'). For ci/grade_engines.py and
conformance/tools/test_lm_eval.py."""

from __future__ import annotations

import importlib.util
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


# llama-server's options for the settings that change numbers, as golden/manifest.json's
# `settings` record them (flash_attn_type 0, type_k and type_v 1 = F16, swa_full, use_extra_bufts
# false): each changes logits by up to ~1 (../shared/notes/llamacpp-reference.md). The README's
# llama-server example gives them too (conformance/tools/test_conform.py checks it).
LLAMA_SERVER_SETTINGS = ("--flash-attn", "off", "--cache-type-k", "f16", "--cache-type-v", "f16",
                         "--swa-full", "--no-repack")


def built_llama_server() -> Path:
    """Where ci/build_llama_server.py keeps the llama-server it builds (its cache path and
    version): what ci/grade_engines.py and test_lm_eval.py start unless told another."""
    spec = importlib.util.spec_from_file_location("build_llama_server", ROOT / "ci" / "build_llama_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.binary()


def llama_cpp_server(name: str, logdir: Path, binary: Path, n_ctx: int = N_CTX) -> Server:
    """llama.cpp's own llama-server (`binary`) on the catalog's file, its model id the catalog
    name, with the settings that change numbers pinned as the goldens were recorded
    (LLAMA_SERVER_SETTINGS) and one batch as large as the context (a batch's split into ubatches
    leaves logits bitwise equal; the goldens' was one). One slot, and no prompt cache: each
    request's prompt is decoded whole, as the goldens' were, whatever the request before it (a
    reused prefix would leave the rest to a smaller batch, or one token to the decode path, which
    rounds differently)."""
    from brass import catalog
    port = free_port()
    threads = str(os.cpu_count() or 2)
    return Server([str(binary), "--model", str(catalog.fetch(name, quiet=True)), "--alias", name,
                   "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(n_ctx),
                   "--batch-size", str(n_ctx), "--ubatch-size", str(n_ctx), "--threads", threads,
                   "--threads-batch", threads, *LLAMA_SERVER_SETTINGS, "--parallel", "1",
                   "--no-cache-prompt", "--fit", "off", "--no-warmup", "--no-webui"],
                  port, logdir / f"llama-server-{name}.log")


def llama_cpp_server_missing(binary: Path) -> str:
    """'' where `binary` runs (`--version`), else why not (a line)."""
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"llama-server does not run ({binary}: {e}; build it with python ci/build_llama_server.py)"
    if r.returncode != 0:
        return f"llama-server does not run ({binary} --version: exit {r.returncode})"
    return ""


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
