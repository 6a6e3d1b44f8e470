"""A stand-in for the parts of CuPy (and cupy_backends) that the CUDA backend uses, backed by
numpy on the CPU, which records what would be sent to the GPU instead of sending it: the CUDA
backend then runs a model's steps on a machine without a GPU (or without CuPy), and what it
launches can be compared with a recording (launch_recording.py).

What it is:

- Device memory is host memory: every allocation is a numpy buffer aligned to 512 bytes (as
  CuPy's pool aligns), zero-filled, kept alive for the fake's life so that an address always
  names one allocation; "device pointers" are the buffers' host addresses, so copies
  (memcpyAsync) and views (`ptr + offset`, UnownedMemory) work on them as on the GPU.
  Arrays are `ndarray`, a numpy subclass whose `.data` is a MemoryPointer as CuPy's is.
- One device, an H100 SXM: 132 SMs, compute capability 9.0, 227 KiB of shared memory a block
  (opt-in), 80 GB (79 GiB free).
- Kernels do not run. NVRTC does not compile (a fake binding answers, so no cubin exists):
  a module "loads" the name of the source it was built from; the static shared memory of a
  kernel reads as 0 and its __launch_bounds__ cannot be read (an error says so: only the
  split mat-vecs ask, for rows of >= 8192 values). Outputs keep the zeros they were allocated
  with: where the host reads device values to decide something (a greedy token, a prompt's
  expert routing planned on the host), it reads zeros, deterministically. A launch whose grid
  or block is past CUDA's bounds (y and z at most 65,535 blocks) is refused, as on the GPU.
- Streams, events and graphs: a capture records its begin and end; the kernels launched
  meanwhile are recorded once; a graph's launch (replay) is recorded, nothing reruns. As on
  the GPU, synchronising (a stream or event, asnumpy) while a stream captures raises
  CUDARuntimeError (cudaErrorStreamCaptureUnsupported); so does a copy between host and device
  memory (memcpyAsync, asarray of host data: a block table written, an input uploaded).
- cuBLAS: the backend's own handle (engine/backends/cuda/blas.py) gets a fake library
  (`FakeCublasLib`) and CuPy's binding a fake module; both record each GEMM.
- Programmatic dependent launch: a fake cuLaunchKernelEx (`fake_launch_kernel_ex`) reads the
  launch configuration the backend's pdl.py builds.

What is recorded (`Recorder.events`, dicts): each kernel launch that reaches a Function call
or cuLaunchKernelEx (completing the entry the caller opened, see launch_recording.py); each
GEMM; each host<->device copy (memcpyAsync, asarray of host data, asnumpy); CuPy's own array
work on device arrays that would launch CuPy kernels (ufuncs and reductions, fills and
copies by item assignment, gathers by fancy indexing, copy(), astype(), take, concatenate, add,
multiply, ascontiguousarray that copies); capture begins and ends and graph launches; kernel
attribute opt-ins. Device arrays are described by label, dtype and shape, never by address.
What it cannot see: what no call here reaches (numpy, not CuPy, reshapes a non-contiguous
array, so a copy CuPy would launch there is not recorded; a CuPy function or attribute the fake
lacks fails loudly with AttributeError rather than passing unseen), the kernels themselves
(what they read and write, out-of-bounds accesses, their static shared memory, hence whether a
launch just under 48 KiB of dynamic shared memory would need the opt-in), timing, and the memory
a capture's pool reuses (the fake pool never reuses: a graph's size is the sum of what its
capture allocated, not its peak; it decides only against BRASS_PROMPT_GRAPHS_MB, far away for
the synthetic models).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import types
from contextlib import contextmanager

import numpy as np

ALIGN = 512
DEVICE_PROPERTIES = {
    "name": "NVIDIA H100 80GB HBM3",
    "multiProcessorCount": 132,
    "major": 9,
    "minor": 0,
    "sharedMemPerBlockOptin": 232448,         # 227 KiB
    "sharedMemPerBlock": 49152,
    "sharedMemPerMultiprocessor": 233472,
    "totalGlobalMem": 80 * 10**9,
    "maxThreadsPerBlock": 1024,
    "warpSize": 32,
    "regsPerBlock": 65536,
    "l2CacheSize": 50 * 2**20,
}
FREE_BYTES = 79 * 2**30
# CUDA's bounds on a launch: grid x, then y and z (each); threads a block
MAX_GRID = (2**31 - 1, 65535)
MAX_BLOCK_THREADS = 1024


class CUDARuntimeError(RuntimeError):
    pass


class CUDADriverError(RuntimeError):
    pass


class OutOfMemoryError(MemoryError):
    pass


class NVRTCError(RuntimeError):
    pass


class Recorder:
    """The events of one run, and the labels of the allocations they name."""

    def __init__(self):
        self.events: list[dict] = []
        self.on = False                 # record only between start() and stop()
        self.capturing = False
        self.graphs = 0
        self.pending: list[dict] = []   # launch entries opened above the fake, awaiting a launch
        self._starts: list[int] = []    # allocations by start address (sorted)
        self._allocs: dict[int, tuple[int, object, str]] = {}  # start -> (size, owner, kind)
        self._labels: dict[int, str] = {}    # start -> label, given at first sight
        self._names: dict[int, str] = {}     # start -> name given by the caller
        self._next_label = 0

    # -- allocations ----------------------------------------------------------------------
    def register(self, start: int, size: int, owner, kind: str = "device"):
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            return
        self._starts.insert(i, start)
        self._allocs[start] = (max(size, 1), owner, kind)

    def find(self, ptr: int):
        """(start, size, owner, kind) of the allocation holding address ptr, or None."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            start = self._starts[i]
            size, owner, kind = self._allocs[start]
            if ptr < start + size:
                return start, size, owner, kind
        return None

    def alloc(self, nbytes: int, kind: str = "device") -> np.ndarray:
        """A zeroed uint8 buffer of nbytes at an address aligned to ALIGN, kept alive."""
        raw = np.zeros(max(nbytes, 1) + ALIGN, np.uint8)
        addr = raw.__array_interface__["data"][0]
        off = (-addr) % ALIGN
        buf = raw[off:off + max(nbytes, 1)]
        self.register(addr + off, max(nbytes, 1), buf, kind)
        return buf

    def name(self, arr, label: str):
        """Call the allocation holding array `arr` `label` in the events."""
        hit = self._locate(arr)
        if hit is not None:
            self._names[hit[0]] = label

    def _locate(self, arr):
        if arr is None or getattr(arr, "nbytes", 0) == 0:
            return None
        ptr = arr.__array_interface__["data"][0]
        hit = self.find(ptr)
        if hit is None:
            # an array numpy made (a ufunc's result): its outermost base is the allocation
            root = arr
            while isinstance(getattr(root, "base", None), np.ndarray):
                root = root.base
            start = root.__array_interface__["data"][0]
            self.register(start, root.nbytes, root, "device")
            hit = self.find(ptr)
        return hit

    def label_ptr(self, ptr: int) -> str:
        if not self.on:
            return "-"              # nothing is recorded: no label is given
        hit = self.find(ptr)
        if hit is None:
            return "?"
        start, _, _, kind = hit
        label = self._labels.get(start)
        if label is None:
            label = self._names.get(start)
            if label is None:
                label = "pinned" if kind == "pinned" else f"t{self._next_label}"
                if kind != "pinned":
                    self._next_label += 1
            self._labels[start] = label
        off = ptr - start
        return f"{label}@{off}" if off else label

    def desc(self, a) -> object:
        """How an argument appears in the events: a device array by label, dtype and shape;
        a host array by dtype and shape; a scalar as itself."""
        if isinstance(a, ndarray):
            shape = "x".join(map(str, a.shape))
            if a.nbytes == 0:
                return f"(empty):{a.dtype}[{shape}]"
            self._locate(a)
            return f"{self.label_ptr(a.__array_interface__['data'][0])}:{a.dtype}[{shape}]"
        if isinstance(a, np.ndarray):
            return f"host:{a.dtype}[{'x'.join(map(str, a.shape))}]"
        if isinstance(a, (np.generic,)):
            return a.item()
        if isinstance(a, (int, float, bool, str)) or a is None:
            return a
        if isinstance(a, slice):
            return f"{'' if a.start is None else a.start}:{'' if a.stop is None else a.stop}" + \
                ("" if a.step is None else f":{a.step}")
        if a is Ellipsis:
            return "..."
        if isinstance(a, (tuple, list)):
            return [self.desc(x) for x in a]
        if isinstance(a, np.dtype) or isinstance(a, type):
            return str(np.dtype(a))
        return type(a).__name__

    # -- events ---------------------------------------------------------------------------
    def event(self, **e):
        if self.on:
            self.events.append(e)
        return e

    def cupy_op(self, fn: str, *args, **kw):
        if self.on:
            e = {"op": "cupy", "fn": fn, "args": [self.desc(a) for a in args]}
            for k, v in kw.items():
                if v is not None:
                    e[k] = self.desc(v)
            self.events.append(e)

    def check_not_capturing(self, what: str):
        if self.capturing:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} while a stream captures "
                                   "(operation not permitted when stream is capturing)")

    def kernel_launched(self, fn, grid, block, smem: int, pdl: bool, args=None):
        """A launch reached the fake driver: complete the entry open above (launch_recording's
        CudaBackend.launch), or record one of its own when nothing opened one. A grid or block
        past CUDA's bounds is refused as the driver refuses it."""
        grid = [int(g) for g in grid] + [1] * (3 - len(grid))
        block = [int(b) for b in block] + [1] * (3 - len(block))
        if not (1 <= grid[0] <= MAX_GRID[0] and all(1 <= g <= MAX_GRID[1] for g in grid[1:])
                and all(b >= 1 for b in block) and block[0] * block[1] * block[2] <= MAX_BLOCK_THREADS):
            raise CUDARuntimeError(f"cudaErrorInvalidValue: kernel {fn.name} launched with grid {grid}, block "
                                   f"{block} (at most {list(MAX_GRID) + [MAX_GRID[1]]} blocks, "
                                   f"{MAX_BLOCK_THREADS} threads a block)")
        if self.pending and "grid" not in self.pending[-1]:
            e = self.pending[-1]
            if e.get("kernel") != f"{fn.source}:{fn.name}":
                e["launched_kernel"] = f"{fn.source}:{fn.name}"
        else:
            e = self.event(op="launch", kernel=f"{fn.source}:{fn.name}", via="not CudaBackend.launch",
                           args=[self.desc(a) for a in (args or ())])
        e.update(grid=grid, block=block, smem=int(smem), pdl=bool(pdl))


