"""The CUDA backend: the op surface of engine/backends/base.py on one GPU, with CuPy arrays
and the NVRTC kernels under kernels/.

This module is the op surface and its dispatch (which path an op takes); each kernel family's
launches are in the module named after its source, as ggml-cuda pairs its launchers with its
kernels: matvec.py (matvec_q.cu, matvec_f.cu), mmq.py (prompt GEMMs: dequant.cu and cuBLAS;
a MoE prompt's int8 tiles, mmq.cu), attention.py (attention.cu, attention_tiled.py), fused.py,
norm.py, rope.py, elementwise.py, router.py, ssm.py (ssm.cu, delta_chunked.cu), quantize.py,
get_rows.py; graphs.py captures and replays CUDA graphs.

- Device: the most capable visible GPU, or `device=` / the BRASS_DEVICE setting (device.py).
- Kernels: compiled on first use for this GPU's architecture, cached on disk (compiler.py).
  Every launch goes through CudaBackend.launch and has one shape: buffers first, then one
  by-value parameter struct (kernels/params.cuh).
- Stream: one per backend (non-blocking: it does not wait for the legacy default stream, nor
  it for it), current inside activate() and the backend's methods, so that CuPy's own array
  operations in the architecture code (reshape, sum, divide) queue behind our kernels in order.
  Outside them the thread's stream is the legacy one (CuPy's `with stream` puts back the stack's
  top on exit, whatever `use()` set): to_numpy() first makes its copy wait for work queued
  there. Nothing here synchronises with the host except to_numpy() and synchronize();
  positions stay on the device, so a decode step can be captured in a CUDA graph.
- Weights: streamed tensor by tensor from the file through a fixed pinned staging buffer,
  so the host never holds more than that buffer of weight data, and stay on the device in
  their quantized form.
- Options (options.py): the choices between two code paths the backend keeps, each at the
  default the GPU suite runs; `debug` compiles kernels with line info and checks the stream
  after every launch, so that a failing kernel is named where it fails.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict, deque
from contextlib import contextmanager

import cupy
import numpy as np
from cupy_backends.cuda.api.driver import CUDADriverError

from ... import flags, quants
from ...errors import BrassError, UnsupportedError
from ...gguf import GGMLType
from ..base import Backend, uses_f16_gemm, uses_mmq_id
from . import (attention, elementwise, fused, get_rows, graphs, matvec, mmq, norm, pdl, quantize, rope,
               router, ssm)
from .common import F32, SUPPORTED_TYPES, CudaWeight, f32, i32
from .compiler import DEFAULT_SMEM, Kernels
from .device import choose_device
from .errors import CudaError
from .options import CudaOptions

STAGING_BYTES = 32 << 20     # per pinned staging buffer (two of them) for weight uploads
FAMILIES = (quantize, get_rows, matvec, mmq, norm, rope, attention, elementwise, router, fused, ssm)


def launched_kernels() -> list[tuple[str, str]]:
    """Every (source, kernel) this backend launches; CI checks that each compiles and exists."""
    return [k for family in FAMILIES for k in family.launched_kernels()]


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
        self.smem_optin_limit = int(props.get("sharedMemPerBlockOptin", DEFAULT_SMEM))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.kernels = Kernels(self.cc, self.options.debug)
        # Tests fill every output with NaN (ints with -1) before the kernel runs, so that an
        # element a kernel fails to write cannot pass for a stale right answer.
        self.poison_outputs = poison_outputs
        self._staging = None
        # Q8_1 blocks of recent activations, written by the kernel that produced them
        # (quantize.py: remember, activations)
        self._q8 = OrderedDict()
        self.launches = 0           # kernels launched (or captured) so far, by launch()
        self._gemm_scratch = None    # float16 weights dequantized for the prompt GEMMs (mmq.py)
        self._split_scratch = None   # the split-K attention kernels' scratch (attention.py)
        self._plan = None           # (ids array, routing plan) of the last prompt MoE layer
        self._own_blas = None       # blas.Handle, made on first use (options.own_cublas)
        self._id_plan = None        # (ids array, experts, device plan) of mmq_id (options.moe_mmq)
        self._row_tables: dict = {}  # block tables of batched steps' rows (attention.py row_tables)
        self._row_step = 0           # batched steps begun (rows_independent): when to gather them
        self._graph_refs: list | None = None   # arrays a graph being captured reads (capture)
        # While a bucket graph of batched steps is captured (engine/batch.py BucketStep): a
        # function giving, for a layer's rows, the graph's own device block tables of its rows
        # (rewritten before each replay), their stride, and the capacity that bounds every
        # row's sequence.
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
            # the delta-net kernels' count of real rows when every row is (ssm.py real_rows)
            self._all_rows = cupy.full(1, np.iinfo(np.int32).max, np.int32)
        self._gemm_scalars = (np.ones(1, F32), np.zeros(1, F32))   # alpha, beta (host pointers)

    @property
    def row_tables(self) -> bool:
        return self.options.row_kernels

    # Keys and values live in block pools (engine/kv_cache.py BlockPool, PagedKVCache): every
    # kernel reads and writes them through a sequence's block table (kernels/common.cuh).
    paged_kv = True

    def block_table(self, n: int):
        """A sequence's device block table of n entries, all -1 (no block yet)."""
        with self.activate():
            return cupy.full(n, -1, np.int32)

    def write_block_table(self, table, blocks):
        """Rewrite device block table `table` in place: `blocks`, then -1 (queued on this
        backend's stream: kernels and graph replays queued after it read the new table)."""
        host = np.full(table.shape[0], -1, np.int32)
        host[:len(blocks)] = blocks
        # from pageable memory: the call returns once `host` has been read (staged)
        with self.activate():
            cupy.cuda.runtime.memcpyAsync(table.data.ptr, host.ctypes.data, host.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    @contextmanager
    def rows_independent(self):
        # a batched step begins: its rows' block tables are gathered again (attention.py)
        self._row_step += 1
        with super().rows_independent():
            yield

    def _one_pool(self, layers) -> bool:
        """Whether a batched step's rows' sequences are in one pool pair (the row kernels need
        that; rows of sessions with pools of their own are taken one at a time)."""
        k0, v0 = layers[0]
        return all(getattr(k, "pool", None) is getattr(k0, "pool", 0)
                   and getattr(v, "pool", None) is getattr(v0, "pool", 0) for k, v in layers)

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
    @staticmethod
    def tensor_info(gf, name):
        """The file's record of tensor `name`; one-line errors where it is missing or of a type
        this backend's kernels do not take."""
        info = gf.tensors.get(name)
        if info is None:
            raise BrassError(f"{gf.path}: no tensor {name}")
        if info.type not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{name}: tensor type {info.type.name} is not supported by the "
                                   f"cuda backend ({', '.join(t.name for t in SUPPORTED_TYPES)})")
        return info

    def weight(self, gf, name):
        info = self.tensor_info(gf, name)
        shape = tuple(reversed(info.shape))
        if len(shape) == 1:
            # Norm weights and biases: small, used as float32 by elementwise kernels.
            dense = quants.dequantize(gf.tensor_bytes(name), info.type, info.shape)
            return CudaWeight(name, info.type, shape, dense=cupy.asarray(dense))
        return CudaWeight(name, info.type, shape, data=self._upload(gf.path, info.offset, info.nbytes))

    def _staging_buffers(self) -> list:
        """The two pinned staging buffers of weight uploads: (memory, its bytes, the event of
        the last copy out of it), made on first use."""
        if self._staging is None:
            mems = [cupy.cuda.alloc_pinned_memory(STAGING_BYTES) for _ in range(2)]
            self._staging = [(m, np.frombuffer(m, np.uint8, STAGING_BYTES), cupy.cuda.Event())
                             for m in mems]
            for _, _, ev in self._staging:
                ev.record(self.stream)
        return self._staging

    def _upload(self, path, offset: int, nbytes: int):
        """Copy file bytes [offset, offset + nbytes) to a new device buffer through two pinned
        staging buffers, reading one while the other is in flight."""
        self._staging_buffers()
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

    def load(self, gf, weights, quiet: bool = False, names=None):
        """Upload every tensor of the file (or those in `names`: a layer split's stage) now
        instead of on first use, one at a time."""
        names = list(gf.tensors) if names is None else list(names)
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
        # `a` may have been made on the caller's stream (CuPy work outside activate(): the
        # legacy stream), which this non-blocking stream does not wait for: unordered, the copy
        # could read `a` before the kernel writing it ran (seen on the GPU runner with another
        # process on the GPU, test_batch.py's caches read back). Read before this stream is
        # made current, so not a method wrapped by _on_own_stream; and on this backend's
        # device (a new thread's current device is 0, whose stream is not the one to wait on).
        with self.device:
            caller = cupy.cuda.get_current_stream()
            with self.stream:
                if caller.ptr != self.stream.ptr:
                    self.stream.wait_event(caller.record())
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

    def device_memory_used(self) -> int:
        """The device's used memory as the driver reports it (every process's, the CUDA
        context's, the pools' cached blocks): what nvidia-smi shows for the whole card."""
        with self.device:
            free, total = cupy.cuda.runtime.memGetInfo()
        return int(total - free)

    def free_memory(self) -> int:
        """The device's free memory as the driver reports it, and what this process's memory
        pool holds unused (cached blocks it would hand out again)."""
        with self.device:
            free, _ = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return int(free + pool.free_bytes())

    def drop_f16_weights(self) -> bool:
        return mmq.drop_f16_weights(self)

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
        return quantize.quantize_q8_1(self, x)

    def _decode_rows(self, n_rows: int) -> bool:
        """Whether n_rows activations take the single-token (decode) kernels: inside
        rows_independent (base) the rows of a batched decode step do (a mat-vec's blockIdx.y
        is the row; gate/up and the MoE experts the same), per row the same sums in the same
        order as a sequence decoded alone, whereas the prompt kernels (tiles, GEMMs) sum in
        another order."""
        return n_rows == 1 or (self._rows_independent and n_rows > 0)

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

    def matmul_many(self, x, ws):
        src = x
        x = f32(x, "matmul")
        for w in ws:
            matvec.check_matrix(x, w, "matmul", 2)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        T = x2.shape[0]
        ys = [self._out((T, w.shape[0]), F32) for w in ws]
        if self._decode_rows(T):
            matvec.decode(self, x2, ws, ys, src)
        elif T:
            mmq.prompt(self, x2, ws, ys, src)
        return [y.reshape(*lead, y.shape[-1]) for y in ys]

    def matmul_id(self, x, w, ids):
        x = f32(x, "matmul_id")
        matvec.check_matrix(x, w, "matmul_id", 3)
        ids = i32(ids, "matmul_id ids")
        if ids.ndim != 2:
            raise BrassError(f"matmul_id: ids must be [T, k], got shape {ids.shape}")
        T, k = ids.shape
        E, N, K = w.shape
        per_slot = x.ndim == 3
        if x.shape[:-1] != ((T, k) if per_slot else (T,)):
            raise BrassError(f"matmul_id: x of shape {x.shape} does not match ids of shape {ids.shape}")
        y = self._out((T, k, N), F32)
        tiles = T and k and not self._rows_independent and self.options.moe_mmq and uses_mmq_id(T, K, w.type)
        if tiles and mmq.tiles_take(self, T * k, E):
            mmq.matmul_id_tiles(self, x, w, ids, per_slot, y)
        elif T and k and not tiles and not self._rows_independent and uses_f16_gemm(T, K, w.type):
            mmq.matmul_id_gemm(self, x, w, ids, per_slot, y)
        elif T and k:
            matvec.matvec_id(self, x, w, ids, per_slot, y)
        return y

    def embed(self, table, ids):
        return get_rows.embed(self, table, ids)

    # -- elementwise ------------------------------------------------------------------------
    def rms_norm(self, x, w, eps):
        return norm.rms_norm(self, x, w, eps)

    def l2_norm(self, x, eps):
        return norm.l2_norm(self, x, eps)

    def rms_norm_gated(self, x, w, z, eps):
        return norm.rms_norm_gated(self, x, w, z, eps)

    def add(self, a, b):
        return elementwise.binary(self, "add", a, b)

    def mul(self, a, b):
        return elementwise.binary(self, "mul", a, b)

    def scale(self, x, s):
        return elementwise.with_scalar(self, "scale", x, s)

    def swiglu(self, gate, up):
        return elementwise.glu(self, "swiglu", gate, up)

    def geglu(self, gate, up):
        return elementwise.glu(self, "geglu", gate, up)

    def rope(self, x, pos, n_rot, base, neox, freq_scale=1.0):
        return rope.rope(self, x, pos, n_rot, base, neox, freq_scale)

    def weighted_sum(self, y, w):
        return elementwise.weighted_sum(self, y, w)

    def take_rows(self, x, rows):
        return cupy.take(x, i32(rows, "take_rows rows"), axis=0)

    # -- attention ----------------------------------------------------------------------------
    def kv_store(self, cache, x, pos):
        attention.kv_store(self, cache, x, pos)

    def attention(self, q, k_cache, v_cache, pos, scale, window=0, row_caches=None):
        return attention.attention(self, q, k_cache, v_cache, pos, scale, window, row_caches)

    def attention_rows(self, q, layers, pos, scale, window=0):
        if len(layers) == 1:
            return self.attention(q, *layers[0], pos, scale, window)
        if not self.options.row_kernels or not self._one_pool(layers):
            return super().attention_rows(q, layers, pos, scale, window)
        k0, v0 = layers[0]
        if q.shape[0] != len(layers):
            raise BrassError(f"attention_rows: {q.shape[0]} rows for {len(layers)} caches")
        return self.attention(q, k0, v0, pos, scale, window, row_caches=layers)

    # -- routing ----------------------------------------------------------------------------
    def softmax(self, x):
        return router.softmax(self, x)

    def topk(self, x, k):
        return router.topk(self, x, k)

    def argmax(self, x):
        return router.argmax(self, x)

    # -- fused ops (base.py defines each by the ops it replaces) --------------------------------
    def add_rms_norm(self, a, b, w, eps, scale=None):
        return fused.add_rms_norm(self, a, b, w, eps, scale)

    def moe_norms(self, x, w, w_router, factor, eps):
        return fused.moe_norms(self, x, w, w_router, factor, eps)

    def rope_store(self, q, k, v, pos, k_cache, v_cache, *, q_norm, k_norm, eps, n_rot, base, neox,
                   freq_scale=1.0, row_caches=None):
        return fused.rope_store(self, q, k, v, pos, k_cache, v_cache, q_norm=q_norm, k_norm=k_norm, eps=eps,
                                n_rot=n_rot, base=base, neox=neox, freq_scale=freq_scale, row_caches=row_caches)

    def rope_store_rows(self, q, k, v, pos, layers, **kw):
        if len(layers) == 1:
            return self.rope_store(q, k, v, pos, *layers[0], **kw)
        if not self.options.row_kernels or not self._one_pool(layers):
            return super().rope_store_rows(q, k, v, pos, layers, **kw)
        if q.shape[0] != len(layers):
            raise BrassError(f"rope_store_rows: {q.shape[0]} rows for {len(layers)} caches")
        return self.rope_store(q, k, v, pos, *layers[0], row_caches=layers, **kw)

    def ffn_glu(self, x, w_gate, w_up, gelu=False):
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        if not self._decode_rows(rows) and len(w_gate.shape) == len(w_up.shape) == 2:
            # a prompt: Backend.ffn_glu's two mat-muls as one matmul_many (x converted or
            # quantized once for both), then the gated activation
            up, gate = self.matmul_many(x, [w_up, w_gate])
            return self.geglu(gate, up) if gelu else self.swiglu(gate, up)
        if not self._decode_rows(rows) or not matvec.fusable(w_gate, w_up) or len(w_gate.shape) != 2:
            return super().ffn_glu(x, w_gate, w_up, gelu)
        return matvec.ffn_glu(self, x, w_gate, w_up, gelu)

    def moe_route(self, logits, k, norm, scale):
        return fused.moe_route(self, logits, k, norm, scale)

    def fuses_moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, down_scale=None) -> bool:
        """Whether moe_ffn runs these operands as the two fused decode kernels rather than
        Backend.moe_ffn's composition (matvec.fuses_moe_ffn)."""
        return matvec.fuses_moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, down_scale)

    def moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, gelu=False, down_scale=None):
        x = f32(x, "moe_ffn")
        ids = i32(ids, "moe_ffn ids")
        weights = f32(weights, "moe_ffn weights")
        if not self.fuses_moe_ffn(x, w_gate, w_up, w_down, ids, weights, down_scale):
            return super().moe_ffn(x, w_gate, w_up, w_down, ids, weights, gelu, down_scale)
        return matvec.moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, gelu, down_scale)

    # -- gated delta-net (hybrid models) -------------------------------------------------------
    def sigmoid(self, x):
        return ssm.unary(self, x, "sigmoid")

    def sigmoid_gate(self, x, gate):
        y = elementwise.sigmoid_gate(self, x, gate)
        return super().sigmoid_gate(x, gate) if y is None else y

    def gated_residual(self, a, x, gate):
        y = elementwise.sigmoid_gate(self, x, gate, a)
        return super().gated_residual(a, x, gate) if y is None else y

    def softplus(self, x):
        return ssm.unary(self, x, "softplus")

    def silu(self, x):
        return ssm.unary(self, x, "silu")

    def ssm_conv(self, x, conv_state, w, n_real=None):
        return ssm.ssm_conv(self, x, conv_state, w, n_real)

    def ssm_conv_silu(self, x, conv_state, w, n_real=None):
        return ssm.ssm_conv(self, x, conv_state, w, n_real, silu=True)

    def delta_net_gates(self, beta, alpha, dt_bias, a):
        return ssm.delta_net_gates(self, beta, alpha, dt_bias, a)

    def gated_delta_net(self, q, k, v, g, beta, state, n_real=None):
        return ssm.gated_delta_net(self, q, k, v, g, beta, state, n_real)

    def gated_delta_net_chunked(self, q, k, v, g, beta, state, n_real=None):
        """gated_delta_net by the chunked kernel whatever the option and T say (the tests call
        it directly)."""
        return ssm.gated_delta_net_chunked(self, q, k, v, g, beta, state, n_real)

    # -- gemma4 -------------------------------------------------------------------------------
    def rope_ff(self, x, pos, n_rot, base, neox, freq_factors, freq_scale=1.0):
        return rope.rope(self, x, pos, n_rot, base, neox, freq_scale, freq_factors)

    def tanh(self, x):
        return elementwise.tanh(self, x)

    def softcap(self, x, cap):
        # One kernel for Backend.softcap's scale, tanh and scale, rounded as those are.
        cap = float(np.float32(cap))
        if not (np.isfinite(cap) and cap != 0.0):
            raise BrassError(f"softcap: the cap must be finite and nonzero, got {cap}")
        return elementwise.with_scalar(self, "softcap", x, cap)

    def mul_expert_scale(self, y, s, ids):
        return elementwise.mul_expert_scale(self, y, s, ids)

    # -- decoding on the device -----------------------------------------------------------------
    supports_graphs = True

    def decode_set(self, tok, pos, token: int, position: int):
        """tok[0] = token, pos[0] = position, queued on the stream (as launch parameters)."""
        fused.decode_set(self, tok, pos, token, position)

    def decode_advance(self, next_ids, tok, pos, history):
        """Greedy step on the device: tok = next_ids[0], pos += 1, history[pos] = tok."""
        fused.decode_advance(self, next_ids, tok, pos, history)

    def capture(self, fn, reuse_freed: bool = False):
        """Record the kernels `fn()` queues on this backend's stream as a CUDA graph (graphs.py)."""
        return graphs.capture(self, fn, reuse_freed)


