"""kernels/attention_tiled.cu run on the CPU, for machines without a GPU (CI, development).

As mmq_host.py and delta_host.py do for their kernels: the kernel source itself (with
its headers) is compiled by g++ against the same shim of CUDA device code (every CUDA thread
of a block a std::thread, __shared__ variables function statics, one block at a time,
__syncthreads a barrier of the block's threads). The statements that are not plain C++ are
replaced textually, each found exactly once or the build refuses:

- the dynamic shared memory declaration becomes a host buffer filled with 0xFF bytes (NaN as
  F16 and as float32) before each block, so a read of shared memory the block never wrote
  shows in the result; a shared address (cvta.to.shared) is the offset into that buffer;
- cp.async copies its 16 bytes at once (commit and wait are no-ops: the copy has landed
  before the barrier that follows, as the real wait guarantees);
- ldmatrix .x4 (.trans) and mma.m16n8k16 .f16 become warp-collective emulations, written
  from the PTX ISA's documented fragment layouts (not from the kernel's comments):
    ldmatrix m8n8 .b16: lanes 8i..8i+7 give the row addresses of matrix i (16-byte aligned
      rows of 8 halves); lane l receives in register i row l/4, columns 2(l%4), 2(l%4)+1 of
      matrix i; with .trans row 2(l%4) and 2(l%4)+1 of column l/4 (the first in the low half);
    mma.m16n8k16.row.col.f32.f16.f16.f32, g = l/4, t = l%4, halves packed low index first:
      a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];
      c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = C[g+8][2t], C[g+8][2t+1].
    The products of two halves are exact in float32; the emulation adds the 16 of an output
    in k order onto the accumulator in float32 (the hardware's order and internal width are
    unspecified: the bound allows for float32 reordering);
- __shfl_xor_sync (the quad max, quantize_warp_q8_1's reductions) exchanges through the
  same per-warp slots; __launch_bounds__ takes two arguments here (the shim's takes one).
Each collective call publishes the lane's words into one of two slot arrays (alternating per
call), meets its warp at a barrier of 32 threads, and reads its partners' words: a lane can
only overwrite a slot array two calls later, after every lane of the warp has passed the
barrier of the call in between, so one barrier per call suffices. Half <-> float conversions
are host functions, round to nearest even with subnormals (checked against numpy by
conformance/kernels/test_kernels_attention_tiled.py).

The caches are paged as on the GPU (common.cuh kv_row): the callers pass a sequence's
contiguous keys and values, and `paged` scatters them into pools of KV_BLOCK-slot blocks under
a random permutation (blocks out of order, spare blocks and the last block's tail NaN), so a
kernel that reads a slot through the wrong block, or a block it was not given, reads NaN.

What this cannot check: that the hardware uses those layouts (the PTX ISA says so), timing,
bank conflicts, the asynchrony of cp.async (a missing wait passes here), FMA contraction, the
GPU's shared memory limits. It does check the tiling, the swizzled addressing, the tile and
mask edges, the grouped head index, both passes and the normalisation, the fragment
reuse of the logits as P, the output staging and the Q8_1 blocks, against the numpy reference.

    python3 conformance/harness/attn_host.py [seed]      # a few shapes; exit 1 on a failure
conformance/kernels/test_kernels_attention_tiled.py uses it (skips without g++).

The second half builds kernels/attention.cu the same way: the one-block decode kernel
(`attention`, test_kernels_attention_rowwise.py), kv_store, and the split-K kernels
(test_kernels_attention_split.py), whose grids run one block at a time in a shuffled order so
that any block of a row may be the one that combines the splits. One block at a time sees every
earlier block's stores, so the GPU's memory ordering cannot show here: the done counter's
fences are checked instead against the PTX memory model's release / acquire rule
(ROWWISE_HARNESS says how).
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness.mmq_host import HOST_HALF, HOST_WARP_SYNC, SHIM, compile_host, host_headers, q8_1_blocks  # noqa: E402

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
SOURCE = "attention_tiled.cu"
HEADERS = ("common.cuh", "params.cuh")
BQ = 64                     # queries per block (ATTN_TILED_BQ)

# (statement pattern, replacement): every inline PTX statement of attention_tiled.cu
_REPLACE = (
    (r'extern __shared__ __align__\(16\) u8 attn_smem\[\];', "u8 * const attn_smem = host_smem;"),
    (r'asm\("\{ \.reg \.u64 t; cvta\.to\.shared\.u64.*?\);', "a = (u32) ((const u8 *) p - host_smem);"),
    (r'asm volatile\("cp\.async\.cg\.shared\.global.*?\);', "memcpy(host_smem + dst, src, 16);"),
    (r'asm volatile\("cp\.async\.commit_group;".*?\);', "(void) 0;"),
    (r'asm volatile\("cp\.async\.wait_group %0;".*?\);', "(void) 0;"),
    (r'asm volatile\("ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16.*?\);', "host_ldmatrix_x4(r, addr, false);"),
    (r'asm volatile\("ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16.*?\);', "host_ldmatrix_x4(r, addr, true);"),
    (r'asm volatile\("mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32.*?\);', "host_mma_f16(d, a, b0, b1);"),
)

HARNESS = r"""#include "shim.h"
#undef __launch_bounds__
#define __launch_bounds__(...)
#include <cstdio>
#include <limits>
unsigned char * host_smem;
static size_t host_smem_size;
void host_ldmatrix_x4(unsigned (&r)[4], unsigned addr, bool trans);
void host_mma_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
#include "attn_host.cu"

thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
static std::barrier<> * block_bar;
static std::barrier<> * warp_bar[ATTN_TILED_THREADS / 32];
struct Slot { unsigned w[6]; };
static Slot xch[2][ATTN_TILED_THREADS];
static thread_local unsigned xseq;
void __syncthreads() { block_bar->arrive_and_wait(); }

// One warp-collective call: publish this lane's words, meet the warp; the warp's 32 slots.
static const Slot * publish(const unsigned * w, int n) {
    const unsigned i = threadIdx.x;
    Slot * s = xch[xseq++ & 1];
    for (int k = 0; k < n; ++k) s[i].w[k] = w[k];
    warp_bar[i / 32]->arrive_and_wait();
    return s + (i / 32) * 32;
}

HOST_HALF

float host_shfl_xor(float v, int o) {
    unsigned w; memcpy(&w, &v, 4);
    const Slot * s = publish(&w, 1);
    const unsigned r = s[(threadIdx.x % 32) ^ (unsigned) o].w[0];
    float f; memcpy(&f, &r, 4);
    return f;
}

double host_shfl_xor_d(double, int) { abort(); }

static unsigned short smem_half(unsigned off) {
    if (off + 2 > host_smem_size) { fprintf(stderr, "ldmatrix: shared offset %u out of range\n", off); abort(); }
    unsigned short h; memcpy(&h, host_smem + off, 2);
    return h;
}

void host_ldmatrix_x4(unsigned (&r)[4], unsigned addr, bool trans) {
    if (addr % 16) { fprintf(stderr, "ldmatrix: row address %u is not 16-byte aligned\n", addr); abort(); }
    const Slot * s = publish(&addr, 1);
    const unsigned l = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) {
        if (!trans) {
            const unsigned row = s[8 * i + l / 4].w[0] + 4 * (l % 4);
            r[i] = smem_half(row) | ((unsigned) smem_half(row + 2) << 16);
        } else {
            const unsigned lo = s[8 * i + 2 * (l % 4)].w[0], hi = s[8 * i + 2 * (l % 4) + 1].w[0];
            r[i] = smem_half(lo + 2 * (l / 4)) | ((unsigned) smem_half(hi + 2 * (l / 4)) << 16);
        }
    }
}

static float frag_half(const Slot * s, int lane, int reg, int k) {
    return host_h2f((unsigned short) (s[lane].w[reg] >> (16 * (k % 2))));
}

void host_mma_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const unsigned w[6] = {a[0], a[1], a[2], a[3], b0, b1};
    const Slot * s = publish(w, 6);
    const int l = threadIdx.x % 32, g = l / 4, t = l % 4;
    for (int c = 0; c < 4; ++c) {
        const int row = g + 8 * (c / 2), col = 2 * t + c % 2;
        float acc = d[c];
        for (int k = 0; k < 16; ++k) {
            const float x = frag_half(s, 4 * (row % 8) + (k % 8) / 2, (row >= 8) + 2 * (k >= 8), k);
            const float y = frag_half(s, 4 * col + (k % 8) / 2, 4 + (k >= 8), k);
            acc += x * y;
        }
        d[c] = acc;
    }
}

typedef void (*kernel_t)(const float *, const u16 *, const u16 *, const int *, const int *, float *,
                         block_q8_1 *, const AttentionTiledParams);
struct Entry { int d, dv; kernel_t fn; int smem; };
static const Entry entries[] = { ENTRIES };

static const Entry * find(int D, int DV) {
    for (const Entry & e : entries) if (e.d == D && e.dv == DV) return &e;
    return nullptr;
}

extern "C" int attn_smem_bytes(int D, int DV) {
    const Entry * e = find(D, DV);
    return e ? e->smem : -1;
}

extern "C" int run_attn(int D, int DV, const float * q, const u16 * k, const u16 * v, const int * pos,
                        const int * table, float * out, block_q8_1 * out_q, int T, int H, int Hkv, int cap, int window,
                        float scale, int write_q8) {
    const Entry * e = find(D, DV);
    if (!e) return 1;
    AttentionTiledParams p{};
    p.n_tokens = T; p.n_heads = H; p.n_kv_heads = Hkv; p.capacity = cap; p.window = window;
    p.scale = scale; p.write_q8 = write_q8;
    std::vector<unsigned char> sm(e->smem);
    host_smem = sm.data();
    host_smem_size = sm.size();
    std::barrier<> bb(ATTN_TILED_THREADS); block_bar = &bb;
    for (int i = 0; i < ATTN_TILED_THREADS / 32; ++i) warp_bar[i] = new std::barrier<>(32);
    gridDim = {(unsigned) H, (unsigned) ((T + ATTN_TILED_BQ - 1) / ATTN_TILED_BQ), 1};
    blockDim = {ATTN_TILED_THREADS, 1, 1};
    for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            std::fill(sm.begin(), sm.end(), (unsigned char) 0xFF);
            blockIdx = {bx, by, 0};
            std::vector<std::thread> th;
            for (unsigned i = 0; i < ATTN_TILED_THREADS; ++i)
                th.emplace_back([=] { threadIdx = {i, 0, 0}; xseq = 0; e->fn(q, k, v, pos, table, out, out_q, p); });
            for (auto & t : th) t.join();
        }
    for (int i = 0; i < ATTN_TILED_THREADS / 32; ++i) delete warp_bar[i];
    return 0;
}

