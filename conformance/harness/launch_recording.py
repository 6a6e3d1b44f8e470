"""The kernel launches (and cuBLAS calls, copies, graph captures and CuPy array work) of the CUDA
backend on the synthetic models, recorded on the CPU through a fake CuPy
(fake_cupy.py): a baseline that host-side changes to the backend must keep entry
for entry (conformance/kernels/test_launch_sequence.py).

How: the fake CuPy and cupy_backends modules are put in sys.modules, brass.backends.cuda and
its submodules are imported afresh under them (so that every `import cupy` of theirs, at module
level or in a function, gets the fake, and nothing of an earlier import with the real CuPy
stays in the way), and everything is put back afterwards. Three things are set on the fresh
modules: `CudaBackend.launch`, the backend's one launch surface, is wrapped to open an entry
with its arguments (kernel, buffers, parameter struct) that the fake driver completes with
what reached it (grid, block, dynamic shared memory, whether with programmatic dependent
launch); `pdl._driver` gives the fake cuLaunchKernelEx; `blas.library` the fake libcublas.
Models are loaded with brass.load(..., backend="cuda") and run through Model / Session as a
user runs them, every switch at its default: a run refuses (skips) while a BRASS_* variable
that changes what runs is set.

The scenario, per synthetic model of golden/models (in one model, in this order):

1. decode: `generate` of 3 greedy tokens after a 7-token prompt in a new session (the prompt
   read eagerly, its length class's first; the first step eager then captured as the decode graph;
   the next a replay of it);
2. prompt: a 70-token prompt (tiles of 64 queries / delta-net chunks of 64 and a tail, and
   the prompt GEMMs, which start at 32 tokens) read three times: in a new session A (eagerly,
   its length class's first read), in a new session B (the model's start graph of the class,
   captured and run), and in A again after a reset (A's own prompt graph, captured and run);
   each read is of the class's 79 rows, the 70 tokens and 9 of padding (engine/model.py
   prompt_class).

Buffers appear as `label[@byte offset]:dtype[shape]`: weights as `w:<tensor name>`, the
sessions' caches as `s<session>.k<layer>` / `.v` / `.conv` / `.ssm`, pinned host buffers as
`pinned`, every other allocation as `t<n>`, numbered in the order the events first name them
(so the labels follow the data flow, not addresses or allocation order). Tokens read back
from the device are zeros (kernels do not run).

    python3 -m conformance.harness.launch_recording --record [--only synth-qwen3,...]

writes conformance/data/launch_sequence.json (one event a line).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


from conformance.harness import fake_cupy

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "conformance" / "data" / "launch_sequence.json"
MODELS_DIR = ROOT / "golden" / "models"
RECORD_CMD = "python3 -m conformance.harness.launch_recording --record"
N_CTX = 128
DECODE_PROMPT, DECODE_TOKENS = 7, 3
PROMPT = 70
# BRASS_* variables that change nothing the recording sees; any other one set is a switch
HARMLESS_ENV = {"BRASS_CACHE", "BRASS_OFFLINE", "BRASS_TEST_SEED", "BRASS_LLAMA_VOCABS", "BRASS_WHEELHOUSE",
                "BRASS_KEEP_WHEELS", "BRASS_PYPI_INDEX", "BRASS_API_KEY", "BRASS_STAGE", "BRASS_PERF_RESULTS",
                "BRASS_SKIP_PERF", "BRASS_FUZZ_LIVE", "BRASS_FUZZ_BODIES", "BRASS_BACKEND"}
_CUDA_PKG = "brass.backends.cuda"


def synthetic_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.gguf"))


def switches_set() -> list[str]:
    """BRASS_* variables set here that may change what the backend runs."""
    return sorted(k for k in os.environ if k.startswith("BRASS_") and k not in HARMLESS_ENV)


def _ours(name: str) -> bool:
    return (name == "cupy" or name.startswith(("cupy.", "cupy_backends")) or name == _CUDA_PKG
            or name.startswith(_CUDA_PKG + "."))


@contextmanager
def fake_cuda(rec: fake_cupy.Recorder):
    """The fake CuPy installed for `rec`, brass.backends.cuda imported afresh under it (yielded:
    its backend module), with CudaBackend.launch recording; everything put back on exit."""
    import brass.backends as backends_pkg
    saved = {k: v for k, v in sys.modules.items() if _ours(k)}
    had_attr, old_attr = hasattr(backends_pkg, "cuda"), getattr(backends_pkg, "cuda", None)
    old_cache = os.environ.get("BRASS_CACHE")
    tmp = tempfile.TemporaryDirectory(prefix="brass-fake-cuda-")
    try:
        for k in saved:
            del sys.modules[k]
        if had_attr:
            delattr(backends_pkg, "cuda")
        sys.modules.update(fake_cupy.modules())
        fake_cupy.activate(rec)
        # the fake NVRTC's images go to a cache of their own, never the real one
        os.environ["BRASS_CACHE"] = tmp.name
        import brass.backends.cuda.backend as backend
        from brass.backends.cuda import blas, pdl
        if not hasattr(pdl, "_driver") or not hasattr(blas, "library"):
            raise RuntimeError("launch_recording: pdl._driver or blas.library is gone; point the fake "
                               "driver and cuBLAS at what replaced them")
        pdl._driver = lambda: fake_cupy.fake_launch_kernel_ex
        blas.library = lambda: fake_cupy.FakeCublasLib()
        _wrap_launch(backend.CudaBackend, rec)
        yield backend
    finally:
        fake_cupy.activate(None)
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
        if had_attr:
            backends_pkg.cuda = old_attr
        elif hasattr(backends_pkg, "cuda"):
            delattr(backends_pkg, "cuda")
        if old_cache is None:
            os.environ.pop("BRASS_CACHE", None)
        else:
            os.environ["BRASS_CACHE"] = old_cache
        tmp.cleanup()


def params_desc(p) -> dict:
    """The by-value parameter struct's fields (in layout order) and values."""
    rec = p.reshape(-1)[0]
    return {f: rec[f].item() for f in p.dtype.names}