def _on_own_stream(method):
    """Run a backend method with this backend's device and stream current: its allocations,
    fills (poisoned outputs) and copies then queue in order with its kernels, even when
    another backend's stream is current in the calling thread."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.device, self.stream:
            return method(self, *args, **kwargs)
    wrapper.on_own_stream = True
    return wrapper


# The methods that order themselves against this backend's stream (activate() inside, an
# explicit stream argument, or the legacy stream waited on first: to_numpy), the context
# managers that make it current, launch (called inside the ops), and host-side queries. Every
# other public method is an op and runs with the stream current, those inherited from
# Backend (its compositions) included: a new op is wrapped without being listed. A hand list
# of ops once missed three fused ones, whose poisoned outputs (a fill on the caller's stream)
# then raced their kernels in the GPU tests.
ORDERS_ITSELF = frozenset({
    "activate", "timer", "rows_independent", "capture", "launch", "synchronize",
    "asarray", "to_numpy", "empty", "zeros", "block_table", "write_block_table",
    "upload_async", "copy_to_host_async", "pinned_empty",
    "device_memory_used", "free_memory", "drop_f16_weights", "fuses_moe_ffn",
})


def stream_ops(cls) -> list[str]:
    """The public methods of `cls` (its own and inherited) that _on_own_stream wraps."""
    names = []
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name)
        if not name.startswith("_") and name not in ORDERS_ITSELF and inspect.isfunction(attr):
            names.append(name)
    return names


for _name in stream_ops(CudaBackend):
    setattr(CudaBackend, _name, _on_own_stream(getattr(CudaBackend, _name)))
del _name
