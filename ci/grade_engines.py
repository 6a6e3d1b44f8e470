#!/usr/bin/env python
"""Grade real engines with `brass conform` (engine/conform.py), as a step of .ci/run after the
README's test command (ci/grade_engines.sh runs it):

- `brass serve` (numpy) on the three catalog models: every check holds;
- llama.cpp's own `llama-server` (ci/build_llama_server.py builds it; --llama-server), started
  with the settings the goldens were recorded with (conformance/harness/engines.py), on the same
  GGUFs: the reference; every check it supports holds. It serves no prompt logprobs (it takes
  `echo` and answers with the generated token's alone), so the teacher-forced checks are
  skipped, and named;
- llama.cpp through llama-cpp-python's server (`python -m llama_cpp.server`, the `record`
  extra): every check holds but where its echo is known to be wrong (KNOWN_DEFECTS: those checks
  fail, and brass conform names the defect), on the checks that fit the step's time
  (LLAMA_CHECKS);
- planted wrong servers (conformance/harness/planted.py, a proxy in front of `brass serve`):
  each fails, naming the check in PLANTED.

Prints each model's table, then one line per grading; exit 0 when every outcome is the expected
one, 1 otherwise, 2 when a server cannot start. Where llama-server was not built or
llama-cpp-python's server does not import, their gradings say so and are not counted as
failures.

    python ci/grade_engines.py [--models smollm2-135m] [--engines brass,planted,llama-server,llama-cpp-python]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from brass import catalog, conform  # noqa: E402
from conformance.harness import goldens  # noqa: E402
from conformance.harness.engines import (  # noqa: E402
    ServerFailed, brass_serve, built_llama_server, llama_cpp_server, llama_cpp_server_missing, llama_server,
    llama_server_missing)
from conformance.harness.planted import Proxy  # noqa: E402

ENGINES = ("brass", "planted", "llama-server", "llama-cpp-python")
# llama-server's context: the goldens' (golden/manifest.json settings.context.n_ctx), which holds
# the longest golden prompt (gemma3's window prompt, 575 + 32 tokens)
LLAMA_SERVER_CTX = 1024

MODELS = conform.DEFAULT_MODELS

# llama-cpp-python's echo (its `_create_completion`) pairs each prompt token with the logits
# that follow it, not the ones that predicted it, wherever the prompt does not start with BOS
# (abetlen/llama-cpp-python#1983: open): on SmolLM2 and Qwen2.5 every echoed distribution is one
# position late. The checks that read echo fail there, and brass conform's note names the
# defect; gemma3 starts with BOS, which the echo drops, and its positions line up.
LATE_ECHO = ("teacher-forced argmax", "top-k gaps", "top-1 logprob")
# gemma3-270m's file carries no chat template. llama.cpp then renders ChatML
# (llama_chat_apply_template's default, as llama-server does: the golden); llama-cpp-python's
# server falls back to its "llama-2" format instead (and its "chatml" format would add an empty
# system turn), so its prompt_tokens are another rendering's.
KNOWN_DEFECTS = {
    ("llama-cpp-python", "smollm2-135m"): (LATE_ECHO, "one position late"),
    ("llama-cpp-python", "qwen2.5-coder-0.5b"): (LATE_ECHO, "one position late"),
    ("llama-cpp-python", "gemma3-270m"): (("chat template",), ""),
}

# llama-cpp-python's logprobs sort the whole vocabulary in Python for every position they cover
# (its `_create_completion`): a third of a second or more a position for Gemma 3's 262,144
# tokens on 2 cores, and the goldens hold about 930 teacher-forced positions for gemma3-270m,
# several minutes of this step's 15. Its other checks run; the teacher-forced ones are left out.
LLAMA_CHECKS = {"gemma3-270m": ("greedy", "tokenize", "chat-template")}

# (mode, model, the checks run, the checks that must fail, why): the three planted
# servers. A planted defect may make other checks fail too (a prompt without BOS changes the
# logits): those are listed, not required.
PLANTED = [
    ("swap", "smollm2-135m", tuple(conform.CHECK_GROUPS), ("teacher-forced argmax",),
     "one echo position's top-1 and top-2 logprobs traded"),
    ("no-generation-prompt", "smollm2-135m", tuple(conform.CHECK_GROUPS), ("chat template",),
     "the chat template rendered without the generation prompt"),
    ("drop-bos", "gemma3-270m", ("teacher-forced", "tokenize"), ("tokenize",),
     "BOS dropped from /tokenize and from token-id prompts"),
]


def log(msg: str):
    print(msg, flush=True)


def grade(url: str, name: str, concurrency: int, checks=tuple(conform.CHECK_GROUPS)) -> conform.ModelReport:
    t0 = time.monotonic()
    report = conform.conform(url, [name], timeout=1800, concurrency=concurrency, checks=checks).models[0]
    log(report.table())
    log(f"  ({time.monotonic() - t0:.0f} s)")
    return report


def outcome(report: conform.ModelReport, must_fail=(), note: str = "", exact: bool = True) -> tuple[bool, str]:
    """(whether the report is the expected one, what it shows): passed where nothing must fail;
    else failed by `must_fail` (exactly, or at least where not `exact`), the first of them with
    `note` in its note."""
    if report.refused:
        return False, f"refused: {report.refused}"
    failed = [c.name for c in report.checks if c.status == "fail"]
    skipped = [c.name for c in report.checks if c.status == "skipped"]
    shown = (f"failed: {', '.join(failed)}" if failed else "passed") + \
        (f"; skipped: {', '.join(skipped)}" if skipped else "")
    ok = set(failed) == set(must_fail) if exact else set(must_fail) <= set(failed)
    if ok and note and not any(note in c.note for c in report.checks if c.name == must_fail[0]):
        return False, f"{shown}; {must_fail[0]} does not name the defect ({note!r})"
    return ok, shown


def main(argv=None) -> int:
    try:
        return run(argv)
    except ServerFailed as e:
        print(f"grade_engines: {e}", file=sys.stderr)
        return 2


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="catalog models to grade (default: the three)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="which gradings (default: %(default)s)")
    ap.add_argument("--llama-server", type=Path, default=built_llama_server(),
                    help="llama.cpp's llama-server binary (default: ci/build_llama_server.py's, %(default)s)")
    ap.add_argument("--logs", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "grade_engines",
                    help="folder for the servers' logs")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    engines = set(args.engines.split(","))
    if engines - set(ENGINES):
        ap.error(f"--engines takes {', '.join(ENGINES)}, not {', '.join(sorted(engines - set(ENGINES)))}")
    args.logs.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    results: list[tuple[str, str, str, bool, str]] = []     # engine, model, expected, ok, shown

    # brass serve through a relaying proxy (the honest run fills its cache), then the planted
    # servers: the same proxy with a defect
    for name in models if engines & {"brass", "planted"} else ():
        planted = [p for p in PLANTED if p[1] == name] if "planted" in engines else []
        if "brass" not in engines and not planted:
            continue
        log(f"\n=== brass serve (numpy) {name}")
        srv = brass_serve(name, args.logs)
        proxy = None
        try:
            from brass.chat_template import ChatTemplate
            from brass.model import Model
            m = Model(catalog.fetch(name, quiet=True), backend="numpy", n_ctx=64, quiet=True)
            proxy = Proxy(srv.url, bos=m.tokenizer.bos_id if m.tokenizer.add_bos else None,
                          template=ChatTemplate.from_gguf(m.gguf, m.tokenizer))
            if "brass" in engines:
                results.append(("brass serve", name, "passes", *outcome(grade(proxy.url, name, 2))))
            for mode, _, checks, must_fail, why in planted:
                log(f"\n=== planted {mode} ({why}) {name}")
                proxy.mode = mode
                if mode == "swap":
                    p = next(p for p in goldens.prompts(name) if p.name == "long")
                    j = next(j for j in range(len(p.prompt_ids), len(p.tf_ids) - 1)
                             if p.tf_margin[j] > conform.ARGMAX_EPS)
                    proxy.swap_at = (p.tf_ids, j + 1)
                results.append((f"planted {mode}", name, f"fails {', '.join(must_fail)}",
                                *outcome(grade(proxy.url, name, 2, checks), must_fail, exact=False)))
        finally:
            if proxy is not None:
                proxy.close()
            srv.stop()

    # llama.cpp's own llama-server: the reference
    why_not = llama_cpp_server_missing(args.llama_server) if "llama-server" in engines else ""
    for name in models if "llama-server" in engines else ():
        if why_not:
            log(f"\n=== llama-server {name}: not graded: {why_not}")
            results.append(("llama-server", name, "passes", True, f"not graded: {why_not}"))
            continue
        log(f"\n=== llama-server {name}")
        srv = llama_cpp_server(name, args.logs, args.llama_server, n_ctx=LLAMA_SERVER_CTX)
        try:
            # one request at a time: one slot, which decodes one prompt at a time anyway
            results.append(("llama-server", name, "passes", *outcome(grade(srv.url, name, 1))))
        finally:
            srv.stop()

    # llama.cpp through llama-cpp-python's server
    why_not = llama_server_missing() if "llama-cpp-python" in engines else ""
    for name in models if "llama-cpp-python" in engines else ():
        if why_not:
            log(f"\n=== llama-cpp-python server {name}: not graded: {why_not}")
            results.append(("llama-cpp-python", name, "passes", True, f"not graded: {why_not}"))
            continue
        log(f"\n=== llama-cpp-python server {name}")
        srv = llama_server(name, args.logs)
        try:
            # one request at a time: the server decodes one at a time anyway
            must_fail, note = KNOWN_DEFECTS.get(("llama-cpp-python", name), ((), ""))
            checks = LLAMA_CHECKS.get(name, tuple(conform.CHECK_GROUPS))
            expected = f"fails {', '.join(must_fail)} (known server defect)" if must_fail else "passes"
            results.append(("llama-cpp-python", name, expected,
                            *outcome(grade(srv.url, name, 1, checks), must_fail, note)))
        finally:
            srv.stop()

    log("\n=== summary")
    bad = 0
    for engine, name, expected, ok, shown in results:
        bad += not ok
        log(f"{'ok ' if ok else 'BAD'} {engine:30s} {name:20s} expected: {expected}; {shown}")
    log(f"{len(results) - bad}/{len(results)} as expected in {time.monotonic() - t_start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
