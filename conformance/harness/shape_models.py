"""Shape-true synthetic models for speed work: GGUF files with a real model's architecture,
tensor shapes, quantization recipe and vocabulary size, filled with seeded random (valid)
quant blocks, written in seconds to minutes where real weights cannot go (the GPU runner).

Both engines run them: llama.cpp (llama-bench) and Brass (brass bench) read the same file.
The weights are random, so the text is noise, but every byte a token reads is a real byte of
a real-sized matrix: decode and prefill cost what they cost on the real model.

    python3 conformance/harness/shape_models.py qwen3-0.6b /tmp/models/         # one shape
    python3 conformance/harness/shape_models.py all /tmp/models/                # every shape in SHAPES
    python3 conformance/harness/shape_models.py qwen3-8b /tmp/m/ --layers 2     # fewer layers (quick checks)
    python3 conformance/harness/shape_models.py gemma-4-26b-a4b /tmp/m/ --layers 2 --vocab 4096 --experts 8

`--layers`, `--vocab` and `--experts` shrink a file for quick checks (such a file is not the
real shape: `ci/gpu.sh side-by-side` regenerates it). With fewer layers than a hybrid's period
(Qwen3.5/3.6: full attention every 4th layer; Gemma 4: every 6th) the period shrinks to the
layer count, so the last layer is still a full-attention one.

Recipes. The qwen3 shapes: Q4_K matrices and token embedding, Q6_K for attn_v, ffn_down
(experts too) and the output head, F32 norms and router. The Qwen3.5/3.6 and Gemma 4 shapes
(`q4_k_m`, the default) follow llama-quantize's Q4_K_M choices tensor by tensor (b11434
src/llama-quant.cpp): Q4_K by default; Q6_K for attn_v and the delta-net attn_qkv (both
"attn_v-like" there) and for ffn_down (dense, experts and shared expert) on the layers where
use_more_bits holds (the first and last eighth and every third between), Q4_K elsewhere; Q6_K
output head (and token embedding when tied, as Gemma 4's is); where a row length is not a
multiple of 256 (Gemma 4's 2112 and 704 FFN widths) llama.cpp's fallback: Q4_K -> Q5_0,
Q6_K -> Q8_0. F32: norms, 1-D vectors, routers, ssm_conv1d, the .scale tensors, rope_freqs.
`--recipe mxfp4-moe` (MoE shapes) is llama-quantize's MXFP4_MOE: expert tensors MXFP4, every
other matrix Q8_0. The tokenizer is a byte-level BPE (Qwen2 pre-tokenizer) of the model's
vocabulary size: the 256 byte tokens, every pair of them, then triples, each with its merge,
and the special tokens at the end (the speed of a forward pass does not depend on it).
The tensor names and shapes of the qwen35 / qwen35moe / gemma4 shapes come from
synth_models.py (tensor_shapes, init_weight), which writes loadable files of the same
architectures at tiny sizes. Needs only numpy and this repository (the runner has no gguf-py).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.harness import synth_models  # noqa: E402
from brass.gguf import BLOCK_SIZES, GGMLType  # noqa: E402
from brass.quants import random_blocks  # noqa: E402

Q4K, Q6K, F32 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F32

# Hyper-parameters of real models (their config.json / GGUF metadata).
SHAPES = {
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, hidden=1024, ffn=3072, n_head=16, n_kv_head=8,
                       head_dim=128, vocab=151936, rope_base=1e6, tied=False),
    "qwen3-8b": dict(arch="qwen3", n_layer=36, hidden=4096, ffn=12288, n_head=32, n_kv_head=8,
                     head_dim=128, vocab=151936, rope_base=1e6, tied=False),
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, hidden=2048, ffn=6144, n_head=32, n_kv_head=4,
                          head_dim=128, vocab=151936, rope_base=1e6, tied=False,
                          n_expert=128, n_expert_used=8, expert_ffn=768),
    # Qwen3.5/3.6 hybrids: three gated delta-net layers (16 key / 32 value heads of 128, conv 4)
    # to one full-attention layer (output-gated q, head 256, IMROPE over 64 dims); untied
    # output; no MTP block (llama.cpp does not run it).
    "qwen3.6-35b-a3b": dict(arch="qwen35moe", n_layer=40, hidden=2048, ffn=512, n_head=16,
                            n_kv_head=2, head_dim=256, vocab=248320, rope_base=1e7, tied=False,
                            n_expert=256, n_expert_used=8, expert_ffn=512, shexp_ffn=512,
                            ssm_conv=4, ssm_state=128, ssm_group=16, ssm_heads=32, period=4),
    "qwen3.5-9b": dict(arch="qwen35", n_layer=32, hidden=4096, ffn=12288, n_head=16, n_kv_head=4,
                       head_dim=256, vocab=248320, rope_base=1e7, tied=False,
                       ssm_conv=4, ssm_state=128, ssm_group=16, ssm_heads=32, period=4),
    # the dense 27B: 48 value heads a delta-net layer (16 key heads, tiled over them)
    "qwen3.6-27b": dict(arch="qwen35", n_layer=64, hidden=5120, ffn=17408, n_head=24, n_kv_head=4,
                        head_dim=256, vocab=248320, rope_base=1e7, tied=False,
                        ssm_conv=4, ssm_state=128, ssm_group=16, ssm_heads=48, period=4),
    # Gemma 4: five sliding-window layers (window 1024, head 256, rope base 1e4) to one full
    # layer (head 512, proportional rope over a quarter of it, base 1e6, values = the raw keys:
    # no attn_v, attention_k_eq_v); KV heads per layer kind; layer output scalars; tied vocab.
    # The MoE has a dense GeGLU FFN beside 128 experts (gate|up merged, router input scale,
    # per-expert down scale).
    "gemma-4-26b-a4b": dict(arch="gemma4", n_layer=30, hidden=2816, ffn=2112, n_head=16,
                            n_kv_head=8, head_dim=512, vocab=262144, rope_base=1e6, tied=True,
                            n_expert=128, n_expert_used=8, expert_ffn=704, period=6,
                            swa=dict(head_dim=256, n_kv_head=8), full=dict(head_dim=512, n_kv_head=2),
                            sliding_window=1024, rope_base_swa=1e4, rope_pairs=64),
    "gemma-4-31b": dict(arch="gemma4", n_layer=60, hidden=5376, ffn=21504, n_head=32, n_kv_head=16,
                        head_dim=512, vocab=262144, rope_base=1e6, tied=True, period=6,
                        swa=dict(head_dim=256, n_kv_head=16), full=dict(head_dim=512, n_kv_head=4),
                        sliding_window=1024, rope_base_swa=1e4, rope_pairs=64),
}
HYBRID = ("qwen35", "qwen35moe", "gemma4")     # built from synth_models.py's tensor lists
RECIPES = ("q4_k_m", "mxfp4-moe")

POOL_BYTES = 96 << 20       # random blocks per type, reused across tensors at shifted offsets
GGUF_STRING, GGUF_UINT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_ARRAY, GGUF_INT32 = 8, 4, 6, 7, 9, 5
ALIGN = 32


def period(c: dict) -> int:
    """Layers per full-attention layer of a hybrid (shrunk to the layer count when fewer)."""
    return min(c["period"], c["n_layer"])


def swa_pattern(c: dict) -> list[bool]:
    """gemma4: True for a sliding-window layer (every period-th layer is a full one)."""
    return [(i + 1) % period(c) != 0 for i in range(c["n_layer"])]


def synth_config(c: dict) -> dict:
    """Shape config `c` as a synth_models.py model config (dims, globals, layer tensors)."""
    dims = {k: v for k, v in c.items() if not isinstance(v, dict)}
    if c["arch"] in ("qwen35", "qwen35moe"):
        ffn = ["ffn_gate", "ffn_up", "ffn_down"] if c["arch"] == "qwen35" else [
            "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
            "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        layer, layer_dims = synth_models._qwen35_layer(ffn, interval=period(c)), None
    else:
        swa = swa_pattern(c)
        ffn = ["ffn_gate", "ffn_up", "ffn_down", "layer_output_scale"]
        if c.get("n_expert"):
            ffn += ["ffn_gate_inp", "ffn_gate_inp_scale", "ffn_gate_up_exps", "ffn_down_exps",
                    "ffn_down_exps_scale", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"]
        full = tuple(i for i, s in enumerate(swa) if not s)
        layer = synth_models._gemma4_layer(ffn, no_v=full)
        layer_dims = synth_models._gemma4_dims(swa, c["swa"], c["full"])
    return dict(arch=c["arch"], dims=dims, vocab=c["vocab"], layer=layer, layer_dims=layer_dims,
                globals=["token_embd", "output_norm"] + ([] if c["tied"] else ["output"])
                + (["rope_freqs"] if c["arch"] == "gemma4" else []))


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's layers that get more bits in *_M recipes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_fallback(t: GGMLType, row_len: int) -> GGMLType:
    """llama-quantize's type for a row length that a 256-element K-quant block cannot take."""
    if BLOCK_SIZES[t][0] == 256 and row_len % 256:
        return {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, Q6K: GGMLType.Q8_0}[t]
    return t