# -- arrays ------------------------------------------------------------------------------

_REC: Recorder | None = None          # the recorder of the fake installed now


def _rec() -> Recorder:
    if _REC is None:
        raise RuntimeError("the fake CuPy is not installed (fake_cupy.install)")
    return _REC


def _plain(x):
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _plain_all(x):
    if isinstance(x, tuple):
        return tuple(_plain_all(v) for v in x)
    if isinstance(x, list):
        return [_plain_all(v) for v in x]
    return _plain(x)


def _advanced(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in keys)


class MemoryPointer:
    def __init__(self, mem, offset: int):
        self.mem, self.offset = mem, int(offset)
        self.ptr = mem.ptr + self.offset
        self.device_id = 0

    def __add__(self, n):
        return MemoryPointer(self.mem, self.offset + int(n))


class _ArrayPointer:
    """ndarray.data: where the array starts."""

    def __init__(self, arr):
        self.ptr = arr.__array_interface__["data"][0]
        self.device_id = 0
        self.mem = None


class ndarray(np.ndarray):
    """A "device" array: numpy memory from the fake's allocations. Construction as CuPy's
    (shape, dtype, memptr, strides) views existing memory."""

    def __new__(cls, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = np.dtype(dtype)
        if memptr is None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            memptr = _allocate(nbytes)
        buf, off = _buffer_at(memptr.ptr)
        return np.ndarray.__new__(cls, shape, dtype, buffer=buf, offset=off, strides=strides, order=order)

    @property
    def data(self):
        return _ArrayPointer(self)

    @property
    def device(self):
        return Device(0)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        rec = _rec()
        name = ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}"
        out = kwargs.get("out")
        rec.cupy_op(name, *inputs, out=out[0] if out else None,
                    **{k: v for k, v in kwargs.items() if k in ("axis", "keepdims", "dtype")})
        inputs = tuple(_plain(x) for x in inputs)
        if out:
            kwargs["out"] = tuple(_plain(o) for o in out)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        if isinstance(result, tuple):
            return tuple(_wrap(r) for r in result)
        return _wrap(result)

    def __setitem__(self, key, value):
        _rec().cupy_op("setitem", self, key, value)
        _plain(self)[_plain_all(key)] = _plain(value)

    def __getitem__(self, key):
        out = np.ndarray.__getitem__(self, key if not _advanced(key) else _plain_all(key))
        if _advanced(key):
            _rec().cupy_op("getitem", self, key)
            return _wrap(out)
        return out

    def copy(self, order="C"):
        _rec().cupy_op("copy", self)
        return _wrap(_plain(self).copy(order))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        _rec().cupy_op("astype", self, dtype=dtype)
        return _wrap(_plain(self).astype(dtype, order=order, casting=casting))

    def fill(self, value):
        _rec().cupy_op("fill", self, value)
        _plain(self).fill(value)

    def get(self, stream=None):
        return asnumpy(self, stream)


