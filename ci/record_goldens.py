#!/usr/bin/env python
"""Record the golden corpus from llama.cpp (CPU) into golden/.

    BRASS_CACHE=... python ci/record_goldens.py            # everything (~2-5 min on 2 cores)
    python ci/record_goldens.py --only synth-qwen3,gemma3-270m   # some models, then the manifest
    python ci/record_goldens.py --check                    # re-record a quick subset, compare

What is recorded and in which format is described in golden/README.md. Recording is
deterministic: recording twice gives byte-identical files (`--check` proves it on a subset).
Needs the `record` extra (llama-cpp-python); the real models come from brass.catalog.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ci import tokenizer_corpus, tokenizer_strings  # noqa: E402
from conformance.harness import synth_models  # noqa: E402
from brass import catalog, llamacpp  # noqa: E402
from brass.diff import nmse  # noqa: E402
from brass.gguf import GGUFFile  # noqa: E402

GOLDEN = ROOT / "golden"
FORMAT_VERSION = 1
N_GENERATE = 32
TOP_K = 16
# float16 keeps ~3 significant digits (relative rounding <= 2^-11), well inside the tolerances
# a per-layer comparison against a quantized llama.cpp can use; nodes with values beyond this
# bound would overflow or lose range and are stored as float32.
FLOAT16_MAX = 60000.0

# --- what is recorded -----------------------------------------------------------------------

LONG_TEXT = (
    "Brass is an inference engine for language models stored in the GGUF format. It reads the "
    "file, maps the weights, and runs the transformer one layer at a time: an RMS norm, the "
    "attention block with rotary position embeddings and a grouped key-value cache, another "
    "norm, and a gated feed-forward network. Each of these steps has to agree with llama.cpp, "
    "which is why every layer's output is compared with a recording like this one. Summarize "
    "the paragraph above in one sentence:"
)

# The synthetic vocabularies are small (~1k tokens), so their long prompt needs fewer words
# for the same >= 64 tokens (and a shorter prompt keeps golden/ within its size budget).
LONG_TEXT_SYNTH = LONG_TEXT.split(": an RMS norm")[0] + "."

COMMON_PROMPTS = [
    ("plain", "The capital of France is"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("digits", "The first ten prime numbers are 2, 3, 5,"),
]

CHATML = "<|im_start|>user\nName three colors of the rainbow.<|im_end|>\n<|im_start|>assistant\n"
GEMMA_CHAT = "<start_of_turn>user\nName three colors of the rainbow.<end_of_turn>\n<start_of_turn>model\n"

# Longer than Gemma 3's 512-token sliding window (built from the synthetic corpus, see
# window_prompt): the only prompt in which the local layers' window actually masks tokens.
WINDOW_MIN_TOKENS = 560

REAL_MODELS = {
    "smollm2-135m": dict(tokenizer="smollm2", chat=CHATML),
    "gemma3-270m": dict(tokenizer="gemma3", chat=GEMMA_CHAT, window_prompt=True),
    "qwen2.5-coder-0.5b": dict(tokenizer="qwen2", chat=CHATML),
}
SYNTH_CHAT = {"synth-spm": "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
              "synth-bpe-llama3": CHATML, "synth-bpe-default": CHATML}

ACTIVATION_PROMPT_REAL = "The quick brown fox jumps over the"        # 7-8 tokens
ACTIVATION_PROMPT_SYNTH = "The harbour is still there, and on market day it rains."

def prompts_for(model: str) -> list[tuple[str, str]]:
    if model in REAL_MODELS:
        return COMMON_PROMPTS + [("long", LONG_TEXT), ("chat", REAL_MODELS[model]["chat"])]
    chat = SYNTH_CHAT[synth_models.MODELS[model]["tokenizer"]]
    return COMMON_PROMPTS + [("long", LONG_TEXT_SYNTH), ("chat", chat)]


def window_prompt(m: llamacpp.Model) -> str:
    """The shortest run of corpus paragraphs that tokenizes to > WINDOW_MIN_TOKENS tokens."""
    paragraphs = synth_models.CORPUS.read_text(encoding="utf-8").split("\n\n")
    text = ""
    for p in paragraphs:
        text = f"{text}\n\n{p}" if text else p
        if len(m.tokenize(text, True, True)) > WINDOW_MIN_TOKENS:
            return text
    raise RuntimeError("the corpus is too short for the sliding-window prompt")


# --- helpers --------------------------------------------------------------------------------

def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def f32(x) -> float:
    """A float32 as the shortest decimal that reads back to the same float32."""
    return float(str(np.float32(x)))


def lse(logits: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp, computed in float64 from the float32 logits (max-shifted, so no
    exp overflows), stored as float32: a logprob is a logit minus its row's lse."""
    x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    m = x.max(axis=1)
    return (m + np.log(np.exp(x - m[:, None]).sum(axis=1))).astype(np.float32)


