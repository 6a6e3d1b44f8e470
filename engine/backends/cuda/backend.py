"""The CUDA backend: the op surface of engine/backends/base.py on one GPU, with CuPy arrays
and the NVRTC kernels under kernels/.

- Device: the most capable visible GPU, or `device=` / the BRASS_DEVICE setting (device.py).
- Kernels: compiled on first use for this GPU's architecture, cached on disk (compiler.py).
  Every launch has one shape: buffers first, then one by-value parameter struct
  (kernels/params.cuh).
- Stream: one per backend, made current for the thread, so that CuPy's own array operations
  in the architecture code (reshape, sum, divide) queue behind our kernels in order. Nothing
  here synchronises with the host except to_numpy() and synchronize(); positions stay on the
  device, so a decode step can be captured in a CUDA graph.
- Weights: streamed tensor by tensor from the file through a fixed pinned staging buffer,
  so the host never holds more than that buffer of weight data, and stay on the device in
  their quantized form.
- Options (options.py): the choices between two code paths the backend keeps, each at the
  default the GPU suite runs; `debug` compiles kernels with line info and checks the stream
  after every launch, so that a failing kernel is named where it fails.
"""

from __future__ import annotations

import functools
import re
import traceback
from collections import OrderedDict, deque
from contextlib import contextmanager

import cupy
import numpy as np
from cupy_backends.cuda.api.driver import CUDADriverError

from brass.backends.cuda.params import pack

from ... import flags, quants
from ...errors import BrassError, UnsupportedError
from ...gguf import BLOCK_SIZES, GGMLType
from ..base import MMQ_BLOCK, Backend, Weight, uses_f16_gemm, uses_mmq_id
from .compiler import KERNEL_DIR, compile_source, target_for
from .device import choose_device
from .options import CudaOptions
from . import attention_tiled, blas, pdl
from .errors import CudaError

F16, F32 = np.float16, np.float32

