"""kernels/mmq.cu run on the CPU, for machines without a GPU (CI, development).

The kernel source itself (with its headers) is compiled by g++ against a small shim of the
CUDA device intrinsics it uses (__dp4a, __vsubss4, __byte_perm, __funnelshift_r, half to
float): every CUDA thread of a block is a std::thread, __shared__ variables are function
statics (one block runs at a time), __syncthreads a barrier of the block's threads. The two
places that are not plain C++ are replaced textually: the half-to-float `cvt` asm of
common.cuh, and the `mma.sync` asm of mmq.cu, which becomes a warp-cooperative emulation
(each lane publishes its fragment registers, the warp meets at a barrier, each lane forms its
four outputs) that follows the PTX ISA fragment layouts of m16n8k32 / m16n8k16 .s8 as mmq.cu's
comments state them. What this cannot check is that the hardware uses those layouts, nor
timing, nor FMA contraction; it does check the tiling, the unpacking, the scaling, the tile
edges and the partial K chunks of the real source, against the numpy q8_1 reference.

    python3 conformance/harness/mmq_host.py [seed]      # every type on a few shapes; exit 1 on a failure
conformance/kernels/test_kernels_mmq.py uses it (skips without g++).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
HEADERS = ("common.cuh", "params.cuh", "quant_dot.cuh")
NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")

SHIM = r"""// Host shim: CUDA device code of kernels/ compiled by g++, one std::thread per CUDA thread.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <atomic>
#include <barrier>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;
#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
struct uint3h { unsigned x, y, z; };
extern thread_local uint3h threadIdx;
extern uint3h blockIdx, blockDim, gridDim;
struct int4 { int x, y, z, w; };
struct int2 { int x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline int atomicAdd(int * p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int) (int8_t) (a >> (8 * i)) * (int) (int8_t) (b >> (8 * i));
    return c;
}
inline unsigned __vsubss4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        int v = (int) (int8_t) (a >> (8 * i)) - (int) (int8_t) (b >> (8 * i));
        v = v < -128 ? -128 : v > 127 ? 127 : v;
        r |= ((unsigned) (uint8_t) (int8_t) v) << (8 * i);
    }
    return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t) y << 32) | x; unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned) ((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
    return (unsigned) ((((uint64_t) hi << 32) | lo) >> (sh & 31));
}
float host_shfl_xor(float v, int o);     // each harness: across its block's threads, or abort
inline float __shfl_xor_sync(unsigned, float v, int o) { return host_shfl_xor(v, o); }
double host_shfl_xor_d(double v, int o);  // likewise, for doubles
inline double __shfl_xor_sync(unsigned, double v, int o) { return host_shfl_xor_d(v, o); }
int host_shfl_xor_i(int v, int o);         // and ints
inline int __shfl_xor_sync(unsigned, int v, int o) { return host_shfl_xor_i(v, o); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);   // HOST_WARP_SYNC: the warp's 32 threads meet
float host_h2f(unsigned short h);
unsigned short host_f2h(float f);
void host_mma_k32(int (&d)[4], int a0, int a1, int a2, int a3, int b0, int b1);
void host_mma_k16(int (&d)[4], int a0, int a1, int b0);
"""

# Host definitions the harnesses share (C++ text): half <-> float, round to nearest even with
# subnormals, as the GPU's cvt does (checked against numpy by test_kernels_attention_tiled.py);
HOST_HALF = r"""float host_h2f(unsigned short h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 0) f = std::ldexp((float) m, -24);
    else if (e == 31) f = m ? NAN : INFINITY;
    else f = std::ldexp((float) (m | 1024), e - 25);
    return s ? -f : f;
}
unsigned short host_f2h(float f) {
    unsigned x; memcpy(&x, &f, 4);
    const unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short) (sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (unsigned short) (sign | 0x7c00u);
    if (ax < 0x38800000u) {
        float a; memcpy(&a, &ax, 4);
        return (unsigned short) (sign | (unsigned) std::nearbyint((double) a * 16777216.0));
    }
    unsigned hbits = ((((ax >> 23) - 112u)) << 10) | ((ax >> 13) & 0x3ffu);
    const unsigned rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (hbits & 1u))) ++hbits;
    return (unsigned short) (sign | hbits);
}
"""
# and the block's barrier, __syncwarp (a barrier of the warp's 32 threads: the kernels call it
# with every lane of the warp) and warp shuffles of floats and doubles through per-warp slots and a
# barrier of the warp's 32 threads (a warp may loop more often than another): NTHREADS is the
# largest block; each call alternates between two slot arrays, so a lane overwrites a slot only
# after every lane of its warp has passed the barrier of the call in between.
HOST_WARP_SYNC = r"""static std::barrier<> * block_bar;
static std::barrier<> * warp_bar[NTHREADS / 32];
static unsigned long long xch[2][NTHREADS];
static thread_local unsigned xseq;
void __syncthreads() { block_bar->arrive_and_wait(); }
void __syncwarp(unsigned) { warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
static unsigned long long exchange(unsigned long long w, int o) {
    const unsigned i = threadIdx.x;
    unsigned long long * s = xch[xseq++ & 1];
    s[i] = w;
    warp_bar[i / 32]->arrive_and_wait();
    return s[(i / 32) * 32 + ((i % 32) ^ (unsigned) o)];
}
float host_shfl_xor(float v, int o) {
    unsigned w; memcpy(&w, &v, 4);
    const unsigned r = (unsigned) exchange(w, o);
    float f; memcpy(&f, &r, 4); return f;
}
double host_shfl_xor_d(double v, int o) {
    unsigned long long w; memcpy(&w, &v, 8);
    const unsigned long long r = exchange(w, o);
    double d; memcpy(&d, &r, 8); return d;
}
int host_shfl_xor_i(int v, int o) { return (int) (unsigned) exchange((unsigned) v, o); }
"""

# and the grid: every block one after another (after HOST_WARP_SYNC, whose barriers it sets up;
# host_smem: the dynamic shared memory, poisoned before each block).
HOST_RUN_GRID = r"""// Every block of a (gx, gy) grid of `threads` threads, one after another, each with `smem`
// bytes of dynamic shared memory poisoned with 0xFF.
template <class F>
static void run_grid(unsigned gx, unsigned gy, unsigned threads, int smem, F fn) {
    std::vector<unsigned char> sm(smem > 0 ? smem : 16);
    host_smem = sm.data();
    std::barrier<> bb(threads); block_bar = &bb;
    for (unsigned i = 0; i < threads / 32; ++i) warp_bar[i] = new std::barrier<>(32);
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::fill(sm.begin(), sm.end(), (unsigned char) 0xFF);
            blockIdx = {bx, by, 0};
            std::vector<std::thread> th;
            for (unsigned i = 0; i < threads; ++i)
                th.emplace_back([=] { threadIdx = {i, 0, 0}; xseq = 0; fn(); });
            for (auto & t : th) t.join();
        }
    for (unsigned i = 0; i < threads / 32; ++i) delete warp_bar[i];
}
"""


def kernel_harness(source: str, threads, body: str, prelude: str = "") -> str:
    """harness.cpp of a kernel file's CPU build: the shim, the kernel source (included under
    its host name `source`), the thread indices, the warp barriers of a block of NTHREADS,
    the halves and run_grid, then `body`, its extern "C" runners. NTHREADS reads `threads`
    everywhere; prelude: what must come before the source (stand-ins for intrinsics)."""
    text = (f'#include "shim.h"\n{prelude}unsigned char * host_smem;\n#include "{source}"\n'
            "thread_local uint3h threadIdx;\nuint3h blockIdx, blockDim, gridDim;\n"
            f"{HOST_WARP_SYNC}\n{HOST_HALF}\n{HOST_RUN_GRID}\n{body}")
    return text.replace("NTHREADS", str(threads))

HARNESS = r"""#include "shim.h"
unsigned char * host_smem;
#include "mmq_host.cu"
thread_local uint3h threadIdx;
uint3h blockIdx, blockDim, gridDim;
HOST_WARP_SYNC
static int A[MMQ_THREADS][4], B[MMQ_THREADS][2];
HOST_HALF_DEFS
HOST_RUN_GRID
// Every block of a (gx, gy) grid of MMQ_THREADS threads, one after another (static shared
// memory only).
template <class F>
static void run_blocks(unsigned gx, unsigned gy, F fn) { run_grid(gx, gy, MMQ_THREADS, 0, fn); }
// PTX ISA fragment layouts (as mmq.cu's comments state them), g = lane / 4, t = lane % 4:
// k32: a0 = A[g][w t], a1 = A[g+8][w t], a2 = A[g][w t+4], a3 = A[g+8][w t+4]; b0 = B[w t][g],
// b1 = B[w t+4][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1].
static void mma(int (&d)[4], int nk) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, base = warp * 32;
    const int g = lane / 4, t = lane % 4;
    for (int c = 0; c < 4; ++c) {
        const int row = g + 8 * (c / 2), col = 2 * t + c % 2;
        for (int kw = 0; kw < nk; ++kw) {
            const int al = base + (row % 8) * 4 + kw % 4, areg = (row >= 8) + 2 * (kw >= 4);
            const int bl = base + col * 4 + kw % 4, breg = kw >= 4;
            d[c] = __dp4a(A[al][areg], B[bl][breg], d[c]);
        }
    }
}
void host_mma_k32(int (&d)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    const int i = threadIdx.x, warp = i / 32;
    A[i][0] = a0; A[i][1] = a1; A[i][2] = a2; A[i][3] = a3; B[i][0] = b0; B[i][1] = b1;
    warp_bar[warp]->arrive_and_wait();
    mma(d, 8);
    warp_bar[warp]->arrive_and_wait();
}
void host_mma_k16(int (&d)[4], int a0, int a1, int b0) {
    const int i = threadIdx.x, warp = i / 32;
    A[i][0] = a0; A[i][1] = a1; B[i][0] = b0;
    warp_bar[warp]->arrive_and_wait();
    mma(d, 4);
    warp_bar[warp]->arrive_and_wait();
}
// moe_plan then mmq_id_<name> (a prompt's expert mat-mul): blocks run one after another, the
// plan's block first, as the two launches do on the GPU.
typedef void (*id_kernel_t)(const u8 *, const block_q8_1 *, const int *, float *, const MmqIdParams);
extern "C" int run_mmq_id(const char * name, const u8 * w, const block_q8_1 * x, const int * ids,
                          int * plan, float * y, int n_rows, int k, int n_slots, int n_used,
                          long long row_bytes, int n_experts, int x_per_slot, int max_tiles) {
    id_kernel_t fn = nullptr;
    const char * names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"};
    id_kernel_t fns[] = {mmq_id_q4_0, mmq_id_q4_1, mmq_id_q5_0, mmq_id_q5_1, mmq_id_q8_0, mmq_id_q4_k,
                         mmq_id_q5_k, mmq_id_q6_k, mmq_id_mxfp4};
    for (int i = 0; i < 9; ++i) if (!strcmp(name, names[i])) fn = fns[i];
    if (!fn) return 1;
    {
        MoePlanParams pp{}; pp.n_slots = n_slots; pp.n_experts = n_experts; pp.max_tiles = max_tiles;
        std::barrier<> bb(MOE_PLAN_THREADS); block_bar = &bb;
        gridDim = {1, 1, 1}; blockDim = {MOE_PLAN_THREADS, 1, 1}; blockIdx = {0, 0, 0};
        std::vector<std::thread> th;
        for (unsigned i = 0; i < MOE_PLAN_THREADS; ++i)
            th.emplace_back([=] { threadIdx = {i, 0, 0}; moe_plan(ids, plan, pp); });
        for (auto & t : th) t.join();
    }
    MmqIdParams p{}; p.n_rows = n_rows; p.k = k; p.n_slots = n_slots; p.n_used = n_used;
    p.row_bytes = row_bytes; p.expert_bytes = (long long) n_rows * row_bytes; p.n_experts = n_experts;
    p.x_per_slot = x_per_slot; p.max_tiles = max_tiles;
    run_blocks((n_rows + MMQ_ROWS - 1) / MMQ_ROWS, max_tiles + 1, [=] { fn(w, x, plan, y, p); });
    return 0;
}
extern "C" int mmq_cols() { return MMQ_COLS; }
extern "C" int mmq_rows() { return MMQ_ROWS; }
"""


def host_headers(names) -> dict[str, str]:
    """The kernel headers `names` as g++ can compile them: the half conversions' inline PTX
    replaced by the shim's host functions."""
    out = {}
    # The mat-vecs stage activations in dynamic shared memory: on the host, the harness's buffer
    # `host_smem` (every harness including these headers declares it), poisoned before each
    # block. The shim's static __shared__ cannot be extern.
    decl, staged = "extern __shared__ int4 staged_x[];", 0
    for h in names:
        s = (KERNEL_DIR / h).read_text()
        s = s.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = host_h2f(h);")
        s = s.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = host_f2h(f);")
        staged += s.count(decl)
        out[h] = s.replace(decl, "int4 * const staged_x = (int4 *) host_smem;")
    if "matvec.cuh" in names and staged < 5:
        raise RuntimeError(f"matvec*.cuh: expected a {decl!r} in each kernel body, found {staged}")
    return out