def hybrid_specs(c: dict, recipe: str = "q4_k_m") -> dict[str, tuple[GGMLType, tuple[int, ...]]]:
    """{name: (type, numpy shape)} of a qwen35 / qwen35moe / gemma4 shape: the tensors of
    synth_models.py's writer at the real dimensions, typed by `recipe` (module docstring)."""
    shapes = synth_models.tensor_shapes(synth_config(c))
    n_wv = sum(1 for name in shapes if name.endswith(("attn_v.weight", "attn_qkv.weight")))
    i_wv, specs = 0, {}
    for name, (kind, shape) in shapes.items():
        if len(shape) == 1 or kind in ("ffn_gate_inp", "ssm_conv1d") or name.endswith(".scale"):
            t = F32
        elif recipe == "mxfp4-moe":
            t = GGMLType.MXFP4 if len(shape) == 3 else GGMLType.Q8_0
        elif kind == "output" or (kind == "token_embd" and c["tied"]):
            t = Q6K
        elif kind in ("attn_v", "attn_qkv"):
            t = Q6K if _use_more_bits(i_wv, n_wv) else Q4K
            i_wv += 1
        elif kind.startswith("ffn_down"):
            t = Q6K if _use_more_bits(int(name.split(".")[1]), c["n_layer"]) else Q4K
        else:
            t = Q4K
        specs[name] = (_k_fallback(t, shape[-1]), shape)
    return specs


