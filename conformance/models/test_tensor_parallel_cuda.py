"""Tensor parallelism on the CUDA backend (issue 49): a rank's TPCudaBackend
(engine/backends/cuda/sharded.py) on the TP-shaped synthetic models (synth_models.TP_MODELS).

On the CPU (the fake CuPy of conformance/harness/fake_cupy.py: kernels do not run, what reaches
the GPU is recorded):
- every rank of TP = 2 and 4 uploads its shard of each tensor it holds a part of: the shape and
  the values (its bytes dequantized) of the plan's rows / columns / experts of the whole tensor;
- a rank's decode step all-reduces each row-parallel product (attn_output, ffn_down, ssm_out,
  the experts' down projection) and the vocabulary-parallel embedding: the all-reduce comes
  right after the launch that wrote the partial sum, before any other launch, and no launch
  reads the partial afterwards: the residual add (add_rms_norm), a bias or gemma4's post-norms
  read the sum; a rank holding none of a weight (a shared expert whole on rank 0) all-reduces
  zeros, so every rank makes the same collectives;
- a TP = 1 rank over a capturable communicator of one rank (as NCCL's) launches what the
  single-GPU model launches, event for event, its captured decode graph included;
- a TPModel of CUDA ranks runs its steps (one rank: the fake is for one thread at a time).
- a rank over a capturable communicator (as NCCL's in the worker processes) captures its
  one-token step with every all-reduce inside the graph, then replays it.
- engine/distributed/nccl.py against a stand-in of CuPy 14's NCCL binding (fake_nccl.py: the
  compiled binding's signatures and C types): the unique id as bytes, each call's arguments in
  order, the collectives' results; a rank built as a worker builds it over NCCL (workers.
  build_rank) makes every all-reduce on its backend's stream, the one its graph is captured on.

On a GPU (the runner: `ci/gpu.sh tp cuda`), with CUDA ranks in threads on the one GPU over the
host-staged communicator (engine/distributed/cuda_rank.py), decoded eagerly:
- TP = 1 through that path gives the single-GPU model's logits bit for bit (the same kernels on
  the same bytes; the all-reduce of one rank is a copy);
- TP = 2 and 4 against TP = 1 on CUDA, under test_tensor_parallel.py's bound and its reason (the
  all-reduce changes summation order; the Q8_1 and float16 roundings now and then turn that into
  one rounding step): logits NMSE <= TP_NMSE, no argmax flip where TP = 1's top-1/top-2 margin
  exceeds TP_MARGIN, greedy tokens equal up to the first step whose margin is below it;
- against the numpy backend's TP of the same world (the same plan, the same rank-order sums):
  within the distance of the two backends at TP = 1 plus both TP bounds (see the test);
- TP = 1 through NCCL (a communicator of one rank, captured): a decode graph holding its
  all-reduces gives the single-GPU model's logits and greedy tokens bit for bit.
- CUDA ranks in processes (workers.py): TP = 2 over "host" on the one GPU gives the bits of
  the same ranks in threads (the same sums in the same order); TP = 1 of the process path over
  NCCL decodes through its graph with the single-GPU model's bits; on two GPUs, TP = 2 over NCCL
  (one process per GPU, decode graphs holding NCCL's all-reduces) against TP = 1 CUDA under the
  bound above.
"""

from __future__ import annotations

import numpy as np
import pytest

from brass import quants
from brass.backends import cuda_available
from brass.distributed.comm import ThreadGroup
from brass.distributed.shard import tensor_parallel
from brass.gguf import GGUFFile
from conformance.harness import fake_cupy, goldens, launch_recording as lr
from conformance.harness.tp_bounds import TP_MARGIN, TP_NMSE, assert_same_bits, cuda_single, nmse
from conformance.harness.tp_bounds import disagreements as _disagreements

TP_NAMES = [m.name for m in goldens.tp_models()]
# greedy streams: prompts taken in order until this many tokens were compared
STREAM_TOKENS = 16

WORLDS = (2, 4)
COMBINE_EXPERTS = ("elementwise.cu:mul_expert_scale", "elementwise.cu:weighted_sum")
N_CTX = 64
requires_cuda = pytest.mark.skipif(
    not cuda_available(), reason="no CUDA device here: the CUDA ranks run on the GPU runner (ci/gpu.sh tp cuda)")


# -- on the CPU: the fake CuPy ---------------------------------------------------------------

class RecordingComm:
    """A rank's communicator of `world` ranks, run alone: its all-reduce is the host-staged one
    of a group of one (device -> host -> device, as the CUDA ranks in threads do), recorded as
    an event {"op": "all_reduce", "in": ..., "out": ...} beside the launches."""

    def __init__(self, rec, world: int, rank: int):
        from brass.distributed.cuda_rank import HostStagedCommunicator
        self.rec, self.world_size, self.rank = rec, world, rank
        self.inner = HostStagedCommunicator(ThreadGroup(1).comm(0))
        self.capturable = False

    def all_reduce(self, x):
        e = self.rec.event(op="all_reduce", **{"in": self.rec.desc(x)})
        y = self.inner.all_reduce(x)
        e["out"] = self.rec.desc(y)
        return y


def _label(desc) -> str | None:
    """The allocation a buffer's description names ("w:<tensor>", "t12", ...; its offset and
    dtype[shape] cut off), None for an empty array or a value."""
    if not isinstance(desc, str) or desc.startswith("(") or ":" not in desc:
        return None
    return desc.rsplit(":", 1)[0].split("@")[0]


def _rank(backend_mod, rec, name: str, world: int, r: int):
    from brass.distributed.tp import Rank
    from brass.backends.cuda.sharded import TPCudaBackend
    path = goldens.model(name).path()
    gf = GGUFFile(path)
    from brass import arch
    a = arch.get(gf.architecture)
    from brass.config import read_config
    cfg = a.configure(read_config(gf, gf.architecture), gf)
    plan = tensor_parallel(gf, cfg, world, r)
    gf.close()
    assert TPCudaBackend.__module__ == "brass.backends.cuda.sharded" and issubclass(TPCudaBackend, backend_mod.CudaBackend)
    return Rank(path, RecordingComm(rec, world, r), plan=plan, backend=TPCudaBackend)



