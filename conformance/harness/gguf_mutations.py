"""Mutation fuzz of model loading: copies of the synthetic GGUFs (golden/models/) with flipped
bytes, truncations, extreme integers and floats in the header, renamed tensors and shifted
chunks, each loaded with `brass.load(..., backend="numpy")` and run on one prompt. Every copy
must either run or fail with a BrassError; anything else (a KeyError from deep in the forward
pass, a ValueError from a mat-mul, a hang) is a bug.

conformance/models/test_fuzz_load.py runs a few thousand copies on every CI run; this script runs
many more over several processes, each copy under a time limit:

    python ci/fuzz_load.py -n 100000 --jobs 2              # counts: ok / BrassError / other
    python ci/fuzz_load.py --seed 7 --case 1234 -v         # replay one copy, with its traceback

A copy is named by (seed, case): the same pair gives the same bytes on any machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    # One BLAS thread per worker process: the matrices are small, and threads of several
    # processes fighting over the cores made the run slower, not faster.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted((ROOT / "golden" / "models").glob("*.gguf"))
PROMPT = "Hello world"

# GGUF metadata value types: struct format of each scalar type (8: string, 9: array)
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_FLOATS = ("<f", "<d")
# Integers that break code which trusts them: zero, negative (read as huge when unsigned),
# the limits of each width, and one past them.
EXTREME_INTS = (0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
                -2**31, 7, 255, 65535)
EXTREME_FLOATS = (0.0, -0.0, -1.0, 1.0, float("nan"), float("inf"), float("-inf"), 1e38, -1e38,
                  1e-45, 3.0e9, 0.5)


@dataclass
class Field:
    """An integer or float somewhere in the header that a mutation may overwrite."""
    what: str
    pos: int
    fmt: str


@dataclass
class Name:
    """A string in the header (metadata key, tensor name, string value): its bytes' position."""
    what: str
    pos: int
    text: bytes


@dataclass
class Layout:
    """Where the parts of a GGUF header are, found by walking it as the reader does."""
    size: int
    header_end: int = 0                    # end of the tensor directory
    values: list[Field] = field(default_factory=list)      # metadata scalars
    structure: list[Field] = field(default_factory=list)   # counts, types, lengths, dims, offsets
    elements: list[Field] = field(default_factory=list)    # a sample of numeric array elements
    tensor_names: list[Name] = field(default_factory=list)
    keys: list[Name] = field(default_factory=list)


