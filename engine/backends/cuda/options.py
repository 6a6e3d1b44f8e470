"""The CUDA backend's options: every choice between two code paths it keeps, with the default
the GPU suite and the benchmarks run.

Four take their default from the environment when the backend is built (engine/flags.py:
BRASS_CUDA_DEBUG, BRASS_F16_WEIGHTS, BRASS_F16_WEIGHTS_GB, BRASS_PROMPT_GRAPHS); the others
are options only, set by a test or a program: `CudaBackend(mixed_matvec=False)`, or
`backend.options.mixed_matvec = False` before the launches it should change. Each kernel
variant here gives the same bits as the path it replaces (the conformance suite checks both),
but attn_split, whose sums are added in another order (attention.cu's head comment); the
default is the one that was faster on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import flags
from ...errors import BrassError


@dataclass
class CudaOptions:
    # Kernels compiled with line info, the stream checked after every launch: a failing kernel
    # is named where it fails.
    debug: bool | None = None
    # A prompt GEMM against a quantized weight reads a float16 copy of it kept since its first
    # prompt, while the copies fit f16_weights_gb (None: half the device memory free when the
    # first copy is made), instead of dequantizing it every call: the same float16 values, so
    # the same results, without a dequantize kernel per weight and prompt.
    f16_weights: bool | None = None
    f16_weights_gb: float | None = None
    # cuBLAS through a handle of the backend's own (blas.py), for eager prompts too: prompt
    # graphs capture the prompt's GEMMs, which CuPy's binding refuses during a capture, and an
    # eager prompt then computes what a replayed one does (the same handle and workspace).
    own_cublas: bool | None = None
    # A batched decode step reaches each row's KV cache through device tables of the rows'
    # cache addresses, one launch per layer (bucket graphs need it); off: a loop over the rows.
    row_kernels: bool = True
    # A decode step's q, k (one type) and v (another: Q4_K_M gives attn_v Q6_K) in one launch,
    # matvec_mixed_<a>_<b>: one launch fewer a layer, which small decodes are bound by.
    mixed_matvec: bool = True
    # Kernels captured into graphs launched with programmatic dependent launch where the GPU
    # has it (sm_90+): each kernel's launch overlaps the previous kernel's tail.
    pdl: bool = True
    # A prompt's attention (T >= 2, one sequence) in tiles on tensor cores
    # (attention_tiled.cu), where attention.cu keeps a query's whole row of logits in shared
    # memory: faster, and no bound on the context from shared memory.
    attn_tiled: bool = True
    # Attention split over the context (flash-decoding: attention.cu's split-K kernels, a
    # row's slots in splits of 256, three launches whose blocks of a (head, query) take its
    # splits in turn) where the one-block kernel reads a query's whole row in one block: None
    # (the default) for every decode-sized call (a step's token, a batched step's rows: never
    # slower at any depth, attention.py), a prompt the tiled kernel declines staying with the
    # one-block kernel; True every call, prompts too; False never. Past the one-block kernel's
    # shared memory (~57,000 slots at head dims 128) the split kernels take any call whatever
    # this says. The same logits, max and exponentials bit for bit; the sums in another order.
    attn_split: bool | None = None
    # A one-token Q6_K mat-vec whose warps read each chunk of a row together, coalesced
    # (matvec_coop_q6_k), where matvec_q6_k's lanes read their own items' words.
    q6k_coop: bool = True
    # A prompt's gated delta rule in chunks of GDN_CHUNK tokens (delta_chunked.cu) from one
    # chunk up, where ssm.cu's kernel steps the state token by token as llama.cpp does.
    delta_chunked: bool = True
    # A prompt's expert mat-muls on int8 tiles planned on the device (mmq.cu moe_plan,
    # mmq_id_<type>), where the float16 GEMMs' routing plan is read on the host every layer
    # (and such a prompt cannot be captured). The numpy q8_1 reference mirrors it (its own
    # moe_mmq option).
    moe_mmq: bool = True

    def __post_init__(self):
        for name, var, kind in (("debug", "BRASS_CUDA_DEBUG", bool), ("f16_weights", "BRASS_F16_WEIGHTS", bool),
                                ("f16_weights_gb", "BRASS_F16_WEIGHTS_GB", float),
                                ("own_cublas", "BRASS_PROMPT_GRAPHS", bool)):
            if getattr(self, name) is None:
                setattr(self, name, flags.get(var))
            elif kind is bool:
                setattr(self, name, bool(getattr(self, name)))
        gb = self.f16_weights_gb
        if gb is not None and not (gb >= 0 and math.isfinite(gb)):
            raise BrassError(f"f16_weights_gb must be a finite number of GiB >= 0, got {gb!r}")
