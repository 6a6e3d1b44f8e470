"""conformance/harness/kernel_resources.py (ci/kernel_resources.py prints it): what NVRTC's
sm_90 build of a kernel needs, read without a GPU (the figures the speed notes quote for
variants nobody has timed yet)."""

from __future__ import annotations

import re

import pytest

from conformance.harness import kernel_resources


def test_blocks_an_sm_follow_the_allocation_rules():
    # registers are allocated 256 a warp: 100 a thread is 104 (3,328 a warp), so four warps a
    # block leave 4 blocks of 65,536 where an exact count (3,200) would give 5
    assert kernel_resources.blocks_per_sm(100, 48640, 128) == {"registers": 4, "shared": 4, "threads": 16}
    assert kernel_resources.blocks_per_sm(95, 44928, 128) == {"registers": 5, "shared": 5, "threads": 16}
    assert kernel_resources.blocks_per_sm(64, 1088, 256)["registers"] == 4
    assert kernel_resources.blocks_per_sm(70, 1088, 256)["registers"] == 3


def test_resources_read_from_an_nvrtc_cubin():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="no NVRTC (pip install -e '.[cuda]')")
    from brass.backends.cuda.compiler import KERNEL_DIR, compile_text
    source = (KERNEL_DIR / "norm.cu").read_text()
    threads = int(re.search(r"#define NORM_THREADS (\d+)", source).group(1))
    got = kernel_resources.resources(compile_text("norm.cu", source, "sm_90", use_cache=False))
    assert set(got) == {"rms_norm"}, sorted(got)
    # rms_norm's only shared array is a double per warp, after the 1 KiB sm_90 reserves; and a
    # real register count (ptxas gives every kernel a few)
    assert got["rms_norm"]["shared"] == 1024 + 8 * (threads // 32), got
    assert 8 <= got["rms_norm"]["registers"] <= 255, got


def test_attention_static_shared_memory_is_what_the_dispatch_counts():
    # engine/backends/cuda/attention.py sends a call to the split kernels where the one-block
    # kernel's dynamic shared memory and ATTN_STATIC_SMEM (its static arrays and the 1 KiB
    # sm_90 reserves) exceed the device's opt-in limit: that constant must be the kernel's
    # static shared memory as built
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="no NVRTC (pip install -e '.[cuda]')")
    from brass.backends.cuda.attention import ATTN_STATIC_SMEM
    from brass.backends.cuda.compiler import KERNEL_DIR, compile_text
    got = kernel_resources.resources(compile_text("attention.cu", (KERNEL_DIR / "attention.cu").read_text(), "sm_90"))
    assert got["attention"]["shared"] == ATTN_STATIC_SMEM, got["attention"]