def _wrap(result):
    """A numpy result as a device array in memory of the fake's (so it has an address)."""
    if not isinstance(result, np.ndarray):
        return result
    out = ndarray(result.shape, result.dtype)
    np.copyto(_plain(out), result)
    return out


def _allocate(nbytes: int) -> MemoryPointer:
    alloc = _ALLOCATOR[-1]
    return alloc(nbytes) if alloc is not None else _DEFAULT_POOL.malloc(nbytes)


def _buffer_at(ptr: int):
    hit = _rec().find(ptr)
    if hit is None:
        raise ValueError(f"no allocation of the fake holds address {ptr:#x}")
    start, _, owner, _ = hit
    return owner, ptr - start


class Memory:
    def __init__(self, size: int):
        self.size = int(size)
        self.buf = _rec().alloc(self.size)
        self.ptr = self.buf.__array_interface__["data"][0]
        self.device_id = 0


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int = 0):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id


class MemoryPool:
    """CuPy's pool: malloc through `allocator` (a Memory each, never reused)."""

    def __init__(self, allocator=None):
        self._allocator = allocator
        self._used = 0

    def malloc(self, nbytes: int) -> MemoryPointer:
        self._used += nbytes
        if self._allocator is not None:
            return self._allocator(nbytes)
        return MemoryPointer(Memory(nbytes), 0)

    def free_all_blocks(self, stream=None):
        pass

    def used_bytes(self) -> int:
        return 0

    def free_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return self._used