def topk(logits: np.ndarray, k: int = TOP_K) -> list[list]:
    """[[id, logit], ...] by descending logit, ties → lower id (deterministic)."""
    cut = np.partition(logits, -k)[-k]
    cand = np.nonzero(logits >= cut)[0]
    order = np.lexsort((cand, -logits[cand]))[:k]
    return [[int(cand[i]), f32(logits[cand[i]])] for i in order]


def dumps(obj, indent: int = 0) -> str:
    """JSON with one line per innermost list: readable, diff-friendly, deterministic."""
    pad = " " * indent
    if isinstance(obj, dict):
        if all(not isinstance(v, (dict, list)) or
               (isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v))
               for v in obj.values()):
            return json.dumps(obj, ensure_ascii=False)
        items = [f'{pad} {json.dumps(k)}: {dumps(v, indent + 1)}' for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        if all(isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v) for v in obj) \
                and len(obj) <= 16:
            return json.dumps(obj, ensure_ascii=False)
        items = [f"{pad} {dumps(v, indent + 1)}" for v in obj]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj, ensure_ascii=False)


def write_json(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(obj) + "\n", encoding="utf-8")


def write_npz(path: Path, arrays: dict[str, np.ndarray]):
    """np.savez_compressed without the timestamps (so the file is reproducible)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            data = io.BytesIO()
            np.lib.format.write_array(data, np.ascontiguousarray(arr), allow_pickle=False)
            z.writestr(info, data.getvalue(), compresslevel=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def model_path(name: str, out: Path) -> Path:
    if name in REAL_MODELS:
        return catalog.fetch(name)
    return out / "models" / f"{name}.gguf"


# --- recorders ------------------------------------------------------------------------------

def tokenize_cases(model_file: Path) -> list[dict]:
    cases = []
    with llamacpp.Model(model_file, vocab_only=True) as m:
        for text in tokenizer_strings.STRINGS:
            for add_special, parse_special in tokenizer_strings.MODES:
                cases.append({"text": text, "add_special": add_special, "parse_special": parse_special,
                              "ids": m.tokenize(text, add_special, parse_special)})
    return cases


def record_tokenizer(tok_name: str, model_file: Path, model_name: str, out: Path):
    """Record a tokenizer from the first model that uses it; for any later model that shares
    it, check that llama.cpp tokenizes identically instead of writing a second copy."""
    t0 = time.time()
    cases = tokenize_cases(model_file)
    target = out / "tokenizer" / f"{tok_name}.json"
    source = TOKENIZER_SOURCE[tok_name]
    if source != model_name:
        recorded = json.loads(target.read_text(encoding="utf-8"))["cases"]
        if recorded != cases:
            raise RuntimeError(f"{model_name} shares tokenizer {tok_name} with {source} but "
                               "llama.cpp tokenizes differently")
        log(f"  tokenizer {tok_name}: identical to {source}'s ({time.time() - t0:.1f}s)")
        return
    write_json(target, {"tokenizer": tok_name, "recorded_from": model_name, "cases": cases})
    log(f"  tokenizer {tok_name}: {len(cases)} cases ({time.time() - t0:.1f}s)")


def corpus_ids(model_file: Path) -> list[list[int]]:
    with llamacpp.Model(model_file, vocab_only=True) as m:
        return [m.tokenize(text, False, False) for text in tokenizer_corpus.strings()]


def dumps_corpus(doc: dict) -> str:
    """The header on the first line, then one compact id list per line (the corpus' order);
    stored gzipped (a quarter of the size), readable with zcat."""
    head = json.dumps({k: v for k, v in doc.items() if k != "ids"}, ensure_ascii=False)[:-1]
    rows = ",\n".join(json.dumps(ids, separators=(",", ":")) for ids in doc["ids"])
    return f'{head}, "ids": [\n{rows}\n]}}\n'


def record_tokenizer_corpus(tok_name: str, model_file: Path, model_name: str, out: Path):
    """llama.cpp's ids (add_special and parse_special off) of every string of the corpus of
    ci/tokenizer_corpus.json; a model sharing the tokenizer is checked, not written, as above."""
    t0 = time.time()
    ids = corpus_ids(model_file)
    target = out / "tokenizer" / "corpus" / f"{tok_name}.json.gz"
    source = TOKENIZER_SOURCE[tok_name]
    if source != model_name:
        if json.loads(gzip.decompress(target.read_bytes()))["ids"] != ids:
            raise RuntimeError(f"{model_name} shares tokenizer {tok_name} with {source} but "
                               "llama.cpp tokenizes the corpus differently")
        log(f"  tokenizer corpus {tok_name}: identical to {source}'s ({time.time() - t0:.1f}s)")
        return
    doc = {"tokenizer": tok_name, "recorded_from": model_name, "corpus": "ci/tokenizer_corpus.json",
           "corpus_sha256": tokenizer_corpus.sha256(), "add_special": False, "parse_special": False,
           "strings": len(ids), "tokens": sum(map(len, ids)), "ids": ids}
    target.parent.mkdir(parents=True, exist_ok=True)
    # mtime 0 and no file name in the header: recording twice gives the same bytes
    target.write_bytes(gzip.compress(dumps_corpus(doc).encode("utf-8"), compresslevel=9, mtime=0))
    log(f"  tokenizer corpus {tok_name}: {len(ids)} strings, {doc['tokens']} tokens ({time.time() - t0:.1f}s)")


def generate(m: llamacpp.Model, ids: list[int]) -> dict:
    """Greedy decoding step by step (prompt in one batch, then one token per decode), then a
    teacher-forced pass over prompt + generated ids in one batch with logits everywhere."""
    gen, steps, step_lse, stop = [], [], [], "length"
    with m.context() as ctx:
        logits = ctx.decode(ids, all_logits=False)[0]
        while True:
            tok = int(np.argmax(logits))           # ties → lowest id
            steps.append(topk(logits))
            step_lse.append(f32(lse(logits)[0]))
            gen.append(tok)
            if m.is_eog(tok):
                stop = "eog"
                break
            if len(gen) == N_GENERATE:
                break
            logits = ctx.decode([tok], all_logits=False)[0]
    with m.context() as ctx:
        full = ctx.decode(ids + gen, all_logits=True)
    top2 = -np.sort(-np.partition(full, -2, axis=1)[:, -2:], axis=1)
    return {
        "generated_ids": gen,
        "stop": stop,
        "generated_topk": steps,
        "generated_lse": step_lse,
        "teacher_forced": {
            "argmax": [int(i) for i in np.argmax(full, axis=1)],
            "margin": [f32(x) for x in top2[:, 0] - top2[:, 1]],
            "topk": [topk(row) for row in full],
            "lse": [f32(x) for x in lse(full)],
        },
    }


def record_prompts(name: str, m: llamacpp.Model, out: Path):
    entries = []
    plist = prompts_for(name)
    if name in REAL_MODELS and REAL_MODELS[name].get("window_prompt"):
        plist = plist + [("window", window_prompt(m))]
    for pname, text in plist:
        t0 = time.time()
        ids = m.tokenize(text, True, True)
        entry = {"name": pname, "text": text, "add_special": True, "parse_special": True,
                 "prompt_ids": ids}
        entry.update(generate(m, ids))
        entries.append(entry)
        log(f"  {name} prompt {pname}: {len(ids)} + {len(entry['generated_ids'])} tokens "
            f"({entry['stop']}, {time.time() - t0:.1f}s)")
    write_json(out / "prompts" / f"{name}.json",
               {"model": name, "n_generate": N_GENERATE, "top_k": TOP_K, "prompts": entries})


def record_activations(name: str, m: llamacpp.Model, out: Path):
    t0 = time.time()
    real = name in REAL_MODELS
    text = ACTIVATION_PROMPT_REAL if real else ACTIVATION_PROMPT_SYNTH
    ids = m.tokenize(text, True, True)
    logits, nodes = llamacpp.capture_activations(m, ids)
    arrays, meta = {}, {}
    for node in nodes:                              # graph order
        key, arr, role = node["key"], node["array"], node["role"]
        info = {k: node[k] for k in ("name", "occurrence", "op", "layer", "role", "ne", "type")}
        if role == "result_output":
            if not np.array_equal(arr, logits):
                raise RuntimeError(f"{name}: captured result_output differs from the logits")
            if real:
                top = [topk(row) for row in arr]
                arrays[key + ":top_ids"] = np.array([[i for i, _ in r] for r in top], np.int32)
                arrays[key + ":top_logits"] = np.array([[v for _, v in r] for r in top], np.float32)
                meta[key] = {**info, "stored": f"top{TOP_K}", "dtype": "float32"}
                continue
        elif arr.dtype == np.float32 and np.isfinite(arr).all() and np.abs(arr).max() < FLOAT16_MAX:
            arr = arr.astype(np.float16)            # logits stay float32
        arrays[key] = arr
        meta[key] = {**info, "stored": "full", "dtype": str(arr.dtype)}
    write_npz(out / "activations" / f"{name}.npz", arrays)
    write_json(out / "activations" / f"{name}.json",
               {"model": name, "text": text, "add_special": True, "parse_special": True,
                "prompt_ids": ids, "nodes": meta})
    log(f"  {name} activations: {len(ids)} tokens, {len(arrays)} arrays ({time.time() - t0:.1f}s)")


def tokenizer_of(name: str) -> str:
    return REAL_MODELS[name]["tokenizer"] if name in REAL_MODELS else synth_models.MODELS[name]["tokenizer"]


def record_model(name: str, out: Path, what=("tokenizer", "prompts", "activations"), device: str = "cpu"):
    log(f"[{name}]")
    # the CUDA set is recorded from the same files as the CPU set (golden/models)
    path = model_path(name, out if device == "cpu" else GOLDEN)
    if name not in REAL_MODELS and "model" in what:
        synth_models.build(name, out / "models")
        log(f"  built {path.relative_to(out)} ({path.stat().st_size / 1e6:.2f} MB)")
    if "tokenizer" in what:
        record_tokenizer(tokenizer_of(name), path, name, out)
        record_tokenizer_corpus(tokenizer_of(name), path, name, out)
    if "prompts" in what or "activations" in what:
        with llamacpp.Model(path, device=device) as m:
            if "prompts" in what:
                record_prompts(name, m, out)
            if "activations" in what:
                record_activations(name, m, out)


# --- manifest -------------------------------------------------------------------------------

# The recorder's folders under golden/ (other goldens, e.g. chat_templates/, have their own).
RECORDED_DIRS = ("models", "tokenizer", "prompts", "activations")


def recorded_files(out: Path) -> list[Path]:
    return sorted(p for d in RECORDED_DIRS if (out / d).is_dir() for p in (out / d).rglob("*") if p.is_file())


def _gguf_facts(path: Path) -> dict:
    gf = GGUFFile(path)
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        counts[t.type.name] = counts.get(t.type.name, 0) + 1
    facts = {"arch": gf.architecture, "n_layer": int(gf.metadata[f"{gf.architecture}.block_count"]),
             "n_vocab": len(gf.metadata["tokenizer.ggml.tokens"]), "types": dict(sorted(counts.items()))}
    gf.close()
    return facts


def decode_vs_batch(prompts: list[dict]) -> float:
    """Largest |logit| difference between the step-by-step decode and the teacher-forced batch
    at the same position, over ids in both top-k lists: how much llama.cpp itself moves."""
    worst = np.float32(0)
    for p in prompts:
        n = len(p["prompt_ids"])
        for i, step in enumerate(p["generated_topk"]):
            batch = {tid: np.float32(v) for tid, v in p["teacher_forced"]["topk"][n - 1 + i]}
            worst = max([worst] + [abs(batch[tid] - np.float32(v)) for tid, v in step if tid in batch])
    return f32(worst)


def build_manifest(out: Path) -> dict:
    # the tensor-parallel shapes (synth_models.TP_MODELS) are listed apart: their own test
    # checks them (conformance/models/test_tensor_parallel.py), not every per-model test
    models, tp_models = [], []
    for name in list(REAL_MODELS) + list(synth_models.MODELS):
        if not (out / "prompts" / f"{name}.json").is_file():
            log(f"manifest: no goldens for {name} yet (left out)")
            continue
        real = name in REAL_MODELS
        path = model_path(name, out)
        facts = _gguf_facts(path)
        prompts = json.loads((out / "prompts" / f"{name}.json").read_text(encoding="utf-8"))["prompts"]
        acts = json.loads((out / "activations" / f"{name}.json").read_text(encoding="utf-8"))
        entry = {"name": name, "kind": "real" if real else "synthetic", "arch": facts["arch"],
                 "tokenizer": tokenizer_of(name), "n_layer": facts["n_layer"],
                 "n_vocab": facts["n_vocab"]}
        if real:
            cm = catalog.CATALOG[name]
            entry.update(description=cm.description, sha256=cm.sha256, size=cm.size,
                         source={"catalog": name, "filename": cm.filename,
                                 "pypi": [f"{w.package}=={w.version}" for w in cm.parts]})
        else:
            cfg = synth_models.MODELS[name]
            entry.update(description=cfg["description"], sha256=sha256(path), size=path.stat().st_size,
                         source={"file": f"models/{name}.gguf", "script": "conformance/harness/synth_models.py",
                                 "seed": cfg["seed"], "corpus": "conformance/harness/synth_corpus.txt",
                                 "quantized_by": "llama_model_quantize (pure, per-tensor overrides)"})
        entry["types"] = facts["types"]
        entry["prompts"] = {"file": f"prompts/{name}.json", "count": len(prompts),
                            "names": [p["name"] for p in prompts],
                            "prompt_tokens": [len(p["prompt_ids"]) for p in prompts],
                            "decode_vs_batch_max_logit_diff": decode_vs_batch(prompts)}
        dtypes = sorted({n["dtype"] for n in acts["nodes"].values()})
        entry["activations"] = {"file": f"activations/{name}.npz", "meta": f"activations/{name}.json",
                                "prompt_tokens": len(acts["prompt_ids"]), "nodes": len(acts["nodes"]),
                                "dtypes": dtypes,
                                "float32_nodes": sorted(k for k, n in acts["nodes"].items()
                                                        if n["dtype"] == "float32")}
        (tp_models if synth_models.MODELS.get(name, {}).get("tp") else models).append(entry)
    tokenizers = []
    for f in sorted((out / "tokenizer").glob("*.json")):
        doc = json.loads(f.read_text(encoding="utf-8"))
        tokenizers.append({"name": doc["tokenizer"], "file": f"tokenizer/{f.name}",
                           "recorded_from": doc["recorded_from"],
                           "models": [m["name"] for m in models if m["tokenizer"] == doc["tokenizer"]],
                           "strings": len({c["text"] for c in doc["cases"]}), "cases": len(doc["cases"])})
        corpus_file = out / "tokenizer" / "corpus" / f"{f.stem}.json.gz"
        if corpus_file.is_file():
            corpus = json.loads(gzip.decompress(corpus_file.read_bytes()))
            tokenizers[-1]["corpus"] = {"file": f"tokenizer/corpus/{corpus_file.name}", "strings": corpus["strings"],
                                        "tokens": corpus["tokens"], "corpus_sha256": corpus["corpus_sha256"],
                                        "add_special": False, "parse_special": False}
    files = {str(f.relative_to(out)): sha256(f) for f in recorded_files(out)}
    llama = llamacpp.provenance()
    return {
        "format": FORMAT_VERSION,
        "llama_cpp": llama,
        "settings": {
            "context": llamacpp.CONTEXT_SETTINGS,
            "model": llamacpp.MODEL_SETTINGS,
            "all_params": llamacpp.settings_record(),
            "tokenization": "llama_tokenize(add_special=True, parse_special=True), as llama.cpp's "
                            "completion tokenizes a prompt",
            "generation": f"greedy: argmax of the float32 logits (ties → lowest id), {N_GENERATE} "
                          "tokens, prompt decoded in one batch then one token per llama_decode; "
                          "stops early only at an end-of-generation token (kept, stop = 'eog'); "
                          "no sampler and no random seed are involved",
            "teacher_forced": "one llama_decode over prompt + generated ids, logits for every position",
            "top_k": TOP_K,
            "activation_storage": f"float16 when every |x| < {FLOAT16_MAX:g}, else float32; "
                                  "result_output: full float32 logits (synthetic) or top-16 per "
                                  "position (real models)",
        },
        "command": "BRASS_CACHE=<cache> python ci/record_goldens.py",
        "check_command": "python ci/record_goldens.py --check",
        "models": models,
        "tp_models": tp_models,
        "tokenizers": tokenizers,
        "weight_types": sorted({t for m in models for t in m["types"]}),
        "files": files,
    }


# --- the CUDA set ---------------------------------------------------------------------------

SPREAD_MARGIN = 0.25      # the clear-margin threshold for argmax agreement


def spread(name: str, cuda_out: Path, cpu_out: Path = GOLDEN) -> dict:
    """How far llama.cpp's CUDA backend is from its own CPU backend on one model: per-role worst
    NMSE of the activations (layer 0 and any layer), teacher-forced argmax agreement where the
    CPU margin is >= SPREAD_MARGIN (on the common prefix of the two teacher-forced sequences:
    the generated ids may part), the worst top-1 logit difference there, and how many greedy
    tokens agree before the two streams part."""
    def load(out):
        meta = json.loads((out / "activations" / f"{name}.json").read_text(encoding="utf-8"))
        with np.load(out / "activations" / f"{name}.npz") as z:
            arrays = {k: z[k].astype(np.float32) if z[k].dtype == np.float16 else z[k] for k in z.files}
        prompts = json.loads((out / "prompts" / f"{name}.json").read_text(encoding="utf-8"))["prompts"]
        return meta, arrays, prompts
    gmeta, garr, gprompts = load(cuda_out)
    cmeta, carr, cprompts = load(cpu_out)
    roles: dict[str, dict] = {}
    for key, node in cmeta["nodes"].items():
        if node["stored"] != "full" or node["role"] == "moe_topk" or key not in gmeta["nodes"]:
            continue
        err = nmse(garr[key], carr[key])
        r = roles.setdefault(node["role"], {"layer0": 0.0, "any": 0.0})
        r["any"] = max(r["any"], err)
        if node["layer"] == 0:
            r["layer0"] = max(r["layer0"], err)
    checked = agree = 0
    worst_top1 = 0.0
    same_tokens = total_tokens = 0
    for gp, cp in zip(gprompts, cprompts):
        g_ids = gp["prompt_ids"] + gp["generated_ids"]
        c_ids = cp["prompt_ids"] + cp["generated_ids"]
        common = next((i for i, (a, b) in enumerate(zip(g_ids, c_ids)) if a != b), min(len(g_ids), len(c_ids)))
        # row i predicts token i + 1; rows < common have identical inputs
        for i in range(common):
            if cp["teacher_forced"]["margin"][i] >= SPREAD_MARGIN:
                checked += 1
                agree += gp["teacher_forced"]["argmax"][i] == cp["teacher_forced"]["argmax"][i]
            gt, ct = gp["teacher_forced"]["topk"][i][0], cp["teacher_forced"]["topk"][i][0]
            if gt[0] == ct[0]:
                worst_top1 = max(worst_top1, abs(gt[1] - ct[1]))
        n = len(cp["generated_ids"])
        same_tokens += next((i for i, (a, b) in enumerate(zip(gp["generated_ids"], cp["generated_ids"])) if a != b),
                            min(n, len(gp["generated_ids"])))
        total_tokens += n
    return {"activations_nmse": {k: {"layer0": float(f"{v['layer0']:.3g}"), "any": float(f"{v['any']:.3g}")}
                                 for k, v in roles.items()},
            "worst_nmse": float(f"{max((v['any'] for v in roles.values()), default=0.0):.3g}"),
            "teacher_forced": {"margin_at_least": SPREAD_MARGIN, "positions": checked, "agree": agree,
                               "worst_top1_logit_diff": f32(worst_top1)},
            "greedy_tokens_equal_before_parting": f"{same_tokens}/{total_tokens}"}


def build_cuda_manifest(out: Path) -> dict:
    """The CUDA set's manifest: its own provenance and settings, each model's files (model
    metadata stays in golden/manifest.json), and the CUDA-vs-CPU spread of llama.cpp itself."""
    models = []
    for name in list(REAL_MODELS) + list(synth_models.MODELS):
        if not (out / "prompts" / f"{name}.json").is_file():
            log(f"manifest: no CUDA goldens for {name} (left out)")
            continue
        prompts = json.loads((out / "prompts" / f"{name}.json").read_text(encoding="utf-8"))["prompts"]
        acts = json.loads((out / "activations" / f"{name}.json").read_text(encoding="utf-8"))
        models.append({
            "name": name,
            "prompts": {"file": f"prompts/{name}.json", "count": len(prompts),
                        "names": [p["name"] for p in prompts],
                        "decode_vs_batch_max_logit_diff": decode_vs_batch(prompts)},
            "activations": {"file": f"activations/{name}.npz", "meta": f"activations/{name}.json",
                            "prompt_tokens": len(acts["prompt_ids"]), "nodes": len(acts["nodes"])},
            "spread_vs_cpu": spread(name, out)})
    files = {str(f.relative_to(out)): sha256(f) for f in recorded_files(out)}
    return {
        "format": FORMAT_VERSION,
        "llama_cpp": llamacpp.provenance("cuda"),
        "settings": {"context": llamacpp.CONTEXT_SETTINGS, "model": llamacpp.model_settings("cuda"),
                     "all_params": llamacpp.settings_record("cuda"),
                     "same_as": "golden/manifest.json (tokenization, generation, teacher forcing, "
                                "storage), except that every layer runs on the GPU"},
        "command": "LLAMA_CPP_LIB_PATH=<CUDA build> python ci/record_goldens.py --device cuda",
        "models": models,
        "files": files,
    }

# --- entry points ---------------------------------------------------------------------------

ALL_MODELS = list(synth_models.MODELS) + list(REAL_MODELS)
TOKENIZER_SOURCE: dict[str, str] = {}
for _name in ALL_MODELS:
    TOKENIZER_SOURCE.setdefault(tokenizer_of(_name), _name)
# --check re-records these (a few minutes on 2 cores): every synthetic artefact, every
# tokenizer, and the smallest real model's prompts and activations.
CHECK_SUBSET = {name: ("model", "tokenizer", "prompts", "activations") for name in synth_models.MODELS}
CHECK_SUBSET.update({"smollm2-135m": ("tokenizer", "prompts", "activations"),
                     "gemma3-270m": ("tokenizer",), "qwen2.5-coder-0.5b": ("tokenizer",)})


def check() -> int:
    committed = json.loads((GOLDEN / "manifest.json").read_text(encoding="utf-8"))
    problems = []
    for rel, digest in committed["files"].items():
        if not (GOLDEN / rel).is_file() or sha256(GOLDEN / rel) != digest:
            problems.append(f"{rel}: committed file does not match the manifest's sha256")
    if committed["llama_cpp"] != llamacpp.provenance():
        problems.append(f"llama.cpp differs: manifest {committed['llama_cpp']} vs {llamacpp.provenance()}")
    if committed["settings"]["all_params"] != json.loads(json.dumps(llamacpp.settings_record())):
        problems.append("the pinned llama.cpp parameters differ from the manifest's")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        t0 = time.time()
        for name, what in CHECK_SUBSET.items():
            record_model(name, out, what)
        n = 0
        for f in recorded_files(out):
            rel = str(f.relative_to(out))
            n += 1
            if rel not in committed["files"]:
                problems.append(f"{rel}: re-recorded but not in the manifest")
            elif sha256(f) != committed["files"][rel]:
                problems.append(f"{rel}: re-recorded file differs from the committed one")
            else:
                print(f"identical  {rel}")
        print(f"{n} files re-recorded in {time.time() - t0:.0f}s; {len(problems)} problems")
    for p in problems:
        print("PROBLEM   ", p)
    return 1 if problems else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="re-record a quick subset into a temporary folder and compare with golden/")
    ap.add_argument("--only", help="comma-separated model names to record (default: all)")
    ap.add_argument("--out", type=Path, help="output folder (default: golden/, or golden/cuda/ with --device cuda)")
    ap.add_argument("--device", choices=llamacpp.DEVICES, default="cpu",
                    help="llama.cpp backend: cpu (the golden set), or cuda (the second set, golden/cuda/: "
                         "prompts and activations of the same files, from a CUDA build named by "
                         "LLAMA_CPP_LIB_PATH; see ci/build_llamacpp_cuda.sh)")
    ap.add_argument("--manifest", action="store_true",
                    help="only rewrite manifest.json from the goldens already in the output folder")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = GOLDEN if args.device == "cpu" else GOLDEN / "cuda"
    cuda = args.device == "cuda"
    if cuda and not llamacpp.has_cuda():
        ap.error("--device cuda needs llama.cpp built with CUDA (ci/build_llamacpp_cuda.sh) named by "
                 "LLAMA_CPP_LIB_PATH; the binding loaded here is a CPU build")
    if args.check:
        return check()
    if args.manifest:
        write_json(args.out / "manifest.json", build_cuda_manifest(args.out) if cuda else build_manifest(args.out))
        return 0
    names = args.only.split(",") if args.only else ALL_MODELS
    unknown = [n for n in names if n not in ALL_MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(ALL_MODELS)}")
    t0 = time.time()
    for name in names:
        what = ("prompts", "activations") if cuda else ("model", "tokenizer", "prompts", "activations")
        record_model(name, args.out, what, device=args.device)
    write_json(args.out / "manifest.json", build_cuda_manifest(args.out) if cuda else build_manifest(args.out))
    log(f"done in {time.time() - t0:.0f}s; manifest written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