def tensor_specs(c: dict, recipe: str = "q4_k_m") -> dict[str, tuple[GGMLType, tuple[int, ...]]]:
    """{name: (type, numpy shape)} of every tensor of shape config `c`."""
    if c["arch"] in HYBRID:
        return hybrid_specs(c, recipe)
    D, V, Dh = c["hidden"], c["vocab"], c["head_dim"]
    specs = {"token_embd.weight": (Q4K, (V, D)), "output_norm.weight": (F32, (D,))}
    if not c["tied"]:
        specs["output.weight"] = (Q6K, (V, D))
    for i in range(c["n_layer"]):
        p = f"blk.{i}."
        specs.update({
            p + "attn_norm.weight": (F32, (D,)),
            p + "attn_q.weight": (Q4K, (c["n_head"] * Dh, D)),
            p + "attn_k.weight": (Q4K, (c["n_kv_head"] * Dh, D)),
            p + "attn_v.weight": (Q6K, (c["n_kv_head"] * Dh, D)),
            p + "attn_output.weight": (Q4K, (D, c["n_head"] * Dh)),
            p + "attn_q_norm.weight": (F32, (Dh,)),
            p + "attn_k_norm.weight": (F32, (Dh,)),
            p + "ffn_norm.weight": (F32, (D,)),
        })
        if c.get("n_expert"):
            E, F = c["n_expert"], c["expert_ffn"]
            specs.update({
                p + "ffn_gate_inp.weight": (F32, (E, D)),
                p + "ffn_gate_exps.weight": (Q4K, (E, F, D)),
                p + "ffn_up_exps.weight": (Q4K, (E, F, D)),
                p + "ffn_down_exps.weight": (Q6K, (E, D, F)),
            })
        else:
            F = c["ffn"]
            specs.update({
                p + "ffn_gate.weight": (Q4K, (F, D)),
                p + "ffn_up.weight": (Q4K, (F, D)),
                p + "ffn_down.weight": (Q6K, (D, F)),
            })
    return specs


