"""Which part of each GGUF tensor a rank holds, for tensor parallelism (Megatron-style), and the
rank's own config (its head counts), with a one-line error where the shapes do not divide.

- Attention: the query heads are cut into contiguous ranges, one per rank; q (and its bias, and
  qwen35's per-head gate rows) by output rows, column-parallel. Attention maps query head h to
  KV head h // (H / H_kv) (grouped: engine/backends/base.py attention, ggml's broadcast in
  mul_mat), so a rank's KV heads are those its query heads read: a contiguous range when TP
  divides H_kv; when TP is a multiple of H_kv each rank's query heads fall in one group and
  that KV head is held by TP / H_kv ranks (replicated, as vLLM does). The KV cache, built from
  the rank's config, holds only those heads. attn_output is cut by input columns
  (row-parallel): each rank's product is a partial sum, all-reduced.
- Gated delta-net (qwen35): value head h reads key head h mod Hk (tiled, unlike attention), so
  a rank holds a contiguous range of key heads and the value heads h with h mod Hk in it: a
  strided set, in ascending order, which keeps the local map h_l mod Hk_l. With TP a multiple
  of Hk, each key head is replicated over TP / Hk ranks, which share its value heads. q/k/v
  rows of attn_qkv, the conv's channels, attn_gate, ssm_beta/alpha/dt/a follow the heads;
  ssm_out is cut by the value heads' columns, all-reduced. The recurrent state follows the
  config (value heads).
- Dense FFN: gate/up by output rows, down by input columns (all-reduced); the same for the
  shared expert of qwen35moe, or, where its width does not cut on its blocks, the whole of it on
  rank 0 (the others hold none and add zeros).
- MoE: expert parallel. Each rank holds E / TP whole experts (a range of the 3-D tensors'
  first axis: no block is ever cut); the router is replicated, every rank routes every token,
  computes its own experts' share and the shares are all-reduced.
- Token embedding and LM head: vocabulary-parallel, contiguous row ranges (uneven where TP
  does not divide the vocabulary: rows are whole). The embedding looks up the rank's ids and
  zeros the rest, all-reduced (exact: one non-zero term); the LM head gives each rank its
  logits, combined by small collectives (vocab.py).
- Norm weights, rope factors and biases added after an all-reduce: replicated.

A quantized block is never cut: a row (output) cut falls between rows, a column cut must fall
on a block boundary of the tensor's type (32 values, 256 for the k-quants). Where it would
not, the plan refuses with one line naming the tensor, its type and the cut.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..errors import BrassError
from ..gguf import BLOCK_SIZES


class ShardError(BrassError):
    """The model's shapes do not divide among the ranks."""


@dataclass
class Cut:
    """A rank's part of one tensor. Runs are half-open ranges in numpy order: `rows` on the
    output axis (the first axis of a 1-D tensor), `cols` on the input axis (the contiguous one,
    in values), `experts` on a 3-D tensor's first axis (or a per-expert vector's)."""
    rows: list[tuple[int, int]] | None = None
    cols: list[tuple[int, int]] | None = None
    experts: tuple[int, int] | None = None
    reduce: bool = False            # the mat-mul gives a partial sum (row-parallel)
    vocab: tuple[int, int] | None = None    # vocabulary-parallel rows (embedding, LM head)