def test_a_cuda_rank_uploads_its_shards_when_it_is_made():
    """As a Model does (backend.load): every tensor the rank takes is on the device once the
    rank exists, before any step (an out-of-memory shows at the start, not at the first
    prompt, and the uploads do not queue behind that prompt's collectives)."""
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend_mod:
        rank = _rank(backend_mod, rec, "synth-tp-qwen3", 2, 1)
        assert set(rank.weights._cache) == set(rank.gguf.tensors)


def _expected_shard(full: np.ndarray, cut) -> np.ndarray:
    """The plan's part of a whole tensor's values (numpy order: [E,] N, K), by slicing."""
    if cut.experts is not None:
        return full[cut.experts[0]:cut.experts[1]]
    out = full
    if cut.rows is not None:
        out = np.concatenate([out[a:b] for a, b in cut.rows], 0) if cut.rows else out[:0]
    if cut.cols is not None:
        out = np.concatenate([out[:, a:b] for a, b in cut.cols], 1) if cut.cols else out[:, :0]
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TP_NAMES)
def test_each_rank_uploads_its_shard(name, world):
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend_mod:
        for r in range(world):
            rank = _rank(backend_mod, rec, name, world, r)
            checked = 0
            for tname, cut in rank.plan.cuts.items():
                info = rank.gguf.tensors[tname]
                full = quants.dequantize(rank.gguf.tensor_bytes(tname), info.type, info.shape)
                want = _expected_shard(full.reshape(tuple(reversed(info.shape))), cut)
                w = rank.weights(tname)
                assert tuple(w.shape) == want.shape, (tname, r, w.shape, want.shape)
                if w.dense is not None:
                    got = np.asarray(w.dense.view(np.ndarray))
                else:
                    raw = np.asarray(w.data.view(np.ndarray))
                    assert raw.nbytes == w.row_bytes * int(np.prod(w.shape[:-1])), tname
                    got = quants.dequantize(raw, w.type, tuple(reversed(w.shape))).reshape(want.shape)
                assert np.array_equal(got, want), f"{name} TP={world} rank {r}: {tname} is not its shard"
                checked += 1
            assert checked == len(rank.plan.cuts) > 0