def tokenizer(vocab: int) -> dict:
    """A byte-level BPE of exactly `vocab` tokens (GPT-2 byte-to-unicode alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = [chr(c) for _, c in sorted(zip(bs, cs))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n_normal = vocab - len(specials)
    tokens, merges = list(alphabet), []
    for a in alphabet:
        for b in alphabet:
            if len(tokens) >= n_normal:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    i = 0
    while len(tokens) < n_normal:             # triples: a pair token + one more byte
        pair = tokens[256 + i // 256]
        c = alphabet[i % 256]
        tokens.append(pair + c)
        merges.append(f"{pair} {c}")
        i += 1
    tokens += specials
    types = [1] * n_normal + [3] * len(specials)        # NORMAL, CONTROL
    return dict(tokens=tokens, types=types, merges=merges, eos=vocab - 3, bos=vocab - 3)


class _Meta:
    def __init__(self):
        self.parts: list[bytes] = []
        self.count = 0

    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    def add(self, key: str, vtype: int, value):
        out = self._str(key) + struct.pack("<I", vtype)
        if vtype == GGUF_STRING:
            out += self._str(value)
        elif vtype == GGUF_UINT32:
            out += struct.pack("<I", value)
        elif vtype == GGUF_INT32:
            out += struct.pack("<i", value)
        elif vtype == GGUF_FLOAT32:
            out += struct.pack("<f", value)
        elif vtype == GGUF_BOOL:
            out += struct.pack("<?", value)
        self.parts.append(out)
        self.count += 1

    def add_array(self, key: str, etype: int, values):
        out = self._str(key) + struct.pack("<IIQ", GGUF_ARRAY, etype, len(values))
        if etype == GGUF_STRING:
            out += b"".join(self._str(v) for v in values)
        elif etype == GGUF_INT32:
            out += np.asarray(values, "<i4").tobytes()
        elif etype == GGUF_FLOAT32:
            out += np.asarray(values, "<f4").tobytes()
        elif etype == GGUF_BOOL:
            out += np.asarray(values, "?").tobytes()
        self.parts.append(out)
        self.count += 1


def metadata(name: str, c: dict, recipe: str = "q4_k_m") -> _Meta:
    """The GGUF keys llama.cpp (b11312 / b11434) reads for the architecture: the keys of
    synth_models.py's gguf-py writer for qwen35 / qwen35moe / gemma4, written by hand here."""
    a = c["arch"]
    m = _Meta()
    m.add("general.architecture", GGUF_STRING, a)
    m.add("general.name", GGUF_STRING, f"{name} (shape-true, random weights)")
    m.add("general.alignment", GGUF_UINT32, ALIGN)
    m.add("general.file_type", GGUF_UINT32, 38 if recipe == "mxfp4-moe" else 15)   # MXFP4_MOE / Q4_K_M
    m.add(f"{a}.context_length", GGUF_UINT32, 262144 if a in HYBRID else 40960)
    m.add(f"{a}.embedding_length", GGUF_UINT32, c["hidden"])
    m.add(f"{a}.block_count", GGUF_UINT32, c["n_layer"])
    m.add(f"{a}.feed_forward_length", GGUF_UINT32, c["ffn"])
    m.add(f"{a}.attention.head_count", GGUF_UINT32, c["n_head"])
    if a == "gemma4":
        # per layer: the sliding-window layers' KV heads, the full layers'
        m.add_array(f"{a}.attention.head_count_kv", GGUF_INT32,
                    [c["swa" if s else "full"]["n_kv_head"] for s in swa_pattern(c)])
    else:
        m.add(f"{a}.attention.head_count_kv", GGUF_UINT32, c["n_kv_head"])
    m.add(f"{a}.attention.key_length", GGUF_UINT32, c["head_dim"])
    m.add(f"{a}.attention.value_length", GGUF_UINT32, c["head_dim"])
    m.add(f"{a}.rope.freq_base", GGUF_FLOAT32, c["rope_base"])
    m.add(f"{a}.attention.layer_norm_rms_epsilon", GGUF_FLOAT32, 1e-6)
    if a in ("qwen35", "qwen35moe"):
        D = c["ssm_state"]
        m.add(f"{a}.rope.dimension_count", GGUF_UINT32, c["head_dim"] // 4)    # partial rotary 0.25
        m.add_array(f"{a}.rope.dimension_sections", GGUF_INT32, [11, 11, 10, 0])
        m.add(f"{a}.ssm.conv_kernel", GGUF_UINT32, c["ssm_conv"])
        m.add(f"{a}.ssm.state_size", GGUF_UINT32, D)
        m.add(f"{a}.ssm.group_count", GGUF_UINT32, c["ssm_group"])
        m.add(f"{a}.ssm.time_step_rank", GGUF_UINT32, c["ssm_heads"])
        m.add(f"{a}.ssm.inner_size", GGUF_UINT32, c["ssm_heads"] * D)
        m.add(f"{a}.full_attention_interval", GGUF_UINT32, period(c))
    if a == "gemma4":
        m.add(f"{a}.attention.sliding_window", GGUF_UINT32, c["sliding_window"])
        m.add_array(f"{a}.attention.sliding_window_pattern", GGUF_BOOL, swa_pattern(c))
        m.add(f"{a}.attention.key_length_swa", GGUF_UINT32, c["swa"]["head_dim"])
        m.add(f"{a}.attention.value_length_swa", GGUF_UINT32, c["swa"]["head_dim"])
        m.add(f"{a}.rope.dimension_count", GGUF_UINT32, c["full"]["head_dim"])   # proportional: rope_freqs
        m.add(f"{a}.rope.dimension_count_swa", GGUF_UINT32, c["swa"]["head_dim"])
        m.add(f"{a}.rope.freq_base_swa", GGUF_FLOAT32, c["rope_base_swa"])
        m.add(f"{a}.final_logit_softcapping", GGUF_FLOAT32, 30.0)
        m.add(f"{a}.embedding_length_per_layer_input", GGUF_UINT32, 0)
    if c.get("n_expert"):
        m.add(f"{a}.expert_count", GGUF_UINT32, c["n_expert"])
        m.add(f"{a}.expert_used_count", GGUF_UINT32, c["n_expert_used"])
        m.add(f"{a}.expert_feed_forward_length", GGUF_UINT32, c["expert_ffn"])
        if c.get("shexp_ffn"):
            m.add(f"{a}.expert_shared_feed_forward_length", GGUF_UINT32, c["shexp_ffn"])
    tok = tokenizer(c["vocab"])
    m.add("tokenizer.ggml.model", GGUF_STRING, "gpt2")
    m.add("tokenizer.ggml.pre", GGUF_STRING, "qwen2")
    m.add_array("tokenizer.ggml.tokens", GGUF_STRING, tok["tokens"])
    m.add_array("tokenizer.ggml.token_type", GGUF_INT32, tok["types"])
    m.add_array("tokenizer.ggml.merges", GGUF_STRING, tok["merges"])
    m.add("tokenizer.ggml.eos_token_id", GGUF_UINT32, tok["eos"])
    m.add("tokenizer.ggml.bos_token_id", GGUF_UINT32, tok["bos"])
    m.add("tokenizer.ggml.add_bos_token", GGUF_BOOL, False)
    return m


def _nbytes(t: GGMLType, shape) -> int:
    blck, tsize = BLOCK_SIZES[t]
    return int(np.prod(shape)) // blck * tsize


def shape_config(name: str, layers: int | None = None, vocab: int | None = None,
                 experts: int | None = None) -> dict:
    """SHAPES[name], optionally shrunk: fewer layers, a smaller vocabulary, fewer experts
    (top-k capped at the expert count)."""
    c = dict(SHAPES[name])
    if layers:
        c["n_layer"] = layers
    if vocab:
        c["vocab"] = vocab
    if experts and c.get("n_expert"):
        c["n_expert"], c["n_expert_used"] = experts, min(c["n_expert_used"], experts)
    return c


def is_real(path: Path, name: str) -> bool:
    """Whether the file at `path` has SHAPES[name]'s full size (not one written with --layers,
    --vocab or --experts): its layer count, vocabulary and expert count."""
    from brass.gguf import GGUFFile
    c, gf = SHAPES[name], GGUFFile(path)
    try:
        a = gf.architecture
        return (a == c["arch"] and gf.get(f"{a}.block_count") == c["n_layer"]
                and gf.tensors["token_embd.weight"].shape[-1] == c["vocab"]
                and (gf.get(f"{a}.expert_count") or 0) == c.get("n_expert", 0))
    finally:
        gf.close()


def write(name: str, out: Path, layers: int | None = None, seed: int = 0, vocab: int | None = None,
          experts: int | None = None, recipe: str = "q4_k_m") -> Path:
    """Write SHAPES[name] (optionally shrunk: shape_config) to out (a file or a folder)."""
    c = shape_config(name, layers, vocab, experts)
    if recipe not in RECIPES or (recipe != "q4_k_m" and (c["arch"] not in HYBRID or not c.get("n_expert"))):
        raise SystemExit(f"recipe {recipe!r} is not one for {name} (q4_k_m; mxfp4-moe for the "
                         "qwen35moe / gemma4 MoE shapes)")
    path = out / f"{name}.gguf" if out.is_dir() or not out.suffix else out
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(c, recipe)
    meta = metadata(name, c, recipe)
    kinds = ({n: k for n, (k, _) in synth_models.tensor_shapes(synth_config(c)).items()}
             if c["arch"] in HYBRID else {})
    rng = np.random.default_rng(seed)
    # One pool of valid blocks per quant type: a tensor is a window of the pool starting at a
    # random whole block (wrapping around), so matrices differ without drawing 20 GB of randomness.
    used = {t for t, _ in specs.values()} - {F32}
    pools = {t: random_blocks(t, POOL_BYTES // BLOCK_SIZES[t][1] // 8, 8 * BLOCK_SIZES[t][0], rng).reshape(-1)
             for t in [Q4K, Q6K] + sorted(used - {Q4K, Q6K}) if t in used}
    infos, offset = [], 0
    for tname, (t, shape) in specs.items():
        ne = tuple(reversed(shape))
        infos.append(_Meta._str(tname) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                     + struct.pack("<IQ", int(t), offset))
        offset = (offset + _nbytes(t, shape) + ALIGN - 1) // ALIGN * ALIGN
    head = b"GGUF" + struct.pack("<IQQ", 3, len(specs), meta.count) + b"".join(meta.parts) + b"".join(infos)
    data_start = (len(head) + ALIGN - 1) // ALIGN * ALIGN
    t0 = time.time()
    # written beside, then renamed: a file at `path` is always complete (a script waiting for
    # it, or a run stopped part-way, never reads half a model)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(head + b"\0" * (data_start - len(head)))
        pos = 0
        for tname, (t, shape) in specs.items():
            n = _nbytes(t, shape)
            f.write(b"\0" * (data_start + pos - f.tell()))
            if t == F32 and tname in kinds:
                # the synthetic models' values by tensor kind (negative ssm_a, proportional
                # rope_freqs, router input scale near sqrt(hidden), ...)
                w = synth_models.init_weight(kinds[tname], shape, c, rng)
                f.write(w.astype("<f4").tobytes())
            elif t == F32:
                # Norm weights near 1, router weights small: activations stay finite.
                scale = 0.02 if "gate_inp" in tname else 0.1
                base = 0.0 if "gate_inp" in tname else 1.0
                f.write((base + scale * rng.standard_normal(int(np.prod(shape)))).astype("<f4").tobytes())
            else:
                pool = pools[t]
                blk = BLOCK_SIZES[t][1]
                start = int(rng.integers(0, pool.size // blk)) * blk
                done = 0
                while done < n:
                    k = min(n - done, pool.size - start)
                    f.write(pool[start:start + k].tobytes())
                    done += k
                    start = 0
            pos = (pos + n + ALIGN - 1) // ALIGN * ALIGN
        f.write(b"\0" * (data_start + offset - f.tell()))
    os.replace(part, path)
    size = path.stat().st_size
    print(f"wrote {path} ({size / 2**30:.2f} GiB, {len(specs)} tensors) in {time.time() - t0:.0f} s", flush=True)
    return path


class ShapeFiles:
    """Shape-true files written into `folder` and deleted together: `with ShapeFiles(folder)
    as write: path = write(name, sub=None, **shrink)` (write()'s arguments; `sub`, a folder
    under `folder` for a second copy). Every file written is gone when the block ends, however
    it ends: a test's files (0.4 GB for a one-layer qwen3-0.6b) do not outlive it, whatever
    pytest keeps of its folder (conformance/conftest.py's shape_model fixture)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.written: list[Path] = []

    def __call__(self, name: str, sub: str | None = None, **shrink) -> Path:
        out = self.folder / sub if sub else self.folder
        path = out / f"{name}.gguf"
        self.written += [path, path.with_name(path.name + ".part")]
        return write(name, out, **shrink)

    def close(self):
        for path in self.written:
            path.unlink(missing_ok=True)
        self.written.clear()

    def __enter__(self) -> "ShapeFiles":
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=[*SHAPES, "all"])
    ap.add_argument("out", type=Path, help="folder (or .gguf path for one shape)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    ap.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (quick checks)")
    ap.add_argument("--experts", type=int, default=None, help="fewer experts (quick checks)")
    ap.add_argument("--recipe", choices=RECIPES, default="q4_k_m",
                    help="weight types (module docstring); mxfp4-moe for the qwen35moe / gemma4 MoE shapes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in (SHAPES if args.shape == "all" else [args.shape]):
        write(name, args.out, args.layers, args.seed, args.vocab, args.experts, args.recipe)


if __name__ == "__main__":
    main()
