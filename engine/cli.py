"""The `brass` command line (also `python -m brass`).

    brass run [MODEL] [PROMPT]           stream a completion to the terminal
    brass generate MODEL --prompt TEXT   one completion, optionally as JSON
    brass tokenize MODEL --text TEXT     token ids (or --jsonl FILE: one JSON string per line)
    brass score MODEL --tokens IDS       teacher-forced top-k logits at every position
    brass models                         the model catalog
    brass serve [MODEL]                  OpenAI-compatible HTTP API and web chat page
    brass chat [MODEL]                   interactive chat in the terminal
    brass bench MODEL [-p 512] [-n 128]  prompt and generation tok/s, as llama-bench reports them

MODEL is a GGUF path or a catalog name; errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import catalog
from .errors import BrassError

DEFAULT_PROMPT = "The three most useful things to know about the sea are"


def _quiet() -> bool:
    """Progress bars (downloads, uploads) go to stderr whenever it is a terminal, whatever
    stdout carries (JSON included); not into logs and pipes."""
    return not sys.stderr.isatty()


def _add_model_args(p, model_optional=False):
    if model_optional:
        p.add_argument("model", nargs="?", default=None,
                       help=f"GGUF path or catalog name (default: {catalog.DEFAULT_MODEL})")
    else:
        p.add_argument("model", help="GGUF path or catalog name (" + ", ".join(catalog.CATALOG) + ")")
    p.add_argument("--backend", choices=["numpy", "cuda"], default=None,
                   help="default: cuda when a GPU is present, else numpy")
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens")


def _add_sampling_args(p):
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate; generation also stops at end of generation (default: 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = all (default: 40)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="keep the most likely tokens up to this probability mass (default: 0.95)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens less likely than this times the most likely one (default: 0.05)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = none (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; -1 or unset: random")


def _sampling(args):
    from .sampling import SamplingParams
    if args.max_tokens < 1:
        raise BrassError("--max-tokens must be at least 1")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def _load(args):
    from .model import Model
    return Model(args.model, backend=args.backend, n_ctx=args.ctx, quiet=_quiet())


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
    sampling = _sampling(args)
    m = _load(args)
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


def cmd_run(args):
    args.json = False
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    sampling = _sampling(args)
    m = _load(args)
    run = _Completion(m, _prompt_ids(m, prompt, args.max_tokens), args.max_tokens, sampling)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    try:
        for piece in run.pieces():
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    sys.stdout.write("\n")
    print(run.summary(), file=sys.stderr)


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


def cmd_tokenize(args):
    from .gguf import GGUFFile
    from .tokenizer import Tokenizer
    if (args.text is None) == (args.jsonl is None):
        raise BrassError("give exactly one of --text or --jsonl")
    tok = Tokenizer.from_gguf(GGUFFile(catalog.resolve(args.model, quiet=_quiet())))
    if args.jsonl is not None:
        for s in _read_jsonl_strings(args.jsonl):
            print(json.dumps(tok.encode(s, add_special=args.add_special, parse_special=args.parse_special)))
        return
    ids = tok.encode(args.text, add_special=args.add_special, parse_special=args.parse_special)
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


def cmd_score(args):
    import numpy as np
    ids = _parse_token_list(args.tokens)
    if args.top_k < 1:
        raise BrassError("--top-k must be >= 1")
    m = _load(args)
    logits = m.score(ids)
    k = min(args.top_k, logits.shape[-1])
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    rows = [[[int(i), float(logits[t, i])] for i in top[t]] for t in range(len(ids))]
    if args.json:
        print(json.dumps({"tokens": ids, "top_k": rows}))
    else:
        for t, r in enumerate(rows):
            print(t, ids[t], " ".join(f"{i}:{v:.3f}" for i, v in r))


def cmd_bench(args):
    from .bench import bench, table
    if args.n_prompt < 0 or args.n_gen < 0 or not (args.n_prompt or args.n_gen):
        raise BrassError("bench: give a positive prompt (-p) and/or generation (-n) length")
    if args.reps < 1:
        raise BrassError("bench: repetitions (-r) must be >= 1")
    if args.parallel < 1:
        raise BrassError("bench: parallel sequences (--parallel) must be >= 1")
    m = _load(args)
    progress = None if args.json or not sys.stderr.isatty() else (lambda msg: print(msg, file=sys.stderr))
    results = bench(m, n_prompt=args.n_prompt, n_gen=args.n_gen, reps=args.reps, progress=progress,
                    parallel=args.parallel)
    if args.json:
        print(json.dumps([r.as_dict() for r in results]))
    else:
        print(table(results))


def cmd_diff(args):
    from .diff import diff
    m = _load(args)
    progress = None if args.json or not sys.stderr.isatty() else (lambda msg: print(msg, file=sys.stderr))
    report = diff(m, prompt=args.prompt, reference=args.reference, n_gen=args.n_gen, progress=progress)
    print(json.dumps(report.as_dict()) if args.json else report.table())
    if not report.passed:
        raise SystemExit(1)


def cmd_models(args):
    from . import arch
    from .backends import BACKENDS
    for m in catalog.CATALOG.values():
        cached = catalog.cached_path(m.name)
        print(f"{m.name:22s} {m.size / 2**20:7.1f} MiB  {'cached' if cached else 'not fetched':11s}  {m.description}")
    # any GGUF of these architectures runs, catalog or not
    names = [a if arch.backends(a) == BACKENDS else f"{a} ({', '.join(arch.backends(a))} only)"
             for a in arch.ARCHITECTURES]
    print(f"\narchitectures: {', '.join(names)}")


def build_parser():
    from . import __version__
    ap = argparse.ArgumentParser(prog="brass", description="GGUF LLM inference (numpy reference / CUDA)")
    ap.add_argument("--version", action="version", version=f"brass {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            help="run, generate, tokenize, score, bench, diff, models, serve, chat")

    p = sub.add_parser("run", help="stream a completion to the terminal")
    _add_model_args(p, model_optional=True)
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("generate", help="one completion")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tokenize", help="text → token ids")
    p.add_argument("model")
    p.add_argument("--text")
    p.add_argument("--jsonl", help="file with one JSON string per line; prints one JSON array per line")
    p.add_argument("--add-special", action="store_true", help="add BOS/EOS as the model's metadata says")
    p.add_argument("--parse-special", action="store_true", help="parse special-token text like <|im_start|>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("score", help="teacher-forced top-k logits for a token sequence")
    _add_model_args(p)
    p.add_argument("--tokens", required=True, help="JSON array of ids, or a file holding one")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("bench", help="prompt (pp) and generation (tg) speed in tokens per second",
                       description="Prefill of -p random tokens and greedy generation of -n tokens, "
                                   "each from an empty context, after one untimed run; mean ± stddev "
                                   "over -r repetitions (as llama-bench reports them).")
    _add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (0: skip; default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (0: skip; default 128)")
    p.add_argument("-r", "--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--parallel", type=int, default=1, metavar="P",
                   help="generate with P sequences in batched steps, as the server does "
                        "(test tgNxP: all sequences' tokens per second; default 1)")
    p.add_argument("--json", action="store_true", help="print the results as a JSON array")
    p.set_defaults(func=cmd_bench)

    from . import diff as diff_mod
    p = sub.add_parser("diff", help="compare with llama.cpp node by node (needs the record extra)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Run llama.cpp and Brass on the same prompt and print, for every "
                                   "layer's nodes, NMSE and max |Δ| against llama.cpp, the first node "
                                   "out of its bound, and the teacher-forced argmax agreement. Exit "
                                   "status 0 when everything is within bounds, 1 otherwise. Needs "
                                   "llama.cpp's Python binding: pip install -e '.[record]'.")
    _add_model_args(p)
    p.add_argument("--prompt", default=diff_mod.DEFAULT_PROMPT, help="text (special tokens parsed, BOS added)")
    p.add_argument("--reference", choices=["cpu", "cuda"], default="cpu",
                   help="llama.cpp's backend (cuda needs a CUDA build of llama.cpp named by LLAMA_CPP_LIB_PATH)")
    p.add_argument("--n-gen", type=int, default=diff_mod.DEFAULT_N_GEN,
                   help="tokens llama.cpp generates greedily after the prompt (compared teacher-forced)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("models", help="list the model catalog")
    p.set_defaults(func=cmd_models)

    from . import chat, server
    server.add_cli(sub, _add_model_args)
    chat.add_cli(sub, _add_model_args, _add_sampling_args, _sampling)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BrassError as e:
        print(f"brass: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
