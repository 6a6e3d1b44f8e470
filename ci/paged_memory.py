"""Issue 47's memory bar, the client side: --sequences concurrent streaming requests of
--prompt-tokens + --max-tokens positions each (64 x (3,968 + 128) = 64 x 4,096 by default),
sent at once to a brass serve whose block pool holds them all (--kv-blocks), while /metrics
(brass_kv_blocks) and the device's memory (nvidia-smi: the compute processes', else the
card's) are sampled. One table: the KV bytes a token for the model's attention layers, the
pool's bytes, the blocks held at the peak against what the sequences need, the device memory
before / at the peak / after, and what the per-session contiguous layout would reserve for the
same sequences (each a whole context: the server's --ctx and the model's trained one) against
the device's memory.

Prompts are token ids (ci/chat_ttft.py's Vocab: the words' own ids), each sequence its own
random draw, so no two share a block and prefix caching shares nothing.

    python3 ci/paged_memory.py --url http://127.0.0.1:8186/v1 --model-file qwen3-8b.gguf [--json OUT]
    python3 ci/paged_memory.py --difference big-pool.json small-pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_ttft import Vocab, counts, one_turn  # noqa: E402

BLOCK_TOKENS = 16       # engine/kv_cache.py's block (brass_kv_blocks counts blocks of 16 tokens)
GIB, MIB = 1 << 30, 1 << 20


def kv_blocks(root: str) -> dict[str, int] | None:
    """brass_kv_blocks{state=used|cached|free} from /metrics, None where it is not reported."""
    try:
        with urllib.request.urlopen(f"{root}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    got = {m[1]: int(float(m[2])) for m in re.finditer(r'^brass_kv_blocks\{state="(\w+)"\} (\S+)$', text, re.M)}
    return got or None


def device_mib() -> tuple[int, str] | None:
    """(MiB, "apps"): the compute processes' used memory summed; (MiB, "card"): the card's used
    memory where the processes are not visible (a container); None without nvidia-smi."""
    q = ["nvidia-smi", "--format=csv,noheader,nounits"]
    try:
        apps = subprocess.run(q + ["--query-compute-apps=used_memory"], capture_output=True, text=True, timeout=10)
        vals = [int(x) for x in apps.stdout.split()] if apps.returncode == 0 else []
        if vals:
            return sum(vals), "apps"
        card = subprocess.run(q + ["--query-gpu=memory.used"], capture_output=True, text=True, timeout=10)
        return (int(card.stdout.split()[0]), "card") if card.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def device_total_mib() -> int | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return int(r.stdout.split()[0]) if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def model_figures(path: str) -> dict:
    """The KV bytes a token over the model's attention layers (keys and values in float16:
    H_kv x (Dk + Dv) x 2 bytes a layer; n_layer x 2 x H_kv x Dh x 2 where every layer is alike),
    its trained context and its file's bytes (the weights, near enough)."""
    from brass.config import read_config
    from brass.gguf import GGUFFile
    gf = GGUFFile(path)
    try:
        cfg = read_config(gf, gf.architecture)
    finally:
        gf.close()
    per_token = sum(2 * cfg.layer_n_head_kv(il) * (cfg.layer_head_dim(il) + cfg.layer_head_dim_v(il))
                    for il in range(cfg.n_layer) if not cfg.is_recurrent(il))
    return {"kv_bytes_per_token": per_token, "n_ctx_train": cfg.n_ctx_train, "file_bytes": os.path.getsize(path),
            "n_layer": cfg.n_layer}


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:,.2f} GiB"