def _wrap_launch(cls, rec: fake_cupy.Recorder):
    orig = cls.launch
    sig = inspect.signature(orig)
    buffers_name = next(n for n, p in sig.parameters.items() if p.kind == p.VAR_POSITIONAL)

    def launch(self, *args, **kwargs):
        a = sig.bind(self, *args, **kwargs).arguments
        entry = rec.event(op="launch", kernel=f"{a['source']}:{a['name']}",
                          args=[rec.desc(b) for b in a.get(buffers_name, ())],
                          params=params_desc(a["params"]))
        rec.pending.append(entry)
        try:
            return orig(self, *args, **kwargs)
        finally:
            rec.pending.pop()
            if "grid" not in entry:
                entry["launched"] = False   # nothing reached the driver
    launch.__wrapped__ = orig
    cls.launch = launch


_KEY_ORDER = ("op", "kernel", "grid", "block", "smem", "pdl", "params", "args")


def _canonical(e: dict) -> dict:
    """An event with a launch's keys in a fixed order (as the JSON shows them)."""
    if e.get("op") != "launch":
        return e
    out = {k: e[k] for k in _KEY_ORDER if k in e}
    out.update({k: v for k, v in e.items() if k not in out})
    return out


def _ids(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt + 37 * i) % vocab for i in range(n)]


def _name_weights(rec, m):
    from brass.errors import BrassError
    for name in m.gguf.tensors:
        try:
            w = m.weights(name)
        except (BrassError, KeyError):
            continue
        rec.name(w.data if w.data is not None else w.dense, f"w:{name}")


def _name_cache(rec, s, tag: str):
    c = s.cache
    for il, (k, v) in enumerate(zip(c.k, c.v)):
        if k is not None:
            rec.name(k, f"{tag}.k{il}")
            rec.name(v, f"{tag}.v{il}")
    if c.recurrent is not None:
        for il in c.recurrent.layers:
            rec.name(c.recurrent.conv[il], f"{tag}.conv{il}")
            rec.name(c.recurrent.ssm[il], f"{tag}.ssm{il}")


def record_model(name: str) -> list[dict]:
    """The events of the scenario (see the module's docstring) on synthetic model `name`."""
    import brass
    rec = fake_cupy.Recorder()
    with fake_cuda(rec):
        m = brass.load(str(MODELS_DIR / f"{name}.gguf"), backend="cuda", quiet=True)
        _name_weights(rec, m)
        V = m.config.n_vocab
        rec.on = True

        rec.event(op="phase", name=f"decode: generate {DECODE_TOKENS} tokens after a {DECODE_PROMPT}-token prompt")
        s0 = m.new_session(N_CTX)
        _name_cache(rec, s0, "s0")
        got = list(m.generate(_ids(DECODE_PROMPT, V, 1), max_tokens=DECODE_TOKENS, stop_at_eog=False, session=s0))
        rec.event(op="tokens", ids=got)

        ids = _ids(PROMPT, V, 5)
        a, b = m.new_session(N_CTX), m.new_session(N_CTX)
        _name_cache(rec, a, "s1")
        _name_cache(rec, b, "s2")
        rec.event(op="phase", name=f"prompt: {PROMPT} tokens in session s1 (its class's first read: eager, padded)")
        a.prefill(ids, device_logits=True)
        rec.event(op="phase", name=f"prompt: {PROMPT} tokens in session s2 (the model's start graph)")
        b.prefill(ids, device_logits=True)
        rec.event(op="phase", name=f"prompt: {PROMPT} tokens in session s1 after a reset (its own graph)")
        a.reset()
        a.prefill(ids, device_logits=True)
        rec.event(op="graphs", start_error=m.start_graphs_error, session_error=a.prompt_graphs_error,
                  session_graphs=a.prompt_graphs)
        rec.on = False
    return [_canonical(e) for e in rec.events]


