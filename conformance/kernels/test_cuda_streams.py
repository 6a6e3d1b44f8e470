"""The CUDA backend's stream on the CPU, through the fake CuPy (conformance/harness/fake_cupy.py
keeps the thread's current stream and its `with` stack as CuPy 14 does). The backend's stream is
non-blocking: no order holds between it and the legacy default stream that is current outside
activate(). On the GPU runner that let to_numpy copy an array before the kernel that made it
had run, when the array was made outside activate() (test_batch.py's caches read back, with
another process on the GPU)."""

from __future__ import annotations

import numpy as np

from conformance.harness import fake_cupy, launch_recording as lr


def test_the_legacy_stream_is_current_outside_activate():
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend:
        import cupy
        b = backend.CudaBackend()        # its stream use()d: current until a `with` ends
        with b.activate():
            assert cupy.cuda.get_current_stream().ptr == b.stream.ptr
        assert cupy.cuda.get_current_stream().ptr == 0, "the backend's stream current outside activate"


def test_to_numpy_waits_for_the_callers_stream():
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend:
        import cupy
        b = backend.CudaBackend()
        with b.activate():               # (CuPy then puts the legacy stream back)
            pass
        x = cupy.asarray(np.arange(6, dtype=np.float32))       # on the legacy stream
        rec.on = True
        b.to_numpy(x[::2])
        waits = [e for e in rec.events if e["op"] == "stream_wait"]
        assert [e["stream"] for e in waits] == [b.stream.ptr], \
            "to_numpy read an array of the legacy stream without waiting for it"
        rec.events.clear()
        with b.activate():
            b.to_numpy(b.asarray(np.ones(3, np.float32)) * 2)   # made on the backend's stream
        assert not [e for e in rec.events if e["op"] == "stream_wait"], "a wait where the order holds"