def _sources(defines: tuple[str, ...] = ()) -> dict[str, str]:
    out = host_headers(HEADERS)
    # a variant of the tiles (ci/gpu_tune_mmq.py's -D options: "MMQ_KB=4", ...) as #defines
    # ahead of the source, which only sets what is not defined already
    s = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + (KERNEL_DIR / "mmq.cu").read_text()
    s, n1 = re.subn(r'asm volatile\("mma\.sync\.aligned\.m16n8k32.*?"r"\(b0\), "r"\(b1\)\);',
                    "host_mma_k32(d, a0, a1, a2, a3, b0, b1);", s, flags=re.S)
    s, n2 = re.subn(r'asm volatile\("mma\.sync\.aligned\.m16n8k16.*?"r"\(b0\)\);',
                    "host_mma_k16(d, a0, a1, b0);", s, flags=re.S)
    if (n1, n2) != (1, 1):
        raise RuntimeError(f"mmq.cu: expected one m16n8k32 and one m16n8k16 asm statement, found {n1} and {n2}")
    out["mmq_host.cu"] = s
    out["shim.h"] = SHIM
    out["harness.cpp"] = (HARNESS.replace("HOST_HALF_DEFS", HOST_HALF).replace("HOST_WARP_SYNC", HOST_WARP_SYNC)
                          .replace("HOST_RUN_GRID", HOST_RUN_GRID).replace("NTHREADS", "MMQ_THREADS"))
    return out