# -- the recording file --------------------------------------------------------------------

def header() -> dict:
    return {
        "about": "kernel launches, cuBLAS calls, copies, graph captures and CuPy array work of the CUDA "
                 "backend on each synthetic model, through conformance/harness/fake_cupy.py; written by "
                 f"`{RECORD_CMD}`, read by conformance/kernels/test_launch_sequence.py",
        "device": {k: fake_cupy.DEVICE_PROPERTIES[k] for k in
                   ("name", "multiProcessorCount", "major", "minor", "sharedMemPerBlockOptin", "totalGlobalMem")},
        "scenario": {"n_ctx": N_CTX, "decode_prompt": DECODE_PROMPT, "decode_tokens": DECODE_TOKENS,
                     "prompt": PROMPT},
    }


def write(models: dict[str, list[dict]], path: Path = DATA):
    """The recording, one event a line (a re-recording's diff then shows the events changed)."""
    lines = ["{"]
    for k, v in header().items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v)},")
    lines.append(' "models": {')
    names = sorted(models)
    for i, name in enumerate(names):
        lines.append(f"  {json.dumps(name)}: [")
        ev = models[name]
        for j, e in enumerate(ev):
            lines.append("   " + json.dumps(e) + ("," if j + 1 < len(ev) else ""))
        lines.append("  ]" + ("," if i + 1 < len(names) else ""))
    lines.append(" }")
    lines.append("}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def read(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def first_difference(want: list[dict], got: list[dict], context: int = 3) -> str | None:
    """None when the two event lists are equal; else where they first differ: the index, the
    phase it falls in, the events before it, both events (and the fields that differ), and
    how many events differ in all."""
    n = next((i for i, (w, g) in enumerate(zip(want, got)) if w != g), None)
    if n is None:
        if len(want) == len(got):
            return None
        n = min(len(want), len(got))
    phase = next((e["name"] for e in reversed(want[:n + 1]) if e.get("op") == "phase"), "(before any phase)")
    lines = [f"event {n} of {len(want)} recorded ({len(got)} now), in phase '{phase}':"]
    for i in range(max(0, n - context), n):
        lines.append(f"    [{i}] {json.dumps(want[i])}")
    w = want[n] if n < len(want) else None
    g = got[n] if n < len(got) else None
    lines.append(f"  recorded [{n}] {json.dumps(w) if w is not None else '(none: the recording ends here)'}")
    lines.append(f"  now      [{n}] {json.dumps(g) if g is not None else '(none: the run ends here)'}")
    if isinstance(w, dict) and isinstance(g, dict):
        for k in sorted(set(w) | set(g)):
            if w.get(k) != g.get(k):
                if isinstance(w.get(k), dict) and isinstance(g.get(k), dict):
                    sub = [f"{f}: {w[k].get(f)!r} -> {g[k].get(f)!r}" for f in sorted(set(w[k]) | set(g[k]))
                           if w[k].get(f) != g[k].get(f)]
                    lines.append(f"  {k} differs: " + "; ".join(sub))
                else:
                    lines.append(f"  {k} differs: {json.dumps(w.get(k))} -> {json.dumps(g.get(k))}")
    same = sum(1 for x, y in zip(want, got) if x == y)
    lines.append(f"  {max(len(want), len(got)) - same} of {max(len(want), len(got))} events differ in all")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--record":
        print(__doc__)
        return 2
    if switches_set():
        print(f"launch_recording: {', '.join(switches_set())} set; the recording is of the defaults")
        return 2
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    models = read()["models"] if only and DATA.exists() else {}
    for name in only or synthetic_models():
        models[name] = record_model(name)
        launches = sum(e["op"] == "launch" for e in models[name])
        print(f"{name}: {len(models[name])} events, {launches} launches")
    write(models)
    print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
