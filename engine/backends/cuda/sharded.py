"""The CUDA backend of one tensor-parallel rank (issue 49, docs/multi-gpu.md): the CudaBackend
with the rank's shards of the weights (the plan of engine/distributed/shard.py) and an
all-reduce over the rank's communicator wherever engine/distributed/tp.py's TPBackend has one.

Where a row-parallel product reaches the residual stream, and where its all-reduce goes (every
hook is in an op, so the eager step, a captured decode graph and a prompt run it alike):

- attn_output (common.attention, qwen35 gated attention, gemma4), ffn_down (common.ffn, the
  dense FFN of every architecture and gemma4's dense branch), ssm_out (qwen35 delta-net) and
  qwen35moe's ffn_down_shexp: `matmul_many` (which `matmul` goes through) all-reduces the
  product of a weight cut by input columns (`reduce`) before returning it. Its consumers are a
  bias add, gemma4's post-norms (rms_norm: not linear, so the sum must come first) and the fused
  residual add with the next norm (add_rms_norm, fused.cu), which then also writes the next
  mat-vecs' Q8_1 blocks from the summed stream.
- The routed experts (moe_ffn: on a decode step matvec_moe_down sums the chosen experts'
  weighted outputs inside one kernel, never the residual): the kernel's output is all-reduced.
- The embedding (vocabulary parallel): the rank's rows, zeros for the others' ids, all-reduced.
- No kernel adds a mat-vec's output into the residual itself; the Q8_1 blocks a mat-vec reuses
  (attention's output for attn_output, the gated FFN's h for ffn_down) are its input, which is
  the rank's own heads / FFN columns: exactly the columns of its shard.

Expert parallelism: the router is replicated; a choice of an expert another rank holds becomes
local expert 0 with routing weight 0 (the kernels write NaN for an id outside the tensor, which
a weight of 0 would not clear), so it adds +-0 to the token's sum: the same value as leaving it
out. It costs that expert's mat-vecs; a kernel that skips negative ids would not.

A communicator captured into a CUDA graph must run on the device stream (NCCL: `capturable`);
one that stages through the host cannot, so this backend takes graphs only over a capturable
one (`supports_graphs`), and `capture` refuses otherwise.
"""

from __future__ import annotations

import cupy
import numpy as np

from ... import quants
from ...distributed.tp import shard_bytes
from ...errors import UnsupportedError
from .backend import STAGING_BYTES, CudaBackend, _on_own_stream
from .common import F32, CudaWeight, f32, i32


class ShardCudaWeight(CudaWeight):
    """A rank's part of a GGUF tensor on the device (its Cut: rows, columns or experts)."""

    def __init__(self, name, type_, shape, cut, data=None, dense=None):
        super().__init__(name, type_, shape, data=data, dense=dense)
        self.cut = cut
        self.reduce, self.vocab, self.experts = cut.reduce, cut.vocab, cut.experts


