"""Every CUDA kernel source compiles with NVRTC for the architectures we support, without a
GPU: CI has no GPU, so this is where a broken kernel fails CI. Also checked here: each
kernel the backend launches exists in the compiled image, the host-side parameter structs
match the C layouts byte for byte, and a compile error names the kernel and the line.

NVRTC comes with CuPy (`cupy_backends.cuda.libs.nvrtc`) and runs without a driver. The
sources compile through the backend's on-disk cache of cubins, keyed by the source, every
header, the options and the NVRTC version: a hit is an image NVRTC built from exactly these
inputs, and a changed kernel misses and compiles again. The sm_90 images are then the ones
test_kernel_machine_code.py hashes, so the suite compiles each source once for sm_90, not twice
(matvec_q.cu alone takes ~40 s of CPU an architecture).
"""

from __future__ import annotations

import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="CuPy's NVRTC binding is not installed (pip install -e '.[cuda]')")

from brass.backends.cuda.backend import launched_kernels  # noqa: E402
from brass.backends.cuda.compiler import (KERNEL_DIR, compile_source, compile_text,  # noqa: E402
                                           kernel_sources)
from brass.backends.cuda.errors import KernelCompileError  # noqa: E402
from brass.backends.cuda.params import STRUCTS  # noqa: E402

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", kernel_sources())
def test_kernel_compiles(source, arch):
    image = compile_source(source, arch)
    assert image[:4] == b"\x7fELF", "NVRTC did not return a cubin"
    for src, name in launched_kernels():
        if src == source:
            # extern "C" names appear verbatim in the cubin's symbol table.
            assert name.encode() + b"\0" in image, f"kernel {name} is missing from {source}"


def test_every_launched_kernel_has_a_source():
    sources = set(kernel_sources())
    missing = {src for src, _ in launched_kernels()} - sources
    assert not missing, f"the backend launches kernels from missing sources {missing}"


def _has_builtin_offsetof() -> bool:
    src = "struct S { int a; long long b; };\nstatic_assert(__builtin_offsetof(S, b) == 8, \"\");\n"
    try:
        compile_text("offsetof_probe.cu", src, "sm_80", use_cache=False)
        return True
    except KernelCompileError:
        return False


def test_param_structs_match_the_c_layout():
    # One static_assert per field offset and per struct size, compiled by NVRTC: the numpy
    # dtypes that CuPy passes by value must agree with params.cuh on every byte.
    if not _has_builtin_offsetof():
        pytest.skip(f"this NVRTC {nvrtc.getVersion()} has no __builtin_offsetof (13.0 on the GPU "
                    f"runner); CI's NVRTC (13.5) runs this check")
    lines = ['#include "params.cuh"']
    for name, dt in STRUCTS.items():
        lines.append(f'static_assert(sizeof({name}) == {dt.itemsize}, "{name}: size");')
        for field in dt.names:
            off = dt.fields[field][1]
            lines.append(f'static_assert(__builtin_offsetof({name}, {field}) == {off}, "{name}.{field}");')
    assert len(STRUCTS) >= 10
    compile_text("params_layout.cu", "\n".join(lines), "sm_90", use_cache=False)


def test_compile_error_names_kernel_and_line():
    source = (KERNEL_DIR / "norm.cu").read_text()
    anchor = "    const float mean = (float) (ss / p.n_cols);"       # in the rms_norm kernel
    assert anchor in source
    broken = source.replace(anchor, "    const float mean = (float) (ss_typo / p.n_cols);", 1)
    line = broken[:broken.index("ss_typo")].count("\n") + 1
    with pytest.raises(KernelCompileError) as err:
        compile_text("norm.cu", broken, "sm_90", use_cache=False)
    msg = str(err.value)
    assert f"kernels/norm.cu line {line}, in rms_norm" in msg, msg
    assert "ss_typo" in msg and "sm_90" in msg