_DEFAULT_POOL = MemoryPool()
_ALLOCATOR: list = [None]


@contextmanager
def using_allocator(allocator=None):
    _ALLOCATOR.append(allocator)
    try:
        yield
    finally:
        _ALLOCATOR.pop()


def get_default_memory_pool():
    return _DEFAULT_POOL


class PinnedMemory(np.ndarray):
    """alloc_pinned_memory's result: a host buffer (numpy's buffer protocol) with .ptr."""

    @property
    def ptr(self):
        return self.__array_interface__["data"][0]


def alloc_pinned_memory(nbytes: int):
    buf = _rec().alloc(nbytes, kind="pinned")
    return buf.view(PinnedMemory)


# -- array functions ---------------------------------------------------------------------

def empty(shape, dtype=float, order="C"):
    return ndarray(shape if isinstance(shape, tuple) else (shape,) if np.isscalar(shape) else tuple(shape), dtype)


def zeros(shape, dtype=float, order="C"):
    return empty(shape, dtype)          # every allocation is zeroed


def full(shape, fill_value, dtype=None):
    a = empty(shape, dtype if dtype is not None else np.array(fill_value).dtype)
    a.fill(fill_value)
    return a


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _rec().check_not_capturing("asarray of host data (an H2D copy)")
    host = np.asarray(a, dtype=dtype)
    out = empty(host.shape, host.dtype)
    np.copyto(_plain(out), host)
    _rec().event(op="upload", to=_rec().desc(out))
    return out


