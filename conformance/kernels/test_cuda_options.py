"""The CUDA backend's options (engine/backends/cuda/options.py) on the CPU: each one turned off
takes its path away from what a model launches, through the fake CuPy of
conformance/harness/launch_recording.py (kernels do not run: which kernels are launched, with which
grids and parameters, is what is checked). What each path computes is checked on the GPU
(test_kernels*.py); that the defaults launch what was recorded, by test_launch_sequence.py."""

from __future__ import annotations

import pytest

from conformance.harness import fake_cupy, launch_recording as lr

N_CTX = 128


def _launches(model: str, batch: bool = False, **options) -> list[dict]:
    """The kernel launches of a 7-token prompt and two greedy tokens (the first step eager, the
    second from the decode graph), then a 70-token prompt read twice in a new session (eagerly,
    then the model's start graph), on synthetic model `model` with the backend's `options`;
    with `batch`, a batched step of two sequences after that."""
    import brass
    from brass.batch import BatchDecoder
    rec = fake_cupy.Recorder()
    with lr.fake_cuda(rec):
        m = brass.load(str(lr.MODELS_DIR / f"{model}.gguf"), backend="cuda", quiet=True, **options)
        V = m.config.n_vocab
        rec.on = True
        list(m.generate([(3 + 37 * i) % V for i in range(7)], max_tokens=2, stop_at_eog=False,
                        session=m.new_session(N_CTX)))
        prompt = [(5 + 11 * i) % V for i in range(70)]
        for _ in range(2):
            m.new_session(N_CTX).prefill(prompt, device_logits=True)
        if batch:
            # the row kernels take rows of one block pool (a server's); sessions with pools of
            # their own are stepped a row at a time
            from brass.kv_cache import blocks_for
            pool = m.new_block_pool(2 * blocks_for(N_CTX))
            sessions = [m.new_session(N_CTX, pool=pool) for _ in range(2)]
            for s in sessions:
                s.cache.assign(pool.allocate(blocks_for(N_CTX)))
            for s, n in zip(sessions, (5, 9)):
                s.prefill(prompt[:n])
            BatchDecoder(m, graphs=False).step(sessions, [1, 2])
        rec.on = False
        assert m.backend.options.__dict__.items() >= options.items()
    return [e for e in rec.events if e["op"] == "launch"]


def _kernels(launches) -> set[str]:
    return {e["kernel"].split(":")[1] for e in launches}


def _taken(launches, prefix: str) -> int:
    return sum(e["kernel"].split(":")[1].startswith(prefix) for e in launches)


@pytest.mark.parametrize("model, option, prefix", [
    ("synth-qwen3", "attn_tiled", "attention_tiled_"),
    ("synth-qwen35", "delta_chunked", "gated_delta_net_chunked_"),
    ("synth-qwen3moe", "moe_mmq", "mmq_id_"),
    ("synth-gemma4", "mixed_matvec", "matvec_mixed_"),
])
def test_an_option_off_takes_its_kernel_away(model, option, prefix):
    on, off = _launches(model), _launches(model, **{option: False})
    assert _taken(on, prefix), f"{model} takes no {prefix}* launch by default: the check would prove nothing"
    assert not _taken(off, prefix), f"{option}=False: {model} still launches {prefix}*"


def test_moe_mmq_off_plans_on_the_host():
    off = _kernels(_launches("synth-qwen3moe", moe_mmq=False))
    assert "moe_plan" not in off and "gather_rows_f16" in off, sorted(off)


def test_pdl_off_launches_plain_graph_kernels():
    on, off = _launches("synth-qwen3"), _launches("synth-qwen3", pdl=False)
    assert any(e["pdl"] for e in on) and not any(e["pdl"] for e in off)
    # the same kernels either way, with the same grids and parameters
    strip = [{k: v for k, v in e.items() if k != "pdl"} for e in on]
    assert strip == [{k: v for k, v in e.items() if k != "pdl"} for e in off]


def test_f16_weights_off_dequantizes_every_prompt():
    on, off = _launches("synth-qwen3"), _launches("synth-qwen3", f16_weights=False)
    # kept copies: each weight dequantized once (its first prompt); off: at every prompt read
    assert 0 < _taken(on, "dequant_f16_") < _taken(off, "dequant_f16_")


def test_row_kernels_off_loops_over_the_rows():
    def per_row(launches):
        return [e for e in launches if e["kernel"].endswith((":rope_store", ":attention"))
                and e["params"].get("per_row")]
    on, off = _launches("synth-qwen3", batch=True), _launches("synth-qwen3", batch=True, row_kernels=False)
    assert per_row(on) and not per_row(off)