# Type name in kernel names (matvec_<name>, get_rows_<name>), and whether the mat-vec takes
# Q8_1 activations (int8 dot products) or float32 ones.
_TYPE_NAMES = {
    GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0", GGMLType.Q4_1: "q4_1", GGMLType.Q5_0: "q5_0", GGMLType.Q5_1: "q5_1",
    GGMLType.Q8_0: "q8_0", GGMLType.Q4_K: "q4_k", GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
    GGMLType.MXFP4: "mxfp4",
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
SUPPORTED_TYPES = tuple(_TYPE_NAMES)

# Thread-block sizes; each must equal the #define of its kernel source.
MATVEC_THREADS, MATMUL_TILE = 128, 8
# matvec_<type>: warps per block, rows per warp (chosen by ci/gpu_tune_matvec.py on the H200:
# one row per warp and 8 warps per block were fastest for both large and small matrices)
MV_WARPS, MV_ROWS = 8, 1
DOWN_WARPS, DOWN_ROWS = 8, 4        # matvec_moe_down_<type>: the chosen experts over the warps
MOE_MAX_USED = 64
SSM_CONV_THREADS = 128
GDN_HEAD_DIMS = (32, 64, 128)        # gated_delta_net_<D>: state sizes the kernels take;
# a block per (value head, GDN_ROWS state rows), each row on max(1, D / GDN_PART) threads
_SSM_CU = (KERNEL_DIR / "ssm.cu").read_text()
GDN_ROWS, GDN_PART = (int(re.search(rf"#define {n} (\d+)", _SSM_CU).group(1)) for n in ("GDN_ROWS", "GDN_PART"))


def gdn_threads(d: int) -> int:
    """Threads per block of gated_delta_net_<d> (its __launch_bounds__)."""
    return GDN_ROWS * max(1, d // GDN_PART)
# gated_delta_net_chunked_<D> (kernels/delta_chunked.cu): a prompt's delta rule in chunks of
# GDN_CHUNK tokens, a block of GDN_CHUNK_THREADS threads per (value head, GDN_COLS state
# columns). Prompts of at least DELTA_CHUNKED_MIN_TOKENS tokens go there (the delta_chunked
# option; off: the sequential kernel, as llama.cpp runs it). The threshold is one chunk: below
# it the chunked kernel has no state steps to save.
_DELTA_CU = (KERNEL_DIR / "delta_chunked.cu").read_text()
GDN_CHUNK, GDN_CHUNK_THREADS, GDN_COLS = (int(re.search(rf"#define {n} (\d+)", _DELTA_CU).group(1))
                                          for n in ("GDN_CHUNK", "GDN_CHUNK_THREADS", "GDN_COLS"))
DELTA_CHUNKED_MIN_TOKENS = GDN_CHUNK


def gdn_chunked_smem(d: int) -> int:
    """Bytes of dynamic shared memory of gated_delta_net_chunked_<d> (GDN_CHUNK_SMEM_FLOATS)."""
    C = GDN_CHUNK
    return 4 * (2 * C * (d + 1) + d * (GDN_COLS + 1) + 2 * C * (C + 1) + C * GDN_COLS
                + 3 * C + GDN_CHUNK_THREADS)
# matvec_mixed_<a>_<b> (kernels/matvec.cuh, the mixed_matvec option): a decode step's q, k (type
# a) and v (type b: Q4_K_M gives attn_v Q6_K) in one launch, the same bits as two launches
MIXED_PAIRS = {(GGMLType.Q4_K, GGMLType.Q6_K): "q4_k_q6_k", (GGMLType.Q5_K, GGMLType.Q6_K): "q5_k_q6_k"}
SMALL_FLOAT_ROWS = 1024              # float decode mat-vecs of at most this many rows: block per row
FUSED_NORM_THREADS = 1024
ROPE_STORE_THREADS = 128
# moe_route's block (kernels/fused.cu), read from the source so that a variant of the kernel
# compiled with another size (a tuning run's variant) is launched with its own
ROUTE_THREADS = int(re.search(r"#define ROUTE_THREADS (\d+)", (KERNEL_DIR / "fused.cu").read_text()).group(1))
ARGMAX_THREADS = 1024
DEQUANT_THREADS = 256
QUANTIZE_THREADS = 256
GET_ROWS_THREADS = 256
NORM_THREADS = 256
ROPE_THREADS = 128
EW_THREADS = 256
KV_STORE_THREADS = 256
ATTN_THREADS = 128
ATTN_WARPS = ATTN_THREADS // 32
ROW_THREADS = 256
Q8_1_BLOCK_BYTES = 36

# The quantized mat-vecs copy their Q8_1 activations into shared memory (at most
# STAGED_BYTES_PER_Q8 per block of 32, kernels/matvec.cuh StagedItem) for rows of up to
# MV_STAGE_MAX_K values; both read from the header so that the shared memory given at launch
# covers what the kernel writes.
_MATVEC_H = (KERNEL_DIR / "matvec.cuh").read_text()
MV_STAGE_MAX_K = int(re.search(r"#define MV_STAGE_MAX_K (\d+)", _MATVEC_H).group(1))
# matvec_cols_<type> / matvec_glu_cols_<type> (a batched decode step): tokens per block at
# most, and how many staged values (tokens x K) they stage at most.
MV_COLS = int(re.search(r"#define MV_COLS (\d+)", _MATVEC_H).group(1))
MV_COLS_STAGE_MAX_K = int(re.search(r"#define MV_COLS_STAGE_MAX_K (\d+)", _MATVEC_H).group(1))
MV_COLS_ROW_ITERS = int(re.search(r"#define MV_COLS_ROW_ITERS (\d+)", _MATVEC_H).group(1))
# ... and the weight rows a warp (a split group) of theirs takes at once (a unit)
MV_COLS_ROWS = int(re.search(r"#define MV_COLS_ROWS (\d+)", _MATVEC_H).group(1))
# ... and those of matvec_cols_many_<type>, taken by launches of two groups of tokens or more
MV_COLS_ROWS_MANY = int(re.search(r"#define MV_COLS_ROWS_MANY (\d+)", _MATVEC_H).group(1))
# matvec_split_<type> / matvec_cols_split_<type>: warps that share a unit of rows, taken by
# matrices of rows of at least MV_SPLIT_MIN_K values (kernels/matvec.cuh says why); a block
# takes MV_WARPS // split units
MV_SPLIT = int(re.search(r"#define MV_SPLIT (\d+)", _MATVEC_H).group(1))
# matvec_glu_<type>: warps x rows of a block, 32 rows = one Q8_1 block of h (kernels/matvec.cuh)
GLU_WARPS = int(re.search(r"#define GLU_WARPS (\d+)", _MATVEC_H).group(1))
GLU_ROWS = int(re.search(r"#define GLU_ROWS (\d+)", _MATVEC_H).group(1))
MV_SPLIT_MIN_K = int(re.search(r"#define MV_SPLIT_MIN_K (\d+)", _MATVEC_H).group(1))
# matvec_glu_wide_<type>: its warps per block, and the launches it takes (fewer blocks per SM)
GLU_WIDE_WARPS = int(re.search(r"#define GLU_WIDE_WARPS (\d+)", _MATVEC_H).group(1))
GLU_WIDE_MAX_BLOCKS_PER_SM = int(re.search(r"#define GLU_WIDE_MAX_BLOCKS_PER_SM (\d+)", _MATVEC_H).group(1))
# matvec_coop_q6_k (kernels/matvec.cuh, MV_COOP_WARPS): a one-token Q6_K mat-vec whose warps read
# each chunk of 32 items of a row together into shared memory (coalesced) before each lane takes
# its item, where matvec_q6_k's lanes read their own items' words (bound by L1); the same bits.
# Rows of whole chunks only (K a multiple of 1024: row bytes a multiple of 8); the q6k_coop
# option (off: matvec_q6_k).
MV_COOP_WARPS = int(re.search(r"#define MV_COOP_WARPS (\d+)", _MATVEC_H).group(1))
MV_COOP_ROWS = int(re.search(r"#define MV_COOP_ROWS (\d+)", _MATVEC_H).group(1))    # rows a warp at once
# ... its blocks at most per SM (the warps step over the rest of the rows): 8 blocks of
# MV_COOP_WARPS = 8 warps, as many warps as an H200 SM holds (4 were slower on an output head)
COOP_BLOCKS_PER_SM = 8


def mv_split(k: int) -> int:
    """Warps per unit of rows of a decode mat-vec over rows of k values (1: a warp per unit).
    A matrix takes the same kernel whatever the batch, so a token's sums do not depend on it."""
    return MV_SPLIT if k >= MV_SPLIT_MIN_K else 1


def uses_q6k_coop(wtype, k: int, row_bytes: list[int]) -> bool:
    """Whether a one-token mat-vec of `wtype` over rows of k values (matrices of `row_bytes`)
    can take matvec_coop_q6_k (where the q6k_coop option is on): Q6_K, a warp per row (not
    split) and rows of whole 8-byte words (its chunks)."""
    return wtype == GGMLType.Q6_K and mv_split(k) == 1 and all(rb % 8 == 0 for rb in row_bytes)


def coop_blocks(units: int, n_sms: int, warps: int | None = None, rows: int | None = None) -> int:
    """matvec_coop_q6_k's blocks for `units` rows: MV_COOP_ROWS rows per warp, at most
    COOP_BLOCKS_PER_SM blocks an SM (the kernel's warps step over the rest); `warps` and `rows`:
    another build's MV_COOP_WARPS and MV_COOP_ROWS (the header's by default)."""
    per_block = (warps or MV_COOP_WARPS) * (rows or MV_COOP_ROWS)
    return max(1, min(-(-units // per_block), n_sms * COOP_BLOCKS_PER_SM))
Q8S_BYTES = int(re.search(r"#define STAGED_BYTES_PER_Q8 (\d+)", _MATVEC_H).group(1))
# mmq_id_<type> (kernels/mmq.cu): weight rows and tokens per thread block, threads per block.
_MMQ_CU = (KERNEL_DIR / "mmq.cu").read_text()
MMQ_ROWS, MMQ_COLS, MMQ_THREADS, MOE_PLAN_THREADS = (
    int(re.search(rf"#define {n} (\d+)", _MMQ_CU).group(1))
    for n in ("MMQ_ROWS", "MMQ_COLS", "MMQ_THREADS", "MOE_PLAN_THREADS"))
MOE_PLAN_MAX_E = int(re.search(r"#define MOE_PLAN_MAX_E (\d+)", _MMQ_CU).group(1))


def cols_row_blocks(rows: list[int], split: int, iters: int | None = None,
                    unit_rows: int | None = None) -> int:
    """blockIdx.y's extent of a batched step's mat-vec over matrices of `rows` rows (matvec_cols_,
    split or not): units of MV_COLS_ROWS rows of each matrix, MV_COLS_ROW_ITERS rounds of a
    block's units each (the kernel strides over the rest)."""
    iters = MV_COLS_ROW_ITERS if iters is None else iters
    unit_rows = MV_COLS_ROWS if unit_rows is None else unit_rows
    units = sum(-(-n // unit_rows) for n in rows)
    return max(1, min(-(-units // (MV_WARPS // split * iters)), 65535))


# The decode mat-vec's preloads (kernels/matvec.cuh MV_PRELOAD, MV_PRELOAD_Q6K: items a lane
# loads ahead) and the rows a warp then takes at once (MV_PRELOAD_ROWS): a launch's units of rows
# follow them (unit_rows).
MV_PRELOAD, MV_PRELOAD_Q6K, MV_PRELOAD_ROWS = (
    int(re.search(rf"#define {n} (\d+)", _MATVEC_H).group(1))
    for n in ("MV_PRELOAD", "MV_PRELOAD_Q6K", "MV_PRELOAD_ROWS"))


def unit_rows(wtype, preload_rows: int | None = None) -> int:
    """Rows of a unit of a one-token matvec_<type> launch (a warp's, or a split group's, at
    once; the kernel's unit_rows<K>): MV_PRELOAD_ROWS for the kinds the kernels preload (Q4_K
    with MV_PRELOAD, Q6_K with MV_PRELOAD_Q6K), MV_ROWS for the others. preload_rows: another
    build's MV_PRELOAD_ROWS."""
    preloaded = (wtype == GGMLType.Q4_K and MV_PRELOAD > 0) or (wtype == GGMLType.Q6_K and MV_PRELOAD_Q6K > 0)
    return (preload_rows or MV_PRELOAD_ROWS) if preloaded and MV_ROWS == 1 else MV_ROWS


def matvec_units(wtype, rows: list[int], preload_rows: int | None = None) -> int:
    """The units of rows of a one-token matvec_<type> launch over matrices of `rows` rows."""
    r = unit_rows(wtype, preload_rows)
    return sum(-(-n // r) for n in rows)


def mixed_blocks(rows: list[int], type_a, type_b, preload_rows: int | None = None) -> int:
    """matvec_mixed_'s blocks for rows [n0, n1, n2] (matrices 0, 1 of type_a, 2 of type_b):
    matvec_<a>'s launch over 0 and 1, then matvec_<b>'s over 2 (the kernel's split)."""
    return (-(-matvec_units(type_a, rows[:2], preload_rows) // MV_WARPS)
            + -(-matvec_units(type_b, rows[2:], preload_rows) // MV_WARPS))


def _stage_bytes(wtype, n_values: int) -> int:
    """Shared memory for a quantized mat-vec whose staged activations are `n_values` long
    (0: a float weight, or too long to stage: the kernel reads them from global memory)."""
    if wtype in FLOAT_TYPES or n_values > MV_STAGE_MAX_K:
        return 0
    return n_values // 32 * Q8S_BYTES


def _cols_per_block(wtype, n_tokens: int, k: int) -> tuple[int, int]:
    """(tokens per block, shared memory) of a batched step's mat-vec: as many tokens as the
    kernel has accumulators for, and, for staged kinds, as fit MV_COLS_STAGE_MAX_K together
    (so that every block, the last one's fewer tokens too, stages exactly when smem is given)."""
    if wtype in FLOAT_TYPES:
        return min(MV_COLS, n_tokens), 0
    cols = max(1, min(MV_COLS, n_tokens, MV_COLS_STAGE_MAX_K // k))
    return cols, (cols * k // 32 * Q8S_BYTES if cols * k <= MV_COLS_STAGE_MAX_K else 0)


STAGING_BYTES = 32 << 20     # per pinned staging buffer (two of them) for weight uploads
GEMM_SCRATCH_BYTES = 256 << 20  # float16 weights dequantized at a time for the prompt GEMMs
Q8_MEMO = 16                 # activations whose Q8_1 blocks are remembered (see _q8_memo)
_DEFAULT_SMEM = 48 << 10     # shared memory a kernel may use without opting in


def launched_kernels() -> list[tuple[str, str]]:
    """Every (source, kernel) this backend launches; CI checks that each compiles and exists."""
    ks = [("quantize.cu", "quantize_q8_1")]
    for t, n in _TYPE_NAMES.items():
        src = "matvec_f.cu" if t in FLOAT_TYPES else "matvec_q.cu"
        ks += [(src, f"matvec_{n}"), (src, f"matmul_{n}"), (src, f"matvec_id_{n}"),
               (src, f"matvec_glu_{n}"), (src, f"matvec_moe_down_{n}"),
               (src, f"matvec_cols_{n}"), (src, f"matvec_glu_cols_{n}"),
               (src, f"matvec_split_{n}"), (src, f"matvec_cols_split_{n}"), (src, f"matvec_glu_wide_{n}"),
               (src, f"matvec_cols_many_{n}"), (src, f"matvec_cols_split_many_{n}"),
               ("get_rows.cu", f"get_rows_{n}"), ("dequant.cu", f"dequant_f16_{n}")]
    ks += [("matvec_q.cu", f"matvec_mixed_{n}") for n in MIXED_PAIRS.values()]
    ks += [("matvec_q.cu", "matvec_coop_q6_k")]
    ks += [("norm.cu", "rms_norm"), ("rope.cu", "rope"), ("attention.cu", "kv_store"),
           ("attention.cu", "attention")]
    ks += [("elementwise.cu", k) for k in ("add", "mul", "scale", "swiglu", "geglu", "weighted_sum")]
    ks += [("rope.cu", "rope_ff")] + [("elementwise.cu", k) for k in ("tanh_f32", "softcap", "mul_expert_scale")]
    ks += [("router.cu", k) for k in ("softmax", "topk", "argmax", "argmax_partial", "argmax_final")]
    ks += [("fused.cu", k) for k in ("add_rms_norm", "moe_norms", "rope_store", "moe_route", "decode_advance",
                                       "decode_set")]
    ks += [("dequant.cu", "to_f16"), ("dequant.cu", "gather_rows_f16")]
    ks += [("mmq.cu", f"mmq_id_{_TYPE_NAMES[t]}") for t in _TYPE_NAMES if int(t) in MMQ_BLOCK]
    ks += [("mmq.cu", "moe_plan")]
    ks += attention_tiled.launched_kernels()
    ks += [("ssm.cu", "unary"), ("ssm.cu", "ssm_conv")]
    ks += [("ssm.cu", f"gated_delta_net_{d}") for d in GDN_HEAD_DIMS]
    ks += [("delta_chunked.cu", f"gated_delta_net_chunked_{d}") for d in GDN_HEAD_DIMS]
    return ks


class CudaWeight(Weight):
    """A GGUF tensor resident on the device: matrices as their raw ggml bytes (`data`, uint8),
    1-D tensors (norm weights, biases) dequantized to float32 (`dense`)."""

    def __init__(self, name, type_, shape, data=None, dense=None):
        self.name, self.type, self.shape = name, type_, shape
        self.data, self.dense = data, dense

    @property
    def row_bytes(self) -> int:
        blck, tsize = BLOCK_SIZES[self.type]
        return self.shape[-1] // blck * tsize

    @property
    def nbytes(self) -> int:
        return int((self.data if self.data is not None else self.dense).nbytes)


class _Kernels:
    """Kernel functions by (source, name), compiled and loaded on first use."""

    def __init__(self, cc: int, debug: bool):
        self.target = target_for(cc)
        self.options = ("-lineinfo",) if debug else ()
        self._modules: dict[str, cupy.cuda.function.Module] = {}
        self._functions: dict[tuple[str, str], cupy.cuda.function.Function] = {}
        self._smem_optin: dict[tuple[str, str], int] = {}
        self._threads: dict[tuple[str, str], int] = {}

    def get(self, source: str, name: str):
        key = (source, name)
        fn = self._functions.get(key)
        if fn is None:
            module = self._modules.get(source)
            if module is None:
                module = cupy.cuda.function.Module()
                module.load(compile_source(source, self.target, self.options))
                self._modules[source] = module
            fn = self._functions[key] = module.get_function(name)
        return fn

    def block_threads(self, source: str, name: str) -> int:
        """The threads a block of the kernel was built for: its __launch_bounds__ (the most it
        can be launched with). matvec_split_<type> is launched with these, so that a build with
        another MV_SPLIT_WARPS (kernels/matvec.cuh) is launched as it expects."""
        key = (source, name)
        n = self._threads.get(key)
        if n is None:
            from cupy_backends.cuda.api import driver
            CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
            n = self._threads[key] = int(driver.funcGetAttribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                                                                 self.get(source, name).ptr))
        return n

    def allow_smem(self, source: str, name: str, nbytes: int, limit: int):
        """Opt the kernel in to `nbytes` of dynamic shared memory when that and its static
        shared memory exceed the 48 KiB every kernel may use."""
        key = (source, name)
        if self._smem_optin.get(key, 0) >= nbytes:
            return
        from cupy_backends.cuda.api import driver
        CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 1, 8
        static = driver.funcGetAttribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.get(source, name).ptr)
        if nbytes + static > limit:
            raise UnsupportedError(f"kernel {name} would need {nbytes + static} bytes of shared memory; "
                                   f"this GPU allows {limit}")
        if nbytes + static > _DEFAULT_SMEM:
            driver.funcSetAttribute(self.get(source, name).ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    nbytes)
        self._smem_optin[key] = nbytes


def _f32(x, what: str):
    """x as a C-contiguous float32 device array."""
    if not isinstance(x, cupy.ndarray):
        raise BrassError(f"{what}: expected a device array, got {type(x).__name__}")
    if x.dtype != F32:
        raise BrassError(f"{what}: expected float32, got {x.dtype}")
    return cupy.ascontiguousarray(x)


def _i32(x, what: str):
    if not isinstance(x, cupy.ndarray):
        x = cupy.asarray(np.asarray(x))
    if x.dtype.kind not in "iu":
        raise BrassError(f"{what}: expected integers, got {x.dtype}")
    return cupy.ascontiguousarray(x, dtype=np.int32)


@functools.lru_cache(maxsize=None)
def _cublas():
    """CuPy's cuBLAS binding, loaded on first use (prompts multiply on tensor cores through it)."""
    try:
        from cupy_backends.cuda.libs import cublas
        cublas.CUBLAS_OP_T        # the library itself loads on first attribute access
        return cublas
    except ImportError as e:
        raise CudaError(f"cuBLAS could not be loaded ({e}); install the cuda extra "
                        f"(pip install -e '.[cuda]', which brings nvidia-cublas) or a CUDA toolkit") from None


class _CupyBlas:
    """CuPy's shared cuBLAS handle of the current device, set to a stream."""

    def __init__(self, stream_ptr: int):
        self.cublas = _cublas()
        self.handle = cupy.cuda.device.get_cublas_handle()
        self.cublas.setStream(self.handle, stream_ptr)

    def gemmEx(self, *args):
        self.cublas.gemmEx(self.handle, *args)

    def gemmStridedBatchedEx(self, *args):
        self.cublas.gemmStridedBatchedEx(self.handle, *args)


def _grid_1d(n: int, threads: int, cap: int = 65535 * 8) -> int:
    return max(1, min(cap, -(-n // threads)))


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int | str | None = None, *, poison_outputs: bool = False, **options):
        """`device`: an index (default: the BRASS_DEVICE setting, else the most capable GPU);
        `options`: fields of CudaOptions (options.py), each at its default unless given."""
        flags.check()
        self.options = CudaOptions(**options)
        self.device_id = choose_device(device)
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        props = cupy.cuda.runtime.getDeviceProperties(self.device_id)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self.n_sms = int(props["multiProcessorCount"])
        self.cc = int(props["major"]) * 10 + int(props["minor"])
        self.smem_optin_limit = int(props.get("sharedMemPerBlockOptin", _DEFAULT_SMEM))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.kernels = _Kernels(self.cc, self.options.debug)
        # Tests fill every output with NaN (ints with -1) before the kernel runs, so that an
        # element a kernel fails to write cannot pass for a stale right answer.
        self.poison_outputs = poison_outputs
        self._staging = None
        # Q8_1 blocks of recent activations, written by the kernel that produced the
        # activation (norm, attention, gated FFN): {id(array): (array, blocks)}. Activations
        # are never written in place once produced, and the entry holds the array, so its id
        # cannot be reused while the entry lives; a mat-vec that finds its input here skips
        # the quantize kernel.
        self._q8 = OrderedDict()
        self.launches = 0           # kernels launched (or captured) so far, by launch()
        self._gemm_scratch = None
        self._plan = None           # (ids array, routing plan) of the last prompt MoE layer
        self._own_blas = None       # blas.Handle, made on first use (options.own_cublas)
        self._id_plan = None        # (ids array, experts, device plan) of mmq_id (options.moe_mmq)
        self._row_tables: dict = {}  # cache addresses of batched steps' rows (_row_pointers)
        self._graph_refs: list | None = None   # arrays a graph being captured reads (capture)
        # While a bucket graph of batched steps is captured (engine/batch.py BucketStep): a
        # function giving, for a layer's rows, the fixed device tables the graph will read the
        # rows' cache addresses from (rewritten before each replay), and the capacity that
        # bounds every row's cache.
        self.row_tables_override = None
        # Kernels captured into graphs are launched with programmatic dependent launch where the
        # GPU has it (sm_90+) and the pdl option is on.
        self.pdl = self.options.pdl and pdl.available(self.cc)
        # Float16 copies of dense weights for the prompt GEMMs (options.f16_weights):
        # {id(weight): (weight, copy)}, their bytes, and the budget (fixed at the first copy).
        self._f16_copies: dict = {}
        self.f16_weight_bytes = 0
        self._f16_budget = None
        # Pinned host buffers of copies still queued, with their events: held until the copy is
        # done, so that the pinned pool cannot hand the memory to another array meanwhile.
        self._inflight = deque()
        with self.device:
            self._no_experts = cupy.zeros(1, np.int32)     # dequant's expert list when unused
        self._gemm_scalars = (np.ones(1, F32), np.zeros(1, F32))   # alpha, beta (host pointers)

    @property
    def row_tables(self) -> bool:
        return self.options.row_kernels

    def _out(self, shape, dtype=F32):
        """A new output array (poisoned when poison_outputs is set)."""
        if not self.poison_outputs:
            return cupy.empty(shape, dtype)
        dtype = np.dtype(dtype)
        fill = np.nan if dtype.kind == "f" else -1 if dtype.kind == "i" else np.iinfo(dtype).max
        return cupy.full(shape, fill, dtype)

    # -- launching --------------------------------------------------------------------------
    def launch(self, source: str, name: str, grid, block: int, *buffers, params: np.ndarray, smem: int = 0):
        """Run kernel `name` of kernels/`source`: buffers first, the parameter struct last
        (brass.backends.cuda.params.pack)."""
        if not (isinstance(params, np.ndarray) and params.dtype.names and params.size == 1):
            raise TypeError(f"{name}: the last kernel argument must be a parameter struct")
        fn = self.kernels.get(source, name)
        self.launches += 1
        if smem:
            self.kernels.allow_smem(source, name, smem, self.smem_optin_limit)
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        if self.pdl and self._graph_refs is not None:
            # Captured into a graph: launched with the programmatic-serialization attribute, so
            # the graph overlaps each kernel's launch with the previous kernel's tail (pdl.py).
            try:
                rc = pdl.launch(fn, grid, int(block), (*buffers, params), int(smem), self.stream)
            except TypeError as e:
                raise CudaError(f"kernel {name} (kernels/{source}): {e}") from None
            if rc:
                raise CudaError(f"kernel {name} (kernels/{source}) did not launch: CUresult {rc}")
        else:
            try:
                fn(grid, (int(block),), (*buffers, params), shared_mem=int(smem), stream=self.stream)
            except (cupy.cuda.runtime.CUDARuntimeError, CUDADriverError) as e:
                raise CudaError(f"kernel {name} (kernels/{source}) did not launch: {e}") from None
        if self.options.debug:
            try:
                self.stream.synchronize()
            except (cupy.cuda.runtime.CUDARuntimeError, CUDADriverError) as e:
                raise CudaError(f"kernel {name} (kernels/{source}) failed: {e}") from None

    @contextmanager
    def activate(self):
        with self.device, self.stream:
            yield

    @contextmanager
    def timer(self):
        """Time the GPU work queued inside the block with CUDA events: yields a dict whose
        'ms' is filled in on exit."""
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        result = {"ms": None}
        start.record(self.stream)
        yield result
        end.record(self.stream)
        end.synchronize()
        result["ms"] = cupy.cuda.get_elapsed_time(start, end)

    # -- memory -----------------------------------------------------------------------------
    def weight(self, gf, name):
        info = gf.tensors.get(name)
        if info is None:
            raise BrassError(f"{gf.path}: no tensor {name}")
        if info.type not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{name}: tensor type {info.type.name} is not supported by the "
                                   f"cuda backend ({', '.join(t.name for t in SUPPORTED_TYPES)})")
        shape = tuple(reversed(info.shape))
        if len(shape) == 1:
            # Norm weights and biases: small, used as float32 by elementwise kernels.
            dense = quants.dequantize(gf.tensor_bytes(name), info.type, info.shape)
            return CudaWeight(name, info.type, shape, dense=cupy.asarray(dense))
        return CudaWeight(name, info.type, shape, data=self._upload(gf.path, info.offset, info.nbytes))

    def _upload(self, path, offset: int, nbytes: int):
        """Copy file bytes [offset, offset + nbytes) to a new device buffer through two pinned
        staging buffers, reading one while the other is in flight."""
        if self._staging is None:
            mems = [cupy.cuda.alloc_pinned_memory(STAGING_BYTES) for _ in range(2)]
            self._staging = [(m, np.frombuffer(m, np.uint8, STAGING_BYTES), cupy.cuda.Event())
                             for m in mems]
            for _, _, ev in self._staging:
                ev.record(self.stream)
        dst = cupy.empty(nbytes, np.uint8)
        with open(path, "rb", buffering=0) as f:
            done, i = 0, 0
            while done < nbytes:
                mem, host, ev = self._staging[i % 2]
                n = min(STAGING_BYTES, nbytes - done)
                ev.synchronize()                     # the previous copy out of this buffer is over
                f.seek(offset + done)
                view = memoryview(host)[:n]
                got = 0
                while got < n:
                    r = f.readinto(view[got:])
                    if not r:
                        raise BrassError(f"{path}: file ended while reading tensor data at byte "
                                         f"{offset + done + got}")
                    got += r
                cupy.cuda.runtime.memcpyAsync(dst.data.ptr + done, mem.ptr, n,
                                              cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
                ev.record(self.stream)
                done += n
                i += 1
        return dst

    def load(self, gf, weights, quiet: bool = False):
        """Upload every tensor of the file now (instead of on first use), one at a time."""
        names = list(gf.tensors)
        if not quiet:
            from tqdm import tqdm
            names = tqdm(names, desc="upload", unit="tensor")
        for name in names:
            if gf.tensors[name].type in SUPPORTED_TYPES:
                weights(name)
        self.synchronize()

    def asarray(self, a, dtype=None):
        with self.activate():
            if isinstance(a, cupy.ndarray):
                return cupy.ascontiguousarray(a, dtype=dtype)
            return cupy.asarray(np.ascontiguousarray(a, dtype=dtype))

    def to_numpy(self, a):
        out = cupy.asnumpy(a, stream=self.stream)
        self.stream.synchronize()
        return out

    def empty(self, shape, dtype=F32):
        return self._allocate(cupy.empty, shape, dtype)

    def zeros(self, shape, dtype=F32):
        # KV caches and recurrent states: a session's memory
        return self._allocate(cupy.zeros, shape, dtype)

    def _allocate(self, make, shape, dtype):
        """make(shape, dtype) on this device; when it does not fit, the float16 weight copies
        (a cache of the prompt GEMMs, options.f16_weights) make room, and no more are made; when it
        still does not fit, one line says so."""
        with self.activate():
            try:
                return make(shape, dtype)
            except cupy.cuda.memory.OutOfMemoryError:
                if self.drop_f16_weights():
                    try:
                        return make(shape, dtype)
                    except cupy.cuda.memory.OutOfMemoryError:
                        pass
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            free, total = cupy.cuda.runtime.memGetInfo()
            raise CudaError(f"out of GPU memory: {nbytes / 2**20:.0f} MiB do not fit in the "
                            f"{free / 2**20:.0f} MiB free of {total / 2**30:.1f} GiB on {self.device_name} "
                            f"(a smaller context, --ctx, or fewer parallel sequences need less)") from None

    def drop_f16_weights(self) -> bool:
        """Free the float16 weight copies and make no more (prompts then dequantize per call,
        with the same results). Not while prompt graphs may hold them (options.own_cublas: a
        captured GEMM reads its copy at every replay). Whether anything was freed."""
        if not self._f16_copies or self.options.own_cublas:
            return False
        self._f16_copies.clear()
        self.f16_weight_bytes = 0
        self._f16_budget = 0
        with self.activate():
            self.stream.synchronize()       # no queued GEMM still reads a copy
            cupy.get_default_memory_pool().free_all_blocks()
        return True

    def synchronize(self):
        self.stream.synchronize()

    def pinned_empty(self, n: int, dtype):
        """A host array in page-locked memory (the target of asynchronous copies)."""
        dtype = np.dtype(dtype)
        mem = cupy.cuda.alloc_pinned_memory(max(1, n * dtype.itemsize))
        return np.frombuffer(mem, dtype, n)

    def upload_async(self, dst, src: np.ndarray):
        """Queue a copy of pinned host array `src` into contiguous device array `dst` (ordered
        with the kernels on this backend's stream); returns a function that waits until the
        copy has read `src` (before `src` may be rewritten)."""
        if not dst.flags.c_contiguous or src.nbytes != dst.nbytes:
            raise BrassError(f"upload_async: {src.nbytes} bytes into {dst.nbytes} (contiguous: "
                             f"{dst.flags.c_contiguous})")
        done = cupy.cuda.Event()
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        done.record(self.stream)
        self._hold_until(done, src)
        return done.synchronize

    def _hold_until(self, event, host):
        """Keep pinned `host` alive until `event` (its copy) is done; drop those done."""
        self._inflight.append((event, host))
        while self._inflight and self._inflight[0][0].done:
            self._inflight.popleft()

    def copy_to_host_async(self, src, dst: np.ndarray):
        """Queue a copy of device array `src` into pinned host array `dst`; returns a function
        that waits for the copy and returns its values."""
        src = cupy.ascontiguousarray(src)
        if src.nbytes != dst.nbytes:
            raise BrassError(f"copy_to_host_async: {src.nbytes} bytes into {dst.nbytes}")
        done = cupy.cuda.Event()
        cupy.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        done.record(self.stream)
        self._hold_until(done, (src, dst))

        def wait():
            done.synchronize()
            return dst.copy()
        return wait

    # -- linear algebra ---------------------------------------------------------------------
    def quantize_q8_1(self, x):
        """Rows of x [R, K] (K a multiple of 32) → Q8_1 blocks, [R, K/32 * 36] bytes."""
        R, K = x.shape
        y = self._out((R, K // 32 * Q8_1_BLOCK_BYTES), np.uint8)
        self.launch("quantize.cu", "quantize_q8_1", _grid_1d(R * K, QUANTIZE_THREADS, 1 << 30),
                    QUANTIZE_THREADS, x, y, params=pack("QuantizeParams", n_rows=R, k=K))
        return y

    def _remember_q8(self, x, blocks):
        self._q8[id(x)] = (x, blocks)
        if len(self._q8) > Q8_MEMO:
            self._q8.popitem(last=False)

    def _q8_of(self, x):
        """The Q8_1 blocks a producer kernel wrote beside `x`, or None."""
        hit = self._q8.get(id(x))
        return hit[1] if hit is not None and hit[0] is x else None

    def _activations(self, x, w: CudaWeight, source=None):
        """What the mat-vec kernel of w's type reads: x itself, or x as Q8_1 blocks (those a
        producer kernel already wrote for `source`, the array x was taken from, if any)."""
        if w.type in FLOAT_TYPES:
            return x
        blocks = self._q8_of(source if source is not None else x)
        return blocks if blocks is not None else self.quantize_q8_1(x)

    def _check_matrix(self, x, w, what: str, ndim: int):
        if not isinstance(w, CudaWeight) or len(w.shape) != ndim:
            raise BrassError(f"{what}: expected a {ndim}-D weight, got "
                             f"{getattr(w, 'shape', type(w).__name__)}")
        if w.type in FLOAT_TYPES and w.shape[-1] % 8:
            # The float mat-vecs read 16-byte vectors of a row.
            raise UnsupportedError(f"{what}: {w.name} has {w.shape[-1]} columns; the cuda backend "
                                   f"needs a multiple of 8 for {w.type.name} weights")
        if x.shape[-1] != w.shape[-1]:
            raise BrassError(f"{what}: input has {x.shape[-1]} features but {w.name} "
                             f"expects {w.shape[-1]}")

    def matmul(self, x, w):
        if isinstance(w, CudaWeight) and len(w.shape) == 1:
            # A one-row weight kept as a vector (qwen35moe's shared-expert gate, [n_embd]): one
            # logit per row, [T] as the numpy backend gives it, through the F32 mat-vec kernel
            # as a (1, K) matrix (a row's sum then does not depend on how many rows there are).
            if w.type != GGMLType.F32:
                raise UnsupportedError(f"matmul: vector weight {w.name} of type {w.type.name}")
            row = CudaWeight(w.name, GGMLType.F32, (1, w.shape[0]), data=w.dense.view(np.uint8))
            return self.matmul_many(x, [row])[0].reshape(x.shape[:-1])
        return self.matmul_many(x, [w])[0]

    def _decode_rows(self, n_rows: int) -> bool:
        """Whether n_rows activations take the single-token (decode) kernels: inside
        rows_independent (base) the rows of a batched decode step do (a mat-vec's blockIdx.y
        is the row; gate/up and the MoE experts the same), per row the same sums in the same
        order as a sequence decoded alone, whereas the prompt kernels (tiles, GEMMs) sum in
        another order."""
        return n_rows == 1 or (self._rows_independent and n_rows > 0)

    def matmul_many(self, x, ws):
        src = x
        x = _f32(x, "matmul")
        for w in ws:
            self._check_matrix(x, w, "matmul", 2)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        T, K = x2.shape
        ys = [self._out((T, w.shape[0]), F32) for w in ws]
        if self._decode_rows(T):
            # Decode: matrices of one type that read the same activations share a launch.
            by_type: dict = {}
            for w, y in zip(ws, ys):
                if w.type in FLOAT_TYPES and w.shape[0] <= SMALL_FLOAT_ROWS:
                    # A MoE router (F32, one row per expert): a warp per row would leave
                    # most SMs idle and each warp K/128 loads deep; a block per row is not.
                    self._matmul_tiles(x2, w, y, src)
                else:
                    by_type.setdefault(w.type, []).append((w, y))
            pair = self._mixed_pair(T, K, by_type) if self.options.mixed_matvec else None
            if pair is not None:
                self._matvec_mixed(x2, by_type[pair[0]], by_type[pair[1]], src)
                by_type = {}
            for wtype, group in by_type.items():
                for i in range(0, len(group), 3):
                    self._matvec(x2, group[i:i + 3], src)
        elif T:
            x16 = None          # x in float16, converted once for every GEMM
            for w, y in zip(ws, ys):
                if uses_f16_gemm(T, K, w.type):
                    if x16 is None:
                        x16 = self._to_f16(x2)
                    self._gemm_f16(x2, w, y, x16)
                else:
                    self._matmul_tiles(x2, w, y, src)
        return [y.reshape(*lead, y.shape[-1]) for y in ys]

    @staticmethod
    def _mixed_pair(T: int, K: int, by_type: dict):
        """(type of matrices 0 and 1, type of matrix 2) when one matvec_mixed_ launch takes the
        decode groups `by_type` (one token, two types of a MIXED_PAIRS pair, at most two
        matrices of the first and one of the second, rows not split), else None."""
        if T != 1 or len(by_type) != 2 or mv_split(K) != 1:
            return None
        a, b = by_type
        for ta, tb in ((a, b), (b, a)):
            if (ta, tb) in MIXED_PAIRS and len(by_type[ta]) <= 2 and len(by_type[tb]) == 1:
                return ta, tb
        return None

    def _matvec_mixed(self, x2, group_a, group_b, src):
        """matvec_mixed_<a>_<b>: group_a's one or two matrices and group_b's one, one token, in
        one launch: the blocks of matvec_<a>'s launch over group_a, then matvec_<b>'s over group_b."""
        (wb, yb), = group_b
        wa0 = group_a[0][0]
        xa = self._activations(x2, wa0, src)        # the same Q8_1 blocks for both kinds
        wa1, ya1 = group_a[1] if len(group_a) > 1 else (wa0, group_a[0][1])
        rows = [wa0.shape[0], wa1.shape[0] if len(group_a) > 1 else 0, wb.shape[0]]
        K = x2.shape[1]
        params = pack("MultiMatVecParams", k=K, n_tokens=1, n_rows0=rows[0], n_rows1=rows[1], n_rows2=rows[2],
                      cols=1, row_bytes0=wa0.row_bytes, row_bytes1=wa1.row_bytes, row_bytes2=wb.row_bytes)
        self.launch("matvec_q.cu", f"matvec_mixed_{MIXED_PAIRS[(wa0.type, wb.type)]}",
                    (mixed_blocks(rows, wa0.type, wb.type), 1),
                    MV_WARPS * 32, wa0.data, wa1.data, wb.data, xa, group_a[0][1], ya1, yb, params=params,
                    smem=_stage_bytes(wa0.type, K))

    def _matvec(self, x2, group, src):
        """One decode mat-vec launch over up to three (weight, output) pairs of one type."""
        w0 = group[0][0]
        xa = self._activations(x2, w0, src)
        ws = [w for w, _ in group] + [w0] * (3 - len(group))
        outs = [y for _, y in group] + [group[0][1]] * (3 - len(group))
        rows = [w.shape[0] for w, _ in group] + [0] * (3 - len(group))
        units = matvec_units(w0.type, rows)
        T, K = x2.shape
        src_file = "matvec_f.cu" if w0.type in FLOAT_TYPES else "matvec_q.cu"
        split = mv_split(K)
        if T == 1:
            params = pack("MultiMatVecParams", k=K, n_tokens=T, n_rows0=rows[0], n_rows1=rows[1],
                          n_rows2=rows[2], cols=1, row_bytes0=ws[0].row_bytes, row_bytes1=ws[1].row_bytes,
                          row_bytes2=ws[2].row_bytes)
            # matvec_coop_q6_k reads its chunks as 8-byte words: the buffers too must be 8-aligned
            if self.options.q6k_coop and uses_q6k_coop(w0.type, K, [w.row_bytes for w in ws]) \
                    and all(w.data.data.ptr % 8 == 0 for w in ws):
                self.launch(src_file, "matvec_coop_q6_k", (coop_blocks(sum(rows), self.n_sms), T), MV_COOP_WARPS * 32,
                            ws[0].data, ws[1].data, ws[2].data, xa, *outs, params=params,
                            smem=_stage_bytes(w0.type, K))
                return
            name = f"matvec_{'split_' if split > 1 else ''}{_TYPE_NAMES[w0.type]}"
            threads = self.kernels.block_threads(src_file, name) if split > 1 else MV_WARPS * 32
            if threads % (32 * split):      # (a build whose warps are not whole split groups)
                raise CudaError(f"kernel {name} (kernels/{src_file}) was built for {threads} threads a block, "
                                f"not whole groups of {split} warps")
            self.launch(src_file, name, (-(-units // (threads // 32 // split)), T), threads,
                        ws[0].data, ws[1].data, ws[2].data, xa, *outs, params=params,
                        smem=_stage_bytes(w0.type, K))
            return
        # A batched step: blocks of `cols` tokens (blockIdx.x, adjacent, so that the groups of
        # one weight row run together and the later ones find it in L2), each token summed
        # as if alone; MV_COLS_ROWS rows per warp (per `split` warps), MV_COLS_ROWS_MANY when
        # there are two groups of tokens or more (the same bits: only the rows a warp takes at
        # once differ).
        cols, smem = _cols_per_block(w0.type, T, K)
        params = pack("MultiMatVecParams", k=K, n_tokens=T, n_rows0=rows[0], n_rows1=rows[1],
                      n_rows2=rows[2], cols=cols, row_bytes0=ws[0].row_bytes, row_bytes1=ws[1].row_bytes,
                      row_bytes2=ws[2].row_bytes)
        groups = -(-T // cols)
        many = groups > 1
        self.launch(src_file, f"matvec_cols_{'split_' if split > 1 else ''}{'many_' if many else ''}"
                              f"{_TYPE_NAMES[w0.type]}",
                    (groups, cols_row_blocks(rows, split, unit_rows=MV_COLS_ROWS_MANY if many else None)),
                    MV_WARPS * 32, ws[0].data, ws[1].data, ws[2].data, xa, *outs, params=params, smem=smem)

    def _matmul_tiles(self, x2, w, y, src):
        """A few tokens: each weight row read once per tile of MATMUL_TILE tokens."""
        T, K = x2.shape
        N = w.shape[0]
        xa = self._activations(x2, w, src)
        params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=1, row_bytes=w.row_bytes,
                      expert_bytes=0, x_per_slot=0, n_experts=1)
        src_file = "matvec_f.cu" if w.type in FLOAT_TYPES else "matvec_q.cu"
        self.launch(src_file, f"matmul_{_TYPE_NAMES[w.type]}", (N, -(-T // MATMUL_TILE)), MATVEC_THREADS,
                    w.data, xa, y, params=params)

    def _to_f16(self, x2):
        """x rounded to float16 (the prompt GEMM's activations)."""
        x16 = cupy.empty(x2.shape, F16)
        self.launch("dequant.cu", "to_f16", _grid_1d(x2.size, DEQUANT_THREADS), DEQUANT_THREADS, x2, x16,
                    params=pack("GluParams", n=x2.size))
        return x16

    def _gemm_f16(self, x2, w, y, x16=None):
        """A prompt's mat-mul on tensor cores: x rounded to float16 (x16, if the caller already
        has it), the weight dequantized to float16 a chunk of rows at a time
        (GEMM_SCRATCH_BYTES) or its kept copy, products summed in float32 by cuBLAS.
        y [T, N] = x [T, K] @ W.T."""
        from cupy_backends.cuda.api import runtime
        cublas = _cublas()
        T, K = x2.shape
        N = w.shape[0]
        if x16 is None:
            x16 = self._to_f16(x2)
        gemm = self._blas()
        alpha, beta = self._gemm_scalars
        kept = self._weight_f16(w)
        if kept is not None:        # the whole float16 matrix, dequantized by an earlier prompt
            chunk, scratch = N, kept
        else:
            chunk = max(1, min(N, GEMM_SCRATCH_BYTES // (2 * K)))
            scratch = self._scratch_f16(chunk * K)
        for r0 in range(0, N, chunk):
            n = min(chunk, N - r0)
            if kept is None:
                self._dequant_f16(w, r0, n, scratch)
            # Column-major view: C^T [n, T] (ld N) = W_chunk [n, K] . x^T; W_chunk is K x n
            # column-major (transposed), x^T is K x T column-major.
            gemm.gemmEx(cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, T, K,
                          alpha.ctypes.data, scratch.data.ptr, runtime.CUDA_R_16F, K,
                          x16.data.ptr, runtime.CUDA_R_16F, K,
                          beta.ctypes.data, y.data.ptr + 4 * r0, runtime.CUDA_R_32F, N,
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)

    def _blas(self):
        """The cuBLAS calls of this backend's stream: CuPy's binding, or a handle of our own
        with its own workspace (options.own_cublas: calls that a stream capture may record)."""
        if self._own_blas is None and self.options.own_cublas:
            if self._graph_refs is not None:
                # its workspace would come from the capture's memory: an eager prompt makes it
                raise CudaError("the cuBLAS handle is made by an eager prompt, not inside a capture")
            self._own_blas = blas.Handle(self.stream.ptr)
        if self._own_blas is not None:
            return self._own_blas
        return _CupyBlas(self.stream.ptr)

    def _dequant_f16(self, w, r0: int, n: int, out):
        """Rows r0 .. r0 + n of the 2-D weight w as float16 into out [n, K]."""
        K = w.shape[-1]
        self.launch("dequant.cu", f"dequant_f16_{_TYPE_NAMES[w.type]}",
                    (-(-K // (2 * DEQUANT_THREADS)), min(n, 65535)), DEQUANT_THREADS,
                    w.data[r0 * w.row_bytes:], self._no_experts, out,
                    params=pack("DequantParams", n_rows=n, n_cols=K, row_bytes=w.row_bytes,
                                rows_per_expert=0))

    def _weight_f16(self, w):
        """The float16 matrix [N, K] of the 2-D weight w for the prompt GEMM without dequantizing:
        an F16 weight's own bytes; for other types the copy kept since the first prompt, made
        while the copies fit their budget (options.f16_weights); else None (dequantize per call)."""
        if len(w.shape) != 2:
            return None
        if w.type == GGMLType.F16:      # already float16, row-major [N, K]: no copy needed
            return w.data
        if not self.options.f16_weights:
            return None
        entry = self._f16_copies.get(id(w))
        if entry is not None:
            return entry[1]
        if self._graph_refs is not None:    # no copy is made inside a capture (nor kept by it)
            return None
        N, K = w.shape
        nbytes = 2 * N * K
        if self._f16_budget is None:
            gib = self.options.f16_weights_gb
            if gib is not None:
                self._f16_budget = int(gib * 2**30)
            else:
                free, _ = cupy.cuda.runtime.memGetInfo()
                pool = cupy.get_default_memory_pool()
                self._f16_budget = (free + pool.free_bytes()) // 2
        if self.f16_weight_bytes + nbytes > self._f16_budget:
            return None
        try:
            copy = cupy.empty((N, K), F16)
        except cupy.cuda.memory.OutMemoryError:
            # the budget was an estimate (KV caches allocated since take their share): keep
            # what is kept, make no more copies, dequantize per call from here on
            self._f16_budget = self.f16_weight_bytes
            return None
        self._dequant_f16(w, 0, N, copy)
        self._f16_copies[id(w)] = (w, copy)
        self.f16_weight_bytes += nbytes
        return copy

    def matmul_id(self, x, w, ids):
        x = _f32(x, "matmul_id")
        self._check_matrix(x, w, "matmul_id", 3)
        ids = _i32(ids, "matmul_id ids")
        if ids.ndim != 2:
            raise BrassError(f"matmul_id: ids must be [T, k], got shape {ids.shape}")
        T, k = ids.shape
        E, N, K = w.shape
        per_slot = x.ndim == 3
        if x.shape[:-1] != ((T, k) if per_slot else (T,)):
            raise BrassError(f"matmul_id: x of shape {x.shape} does not match ids of shape {ids.shape}")
        y = self._out((T, k, N), F32)
        mmq = T and k and not self._rows_independent and self.options.moe_mmq and uses_mmq_id(T, K, w.type)
        # (under the switch without int8 mma, sm < 8.0: the mat-vec kernels, which round as
        # the reference then expects, not the float16 GEMM)
        if mmq and self.cc >= 80 and -(-T * k // MMQ_COLS) + min(E, T * k) < 65535 and E <= MOE_PLAN_MAX_E:
            self._matmul_id_mmq(x, w, ids, per_slot, y)
        elif T and k and not mmq and not self._rows_independent and uses_f16_gemm(T, K, w.type):
            self._matmul_id_gemm(x, w, ids, per_slot, y)
        elif T and k:
            xa = self._activations(x.reshape(-1, K), w)
            params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=k, row_bytes=w.row_bytes,
                          expert_bytes=N * w.row_bytes, x_per_slot=int(per_slot), n_experts=E)
            src = "matvec_f.cu" if w.type in FLOAT_TYPES else "matvec_q.cu"
            self.launch(src, f"matvec_id_{_TYPE_NAMES[w.type]}", (N, T * k), MATVEC_THREADS,
                        w.data, xa, ids, y, params=params)
        return y

    def _matmul_id_mmq(self, x, w, ids, per_slot, y):
        """A prompt's expert mat-muls on int8 tiles (options.moe_mmq): moe_plan sorts the (token,
        slot) pairs by expert on the device (kept while the same ids come back: gate, up and
        down of one layer), then one mmq_id launch covers every expert's tiles. No host
        synchronisation."""
        E, N, K = w.shape
        T, k = ids.shape
        S = T * k
        max_tiles = -(-S // MMQ_COLS) + min(E, S)
        if self._id_plan is not None and self._id_plan[0] is ids and self._id_plan[1] == E:
            plan = self._id_plan[2]
        else:
            plan = cupy.empty(2 * E + 2 * S + 1 + 2 * max_tiles, np.int32)
            self.launch("mmq.cu", "moe_plan", 1, MOE_PLAN_THREADS, ids, plan,
                        params=pack("MoePlanParams", n_slots=S, n_experts=E, max_tiles=max_tiles))
            self._id_plan = (ids, E, plan)
        x2 = x.reshape(-1, K)
        xa = self._activations(x2, w, x)
        self.launch("mmq.cu", f"mmq_id_{_TYPE_NAMES[w.type]}", (-(-N // MMQ_ROWS), max_tiles + 1),
                    MMQ_THREADS, w.data, xa, plan, y,
                    params=pack("MmqIdParams", n_rows=N, k=K, n_slots=S, n_used=k, row_bytes=w.row_bytes,
                                expert_bytes=N * w.row_bytes, n_experts=E, x_per_slot=int(per_slot),
                                max_tiles=max_tiles))

    def _moe_plan(self, ids, n_experts: int):
        """Where each (token, slot) goes in the per-expert batches of a prompt's expert GEMMs.
        Experts with rows are grouped by their row count rounded up to a power of two (at
        least 16); each group is one strided batched GEMM of that many rows per expert, so
        padding at most doubles the work however uneven the routing, and experts no token
        chose are neither dequantized nor multiplied. Reads ids on the host (a prompt may
        synchronise; decode never comes here); reused while the same ids array comes back
        (gate, up and down of one layer)."""
        if self._plan is not None and self._plan[0] is ids:
            return self._plan[1]
        flat = self.to_numpy(ids).reshape(-1)
        valid = (flat >= 0) & (flat < n_experts)
        order = np.argsort(np.where(valid, flat, n_experts), kind="stable")
        n_valid = int(valid.sum())
        slots = order[:n_valid]                       # valid slots, by expert
        counts = np.bincount(flat[valid], minlength=n_experts)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        used = np.nonzero(counts)[0]
        caps = np.maximum(16, 1 << np.ceil(np.log2(np.maximum(counts[used], 1))).astype(np.int64))
        pad_pos = np.empty(n_valid, np.int64)
        groups, row = [], 0
        for cap in np.unique(caps):
            experts = used[caps == cap]
            for q, e in enumerate(experts):
                pad_pos[first[e]:first[e] + counts[e]] = row + q * cap + np.arange(counts[e])
            groups.append((int(cap), experts.astype(np.int32), row))
            row += len(experts) * int(cap)
        plan = dict(rows=max(row, 1), groups=groups, slots_h=slots, pad_pos_h=pad_pos,
                    slots=cupy.asarray(slots.astype(np.int32)), pad_pos=cupy.asarray(pad_pos.astype(np.int32)),
                    invalid=cupy.asarray(np.nonzero(~valid)[0].astype(np.int32)))
        self._plan = (ids, plan)
        return plan

    def _matmul_id_gemm(self, x, w, ids, per_slot, y):
        """A prompt's expert mat-muls on tensor cores: each chosen expert's (token, slot) rows
        gathered into a padded batch (float16), the chosen experts' weights dequantized to
        float16 (as many as the scratch holds at a time), one strided batched GEMM per group
        of experts with the same padded row count (_moe_plan)."""
        from cupy_backends.cuda.api import runtime
        cublas = _cublas()
        E, N, K = w.shape
        T, k = ids.shape
        plan = self._moe_plan(ids, E)
        R = plan["rows"]
        gidx = np.full(R, -1, np.int32)
        gidx[plan["pad_pos_h"]] = plan["slots_h"] if per_slot else plan["slots_h"] // k
        gidx = cupy.asarray(gidx)
        x2 = x.reshape(-1, K)
        xpad = cupy.empty((R, K), F16)
        self.launch("dequant.cu", "gather_rows_f16", (-(-K // DEQUANT_THREADS), min(R, 65535)), DEQUANT_THREADS,
                    x2, gidx, xpad, params=pack("GatherParams", n_out=R, n_cols=K, n_src_rows=x2.shape[0]))
        cpad = cupy.empty((R, N), F32)
        per_chunk = max(1, GEMM_SCRATCH_BYTES // (2 * N * K))
        scratch = self._scratch_f16(min(per_chunk, E) * N * K)
        gemm = self._blas()
        alpha, beta = self._gemm_scalars
        for cap, experts, row0 in plan["groups"]:
            for c0 in range(0, len(experts), per_chunk):
                chunk = experts[c0:c0 + per_chunk]
                ne = len(chunk)
                self.launch("dequant.cu", f"dequant_f16_{_TYPE_NAMES[w.type]}",
                            (-(-K // (2 * DEQUANT_THREADS)), min(ne * N, 65535)), DEQUANT_THREADS,
                            w.data, cupy.asarray(chunk), scratch,
                            params=pack("DequantParams", n_rows=ne * N, n_cols=K, row_bytes=w.row_bytes,
                                        rows_per_expert=N))
                r0 = row0 + c0 * cap
                gemm.gemmStridedBatchedEx(
                    cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, cap, K,
                    alpha.ctypes.data, scratch.data.ptr, runtime.CUDA_R_16F, K, N * K,
                    xpad.data.ptr + 2 * r0 * K, runtime.CUDA_R_16F, K, cap * K,
                    beta.ctypes.data, cpad.data.ptr + 4 * r0 * N, runtime.CUDA_R_32F, N, cap * N,
                    ne, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        y2 = y.reshape(T * k, N)
        y2[plan["slots"]] = cpad[plan["pad_pos"]]
        if plan["invalid"].size:
            y2[plan["invalid"]] = np.nan       # as the mat-vec kernels: an expert id out of range

    def _scratch_f16(self, n: int):
        if (self._gemm_scratch is None or self._gemm_scratch.size < n) and self._graph_refs is not None:
            # the scratch is shared by every prompt, eager or captured: it must not come from
            # (and die with) one graph's memory
            raise CudaError("the float16 GEMM scratch would be allocated inside a graph capture")
        if self._gemm_scratch is None or self._gemm_scratch.size < n:
            self._gemm_scratch = None
            self._gemm_scratch = cupy.empty(max(n, GEMM_SCRATCH_BYTES // 2), F16)
        return self._gemm_scratch

    def embed(self, table, ids):
        ids = _i32(ids, "embed ids").reshape(-1)
        if not isinstance(table, CudaWeight) or len(table.shape) != 2:
            raise BrassError("embed: expected a 2-D weight table")
        n_rows, D = table.shape
        y = self._out((ids.size, D), F32)
        if ids.size:
            self.launch("get_rows.cu", f"get_rows_{_TYPE_NAMES[table.type]}",
                        (-(-D // GET_ROWS_THREADS), ids.size), GET_ROWS_THREADS, table.data, ids, y,
                        params=pack("GetRowsParams", n_ids=ids.size, n_cols=D, row_bytes=table.row_bytes,
                                    n_table_rows=n_rows))
        return y

    # -- elementwise ------------------------------------------------------------------------
    def rms_norm(self, x, w, eps):
        x = _f32(x, "rms_norm")
        D = x.shape[-1]
        if w is not None and tuple(w.shape) != (D,):
            raise BrassError(f"rms_norm: weight {w.name} has shape {w.shape}, rows have {D} values")
        y = self._out(x.shape)
        rows = x.size // D if D else 0
        if rows:
            self.launch("norm.cu", "rms_norm", rows, NORM_THREADS, x, x if w is None else w.dense, y,
                        params=pack("RmsNormParams", n_rows=rows, n_cols=D, eps=eps,
                                    has_weight=int(w is not None)))
        return y

    def _binary(self, kernel: str, a, b):
        a = _f32(a, kernel)
        b = _f32(b.dense if isinstance(b, Weight) else b, kernel)
        if b.shape == a.shape:
            n_b = a.size
        elif b.ndim <= a.ndim and a.shape[a.ndim - b.ndim:] == b.shape:
            n_b = b.size
        elif b.ndim <= a.ndim and b.size == 1:
            n_b = 1         # a scalar weight (gemma4's layer_output_scale, shape (1,))
        else:
            # Other broadcasts do not occur in the architectures; CuPy's own kernel does them.
            return (cupy.add if kernel == "add" else cupy.multiply)(a, b, dtype=F32)
        y = self._out(a.shape)
        if a.size:
            self.launch("elementwise.cu", kernel, _grid_1d(a.size, EW_THREADS), EW_THREADS, a, b, y,
                        params=pack("BinaryParams", n=a.size, n_b=n_b))
        return y

    def add(self, a, b):
        return self._binary("add", a, b)

    def mul(self, a, b):
        return self._binary("mul", a, b)

    def scale(self, x, s):
        return self._with_scalar("scale", x, s)

    def _with_scalar(self, kernel: str, x, s: float):
        """An elementwise kernel of elementwise.cu taking x and one float (ScaleParams)."""
        x = _f32(x, kernel)
        y = self._out(x.shape)
        if x.size:
            self.launch("elementwise.cu", kernel, _grid_1d(x.size, EW_THREADS), EW_THREADS, x, y,
                        params=pack("ScaleParams", n=x.size, s=s))
        return y

    # -- gated delta-net (hybrid models) -------------------------------------------------------
    def _unary(self, x, op: int, what: str):
        x = _f32(x, what)
        y = self._out(x.shape)
        if x.size:
            self.launch("ssm.cu", "unary", _grid_1d(x.size, EW_THREADS), EW_THREADS, x, y,
                        params=pack("UnaryParams", n=x.size, op=op))
        return y

    def sigmoid(self, x):
        return self._unary(x, 0, "sigmoid")

    def softplus(self, x):
        return self._unary(x, 1, "softplus")

    def silu(self, x):
        return self._unary(x, 2, "silu")

    @staticmethod
    def _state(a, shape: tuple, what: str):
        """A recurrent state the kernel updates in place: it must be that array itself."""
        if not (isinstance(a, cupy.ndarray) and a.dtype == F32 and a.flags.c_contiguous
                and a.shape == shape):
            raise BrassError(f"{what}: the state must be a contiguous float32 device array of "
                             f"shape {shape}, got {getattr(a, 'shape', type(a).__name__)}")
        return a

    def ssm_conv(self, x, conv_state, w):
        x = _f32(x, "ssm_conv")
        if x.ndim != 2 or not isinstance(w, CudaWeight) or w.type != GGMLType.F32 or len(w.shape) != 2:
            raise BrassError(f"ssm_conv: expected x [T, C] and an F32 weight (C, K), got x "
                             f"{x.shape} and {getattr(w, 'name', w)}")
        T, C = x.shape
        if w.shape[0] != C or w.shape[1] < 2:
            raise BrassError(f"ssm_conv: weight {w.name} has shape {w.shape}, x has {C} channels")
        K = w.shape[1]
        self._state(conv_state, (K - 1, C), "ssm_conv")
        y = self._out((T, C))
        if T and C:
            self.launch("ssm.cu", "ssm_conv", -(-C // SSM_CONV_THREADS), SSM_CONV_THREADS,
                        x, conv_state, w.data, y,
                        params=pack("SsmConvParams", n_tokens=T, n_channels=C, kernel=K))
        return y

    def gated_delta_net(self, q, k, v, g, beta, state):
        q, k, v, g, beta, (T, Hv, Hk, D) = self._gdn_args(q, k, v, g, beta, state)
        if self.options.delta_chunked and T >= DELTA_CHUNKED_MIN_TOKENS \
                and gdn_chunked_smem(D) <= self.smem_optin_limit:
            return self._gated_delta_net_chunked(q, k, v, g, beta, state, T, Hv, Hk, D)
        out = self._out((T, Hv, D))
        if T:
            self.launch("ssm.cu", f"gated_delta_net_{D}", (Hv, D // GDN_ROWS), gdn_threads(D), q, k, v, g, beta, state, out,
                        params=pack("GatedDeltaNetParams", n_tokens=T, n_v_heads=Hv, n_k_heads=Hk,
                                    head_dim=D))
        return out

    def _gdn_args(self, q, k, v, g, beta, state):
        """The checked float32 inputs of gated_delta_net and (T, Hv, Hk, D)."""
        q, k, v = _f32(q, "gated_delta_net q"), _f32(k, "gated_delta_net k"), _f32(v, "gated_delta_net v")
        g, beta = _f32(g, "gated_delta_net g"), _f32(beta, "gated_delta_net beta")
        if v.ndim != 3 or q.shape != k.shape or q.ndim != 3 or q.shape[0] != v.shape[0] \
                or q.shape[2] != v.shape[2]:
            raise BrassError(f"gated_delta_net: q {q.shape}, k {k.shape}, v {v.shape} do not "
                             f"match ([T, Hk, D] and [T, Hv, D])")
        T, Hv, D = v.shape
        Hk = q.shape[1]
        if Hv % Hk or g.shape != (T, Hv) or beta.shape != (T, Hv):
            raise BrassError(f"gated_delta_net: {Hv} value heads over {Hk} key heads, g "
                             f"{g.shape}, beta {beta.shape}")
        if D not in GDN_HEAD_DIMS:
            raise UnsupportedError(f"gated_delta_net: state size {D} is not supported on the "
                                   f"cuda backend (supported: {', '.join(map(str, GDN_HEAD_DIMS))})")
        self._state(state, (Hv, D, D), "gated_delta_net")
        return q, k, v, g, beta, (T, Hv, Hk, D)

    # -- gated delta-net prompt in chunks (kernels/delta_chunked.cu, options.delta_chunked) ----------
    def gated_delta_net_chunked(self, q, k, v, g, beta, state):
        """gated_delta_net by the chunked kernel whatever the switch and T say (the tests
        call it directly): the same checks, contract and state update."""
        q, k, v, g, beta, (T, Hv, Hk, D) = self._gdn_args(q, k, v, g, beta, state)
        return self._gated_delta_net_chunked(q, k, v, g, beta, state, T, Hv, Hk, D)

    def _gated_delta_net_chunked(self, q, k, v, g, beta, state, T, Hv, Hk, D):
        out = self._out((T, Hv, D))
        if T:
            self.launch("delta_chunked.cu", f"gated_delta_net_chunked_{D}", (Hv, D // GDN_COLS),
                        GDN_CHUNK_THREADS, q, k, v, g, beta, state, out,
                        params=pack("GatedDeltaNetParams", n_tokens=T, n_v_heads=Hv, n_k_heads=Hk,
                                    head_dim=D), smem=gdn_chunked_smem(D))
        return out

    def _glu(self, kernel: str, gate, up):
        gate, up = _f32(gate, kernel), _f32(up, kernel)
        if gate.shape != up.shape:
            raise BrassError(f"{kernel}: gate {gate.shape} and up {up.shape} differ in shape")
        y = self._out(gate.shape)
        if gate.size:
            self.launch("elementwise.cu", kernel, _grid_1d(gate.size, EW_THREADS), EW_THREADS,
                        gate, up, y, params=pack("GluParams", n=gate.size))
        return y

    def swiglu(self, gate, up):
        return self._glu("swiglu", gate, up)

    def geglu(self, gate, up):
        return self._glu("geglu", gate, up)

    def rope(self, x, pos, n_rot, base, neox, freq_scale=1.0):
        return self._rope(x, pos, n_rot, base, neox, freq_scale)

    def _rope(self, x, pos, n_rot, base, neox, freq_scale, freq_factors=None):
        """rope, or rope_ff when freq_factors (a 1-D weight of >= n_rot / 2 factors) is given."""
        what = "rope" if freq_factors is None else "rope_ff"
        x = _f32(x, what)
        pos = _i32(pos, f"{what} pos")
        if x.ndim != 3 or pos.shape != (x.shape[0],):
            raise BrassError(f"{what}: expected x [T, H, Dh] and pos [T], got {x.shape} and {pos.shape}")
        T, H, Dh = x.shape
        if n_rot % 2 or not 0 < n_rot <= Dh:
            raise BrassError(f"{what}: n_rot {n_rot} must be even and in (0, {Dh}]")
        if freq_factors is not None and (not isinstance(freq_factors, CudaWeight) or freq_factors.dense is None
                                         or freq_factors.dense.ndim != 1
                                         or freq_factors.dense.shape[0] < n_rot // 2):
            raise BrassError(f"rope_ff: the frequency factors must be a 1-D weight of at least "
                             f"n_rot / 2 = {n_rot // 2} values, got {getattr(freq_factors, 'shape', freq_factors)}")
        # ggml's theta_scale, rounded to float32 the way the numpy reference rounds it.
        theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
        y = self._out(x.shape)
        n_threads = n_rot // 2 + (Dh - n_rot)
        ff = () if freq_factors is None else (freq_factors.dense,)
        if T:
            self.launch("rope.cu", what, (-(-n_threads // ROPE_THREADS), H, T), ROPE_THREADS, x, pos, *ff, y,
                        params=pack("RopeParams", n_tokens=T, n_heads=H, head_dim=Dh, n_rot=n_rot,
                                    theta_scale=theta_scale, freq_scale=freq_scale, neox=int(bool(neox))))
        return y

    def _no_direct_cache(self, what: str):
        """While a bucket graph is captured every cache must be reached through the row
        tables (they are rewritten before each replay); an address baked in would be that of
        a session that may be gone by the next replay."""
        if self.row_tables_override is not None:
            raise BrassError(f"{what}: a cache reached directly while a bucket graph is captured")

    def kv_store(self, cache, x, pos):
        self._no_direct_cache("kv_store")
        x = _f32(x, "kv_store")
        pos = _i32(pos, "kv_store pos")
        if cache.dtype != F16 or not cache.flags.c_contiguous:
            raise BrassError("kv_store: the cache must be a contiguous float16 device array")
        T = pos.shape[0]
        row = int(np.prod(cache.shape[1:]))
        if x.size != T * row:
            raise BrassError(f"kv_store: x of shape {x.shape} does not fill {T} slots of {cache.shape[1:]}")
        if T:
            self.launch("attention.cu", "kv_store", (-(-row // KV_STORE_THREADS), T), KV_STORE_THREADS,
                        x, pos, cache,
                        params=pack("KvStoreParams", n_tokens=T, row_elems=row, capacity=cache.shape[0]))

    def _row_pointers(self, layers, what: str):
        """Device arrays of the K and V cache addresses of a batched step's rows and the
        capacity that bounds them, after checking that every row's caches have the first row's
        layout. The kernels bound slots by the largest capacity (or a bucket graph's, larger):
        each row's position is checked against its own cache on the host before the step
        (engine/batch.py)."""
        k0, v0 = layers[0]
        for kc, vc in layers:
            if (kc.dtype != F16 or vc.dtype != F16 or not kc.flags.c_contiguous or not vc.flags.c_contiguous
                    or kc.shape[1:] != k0.shape[1:] or vc.shape[1:] != v0.shape[1:]
                    or kc.shape[0] != vc.shape[0]):
                raise BrassError(f"{what}: the rows' caches differ in layout ({kc.shape} / {vc.shape} "
                                 f"against {k0.shape} / {v0.shape})")
        if self.row_tables_override is not None:
            return self.row_tables_override(layers)
        cap = max(kc.shape[0] for kc, _ in layers)
        key = tuple((kc.data.ptr, vc.data.ptr) for kc, vc in layers)
        dev = self._row_tables.get(key)
        if dev is not None and self._graph_refs is not None:
            self._graph_refs.append(dev)    # a captured graph reads it at every replay
        if dev is None:
            # An upload per (layer, batch composition), not per launch: rope_store and
            # attention of a layer share it, and so do the steps while the batch is unchanged.
            if len(self._row_tables) >= 4096:
                self._row_tables.clear()
            ptrs = np.array([[k for k, _ in key], [v for _, v in key]], np.uint64)
            dev = self._row_tables[key] = cupy.asarray(ptrs)
        return dev[0], dev[1], cap

    def attention_rows(self, q, layers, pos, scale, window=0):
        if len(layers) == 1:
            return self.attention(q, *layers[0], pos, scale, window)
        if not self.options.row_kernels:
            return super().attention_rows(q, layers, pos, scale, window)
        k0, v0 = layers[0]
        if q.shape[0] != len(layers):
            raise BrassError(f"attention_rows: {q.shape[0]} rows for {len(layers)} caches")
        return self.attention(q, k0, v0, pos, scale, window, row_caches=layers)

    def attention(self, q, k_cache, v_cache, pos, scale, window=0, row_caches=None):
        q = _f32(q, "attention")
        pos = _i32(pos, "attention pos")
        if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
            raise BrassError("attention: expected q [T, H, Dh] and caches [n_ctx, H_kv, D]")
        T, H, Dh = q.shape
        cap, Hkv, Dk = k_cache.shape
        Dv = v_cache.shape[2]
        if Dk != Dh or v_cache.shape[:2] != (cap, Hkv) or H % Hkv:
            raise BrassError(f"attention: q {q.shape} does not fit caches {k_cache.shape} / {v_cache.shape}")
        if k_cache.dtype != F16 or v_cache.dtype != F16:
            raise BrassError("attention: the KV cache must be float16")
        if Dh % 2 or Dv % 2:
            raise BrassError(f"attention: head dims {Dh}/{Dv} must be even")
        out = self._out((T, H * Dv), F32)
        write_q8 = Dv % 32 == 0
        out_q = self._out((T, H * Dv // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else out
        if row_caches is None:
            self._no_direct_cache("attention")
            if self.options.attn_tiled and T >= 2 and attention_tiled.attention_tiled(
                    self, q, k_cache, v_cache, pos, scale, window, out, out_q, write_q8):
                if write_q8:
                    self._remember_q8(out, out_q)
                return out
        rows = self._row_pointers(row_caches, "attention") if row_caches is not None else None
        if rows is not None:
            *rows, cap = rows
        n_slots = min(cap, window) if window > 0 else cap
        params = pack("AttentionParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=Dh, head_dim_v=Dv,
                      capacity=cap, n_slots=n_slots, window=max(0, window), scale=scale, write_q8=int(write_q8),
                      per_row=int(rows is not None))
        if T:
            smem = 4 * (Dh + n_slots + ATTN_WARPS * Dv)
            k_rows, v_rows = rows if rows is not None else (pos, pos)   # unread unless per_row
            self.launch("attention.cu", "attention", (H, T), ATTN_THREADS, q, k_cache, v_cache, pos, out, out_q,
                        k_rows, v_rows, params=params, smem=smem)
        if T and write_q8:
            self._remember_q8(out, out_q)
        return out

    # -- gemma4 -------------------------------------------------------------------------------
    def rope_ff(self, x, pos, n_rot, base, neox, freq_factors, freq_scale=1.0):
        return self._rope(x, pos, n_rot, base, neox, freq_scale, freq_factors)

    def tanh(self, x):
        x = _f32(x, "tanh")
        y = self._out(x.shape)
        if x.size:
            self.launch("elementwise.cu", "tanh_f32", _grid_1d(x.size, EW_THREADS), EW_THREADS, x, y,
                        params=pack("GluParams", n=x.size))
        return y

    def softcap(self, x, cap):
        # One kernel for Backend.softcap's scale, tanh and scale, rounded as those are.
        cap = float(np.float32(cap))
        if not (np.isfinite(cap) and cap != 0.0):
            raise BrassError(f"softcap: the cap must be finite and nonzero, got {cap}")
        return self._with_scalar("softcap", x, cap)

    def mul_expert_scale(self, y, s, ids):
        y = _f32(y, "mul_expert_scale")
        ids = _i32(ids, "mul_expert_scale ids")
        if not isinstance(s, CudaWeight) or s.dense is None or s.dense.ndim != 1:
            raise BrassError(f"mul_expert_scale: the scale must be a 1-D weight (one value per expert), "
                             f"got {getattr(s, 'shape', type(s).__name__)}")
        if y.ndim != 3 or ids.shape != y.shape[:2]:
            raise BrassError(f"mul_expert_scale: expected y [T, k, N] and ids [T, k], got {y.shape} "
                             f"and {ids.shape}")
        T, k, N = y.shape
        out = self._out(y.shape)
        if T * k and N:
            self.launch("elementwise.cu", "mul_expert_scale", (T * k, -(-N // EW_THREADS)), EW_THREADS,
                        y, s.dense, ids, out,
                        params=pack("ExpertScaleParams", n_slots=T * k, n_cols=N, n_experts=s.dense.shape[0]))
        return out

    # -- routing ----------------------------------------------------------------------------
    def _rows(self, x, what):
        x = _f32(x, what)
        return x, x.shape[-1], (x.size // x.shape[-1] if x.shape[-1] else 0)

    def softmax(self, x):
        x, C, R = self._rows(x, "softmax")
        y = self._out(x.shape)
        if R:
            self.launch("router.cu", "softmax", R, ROW_THREADS, x, y,
                        params=pack("RowParams", n_rows=R, n_cols=C, k=0))
        return y

    def topk(self, x, k):
        x, C, R = self._rows(x, "topk")
        if not 0 < k <= C:
            raise BrassError(f"topk: k = {k} must be in [1, {C}]")
        ids = self._out((*x.shape[:-1], k), np.int32)
        vals = self._out((*x.shape[:-1], k), F32)
        if R:
            self.launch("router.cu", "topk", R, ROW_THREADS, x, ids, vals,
                        params=pack("RowParams", n_rows=R, n_cols=C, k=k))
        return ids, vals

    def argmax(self, x):
        x, C, R = self._rows(x, "argmax")
        if not C:
            raise BrassError("argmax: rows are empty")
        ids = self._out(x.shape[:-1], np.int32)
        if R and C > 8 * ARGMAX_THREADS:
            # An output head's row: spread over many blocks, then one warp picks the best.
            pv, pi, parts = self._argmax_partials(x, C, R)
            self.launch("router.cu", "argmax_final", R, 32, pv, pi, ids,
                        params=pack("RowParams", n_rows=R, n_cols=parts, k=1))
        elif R:
            self.launch("router.cu", "argmax", R, ARGMAX_THREADS, x, ids,
                        params=pack("RowParams", n_rows=R, n_cols=C, k=1))
        return ids

    def weighted_sum(self, y, w):
        y, w = _f32(y, "weighted_sum"), _f32(w, "weighted_sum")
        if y.ndim != 3 or w.shape != y.shape[:2]:
            raise BrassError(f"weighted_sum: expected y [T, k, D] and w [T, k], got {y.shape} and {w.shape}")
        T, k, D = y.shape
        out = self._out((T, D), F32)
        if T and D:
            self.launch("elementwise.cu", "weighted_sum", (-(-D // EW_THREADS), T), EW_THREADS, y, w, out,
                        params=pack("WeightedSumParams", n_tokens=T, k=k, n_cols=D))
        return out

    def take_rows(self, x, rows):
        return cupy.take(x, _i32(rows, "take_rows rows"), axis=0)

    # -- fused ops (base.py defines each by the ops it replaces) --------------------------------
    def add_rms_norm(self, a, b, w, eps, scale=None):
        a = _f32(a, "add_rms_norm")
        if b is not None:
            b = _f32(b, "add_rms_norm")
            if b.shape != a.shape:
                raise BrassError(f"add_rms_norm: {a.shape} and {b.shape} differ in shape")
        D = a.shape[-1]
        if w is None or tuple(w.shape) != (D,):
            raise BrassError(f"add_rms_norm: the weight must have shape ({D},)")
        sc = None
        if scale is not None:
            sc = _f32(scale.dense if isinstance(scale, Weight) else scale, "add_rms_norm scale")
            if sc.size != 1:
                raise BrassError(f"add_rms_norm: the scale must be one value, got shape {sc.shape}")
        rows = a.size // D if D else 0
        s = self._out(a.shape) if b is not None or sc is not None else a
        y = self._out(a.shape)
        write_q8 = D % 32 == 0
        yq = self._out((rows, D // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else y
        if rows:
            self.launch("fused.cu", "add_rms_norm", rows, FUSED_NORM_THREADS, a, a if b is None else b,
                        w.dense, a if sc is None else sc, s, y, yq,
                        params=pack("AddNormParams", n_rows=rows, n_cols=D, eps=eps,
                                    has_residual=int(b is not None), write_q8=int(write_q8),
                                    has_scale=int(sc is not None)))
            if write_q8:
                self._remember_q8(y, yq)
        return s, y

    def moe_norms(self, x, w, w_router, factor, eps):
        x = _f32(x, "moe_norms")
        D = x.shape[-1]
        for v, what in ((w, "weight"), (w_router, "router weight")):
            if v is None or tuple(v.shape) != (D,):
                raise BrassError(f"moe_norms: the {what} must have shape ({D},)")
        rows = x.size // D if D else 0
        h, r = self._out(x.shape), self._out(x.shape)
        write_q8 = D % 32 == 0
        hq = self._out((rows, D // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else h
        if rows:
            self.launch("fused.cu", "moe_norms", rows, FUSED_NORM_THREADS, x, w.dense, w_router.dense, h, hq, r,
                        params=pack("MoeNormsParams", n_rows=rows, n_cols=D, eps=eps, factor=factor,
                                    write_q8=int(write_q8)))
            if write_q8:
                self._remember_q8(h, hq)
        return h, r

    def rope_store_rows(self, q, k, v, pos, layers, **kw):
        if len(layers) == 1:
            return self.rope_store(q, k, v, pos, *layers[0], **kw)
        if not self.options.row_kernels:
            return super().rope_store_rows(q, k, v, pos, layers, **kw)
        if q.shape[0] != len(layers):
            raise BrassError(f"rope_store_rows: {q.shape[0]} rows for {len(layers)} caches")
        return self.rope_store(q, k, v, pos, *layers[0], row_caches=layers, **kw)

    @staticmethod
    def _rope_checked(what, q, k, v, pos, k_cache, v_cache, q_norm, k_norm, n_rot, base):
        """rope_store's inputs checked: (q, k, v, pos, theta_scale)."""
        q, k, v = _f32(q, f"{what} q"), _f32(k, f"{what} k"), _f32(v, f"{what} v")
        pos = _i32(pos, f"{what} pos")
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or pos.shape != (q.shape[0],):
            raise BrassError(f"{what}: expected q/k/v [T, H, Dh] and pos [T], got {q.shape}, "
                             f"{k.shape}, {v.shape}, {pos.shape}")
        T, H, Dh = q.shape
        Hkv, Dv = k.shape[1], v.shape[2]
        if k.shape != (T, Hkv, Dh) or v.shape[:2] != (T, Hkv):
            raise BrassError(f"{what}: k {k.shape} / v {v.shape} do not match q {q.shape}")
        for cache, d in ((k_cache, Dh), (v_cache, Dv)):
            if cache.dtype != F16 or not cache.flags.c_contiguous or cache.shape[1:] != (Hkv, d):
                raise BrassError(f"{what}: cache {cache.shape} {cache.dtype} does not hold "
                                 f"[n_ctx, {Hkv}, {d}] float16")
        if n_rot % 2 or not 0 < n_rot <= Dh:
            raise BrassError(f"{what}: n_rot {n_rot} must be even and in (0, {Dh}]")
        for nw, which in ((q_norm, "q"), (k_norm, "k")):
            if nw is not None and tuple(nw.shape) != (Dh,):
                raise BrassError(f"{what}: the {which} norm weight must have shape ({Dh},)")
        theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
        return q, k, v, pos, theta_scale

    def rope_store(self, q, k, v, pos, k_cache, v_cache, *, q_norm, k_norm, eps, n_rot, base, neox,
                   freq_scale=1.0, row_caches=None):
        q, k, v, pos, theta_scale = self._rope_checked("rope_store", q, k, v, pos, k_cache, v_cache,
                                                       q_norm, k_norm, n_rot, base)
        T, H, Dh = q.shape
        Hkv, Dv = k.shape[1], v.shape[2]
        q_out, k_out = self._out(q.shape), self._out(k.shape)
        if row_caches is None:
            self._no_direct_cache("rope_store")
        rows = self._row_pointers(row_caches, "rope_store") if row_caches is not None else None
        capacity = k_cache.shape[0]
        if rows is not None:
            *rows, capacity = rows
        if T:
            k_rows, v_rows = rows if rows is not None else (pos, pos)   # unread unless per_row
            self.launch("fused.cu", "rope_store", (H + 2 * Hkv, T), ROPE_STORE_THREADS,
                        q, k, v, q if q_norm is None else q_norm.dense, k if k_norm is None else k_norm.dense,
                        pos, q_out, k_out, k_cache, v_cache, k_rows, v_rows,
                        params=pack("RopeStoreParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=Dh,
                                    head_dim_v=Dv, n_rot=n_rot, theta_scale=theta_scale,
                                    freq_scale=freq_scale, neox=int(bool(neox)),
                                    q_norm=int(q_norm is not None), k_norm=int(k_norm is not None),
                                    eps=eps, capacity=capacity, write_k=1, per_row=int(rows is not None)),
                        smem=4 * Dh)
        return q_out, k_out

    def _glu_matvec(self, x, w_gate, w_up, gelu, ids=None, what="ffn_glu"):
        """matvec_glu: h = act(x W_gate^T) * (x W_up^T) [rows, N] and its Q8_1 blocks. With ids
        and w_up None, w_gate holds each expert's gate rows then its up rows ([E, 2N, K]): the
        up matrix is the same bytes N rows on, every expert 2N rows apart."""
        src = x
        x = _f32(x, what)
        K = x.shape[-1]
        fused = w_up is None
        N = w_gate.shape[-2] // (2 if fused else 1)
        up_data = w_gate.data[N * w_gate.row_bytes:] if fused else w_up.data
        stride = (2 if fused else 1) * N * w_gate.row_bytes      # bytes from one expert to the next
        x2 = x.reshape(-1, K)
        slots = x2.shape[0] if ids is None else ids.size
        h = self._out((slots, N), F32)
        write_q8 = N % 32 == 0      # for a quantized down projection (unused by a float one)
        hq = self._out((slots, N // 32 * Q8_1_BLOCK_BYTES), np.uint8) if write_q8 else h
        xa = self._activations(x2, w_gate, src)
        # A batched step (no experts) takes blocks of `cols` tokens, each token's h as the
        # one-token kernel's.
        batched = ids is None and slots > 1
        cols, smem = _cols_per_block(w_gate.type, slots, K) if batched else (1, _stage_bytes(w_gate.type, K))
        params = pack("GluMatVecParams", n_rows=N, k=K, n_tokens=x2.shape[0], cols=cols,
                      n_used=1 if ids is None else ids.shape[1], row_bytes=w_gate.row_bytes,
                      expert_bytes=stride if ids is not None else 0,
                      has_ids=int(ids is not None), n_experts=w_gate.shape[0] if ids is not None else 1,
                      gelu=int(bool(gelu)), write_q8=int(write_q8))
        src_file = "matvec_f.cu" if w_gate.type in FLOAT_TYPES else "matvec_q.cu"
        if batched:
            self.launch(src_file, f"matvec_glu_cols_{_TYPE_NAMES[w_gate.type]}",
                        (-(-slots // cols), -(-N // (GLU_WARPS * GLU_ROWS))), GLU_WARPS * 32,
                        w_gate.data, up_data, xa, h, hq, params=params, smem=smem)
        elif slots:
            # a launch of few blocks (a small model's FFN, a token's chosen experts) takes more
            # warps a block, gate and up in one loop: the same floats, more loads in flight
            blocks = -(-N // 32) * slots
            wide = blocks < GLU_WIDE_MAX_BLOCKS_PER_SM * self.n_sms
            self.launch(src_file, f"matvec_glu_{'wide_' if wide else ''}{_TYPE_NAMES[w_gate.type]}",
                        (-(-N // 32), slots), (GLU_WIDE_WARPS if wide else GLU_WARPS) * 32,
                        w_gate.data, up_data, xa, x if ids is None else ids, h, hq,
                        params=params, smem=_stage_bytes(w_gate.type, K))
        return h, (hq if write_q8 else None)

    def _fusable(self, a: CudaWeight, b: CudaWeight) -> bool:
        return a.type == b.type and a.shape == b.shape

    def ffn_glu(self, x, w_gate, w_up, gelu=False):
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        if not self._decode_rows(rows) and len(w_gate.shape) == len(w_up.shape) == 2:
            # a prompt: Backend.ffn_glu's two mat-muls as one matmul_many (x converted or
            # quantized once for both), then the gated activation
            up, gate = self.matmul_many(x, [w_up, w_gate])
            return self.geglu(gate, up) if gelu else self.swiglu(gate, up)
        if not self._decode_rows(rows) or not self._fusable(w_gate, w_up) or len(w_gate.shape) != 2:
            return super().ffn_glu(x, w_gate, w_up, gelu)
        self._check_matrix(_f32(x, "ffn_glu"), w_gate, "ffn_glu", 2)
        h, hq = self._glu_matvec(x, w_gate, w_up, gelu)
        h = h.reshape(*x.shape[:-1], h.shape[-1])
        if hq is not None:
            self._remember_q8(h, hq)
        return h

    def moe_route(self, logits, k, norm, scale):
        x, E, R = self._rows(logits, "moe_route")
        if not 0 < k <= min(E, 64):
            raise BrassError(f"moe_route: k = {k} must be in [1, {min(E, 64)}]")
        probs = self._out(x.shape)
        ids = self._out((*x.shape[:-1], k), np.int32)
        weights = self._out((*x.shape[:-1], k), F32)
        if R:
            self.launch("fused.cu", "moe_route", R, ROUTE_THREADS, x, probs, ids, weights,
                        params=pack("MoeRouteParams", n_rows=R, n_experts=E, k=k, norm=int(bool(norm)),
                                    scale=1.0 if scale in (0.0, 1.0) else scale))
        return probs, ids, weights

    def fuses_moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, down_scale=None) -> bool:
        """Whether moe_ffn runs these operands as the two fused decode kernels (the experts'
        gate/up mat-vecs writing h's Q8_1 blocks, then the down projection with the weighted
        sum) rather than Backend.moe_ffn's composition (a prompt, float down weights, ...)."""
        T = x.shape[0] if x.ndim == 2 else 0
        fused = w_up is None                # w_gate is [E, 2F, D]: each expert's gate rows, then up
        return not (x.ndim != 2 or not self._decode_rows(T) or ids.shape != weights.shape or ids.shape[0] != T
                    or len(w_gate.shape) != 3 or (not fused and not self._fusable(w_gate, w_up))
                    or (fused and w_gate.shape[1] % 2) or w_down.type in FLOAT_TYPES
                    or (w_gate.shape[1] // (2 if fused else 1)) % 32 or ids.shape[-1] > MOE_MAX_USED
                    or (down_scale is not None and (not isinstance(down_scale, CudaWeight)
                                                    or down_scale.dense is None
                                                    or down_scale.dense.shape != (w_gate.shape[0],))))

    def moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, gelu=False, down_scale=None):
        x = _f32(x, "moe_ffn")
        ids = _i32(ids, "moe_ffn ids")
        weights = _f32(weights, "moe_ffn weights")
        if not self.fuses_moe_ffn(x, w_gate, w_up, w_down, ids, weights, down_scale):
            return super().moe_ffn(x, w_gate, w_up, w_down, ids, weights, gelu, down_scale)
        T = x.shape[0]
        fused = w_up is None                # w_gate is [E, 2F, D]: each expert's gate rows, then up
        self._check_matrix(x, w_gate, "moe_ffn", 3)
        E, N, K = w_gate.shape
        N //= 2 if fused else 1
        D = w_down.shape[1]
        if w_down.shape != (E, D, N):
            raise BrassError(f"moe_ffn: down {w_down.shape} does not match gate {w_gate.shape}")
        k = ids.shape[1]
        _, hq = self._glu_matvec(x, w_gate, w_up, gelu, ids=ids, what="moe_ffn")
        out = self._out((T, D), F32)
        self.launch("matvec_q.cu", f"matvec_moe_down_{_TYPE_NAMES[w_down.type]}",
                    (-(-D // DOWN_ROWS), T), DOWN_WARPS * 32, w_down.data, hq, ids, weights,
                    down_scale.dense if down_scale is not None else weights, out,
                    params=pack("MoeDownParams", n_rows=D, k=N, n_tokens=T, n_used=k, row_bytes=w_down.row_bytes,
                                expert_bytes=D * w_down.row_bytes, n_experts=E,
                                has_scale=int(down_scale is not None)),
                    smem=_stage_bytes(w_down.type, k * N))
        return out

    # -- decoding on the device -----------------------------------------------------------------
    supports_graphs = True

    def decode_set(self, tok, pos, token: int, position: int):
        """tok[0] = token, pos[0] = position, queued on the stream (as launch parameters)."""
        self.launch("fused.cu", "decode_set", 1, 32, tok, pos,
                    params=pack("DecodeSetParams", tok=int(token), pos=int(position)))

    def _argmax_partials(self, x, C: int, R: int):
        """argmax_partial's best (value, index) of each run of columns: (pv, pi, runs per row)."""
        parts = min(-(-C // ARGMAX_THREADS), 256)
        pv, pi = self._out((R, parts), F32), self._out((R, parts), np.int32)
        self.launch("router.cu", "argmax_partial", (parts, R), ARGMAX_THREADS, x, pv, pi,
                    params=pack("RowParams", n_rows=R, n_cols=C, k=1))
        return pv, pi, parts

    def decode_advance(self, next_ids, tok, pos, history):
        """Greedy step on the device: tok = next_ids[0], pos += 1, history[pos] = tok."""
        self.launch("fused.cu", "decode_advance", 1, 32, next_ids, tok, pos, history,
                    params=pack("AdvanceParams", capacity=history.shape[0]))

    def capture(self, fn, reuse_freed: bool = False):
        """Record the kernels `fn()` queues on this backend's stream as a CUDA graph (nothing
        runs). Every allocation made meanwhile is kept with the graph: replays write into that
        memory, so the pool must never hand it to anyone else. With reuse_freed the
        allocations come from a pool of the graph's own instead, where memory an array of the
        capture freed serves a later allocation of the same capture (the graph runs its
        kernels in the order they were queued, each waiting for the one before it), so the
        graph holds its peak working set rather than every intermediate array (a prompt's).

        That pool serves the capture only: the graph keeps the device blocks the pool took
        (cupy.cuda.Memory, freed when the graph and the arrays it returned are gone) and the
        pool is emptied and dropped at once. A dropped CuPy pool that still holds free blocks
        never gives them back (CuPy 14: an arena holds its free chunks by references the
        garbage collector cannot see, and each chunk holds its arena), which is how evicted
        prompt graphs used to keep their memory for good (issue 11)."""
        blocks: list = []               # reuse_freed: the device memory the graph's pool took
        if reuse_freed:
            def grow(nbytes):
                mem = cupy.cuda.Memory(nbytes)
                blocks.append(mem)
                return cupy.cuda.MemoryPointer(mem, 0)
            pool = cupy.cuda.MemoryPool(grow)
            alloc = pool.malloc
        else:
            pool = cupy.get_default_memory_pool()

            def alloc(nbytes):
                mem = pool.malloc(nbytes)
                blocks.append(mem)
                return mem
        refs: list = []                 # arrays others own that its kernels read (row tables)
        try:
            with self.device, self.stream, cupy.cuda.using_allocator(alloc):
                self._graph_refs = refs
                self.stream.begin_capture()
                try:
                    result = fn()
                except BaseException:
                    try:
                        self.stream.end_capture()
                    except Exception:   # the capture is already invalid; report fn's error
                        pass
                    raise
                finally:
                    self._graph_refs = None
                    # the memos' arrays of this forward are the graph's memory: none outlives it
                    self._q8.clear()
                    self._plan = self._id_plan = None
                graph = self.stream.end_capture()
        except BaseException as e:
            if reuse_freed:
                # the arrays the failed forward left in its frames go back to the pool, and the
                # blocks leave it: a failed capture keeps nothing
                traceback.clear_frames(e.__traceback__)
                with self.device:
                    pool.free_all_blocks()
            raise
        escaped = 0
        if reuse_freed:
            # The arrays returned, as views that keep the graph's blocks alive (a caller may
            # hold the logits after the graph is dropped); the pool's own arrays then go back
            # to it, its blocks leave it, and it goes.
            result = _holding(result, blocks)
            with self.device:
                pool.free_all_blocks()
                escaped = pool.used_bytes()     # an array of the capture still held elsewhere
            del pool
        return CudaGraph(self, graph, blocks + refs, result, escaped)


def _holding(result, owner):
    """`result` (an array, a tuple or list of them, or anything else, unchanged) with each
    array replaced by a view of the same memory that holds `owner`."""
    if isinstance(result, cupy.ndarray):
        mem = cupy.cuda.UnownedMemory(result.data.ptr, result.nbytes, owner, result.data.device_id)
        return cupy.ndarray(result.shape, result.dtype, cupy.cuda.MemoryPointer(mem, 0), strides=result.strides)
    if isinstance(result, (tuple, list)):
        return type(result)(_holding(r, owner) for r in result)
    return result


class CudaGraph:
    """A captured CUDA graph, the memory its kernels use, and what the captured function
    returned (arrays that every replay rewrites). `escaped`: bytes of the graph's own pool
    still held by arrays outside it when the capture ended (0: none)."""

    def __init__(self, backend, graph, memory, result, escaped: int = 0):
        self.backend, self.graph, self.memory, self.result = backend, graph, memory, result
        self.escaped = escaped

    def replay(self):
        self.graph.launch(stream=self.backend.stream)

    @property
    def nbytes(self) -> int:
        """Device memory held for the graph: the blocks of its own pool (reuse_freed) or the
        allocations made during the capture (arrays it reads that others own are not counted)."""
        total = 0
        for m in self.memory:
            if isinstance(m, cupy.cuda.Memory):
                total += m.size
            elif isinstance(m, cupy.cuda.MemoryPointer):
                total += m.mem.size
        return total


def _on_own_stream(method):
    """Run a backend method with this backend's device and stream current: its allocations,
    fills (poisoned outputs) and copies then queue in order with its kernels, even when
    another backend's stream is current in the calling thread."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.device, self.stream:
            return method(self, *args, **kwargs)
    return wrapper


for _name in ("weight", "load", "to_numpy", "quantize_q8_1", "matmul", "matmul_many", "matmul_id",
              "embed", "rms_norm", "add", "mul", "scale", "swiglu", "geglu", "rope", "kv_store",
              "attention", "softmax", "topk", "argmax", "weighted_sum", "take_rows", "add_rms_norm",
              "rope_store", "ffn_glu", "moe_route", "moe_ffn", "decode_set", "decode_advance",
              "sigmoid", "softplus", "silu", "ssm_conv", "gated_delta_net", "attention_rows",
              "gated_delta_net_chunked",
              "rope_store_rows", "rope_ff", "tanh", "softcap", "mul_expert_scale", "moe_norms"):
    setattr(CudaBackend, _name, _on_own_stream(getattr(CudaBackend, _name)))
del _name