array = asarray


def ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray):
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        _rec().cupy_op("ascontiguousarray", a, dtype=dtype)
        return _wrap(np.ascontiguousarray(_plain(a), dtype=dtype))
    return asarray(np.ascontiguousarray(a, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None):
    rec = _rec()
    if isinstance(a, ndarray):
        rec.check_not_capturing("asnumpy (a copy the host waits for)")
        rec.event(op="download", array=rec.desc(a))
        return np.array(_plain(a), order=order)
    return np.asarray(a)


def take(a, indices, axis=None, out=None):
    _rec().cupy_op("take", a, indices, axis=axis)
    return _wrap(np.take(_plain(a), _plain(indices), axis=axis))


def concatenate(arrays, axis=0, out=None, dtype=None):
    arrays = list(arrays)
    _rec().cupy_op("concatenate", *arrays, axis=axis)
    return _wrap(np.concatenate([_plain(a) for a in arrays], axis=axis))


def add(a, b, dtype=None):
    return np.add(a, b, dtype=dtype)        # recorded by ndarray.__array_ufunc__


def multiply(a, b, dtype=None):
    return np.multiply(a, b, dtype=dtype)


# -- devices, streams, events, graphs ----------------------------------------------------

class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        self.compute_capability = f"{DEVICE_PROPERTIES['major']}{DEVICE_PROPERTIES['minor']}"

    def use(self):
        pass

    def synchronize(self):
        _rec().check_not_capturing("Device.synchronize")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Graph:
    def __init__(self, n: int):
        self.n = n

    def launch(self, stream=None):
        _rec().event(op="graph_launch", graph=self.n)

    def upload(self, stream=None):
        pass


class Stream:
    _next_ptr = 0x5000

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        Stream._next_ptr += 0x10
        self.ptr = 0 if null else Stream._next_ptr

    def use(self):
        _streams.current = self
        return self

    def synchronize(self):
        _rec().check_not_capturing("Stream.synchronize")

    def record(self, event=None):
        return event or Event()

    def wait_event(self, event):
        _rec().event(op="stream_wait", stream=self.ptr)

    def begin_capture(self, mode=None):
        rec = _rec()
        if rec.capturing:
            raise CUDARuntimeError("cudaErrorIllegalState: a capture is already in progress")
        rec.capturing = True
        rec.event(op="capture_begin")

    def end_capture(self):
        rec = _rec()
        rec.capturing = False
        rec.graphs += 1
        rec.event(op="capture_end", graph=rec.graphs)
        return Graph(rec.graphs)

    def is_capturing(self):
        return _rec().capturing

    def __enter__(self):
        _streams.stack.append(self)
        _streams.current = self
        return self

    def __exit__(self, *exc):
        # as CuPy 14's: the stack's new top becomes current, whatever use() had set
        _streams.stack.pop()
        _streams.current = _streams.stack[-1] if _streams.stack else NULL_STREAM
        return False


NULL_STREAM = Stream(null=True)


class _Streams(threading.local):
    """The thread's current stream and its stack of `with stream` blocks (CuPy's, per thread)."""

    def __init__(self):
        self.current = NULL_STREAM
        self.stack: list = []


_streams = _Streams()


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        _rec().check_not_capturing("Event.synchronize")

    @property
    def done(self):
        return True


def get_elapsed_time(start, end):
    return 0.0


# -- runtime and driver ------------------------------------------------------------------

def _memcpy_kind(n: int) -> str:
    return {0: "H2H", 1: "H2D", 2: "D2H", 3: "D2D", 4: "default"}.get(n, str(n))


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int):
    rec = _rec()
    if kind in (1, 2):
        # CUDA refuses a pageable buffer's copy in a capture; a pinned one's would be replayed
        # from (to) that buffer as it is at each replay, not the data given now: neither is meant
        rec.check_not_capturing(f"a {_memcpy_kind(kind)} copy (memcpyAsync)")
    rec.event(op="memcpy", kind=_memcpy_kind(kind), bytes=int(size), dst=rec.label_ptr(dst),
              src=rec.label_ptr(src))
    if size:
        ctypes.memmove(dst, src, size)