def test_attn_split_takes_decode_attention():
    # on and the default: every decode step's and batched step's attention in the split kernels
    # (prompts stay with the tiled kernel); off: none
    def split(launches):
        return _taken(launches, "attention_split_")
    for on in (_launches("synth-qwen3", batch=True, attn_split=True), _launches("synth-qwen3", batch=True)):
        assert split(on) and not [e for e in on if e["kernel"].endswith(":attention")]
        assert {e["params"]["per_row"] for e in on if e["kernel"].endswith(":attention_split_values")} == {0, 1}
    assert not split(_launches("synth-qwen3", batch=True, attn_split=False))


def test_attn_split_default_and_the_shared_memory_limit():
    # None: every decode-sized call, at any number of slots; True / False as said, for any call,
    # except where the one-block kernel's shared memory would not fit the device: the split
    # kernels whatever the option and whatever the call
    from types import SimpleNamespace
    from brass.backends.cuda.attention import ATTN_STATIC_SMEM, takes_split
    limit = 232448

    def takes(option, n_slots, smem=4096, decode=True):
        return takes_split(SimpleNamespace(options=SimpleNamespace(attn_split=option), smem_optin_limit=limit),
                           n_slots, smem, decode)
    assert all(takes(None, n) for n in (1, 16, 4095, 4097, 8192, 40960))
    assert not takes(None, 16, decode=False) and not takes(None, 40960, decode=False)
    assert takes(True, 16) and takes(True, 16, decode=False) and not takes(False, 8192)
    assert not takes(False, 1000, limit - ATTN_STATIC_SMEM) and takes(False, 1000, limit - ATTN_STATIC_SMEM + 4)
    assert takes(None, 1000, limit - ATTN_STATIC_SMEM + 4, decode=False)


def _depth_attention(**options) -> dict[str, set[str]]:
    """The attention kernels launched (by phase: a 20-token prompt, a decode step, a batched
    step of two rows) on synthetic model synth-qwen3 at a capacity of 4,096 slots, the prompt
    with the tiled kernel off (as a prompt whose head dims it lacks goes): what the split's
    default takes."""
    import brass
    from brass.batch import BatchDecoder
    from brass.kv_cache import blocks_for
    rec = fake_cupy.Recorder()
    got = {}
    with lr.fake_cuda(rec):
        m = brass.load(str(lr.MODELS_DIR / "synth-qwen3.gguf"), backend="cuda", quiet=True, attn_tiled=False,
                       **options)
        V, n_ctx = m.config.n_vocab, 4096
        pool = m.new_block_pool(2 * blocks_for(n_ctx))
        sessions = [m.new_session(n_ctx, pool=pool) for _ in range(2)]
        for s in sessions:
            s.cache.assign(pool.allocate(blocks_for(n_ctx)))
        prompt = [(5 + 11 * i) % V for i in range(20)]

        def phase(name, run):
            rec.events.clear()
            rec.on = True
            run()
            rec.on = False
            got[name] = {e["kernel"].split(":")[1] for e in rec.events
                         if e["op"] == "launch" and ":attention" in e["kernel"]}
        phase("prompt", lambda: sessions[0].prefill(prompt))
        sessions[1].prefill(prompt[:9])
        phase("decode", lambda: list(m.generate([7], max_tokens=1, stop_at_eog=False, session=sessions[0])))
        phase("rows", lambda: BatchDecoder(m, graphs=False).step(sessions, [1, 2]))
    return got


def test_attn_split_default_takes_decode_not_prompts():
    # the default takes a decode step's attention and a batched step's rows to the split
    # kernels, and leaves a prompt (that the tiled kernel
    # does not take) with the one-block kernel: one launch a layer, not three a group of
    # queries; attn_split=True takes the prompt too
    split = {"attention_split_logits", "attention_split_sums", "attention_split_values"}
    default = _depth_attention()
    assert default["prompt"] == {"attention"}, default
    assert default["decode"] == split and default["rows"] == split, default
    assert _depth_attention(attn_split=True)["prompt"] == split


def test_the_settings_give_the_defaults_and_options_override_them(monkeypatch):
    from brass.backends.cuda.options import CudaOptions
    for var in ("BRASS_CUDA_DEBUG", "BRASS_F16_WEIGHTS", "BRASS_F16_WEIGHTS_GB", "BRASS_PROMPT_GRAPHS"):
        monkeypatch.delenv(var, raising=False)
    o = CudaOptions()
    assert (o.debug, o.f16_weights, o.f16_weights_gb, o.own_cublas) == (False, True, None, True)
    monkeypatch.setenv("BRASS_F16_WEIGHTS", "0")
    monkeypatch.setenv("BRASS_F16_WEIGHTS_GB", "1.5")
    monkeypatch.setenv("BRASS_PROMPT_GRAPHS", "no")
    o = CudaOptions()
    assert (o.f16_weights, o.f16_weights_gb, o.own_cublas) == (False, 1.5, False)
    assert CudaOptions(f16_weights=True, own_cublas=True).f16_weights is True
    with pytest.raises(TypeError):
        CudaOptions(norm_matvec=True)               # a switch that was removed is no option
