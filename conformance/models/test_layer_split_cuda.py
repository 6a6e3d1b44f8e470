"""The layer split on the CUDA backend (issue 49, `--split layer --backend cuda`): each rank a
TPCudaBackend holding the contiguous layers of its stage (engine/distributed/tp.py Stage), the
residual stream handed on between stages (a header of kinds, dtypes and shapes, then the arrays:
device arrays through NCCL's send / recv_into, or staged through the host).

On the CPU:
- the hand-over's header carries host arrays, device arrays of every dtype the stages send, and
  None, in order; a device array reaches the receiver's device (through recv_into where the
  communicator has it, as NCCL's, else staged through the host);
- on the fake CuPy (conformance/harness/fake_cupy.py: kernels do not run), a TPModel of two
  CUDA ranks in threads over the host-staged communicator uploads, when it is made, exactly the
  tensors of each rank's stage (its layers; the embedding on the first, the output norm and head
  on the last) and no other tensor after steps, and runs prompts and greedy decoding.

On a GPU (`ci/gpu.sh tp cuda`): the layer split over 2 ranks, in threads over the host-staged
communicator and in processes over "host" on the one GPU, gives the single-GPU model's logits and
greedy tokens bit for bit: the same kernels on the same bytes in the same order, the hand-over an
exact copy. (Over NCCL the stages need a GPU each: the two-GPU kind, `ci/gpu.sh tp bars`.)
"""

from __future__ import annotations

import numpy as np
import pytest

from brass.backends import cuda_available
from brass.distributed.comm import ThreadGroup
from brass.gguf import GGUFFile
from conformance.harness import fake_cupy, goldens, launch_recording as lr
from conformance.harness.tp_bounds import assert_same_bits, cuda_single

TP_NAMES = [m.name for m in goldens.tp_models()]
requires_cuda = pytest.mark.skipif(
    not cuda_available(), reason="no CUDA device here: the CUDA stages run on the GPU runner (ci/gpu.sh tp cuda)")


class DeviceArray(np.ndarray):
    """Stands for a device array (not a plain numpy array: the hand-over's 'device' kind)."""


class DeviceBackend:
    """What a stage's receiver asks of its backend: empty arrays and host-to-device copies on its
    device; records which it did."""

    def __init__(self):
        self.made = []

    def empty(self, shape, dtype):
        self.made.append(("empty", tuple(shape), np.dtype(dtype)))
        return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype).view(DeviceArray)

    def asarray(self, a, dtype=None):
        self.made.append(("asarray", a.shape, np.dtype(dtype)))
        return np.array(a, dtype).view(DeviceArray)