def test_shard_upload_crosses_staging_buffers(monkeypatch):
    """A shard larger than a staging buffer goes up in chunks through both pinned buffers in
    turn (the TP models' tensors fit one: the buffer is made small here), every byte in place."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, 10_007, dtype=np.uint8)
    with lr.fake_cuda(fake_cupy.Recorder()):
        from brass.backends.cuda import sharded
        monkeypatch.setattr(sharded, "STAGING_BYTES", 1000)
        b = sharded.TPCudaBackend(OneRankOnDevice())
        b._staging = [(m, h[:1000], ev) for m, h, ev in b._staging_buffers()]
        got = b._upload_bytes(raw)
        assert np.array_equal(np.asarray(got.view(np.ndarray)), raw)


def _products(events, reduce_names: set, vocab_names: set):
    """[(event index, output label, weight name)] of the launches that write a partial sum: a
    mat-vec of a row-parallel weight (the output is a decode mat-vec's last buffer), or the
    vocabulary-parallel embedding's get_rows."""
    out = []
    for i, e in enumerate(events):
        if e.get("op") != "launch":
            continue
        names = {_label(a)[2:] for a in e["args"] if (_label(a) or "").startswith("w:")}
        kernel = e["kernel"].split(":")[1]
        # (a tied LM head's mat-vec reads the embedding's table: not a partial sum)
        hit = names & (vocab_names if kernel.startswith("get_rows") else reduce_names)
        if hit:
            assert kernel.startswith(("matvec", "matmul", "get_rows")), e["kernel"]
            out.append([i, _label(e["args"][-1]), hit.pop()])
    # the experts' composition (a MoE layer that does not take the fused kernels): their
    # down mat-vecs by id, then the per-expert scale and the weighted sum of a token's experts,
    # linear in them: the partial sum is the weighted sum's output
    for prod in out:
        i, p = prod[0], prod[1]
        for k in range(i + 1, len(events)):
            e = events[k]
            if e.get("op") != "launch":
                continue
            if e["kernel"] not in COMBINE_EXPERTS or p not in {_label(a) for a in e["args"]}:
                break
            prod[0], prod[1] = i, p = k, _label(e["args"][-1])
    return [tuple(p) for p in out]


def all_reduce_misplaced(events, reduce_names: set, vocab_names: set, held_none: set = frozenset()) -> list[str]:
    """What is wrong with where a decode step's all-reduces are (empty: nothing). `held_none`:
    row-parallel weights the rank holds none of: no product, but their all-reduce (of zeros)
    all the same, so that every rank makes the same collectives."""
    bad = []
    products = _products(events, reduce_names - held_none, vocab_names)
    reduces = [i for i, e in enumerate(events) if e.get("op") == "all_reduce"]
    if len(reduces) != len(products) + len(held_none):
        bad.append(f"{len(reduces)} all-reduces for {len(products)} partial products and "
                   f"{len(held_none)} weights held by other ranks")
    used = {w for _, _, w in products}
    if used != (reduce_names - held_none) | vocab_names:
        bad.append(f"no product of {sorted((reduce_names - held_none) | vocab_names - used)} in the step")
    for i, p, wname in products:
        j = next((k for k in reduces if k > i), None)
        if j is None:
            bad.append(f"{wname}: no all-reduce after its product")
            continue
        between = [events[k]["kernel"] for k in range(i + 1, j) if events[k].get("op") == "launch"]
        if between:
            bad.append(f"{wname}: {between} launched between its product and the all-reduce")
        ar = events[j]
        if _label(ar["in"]) != p and wname not in vocab_names:
            bad.append(f"{wname}: the all-reduce after it sums {ar['in']}, not its product {p}")
        later = [events[k]["kernel"] for k in range(j + 1, len(events))
                 if events[k].get("op") == "launch" and p in {_label(a) for a in events[k]["args"]}]
        if later:
            bad.append(f"{wname}: its partial sum {p} is read by {later[0]} after the all-reduce")
        s = _label(ar.get("out"))
        if not any(events[k].get("op") == "launch" and s in {_label(a) for a in events[k]["args"]}
                   for k in range(j + 1, len(events))):
            bad.append(f"{wname}: nothing reads the all-reduced {s}")
    return bad


def _decode_step_events(name: str, world: int, r: int, break_rank=None, edit_plan=None):
    """The events of rank r's decode step (one token after a 5-token prompt), and the names of
    its row-parallel and vocabulary-parallel weights. `edit_plan(rank)` may change the rank's
    plan before its weights are read; `break_rank(rank)` its weights after (the tests of the
    check)."""
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend_mod:
        from brass.kv_cache import PagedKVCache
        rank = _rank(backend_mod, rec, name, world, r)
        if edit_plan is not None:
            from brass.arch.common import Weights
            edit_plan(rank)
            # the rank uploaded its shards when it was made: read them again under the new plan
            rank.weights = Weights(rank.backend, rank.gguf)
        for tname in rank.gguf.tensors:
            w = rank.weights(tname)
            rec.name(w.data if w.data is not None else w.dense, f"w:{tname}")
        if break_rank is not None:
            break_rank(rank)
        cache = PagedKVCache.private(rank.backend, rank.config, N_CTX)
        V = rank.config.n_vocab
        ids = np.array([(7 + 37 * i) % V for i in range(5)], np.int32)
        rank.forward(ids, np.arange(5, dtype=np.int32), cache, np.array([4], np.int32))
        rec.on = True
        rank.forward(np.array([11 % V], np.int32), np.array([5], np.int32), cache)
        rec.on = False
        reduce_names = {n for n, c in rank.plan.cuts.items() if c.reduce}
        reduce_names |= {n for n, c in rank.plan.cuts.items() if c.experts and "down_exps.weight" in n}
        vocab_names = {"token_embd.weight"}
    return rec.events, reduce_names, vocab_names


# synth-qwen35moe at TP = 2 adds the shared expert's down projection (row-parallel, all-reduced
# on its own) to the TP models' products
@pytest.mark.parametrize("name,world,r", [(n, w, r) for n in TP_NAMES for w, r in ((2, 1), (4, 2))]
                         + [("synth-qwen35moe", 2, 1)])
def test_decode_step_all_reduces_each_partial_before_the_residual(name, world, r):
    events, reduce_names, vocab_names = _decode_step_events(name, world, r)
    bad = all_reduce_misplaced(events, reduce_names, vocab_names)
    assert not bad, f"{name} TP={world} rank {r}:\n  " + "\n  ".join(bad)


def _shared_expert_whole_on_rank_0(rank):
    """The plan of a shared expert too narrow to cut on its blocks (shard.py): rank 0 holds all
    of it, the others none (test_tensor_parallel.py forces it the same way on the numpy ranks)."""
    from brass.distributed.shard import Cut
    for il in range(rank.config.n_layer):
        whole = [(0, 64)] if rank.comm.rank == 0 else []
        for n in ("ffn_gate_shexp", "ffn_up_shexp"):
            rank.plan.cuts[f"blk.{il}.{n}.weight"] = Cut(rows=whole)
        rank.plan.cuts[f"blk.{il}.ffn_down_shexp.weight"] = Cut(cols=whole, reduce=True)


def test_a_rank_holding_none_of_the_shared_expert_all_reduces_zeros():
    """synth-qwen35moe at TP = 2 with its shared expert whole on rank 0: rank 1 launches nothing
    for it, and still makes each of its all-reduces (zeros), as many as rank 0 (a collective
    one rank skips would leave the others waiting)."""
    name = "synth-qwen35moe"
    counts = []
    for r in (0, 1):
        events, reduce_names, vocab_names = _decode_step_events(name, 2, r, edit_plan=_shared_expert_whole_on_rank_0)
        none = {n for n in reduce_names if "shexp" in n} if r else set()
        assert len(none) == (3 if r else 0)
        bad = all_reduce_misplaced(events, reduce_names, vocab_names, none)
        assert not bad, f"{name} TP=2 rank {r}:\n  " + "\n  ".join(bad)
        held = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")    # (not its replicated gate)
        shexp = [e["kernel"] for e in events if e.get("op") == "launch"
                 and any(h in (_label(a) or "") for a in e["args"] for h in held)]
        assert bool(shexp) == (r == 0), (r, shexp)
        counts.append(sum(e.get("op") == "all_reduce" for e in events))
    assert counts[0] == counts[1], counts


def _drop(attr, tensor):
    def go(rank):
        setattr(rank.weights(tensor), attr, None if attr != "reduce" else False)
    return go


@pytest.mark.parametrize("name,tensor,attr", [
    ("synth-tp-qwen3", "blk.0.attn_output.weight", "reduce"),
    ("synth-tp-qwen3", "blk.1.ffn_down.weight", "reduce"),
    ("synth-tp-qwen35", "blk.0.ssm_out.weight", "reduce"),
    ("synth-tp-qwen3moe", "blk.1.ffn_gate_exps.weight", "experts"),
    ("synth-tp-gemma4", "token_embd.weight", "vocab"),
])
def test_the_check_catches_a_dropped_all_reduce(name, tensor, attr):
    """The check above, on a rank whose one hook is taken away (the weight no longer says it is
    row-parallel, expert-parallel or vocabulary-parallel): it names what is missing."""
    events, reduce_names, vocab_names = _decode_step_events(name, 2, 1, _drop(attr, tensor))
    bad = all_reduce_misplaced(events, reduce_names, vocab_names)
    assert bad, f"dropping {tensor}'s all-reduce went unseen"


@pytest.mark.parametrize("name", TP_NAMES)
def test_a_model_of_cuda_ranks_runs_its_steps(name):
    """TPModel(backend="cuda", comm="host") end to end on the fake (one rank: the fake's
    recorder is not for several threads at once): greedy tokens through each rank's two numbers
    a row (row_max) and the small all-gather, whole logits gathered to the host, the ranks'
    backends TPCudaBackend over the host-staged communicator, decoding eagerly. Kernels do not
    run: the values are the fake's zeros, the shapes and the path are what is checked."""
    from brass.distributed.tp import TPModel
    from brass.errors import UnsupportedError
    with lr.fake_cuda(fake_cupy.Recorder()):
        from brass.backends.cuda.sharded import TPCudaBackend
        from brass.distributed.cuda_rank import HostStagedCommunicator
        m = TPModel(goldens.model(name).path(), 1, backend="cuda", comm="host")
        try:
            rank = m.ranks[0]
            assert isinstance(rank.backend, TPCudaBackend) and isinstance(rank.comm, HostStagedCommunicator)
            assert not rank.backend.supports_graphs
            with pytest.raises(UnsupportedError, match="cannot be captured"):
                rank.backend.capture(lambda: None)
            p = goldens.prompts(name)[0]
            assert m.score(p.tf_ids[:6]).shape == (6, m.config.n_vocab)
            # every logit equal (the fake's zeros): the lowest id wins, as argmax of the whole row
            assert list(m.generate(p.prompt_ids[:4], max_tokens=3, stop_at_eog=False)) == [0] * 3
        finally:
            m.close()


class OneRankOnDevice:
    """A capturable communicator of one rank that stays on the device, as NCCL's of one rank:
    its in-place all-reduce leaves the array as it is."""
    rank, world_size, capturable = 0, 1, True

    def all_reduce(self, x):
        return x


def _generate_events(name: str, tp: bool) -> list[dict]:
    """The events of greedy generation (3 tokens after a 7-token prompt: the first decode step
    eager, then captured as the decode graph and replayed) on the single-GPU model, or with
    `tp` on a TP = 1 rank's TPCudaBackend over OneRankOnDevice."""
    import brass
    from brass import flags
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec):
        path = str(goldens.model(name).path())
        backend = "cuda"
        if tp:
            from brass import arch
            from brass.backends.cuda.sharded import TPCudaBackend
            from brass.config import read_config
            gf = GGUFFile(path)
            cfg = arch.get(gf.architecture).configure(read_config(gf, gf.architecture), gf)
            # own_cublas as Model sets it for a backend it makes
            backend = TPCudaBackend(OneRankOnDevice(), tensor_parallel(gf, cfg, 1, 0),
                                    own_cublas=flags.get("BRASS_PROMPT_GRAPHS"))
            gf.close()
        m = brass.load(path, backend=backend, quiet=True)
        lr._name_weights(rec, m)
        rec.on = True
        s = m.new_session(lr.N_CTX)
        lr._name_cache(rec, s, "s0")
        ids = [(1 + 37 * i) % m.config.n_vocab for i in range(7)]
        rec.event(op="tokens", ids=list(m.generate(ids, max_tokens=3, stop_at_eog=False, session=s)))
        rec.on = False
        assert s._step is not None, "no decode graph was captured"
    return rec.events