def memcpy(dst: int, src: int, size: int, kind: int):
    _rec().check_not_capturing("memcpy (synchronous)")
    memcpyAsync(dst, src, size, kind, 0)


def _runtime_module():
    m = types.ModuleType("cupy_backends.cuda.api.runtime")
    m.CUDARuntimeError = CUDARuntimeError
    m.getDeviceCount = lambda: 1
    m.getDeviceProperties = lambda i: dict(DEVICE_PROPERTIES)
    m.memGetInfo = lambda: (FREE_BYTES, DEVICE_PROPERTIES["totalGlobalMem"])
    m.memcpyAsync, m.memcpy = memcpyAsync, memcpy
    m.memcpyHostToHost, m.memcpyHostToDevice, m.memcpyDeviceToHost, m.memcpyDeviceToDevice = 0, 1, 2, 3
    m.memcpyDefault = 4
    m.CUDA_R_32F, m.CUDA_R_16F, m.CUDA_R_64F, m.CUDA_R_16BF = 0, 2, 1, 14
    m.CUDA_R_8I, m.CUDA_R_32I = 3, 10
    m.getDevice = lambda: 0
    m.deviceSynchronize = lambda: _rec().check_not_capturing("deviceSynchronize")
    return m


_FUNC_ATTR = {0: "max_threads_per_block", 1: "shared_size_bytes", 8: "max_dynamic_shared_size_bytes"}


def funcGetAttribute(attrib: int, func: int):
    fn = Function.by_ptr[func]
    if attrib == 1:           # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: no cubin, none known
        return 0
    raise NotImplementedError(
        f"the fake CuPy compiles nothing, so it cannot answer attribute {_FUNC_ATTR.get(attrib, attrib)} of "
        f"kernel {fn.name} (kernels/{fn.source}); extend conformance/harness/fake_cupy.py if a recorded path needs it")


def funcSetAttribute(func: int, attrib: int, value: int):
    fn = Function.by_ptr[func]
    _rec().event(op="func_attribute", kernel=f"{fn.source}:{fn.name}", attribute=_FUNC_ATTR.get(attrib, attrib),
                 value=int(value))


def _driver_module():
    m = types.ModuleType("cupy_backends.cuda.api.driver")
    m.CUDADriverError = CUDADriverError
    m.funcGetAttribute, m.funcSetAttribute = funcGetAttribute, funcSetAttribute
    return m


# -- modules and kernels -----------------------------------------------------------------

class Function:
    by_ptr: dict = {}
    _next = 0xF000

    def __init__(self, source: str, name: str):
        self.source, self.name = source, name
        Function._next += 0x10
        self.ptr = Function._next
        Function.by_ptr[self.ptr] = self

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False):
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        _rec().kernel_launched(self, grid, block, shared_mem, pdl=False, args=args)


class Module:
    def __init__(self):
        self.source = None
        self._functions: dict = {}

    def load(self, image: bytes):
        if not image.startswith(FAKE_IMAGE):
            raise ValueError("the fake CuPy loads only the fake NVRTC's images")
        self.source = image[len(FAKE_IMAGE):].split(b"\0", 1)[0].decode()

    def load_file(self, path):
        raise NotImplementedError("Module.load_file")

    def get_function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = Function(self.source, name)
        return fn


# -- NVRTC and cuBLAS --------------------------------------------------------------------

FAKE_IMAGE = b"FAKE-CUBIN\0"


