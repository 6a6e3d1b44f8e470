"""CUDA graphs: capture records the kernels a function queues on the backend's stream (nothing
runs), with the memory they use; a replay launches them all at once. Decode steps, batched
steps and prompts are replayed this way (engine/model.py, engine/batch.py), their inputs
rewritten in place before each replay."""

from __future__ import annotations

import traceback

import cupy


def capture(b, fn, reuse_freed: bool = False):
    """Record the kernels `fn()` queues on b's stream as a CUDA graph (nothing
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
        with b.device, b.stream, cupy.cuda.using_allocator(alloc):
            b._graph_refs = refs
            b.stream.begin_capture()
            try:
                result = fn()
            except BaseException:
                try:
                    b.stream.end_capture()
                except Exception:   # the capture is already invalid; report fn's error
                    pass
                raise
            finally:
                b._graph_refs = None
                # the memos' arrays of this forward are the graph's memory: none outlives it
                b._q8.clear()
                b._plan = b._id_plan = None
            graph = b.stream.end_capture()
    except BaseException as e:
        if reuse_freed:
            # the arrays the failed forward left in its frames go back to the pool, and the
            # blocks leave it: a failed capture keeps nothing
            traceback.clear_frames(e.__traceback__)
            with b.device:
                pool.free_all_blocks()
        raise
    escaped = 0
    if reuse_freed:
        # The arrays returned, as views that keep the graph's blocks alive (a caller may
        # hold the logits after the graph is dropped); the pool's own arrays then go back
        # to it, its blocks leave it, and it goes.
        result = holding(result, blocks)
        with b.device:
            pool.free_all_blocks()
            escaped = pool.used_bytes()     # an array of the capture still held elsewhere
        del pool
    return CudaGraph(b, graph, blocks + refs, result, escaped)


def holding(result, owner):
    """`result` (an array, a tuple or list of them, or anything else, unchanged) with each
    array replaced by a view of the same memory that holds `owner`."""
    if isinstance(result, cupy.ndarray):
        mem = cupy.cuda.UnownedMemory(result.data.ptr, result.nbytes, owner, result.data.device_id)
        return cupy.ndarray(result.shape, result.dtype, cupy.cuda.MemoryPointer(mem, 0), strides=result.strides)
    if isinstance(result, (tuple, list)):
        return type(result)(holding(r, owner) for r in result)
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