@pytest.mark.parametrize("name", TP_NAMES)
def test_one_rank_in_the_decode_graph_launches_what_one_gpu_launches(name):
    """A TP = 1 rank over a capturable communicator (as NCCL's) runs the single-GPU model's
    launches, copies and captures, event for event, its decode graph included: its shards are
    whole tensors, its all-reduces of one rank queue nothing, and nothing in its step
    synchronises with the host (the fake refuses that inside a capture, as CUDA does)."""
    one, tp = _generate_events(name, False), _generate_events(name, True)
    assert any(e.get("op") == "capture_begin" for e in one)
    diff = lr.first_difference(one, tp)
    assert diff is None, f"{name}: the TP = 1 rank's events differ from one GPU's:\n{diff}"


class CapturableRecordingComm(RecordingComm):
    """RecordingComm made capturable (as NCCL's, whose collectives queue on the stream: here
    the all-reduce of one rank, a copy on the device), and a peer that holds the same two numbers
    a row for the argmax's all-gather."""

    def __init__(self, rec, world: int, rank: int):
        super().__init__(rec, world, rank)
        self.capturable = True

    def all_reduce(self, x):
        self.rec.event(op="all_reduce", **{"in": self.rec.desc(x)})
        return x

    def all_gather(self, x, axis: int = -1):
        return np.concatenate([x] * self.world_size, axis=axis)


@pytest.mark.parametrize("name", TP_NAMES)
def test_a_rank_over_a_capturable_communicator_decodes_through_a_graph(name):
    """Rank 1 of 2 over a capturable communicator (as NCCL's in the worker processes): its
    first one-token step runs eagerly, then is captured with every all-reduce of the eager
    step inside the graph (nothing in it waits for the host: the fake refuses that inside a
    capture), and later steps replay it; a session freed lets its graph go."""
    from brass.distributed.tp import Command, Rank
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec) as backend_mod:
        rank = _rank(backend_mod, rec, name, 2, 1)
        rank = Rank(rank.gguf.path, CapturableRecordingComm(rec, 2, 1), plan=rank.plan, backend=type(rank.backend))
        assert rank.graphs
        V = rank.config.n_vocab
        rank.handle(Command("new", 1, n_ctx=N_CTX))
        rank.handle(Command("step", 1, ids=np.arange(5, dtype=np.int32) % V, pos=np.arange(5, dtype=np.int32),
                            rows=np.array([4], np.int32), want="argmax"))
        rec.on = True
        for i in range(3):
            rank.handle(Command("step", 1, ids=np.array([(3 + i) % V], np.int32), pos=np.array([5 + i], np.int32),
                                rows=np.array([0], np.int32), want="argmax"))
        rec.on = False
        ops = [e.get("op") for e in rec.events]
        begin, end = ops.index("capture_begin"), ops.index("capture_end")
        eager = ops[:begin].count("all_reduce")
        assert eager > 0 and ops[begin:end].count("all_reduce") == eager
        assert ops[end:].count("graph_launch") == 2 and ops[end:].count("all_reduce") == 0
        assert 1 in rank.decode_steps
        rank.handle(Command("free", free=(1,)))
        assert not rank.decode_steps and not rank.sessions