class NoHostCompiler(RuntimeError):
    """No g++ on this machine: the kernels' CPU builds cannot be made (their tests skip). Any
    other failure to build one is a RuntimeError: a broken harness or kernel source, which
    its tests must report rather than skip."""


def built(build, *args):
    """build(*args), a kernel's CPU build, for a test; the test skipped, saying so, where this
    machine has no g++ (NoHostCompiler). Any other failure to build stays an error."""
    import pytest       # here, not at the top: ci/ imports this module and runs without pytest
    try:
        return build(*args)
    except NoHostCompiler as e:
        pytest.skip(str(e))


def build_kernel_file(kernel_file: str, threads: int, runners: str,
                      headers: tuple[str, ...] = ("common.cuh", "params.cuh")) -> ctypes.CDLL:
    """The CPU build of kernels/`kernel_file` alone: its headers, the shim, and kernel_harness
    with `runners` (its extern "C" entry points, blocks of `threads`); compiled or reused as
    lib<name>.so. Raises NoHostCompiler without g++."""
    stem = kernel_file.removesuffix(".cu")
    srcs = host_headers(headers)
    srcs[f"{stem}_host.cu"] = (KERNEL_DIR / kernel_file).read_text()
    srcs["shim.h"] = SHIM
    srcs["harness.cpp"] = kernel_harness(f"{stem}_host.cu", threads, runners)
    return compile_host(srcs, stem, kernel_file)