class _Program:
    def __init__(self, name):
        self.name, self.options = name, []


def _nvrtc_module():
    m = types.ModuleType("cupy_backends.cuda.libs.nvrtc")
    m.NVRTCError = NVRTCError
    m.getVersion = lambda: (0, 0)                   # the fake's: no compiler behind it
    m.getSupportedArchs = lambda: (75, 80, 86, 89, 90, 100, 120)
    m.createProgram = lambda src, name, headers, include_names: _Program(name)

    def compile_program(prog, options):
        prog.options = [o.decode() if isinstance(o, bytes) else o for o in options]
    m.compileProgram = compile_program
    m.getCUBIN = lambda prog: FAKE_IMAGE + prog.name.encode() + b"\0" + " ".join(prog.options).encode()
    m.getPTX = lambda prog: ("// fake PTX of " + prog.name)
    m.getProgramLog = lambda prog: ""
    m.destroyProgram = lambda prog: None
    return m


CUBLAS_OP = {0: "N", 1: "T", 2: "C"}
CUDA_TYPE = {0: "32F", 1: "64F", 2: "16F", 3: "8I", 10: "32I", 14: "16BF"}
COMPUTE_TYPE = {64: "16F", 68: "32F", 70: "64F", 72: "32I", 74: "32F_FAST_TF32", 77: "32F_FAST_TF32"}


def _f32_at(ptr: int) -> float:
    return float(np.float32(ctypes.c_float.from_address(int(ptr)).value))


def record_gemm(op: str, args: tuple):
    """A cublasGemmEx / cublasGemmStridedBatchedEx call's arguments (after the handle)."""
    rec = _rec()
    if op == "cublasGemmEx":
        (ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo) = args
        strides = {}
    else:
        (ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batch, compute,
         algo) = args
        strides = dict(strideA=int(sa), strideB=int(sb), strideC=int(sc), batch=int(batch))
    rec.event(op=op, trans=CUBLAS_OP[int(ta)] + CUBLAS_OP[int(tb)], m=int(m), n=int(n), k=int(k),
              alpha=_f32_at(alpha), beta=_f32_at(beta),
              A=rec.label_ptr(int(A)), Atype=CUDA_TYPE.get(int(at), at), lda=int(lda),
              B=rec.label_ptr(int(B)), Btype=CUDA_TYPE.get(int(bt), bt), ldb=int(ldb),
              C=rec.label_ptr(int(C)), Ctype=CUDA_TYPE.get(int(ct), ct), ldc=int(ldc),
              compute=COMPUTE_TYPE.get(int(compute), compute), algo=int(algo), **strides)
    return 0


class FakeCublasLib:
    """What engine/backends/cuda/blas.py takes from libcublas through ctypes."""

    def cublasCreate_v2(self, handle_ref):
        handle_ref._obj.value = 0xB1A5
        return 0

    def cublasSetStream_v2(self, handle, stream):
        return 0

    def cublasSetWorkspace_v2(self, handle, ptr, size):
        return 0

    def cublasGemmEx(self, handle, *args):
        return record_gemm("cublasGemmEx", args)

    def cublasGemmStridedBatchedEx(self, handle, *args):
        return record_gemm("cublasGemmStridedBatchedEx", args)


def _cublas_module():
    m = types.ModuleType("cupy_backends.cuda.libs.cublas")
    m.CUBLAS_OP_N, m.CUBLAS_OP_T, m.CUBLAS_OP_C = 0, 1, 2
    m.CUBLAS_COMPUTE_32F, m.CUBLAS_COMPUTE_16F = 68, 64
    m.CUBLAS_GEMM_DEFAULT, m.CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
    m.setStream = lambda handle, stream: None
    m.gemmEx = lambda handle, *args: record_gemm("cublasGemmEx", args)
    m.gemmStridedBatchedEx = lambda handle, *args: record_gemm("cublasGemmStridedBatchedEx", args)
    return m