def test_cuda_ranks_refuse_what_they_cannot_take():
    from brass.distributed.tp import TPModel
    from brass.errors import BrassError
    path = goldens.model(TP_NAMES[0]).path()
    with pytest.raises(BrassError, match="take the communicator 'host', not 'nccl'"):
        TPModel(path, 2, backend="cuda", comm="nccl")
    with pytest.raises(BrassError, match="backend must be one of numpy, cuda"):
        TPModel(path, 2, backend="rocm")
    with pytest.raises(BrassError, match="the cuda ranks in processes take the communicator 'nccl' or 'host', not 'thread'"):
        TPModel(path, 2, ranks="processes", backend="cuda", comm="thread")


# -- on the CPU: NCCL through a stand-in of CuPy 14's binding (fake_nccl.py) -------------------

def test_the_nccl_communicator_calls_cupys_binding_as_it_is_declared():
    """brass.distributed.nccl against CuPy 14's binding as compiled (fake_nccl.py holds its
    signatures and types): the unique id as bytes, each call's arguments in the binding's order
    and C types (device pointers, an element count, nccl.h's data type and operation), on the
    stream the communicator was given; the all-reduce in place, summed over the ranks; a send
    met by its receive; the all-gather of one rank (its concatenation reads NCCL's buffer at
    once, which the stand-in fills only in a rank's own call); nothing after an abort."""
    from conformance.harness import fake_nccl
    with lr.fake_cuda(fake_cupy.Recorder()):
        fake_nccl.install()
        import cupy
        from brass.distributed import nccl
        uid = nccl.unique_id()
        assert isinstance(uid, bytes) and len(uid) == fake_nccl.NCCL_UNIQUE_ID_BYTES
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        comms = [nccl.NcclCommunicator(2, uid, r, stream=streams[r]) for r in range(2)]
        for dtype in (np.float32, np.int32, np.int64, np.float16):
            xs = [cupy.asarray(np.array([3, -2, 5], dtype) * (r + 1)) for r in range(2)]
            outs = [c.all_reduce(x) for c, x in zip(comms, xs)]
            assert all(o is x for o, x in zip(outs, xs)), "the all-reduce is NCCL's, in place"
            for o in outs:
                assert o.dtype == dtype and np.array_equal(cupy.asnumpy(o), [9, -6, 15]), dtype
        x = cupy.asarray(np.arange(4, dtype=np.float32))
        comms[0].send(x, 1)
        got = comms[1].recv_into(cupy.zeros(4, np.float32), 0)
        assert np.array_equal(cupy.asnumpy(got), [0, 1, 2, 3])
        assert {(c["rank"], c["stream"]) for c in fake_nccl.calls} == {(r, streams[r].ptr) for r in range(2)}
        one = nccl.NcclCommunicator(1, nccl.unique_id(), 0, stream=streams[0])
        row = cupy.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
        assert np.array_equal(cupy.asnumpy(one.all_gather(row, axis=-1)), np.arange(6).reshape(2, 3))
        comms[1].abort()
        with pytest.raises(fake_nccl.NcclError, match="aborted"):
            comms[1].all_reduce(cupy.zeros(2, np.float32))


def test_an_nccl_bootstrap_that_cannot_start_is_one_line(monkeypatch):
    """NCCL's unique id opens its bootstrap's socket in rank 0 before any rank starts; where it
    cannot (CuPy raises its NcclError), TPModel over NCCL fails in one line, not a traceback."""
    from conformance.harness import fake_nccl
    from brass.distributed.tp import TPModel
    from brass.errors import BrassError

    def fails():
        raise fake_nccl.NcclError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error (run with NCCL_DEBUG=INFO\n"
                                  "for details)")
    with lr.fake_cuda(fake_cupy.Recorder()):
        fake_nccl.install()
        monkeypatch.setattr(fake_nccl, "get_unique_id", fails)
        with pytest.raises(BrassError) as e:
            TPModel(goldens.model(TP_NAMES[0]).path(), 1, backend="cuda", ranks="processes")
    assert str(e.value) == ("NCCL could not start the ranks' rendezvous (its unique id: NcclError: "
                            "NCCL_ERROR_SYSTEM_ERROR: unhandled system error (run with NCCL_DEBUG=INFO for details))")


@pytest.mark.parametrize("name,edit", [(n, None) for n in TP_NAMES]
                         + [("synth-qwen35moe", None), ("synth-qwen35moe", "shexp-on-rank-0")])