def layout(data: bytes) -> Layout:
    lay = Layout(size=len(data))
    pos = 8

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string(what, names=None):
        nonlocal pos
        lay.structure.append(Field(f"length of {what}", pos, "<Q"))
        n = take("<Q")
        if names is not None:
            names.append(Name(what, pos, data[pos:pos + n]))
        pos += n

    lay.structure.append(Field("tensor count", pos, "<Q"))
    n_tensors = take("<Q")
    lay.structure.append(Field("metadata count", pos, "<Q"))
    n_kv = take("<Q")
    for _ in range(n_kv):
        string("metadata key", lay.keys)
        key = lay.keys[-1].text.decode("utf-8", "replace")
        lay.structure.append(Field(f"value type of {key}", pos, "<I"))
        vtype = take("<I")
        if vtype == 8:
            string(key)
        elif vtype == 9:
            lay.structure.append(Field(f"element type of {key}", pos, "<I"))
            etype = take("<I")
            lay.structure.append(Field(f"length of {key}", pos, "<Q"))
            n = take("<Q")
            if etype == 8:
                for i in range(n):
                    if i < 4 or i == n - 1:
                        lay.structure.append(Field(f"length of {key}[{i}]", pos, "<Q"))
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            else:
                fmt = _SCALAR_FMT[etype]
                size = struct.calcsize(fmt)
                for i in sorted({0, 1, n // 2, n - 1} & set(range(n))):
                    lay.elements.append(Field(f"{key}[{i}]", pos + i * size, fmt))
                pos += n * size
        else:
            lay.values.append(Field(key, pos, _SCALAR_FMT[vtype]))
            take(_SCALAR_FMT[vtype])
    for _ in range(n_tensors):
        string("tensor name", lay.tensor_names)
        name = lay.tensor_names[-1].text.decode("utf-8", "replace")
        lay.structure.append(Field(f"dims of tensor {name}", pos, "<I"))
        n_dims = take("<I")
        for d in range(n_dims):
            lay.structure.append(Field(f"ne[{d}] of tensor {name}", pos, "<Q"))
            take("<Q")
        lay.structure.append(Field(f"type of tensor {name}", pos, "<I"))
        take("<I")
        lay.structure.append(Field(f"offset of tensor {name}", pos, "<Q"))
        take("<Q")
    lay.header_end = pos
    return lay


def set_value(data: bytes, what: str, value) -> bytes:
    """`data` with the header field named `what` (a metadata key, or e.g. "ne[1] of tensor
    blk.0.attn_q.weight", "type of tensor output.weight") set to `value`."""
    lay = layout(data)
    f = next(f for f in lay.values + lay.structure + lay.elements if f.what == what)
    buf = bytearray(data)
    buf[f.pos:f.pos + struct.calcsize(f.fmt)] = _pack(f.fmt, value)
    return bytes(buf)


def rename_tensor(data: bytes, old: str, new: str) -> bytes:
    """`data` with tensor `old` renamed to `new` (a name of the same length)."""
    n = next(n for n in layout(data).tensor_names if n.text == old.encode())
    assert len(new) == len(old)
    return data[:n.pos] + new.encode() + data[n.pos + len(old):]


# -- mutations ---------------------------------------------------------------------------------
# Each takes (bytearray, Layout, rng), changes the bytes and returns what it did.

def _pack(fmt: str, value) -> bytes:
    if fmt in _FLOATS:
        return struct.pack(fmt, value)
    width = struct.calcsize(fmt)
    return (int(value) % (1 << (8 * width))).to_bytes(width, "little")


def _set_field(buf, f: Field, rng, values=None) -> str:
    if f.fmt in _FLOATS:
        v = values or EXTREME_FLOATS
        value = v[rng.integers(len(v))]
    else:
        old = int.from_bytes(buf[f.pos:f.pos + struct.calcsize(f.fmt)], "little")
        candidates = EXTREME_INTS + (old + 1, old - 1, old * 2, old // 2)
        value = values[rng.integers(len(values))] if values else candidates[rng.integers(len(candidates))]
    buf[f.pos:f.pos + struct.calcsize(f.fmt)] = _pack(f.fmt, value)
    return f"{f.what} = {value}"


def m_metadata_value(buf, lay, rng):
    return _set_field(buf, lay.values[rng.integers(len(lay.values))], rng)


def m_structure(buf, lay, rng):
    return _set_field(buf, lay.structure[rng.integers(len(lay.structure))], rng)


def m_array_element(buf, lay, rng):
    return _set_field(buf, lay.elements[rng.integers(len(lay.elements))], rng)


def m_retype(buf, lay, rng):
    """A metadata value read as another type (the bytes after it then read as something else),
    or an array whose elements become strings or arrays."""
    types = [f for f in lay.structure if f.what.startswith(("value type of ", "element type of "))]
    return _set_field(buf, types[rng.integers(len(types))], rng, tuple(range(13)))


def m_tensor_dim(buf, lay, rng):
    dims = [f for f in lay.structure if f.what.startswith(("ne[", "dims of"))]
    f = dims[rng.integers(len(dims))]
    small = (0, 1, 2, 32, 64, 128, 255, 256, 257, 512, 1024)
    return _set_field(buf, f, rng, small if rng.random() < 0.6 else None)


def m_tensor_type(buf, lay, rng):
    types = [f for f in lay.structure if f.what.startswith("type of tensor ")]
    f = types[rng.integers(len(types))]
    # mostly real ggml types (some unsupported ones), sometimes an id that is none
    return _set_field(buf, f, rng, (0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 13, 14, 16, 24, 30, 39, 40, 99))


def m_rename_tensor(buf, lay, rng):
    """One character of a tensor name changed: the tensor seems missing, or a block number
    points at another layer."""
    n = lay.tensor_names[rng.integers(len(lay.tensor_names))]
    if not n.text:
        return "rename (empty name)"
    i = int(rng.integers(len(n.text)))
    old = n.text.decode("utf-8", "replace")
    c = n.text[i]
    new = ord("0") + (c - ord("0") + 1 + int(rng.integers(9))) % 10 if chr(c).isdigit() \
        else int(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz_.0123456789")))
    buf[n.pos + i] = new
    return f"rename tensor {old} -> {bytes(buf[n.pos:n.pos + len(n.text)]).decode('utf-8', 'replace')}"


def m_swap_names(buf, lay, rng):
    """Two tensors whose names have the same length trade names (attn_q <-> attn_k,
    ffn_gate <-> ffn_down, blk.0 <-> blk.1): every name exists, the shapes disagree."""
    by_len: dict[int, list[Name]] = {}
    for n in lay.tensor_names:
        by_len.setdefault(len(n.text), []).append(n)
    groups = [g for g in by_len.values() if len(g) > 1]
    g = groups[rng.integers(len(groups))]
    a, b = (g[i] for i in rng.choice(len(g), 2, replace=False))
    buf[a.pos:a.pos + len(a.text)], buf[b.pos:b.pos + len(b.text)] = b.text, a.text
    return f"swap tensor names {a.text.decode()} <-> {b.text.decode()}"


def m_rename_key(buf, lay, rng):
    k = lay.keys[rng.integers(len(lay.keys))]
    i = int(rng.integers(len(k.text)))
    buf[k.pos + i] = (buf[k.pos + i] + 1 + int(rng.integers(60))) % 128 or 65
    new = bytes(buf[k.pos:k.pos + len(k.text)]).decode("utf-8", "replace")
    return f"rename key {k.text.decode()} -> {new}"


def _pos(lay, rng, header=0.8) -> int:
    """A byte position, most often in the header (the data is only weights)."""
    end = lay.header_end if rng.random() < header else lay.size
    return int(rng.integers(8, max(end, 9)))


def m_flip_bits(buf, lay, rng):
    done = []
    for _ in range(int(rng.integers(1, 9))):
        p, bit = _pos(lay, rng), int(rng.integers(8))
        buf[p] ^= 1 << bit
        done.append(f"{p}.{bit}")
    return "flip bits " + ",".join(done)


def m_random_bytes(buf, lay, rng):
    p = _pos(lay, rng)
    n = int(rng.integers(1, 17))
    buf[p:p + n] = rng.integers(0, 256, min(n, len(buf) - p), dtype=np.uint8).tobytes()
    return f"random bytes [{p}, {p + n})"


def m_truncate(buf, lay, rng):
    p = _pos(lay, rng, header=0.5)
    del buf[p:]
    return f"truncate at {p}"


def m_shift_chunk(buf, lay, rng):
    """Bytes inserted or removed in the middle (everything after moves), or a chunk rotated
    in place."""
    p = _pos(lay, rng, header=0.7)
    k = int(rng.choice([1, 2, 3, 4, 7, 8, 16, 32, 100]))
    kind = rng.integers(3)
    if kind == 0:
        buf[p:p] = bytes(k)
        return f"insert {k} bytes at {p}"
    if kind == 1:
        del buf[p:p + k]
        return f"delete {k} bytes at {p}"
    end = min(len(buf), p + int(rng.integers(k + 1, 4096)))
    buf[p:end] = buf[p + k:end] + buf[p:p + k]
    return f"rotate [{p}, {end}) by {k}"


MUTATIONS = {
    "metadata_value": (m_metadata_value, 5), "structure": (m_structure, 4), "retype": (m_retype, 2),
    "array_element": (m_array_element, 2), "tensor_dim": (m_tensor_dim, 3),
    "tensor_type": (m_tensor_type, 2), "rename_tensor": (m_rename_tensor, 2),
    "swap_names": (m_swap_names, 2), "rename_key": (m_rename_key, 2),
    "flip_bits": (m_flip_bits, 3), "random_bytes": (m_random_bytes, 2),
    "truncate": (m_truncate, 1), "shift_chunk": (m_shift_chunk, 2),
}
_NAMES = list(MUTATIONS)
_WEIGHTS = np.array([w for _, w in MUTATIONS.values()], float)
_WEIGHTS /= _WEIGHTS.sum()

_ORIGINALS: dict[Path, tuple[bytes, Layout]] = {}


def original(path: Path) -> tuple[bytes, Layout]:
    if path not in _ORIGINALS:
        data = path.read_bytes()
        _ORIGINALS[path] = (data, layout(data))
    return _ORIGINALS[path]


def mutant(seed: int, case: int) -> tuple[Path, bytes, list[str]]:
    """The bytes of copy `case` of seed `seed`: which model, and the mutations applied
    (one, sometimes two or three)."""
    rng = np.random.default_rng([seed, case])
    model = MODELS[case % len(MODELS)]
    data, lay = original(model)
    buf = bytearray(data)
    done = []
    for _ in range(int(rng.choice([1, 1, 1, 2, 3]))):
        name = _NAMES[rng.choice(len(_NAMES), p=_WEIGHTS)]
        done.append(f"{name}: {MUTATIONS[name][0](buf, lay, rng)}")
        if len(buf) != len(data):
            break           # positions after a truncation or shift no longer match the layout
    return model, bytes(buf), done


def run(path: str | os.PathLike) -> None:
    """Load and generate two tokens. Raises whatever the engine raises."""
    import brass
    m = brass.load(str(path), backend="numpy", quiet=True)
    try:
        ids = m.tokenizer.encode(PROMPT)
        out = list(m.generate(ids, max_tokens=2, stop_at_eog=False))
        m.tokenizer.decode(out)
    finally:
        m.gguf.close()


def check(seed: int, case: int, directory: str | os.PathLike) -> tuple[str, str]:
    """Run one copy: ("ok", ""), ("brass", message) or ("other", traceback)."""
    from brass.errors import BrassError
    model, data, done = mutant(seed, case)
    path = Path(directory) / f"fuzz-{os.getpid()}-{case}.gguf"
    path.write_bytes(data)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # NaN or huge weights from flipped bits are a model that runs, badly
            warnings.simplefilter("ignore", RuntimeWarning)
            run(path)
        return "ok", ""
    except BrassError as e:
        return "brass", str(e)
    except Exception:
        return "other", f"seed {seed} case {case} ({model.name}: {'; '.join(done)})\n" \
                        + traceback.format_exc()
    finally:
        path.unlink()


# -- the long run: worker processes, a time limit per copy ---------------------------------------

def _worker(conn, seed, directory):
    """Run the cases the parent sends, one at a time, answering each with its result."""
    while True:
        case = conn.recv()
        if case is None:
            return
        conn.send((case,) + check(seed, case, directory))


class _Pool:
    """Worker processes, each sent one case at a time, so that a case that runs past the time
    limit is known and its worker can be killed (and replaced) without disturbing the others."""

    def __init__(self, jobs, seed, directory):
        self.ctx = multiprocessing.get_context("fork")
        self.seed, self.directory = seed, directory
        self.busy = {}                     # connection -> (process, case, time sent)
        self.idle = [self._start() for _ in range(jobs)]

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, self.seed, self.directory), daemon=True)
        p.start()
        child.close()
        return parent, p

    def send(self, case):
        conn, p = self.idle.pop()
        conn.send(case)
        self.busy[conn] = (p, case, time.monotonic())

    def results(self, limit):
        """Wait a little; yield (case, kind, detail) for cases finished or past the limit."""
        for conn in multiprocessing.connection.wait(list(self.busy), timeout=1.0):
            p, case, _ = self.busy.pop(conn)
            try:
                result = conn.recv()
            except EOFError:               # the worker died (killed for memory, say)
                yield self._replace(conn, p, "died", case)
                continue
            self.idle.append((conn, p))
            yield result
        now = time.monotonic()
        for conn, (p, case, sent) in list(self.busy.items()):
            if now - sent > limit:
                del self.busy[conn]
                yield self._replace(conn, p, "hung", case)

    def _replace(self, conn, p, kind, case):
        p.kill()
        p.join()
        conn.close()
        self.idle.append(self._start())
        model, _, done = mutant(self.seed, case)
        return case, kind, f"seed {self.seed} case {case} ({model.name}: {'; '.join(done)}): {kind}"

    def close(self):
        for conn, p in self.idle:
            conn.send(None)
            p.join()
        for conn, (p, _, _) in self.busy.items():
            p.kill()
            p.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10000, help="number of mutated copies")
    ap.add_argument("--seed", type=int, default=None, help="default: random, printed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--limit", type=float, default=60.0, help="seconds allowed per copy")
    ap.add_argument("--budget", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--case", type=int, default=None, help="replay one copy")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    tmp = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        if a.case is not None:
            model, _, done = mutant(seed, a.case)
            print(f"seed {seed} case {a.case}: {model.name}: {'; '.join(done)}")
            kind, detail = check(seed, a.case, d)
            print(kind, detail)
            return 0 if kind != "other" else 1
        print(f"seed {seed}: {a.n} copies of {len(MODELS)} models, {a.jobs} processes, "
              f"{a.limit:g} s per copy", flush=True)
        for m in MODELS:
            original(m)                    # parsed once, before the workers fork
        counts: Counter = Counter()
        failures: list[str] = []
        messages: Counter = Counter()
        start = last = time.monotonic()
        pool = _Pool(a.jobs, seed, d)
        next_case = 0
        try:
            while next_case < a.n or pool.busy:
                while pool.idle and next_case < a.n:
                    pool.send(next_case)
                    next_case += 1
                for case, kind, detail in pool.results(a.limit):
                    counts[kind] += 1
                    if kind == "brass":
                        messages[_shape(detail)] += 1
                    elif kind != "ok":
                        failures.append(detail)
                        if a.verbose:
                            print(detail, flush=True)
                now = time.monotonic()
                if now - last > 60:
                    last = now
                    print(f"  {sum(counts.values())} done, {now - start:.0f} s: {dict(counts)}",
                          flush=True)
                if a.budget and now - start > a.budget and next_case < a.n:
                    print("wall-clock budget spent", flush=True)
                    a.n = next_case        # finish the cases in flight, send no more
        finally:
            pool.close()
    total = sum(counts.values())
    print(f"\nseed {seed}: {total} mutated files in {time.monotonic() - start:.0f} s: "
          f"{counts['ok']} loaded and ran, {counts['brass']} BrassError, "
          f"{counts['other']} other exceptions, {counts['hung']} hung (> {a.limit:g} s), "
          f"{counts['died']} workers died")
    if a.verbose:
        print("\nmost common BrassError messages (numbers and paths elided):")
        for msg, n in messages.most_common(60):
            print(f"  {n:6d}  {msg}")
    for f in failures[:20]:
        print("\n" + f)
    return 1 if failures else 0


def _shape(message: str) -> str:
    """A BrassError message with its path and numbers elided, to group them."""
    import re
    message = re.sub(r"\S*fuzz-\d+-\d+\.gguf", "FILE", message)
    return re.sub(r"\d+", "N", message)[:160]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
