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


def test_every_op_runs_on_the_backends_stream():
    # Each public method of the backend, its own or inherited from Backend, is an op run with
    # the backend's stream current, unless it orders itself (backend.ORDERS_ITSELF)
    import inspect

    from brass.backends.base import Backend
    from brass.backends.cuda import backend

    def public(cls):
        return {n for n in dir(cls) if not n.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, n))}

    ops = public(Backend) | public(backend.CudaBackend)
    assert backend.ORDERS_ITSELF <= ops, f"not methods of the backend: {sorted(backend.ORDERS_ITSELF - ops)}"
    unwrapped = sorted(n for n in ops - backend.ORDERS_ITSELF
                       if not getattr(getattr(backend.CudaBackend, n), "on_own_stream", False))
    assert not unwrapped, f"ops run on the caller's stream: {unwrapped}"


def test_fused_ops_fill_their_outputs_on_the_backends_stream(rng, tmp_path):
    # Called outside activate(), as the kernel tests call them: a poisoned output filled on the
    # legacy stream races the kernel that writes it on the backend's (seen on the GPU runner:
    # delta_net_gates' g and rms_norm_gated's Q8_1 blocks left NaN under 14 test workers)
    from brass.gguf import GGMLType, GGUFFile
    from conformance.harness.cases import random_weight_file
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend:
        import cupy
        b = backend.CudaBackend(poison_outputs=True)
        streams = []
        out = b._out
        b._out = lambda *a, **k: (streams.append(cupy.cuda.get_current_stream().ptr), out(*a, **k))[1]
        with b.activate():
            pass
        T, H, D = 3, 4, 64
        gf = GGUFFile(random_weight_file(tmp_path / "w.gguf", rng, {
            "norm": (GGMLType.F32, (D,)), "dt": (GGMLType.F32, (H,)), "a": (GGMLType.F32, (H,))}))
        x, z = (b.asarray(rng.standard_normal((T, H, D)).astype(np.float32)) for _ in range(2))
        beta, alpha = (b.asarray(rng.standard_normal((T, H)).astype(np.float32)) for _ in range(2))
        b.l2_norm(x, 1e-6)
        b.rms_norm_gated(x, b.weight(gf, "norm"), z, 1e-6)
        b.delta_net_gates(beta, alpha, b.weight(gf, "dt"), b.weight(gf, "a"))
        assert streams and set(streams) == {b.stream.ptr}, "an output filled on another stream than the kernel's"