def test_nccl_ranks_make_the_same_collectives_in_the_same_order(name, edit):
    """TP = 2 over NCCL (nccl_backend, one process's two ranks in turn): a prompt, a one-token
    step and its capture make, on each rank, the same all-reduces in the same order, each of
    the same count and data type (NCCL checks none of it across ranks: on the GPU a mismatch
    hangs or reads past a buffer), none left unmatched, each on its backend's stream; so too
    with the shared expert whole on rank 0 (rank 1 all-reduces zeros of the same shape)."""
    from types import SimpleNamespace
    from conformance.harness import fake_nccl
    from brass import arch
    from brass.config import read_config
    from brass.distributed.tp import Rank
    from brass.kv_cache import PagedKVCache
    path = goldens.model(name).path()
    gf = GGUFFile(path)
    cfg = arch.get(gf.architecture).configure(read_config(gf, gf.architecture), gf)
    plans = [tensor_parallel(gf, cfg, 2, r) for r in range(2)]
    gf.close()
    if edit:
        for r, plan in enumerate(plans):
            _shared_expert_whole_on_rank_0(SimpleNamespace(comm=SimpleNamespace(rank=r), config=plan.config, plan=plan))
    with lr.fake_cuda(fake_cupy.Recorder()):
        fake_nccl.install()
        from brass.distributed import nccl
        from brass.distributed.cuda_rank import nccl_backend
        uid = nccl.unique_id()
        made = []
        for r in range(2):
            b = nccl_backend(plans[r], uid)
            rank = Rank(path, b.comm, plan=plans[r], backend=lambda comm, plan, b=b: b)
            with b.activate():
                cache = PagedKVCache.private(b, rank.config, N_CTX)
                tok, pos = b.zeros((1,), np.int32), b.zeros((1,), np.int32)
            made.append((rank, cache, tok, pos))
        V = cfg.n_vocab
        ids = np.array([(7 + 37 * i) % V for i in range(5)], np.int32)
        for rank, cache, tok, pos in made:
            rank.forward(ids, np.arange(5, dtype=np.int32), cache, np.array([4], np.int32))
            rank.forward(np.array([11 % V], np.int32), np.array([5], np.int32), cache)
            rank.backend.capture(lambda rank=rank, tok=tok, pos=pos, cache=cache: rank.forward(tok, pos, cache))
        group = fake_nccl._groups[uid]
        assert not group.pending, f"collectives left unmatched: {sorted(group.pending)}"
        per_rank = [[c for c in fake_nccl.calls if c.get("rank") == r] for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        assert [c["capturing"] for c in per_rank[0]] == [c["capturing"] for c in per_rank[1]]
        for r, (rank, *_) in enumerate(made):   # on the stream the rank's graph is captured on
            assert {c["stream"] for c in per_rank[r]} == {rank.backend.stream.ptr}


@pytest.mark.parametrize("name", TP_NAMES)
def test_a_layer_split_hands_over_through_nccl_as_cupys_binding_takes_it(name):
    """--split layer --backend cuda over NCCL, its two stages run in turn in this process on the
    fake (the GPU runs it only on two GPUs): the first stage's residual stream goes as a header
    through the host and its device arrays through NCCL's send, each received by the next stage
    into an array of its own device of the header's shape and dtype (the stand-in binding
    matches count and data type), each on its stage's backend stream, none left unmatched; the
    last stage answers the greedy token."""
    from conformance.harness import fake_nccl
    from brass.distributed.tp import Command, make_rank
    path = goldens.model(name).path()
    with lr.fake_cuda(fake_cupy.Recorder()):
        fake_nccl.install()
        from brass.distributed import nccl
        from brass.distributed.cuda_rank import NcclRank, rank_factory
        uid, host = nccl.unique_id(), ThreadGroup(2)
        ranks = [make_rank(path, NcclRank(nccl.NcclCommunicator(2, uid, r), host.comm(r)), "layer", rank_factory(0))
                 for r in range(2)]
        V = ranks[0].config.n_vocab
        steps = [Command("new", 1, n_ctx=N_CTX),
                 Command("step", 1, ids=np.arange(5, dtype=np.int32) % V, pos=np.arange(5, dtype=np.int32),
                         rows=np.array([4], np.int32), want="argmax"),
                 Command("step", 1, ids=np.array([3 % V], np.int32), pos=np.array([5], np.int32),
                         rows=np.array([0], np.int32), want="argmax")]
        for cmd in steps:
            got = [rank.handle(cmd) for rank in ranks]
            if cmd.op == "step":
                assert got == [None, 0]         # the last stage's token (the fake's zeros: the lowest id)
        calls = {op: [c for c in fake_nccl.calls if c["op"] == op] for op in ("send", "recv")}
        assert calls["send"] and len(calls["send"]) == len(calls["recv"])
        assert {c["stream"] for c in calls["send"]} == {ranks[0].backend.stream.ptr}
        assert {c["stream"] for c in calls["recv"]} == {ranks[1].backend.stream.ptr}
        assert not any(fake_nccl._groups[uid].sends.values()), "a send no stage received"


def test_a_model_of_one_nccl_rank_in_processes_runs_its_steps():
    """TPModel(..., backend="cuda", ranks="processes") of one rank (the GPU test's TP = 1 over
    NCCL, here on the fake CuPy and the stand-in binding): rank 0 built in its start thread,
    its steps run in its daemon thread, a session's one-token steps replayed from the graph
    captured after the first, every all-reduce on the rank's backend stream (the graph's),
    greedy tokens through the pipes' all-gather."""
    from conformance.harness import fake_nccl
    from brass.distributed.tp import TPModel
    with lr.fake_cuda(fake_cupy.Recorder()):
        fake_nccl.install()
        tp = TPModel(goldens.model(TP_NAMES[0]).path(), 1, backend="cuda", ranks="processes")
        try:
            rank = tp.ranks[0]
            assert type(rank.comm).__name__ == "NcclRank" and rank.graphs
            s = tp.new_session(N_CTX)
            assert np.asarray(s.prefill([1, 2, 3, 4, 5])).shape == (1, tp.config.n_vocab)
            prompt = len(fake_nccl.calls)
            for t in (6, 7, 8):
                s.decode(t)
            k = len(fake_nccl.calls) - prompt
            # the first one-token step eager, then captured with the same all-reduces; replays call none
            assert prompt and k and [c["capturing"] for c in fake_nccl.calls[prompt:]] == [False] * (k // 2) + [True] * (k // 2)
            assert s.sid in rank.decode_steps
            assert list(tp.generate([1, 2, 3], 4, stop_at_eog=False)) == [0] * 4     # the fake's zeros
            assert {c["stream"] for c in fake_nccl.calls} == {rank.backend.stream.ptr}
        finally:
            tp.close()


def test_a_cuda_rank_in_its_process_runs_nccl_on_its_backends_stream():
    """The process path's NCCL rank (workers.build_rank: communicator(), cuda_rank.NcclRank,
    rank_factory) built as a worker builds it, here the one rank of a group on the fake CuPy:
    every all-reduce of its steps goes to NCCL on the stream of the rank's backend, the stream
    its decode graph is captured on (NCCL on another stream would be outside the graph: on the
    GPU, a capture error or a collective that runs once at capture and never at replay); the
    one-token step captured with as many all-reduces as its eager run, and replayed without a
    call; the greedy all-gather of host numbers through the pipes."""
    from conformance.harness import fake_nccl
    from brass.distributed.comm import ProcessGroup
    from brass.distributed.tp import Command
    from brass.distributed.workers import WorkerSpec, build_rank
    name = TP_NAMES[0]
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec):
        fake_nccl.install()
        from brass.distributed import nccl
        spec = WorkerSpec(0, 1, str(goldens.model(name).path()), "tensor", uid=nccl.unique_id(), device=0,
                          comm="nccl", backend="cuda")
        comm, rank = build_rank(spec, ProcessGroup(1).ends(0))
        try:
            assert type(comm).__name__ == "NcclRank" and rank.graphs
            V = rank.config.n_vocab
            rank.handle(Command("new", 1, n_ctx=N_CTX))
            got = rank.handle(Command("step", 1, ids=np.arange(5, dtype=np.int32) % V,
                                      pos=np.arange(5, dtype=np.int32), rows=np.array([4], np.int32), want="argmax"))
            assert got == 0         # every logit the fake's zero: the lowest id
            prompt = len(fake_nccl.calls)
            for i in range(3):
                rank.handle(Command("step", 1, ids=np.array([(3 + i) % V], np.int32),
                                    pos=np.array([5 + i], np.int32), rows=np.array([0], np.int32), want="argmax"))
            calls = fake_nccl.calls
            assert prompt and {c["op"] for c in calls} == {"allReduce"}
            stream = rank.backend.stream.ptr
            assert stream != 0 and {c["stream"] for c in calls} == {stream}, \
                "NCCL's calls are not on the rank's backend stream"
            k = sum(not c["capturing"] for c in calls[prompt:])
            assert k and [c["capturing"] for c in calls[prompt:]] == [False] * k + [True] * k, \
                "the first one-token step eager, then captured with the same all-reduces, then replays alone"
            assert 1 in rank.decode_steps
        finally:
            comm.close("done")


# -- on a GPU -----------------------------------------------------------------------------------

def _cuda_single(name: str):
    return cuda_single(goldens.model(name).path())


def _cuda_tp(name: str, world: int):
    from brass.distributed.tp import TPModel
    return TPModel(goldens.model(name).path(), world, backend="cuda", comm="host")


def _greedy_with_margins(m, ids, n):
    """TP = 1 CUDA's greedy tokens after `ids`, decoded eagerly, and each step's top-1/top-2
    margin."""
    s = m.new_session(len(ids) + n + 1)
    s.graphs = False
    logits = s.prefill(ids)
    toks, margins = [], []
    for i in range(n):
        row = np.asarray(logits, np.float32)[-1]
        top = np.sort(row)[-2:]
        toks.append(int(row.argmax()))
        margins.append(float(top[1] - top[0]))
        if i + 1 < n:
            logits = m.backend.to_numpy(s.decode(toks[-1]))
    return toks, margins


@requires_cuda
@pytest.mark.parametrize("name", TP_NAMES)
def test_one_cuda_rank_equals_the_single_gpu_model(name):
    single, tp = _cuda_single(name), _cuda_tp(name, 1)
    try:
        for p in goldens.prompts(name)[:2]:
            assert np.array_equal(tp.score(p.tf_ids), single.score(p.tf_ids)), p.name
    finally:
        tp.close()


@requires_cuda
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TP_NAMES)
def test_cuda_tp_against_one_gpu_and_the_numpy_tp(name, world):
    from brass.distributed.tp import TPModel
    from brass.model import Model
    single, tp = _cuda_single(name), _cuda_tp(name, world)
    path = goldens.model(name).path()
    numpy_one, numpy_tp = Model(path, backend="numpy"), TPModel(path, world)
    try:
        for p in goldens.prompts(name):
            # the numpy TP of the same world: the two backends differ at TP = 1 by d1; each TP
            # is within TP_NMSE of its own TP = 1, so (NMSE's square root being a distance, the
            # normalisers nearly equal) the two TPs are within (sqrt(d1) + 2 sqrt(TP_NMSE))^2
            ref = single.score(p.tf_ids)
            d1 = nmse(numpy_one.score(p.tf_ids), ref)
            bound = (np.sqrt(d1) + 2 * np.sqrt(TP_NMSE)) ** 2
            d = nmse(tp.score(p.tf_ids), numpy_tp.score(p.tf_ids))
            assert d <= bound, f"{name} TP={world} {p.name}: {d:.2e} from the numpy TP > {bound:.2e}"
        _hold_to_one_gpu(name, world, single, tp)
    finally:
        tp.close()
        numpy_tp.close()