def compile_host(srcs: dict[str, str], stem: str, what: str) -> ctypes.CDLL:
    """Compile (or reuse, keyed by the sources) harness.cpp of `srcs` with g++ into a shared
    library named lib<stem>.so; raises NoHostCompiler without g++, RuntimeError when it fails."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise NoHostCompiler(f"no CPU build of {what}: g++ is not installed")
    # -fno-gnu-unique: the kernels' __shared__ arrays are function statics here, which g++
    # otherwise exports as STB_GNU_UNIQUE symbols that the dynamic linker binds to one object
    # for every library of a process, RTLD_LOCAL or not: a variant's library (MMQ_KB=8) loaded
    # after another's (MMQ_KB=2) then wrote its tiles into the other's smaller arrays (wrong
    # results in whichever pytest worker loaded the two in that order)
    flags = ["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-fno-gnu-unique"]
    key = hashlib.sha256("\0".join([*flags, *(f"{k}\0{v}" for k, v in sorted(srcs.items()))]).encode()).hexdigest()[:16]
    d = Path(tempfile.gettempdir()) / f"brass-{stem}-host-{key}"
    lib = d / f"lib{stem}.so"
    if not lib.exists():
        # Test workers (pytest -n) build the same variant at once: each writes its sources and its
        # library in a folder of its own and renames the finished library into place (atomic), so
        # none reads a source another is rewriting or loads a library another is still linking
        # (seen on the GPU runner at -n 14: a variant's results NaN and 1e33 from such a library).
        d.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=d))
        try:
            for name, text in srcs.items():
                (work / name).write_text(text)
            tmp = work / f"lib{stem}.so"
            r = subprocess.run([gxx, *flags, "-x", "c++",
                                str(work / "harness.cpp"), "-o", str(tmp)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"g++ failed on the CPU build of {what}:\n{r.stderr[-3000:]}")
            tmp.replace(lib)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return ctypes.CDLL(str(lib))


def c_expf(a: np.ndarray) -> np.ndarray:
    """expf of the C library element by element, as a kernel's CPU build calls it (the tests'
    float32 twins of sigmoid and silu give that build's bits only with its expf)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    a = np.asarray(a, np.float32)
    return np.array([libm.expf(float(v)) for v in a.ravel()], np.float32).reshape(a.shape)