def difference(big: str, small: str) -> int:
    """The pool's device memory a token, measured: two runs' JSONs (--json) of one server with
    two pool sizes, otherwise alike; the idle servers' memory apart over their pools' tokens."""
    try:
        a, b = (json.loads(Path(p).read_text()) for p in (big, small))
        (ma, sa), (mb, sb) = a["device_mib"]["idle"], b["device_mib"]["idle"]
        na, nb = a["pool_blocks"], b["pool_blocks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"--difference: no idle device memory and pool in {big} and {small} ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    if sa != sb or na == nb:
        print(f"--difference: not comparable (memory from {sa} and {sb}, pools of {na} and {nb} blocks)", file=sys.stderr)
        return 2
    per_token = (ma - mb) * MIB / ((na - nb) * BLOCK_TOKENS)
    layers = (a.get("model") or {}).get("kv_bytes_per_token")
    print(f"KV bytes a token, measured: ({ma:,} - {mb:,} MiB) / (({na} - {nb}) blocks x {BLOCK_TOKENS} tokens) = "
          f"{per_token:,.0f} B (the layers' figure: {'-' if layers is None else f'{layers:,} B'}; "
          f"nvidia-smi counts whole MiB)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="brass serve's OpenAI API, e.g. http://127.0.0.1:8186/v1")
    ap.add_argument("--difference", nargs=2, metavar=("BIG", "SMALL"),
                    help="two runs' JSONs with pools of two sizes: the pool's memory a token, and stop")
    ap.add_argument("--model-file", default=None, help="the GGUF the server serves (the KV bytes a token)")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=3968)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=None,
                    help="the server's context, for the per-session layout (default: brass's --ctx default)")
    ap.add_argument("--device-before-mib", type=int, default=None,
                    help="the card's used memory before the server started (nvidia-smi)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the prompts' draw (another for a second run against one server: its cache holds the first's)")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.difference:
        return difference(*args.difference)
    if not args.url:
        ap.error("--url is required (or --difference BIG SMALL)")
    if min(args.sequences, args.prompt_tokens, args.max_tokens) < 1 or args.interval <= 0:
        ap.error("--sequences, --prompt-tokens and --max-tokens must be at least 1, --interval above 0")
    if args.model_file and not Path(args.model_file).is_file():
        ap.error(f"--model-file {args.model_file}: no such file")
    if args.ctx is None:
        from brass.cli import DEFAULT_CTX
        args.ctx = DEFAULT_CTX
    root = args.url.rstrip("/").removesuffix("/v1")
    try:
        vocab = Vocab.fetch(args.url)
    except OSError as e:
        print(f"{args.url}: {e}", file=sys.stderr)
        return 2
    if not vocab.measured:
        print("the server has no /tokenize: prompts of token ids cannot be made", file=sys.stderr)
        return 2
    idle_blocks, idle_mem = kv_blocks(root), device_mib()

    peak = {"used": 0, "mem": None, "in_flight": 0}
    live = {"in_flight": 0}
    lock, done = threading.Lock(), threading.Event()

    def sampler():
        while not done.is_set():
            b, m = kv_blocks(root), device_mib()
            with lock:
                if b:
                    peak["used"] = max(peak["used"], b.get("used", 0))
                if m and (peak["mem"] is None or m[0] > peak["mem"][0]):
                    peak["mem"] = m
            done.wait(args.interval)

    results, errors = [], []
    start = threading.Barrier(args.sequences)

    def client(i: int):
        ids = vocab.token_ids(random.Random(f"{args.seed}/{i}"), args.prompt_tokens)
        start.wait()
        with lock:
            live["in_flight"] += 1
            peak["in_flight"] = max(peak["in_flight"], live["in_flight"])
        try:
            got = one_turn(args.url, None, ids, args.max_tokens, args.timeout)
            with lock:
                results.append(got)
        except urllib.error.HTTPError as e:
            with lock:
                errors.append(f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}")
        except OSError as e:
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
        finally:
            with lock:
                live["in_flight"] -= 1

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.sequences)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    after_blocks, after_mem = kv_blocks(root), device_mib()

    n = [counts(r["usage"], r["timings"]) for r in results]
    positions = args.prompt_tokens + args.max_tokens
    need_blocks = args.sequences * -(-positions // BLOCK_TOKENS)
    pool_blocks = sum(idle_blocks.values()) if idle_blocks else None
    m = model_figures(args.model_file) if args.model_file else None
    bpt = m["kv_bytes_per_token"] if m else None
    total = device_total_mib()
    out = {"sequences": args.sequences, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "completed": len(results), "failed": len(errors), "errors": errors[:5], "wall_s": round(wall, 2),
           "generated_tokens": sum(x["completion_tokens"] or 0 for x in n),
           "cached_tokens": sum(x["cached_tokens"] or 0 for x in n),
           "pool_blocks": pool_blocks, "blocks_needed": need_blocks, "peak_blocks_used": peak["used"],
           "idle_blocks": idle_blocks, "after_blocks": after_blocks, "peak_in_flight": peak["in_flight"],
           "device_mib": {"before_server": args.device_before_mib, "idle": idle_mem, "peak": peak["mem"],
                          "after": after_mem, "total": total},
           "model": m, "ctx": args.ctx}
    prompts = sorted({x["prompt_tokens"] for x in n})
    rows = [("requests done / failed", f"{len(results)} / {len(errors)} in {wall:.1f} s, "
                                       f"{out['generated_tokens']} tokens generated, {out['cached_tokens']} cached"),
            ("prompt tokens a request (server's count)", ", ".join(map(str, prompts)) or "-"),
            ("requests in flight at once (client)", f"{peak['in_flight']} of {args.sequences}"),
            ("KV blocks held at the peak (/metrics)",
             f"{peak['used']} of {pool_blocks} in the pool; the sequences need {need_blocks} "
             f"({args.sequences} x {positions} positions / {BLOCK_TOKENS})"
             + ("" if peak["used"] >= need_blocks else ": NOT all held at once"))]
    if bpt:
        per_session = {c: args.sequences * c * bpt for c in (args.ctx, m["n_ctx_train"])}
        rows += [("KV bytes a token (attention layers, float16)",
                  f"{bpt:,} B ({m['n_layer']} layers; {bpt / 1024:,.0f} KiB)"),
                 ("paged pool", f"{pool_blocks} blocks x {BLOCK_TOKENS} tokens = {gib((pool_blocks or 0) * BLOCK_TOKENS * bpt)}"),
                 ("the sequences' tokens held at the peak", gib(peak["used"] * BLOCK_TOKENS * bpt))]
        for c, b in per_session.items():
            fits = "-" if total is None else ("fits" if b + m["file_bytes"] <= total * MIB else "does NOT fit")
            rows.append((f"per-session layout, {args.sequences} x {c:,}-token context",
                         f"{gib(b)} (+ weights {gib(m['file_bytes'])}) against the device's "
                         f"{'-' if total is None else gib(total * MIB)}: {fits}"))

    def mem(x):
        return "-" if x is None else f"{x[0]:,} MiB ({x[1]})"
    rows.append(("device memory: before the server / idle / peak / after",
                 f"{'-' if args.device_before_mib is None else f'{args.device_before_mib:,} MiB (card)'} / "
                 f"{mem(idle_mem)} / {mem(peak['mem'])} / {mem(after_mem)}"))
    if bpt and idle_mem and pool_blocks:
        held = idle_mem[0] - ((args.device_before_mib or 0) if idle_mem[1] == "card" else 0)
        rows.append(("measured: (server's device memory - weights file) / pool tokens",
                     f"{(held * MIB - m['file_bytes']) / (pool_blocks * BLOCK_TOKENS):,.0f} B a token "
                     f"(at most: the CUDA context, activations and graphs are in it too)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    for e in errors[:3]:
        print(f"  {e}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if not errors and peak["used"] >= need_blocks else 1


if __name__ == "__main__":
    sys.exit(main())
