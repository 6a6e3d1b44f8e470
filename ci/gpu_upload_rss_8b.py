"""Usage on the GPU runner: python3 ci/gpu_upload_rss_8b.py /tmp/qwen3-8b-shape.gguf [scale] [--write-only]

Peak host RSS while the CUDA backend uploads a shape-true Qwen3-8B Q4_K_M-style file
(36 layers, hidden 4096, ffn 12288, 32/8 heads x 128, vocab 151936; Q4_K, Q6_K for attn_v,
ffn_down and output; F32 norms), written here with random bytes (upload does not look at
values). Prints base/peak RSS and the growth."""
import os, sys, time
import numpy as np
sys.path.insert(0, ".")
from brass.gguf import BLOCK_SIZES, GGMLType, GGUFFile
from conformance.harness.cases import write_gguf
Q4K, Q6K, F32 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F32
scale = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
L, D, FF, V = int(36 * scale) or 1, 4096, 12288, 151936
rng = np.random.default_rng(0)
cache = {}
def raw(t, shape):
    key = (t, shape)
    if key not in cache:
        n = int(np.prod(shape)); blk, ts = BLOCK_SIZES[t]
        cache[key] = (rng.standard_normal(n).astype(np.float32).view(np.uint8) if t == F32
                      else np.frombuffer(rng.bytes(n // blk * ts), np.uint8))
    return (t, shape, cache[key])
spec = {"token_embd.weight": raw(Q4K, (V, D)), "output.weight": raw(Q6K, (V, D)),
        "output_norm.weight": raw(F32, (D,))}
for i in range(L):
    p = f"blk.{i}."
    spec.update({p + "attn_q.weight": raw(Q4K, (D, D)), p + "attn_k.weight": raw(Q4K, (1024, D)),
                 p + "attn_v.weight": raw(Q6K, (1024, D)), p + "attn_output.weight": raw(Q4K, (D, D)),
                 p + "ffn_gate.weight": raw(Q4K, (FF, D)), p + "ffn_up.weight": raw(Q4K, (FF, D)),
                 p + "ffn_down.weight": raw(Q6K, (D, FF)), p + "attn_norm.weight": raw(F32, (D,)),
                 p + "ffn_norm.weight": raw(F32, (D,)), p + "attn_q_norm.weight": raw(F32, (128,)),
                 p + "attn_k_norm.weight": raw(F32, (128,))})
path = sys.argv[1]
t0 = time.time(); write_gguf(path, spec); cache.clear(); del spec
print(f"wrote {os.path.getsize(path) / 2**30:.2f} GiB in {time.time() - t0:.0f} s", flush=True)
if len(sys.argv) > 3 and sys.argv[3] == "--write-only":
    sys.exit(0)
import subprocess
code = f"""
import sys; sys.path.insert(0, ".")
from brass.backends.cuda import CudaBackend
from brass.gguf import GGUFFile
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
b = CudaBackend(); b.zeros(1).sum()
base = status("VmRSS:")
gf = GGUFFile({path!r}); ws = {{}}
import time; t0 = time.time()
b.load(gf, lambda name: ws.setdefault(name, b.weight(gf, name)), quiet=True)
b.synchronize()
peak = status("VmHWM:")
print(f"uploaded {{len(ws)}} tensors in {{time.time() - t0:.1f}} s; RSS base {{base / 2**20:.0f}} MiB, peak {{peak / 2**20:.0f}} MiB, growth {{(peak - base) / 2**20:.0f}} MiB")
"""
print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout or "failed")
