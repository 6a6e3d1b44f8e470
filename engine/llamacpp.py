"""llama.cpp driven through llama-cpp-python's ctypes API, with every setting that changes
numbers pinned in one place (`CONTEXT_SETTINGS`, `model_settings()`).

The golden recorder (ci/record_goldens.py) and `brass diff` use this module; it needs the
`record` extra (`pip install -e '.[record]'`, llama-cpp-python 0.3.36 = llama.cpp b11312, CPU
build with GGML_NATIVE=OFF). A build of the same llama.cpp with CUDA (ci/build_llamacpp_cuda.sh)
is used instead when LLAMA_CPP_LIB_PATH names its library folder, as llama-cpp-python itself
does; `Model(..., device="cuda")` then offloads every layer. Nothing is installed or loaded at
import time: `lib()` loads the binding on first use and says how to get it when it is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from pathlib import Path

import numpy as np

from brass.errors import BrassError
from brass.gguf import GGMLType

LLAMA_CPP_BUILD = "b11312"          # vendored in llama-cpp-python 0.3.36 (not readable from the .so)
BINDING = "llama-cpp-python==0.3.36"

# One context size for every model: the longest prompt (Gemma's > 512-token one) plus 32
# generated tokens fits, so every teacher-forced pass is a single batch and a single ubatch
# (a prompt split into ubatches would show each activation once per chunk).
N_CTX = 1024

CONTEXT_SETTINGS = {
    "n_ctx": N_CTX,
    "n_batch": N_CTX,
    "n_ubatch": N_CTX,
    # 0 = n_batch: logits for every position of a batch (the default of 1 per sequence would
    # silently give only the last row).
    "n_outputs_max": 0,
    "n_outputs_max_per_seq": 0,
    # 1 and 2 threads gave bitwise identical results; 2 is what CI has.
    "n_threads": 2,
    "n_threads_batch": 2,
    # AUTO resolves to ON on CPU and changes logits by up to ~1: pin OFF.
    "flash_attn_type": 0,
    # F16 KV cache (llama.cpp's default); F32 changes logits by up to ~0.7.
    "type_k": 1,
    "type_v": 1,
    "swa_full": True,
    "offload_kqv": True,
    "op_offload": True,
    "kv_unified": False,
    "no_perf": True,
}

MODEL_SETTINGS = {
    "n_gpu_layers": 0,              # device="cuda" offloads everything (model_settings)
    # Weight repacking (CPU_REPACK buffers) changes logits by up to ~0.8: off.
    "use_extra_bufts": False,
    "check_tensors": False,
}

DEVICES = ("cpu", "cuda")
_state: dict = {}


class LlamaCppMissing(BrassError):
    """llama.cpp's Python binding (the `record` extra) is not installed."""


def model_settings(device: str = "cpu") -> dict:
    """The pinned model parameters for a device: on CUDA every repeating layer and the output
    layer are offloaded (llama.cpp keeps the token embedding lookup on the CPU either way)."""
    if device not in DEVICES:
        raise BrassError(f"llama.cpp device must be one of {', '.join(DEVICES)}, not {device!r}")
    return {**MODEL_SETTINGS, "n_gpu_layers": 999} if device == "cuda" else dict(MODEL_SETTINGS)


def lib_dir() -> Path:
    """The folder llama-cpp-python loads libllama.so and its ggml libraries from."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    import llama_cpp
    return Path(llama_cpp.__file__).parent / "lib"


def lib():
    """The low-level binding module, loaded once, with llama.cpp's logging silenced."""
    if "L" not in _state:
        # A CUDA build's libggml-cuda.so carries weak copies of libstdc++'s stream code; when
        # it is the first library in the process to provide them, libllama binds to those and
        # crashes in its first log line (seen on the H200 runner: llama_model::print_info →
        # ostream::_M_insert from libggml-cuda.so). Loading libstdc++ globally first makes
        # every library bind to the real one.
        try:
            ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
        try:
            import llama_cpp.llama_cpp as L
        except ImportError as e:
            # the binding's own imports (jinja2, diskcache, typing_extensions) fail here too: name which
            raise LlamaCppMissing("this needs llama.cpp's Python binding (llama-cpp-python 0.3.36): "
                                  f"pip install -e '.[record]'  (see golden/README.md); import failed: {e}") from None
        except (OSError, RuntimeError) as e:
            raise LlamaCppMissing(f"llama.cpp's library could not be loaded: {e}") from None
        L.llama_backend_init()
        # Keep a reference: ctypes would free the callback while llama.cpp still holds it.
        _state["log_cb"] = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(_state["log_cb"], ctypes.c_void_p())
        _state["L"] = L
        _state["ggml"] = _load_ggml(lib_dir() / "libggml-base.so")
    return _state["L"]


