"""The CUDA backend: the op surface of engine/backends/base.py on one GPU, with CuPy arrays
and the NVRTC kernels under kernels/.

- Device: the most capable visible GPU, or BRASS_DEVICE / `device=` (device.py).
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
- Debug (BRASS_CUDA_DEBUG=1): kernels compiled with line info, and the stream checked after
  every launch, so a failing kernel is named where it fails.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import cupy
import numpy as np
from cupy_backends.cuda.api.driver import CUDADriverError

from kernels.params import pack

from ... import quants
from ...errors import BrassError, UnsupportedError
from ...gguf import BLOCK_SIZES, GGMLType
from ..base import Backend, Weight
from .compiler import compile_source, target_for
from .device import choose_device
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
QUANTIZE_THREADS = 256
GET_ROWS_THREADS = 256
NORM_THREADS = 256
ROPE_THREADS = 128
EW_THREADS = 256
KV_STORE_THREADS = 256
ATTN_THREADS = 128
ROW_THREADS = 256
Q8_1_BLOCK_BYTES = 36

STAGING_BYTES = 32 << 20     # per pinned staging buffer (two of them) for weight uploads
_DEFAULT_SMEM = 48 << 10     # shared memory a kernel may use without opting in


def launched_kernels() -> list[tuple[str, str]]:
    """Every (source, kernel) this backend launches; CI checks that each compiles and exists."""
    ks = [("quantize.cu", "quantize_q8_1")]
    for t, n in _TYPE_NAMES.items():
        src = "matvec_f.cu" if t in FLOAT_TYPES else "matvec_q.cu"
        ks += [(src, f"matvec_{n}"), (src, f"matmul_{n}"), (src, f"matvec_id_{n}"),
               ("get_rows.cu", f"get_rows_{n}")]
    ks += [("norm.cu", "rms_norm"), ("rope.cu", "rope"), ("attention.cu", "kv_store"),
           ("attention.cu", "attention")]
    ks += [("elementwise.cu", k) for k in ("add", "mul", "scale", "swiglu", "geglu", "weighted_sum")]
    ks += [("router.cu", k) for k in ("softmax", "topk", "argmax")]
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

    def allow_smem(self, source: str, name: str, nbytes: int, limit: int):
        """Opt the kernel in to `nbytes` of dynamic shared memory when that exceeds 48 KiB."""
        if nbytes <= _DEFAULT_SMEM or self._smem_optin.get((source, name), 0) >= nbytes:
            return
        if nbytes > limit:
            raise UnsupportedError(f"kernel {name} would need {nbytes} bytes of shared memory; "
                                   f"this GPU allows {limit}")
        from cupy_backends.cuda.api import driver
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
        driver.funcSetAttribute(self.get(source, name).ptr,
                                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        self._smem_optin[(source, name)] = nbytes


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


def _grid_1d(n: int, threads: int, cap: int = 65535 * 8) -> int:
    return max(1, min(cap, -(-n // threads)))


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int | str | None = None, debug: bool | None = None,
                 poison_outputs: bool = False):
        self.device_id = choose_device(device)
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        props = cupy.cuda.runtime.getDeviceProperties(self.device_id)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self.cc = int(props["major"]) * 10 + int(props["minor"])
        self.smem_optin_limit = int(props.get("sharedMemPerBlockOptin", _DEFAULT_SMEM))
        self.debug = os.environ.get("BRASS_CUDA_DEBUG", "") not in ("", "0") if debug is None else debug
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.kernels = _Kernels(self.cc, self.debug)
        # Tests fill every output with NaN (ints with -1) before the kernel runs, so that an
        # element a kernel fails to write cannot pass for a stale right answer.
        self.poison_outputs = poison_outputs
        self._staging = None

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
        (kernels.params.pack)."""
        if not (isinstance(params, np.ndarray) and params.dtype.names and params.size == 1):
            raise TypeError(f"{name}: the last kernel argument must be a parameter struct")
        fn = self.kernels.get(source, name)
        if smem:
            self.kernels.allow_smem(source, name, smem, self.smem_optin_limit)
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        try:
            fn(grid, (int(block),), (*buffers, params), shared_mem=int(smem), stream=self.stream)
        except (cupy.cuda.runtime.CUDARuntimeError, CUDADriverError) as e:
            raise CudaError(f"kernel {name} (kernels/{source}) did not launch: {e}") from None
        if self.debug:
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
        with self.activate():
            return cupy.empty(shape, dtype)

    def zeros(self, shape, dtype=F32):
        with self.activate():
            return cupy.zeros(shape, dtype)

    def synchronize(self):
        self.stream.synchronize()

    # -- linear algebra ---------------------------------------------------------------------
    def quantize_q8_1(self, x):
        """Rows of x [R, K] (K a multiple of 32) → Q8_1 blocks, [R, K/32 * 36] bytes."""
        R, K = x.shape
        y = self._out((R, K // 32 * Q8_1_BLOCK_BYTES), np.uint8)
        self.launch("quantize.cu", "quantize_q8_1", _grid_1d(R * K, QUANTIZE_THREADS, 1 << 30),
                    QUANTIZE_THREADS, x, y, params=pack("QuantizeParams", n_rows=R, k=K))
        return y

    def _activations(self, x, w: CudaWeight):
        """What the mat-vec kernel of w's type reads: x itself, or x as Q8_1 blocks."""
        return x if w.type in FLOAT_TYPES else self.quantize_q8_1(x)

    def _check_matrix(self, x, w, what: str, ndim: int):
        if not isinstance(w, CudaWeight) or len(w.shape) != ndim:
            raise BrassError(f"{what}: expected a {ndim}-D weight, got "
                             f"{getattr(w, 'shape', type(w).__name__)}")
        if x.shape[-1] != w.shape[-1]:
            raise BrassError(f"{what}: input has {x.shape[-1]} features but {w.name} "
                             f"expects {w.shape[-1]}")

    def matmul(self, x, w):
        x = _f32(x, "matmul")
        self._check_matrix(x, w, "matmul", 2)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        T, (N, K) = x2.shape[0], w.shape
        y = self._out((T, N), F32)
        if T:
            xa = self._activations(x2, w)
            params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=1, row_bytes=w.row_bytes,
                          expert_bytes=0, x_per_slot=0, n_experts=1)
            src = "matvec_f.cu" if w.type in FLOAT_TYPES else "matvec_q.cu"
            tname = _TYPE_NAMES[w.type]
            if T == 1:
                self.launch(src, f"matvec_{tname}", (N, 1), MATVEC_THREADS, w.data, xa, y, params=params)
            else:
                self.launch(src, f"matmul_{tname}", (N, -(-T // MATMUL_TILE)), MATVEC_THREADS,
                            w.data, xa, y, params=params)
        return y.reshape(*lead, N)

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
        if T and k:
            xa = self._activations(x.reshape(-1, K), w)
            params = pack("MatVecParams", n_rows=N, k=K, n_tokens=T, n_used=k, row_bytes=w.row_bytes,
                          expert_bytes=N * w.row_bytes, x_per_slot=int(per_slot), n_experts=E)
            src = "matvec_f.cu" if w.type in FLOAT_TYPES else "matvec_q.cu"
            self.launch(src, f"matvec_id_{_TYPE_NAMES[w.type]}", (N, T * k), MATVEC_THREADS,
                        w.data, xa, ids, y, params=params)
        return y

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
        x = _f32(x, "scale")
        y = self._out(x.shape)
        if x.size:
            self.launch("elementwise.cu", "scale", _grid_1d(x.size, EW_THREADS), EW_THREADS, x, y,
                        params=pack("ScaleParams", n=x.size, s=s))
        return y

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
        x = _f32(x, "rope")
        pos = _i32(pos, "rope pos")
        if x.ndim != 3 or pos.shape != (x.shape[0],):
            raise BrassError(f"rope: expected x [T, H, Dh] and pos [T], got {x.shape} and {pos.shape}")
        T, H, Dh = x.shape
        if n_rot % 2 or not 0 < n_rot <= Dh:
            raise BrassError(f"rope: n_rot {n_rot} must be even and in (0, {Dh}]")
        # ggml's theta_scale, rounded to float32 the way the numpy reference rounds it.
        theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
        y = self._out(x.shape)
        n_threads = n_rot // 2 + (Dh - n_rot)
        if T:
            self.launch("rope.cu", "rope", (-(-n_threads // ROPE_THREADS), H, T), ROPE_THREADS, x, pos, y,
                        params=pack("RopeParams", n_tokens=T, n_heads=H, head_dim=Dh, n_rot=n_rot,
                                    theta_scale=theta_scale, freq_scale=freq_scale, neox=int(bool(neox))))
        return y

    def kv_store(self, cache, x, pos):
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

    def attention(self, q, k_cache, v_cache, pos, scale, window=0):
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
        n_slots = min(cap, window) if window > 0 else cap
        out = self._out((T, H * Dv), F32)
        if T:
            smem = 4 * (Dh + n_slots)
            self.launch("attention.cu", "attention", (H, T), ATTN_THREADS, q, k_cache, v_cache, pos, out,
                        params=pack("AttentionParams", n_tokens=T, n_heads=H, n_kv_heads=Hkv, head_dim=Dh,
                                    head_dim_v=Dv, capacity=cap, n_slots=n_slots, window=max(0, window),
                                    scale=scale),
                        smem=smem)
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
        if R:
            self.launch("router.cu", "argmax", R, ROW_THREADS, x, ids,
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


def _on_own_stream(method):
    """Run a backend method with this backend's device and stream current: its allocations,
    fills (poisoned outputs) and copies then queue in order with its kernels, even when
    another backend's stream is current in the calling thread."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.device, self.stream:
            return method(self, *args, **kwargs)
    return wrapper


for _name in ("weight", "load", "to_numpy", "quantize_q8_1", "matmul", "matmul_id", "embed",
              "rms_norm", "add", "mul", "scale", "swiglu", "geglu", "rope", "kv_store",
              "attention", "softmax", "topk", "argmax", "weighted_sum", "take_rows"):
    setattr(CudaBackend, _name, _on_own_stream(getattr(CudaBackend, _name)))
del _name
