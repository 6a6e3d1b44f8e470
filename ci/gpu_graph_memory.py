"""Prompt graphs' GPU memory under a server's churn, without HTTP (issue 11).

`brass serve --parallel 16` grew its GPU memory without end under ci/soak.py (the 8B shape:
21.5 -> 39.5 GB in 420 s), and not at all with BRASS_PROMPT_GRAPHS=0. This runs a server's
worker (engine/serving.py BatchScheduler, warmed up as `brass serve` warms it, its SessionPool
of --parallel sessions) under --clients clients that each send a request, wait for it and send
the next, for --requests requests or --seconds seconds, whichever ends first. Prompts as
ci/soak.py sends them: one of its five chat messages rendered by the model's chat template (the
server's rendering); and one request in --long-share (seeded) a prompt of one of --long-lengths
lengths drawn once between 64 and --long-max tokens, which the worker reads in chunks (the
first from position 0: the model's StartStep; the next ones: the session's own PromptSteps)
and whose session size differs (the pool then drops idle sessions). max_tokens 4..48, and a
client that disconnects (--disconnect share) leaves after 1..8 tokens, as ci/soak.py's do.

Every --every requests one line: seconds, requests done, device memory in use
(cupy.cuda.runtime.memGetInfo), CuPy's default pool (used / total), the prompt graphs' bytes
(Model.graph_bytes: the sessions' own, the model's StartSteps with their caches), the graphs'
own blocks, what the device holds beyond the default pool and those blocks ("other": the CUDA
context, kernels, instantiated graphs, and whatever a dropped graph failed to give back), the
PromptStep / StartStep / Session objects alive (gc.get_objects) against the ledger's entries,
the graphs captured so far (prompt graphs, decode steps and batched steps alike). At the end:
what gc.collect() and then the default pool's free_all_blocks() give back, and a verdict line:
PASS when the graphs held at most their budget (BRASS_PROMPT_GRAPHS_MB) at every sample and
"other" grew at most --other-growth-mb from the first sample after --warmup seconds to the end
(memory a dropped graph keeps shows there), no request failing; the device's growth over the
same span is printed beside the budget.

    python3 conformance/harness/shape_models.py qwen3-0.6b /tmp/models
    python3 ci/gpu_graph_memory.py /tmp/models/qwen3-0.6b.gguf     # 60 s of requests, then the end
    python3 ci/gpu_graph_memory.py golden/models/synth-qwen3.gguf --backend numpy \\
        --requests 12 --every 4 --clients 4                              # a smoke run on the CPU

Exit status 0 on PASS, 1 on FAIL, 2 when there is nothing to judge (no CUDA device: numpy). It
also runs against the code before the model-wide ledger (commit 09d252b and earlier: a
shelf per session), for comparison.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ci.soak import PROMPTS  # noqa: E402
from brass import model as model_mod  # noqa: E402
from brass.serving import BatchScheduler, Request  # noqa: E402
from brass.sampling import SamplingParams  # noqa: E402

MB = 2 ** 20


class Client(Request):
    """A streaming client's request: it reads `keep` tokens and goes away (cancelled, as the
    server cancels a request whose client disconnected), or reads them all."""

    def __init__(self, ids, max_tokens, keep):
        super().__init__(ids, max_tokens, SamplingParams(temperature=0.0))
        self.keep = keep

    def on_token(self, token):
        self.tokens.append(token)
        if self.keep is not None and len(self.tokens) >= self.keep:
            self.cancelled.set()
        return len(self.tokens) >= self.max_tokens


def graphs(m) -> list:
    """The prompt graphs the model keeps (every session's and its StartSteps)."""
    ledger = getattr(m, "graph_ledger", None)
    if ledger is not None:
        return list(ledger.steps.values())
    # the code before issue 11's ledger (for comparison): a session's own shelf each
    return [st for s in list(m._sessions.values()) for st in list(s._prompt_steps.values())] + \
        list(m._start_steps.values())


def live(*types) -> list[int]:
    counts = [0] * len(types)
    for o in gc.get_objects():
        for i, t in enumerate(types):
            if isinstance(o, t):
                counts[i] += 1
    return counts


def sample(m, cuda, t0, done, captures) -> dict:
    """What the process holds now (device figures None without CUDA)."""
    steps = graphs(m)
    blocks = sum(st.graph.nbytes for st in steps)
    gb = m.graph_bytes()
    prompt_steps, start_steps, sessions = live(model_mod.PromptStep, model_mod.StartStep, model_mod.Session)
    out = dict(t=time.perf_counter() - t0, done=done, graphs=gb["prompt"] + gb["start"], prompt=gb["prompt"],
               start=gb["start"], blocks=blocks, kept=len(steps), prompt_steps=prompt_steps,
               start_steps=start_steps, sessions=sessions, captures=captures[0],
               escaped=sum(getattr(st.graph, "escaped", 0) for st in steps),
               device=None, pool_used=None, pool_total=None, other=None)
    if cuda:
        import cupy
        # no synchronisation: the worker thread may be capturing a graph on the stream (a
        # synchronize then fails the capture), and the memory figures need none
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        out.update(device=total - free, pool_used=pool.used_bytes(), pool_total=pool.total_bytes())
        out["other"] = out["device"] - out["pool_total"] - blocks
    return out


def line(s) -> str:
    def mb(v):
        return "-" if v is None else f"{v / MB:,.0f}"
    return (f"{s['t']:6.1f} s {s['done']:5d} req  device {mb(s['device'])} MB  pool {mb(s['pool_used'])}/"
            f"{mb(s['pool_total'])}  graphs {mb(s['graphs'])} (prompt {mb(s['prompt'])}, start "
            f"{mb(s['start'])}; blocks {mb(s['blocks'])})  other {mb(s['other'])}  alive: {s['prompt_steps']} "
            f"PromptStep {s['start_steps']} StartStep (kept {s['kept']}) {s['sessions']} Session  "
            f"graphs captured {s['captures']}" + (f"  escaped {s['escaped']} B" if s["escaped"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file (conformance/harness/shape_models.py writes shape-true ones)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--parallel", type=int, default=16, help="the worker's sessions (brass serve --parallel)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=60.0, help="stop sending after this long")
    ap.add_argument("--every", type=int, default=100, help="requests between samples")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds before the baseline sample")
    ap.add_argument("--disconnect", type=float, default=0.3)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--long-lengths", type=int, default=24)
    ap.add_argument("--long-max", type=int, default=1000)
    ap.add_argument("--other-growth-mb", type=float, default=64.0)
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    m = model_mod.Model(args.model, backend=args.backend, n_ctx=args.ctx, quiet=True)
    cuda = m.backend.name == "cuda"
    captures = [0]
    capture = getattr(m.backend, "capture", None)
    if capture is not None:
        def counted(fn, **kw):
            captures[0] += 1
            return capture(fn, **kw)
        m.backend.capture = counted
    from brass.chat_template import ChatTemplate
    template = ChatTemplate.from_gguf(m.gguf, m.tokenizer)
    soak_ids = [m.tokenizer.encode(template.render([{"role": "user", "content": p}]),
                                   add_special=True, parse_special=True) for p in PROMPTS]
    rng = random.Random(args.seed)
    V = m.config.n_vocab
    top = max(64, min(args.long_max, m.n_ctx - 64))
    long_lengths = [rng.randint(64, top) for _ in range(args.long_lengths)]
    on = m.prompt_graphs and model_mod.graphs_enabled(m)
    budget = m.graph_ledger.budget if on else 0
    print(f"{Path(args.model).name} on {m.backend.name}: parallel {args.parallel}, {args.clients} clients, "
          f"soak prompts of {sorted({len(i) for i in soak_ids})} tokens, long ones ({args.long_share:.0%}) of "
          f"{sorted(long_lengths)}; prompt graphs {'on' if on else 'off'}, budget {budget / MB:.0f} MB, at most "
          f"{model_mod.PROMPT_GRAPHS_KEPT} graphs", flush=True)

    sched = BatchScheduler(m, parallel=args.parallel, start=False)
    t_warm = sched.warm_up()
    sched._thread.start()
    t0 = time.perf_counter()
    print(f"worker warmed up in {t_warm:.1f} s", flush=True)

    def request():
        if rng.random() < args.long_share:
            ids = [rng.randrange(V) for _ in range(rng.choice(long_lengths))]
        else:
            ids = list(rng.choice(soak_ids))
        max_tokens = rng.randint(4, 48)
        keep = rng.randint(1, 8) if rng.random() < args.disconnect else None
        return Client(ids, min(max_tokens, m.n_ctx - len(ids)), keep)

    open_, sent, done, failed = [], 0, 0, 0
    samples, baseline = [], None
    wake = threading.Event()
    try:
        while True:
            running = time.perf_counter() - t0 < args.seconds and sent < args.requests
            while running and len(open_) < args.clients and sent < args.requests:
                r = request()
                sched.submit(r)
                open_.append(r)
                sent += 1
            if not open_:
                break
            if time.perf_counter() - t0 > args.seconds + 120:
                print(f"{len(open_)} requests still open 120 s after the last was sent: giving up", flush=True)
                failed += len(open_)
                break
            wake.wait(0.002)
            for r in [r for r in open_ if r.finished.is_set()]:
                open_.remove(r)
                done += 1
                failed += r.error is not None
                if r.error is not None and failed <= 3:
                    print(f"request failed: {type(r.error).__name__}: {r.error}", flush=True)
                if done % args.every == 0:
                    s = sample(m, cuda, t0, done, captures)
                    samples.append(s)
                    if baseline is None and s["t"] >= args.warmup:
                        baseline = s
                    print(line(s) + ("  <- baseline (after warm-up)" if s is baseline else ""), flush=True)
    finally:
        sched.close()
    end = sample(m, cuda, t0, done, captures)
    samples.append(end)
    print(line(end) + "  <- end", flush=True)
    if baseline is None:
        baseline = samples[0]

    if not cuda:
        print(f"verdict: NONE: {done} requests ({failed} failed) on {m.backend.name}: no device memory to judge "
              f"(a smoke run)")
        return 2 if not failed else 1
    import cupy
    collected = gc.collect()
    after_gc = sample(m, cuda, t0, done, captures)
    cupy.get_default_memory_pool().free_all_blocks()
    after_free = sample(m, cuda, t0, done, captures)
    by_gc = (after_gc["device"] - end["device"]) / MB
    by_free = (after_free["device"] - after_gc["device"]) / MB
    print(f"gc.collect(): {collected} objects, device {by_gc:+,.0f} MB; then the default pool's "
          f"free_all_blocks(): device {by_free:+,.0f} MB (to {after_free['device'] / MB:,.0f} MB)")
    grew = end["device"] - baseline["device"]
    other = end["other"] - baseline["other"]
    most = max(s["graphs"] for s in samples)
    ok = most <= budget and other <= args.other_growth_mb * MB and not failed
    print(f"verdict: {'PASS' if ok else 'FAIL'}: from {baseline['t']:.0f} s (request {baseline['done']}) to the end "
          f"({end['t']:.0f} s, {done} requests, {failed} failed, {end['captures']} captures) the device's memory "
          f"grew {grew / MB:+,.0f} MB, the prompt graphs' budget is {budget / MB:,.0f} MB; the graphs held at most "
          f"{most / MB:,.0f} MB (limit: the budget), {end['graphs'] / MB:,.0f} MB at the end; memory beyond the "
          f"default pool and the graphs' blocks grew {other / MB:+,.0f} MB (limit {args.other_growth_mb:.0f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