class TPCudaBackend(CudaBackend):
    """CudaBackend + a communicator `comm` and the rank's plan (None: every tensor whole)."""

    def __init__(self, comm, plan=None, device=None, **options):
        super().__init__(device, **options)
        self.comm, self.plan = comm, plan
        # one rank holding everything: the embedding and the experts need no masking
        self._whole = plan is None or plan.world == 1

    @property
    def supports_graphs(self) -> bool:
        return bool(getattr(self.comm, "capturable", False))

    def capture(self, fn, reuse_freed: bool = False):
        if not self.supports_graphs:
            raise UnsupportedError(f"{type(self.comm).__name__} cannot be captured in a CUDA graph "
                                   f"(it synchronises with the host): decode eagerly")
        return super().capture(fn, reuse_freed)

    # -- the rank's shards ---------------------------------------------------------------------
    def weight(self, gf, name):
        cut = self.plan.cut(name) if self.plan is not None else None
        if cut is None:
            return super().weight(gf, name)
        info = self.tensor_info(gf, name)
        raw, ggml_shape = shard_bytes(gf, name, cut)
        shape = tuple(reversed(ggml_shape))
        if len(shape) == 1:
            dense = quants.dequantize(raw, info.type, ggml_shape)
            return ShardCudaWeight(name, info.type, shape, cut, dense=cupy.asarray(np.asarray(dense, F32)))
        # the rank's bytes only (a view of the file's map for rows and experts, a copy of its
        # columns), in their quantized form
        return ShardCudaWeight(name, info.type, shape, cut, data=self._upload_bytes(raw))

    def _upload_bytes(self, raw: np.ndarray):
        """Host bytes to a new device buffer through the two pinned staging buffers (as
        CudaBackend._upload copies a file's range): one filled while the other is in flight."""
        raw = raw.reshape(-1).view(np.uint8)
        dst = cupy.empty(raw.nbytes, np.uint8)
        staging = self._staging_buffers()
        for i, done in enumerate(range(0, raw.nbytes, STAGING_BYTES)):
            mem, host, ev = staging[i % 2]
            n = min(STAGING_BYTES, raw.nbytes - done)
            ev.synchronize()                    # the previous copy out of this buffer is over
            host[:n] = raw[done:done + n]
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr + done, mem.ptr, n,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            ev.record(self.stream)
        return dst

    # -- the all-reduce hooks -------------------------------------------------------------------
    def all_reduce(self, y):
        """The sum over the ranks of a partial product (every rank gets the same array)."""
        return self.comm.all_reduce(y)

    def matmul_many(self, x, ws):
        # a rank holding none of a weight (a shared expert whole on rank 0): zeros, no launch
        held = [w for w in ws if 0 not in w.shape]
        ys = iter(super().matmul_many(x, held) if held else [])
        lead = x.shape[:-1]
        out = []
        for w in ws:
            y = next(ys) if 0 not in w.shape else self._zeros((*lead, w.shape[0]))
            out.append(self.all_reduce(y) if getattr(w, "reduce", False) else y)
        return out

    def ffn_glu(self, x, w_gate, w_up, gelu=False):
        if 0 in w_gate.shape:           # none of this FFN here: h has no columns
            return self._zeros((*x.shape[:-1], 0))
        return super().ffn_glu(x, w_gate, w_up, gelu)

    def embed(self, table, ids):
        v = getattr(table, "vocab", None)
        if v is None:
            return super().embed(table, ids)
        if self._whole:
            return self.all_reduce(super().embed(table, ids))
        ids = i32(ids, "embed ids").reshape(-1)
        # ids of other ranks' rows read local row 0 and are zeroed (one non-zero term per row
        # in the all-reduce: exact)
        mine = (ids >= v[0]) & (ids < v[1])
        local = (ids - np.int32(v[0])) * mine.astype(np.int32)
        rows = super().embed(table, local)
        return self.all_reduce(rows * mine.astype(F32)[:, None])

    def moe_ffn(self, x, w_gate, w_up, w_down, ids, weights, gelu=False, down_scale=None):
        e = getattr(w_gate, "experts", None)
        if e is not None and not self._whole:
            ids = i32(ids, "moe_ffn ids")
            weights = f32(weights, "moe_ffn weights")
            mine = (ids >= e[0]) & (ids < e[1])
            ids = ((ids - np.int32(e[0])) * mine.astype(np.int32)).astype(np.int32)
            weights = weights * mine.astype(F32)
        y = super().moe_ffn(x, w_gate, w_up, w_down, ids, weights, gelu, down_scale)
        return self.all_reduce(y) if e is not None else y

    # -- the vocabulary-parallel head -------------------------------------------------------------
    def row_max(self, logits):
        """(largest value, its local column) of each row of the rank's logits, on the host: the
        two numbers a row that the greedy all-gather needs (engine/distributed/vocab.py)."""
        idx = self.to_numpy(self.argmax(logits)).astype(np.int64).reshape(-1)
        V = logits.shape[-1]
        at = cupy.asarray(np.arange(len(idx), dtype=np.int64) * V + idx)
        vals = self.to_numpy(cupy.take(cupy.ascontiguousarray(logits).reshape(-1), at))
        return vals.astype(np.float64), idx

    def _zeros(self, shape):
        return cupy.zeros(shape, F32)


for _name in ("weight", "matmul_many", "ffn_glu", "embed", "moe_ffn", "row_max"):
    setattr(TPCudaBackend, _name, _on_own_stream(getattr(TPCudaBackend, _name)))
del _name
