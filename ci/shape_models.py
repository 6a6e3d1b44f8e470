"""Shape-true synthetic models for speed work: GGUF files with a real model's architecture,
tensor shapes, quantization recipe and vocabulary size, filled with seeded random (valid)
quant blocks, written in seconds to minutes where real weights cannot go (the GPU runner).

Both engines run them: llama.cpp (llama-bench) and Brass (brass bench) read the same file.
The weights are random, so the text is noise, but every byte a token reads is a real byte of
a real-sized matrix: decode and prefill cost what they cost on the real model.

    python3 ci/shape_models.py qwen3-0.6b /tmp/models/         # one shape
    python3 ci/shape_models.py all /tmp/models/                # every shape in SHAPES
    python3 ci/shape_models.py qwen3-8b /tmp/m/ --layers 2     # fewer layers (quick checks)

Recipe, as Q4_K_M files have it: Q4_K matrices and token embedding, Q6_K for attn_v,
ffn_down (experts too) and the output head, F32 norms and router. The tokenizer is a
byte-level BPE (Qwen2 pre-tokenizer) of the model's vocabulary size: the 256 byte tokens,
every pair of them, then triples, each with its merge, and the special tokens at the end.
Needs only numpy and this repository (the runner has no gguf-py).
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.gguf import BLOCK_SIZES, GGMLType  # noqa: E402
from engine.quants import random_blocks  # noqa: E402

Q4K, Q6K, F32 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F32

# Hyper-parameters of real models (their config.json / GGUF metadata).
SHAPES = {
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, hidden=1024, ffn=3072, n_head=16, n_kv_head=8,
                       head_dim=128, vocab=151936, rope_base=1e6, tied=False),
    "qwen3-8b": dict(arch="qwen3", n_layer=36, hidden=4096, ffn=12288, n_head=32, n_kv_head=8,
                     head_dim=128, vocab=151936, rope_base=1e6, tied=False),
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, hidden=2048, ffn=6144, n_head=32, n_kv_head=4,
                          head_dim=128, vocab=151936, rope_base=1e6, tied=False,
                          n_expert=128, n_expert_used=8, expert_ffn=768),
}

POOL_BYTES = 96 << 20       # random blocks per type, reused across tensors at shifted offsets
GGUF_STRING, GGUF_UINT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_ARRAY, GGUF_INT32 = 8, 4, 6, 7, 9, 5
ALIGN = 32


def tensor_specs(c: dict) -> dict[str, tuple[GGMLType, tuple[int, ...]]]:
    """{name: (type, numpy shape)} of every tensor of shape config `c`."""
    D, V, Dh = c["hidden"], c["vocab"], c["head_dim"]
    specs = {"token_embd.weight": (Q4K, (V, D)), "output_norm.weight": (F32, (D,))}
    if not c["tied"]:
        specs["output.weight"] = (Q6K, (V, D))
    for i in range(c["n_layer"]):
        p = f"blk.{i}."
        specs.update({
            p + "attn_norm.weight": (F32, (D,)),
            p + "attn_q.weight": (Q4K, (c["n_head"] * Dh, D)),
            p + "attn_k.weight": (Q4K, (c["n_kv_head"] * Dh, D)),
            p + "attn_v.weight": (Q6K, (c["n_kv_head"] * Dh, D)),
            p + "attn_output.weight": (Q4K, (D, c["n_head"] * Dh)),
            p + "attn_q_norm.weight": (F32, (Dh,)),
            p + "attn_k_norm.weight": (F32, (Dh,)),
            p + "ffn_norm.weight": (F32, (D,)),
        })
        if c.get("n_expert"):
            E, F = c["n_expert"], c["expert_ffn"]
            specs.update({
                p + "ffn_gate_inp.weight": (F32, (E, D)),
                p + "ffn_gate_exps.weight": (Q4K, (E, F, D)),
                p + "ffn_up_exps.weight": (Q4K, (E, F, D)),
                p + "ffn_down_exps.weight": (Q6K, (E, D, F)),
            })
        else:
            F = c["ffn"]
            specs.update({
                p + "ffn_gate.weight": (Q4K, (F, D)),
                p + "ffn_up.weight": (Q4K, (F, D)),
                p + "ffn_down.weight": (Q6K, (D, F)),
            })
    return specs


def tokenizer(vocab: int) -> dict:
    """A byte-level BPE of exactly `vocab` tokens (GPT-2 byte-to-unicode alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = [chr(c) for _, c in sorted(zip(bs, cs))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n_normal = vocab - len(specials)
    tokens, merges = list(alphabet), []
    for a in alphabet:
        for b in alphabet:
            if len(tokens) >= n_normal:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    i = 0
    while len(tokens) < n_normal:             # triples: a pair token + one more byte
        pair = tokens[256 + i // 256]
        c = alphabet[i % 256]
        tokens.append(pair + c)
        merges.append(f"{pair} {c}")
        i += 1
    tokens += specials
    types = [1] * n_normal + [3] * len(specials)        # NORMAL, CONTROL
    return dict(tokens=tokens, types=types, merges=merges, eos=vocab - 3, bos=vocab - 3)


class _Meta:
    def __init__(self):
        self.parts: list[bytes] = []
        self.count = 0

    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    def add(self, key: str, vtype: int, value):
        out = self._str(key) + struct.pack("<I", vtype)
        if vtype == GGUF_STRING:
            out += self._str(value)
        elif vtype == GGUF_UINT32:
            out += struct.pack("<I", value)
        elif vtype == GGUF_INT32:
            out += struct.pack("<i", value)
        elif vtype == GGUF_FLOAT32:
            out += struct.pack("<f", value)
        elif vtype == GGUF_BOOL:
            out += struct.pack("<?", value)
        self.parts.append(out)
        self.count += 1

    def add_array(self, key: str, etype: int, values):
        out = self._str(key) + struct.pack("<IIQ", GGUF_ARRAY, etype, len(values))
        if etype == GGUF_STRING:
            out += b"".join(self._str(v) for v in values)
        elif etype == GGUF_INT32:
            out += np.asarray(values, "<i4").tobytes()
        elif etype == GGUF_FLOAT32:
            out += np.asarray(values, "<f4").tobytes()
        self.parts.append(out)
        self.count += 1


def metadata(name: str, c: dict) -> _Meta:
    a = c["arch"]
    m = _Meta()
    m.add("general.architecture", GGUF_STRING, a)
    m.add("general.name", GGUF_STRING, f"{name} (shape-true, random weights)")
    m.add("general.alignment", GGUF_UINT32, ALIGN)
    m.add("general.file_type", GGUF_UINT32, 15)             # MOSTLY_Q4_K_M
    m.add(f"{a}.context_length", GGUF_UINT32, 40960)
    m.add(f"{a}.embedding_length", GGUF_UINT32, c["hidden"])
    m.add(f"{a}.block_count", GGUF_UINT32, c["n_layer"])
    m.add(f"{a}.feed_forward_length", GGUF_UINT32, c["ffn"])
    m.add(f"{a}.attention.head_count", GGUF_UINT32, c["n_head"])
    m.add(f"{a}.attention.head_count_kv", GGUF_UINT32, c["n_kv_head"])
    m.add(f"{a}.attention.key_length", GGUF_UINT32, c["head_dim"])
    m.add(f"{a}.attention.value_length", GGUF_UINT32, c["head_dim"])
    m.add(f"{a}.rope.freq_base", GGUF_FLOAT32, c["rope_base"])
    m.add(f"{a}.attention.layer_norm_rms_epsilon", GGUF_FLOAT32, 1e-6)
    if c.get("n_expert"):
        m.add(f"{a}.expert_count", GGUF_UINT32, c["n_expert"])
        m.add(f"{a}.expert_used_count", GGUF_UINT32, c["n_expert_used"])
        m.add(f"{a}.expert_feed_forward_length", GGUF_UINT32, c["expert_ffn"])
    tok = tokenizer(c["vocab"])
    m.add("tokenizer.ggml.model", GGUF_STRING, "gpt2")
    m.add("tokenizer.ggml.pre", GGUF_STRING, "qwen2")
    m.add_array("tokenizer.ggml.tokens", GGUF_STRING, tok["tokens"])
    m.add_array("tokenizer.ggml.token_type", GGUF_INT32, tok["types"])
    m.add_array("tokenizer.ggml.merges", GGUF_STRING, tok["merges"])
    m.add("tokenizer.ggml.eos_token_id", GGUF_UINT32, tok["eos"])
    m.add("tokenizer.ggml.bos_token_id", GGUF_UINT32, tok["bos"])
    m.add("tokenizer.ggml.add_bos_token", GGUF_BOOL, False)
    return m


def _nbytes(t: GGMLType, shape) -> int:
    blck, tsize = BLOCK_SIZES[t]
    return int(np.prod(shape)) // blck * tsize


def write(name: str, out: Path, layers: int | None = None, seed: int = 0) -> Path:
    """Write SHAPES[name] (optionally with fewer layers) to out (a file or a folder)."""
    c = dict(SHAPES[name])
    if layers:
        c["n_layer"] = layers
    path = out / f"{name}.gguf" if out.is_dir() or not out.suffix else out
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(c)
    meta = metadata(name, c)
    rng = np.random.default_rng(seed)
    # One pool of valid blocks per quant type: a tensor is a window of the pool starting at a
    # random whole block (wrapping around), so matrices differ without drawing 20 GB of randomness.
    pools = {t: random_blocks(t, POOL_BYTES // BLOCK_SIZES[t][1] // 8, 8 * BLOCK_SIZES[t][0], rng).reshape(-1)
             for t in (Q4K, Q6K)}
    infos, offset = [], 0
    for tname, (t, shape) in specs.items():
        ne = tuple(reversed(shape))
        infos.append(_Meta._str(tname) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                     + struct.pack("<IQ", int(t), offset))
        offset = (offset + _nbytes(t, shape) + ALIGN - 1) // ALIGN * ALIGN
    head = b"GGUF" + struct.pack("<IQQ", 3, len(specs), meta.count) + b"".join(meta.parts) + b"".join(infos)
    data_start = (len(head) + ALIGN - 1) // ALIGN * ALIGN
    t0 = time.time()
    with open(path, "wb") as f:
        f.write(head + b"\0" * (data_start - len(head)))
        pos = 0
        for tname, (t, shape) in specs.items():
            n = _nbytes(t, shape)
            f.write(b"\0" * (data_start + pos - f.tell()))
            if t == F32:
                # Norm weights near 1, router weights small: activations stay finite.
                scale = 0.02 if "gate_inp" in tname else 0.1
                base = 0.0 if "gate_inp" in tname else 1.0
                f.write((base + scale * rng.standard_normal(int(np.prod(shape)))).astype("<f4").tobytes())
            else:
                pool = pools[t]
                blk = BLOCK_SIZES[t][1]
                start = int(rng.integers(0, pool.size // blk)) * blk
                done = 0
                while done < n:
                    k = min(n - done, pool.size - start)
                    f.write(pool[start:start + k].tobytes())
                    done += k
                    start = 0
            pos = (pos + n + ALIGN - 1) // ALIGN * ALIGN
        f.write(b"\0" * (data_start + offset - f.tell()))
    size = path.stat().st_size
    print(f"wrote {path} ({size / 2**30:.2f} GiB, {len(specs)} tensors) in {time.time() - t0:.0f} s", flush=True)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=[*SHAPES, "all"])
    ap.add_argument("out", type=Path, help="folder (or .gguf path for one shape)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in (SHAPES if args.shape == "all" else [args.shape]):
        write(name, args.out, args.layers, args.seed)


if __name__ == "__main__":
    main()