def fake_launch_kernel_ex(config_ref, func: int, params, extra) -> int:
    """cuLaunchKernelEx (engine/backends/cuda/pdl.py): the configuration as the driver reads it."""
    cfg = config_ref._obj
    attrs = [(cfg.attrs[i].id, cfg.attrs[i].value.i) for i in range(cfg.numAttrs)]
    _rec().kernel_launched(Function.by_ptr[func], (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                           (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ), cfg.sharedMemBytes,
                           pdl=(6, 1) in attrs)
    return 0


# -- the modules -------------------------------------------------------------------------

def modules() -> dict[str, types.ModuleType]:
    """{name: module} for sys.modules: cupy, cupy.cuda and the cupy_backends parts used."""
    cp = types.ModuleType("cupy")
    cp.__fake__ = True
    cp.ndarray = ndarray
    for f in (empty, zeros, full, asarray, array, ascontiguousarray, asnumpy, take, concatenate, add,
              multiply, get_default_memory_pool):
        setattr(cp, f.__name__, f)
    for t in ("uint8", "int8", "int32", "uint32", "int64", "float16", "float32", "float64", "bool_"):
        setattr(cp, t, getattr(np, t))
    cp.dtype = np.dtype

    cuda = types.ModuleType("cupy.cuda")
    runtime, driver = _runtime_module(), _driver_module()
    memory = types.ModuleType("cupy.cuda.memory")
    memory.OutOfMemoryError = OutOfMemoryError
    memory.Memory, memory.MemoryPointer, memory.UnownedMemory, memory.MemoryPool = \
        Memory, MemoryPointer, UnownedMemory, MemoryPool
    function = types.ModuleType("cupy.cuda.function")
    function.Module, function.Function = Module, Function
    device = types.ModuleType("cupy.cuda.device")
    device.Device = Device
    device.get_cublas_handle = lambda: 0xB1A5
    graph = types.ModuleType("cupy.cuda.graph")
    graph.Graph = Graph
    for name, v in dict(Device=Device, Stream=Stream, Event=Event, Graph=Graph, Memory=Memory,
                        MemoryPointer=MemoryPointer, UnownedMemory=UnownedMemory, MemoryPool=MemoryPool,
                        using_allocator=using_allocator, alloc_pinned_memory=alloc_pinned_memory,
                        get_elapsed_time=get_elapsed_time, runtime=runtime, driver=driver, memory=memory,
                        function=function, device=device, graph=graph,
                        is_available=lambda: True, get_current_stream=lambda: _streams.current).items():
        setattr(cuda, name, v)
    cp.cuda = cuda

    backends = types.ModuleType("cupy_backends")
    b_cuda = types.ModuleType("cupy_backends.cuda")
    api = types.ModuleType("cupy_backends.cuda.api")
    libs = types.ModuleType("cupy_backends.cuda.libs")
    nvrtc, cublas = _nvrtc_module(), _cublas_module()
    for m in (backends, b_cuda, api, libs):
        m.__path__ = []                 # packages, for the import system
    backends.cuda, b_cuda.api, b_cuda.libs = b_cuda, api, libs
    api.runtime, api.driver, libs.nvrtc, libs.cublas = runtime, driver, nvrtc, cublas
    return {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.memory": memory,
            "cupy.cuda.function": function, "cupy.cuda.device": device, "cupy.cuda.graph": graph,
            "cupy_backends": backends, "cupy_backends.cuda": b_cuda, "cupy_backends.cuda.api": api,
            "cupy_backends.cuda.api.runtime": runtime, "cupy_backends.cuda.api.driver": driver,
            "cupy_backends.cuda.libs": libs, "cupy_backends.cuda.libs.nvrtc": nvrtc,
            "cupy_backends.cuda.libs.cublas": cublas}


def activate(rec: Recorder | None):
    """Make `rec` the recorder the fake's arrays and functions report to (None: none)."""
    global _REC
    _REC = rec
    _ALLOCATOR[:] = [None]
    _DEFAULT_POOL._used = 0
    Function.by_ptr.clear()
    _streams.current, _streams.stack = NULL_STREAM, []     # the last user's use() not carried over