extern "C" void f32_to_f16_array(const float * x, unsigned short * y, long long n) {
    for (long long i = 0; i < n; ++i) y[i] = host_f2h(x[i]);
}
"""


def kernel_head_dims(source: str | None = None) -> list[tuple[int, int]]:
    """The (D, DV) pairs attention_tiled.cu instantiates (its ATTN_TILED_KERNEL lines)."""
    s = source if source is not None else (KERNEL_DIR / SOURCE).read_text()
    return [(int(d), int(dv)) for d, dv in re.findall(r"^ATTN_TILED_KERNEL\(\w+, (\d+), (\d+)\)", s, re.M)]


def _sources(kernel_text: str | None = None) -> dict[str, str]:
    out = host_headers(HEADERS)
    s = kernel_text if kernel_text is not None else (KERNEL_DIR / SOURCE).read_text()
    for pattern, repl in _REPLACE:
        s, n = re.subn(pattern, lambda _m, r=repl: r, s, flags=re.S)
        if n != 1:
            raise RuntimeError(f"{SOURCE}: expected one statement matching {pattern!r}, found {n}")
    out["attn_host.cu"] = s
    out["shim.h"] = SHIM
    entries = ", ".join(f"{{{d}, {dv}, attention_tiled_{d}_{dv}, ATTN_TILED_SMEM({d}, {dv})}}"
                        for d, dv in kernel_head_dims(s))
    out["harness.cpp"] = HARNESS.replace("ENTRIES", entries).replace("HOST_HALF", HOST_HALF)
    return out


def build(kernel_text: str | None = None) -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of attention_tiled.cu (or of `kernel_text`, a modified
    copy of it); raises RuntimeError without g++."""
    so = compile_host(_sources(kernel_text), "attn", SOURCE)
    so.run_attn.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5 + \
                           [ctypes.c_float, ctypes.c_int]
    so.attn_smem_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    so.f32_to_f16_array.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    return so


def _aligned(a: np.ndarray, dtype) -> np.ndarray:
    """A C-contiguous copy of a with a 64-byte aligned base (the kernel reads 16-byte vectors)."""
    a = np.asarray(a, dtype)
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + a.nbytes].view(dtype).reshape(a.shape)
    out[...] = a
    return out


KV_BLOCK = 16               # slots per KV block (common.cuh KV_BLOCK, engine/kv_cache.py BLOCK_TOKENS)