@dataclass
class Plan:
    world: int
    rank: int
    config: object                  # the rank's ModelConfig
    cuts: dict[str, Cut] = field(default_factory=dict)

    def cut(self, name: str) -> Cut | None:
        return self.cuts.get(name)


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of n items (the first n % world ranks get one more)."""
    return n * rank // world, n * (rank + 1) // world


def _even(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ShardError(f"--tp {world} does not divide the model: {what} is {n}, not a multiple of {world}")
    k = n // world
    return rank * k, (rank + 1) * k


def _runs(heads: list[int], width: int, offset: int = 0) -> list[tuple[int, int]]:
    """Row or column runs of `width` per head for the ascending head list, merged."""
    runs: list[list[int]] = []
    for h in heads:
        a, b = offset + h * width, offset + (h + 1) * width
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


def kv_heads(n_head: int, n_kv: int, world: int, rank: int, where: str):
    """(query heads, KV heads) of a rank, both contiguous ranges, for grouped attention."""
    q0, q1 = _even(n_head, world, rank, f"{where}'s query head count")
    if n_kv % world == 0:
        k = n_kv // world
        return (q0, q1), (rank * k, (rank + 1) * k)
    if world % n_kv == 0:
        kv = q0 // (n_head // n_kv)
        return (q0, q1), (kv, kv + 1)
    raise ShardError(f"--tp {world} does not divide the model: {where} has {n_kv} KV heads "
                     f"(TP must divide the KV head count or be a multiple of it)")


def delta_heads(n_k: int, n_v: int, world: int, rank: int, where: str):
    """(key heads, value heads) of a rank in a gated delta-net (value head h reads key head
    h mod n_k): a contiguous key range, and the ascending value heads that read it."""
    if n_v % world:
        raise ShardError(f"--tp {world} does not divide the model: {where} has {n_v} value heads, "
                         f"not a multiple of {world}")
    if n_k % world == 0:
        k = n_k // world
        keys = list(range(rank * k, (rank + 1) * k))
        return keys, [h for h in range(n_v) if h % n_k in keys]
    if world % n_k == 0:
        rep = world // n_k                      # ranks sharing one key head
        key = rank // rep
        mine = [h for h in range(n_v) if h % n_k == key]
        a, b = split_range(len(mine), rep, rank % rep)
        return [key], mine[a:b]
    raise ShardError(f"--tp {world} does not divide the model: {where} has {n_k} key heads "
                     f"(TP must divide the key head count or be a multiple of it)")


def _check_cols(gf, name: str, runs, world: int):
    t = gf.tensors[name]
    blk = BLOCK_SIZES[t.type][0]
    for a, b in runs:
        for c in (a, b):
            if c % blk:
                raise ShardError(f"--tp {world} would cut a quantized block: {name} ({t.type.name}, "
                                 f"rows of {t.shape[0]}) at column {c}, not a multiple of its "
                                 f"{blk}-value blocks")


def tensor_parallel(gf, cfg, world: int, rank: int) -> Plan:
    """The plan of rank `rank` of `world` for the model in `gf` (configured `cfg`)."""
    local = copy.deepcopy(cfg)
    cuts: dict[str, Cut] = {}
    names = set(gf.tensors)

    def rows_of(name):              # the output (row) count of a 2-D tensor, numpy order
        return gf.tensors[name].shape[1]

    def put(name, cut):
        if name in names:
            if cut.cols:
                _check_cols(gf, name, cut.cols, world)     # (a rank holding none: no cut)
            cuts[name] = cut

    V = rows_of("token_embd.weight")
    vr = split_range(V, world, rank)
    put("token_embd.weight", Cut(rows=[vr], vocab=vr))
    if "output.weight" in names:
        Vo = rows_of("output.weight")
        vo = split_range(Vo, world, rank)
        put("output.weight", Cut(rows=[vo], vocab=vo))

    H = cfg.n_head
    kv_arr = []
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        where = f"layer {il}"
        if cfg.is_recurrent(il):
            Hk, Hv, D = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state
            keys, vals = delta_heads(Hk, Hv, world, rank, where)
            qkv = _runs(keys, D) + _runs(keys, D, Hk * D) + _runs(vals, D, 2 * Hk * D)
            put(p + "attn_qkv.weight", Cut(rows=qkv))
            put(p + "ssm_conv1d.weight", Cut(rows=qkv))
            put(p + "attn_gate.weight", Cut(rows=_runs(vals, D)))
            for n in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
                put(p + n, Cut(rows=_runs(vals, 1)))
            put(p + "ssm_out.weight", Cut(cols=_runs(vals, D), reduce=True))
            local.ssm_n_group, local.ssm_dt_rank = len(keys), len(vals)
            local.ssm_d_inner = len(vals) * D
            kv_arr.append(None)
        else:
            Hkv = cfg.layer_n_head_kv(il)
            (q0, q1), (k0, k1) = kv_heads(H, Hkv, world, rank, where)
            q_rows = rows_of(p + "attn_q.weight") // H      # qwen35: query and gate rows
            for n in ("attn_q.weight", "attn_q.bias"):
                put(p + n, Cut(rows=[(q0 * q_rows, q1 * q_rows)]))
            for kind in ("k", "v"):
                if p + f"attn_{kind}.weight" in names:
                    r = rows_of(p + f"attn_{kind}.weight") // Hkv
                    for n in (f"attn_{kind}.weight", f"attn_{kind}.bias"):
                        put(p + n, Cut(rows=[(k0 * r, k1 * r)]))
            o_cols = gf.tensors[p + "attn_output.weight"].shape[0] // H
            put(p + "attn_output.weight", Cut(cols=[(q0 * o_cols, q1 * o_cols)], reduce=True))
            kv_arr.append(k1 - k0)
        for gate, up, down in (("ffn_gate", "ffn_up", "ffn_down"),
                               ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")):
            if p + gate + ".weight" not in names:
                continue
            F = rows_of(p + gate + ".weight")
            try:
                f0, f1 = _even(F, world, rank, f"{where}'s {gate} width")
                runs = [(f0, f1)]
                _check_cols(gf, p + down + ".weight", runs, world)
            except ShardError:
                if not gate.endswith("_shexp"):
                    raise
                # a shared expert too narrow to cut on its blocks (Qwen3.6-35B-A3B's, 512 wide,
                # at TP = 4) is computed whole by rank 0; the others hold none of it and add
                # zeros to the FFN's all-reduce (every rank's boundaries fail alike: they are
                # multiples of the first)
                runs = [(0, F)] if rank == 0 else []
            put(p + gate + ".weight", Cut(rows=runs))
            put(p + up + ".weight", Cut(rows=runs))
            put(p + down + ".weight", Cut(cols=runs, reduce=True))
        for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                  "ffn_gate_up_exps.weight", "ffn_down_exps.scale"):
            if p + n in names:
                t = gf.tensors[p + n]
                E = t.shape[-1]
                put(p + n, Cut(experts=_even(E, world, rank, f"{where}'s expert count")))
    local.n_head = H // world
    attn = [k for k in kv_arr if k is not None]
    local.n_head_kv = attn[0] if attn else cfg.n_head_kv
    if cfg.n_head_kv_arr:
        local.n_head_kv_arr = [cfg.n_head_kv if k is None else k for k in kv_arr]
    return Plan(world, rank, local, cuts)


def layer_stages(n_layer: int, world: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per rank (a layer split)."""
    if n_layer < world:
        raise ShardError(f"--split layer over {world} ranks needs at least {world} layers; "
                         f"the model has {n_layer}")
    return [split_range(n_layer, world, r) for r in range(world)]