def _load_ggml(path: Path):
    g = ctypes.CDLL(str(path))
    g.ggml_get_name.argtypes = [ctypes.c_void_p]
    g.ggml_get_name.restype = ctypes.c_char_p
    g.ggml_op_desc.argtypes = [ctypes.c_void_p]
    g.ggml_op_desc.restype = ctypes.c_char_p
    g.ggml_nbytes.argtypes = [ctypes.c_void_p]
    g.ggml_nbytes.restype = ctypes.c_size_t
    g.ggml_nelements.argtypes = [ctypes.c_void_p]
    g.ggml_nelements.restype = ctypes.c_int64
    g.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    g.ggml_backend_tensor_get.restype = None
    g.ggml_commit.restype = ctypes.c_char_p
    g.ggml_version.restype = ctypes.c_char_p
    return g


class _TensorHead(ctypes.Structure):
    """The leading fields of `struct ggml_tensor` (ggml.h): type, buffer, ne[4], nb[4]."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


def provenance(device: str = "cpu") -> dict:
    """What computed the numbers: llama.cpp's build and, on CUDA, the GPU, the CUDA version and
    the build flags (from build-info.json, written beside the libraries by
    ci/build_llamacpp_cuda.sh)."""
    L = lib()
    g = _state["ggml"]
    out = {
        "llama_cpp_build": LLAMA_CPP_BUILD,
        "ggml_version": g.ggml_version().decode(),
        "ggml_commit": g.ggml_commit().decode(),
        "binding": BINDING,
        "backend": "CPU" if device == "cpu" else "CUDA",
        "system_info": L.llama_print_system_info().decode().strip(),
    }
    if device == "cuda":
        info = lib_dir() / "build-info.json"
        out["build"] = json.loads(info.read_text()) if info.is_file() else "unknown (no build-info.json)"
        out["gpu"] = _gpu_description()
    return out


def has_cuda() -> bool:
    """Whether the loaded llama.cpp was built with CUDA (it can then run either device)."""
    return "CUDA" in lib().llama_print_system_info().decode()


def _gpu_description() -> str:
    """GPU name, compute capability and driver, as nvidia-smi reports them."""
    import subprocess
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _apply(params, settings: dict):
    for k, v in settings.items():
        setattr(params, k, v)
    return params


def _scalars(params) -> dict:
    """Every plain field of a params struct, for the manifest."""
    out = {}
    for name, typ in params._fields_:
        if typ in (ctypes.c_int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_bool,
                   ctypes.c_float, ctypes.c_size_t):
            out[name] = getattr(params, name)
    return out


def settings_record(device: str = "cpu") -> dict:
    """The full model and context parameters the recorder runs with (pinned + defaults)."""
    L = lib()
    return {"model_params": _scalars(_apply(L.llama_model_default_params(), model_settings(device))),
            "context_params": _scalars(_apply(L.llama_context_default_params(), CONTEXT_SETTINGS))}


class _Handle:
    """A llama.cpp object freed by `_free` on close() or at the end of a with block."""
    ptr = None

    def _free(self, ptr):
        raise NotImplementedError

    def close(self):
        if self.ptr:
            self._free(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Model(_Handle):
    """A loaded GGUF: tokenizer, vocabulary facts, and fresh contexts on demand."""

    def __init__(self, path: str | os.PathLike, vocab_only: bool = False, device: str = "cpu"):
        L = lib()
        params = _apply(L.llama_model_default_params(), model_settings(device))
        self.device = device
        params.vocab_only = vocab_only
        self.path = Path(path)
        self.ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def _free(self, ptr):
        lib().llama_model_free(ptr)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        L = lib()
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n}) on {text!r}")
        return list(buf[:n])

    def is_eog(self, token: int) -> bool:
        return bool(lib().llama_vocab_is_eog(self.vocab, token))

    @property
    def arch(self) -> str:
        """general.architecture, as llama.cpp read it."""
        buf = ctypes.create_string_buffer(256)
        n = lib().llama_model_meta_val_str(self.ptr, b"general.architecture", buf, len(buf))
        return buf.value.decode() if n >= 0 else ""

    def context(self, capture=None) -> "Context":
        return Context(self, capture)


class Capture:
    """Eval callback that copies chosen graph nodes out while llama.cpp computes them.

    Nodes are keyed `<name>#<occurrence>`: names repeat (a matmul, its reshape and its rope
    all carry `Qcur-0`), and the occurrence counts every node of that name in graph order.
    `wanted(name, previous_name)` decides which nodes to copy (the previous node in graph order
    identifies unnamed nodes such as an output projection); only inside the callback is the
    data valid.
    """

    def __init__(self, wanted):
        self.wanted = wanted
        self.active = False
        self.error: BaseException | None = None
        self.reset()
        self.cfunc = lib().ggml_backend_sched_eval_callback(self._callback)

    def reset(self):
        self.counts: dict[str, int] = {}
        self.previous: str | None = None
        self.pending: dict[int, str] = {}
        self.nodes: dict[str, dict] = {}   # key → {name, occurrence, op, type, ne, array}

    def _callback(self, t, ask, user_data):
        # An exception escaping into C would abort the compute silently: keep it for later.
        try:
            if not self.active:
                return False
            g = _state["ggml"]
            if ask:
                name = g.ggml_get_name(t).decode()
                occ = self.counts.get(name, 0)
                self.counts[name] = occ + 1
                previous, self.previous = self.previous, name
                if self.wanted(name, previous):
                    self.pending[t] = f"{name}#{occ}"
                    return True
                return False
            key = self.pending.pop(t, None)
            if key is not None:
                self.nodes[key] = _read_node(g, t, key)
            return True
        except BaseException as e:  # noqa: BLE001 - re-raised after the decode returns
            self.error = e
            return False


_NP_DTYPE = {0: np.float32, 1: np.float16, 26: np.int32}


def _read_node(g, t, key: str) -> dict:
    head = _TensorHead.from_address(t)
    ne = [int(x) for x in head.ne]
    nb = [int(x) for x in head.nb]
    if int(np.prod(ne)) != g.ggml_nelements(t):
        raise RuntimeError("struct ggml_tensor layout does not match this ggml build")
    if head.type not in _NP_DTYPE:
        raise RuntimeError(f"{key}: node type {head.type} not handled")
    dtype = np.dtype(_NP_DTYPE[head.type])
    nbytes = g.ggml_nbytes(t)
    raw = np.empty(nbytes, dtype=np.uint8)
    g.ggml_backend_tensor_get(t, raw.ctypes.data, 0, nbytes)
    # Views and permutes are strided: honour nb. numpy order is reversed ggml order.
    arr = np.ndarray(shape=ne[::-1], dtype=dtype, buffer=raw, strides=nb[::-1]).copy()
    name, occ = key.rsplit("#", 1)
    return {"name": name, "occurrence": int(occ), "op": g.ggml_op_desc(t).decode(),
            "type": GGMLType(head.type).name, "ne": ne, "array": arr}


class Context(_Handle):
    """A llama_context with the pinned settings; one sequence, positions from 0."""

    def __init__(self, model: Model, capture: Capture | None = None):
        L = lib()
        params = _apply(L.llama_context_default_params(), CONTEXT_SETTINGS)
        self.capture = capture
        if capture is not None:
            params.cb_eval = capture.cfunc
        self.model = model
        self.ptr = L.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_past = 0

    def _free(self, ptr):
        lib().llama_free(ptr)

    def decode(self, tokens: list[int], all_logits: bool) -> np.ndarray:
        """Append `tokens` to the sequence; return logits `[n_out, n_vocab]` float32 for every
        position (all_logits) or for the last one."""
        L = lib()
        n = len(tokens)
        if self.n_past + n > N_CTX:
            raise RuntimeError(f"{self.n_past + n} tokens do not fit the pinned context of {N_CTX}")
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if (all_logits or i == n - 1) else 0
            batch.n_tokens = n
            if self.capture is not None:
                self.capture.active = True
            rc = L.llama_decode(self.ptr, batch)
            if self.capture is not None:
                self.capture.active = False
                if self.capture.error is not None:
                    raise self.capture.error
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            n_out = n if all_logits else 1
            first = 0 if all_logits else n - 1
            rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(self.ptr, first + i),
                                          shape=(self.model.n_vocab,)).copy() for i in range(n_out)]
        finally:
            L.llama_batch_free(batch)
        self.n_past += n
        return np.stack(rows)


def quantize(src: Path, dst: Path, overrides: list[tuple[str, str]], threads: int = 2):
    """llama_model_quantize with every tensor typed explicitly: `overrides` are (regex, type
    name) pairs searched in tensor names, first match wins (as `llama-quantize --tensor-type`).
    `pure` stops llama.cpp's own per-tensor mix; a tensor no pattern names would get the
    fallback Q8_0, so callers check the result."""
    L = lib()
    params = L.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = L.LLAMA_FTYPE_MOSTLY_Q8_0
    params.pure = True
    params.allow_requantize = False
    arr = (L.llama_model_tensor_override * (len(overrides) + 1))()   # NULL-pattern terminated
    patterns = [p.encode() for p, _ in overrides]                      # kept alive during the call
    for i, (pattern, (_, typ)) in enumerate(zip(patterns, overrides)):
        arr[i].pattern = pattern
        arr[i].type = GGMLType[typ]
    params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(L.llama_model_tensor_override))
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {src}")


# --- per-layer activations ------------------------------------------------------------------

# Graph nodes taken per layer, by llama.cpp name (without the "-<layer>" suffix) → role. The
# role is the same across architectures; the name is what llama.cpp calls it in this one.
# Gemma's post-norms are left out for size: a fault there shows between attn_proj and
# ffn_inp (sa_out), or between ffn_out and l_out.
NODE_ROLES = {
    "attn_norm": "attn_norm",
    "Qcur": "q_rope", "Kcur": "k_rope",             # last occurrence: after q/k norm and rope
    "kqv_out": "kqv_out",
    "ffn_inp": "ffn_inp", "sa_out": "ffn_inp",      # residual after attention (gemma: sa_out)
    "ffn_out": "ffn_out", "ffn_moe_out": "ffn_out",
    "ffn_moe_logits": "moe_logits", "ffn_moe_probs": "moe_probs",
    "ffn_moe_topk": "moe_topk", "ffn_moe_weights_norm": "moe_weights",
    "l_out": "l_out",
    "result_norm": "result_norm", "result_output": "result_output",
}
LAST_OCCURRENCE_ONLY = {"Qcur", "Kcur"}
# The attention output projection is unnamed in some architectures (qwen2, gemma3: node_<i>),
# named attn_out in llama: it is always the node right after kqv_out-<layer>.
AFTER_KQV_OUT = "attn_proj"

# Architectures with nodes of their own (added to NODE_ROLES for their graphs only, so the
# other models' recordings do not change). A value may depend on the node's op: in qwen35,
# `attn_output-N` is the delta-net's core output (a VIEW of the GATED_DELTA_NET result) in a
# recurrent layer and the output projection (MUL_MAT) in an attention layer.
_QWEN35_ROLES = {
    # gated delta-net layers (src/models/qwen35.cpp build_layer_attn_linear)
    "conv_output_silu": "gdn_conv",                 # silu(causal conv1d of q|k|v, with state)
    "q_conv_predelta": "gdn_q", "k_conv_predelta": "gdn_k",     # L2-normed q and k
    "beta_sigmoid": "gdn_beta", "gate": "gdn_gate",  # β and g = softplus(α + dt)·a per v-head
    "attn_output": {"VIEW": "gdn_out", "MUL_MAT": "attn_proj"},
    "final_output": "gdn_gated_norm",               # rms(o)·w·silu(z)
    "linear_attn_out": "attn_proj",                 # its output projection
    # attention layers: the attention before and after its sigmoid output gate
    "attn_pregate": "kqv_out", "attn_gated": "attn_gated",
    # both: residual after the mixer and the norm before the FFN
    "attn_residual": "ffn_inp", "attn_post_norm": "ffn_norm",
}
# gemma4 (src/models/gemma4.cpp): "Qcur-N"/"Kcur-N" are the raw projections (None: not
# recorded; on a layer whose values are the keys the one projection is named "Vcur-N"), q and k
# after norm and rope are "Q/Kcur_pos-N"; the values' weightless RMS norm; both post-norms;
# "attn_out-N" is the residual after attention (Brass: attn_residual-N, see brass_tap). A MoE
# layer's FFN output is "ffn_moe_combined-N" = dense branch ("ffn_mlp") + the experts' normed
# sum ("ffn_moe" of "ffn_moe_out"). The experts' scaled outputs (ffn_moe_down_scaled) are not
# recorded: they are per top-k slot, and two experts of near-equal probability may take their
# slots in either order without changing the sum.
_GEMMA4_ROLES = {
    "Qcur": None, "Kcur": None, "Vcur": None,
    "Qcur_pos": "q_rope", "Kcur_pos": "k_rope", "Vcur_normed": "v_norm",
    "attn_post_norm": "attn_post_norm", "attn_out": "ffn_inp",
    "ffn_mlp": "moe_dense", "ffn_moe_out": "moe_out",
    "ffn_moe": "moe_normed", "ffn_moe_combined": "ffn_out",
    "ffn_post_norm": "ffn_post_norm",
}
ARCH_NODE_ROLES = {
    "gemma4": _GEMMA4_ROLES,
    "qwen35": _QWEN35_ROLES,
    # the routed experts' sum, the shared expert and its gate, then ffn_out = their sum
    "qwen35moe": {**_QWEN35_ROLES, "ffn_moe_out": "moe_out", "ffn_shexp": "shexp_out",
                  "shared_expert_gate_sigmoid": "shexp_gate"},
}


def node_roles(arch: str) -> dict:
    """Name (without the layer suffix) → role, or → {op: role}, for an architecture's graph;
    a name mapped to None is not recorded."""
    return {**NODE_ROLES, **ARCH_NODE_ROLES.get(arch, {})}


def brass_tap(name: str, role: str, layer: int | None) -> str:
    """The name Brass traces a recorded node under: llama.cpp's own, except the attention
    output projection, attn_out-N in every Brass architecture (llama.cpp leaves it unnamed or
    calls it attn_output / linear_attn_out), and gemma4's residual after attention, which
    llama.cpp names attn_out-N: attn_residual-N in Brass (qwen35's name for that node)."""
    if role == "attn_proj":
        return f"attn_out-{layer}"
    if role == "ffn_inp" and split_name(name)[0] == "attn_out":
        return f"attn_residual-{layer}"
    return name


def split_name(name: str) -> tuple[str, int | None]:
    """"l_out-12" → ("l_out", 12); "result_norm" → ("result_norm", None)."""
    m = re.search(r"-(\d+)$", name)
    return (name[:m.start()], int(m.group(1))) if m else (name, None)


def _wanted(roles: dict):
    def wanted(name: str, prev: str | None) -> bool:
        return roles.get(split_name(name)[0]) is not None or \
            (prev is not None and prev.startswith("kqv_out-"))
    return wanted


def capture_activations(m: Model, ids: list[int]) -> tuple[np.ndarray, list[dict]]:
    """One pass over `ids` in a fresh context: (logits [T, n_vocab], nodes in graph order).

    Each node is {key, name, occurrence, op, layer, role, ne, type, array}: `array` has shape
    reversed(ne) trimmed to its real dimensions ([T, ...] for per-token nodes); `layer` is
    None for result_norm and result_output."""
    roles = node_roles(m.arch)
    cap = Capture(_wanted(roles))
    with m.context(cap) as ctx:
        logits = ctx.decode(ids, all_logits=True)
    last = {node["name"]: key for key, node in cap.nodes.items()
            if split_name(node["name"])[0] in LAST_OCCURRENCE_ONLY}
    out, layer = [], None
    for key, node in cap.nodes.items():            # graph order
        base, node_layer = split_name(node["name"])
        if node_layer is not None:
            layer = node_layer                     # unnamed nodes belong to the current layer
        if base in LAST_OCCURRENCE_ONLY and last[node["name"]] != key:
            continue
        role = roles.get(base, AFTER_KQV_OUT)
        if isinstance(role, dict):
            role = role[node["op"]]
        ne = node["ne"]
        ndim = max(2, max(i for i, n in enumerate(ne) if n != 1) + 1)
        out.append({"key": key, "name": node["name"], "occurrence": node["occurrence"],
                    "op": node["op"], "layer": None if role.startswith("result_") else layer,
                    "role": role, "ne": ne[:ndim], "type": node["type"],
                    "array": node["array"].reshape(ne[:ndim][::-1])})
    return logits, out
