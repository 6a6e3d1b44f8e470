"""`brass diff`: one prompt through llama.cpp and through Brass, compared node by node.

llama.cpp (its Python binding, the `record` extra; a CUDA build through LLAMA_CPP_LIB_PATH for
`--reference cuda`) reads the prompt, continues it greedily for a few tokens, then computes the
whole sequence in one pass while its graph nodes are copied out (the recorder's selection:
per layer the attention norm, q and k after RoPE, the attention output before and after its
projection, the residual, the FFN output, the MoE router, the layer output; then the final
norm and the logits). Brass scores the same ids with its trace hook on, and every node is
compared: NMSE = Σ(ours − ref)² / Σ ref² (llama.cpp's test-backend-ops measure) and max |Δ|.
The first node whose NMSE leaves its bound is where the two forward passes part; a wrong layer
shows there and not only, many layers later, in the logits. The teacher-forced argmax is
compared at every position where llama.cpp's top-1/top-2 margin is clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import BrassError

DEFAULT_PROMPT = ("The history of the printing press begins in the fifteenth century, when "
                  "movable type made books cheap enough for ordinary readers. Within fifty years")
DEFAULT_N_GEN = 16

# NMSE bounds (layer 0, any later layer) by (Brass backend, llama.cpp backend). Reasons, from
# the conformance suite's measurements on real models (conformance/harness/tolerances.py):
# - numpy vs llama.cpp CPU: numpy rounds activations where llama.cpp's CPU path does; layer 0
#   agrees to ~1e-5 (an occasional Q8 rounding flip), deep layers reach 8.5e-3 (gemma3's
#   post-norms amplify) → 1e-4 and 2e-2.
# - CUDA (Q8_1 activations, as llama.cpp's CUDA path) vs llama.cpp CPU: ~3e-4 at layer 0
#   → 2e-3; deep layers drift like an unemulated engine, bounded like llama.cpp's whole-graph
#   check → 5e-2. The same bounds are used against llama.cpp's CUDA backend and for numpy
#   against llama.cpp's CUDA backend.
NODE_BOUNDS = {("numpy", "cpu"): (1e-4, 2e-2)}
DEFAULT_NODE_BOUNDS = (2e-3, 5e-2)
# Logits (result_output): measured ≤ 9.1e-4 (numpy vs CPU), CUDA given the any-layer bound.
LOGIT_BOUNDS = {("numpy", "cpu"): 5e-3}
DEFAULT_LOGIT_BOUND = 2e-2
# Teacher-forced argmax must agree wherever llama.cpp's margin is at least this (logits): the
# largest margin at which the numpy backend ever chose differently was 0.345 (gemma3-270m).
ARGMAX_MARGIN = 0.5


@dataclass
class NodeDiff:
    name: str           # llama.cpp's node name (Brass traces it under the same name)
    role: str
    layer: int | None
    nmse: float
    max_abs: float
    bound: float
    experts_differ: int = 0     # moe_topk: tokens whose chosen experts differ

    @property
    def ok(self) -> bool:
        return self.nmse <= self.bound and not self.experts_differ

    @property
    def note(self) -> str:
        return f"experts differ at {self.experts_differ} tokens" if self.experts_differ else ""


@dataclass
class DiffReport:
    model: str
    backend: str
    reference: str
    prompt_ids: list[int]
    generated_ids: list[int]          # llama.cpp's greedy continuation
    tokenizer_agrees: bool
    nodes: list[NodeDiff] = field(default_factory=list)
    positions: int = 0                # teacher-forced positions with a clear margin
    agree: int = 0
    disagreements: list[str] = field(default_factory=list)
    untraced: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> NodeDiff | None:
        return next((n for n in self.nodes if not n.ok), None)

    @property
    def passed(self) -> bool:
        return (self.first_divergence is None and self.agree == self.positions
                and not self.untraced and self.tokenizer_agrees)

    def as_dict(self) -> dict:
        first = self.first_divergence
        return {"model": self.model, "backend": self.backend, "reference": f"llama.cpp {self.reference}",
                "prompt_tokens": len(self.prompt_ids), "generated_by_llama_cpp": len(self.generated_ids),
                "tokenizer_agrees": self.tokenizer_agrees,
                "nodes": [{"node": n.name, "role": n.role, "layer": n.layer, "nmse": n.nmse,
                           "max_abs": n.max_abs, "bound": n.bound, "ok": n.ok,
                           **({"note": n.note} if n.note else {})} for n in self.nodes],
                "first_divergence": first.name if first else None,
                "argmax": {"margin_at_least": ARGMAX_MARGIN, "positions": self.positions,
                           "agree": self.agree, "disagreements": self.disagreements},
                "untraced": self.untraced, "passed": self.passed}

    def table(self) -> str:
        from tabulate import tabulate
        first = self.first_divergence
        rows = [(n.name, n.role, "-" if n.layer is None else n.layer, f"{n.nmse:.2e}", f"{n.max_abs:.3g}",
                 f"{n.bound:.0e}", ("ok" if n.ok else "OUT") + (f" ({n.note})" if n.note else "")
                 + ("  <- first divergence" if n is first else "")) for n in self.nodes]
        out = [tabulate(rows, headers=["node", "role", "layer", "NMSE", "max |Δ|", "bound", ""])]
        out.append("")
        out.append(f"{self.model}: Brass {self.backend} vs llama.cpp {self.reference}; "
                   f"{len(self.prompt_ids)} prompt tokens + {len(self.generated_ids)} generated by llama.cpp")
        if not self.tokenizer_agrees:
            out.append("tokenizer: Brass's ids differ from llama.cpp's (llama.cpp's were used below)")
        out.append(f"teacher-forced argmax: {self.agree}/{self.positions} positions agree "
                   f"where llama.cpp's margin >= {ARGMAX_MARGIN}")
        out += [f"  {d}" for d in self.disagreements[:10]]
        if self.untraced:
            out.append(f"Brass traced no node for: {', '.join(self.untraced[:10])}")
        out.append(f"first node out of bounds: {first.name} (layer {first.layer}, {first.role})"
                   if first else "every node within its bound")
        out.append("PASS" if self.passed else "FAIL")
        return "\n".join(out)


def _tap_name(node: dict) -> str:
    from .llamacpp import brass_tap
    return brass_tap(node["name"], node["role"], node["layer"])


def nmse(ours: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(((ours.astype(np.float64) - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-30))


def diff(model, prompt: str = DEFAULT_PROMPT, reference: str = "cpu", n_gen: int = DEFAULT_N_GEN,
         progress=None) -> DiffReport:
    """Compare `model` (an brass.model.Model) with llama.cpp on `prompt`."""
    from . import llamacpp
    if n_gen < 0:
        raise BrassError("diff: the number of generated tokens must be >= 0")
    if reference not in llamacpp.DEVICES:
        raise BrassError(f"diff: the reference must be one of {', '.join(llamacpp.DEVICES)}, not {reference!r}")
    if reference == "cuda" and not llamacpp.has_cuda():
        # a CPU build would silently run everything on the CPU and be reported as CUDA
        raise BrassError("diff: --reference cuda needs llama.cpp built with CUDA (ci/build_llamacpp_cuda.sh), "
                         "named by LLAMA_CPP_LIB_PATH; the binding loaded here is a CPU build")
    say = progress or (lambda msg: None)
    ours_ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    if not ours_ids:
        raise BrassError("diff: the prompt is empty")
    say(f"llama.cpp ({reference}): loading {model.path.name}")
    with llamacpp.Model(model.path, device=reference) as lm:
        ids = lm.tokenize(prompt, True, True)
        if len(ids) + n_gen > llamacpp.N_CTX:
            raise BrassError(f"diff: {len(ids)} prompt tokens + {n_gen} do not fit llama.cpp's "
                             f"pinned context of {llamacpp.N_CTX}")
        gen = []
        if n_gen:
            with lm.context() as ctx:
                logits = ctx.decode(ids, all_logits=False)[0]
                while len(gen) < n_gen:
                    tok = int(np.argmax(logits))
                    gen.append(tok)
                    if lm.is_eog(tok) or len(gen) == n_gen:
                        break
                    logits = ctx.decode([tok], all_logits=False)[0]
        say(f"llama.cpp ({reference}): {len(ids)} + {len(gen)} tokens, capturing activations")
        ref_logits, ref_nodes = llamacpp.capture_activations(lm, ids + gen)
    say(f"Brass ({model.backend.name}): scoring")
    traced: dict = {}
    logits = model.score(ids + gen, trace=lambda key, x: traced.__setitem__(key, model.backend.to_numpy(x)))
    backend = model.backend.name
    bound0, bound = NODE_BOUNDS.get((backend, reference), DEFAULT_NODE_BOUNDS)
    logit_bound = LOGIT_BOUNDS.get((backend, reference), DEFAULT_LOGIT_BOUND)
    report = DiffReport(model=model.name, backend=backend, reference=reference, prompt_ids=ids,
                        generated_ids=gen, tokenizer_agrees=ours_ids == ids)
    for node in ref_nodes:
        tap = _tap_name(node)
        if tap not in traced:
            report.untraced.append(node["name"])
            continue
        ref = node["array"].astype(np.float32) if node["array"].dtype != np.int32 else node["array"]
        ours = np.asarray(traced[tap]).reshape(ref.shape)
        if node["role"] == "moe_topk":
            n_diff = int((np.sort(ours, axis=-1) != np.sort(ref, axis=-1)).any(axis=-1).sum())
            report.nodes.append(NodeDiff(node["name"], node["role"], node["layer"], 0.0, 0.0, 0.0, n_diff))
            continue
        limit = logit_bound if node["role"] == "result_output" else (bound0 if node["layer"] == 0 else bound)
        report.nodes.append(NodeDiff(node["name"], node["role"], node["layer"], nmse(ours, ref),
                                     float(np.abs(ours.astype(np.float64) - ref).max()), limit))
    top2 = -np.sort(-np.partition(ref_logits, -2, axis=1)[:, -2:], axis=1)
    margin = top2[:, 0] - top2[:, 1]
    ref_arg, our_arg = ref_logits.argmax(axis=1), logits.argmax(axis=1)
    clear = margin >= ARGMAX_MARGIN
    report.positions, report.agree = int(clear.sum()), int((clear & (ref_arg == our_arg)).sum())
    report.disagreements = [f"position {j}: Brass {our_arg[j]}, llama.cpp {ref_arg[j]} (margin {margin[j]:.3f})"
                            for j in np.nonzero(clear & (ref_arg != our_arg))[0]]
    return report