def _hold_to_one_gpu(name: str, world: int, single, tp, label: str = "CUDA"):
    """`tp` (a TPModel of `world` CUDA ranks) against TP = 1 CUDA (`single`), under
    test_tensor_parallel.py's bound and its reason: logits NMSE <= TP_NMSE and no argmax flip
    where TP = 1's margin exceeds TP_MARGIN, on every prompt; greedy tokens equal up to the first
    step whose margin is below it."""
    worst = 0.0
    for p in goldens.prompts(name):
        ref, got = single.score(p.tf_ids), tp.score(p.tf_ids)
        worst = max(worst, nmse(got, ref))
        bad, _ = _disagreements(got, ref, TP_MARGIN)
        assert not len(bad), f"{name} TP={world} {label} {p.name}: argmax differs from TP=1 CUDA at {list(bad)}"
    print(f"{name} TP={world} {label}: logits NMSE vs TP=1 CUDA {worst:.2e}")
    assert worst <= TP_NMSE, f"{name} TP={world} {label}: logits NMSE {worst:.2e} from TP=1 CUDA > {TP_NMSE}"
    compared = 0
    for p in goldens.prompts(name):
        if compared >= STREAM_TOKENS:
            break
        n = len(p.generated_ids)
        ref, margins = _greedy_with_margins(single, p.prompt_ids, n)
        ours = list(tp.generate(p.prompt_ids, max_tokens=n, stop_at_eog=False))
        k = next((i for i, m in enumerate(margins) if m < TP_MARGIN), n)
        assert ours[:k] == ref[:k], f"{name} TP={world} {label} {p.name}: {ours[:k]} vs TP=1 CUDA {ref[:k]}"
        compared += k
    assert compared >= STREAM_TOKENS, f"only {compared} greedy tokens before near-ties"