def paged(rng, seqs, spare: int = 3):
    """The paged layout of sequences' caches: `seqs` a list, one per sequence, of its
    contiguous caches ([cap_i, H_kv, D] each; a sequence's caches share its block table) ->
    (tables int32 [n_seq, stride], pools [n_blocks, KV_BLOCK, H_kv, D] one per cache kind).
    Blocks are handed out under a random permutation of the pool (out of order, not
    adjacent), `spare` blocks are never handed out, and those, the tail of each sequence's
    last block and the table entries past a sequence's blocks (pointing at a spare block) are
    NaN to the kernel: a read through a wrong index shows in its output."""
    nbs = [-(-s[0].shape[0] // KV_BLOCK) for s in seqs]
    n = sum(nbs) + spare
    order = rng.permutation(n).astype(np.int32)
    stride = max(nbs)
    tables = np.full((len(seqs), stride), order[-1], np.int32)      # a spare block
    pools = [np.full((n, KV_BLOCK, *c.shape[1:]), np.nan, c.dtype) for c in seqs[0]]
    at = 0
    for i, (caches, nb) in enumerate(zip(seqs, nbs)):
        tables[i, :nb] = order[at:at + nb]
        at += nb
        for pool, c in zip(pools, caches):
            flat = np.full((nb * KV_BLOCK, *c.shape[1:]), np.nan, c.dtype)
            flat[:c.shape[0]] = c
            pool[tables[i, :nb]] = flat.reshape(nb, KV_BLOCK, *c.shape[1:])
    return tables, pools


def device_sequence(backend, rng, k, v=None, spare: int = 3):
    """One sequence's (keys, values) layers on `backend` (a CudaBackend) holding the
    contiguous caches k / v ([cap, H_kv, D] float16; v None: the values are the keys' own pool,
    Gemma 4), paged under `rng`'s permutation (`paged`) into device pools: engine/kv_cache.py
    PagedLayers over one BlockTable with its device copy, as a session's cache holds them."""
    return device_rows(backend, rng, [(k, v)], spare)[0]


def device_rows(backend, rng, seqs, spare: int = 3):
    """A batched step's rows on `backend`: per sequence of `seqs` ((k, v) contiguous caches, v
    None for the keys' own pool) its (keys, values) PagedLayers, all in one pool pair."""
    from brass.kv_cache import BlockTable, PagedLayer
    same = seqs[0][1] is None
    tables, pools = paged(rng, [(k,) if same else (k, v) for k, v in seqs], spare)
    kp = backend.asarray(pools[0])
    vp = kp if same else backend.asarray(pools[1])
    out = []
    for (k, _), row in zip(seqs, tables):
        t = BlockTable(k.shape[0])
        t.table = row[:-(-k.shape[0] // KV_BLOCK)].astype(np.int64)
        t.device = backend.asarray(t.table.astype(np.int32))
        out.append((PagedLayer(kp, t), PagedLayer(vp, t)))
    return out


def read_back(backend, layer) -> np.ndarray:
    """A sequence's PagedLayer on the device as the contiguous [n_ctx, H_kv, D] it holds."""
    pool = backend.to_numpy(layer.pool)
    return pool[layer.table].reshape(-1, *pool.shape[2:])[:layer.cache.n_ctx]


def write_back(backend, layer, cache: np.ndarray):
    """Set a sequence's PagedLayer on the device to the contiguous `cache` [n_ctx, H_kv, D]."""
    nb = len(layer.table)
    flat = np.zeros((nb * KV_BLOCK, *cache.shape[1:]), cache.dtype)
    flat[:cache.shape[0]] = cache
    with backend.activate():
        layer.pool[backend.asarray(layer.table)] = backend.asarray(flat.reshape(nb, KV_BLOCK, *cache.shape[1:]))


def attention_tiled(lib, q, k_cache, v_cache, pos, scale, window=0, write_q8=True, *, rng):
    """The CPU build of attention_tiled_<D>_<DV> over the caches paged (`paged`, under
    `rng`'s permutation): (out [T, H * DV] float32, Q8_1 blocks [T, H * DV / 32, 36] uint8 or
    None), both poisoned (NaN, 0xFF) before the kernel runs. v_cache may be k_cache itself
    (Gemma 4): then one pool is passed for both."""
    same = v_cache is k_cache
    T, H, D = q.shape
    cap, Hkv, Dk = k_cache.shape
    DV = v_cache.shape[2]
    assert Dk == D and v_cache.shape[:2] == (cap, Hkv) and H % Hkv == 0 and T >= 1
    tables, pools = paged(rng, [(k_cache,) if same else (k_cache, v_cache)])
    q = _aligned(q, np.float32)
    k = _aligned(pools[0], np.float16)
    v = k if same else _aligned(pools[1], np.float16)
    table = np.ascontiguousarray(tables[0], np.int32)
    pos = np.ascontiguousarray(pos, np.int32)
    out = _aligned(np.full((T, H * DV), np.nan, np.float32), np.float32)
    out_q = _aligned(np.full((T, H * DV // 32, 36), 0xFF, np.uint8), np.uint8)
    if lib.run_attn(D, DV, q.ctypes.data, k.ctypes.data, v.ctypes.data, pos.ctypes.data, table.ctypes.data,
                    out.ctypes.data, out_q.ctypes.data, T, H, Hkv, cap, int(window), float(scale), int(write_q8)):
        raise ValueError(f"no tiled attention kernel for head dims {D}/{DV}")
    return out, (out_q if write_q8 else None)


# ---- attention.cu's `attention` (a block per (head, query); the decode kernel) ----------------
# The same shim; its dynamic shared memory becomes a host buffer poisoned with NaN before each
# block, and warp shuffles (float and double) go through per-warp slots and barriers, as above.
# The split-K kernels' grids run one block at a time in a shuffled order (a seed's), so that
# any block of a (KV head, query) group may be the last to finish pass 3 and combine the splits.
# One block at a time sees every store of an earlier block, so the GPU's memory ordering cannot
# be observed here; instead the done counter's protocol is checked against the rule the PTX
# memory model sets for it (a block's relaxed atomicAdd publishes the other blocks' plain
# stores to it only through a release pattern and an acquire pattern, fences being cumulative
# over what a block barrier ordered before them):
# - release: the counting thread's __threadfence comes after the block's last barrier (which
#   orders every thread's part stores before it) and before its atomicAdd, no barrier between;
# - acquire: each __ldcg comes after a __threadfence that the counting thread made after its
#   atomicAdd, and (in any other thread) after a block barrier that followed that fence.
# A breach is recorded (protocol_fault; a write past a block's shared memory too) and the run
# raises it. What this cannot see: which stores the barrier covers (every pass-3 store precedes
# the kernel's last barrier by its structure), and anything the hardware does beyond the model.
ROWWISE_HARNESS = r"""#include "shim.h"
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
float * host_smem;
static thread_local long host_bars;            // block barriers this thread has passed
static thread_local long host_fenced_at = -1;  // host_bars at this thread's last __threadfence
static thread_local bool host_counted;         // an atomicAdd not yet followed by a fence
static thread_local bool host_acquired;        // this thread fenced after its atomicAdd
static std::atomic<long> host_acquire_bar{-1};  // host_bars at the block's acquire fence
static std::mutex host_fault_mu;
static std::string host_fault;
static void protocol_breach(const char * what) {
    std::lock_guard<std::mutex> g(host_fault_mu);
    if (host_fault.empty()) host_fault = what;
}
void __syncthreads();
inline void host_bar() { __syncthreads(); ++host_bars; }
inline void __threadfence() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    host_fenced_at = host_bars;
    if (host_counted) { host_acquired = true; host_acquire_bar = host_bars; host_counted = false; }
}
inline int host_count(int * p, int v) {
    if (host_fenced_at != host_bars || host_bars == 0)
        protocol_breach("atomicAdd on the done counter without a release: no __threadfence in the counting "
                        "thread between the block's last barrier and the atomicAdd");
    host_counted = true;
    return std::atomic_ref<int>(*p).fetch_add(v);
}
template <class T> inline T __ldcg(const T * p) {
    const long at = host_acquire_bar;
    if (!host_acquired && !(at >= 0 && host_bars > at))
        protocol_breach("__ldcg of other blocks' stores without an acquire: no __threadfence after the counting "
                        "thread's atomicAdd, followed by a block barrier, before the load");
    return *p;
}
#define __syncthreads() host_bar()
#define atomicAdd(p, v) host_count(p, v)
#include "attn_rowwise.cu"
#undef __syncthreads
#undef atomicAdd
thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
HOST_WARP_SYNC
HOST_HALF
// A block's dynamic shared memory is poisoned with NaN before it runs and followed by a guard
// of SMEM_GUARD floats, checked after it: no block may write there (on the GPU a write past the
// launch's shared memory is an illegal address, or another block's).
static constexpr size_t SMEM_GUARD = 4096;
static constexpr uint32_t SMEM_GUARD_BITS = 0x7fc0beefu;

// The blocks of `order`, one at a time, each with `smem_floats` of dynamic shared memory. One
// team of ATTN_THREADS threads runs every block (its threads meet this one at a block's start
// and its end), each thread's per-block state reset at the start: spawning a team a block cost
// most of these tests' time, where most blocks of a split launch return at once (past their
// column's lanes).
template <class F>
static void run_blocks(const std::vector<uint3h> & order, size_t smem_floats, F fn) {
    std::vector<float> sm(smem_floats + SMEM_GUARD);
    float guard;
    std::memcpy(&guard, &SMEM_GUARD_BITS, sizeof guard);
    host_smem = sm.data();
    std::barrier<> bb(ATTN_THREADS); block_bar = &bb;
    for (int i = 0; i < ATTN_THREADS / 32; ++i) warp_bar[i] = new std::barrier<>(32);
    blockDim = {ATTN_THREADS, 1, 1};
    std::barrier<> begin(ATTN_THREADS + 1), end(ATTN_THREADS + 1);
    bool stop = false;
    std::vector<std::thread> team;
    for (unsigned i = 0; i < ATTN_THREADS; ++i)
        team.emplace_back([&, i] {
            threadIdx = {i, 0, 0};
            for (;;) {
                begin.arrive_and_wait();
                if (stop) return;
                xseq = 0; host_bars = 0; host_fenced_at = -1; host_counted = false; host_acquired = false;
                fn();
                end.arrive_and_wait();
            }
        });
    for (const uint3h & b : order) {
        std::fill(sm.begin(), sm.begin() + smem_floats, std::numeric_limits<float>::quiet_NaN());
        std::fill(sm.begin() + smem_floats, sm.end(), guard);
        blockIdx = b;
        host_acquire_bar = -1;          // each block its own acquire
        begin.arrive_and_wait();
        end.arrive_and_wait();
        for (size_t i = smem_floats; i < sm.size(); ++i) {
            uint32_t bits;
            std::memcpy(&bits, &sm[i], sizeof bits);
            if (bits != SMEM_GUARD_BITS) {
                protocol_breach("a block wrote past the dynamic shared memory its launch gives");
                break;
            }
        }
    }
    stop = true;
    begin.arrive_and_wait();
    for (auto & t : team) t.join();
    for (int i = 0; i < ATTN_THREADS / 32; ++i) delete warp_bar[i];
}

// Every (head, token) block of attention.cu's grid, one after another.
template <class F>
static void run_heads(unsigned H, unsigned T, size_t smem_floats, F fn) {
    gridDim = {H, T, 1};
    std::vector<uint3h> order;
    for (unsigned by = 0; by < T; ++by)
        for (unsigned bx = 0; bx < H; ++bx) order.push_back({bx, by, 0});
    run_blocks(order, smem_floats, fn);
}

// table_stride 0: one sequence (table its block table); else per_row, row t's at t * table_stride
extern "C" int run_attention(const float * q, const u16 * k, const u16 * v, const int * pos, const int * table,
                             float * out, block_q8_1 * out_q, int T, int H, int Hkv, int D, int DV, int cap,
                             int window, float scale, int write_q8, int table_stride) {
    AttentionParams p{};
    p.n_tokens = T; p.n_heads = H; p.n_kv_heads = Hkv; p.head_dim = D; p.head_dim_v = DV;
    p.capacity = cap; p.n_slots = window > 0 ? std::min(cap, window) : cap; p.window = window > 0 ? window : 0;
    p.scale = scale; p.write_q8 = write_q8; p.per_row = table_stride > 0; p.table_stride = table_stride;
    host_fault.clear();
    run_heads(H, T, D + p.n_slots + ATTN_WARPS * DV,
              [=] { attention(q, k, v, pos, table, out, out_q, p); });
    return 0;
}

// Every block of a (gx, gy, gz) grid, one at a time in an order shuffled by `seed`.
template <class F>
static void run_shuffled(unsigned gx, unsigned gy, unsigned gz, size_t smem_floats, unsigned seed, F fn) {
    gridDim = {gx, gy, gz};
    std::vector<uint3h> order;
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) order.push_back({x, y, z});
    std::mt19937 gen(seed);
    std::shuffle(order.begin(), order.end(), gen);
    run_blocks(order, smem_floats, fn);
}

extern "C" int split_slots() { return ATTN_SPLIT_SLOTS; }

// The first breach (the done counter's protocol, shared memory) since the last run ("": none).
extern "C" const char * protocol_fault() { return host_fault.c_str(); }

// The three split-K launches as engine/backends/cuda/attention.py makes them: passes 1 and 3
// a grid of (H, blocks, T), each query's KV groups cut into block columns by the kernels
// (split_columns, under `fill`), pass 2 a block per (head, query) row and `sum_blocks`
// blocks a row; dynamic shared memory for `heads` heads of a column's chunk. The scratch
// buffers are the caller's (poisoned there).
extern "C" int run_attention_split(const float * q, const u16 * k, const u16 * v, const int * pos, const int * table,
                                   float * out, block_q8_1 * out_q, float * logit, float * split_max,
                                   double * split_sum, float * part, int * done, int T, int H, int Hkv, int D, int DV,
                                   int cap, int window, float scale, int write_q8, int table_stride, int blocks,
                                   int sum_blocks, int fill, int heads, unsigned seed) {
    AttentionParams p{};
    p.n_tokens = T; p.n_heads = H; p.n_kv_heads = Hkv; p.head_dim = D; p.head_dim_v = DV;
    p.capacity = cap; p.n_slots = window > 0 ? std::min(cap, window) : cap; p.window = window > 0 ? window : 0;
    p.scale = scale; p.write_q8 = write_q8; p.per_row = table_stride > 0; p.table_stride = table_stride;
    p.split_fill = fill;
    const size_t nh = (size_t) heads;
    host_fault.clear();
    run_shuffled(H, blocks, T, nh * D, seed,
                 [=] { attention_split_logits(q, k, pos, table, logit, split_max, done, p); });
    run_shuffled(H, sum_blocks, T, 0, seed + 1, [=] { attention_split_sums(pos, logit, split_max, split_sum, p); });
    run_shuffled(H, blocks, T, nh * (ATTN_SPLIT_SLOTS + ATTN_WARPS * DV), seed + 2,
                 [=] { attention_split_values(v, pos, table, logit, split_max, split_sum, part, done, out, out_q, p); });
    return 0;
}

// split_chunk_heads as the kernels' host sees it: the heads of a KV group's first chunk.
extern "C" int split_heads(int G) { return split_chunk_heads(G); }

// attention.cu's kv_store: a grid of (row / KV_STORE_THREADS, T) blocks, no shared memory
extern "C" int run_kv_store(const float * x, const int * pos, const int * table, u16 * pool, int T, int row,
                            int cap) {
    KvStoreParams p{};
    p.n_tokens = T; p.row_elems = row; p.capacity = cap;
    gridDim = {(unsigned) ((row + KV_STORE_THREADS - 1) / KV_STORE_THREADS), (unsigned) T, 1};
    blockDim = {KV_STORE_THREADS, 1, 1};
    for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            blockIdx = {bx, by, 0};
            for (unsigned i = 0; i < KV_STORE_THREADS; ++i) {     // no barrier in it: threads in turn
                threadIdx = {i, 0, 0};
                kv_store(x, pos, table, pool, p);
            }
        }
    return 0;
}
"""


def build_rowwise(kernel_text: str | None = None) -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of attention.cu's `attention` kernel (or of
    `kernel_text`, a modified copy of attention.cu); raises RuntimeError without g++."""
    srcs = host_headers(HEADERS)
    text = kernel_text if kernel_text is not None else (KERNEL_DIR / "attention.cu").read_text()
    decl = "extern __shared__ float smem[];"
    if text.count(decl) != 3:       # attend_block's, attention_split_logits' and _values'
        raise RuntimeError(f"attention.cu: expected three {decl!r}")
    srcs["attn_rowwise.cu"] = text.replace(decl, "float * const smem = host_smem;")
    srcs["shim.h"] = SHIM
    srcs["harness.cpp"] = (ROWWISE_HARNESS.replace("HOST_WARP_SYNC", HOST_WARP_SYNC)
                           .replace("NTHREADS", "ATTN_THREADS").replace("HOST_HALF", HOST_HALF))
    so = compile_host(srcs, "attnrow", "attention.cu")
    so.run_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int,
                                                                               ctypes.c_int]
    so.run_kv_store.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    so.run_attention_split.argtypes = [ctypes.c_void_p] * 12 + [ctypes.c_int] * 7 + [ctypes.c_float] + \
                                      [ctypes.c_int] * 6 + [ctypes.c_uint]
    so.split_slots.restype = ctypes.c_int
    so.split_heads.argtypes = [ctypes.c_int]
    so.split_heads.restype = ctypes.c_int
    so.protocol_fault.restype = ctypes.c_char_p
    return so


def attention_rowwise(lib, q, k_cache, v_cache, pos, scale, window=0, *, rng):
    """The CPU build of attention.cu's `attention` over the caches paged (`paged`, under
    `rng`'s permutation): (out [T, H * DV], Q8_1 blocks or None), the output poisoned with NaN
    before the kernel runs."""
    T, H, D = q.shape
    cap, Hkv, _ = k_cache.shape
    tables, (k, v) = paged(rng, [(k_cache, v_cache)])
    return _run_rowwise(lib, q, k, v, pos, tables[0], cap, scale, window, 0)


def attention_rows(lib, q, caches, pos, scale, window=0, *, rng):
    """attention.cu's `attention` in per_row mode (a batched decode step): query row t over
    its own sequence's caches `caches[t] = (k [cap_t, H_kv, D], v)`, all paged into one pool
    pair (`paged`), each row its own row of the block tables. (out, Q8_1 blocks or None)."""
    tables, (k, v) = paged(rng, list(caches))
    cap = max(c[0].shape[0] for c in caches)
    return _run_rowwise(lib, q, k, v, pos, tables, cap, scale, window, tables.shape[1])


def attention_split(lib, q, k_cache, v_cache, pos, scale, window=0, *, rng, blocks=None, sum_blocks=None,
                    scratch=None, fill=0, heads=None):
    """attention.cu's split-K kernels (attention_split_logits, _sums, _values) over the caches
    paged (`paged`, under `rng`'s permutation), their blocks in an order shuffled by `rng`:
    (out, Q8_1 blocks or None). fill: AttentionParams.split_fill, by which the kernels cut a
    KV group's query heads into block columns in passes 1 and 3 at each query's splits in use
    (attention.py split_group_blocks; 0: one column a group); blocks: a (head, query)'s blocks
    in every pass (gridDim.y; default one a split, split_count); sum_blocks: pass 2's instead
    (default `blocks`). `scratch`: a dict that receives the scratch buffers (poisoned before
    the kernels run) as they were left. `heads`: the heads of a column's chunk the shared
    memory is sized for (default: as the backend sizes it)."""
    cap = k_cache.shape[0]
    tables, (k, v) = paged(rng, [(k_cache, v_cache)])
    return _run_split(lib, q, k, v, pos, tables[0], cap, scale, window, 0, rng, blocks, sum_blocks, scratch, fill,
                      heads)


def attention_split_rows(lib, q, caches, pos, scale, window=0, *, rng, blocks=None, sum_blocks=None, scratch=None,
                         fill=0):
    """The split-K kernels in per_row mode (a batched decode step), as attention_rows."""
    tables, (k, v) = paged(rng, list(caches))
    cap = max(c[0].shape[0] for c in caches)
    return _run_split(lib, q, k, v, pos, tables, cap, scale, window, tables.shape[1], rng, blocks, sum_blocks,
                      scratch, fill)


def split_count(lib, cap: int, window: int = 0) -> int:
    """A row's splits for a capacity and window: ceil(n_slots / ATTN_SPLIT_SLOTS)."""
    n_slots = min(cap, window) if window > 0 else cap
    return -(-n_slots // lib.split_slots())


def _contiguous(q, k_pool, v_pool, table, pos):
    """The kernels' inputs as the C entry points read them: contiguous, in their dtypes."""
    return (np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k_pool, np.float16),
            np.ascontiguousarray(v_pool, np.float16), np.ascontiguousarray(table, np.int32),
            np.ascontiguousarray(pos, np.int32))


def _poisoned_out(T: int, H: int, DV: int):
    """The outputs, poisoned: NaN floats and 0xFF Q8_1 bytes, so a value never written shows."""
    return np.full((T, H * DV), np.nan, np.float32), np.full((T, H * DV // 32, 36), 0xFF, np.uint8)


def _run_split(lib, q, k_pool, v_pool, pos, table, cap, scale, window, table_stride, rng, blocks, sum_blocks,
               scratch=None, fill=0, heads=None):
    from brass.backends.cuda.attention import split_group_blocks
    T, H, D = q.shape
    Hkv, DV = k_pool.shape[2], v_pool.shape[3]
    S = split_count(lib, cap, window)
    G = H // Hkv
    if heads is None:                       # as the backend sizes it
        heads = lib.split_heads(G // split_group_blocks(G, Hkv, S, T, fill))
    blocks = S if blocks is None else int(blocks)
    sum_blocks = blocks if sum_blocks is None else int(sum_blocks)
    q, k, v, table, pos = _contiguous(q, k_pool, v_pool, table, pos)
    write_q8 = DV % 32 == 0
    out, out_q = _poisoned_out(T, H, DV)
    bufs = {"logit": np.full((T, H, S * lib.split_slots()), np.nan, np.float32),
            "split_max": np.full((T, H, S), np.nan, np.float32),
            "split_sum": np.full((T, H, S), np.nan, np.float64),
            "part": np.full((T, H, S, DV), np.nan, np.float32),
            "done": np.full((T, H), -1, np.int32)}
    lib.run_attention_split(q.ctypes.data, k.view(np.uint16).ctypes.data, v.view(np.uint16).ctypes.data,
                            pos.ctypes.data, table.ctypes.data, out.ctypes.data, out_q.ctypes.data,
                            *(b.ctypes.data for b in bufs.values()), T, H, Hkv, D, DV, cap, int(window),
                            float(scale), int(write_q8), int(table_stride), blocks, sum_blocks,
                            int(fill), int(heads), int(rng.integers(0, 2**31)))
    fault = lib.protocol_fault().decode()
    if fault:
        raise AssertionError(f"the split kernels: {fault}")
    if scratch is not None:
        scratch.update(bufs)
    return out, (out_q if write_q8 else None)


def _run_rowwise(lib, q, k_pool, v_pool, pos, table, cap, scale, window, table_stride):
    T, H, D = q.shape
    Hkv, DV = k_pool.shape[2], v_pool.shape[3]
    q, k, v, table, pos = _contiguous(q, k_pool, v_pool, table, pos)
    write_q8 = DV % 32 == 0
    out, out_q = _poisoned_out(T, H, DV)
    lib.run_attention(q.ctypes.data, k.view(np.uint16).ctypes.data, v.view(np.uint16).ctypes.data,
                      pos.ctypes.data, table.ctypes.data, out.ctypes.data, out_q.ctypes.data, T, H, Hkv, D, DV,
                      cap, int(window), float(scale), int(write_q8), int(table_stride))
    fault = lib.protocol_fault().decode()
    if fault:
        raise AssertionError(f"attention: {fault}")
    return out, (out_q if write_q8 else None)


def kv_store(lib, pool, x, pos, table, capacity):
    """attention.cu's kv_store: x [T, H_kv, D] float32 written as float16 into `pool`
    ([n_blocks, KV_BLOCK, H_kv, D], in place) at positions pos through `table`."""
    x = np.ascontiguousarray(x, np.float32)
    pos = np.ascontiguousarray(pos, np.int32)
    table = np.ascontiguousarray(table, np.int32)
    assert pool.flags.c_contiguous and pool.dtype == np.float16
    lib.run_kv_store(x.ctypes.data, pos.ctypes.data, table.ctypes.data, pool.view(np.uint16).ctypes.data,
                     x.shape[0], int(np.prod(x.shape[1:])), int(capacity))


def random_case(rng, T, past, H, Hkv, D, DV, cap=None, window=0):
    """A prompt of T tokens continuing `past` cached ones: q [T, H, D], caches [cap, Hkv, D/DV]
    with slots 0 .. past + T - 1 written (random, as after kv_store) and NaN beyond."""
    cap = past + T + 5 if cap is None else cap
    q = rng.uniform(-1, 1, (T, H, D)).astype(np.float32)
    k = np.full((cap, Hkv, D), np.nan, np.float16)
    v = np.full((cap, Hkv, DV), np.nan, np.float16)
    k[:past + T] = rng.uniform(-1, 1, (past + T, Hkv, D)).astype(np.float16)
    v[:past + T] = rng.uniform(-1, 1, (past + T, Hkv, DV)).astype(np.float16)
    pos = np.arange(past, past + T, dtype=np.int32)
    return q, k, v, pos


def unseen_slots(pos, cap, window) -> np.ndarray:
    """Mask of the cache slots no query can see (the kernel must not read them)."""
    s = np.arange(cap)
    seen = (s[None, :] <= pos[:, None])
    if window:
        seen &= (pos[:, None] - s[None, :]) < window
    return ~seen.any(axis=0)


def main(argv: list[str]) -> int:
    from conformance.harness.cases import ATTENTION, cuda_reference, nmse
    rng = np.random.default_rng(int(argv[0]) if argv else 0)
    lib = build()
    ref = cuda_reference()
    failed = 0
    for T, past, H, Hkv, D, DV, window in ((70, 0, 4, 2, 64, 64, 0), (37, 50, 8, 2, 128, 128, 0),
                                          (40, 10, 2, 1, 256, 256, 16), (20, 3, 4, 2, 128, 64, 0)):
        q, k, v, pos = random_case(rng, T, past, H, Hkv, D, DV, window=window)
        scale = 1.0 / np.sqrt(D)
        want = ref.attention(q, k, v, pos, scale, window)
        got, blocks = attention_tiled(lib, q, k, v, pos, scale, window, rng=rng)
        e = nmse(got, want)
        ok = e <= ATTENTION and not np.isnan(got).any() and np.array_equal(blocks, q8_1_blocks(got))
        failed += not ok
        print(f"T={T} past={past} H={H}/{Hkv} D={D}/{DV} window={window}: NMSE {e:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