def build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile (or reuse) the CPU build of mmq.cu (with `defines`, "NAME=VALUE" each);
    raises RuntimeError without g++."""
    so = compile_host(_sources(tuple(defines)), "mmq", "mmq.cu")
    so.run_mmq_id.argtypes = [ctypes.c_char_p] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + \
        [ctypes.c_longlong] + [ctypes.c_int] * 3
    return so


def plan_ints(n_slots: int, n_experts: int, max_tiles: int) -> int:
    """Ints of moe_plan's output (kernels/mmq.cu)."""
    return 2 * n_experts + 2 * n_slots + 1 + 2 * max_tiles


def max_tiles(n_slots: int, n_experts: int, cols: int) -> int:
    """Tiles moe_plan may make: one per MMQ_COLS slots of an expert, rounded up per expert."""
    return -(-n_slots // cols) + min(n_experts, n_slots)


def mmq_id(lib, qtype, w_raw: np.ndarray, x: np.ndarray, ids: np.ndarray, n_experts: int,
           misalign: int = 0) -> np.ndarray:
    """y [T, k, N] = expert ids[t, j] applied to x[t] (x [T, K]) or x[t, j] (x [T, k, K]) by the
    CPU build of moe_plan + mmq_id_<type>; w_raw: the expert tensor's ggml bytes [E * N, row_bytes];
    misalign: x's Q8_1 blocks that many bytes past a 64-byte boundary (q8_1_blocks)."""
    from brass.backends.cuda.common import TYPE_NAMES
    w_raw = np.ascontiguousarray(w_raw, np.uint8)
    EN, row_bytes = w_raw.shape
    N = EN // n_experts
    T, k = ids.shape
    S = T * k
    per_slot = x.ndim == 3
    K = x.shape[-1]
    xb = q8_1_blocks(x.reshape(-1, K), misalign)
    mt = max_tiles(S, n_experts, lib.mmq_cols())
    plan = np.full(plan_ints(S, n_experts, mt), -7, np.int32)      # poisoned as well
    # poisoned with a finite value: the NaN rows of out-of-range ids must be the kernel's own
    y = np.full((T, k, N), 1234.5, np.float32)
    ids32 = np.ascontiguousarray(ids, np.int32)
    if lib.run_mmq_id(TYPE_NAMES[qtype].encode(), w_raw.ctypes.data, xb.ctypes.data, ids32.ctypes.data,
                      plan.ctypes.data, y.ctypes.data, N, K, S, k, row_bytes, n_experts, int(per_slot), mt):
        raise ValueError(f"no mmq_id kernel for {qtype}")
    return y


def q8_1_blocks(x: np.ndarray, misalign: int = 0) -> np.ndarray:
    """x [T, K] as the quantize_q8_1 kernel writes it: [T, K/32] blocks of 36 bytes, starting
    on a 64-byte boundary, or `misalign` bytes past one (a multiple of 4: the blocks' own
    alignment; the tile's 16-byte copies of activations then give way to 32-bit ones)."""
    from brass import quants
    qb = quants.quantize_q8_1_cuda(x)
    T, K = x.shape
    raw = np.zeros(T * K // 32 * 36 + 64 + misalign, np.uint8)
    start = -raw.ctypes.data % 64 + misalign
    out = raw[start:start + T * K // 32 * 36].reshape(T, K // 32, 36)
    assert out.ctypes.data % 64 == misalign
    out[..., 0:2] = qb.d.astype("<f2").reshape(T, K // 32, 1).view(np.uint8)
    out[..., 2:4] = qb.s.astype("<f2").reshape(T, K // 32, 1).view(np.uint8)
    out[..., 4:] = qb.qs.reshape(T, K // 32, 32).view(np.uint8)
    return out


def main(argv: list[str]) -> int:
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import MATMUL, cuda_reference, nmse, random_weight_file
    rng = np.random.default_rng(int(argv[0]) if argv else 0)
    lib = build()
    ref = cuda_reference()
    types = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
             GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4)
    # (E, N, K, T, k): experts' tiles partly filled, ragged row tiles, partial K chunks (288)
    cases = [(t, s) for t in types for s in ((4, 70, 256, 20, 2), (3, 67, 512, 50, 2), (8, 130, 768, 33, 4))]
    cases += [(t, (3, 45, 288, 40, 2)) for t in types if t not in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for qtype, (E, N, K, T, k) in cases:
            gf = GGUFFile(random_weight_file(Path(tmp) / "w.gguf", rng, {"w": (qtype, (E, N, K))}))
            x = rng.uniform(-1, 1, (T, K)).astype(np.float32)
            x[2, 5] = 3247.0             # issue 9's massive activation
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
            y = mmq_id(lib, qtype, gf.tensor_bytes("w").reshape(E * N, -1), x, ids, E)
            with ref.rows_independent():
                want = ref.matmul_id(x, ref.weight(gf, "w"), ids)
            e = nmse(y, want)
            ok = e <= MATMUL and not np.isnan(y).any()
            failed += not ok
            print(f"{qtype.name:6s} E{E} N{N} K{K} T{T} k{k}: NMSE {e:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main(sys.argv[1:]))