class IntoComm:
    """A ThreadCommunicator with NCCL's recv_into (the receiver allocates; the data lands in it)."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.into = 0

    def send(self, x, dst):
        self.inner.send(np.asarray(x), dst)

    def recv(self, src):
        return self.inner.recv(src)

    def recv_into(self, out, src):
        self.into += 1
        out[...] = self.inner.recv(src)
        return out


@pytest.mark.parametrize("into", [False, True], ids=["staged", "recv_into"])
def test_the_hand_over_carries_kinds_dtypes_shapes_and_none(into, rng):
    from brass.distributed.tp import Stage
    carry = (rng.standard_normal((3, 8)).astype(np.float32).view(DeviceArray), None,
             rng.integers(-9, 9, 5).astype(np.int32),
             rng.standard_normal(16).astype(np.float16).view(DeviceArray),
             rng.integers(0, 99, (2, 2)).astype(np.int64).view(DeviceArray))
    g = ThreadGroup(2)
    comms = [g.comm(0), g.comm(1)]
    if into:
        comms = [IntoComm(c) for c in comms]
    send, recv = Stage(comms[0], (0, 1)), Stage(comms[1], (1, 2))
    recv.backend = DeviceBackend()
    send.send(carry)
    got = recv.recv()
    assert len(got) == len(carry) and got[1] is None
    for a, b in zip(carry, got):
        if a is None:
            continue
        assert type(b) is type(a) and b.dtype == a.dtype and b.shape == a.shape
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # the device arrays (float32, float16, int64) reached the receiver's device, the host one not
    device = [(a.shape, a.dtype) for a in carry if type(a) is DeviceArray]
    kinds = {k for k, *_ in recv.backend.made}
    assert kinds == {"empty" if into else "asarray"}
    assert [(s, d) for _, s, d in recv.backend.made] == device
    if into:
        assert comms[1].into == 3


def _stage_names(path, world: int) -> list[set]:
    from brass import arch
    from brass.config import read_config
    from brass.distributed.tp import Stage, layer_stages, stage_tensors
    gf = GGUFFile(path)
    try:
        cfg = arch.get(gf.architecture).configure(read_config(gf, gf.architecture), gf)
        stages = layer_stages(cfg.n_layer, world)
        g = ThreadGroup(world)
        return [set(stage_tensors(gf, Stage(g.comm(r), stages[r]))) for r in range(world)]
    finally:
        gf.close()


@pytest.mark.parametrize("name", TP_NAMES)
def test_stage_tensors_split_the_file(name):
    """Every tensor of the file is some stage's; a layer's tensors are its stage's alone; the
    first stage holds the embedding, the last the output norm (and head)."""
    path = goldens.model(name).path()
    gf = GGUFFile(path)
    every = set(gf.tensors)
    gf.close()
    first, last = _stage_names(path, 2)
    assert first | last == every
    assert "token_embd.weight" in first and "output_norm.weight" in last and "output_norm.weight" not in first
    assert not {n for n in first & last if n.startswith("blk.") and not n.endswith(".layer_output_scale.weight")}
    assert {n for n in first if n.startswith("blk.0.")} and not {n for n in last if n.startswith("blk.0.")}


def test_a_later_stage_holds_the_output_scale_of_the_layer_before():
    """gemma4 with fused ops: a later stage adds the hand-over's FFN output to the residual
    scaled by the layer before's layer_output_scale (engine/arch/gemma4.py), a tensor of the
    stage before: it is that stage's too. (The TP-shaped gemma4 has none: a stand-in file.)"""
    from types import SimpleNamespace
    from brass.distributed.tp import Stage, stage_tensors
    names = ["token_embd.weight", "output_norm.weight", "rope_freqs.weight"] + [
        f"blk.{il}.{t}" for il in range(4) for t in ("attn_q.weight", "layer_output_scale.weight")]
    gf = SimpleNamespace(tensors=dict.fromkeys(names))
    g = ThreadGroup(2)
    first = set(stage_tensors(gf, Stage(g.comm(0), (0, 2))))
    last = set(stage_tensors(gf, Stage(g.comm(1), (2, 4))))
    assert "blk.1.layer_output_scale.weight" in first and "blk.1.layer_output_scale.weight" in last
    assert "blk.1.attn_q.weight" not in last and "blk.0.layer_output_scale.weight" not in last
    assert "token_embd.weight" in last       # tied head (no output.weight): the last stage's too
    assert {"rope_freqs.weight", "token_embd.weight"} <= first and "output_norm.weight" not in first


@pytest.mark.parametrize("name", TP_NAMES)
def test_a_layer_split_of_cuda_ranks_uploads_its_stages_and_runs(name):
    """TPModel(split="layer", backend="cuda", comm="host") on the fake: each rank a TPCudaBackend
    over the host-staged communicator, holding (uploaded when it is made) exactly its stage's
    tensors, none more after prompts and greedy decoding, which run end to end (the values are
    the fake's zeros: the shapes and the path are what is checked)."""
    from brass.distributed.tp import TPModel
    path = goldens.model(name).path()
    want = _stage_names(path, 2)
    with lr.fake_cuda(fake_cupy.Recorder()):
        from brass.backends.cuda.sharded import TPCudaBackend
        from brass.distributed.cuda_rank import HostStagedCommunicator
        m = TPModel(path, 2, split="layer", backend="cuda", comm="host")
        try:
            for rank, names in zip(m.ranks, want):
                assert isinstance(rank.backend, TPCudaBackend) and isinstance(rank.comm, HostStagedCommunicator)
                assert not rank.graphs
                assert set(rank.weights._cache) == names, f"rank {rank.comm.rank} uploaded another set"
            # the last stage's logits come to the host through its backend (a CuPy array does
            # not convert by itself; the fake's would)
            to_host = []
            last = m.ranks[-1].backend
            real = last.to_numpy
            last.to_numpy = lambda a: to_host.append(a.shape) or real(a)
            p = goldens.prompts(name)[0]
            logits = m.score(p.tf_ids[:6])
            assert to_host == [(6, m.config.n_vocab)]
            assert type(logits) is np.ndarray and logits.shape == (6, m.config.n_vocab)
            assert list(m.generate(p.prompt_ids[:4], max_tokens=3, stop_at_eog=False)) == [0] * 3
            assert len(to_host) == 1 + 3
            for rank, names in zip(m.ranks, want):
                assert set(rank.weights._cache) == names, f"rank {rank.comm.rank} read a tensor of another stage"
        finally:
            m.close()


# -- on a GPU -----------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", ["threads", "processes"])
@pytest.mark.parametrize("name", TP_NAMES)
def test_the_cuda_layer_split_equals_one_gpu(name, ranks):
    from brass.distributed.tp import TPModel
    path = goldens.model(name).path()
    split = TPModel(path, 2, split="layer", backend="cuda", ranks=ranks, comm="host")
    try:
        assert_same_bits(split, cuda_single(path), goldens.prompts(name))
    finally:
        split.close()