@requires_cuda
@pytest.mark.parametrize("name", TP_NAMES)
def test_one_nccl_rank_in_the_decode_graph_equals_the_single_gpu_model(name):
    """TP = 1 through NCCL (a communicator of one rank on the backend's stream): its all-reduces
    are captured in the decode graph, whose logits and greedy tokens are the single-GPU model's,
    bit for bit."""
    from brass import arch, flags
    from brass.config import read_config
    from brass.distributed import nccl
    from brass.distributed.cuda_rank import nccl_backend
    from brass.model import Model
    path = goldens.model(name).path()
    gf = GGUFFile(path)
    cfg = arch.get(gf.architecture).configure(read_config(gf, gf.architecture), gf)
    plan = tensor_parallel(gf, cfg, 1, 0)
    gf.close()
    # own_cublas as Model gives the plain model (its prompt graphs' setting)
    b = nccl_backend(plan, nccl.unique_id(), own_cublas=flags.get("BRASS_PROMPT_GRAPHS"))
    assert b.supports_graphs
    captured = []
    reduce = b.comm.all_reduce

    def counted(x):
        if b._graph_refs is not None:           # inside a capture
            captured.append(x.shape)
        return reduce(x)
    b.comm.all_reduce = counted
    m = Model(path, backend=b, quiet=True, graphs=True)
    plain = Model(path, backend="cuda", quiet=True, graphs=True)
    rng = np.random.default_rng(49)
    ids = [int(t) for t in rng.integers(0, cfg.n_vocab, 9)]
    follow = [int(t) for t in rng.integers(0, cfg.n_vocab, 6)]
    runs = []
    for model in (m, plain):
        s = model.new_session(128)
        s.prefill(ids)
        runs.append([model.backend.to_numpy(s.decode(t)).copy() for t in follow])
        assert s._step is not None, "no decode graph was captured"
    for i, (a, c) in enumerate(zip(*runs)):
        assert np.array_equal(a, c), f"decode step {i}: the NCCL rank's graph logits differ (max |diff| {np.abs(a - c).max():.3g})"
    layers_moe = sum(1 for n in plan.cuts if n.endswith("ffn_down_exps.weight"))
    want = 1 + sum(1 for c in plan.cuts.values() if c.reduce) + layers_moe
    assert len(captured) >= want, f"{len(captured)} all-reduces captured, {want} a decode step"
    greedy = [list(model.generate(ids, 24, stop_at_eog=False, session=model.new_session(128))) for model in (m, plain)]
    assert greedy[0] == greedy[1]


# -- on a GPU: CUDA ranks in processes (workers.py) ---------------------------------------------

def _gpus() -> int:
    from brass.distributed.tp import gpu_count
    return gpu_count()


requires_two_gpus = pytest.mark.skipif(
    _gpus() < 2, reason="TP = 2 over NCCL needs two GPUs (NCCL cannot put two ranks of one communicator "
                        "on one device): ci/gpu.sh tp cuda on nvidia-h100-x2 runs it")


@requires_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TP_NAMES)
def test_cuda_ranks_in_processes_over_host_give_the_threads_bits(name):
    """TP = 2 CUDA ranks in two processes sharing the one GPU over "host" (device -> host, the
    pipes' sum in rank order -> device) against the same ranks in threads over the host-staged
    communicator (ThreadGroup's sum in the same order): the same kernels on the same shards and
    the same sums in the same order, so the same bits."""
    from brass.distributed.tp import TPModel
    path = goldens.model(name).path()
    procs = TPModel(path, 2, backend="cuda", ranks="processes", comm="host")
    threads = _cuda_tp(name, 2)
    try:
        assert not procs.ranks[0].graphs         # host-staged: eager
        assert_same_bits(procs, threads, goldens.prompts(name))
    finally:
        procs.close()
        threads.close()


@requires_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TP_NAMES)
def test_one_nccl_rank_in_processes_decodes_in_a_graph_as_one_gpu(name):
    """TPModel(..., ranks="processes") of one rank on the one GPU: rank 0's NCCL communicator
    of one rank (the pipes for host arrays) and its decode graph, captured with the all-reduces
    inside; its decode logits and greedy tokens are the single-GPU model's, bit for bit."""
    from brass import flags
    from brass.distributed.tp import TPModel
    from brass.model import Model
    path = goldens.model(name).path()
    tp = TPModel(path, 1, backend="cuda", ranks="processes")
    plain = Model(path, backend="cuda", quiet=True, graphs=True, prompt_graphs=False,
                  own_cublas=flags.get("BRASS_PROMPT_GRAPHS"))
    try:
        rank = tp.ranks[0]
        assert rank.graphs and type(rank.comm).__name__ == "NcclRank"
        rng = np.random.default_rng(49)
        ids = [int(t) for t in rng.integers(0, tp.config.n_vocab, 9)]
        follow = [int(t) for t in rng.integers(0, tp.config.n_vocab, 6)]
        s, q = tp.new_session(128), plain.new_session(128)
        s.prefill(ids)
        q.prefill(ids)
        for i, t in enumerate(follow):
            a, c = np.asarray(s.decode(t)), plain.backend.to_numpy(q.decode(t))
            assert np.array_equal(a.reshape(c.shape), c), f"decode step {i}: the graph's logits differ"
        assert s.sid in rank.decode_steps, "no decode graph was captured"
        assert list(tp.generate(ids, 24, stop_at_eog=False)) == list(plain.generate(ids, 24, stop_at_eog=False))
    finally:
        tp.close()


@requires_cuda
@requires_two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", TP_NAMES)
def test_nccl_ranks_in_processes_against_one_gpu(name):
    """TP = 2 over NCCL, one process per GPU (what `brass ... --tp 2 --backend cuda` runs):
    within the TP bound of TP = 1 CUDA (_hold_to_one_gpu), its greedy tokens decoded through
    each rank's captured graph (NCCL's all-reduces inside)."""
    from brass.distributed.tp import TPModel
    tp = TPModel(goldens.model(name).path(), 2, backend="cuda", ranks="processes")
    single = _cuda_single(name)
    try:
        assert tp.ranks[0].graphs and type(tp.ranks[0].comm).__name__ == "NcclRank"
        _hold_to_one_gpu(name, 2, single, tp, "NCCL")
        assert tp.ranks[0].decode_steps, "no decode graph was captured"
    finally:
        tp.close()
