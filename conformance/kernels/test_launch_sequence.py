"""The CUDA backend launches, entry for entry, what was recorded on each synthetic model: kernel,
grid, block, dynamic shared memory, programmatic dependent launch or not, the parameter struct's
fields and values, the buffers' labels, dtypes and shapes; and the cuBLAS calls, host<->device
copies, CuPy array work and graph captures and launches between them. A baseline for host-side
changes that must change no launch (conformance/harness/launch_recording.py says what runs and how;
conformance/harness/fake_cupy.py what the fake CuPy sees and what it cannot).

No GPU and no CuPy needed: the backend runs on a numpy stand-in of CuPy, kernels do not run.
The recording is conformance/data/launch_sequence.json; when a change is meant to change what
is launched, re-record it and say why in the commit:

    python3 -m conformance.harness.launch_recording --record [--only synth-qwen3,...]
"""

from __future__ import annotations

import sys

import pytest

from conformance.harness import fake_cupy, launch_recording as lr


def _recorded_models() -> list[str]:
    return sorted(lr.read()["models"]) if lr.DATA.exists() else []


@pytest.fixture
def recording():
    if lr.switches_set():
        pytest.skip(f"{', '.join(lr.switches_set())} set here: the recording is of every switch at its "
                    f"default (what a user gets)")
    if not lr.DATA.exists():
        pytest.fail(f"no recording {lr.DATA}: write it with {lr.RECORD_CMD}", pytrace=False)
    rec = lr.read()
    for key in ("scenario", "device"):
        assert rec[key] == lr.header()[key], (
            f"the recording's {key} {rec[key]} is not the harness's {lr.header()[key]}: re-record ({lr.RECORD_CMD})")
    return rec


@pytest.mark.parametrize("name", sorted(set(lr.synthetic_models()) | set(_recorded_models())))
def test_launch_sequence_is_the_recorded(name, recording):
    assert name in recording["models"], (f"{name} is not in the recording: record it "
                                         f"({lr.RECORD_CMD} --only {name})")
    assert name in lr.synthetic_models(), (f"{name} is in the recording but not in {lr.MODELS_DIR}: "
                                           f"re-record ({lr.RECORD_CMD})")
    diff = lr.first_difference(recording["models"][name], lr.record_model(name))
    if diff:
        pytest.fail(f"{name}: what the CUDA backend launches differs from {lr.DATA.name}\n{diff}\n"
                    f"If the change is meant, re-record ({lr.RECORD_CMD} --only {name}) and say why "
                    f"in the commit.", pytrace=False)


def test_the_fake_puts_everything_back():
    before = {k: v for k, v in sys.modules.items() if lr._ours(k)}
    with lr.fake_cuda(fake_cupy.Recorder()) as backend:
        import cupy
        assert getattr(cupy, "__fake__", False) and backend.cupy is cupy
    assert {k: v for k, v in sys.modules.items() if lr._ours(k)} == before


def test_the_fake_refuses_to_synchronise_inside_a_capture():
    # as CUDA does (cudaErrorStreamCaptureUnsupported): a forward that reads the device on the
    # host fails to capture, and the recording shows the fallback a GPU would take
    with lr.fake_cuda(fake_cupy.Recorder()) as backend:
        b = backend.CudaBackend()
        x = b.asarray([1.0, 2.0])
        with pytest.raises(fake_cupy.CUDARuntimeError, match="capture"):
            b.capture(lambda: b.to_numpy(x))
        assert b.to_numpy(x).tolist() == [1.0, 2.0]


def test_the_fake_refuses_host_copies_inside_a_capture():
    # a block table rewritten or an input uploaded inside a capture would not be redone at a
    # replay (CUDA refuses a pageable buffer's copy there; a pinned one's is replayed from the
    # buffer as it then is): the fake refuses both, so that the CPU tests see such a forward
    with lr.fake_cuda(fake_cupy.Recorder()) as backend:
        b = backend.CudaBackend()
        table = b.block_table(4)
        with pytest.raises(fake_cupy.CUDARuntimeError, match="capture"):
            b.capture(lambda: b.write_block_table(table, [3, 1]))
        with pytest.raises(fake_cupy.CUDARuntimeError, match="capture"):
            b.capture(lambda: b.asarray([1, 2]))
        b.write_block_table(table, [3, 1])
        assert b.to_numpy(table).tolist() == [3, 1, -1, -1]
