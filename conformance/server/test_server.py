"""`brass serve` on loopback, driven as users drive it: the official `openai` client (streaming
and not), many clients at once, clients that hang up, /metrics, the command's own behaviour
(port in use, open files, Ctrl-C) and the web page in headless Chromium. Bad requests are in
test_server_requests.py, the API key in test_server_auth.py.

One server process (smollm2-135m, numpy backend, a 256-token context) serves the whole session
(the fixture `server` of conformance/harness/server_harness.py). What a reply must be
comes from the same model run in this process through the engine's API (greedy, or the same
seed): the server must neither change nor mix up anyone's tokens.
Measured on 2 cores: ~15 s for the module when the machine is otherwise idle, ~2.5 min when
other work shares the cores; the 16-client test, the Gemma fallback test and the openai-client
tests take most of it, the browser test ~2 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="FastAPI is not installed, so brass serve cannot run (pip install -e .; "
                                      "on the GPU runner: the wheels in .whl/, listed in ci/gpu.sh)")
from brass.sampling import SamplingParams  # noqa: E402
from brass.server import StopScanner  # noqa: E402
from conformance.harness.server_harness import (API_KEY, CHAT, COMPLETIONS, MODEL, N_CTX, SYSTEM, chat_ids,  # noqa: E402
                                        cut_at_stop, expected, read_sse, serve_synth, words)


# --------------------------------------------------------------------------------------------
# The openai client, streaming and not


def test_chat_completion_with_openai_client(server, model, openai_client, rng):
    messages = [SYSTEM, {"role": "user", "content": f"Repeat: {words(rng, 4)}"}]
    ids = chat_ids(model, messages)
    text, n, reason = expected(model, ids, 4)
    r = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)


def test_chat_completion_stream_with_openai_client(server, model, openai_client, rng):
    messages = [SYSTEM, {"role": "user", "content": f"Continue: {words(rng, 5)}"}]
    ids = chat_ids(model, messages)
    text, n, reason = expected(model, ids, 5)
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first, *middle, last, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None and c.choices[0].delta.content for c in middle)
    assert last.choices[0].finish_reason == reason and last.choices[0].delta.content is None
    assert "".join(c.choices[0].delta.content for c in middle) == text
    if n > 1 and len(text) > 1:
        assert len(middle) > 1, "the reply came in one piece: it was not streamed"
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(ids), n)


def test_completion_with_openai_client(server, model, openai_client, rng):
    prompt = words(rng, 6)
    ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    text, n, reason = expected(model, ids, 4)
    r = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.object == "text_completion"
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == reason


def test_completion_from_token_ids(server, model, rng):
    ids = [int(i) for i in rng.integers(100, model.config.n_vocab, size=5)]
    text, n, reason = expected(model, ids, 3)
    status, _, body = server.request("POST", COMPLETIONS, {"prompt": ids, "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (text, reason)
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_sampling_parameters_reach_the_sampler(server, model, openai_client, rng):
    """Random temperature/top-k/top-p/min-p/penalty and a seed: the server's tokens must be
    exactly the engine's with the same parameters (a dropped parameter changes them)."""
    params = dict(temperature=float(rng.uniform(0.7, 1.5)), top_k=int(rng.integers(5, 60)),
                  top_p=float(rng.uniform(0.6, 1.0)), min_p=float(rng.uniform(0.0, 0.1)),
                  repetition_penalty=float(rng.uniform(1.0, 1.5)), seed=int(rng.integers(0, 2**31)))
    prompt = words(rng, 5)
    ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    text, n, reason = expected(model, ids, 6, SamplingParams(**params))
    extra = {k: params[k] for k in ("top_k", "min_p", "repetition_penalty")}
    r = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=params["temperature"],
                                         top_p=params["top_p"], seed=params["seed"], extra_body=extra)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, reason), params


def test_seed_minus_one_is_random(server, rng):
    """llama.cpp reads a seed of -1 as "pick one at random": accepted, not a 500."""
    body = {"prompt": words(rng, 4), "max_tokens": 2, "temperature": 0.9, "seed": -1}
    status, _, out = server.request("POST", COMPLETIONS, body)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] >= 1


def test_stop_strings(server, model, rng):
    """A stop string taken from the middle of the greedy reply: the reply ends before it."""
    prompt = words(rng, 5)
    ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    full, _, _ = expected(model, ids, 8)
    if len(full.strip()) < 4:
        pytest.skip(f"the greedy reply to {prompt!r} is too short to cut: {full!r}")
    start = int(rng.integers(1, len(full) - 2))
    stop = full[start:start + 2]
    text, n, reason = expected(model, ids, 8, stop=[stop])
    status, _, body = server.request("POST", COMPLETIONS, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                           "stop": [stop, "\u2603never"]})
    assert status == 200, body
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (text, "stop"), (full, stop)
    assert body["usage"]["completion_tokens"] == n
    status, _, raw = server.request("POST", COMPLETIONS, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                          "stop": stop, "stream": True})
    events = read_sse(raw)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text


@pytest.mark.parametrize("trial", range(200))
def test_stop_scanner_any_chunking(trial, rng):
    """Text cut into random pieces gives the same output as the whole text: everything before
    the first stop string to be complete."""
    alphabet = list("ab c\n") + ["é", "☃"]
    text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 30))))
    # Stops that occur in the text (most of them) and ones that may not; many small pieces, so
    # that stop strings often straddle pieces.
    stops = []
    for _ in range(int(rng.integers(1, 4))):
        k = int(rng.integers(1, 5))
        if text and rng.random() < 0.7:
            start = int(rng.integers(0, len(text)))
            stops.append(text[start:start + k])
        else:
            stops.append("".join(rng.choice(alphabet, size=k)))
    cuts = sorted(set(int(c) for c in rng.integers(0, len(text) + 1, size=int(rng.integers(0, len(text) + 1)))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    scanner, out, hit = StopScanner(stops), [], False
    for p in pieces:
        emitted, hit = scanner.feed(p)
        out.append(emitted)
        if hit:
            break
    if not hit:
        out.append(scanner.flush())
    assert ("".join(out), hit) == cut_at_stop(text, stops), (text, stops, pieces)


def test_models_and_health(server, openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    assert openai_client.models.retrieve(MODEL).id == MODEL
    h = server.health()
    assert (h["status"], h["model"], h["backend"], h["n_ctx"]) == ("ok", MODEL, "numpy", N_CTX)


def test_binds_to_loopback_by_default(server):
    assert server.host == "127.0.0.1"
    # Another address of this machine must not reach the server.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET address: no packet is sent by a UDP connect
        own = probe.getsockname()[0]
    except OSError:
        own = None
    finally:
        probe.close()
    if own is None or own.startswith("127."):
        return  # no non-loopback address here; the printed address above is the check
    with pytest.raises(OSError):
        socket.create_connection((own, server.port), timeout=5).close()


def test_web_page_is_served(server):
    status, headers, page = server.request("GET", "/", key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    for asset in re.findall(rb'(?:src|href)="(/web/[^"]+)"', page):
        status, _, _ = server.request("GET", asset.decode(), key=None)
        assert status == 200, asset


def test_chatml_fallback_ends_replies_at_its_end_marker(shared_model, let_go_of_shelved_models):
    """Gemma 3 270M has no template; ChatML's `<|im_end|>` is plain text to it, so the server
    ends a chat reply where the model writes it (the server's own queue, without HTTP)."""
    from brass.server import App
    gemma = shared_model("gemma3-270m", "numpy", n_ctx=N_CTX)
    app = App(gemma, "gemma3-270m", None, parallel=1, max_waiting=1)
    messages = [{"role": "user", "content": "Hello"}]
    job, _ = app.prepare({"messages": messages, "max_tokens": 8, "temperature": 0}, chat=True)
    try:
        app.scheduler.submit(job)
        events = [job.events.get(timeout=300)]
        while events[-1][0] == "delta":
            events.append(job.events.get(timeout=300))
    finally:
        app.scheduler.close()   # its thread holds the model (1 GB of float32)
    assert events[-1][0] == "done", events
    full, _, _ = expected(gemma, chat_ids(gemma, messages), 8)
    want = cut_at_stop(full, ["<|im_end|>"])
    assert ("".join(e[1] for e in events[:-1]), events[-1][1]) == (want[0], "stop" if want[1] else events[-1][1])


# --------------------------------------------------------------------------------------------
# Several clients at once, and clients that leave


def test_sixteen_concurrent_clients(server, model, rng):
    """16 requests at once (4 prompts, streaming and not, chat and plain): every one answered,
    each with exactly its own prompt's tokens, within a bound."""
    prompts = [words(rng, 3) for _ in range(4)]
    refs = [expected(model, model.tokenizer.encode(p, add_special=True, parse_special=True), 2)
            for p in prompts]

    def client(i):
        p, stream = i % 4, i % 3 == 0
        status, _, body = server.request("POST", COMPLETIONS, {"prompt": prompts[p], "max_tokens": 2,
                                                               "temperature": 0, "stream": stream})
        assert status == 200, body
        if stream:
            events = read_sse(body)
            assert events[-1] == "[DONE]"
            return p, "".join(e["choices"][0]["text"] for e in events[:-1]), events[-2]["choices"][0]["finish_reason"]
        return p, body["choices"][0]["text"], body["choices"][0]["finish_reason"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, range(16)))
    elapsed = time.monotonic() - t0
    for p, text, reason in results:
        assert (text, reason) == refs[p][0::2], prompts[p]
    # 16 prefills of ~5 tokens and 32 decode steps; 240 s is far beyond any healthy run even on
    # a shared 2-core machine, and far below "hangs".
    assert elapsed < 240, f"16 requests took {elapsed:.0f} s"
    h = server.health()
    assert (h["requests_running"], h["requests_waiting"]) == (0, 0)


def test_full_queue_gets_503_and_leavers_free_their_places(model, rng):
    """The worker's queue in-process: one request running, one waiting, a third refused with
    503 and Retry-After; once the waiting one's client leaves, a new request takes its place."""
    from brass.server import APIError, App, Job
    app = App(model, MODEL, None, parallel=1, max_waiting=1)
    scheduler = app.scheduler

    def job():
        ids = model.tokenizer.encode(words(rng, 3), add_special=True, parse_special=True)
        return Job(ids, 200, SamplingParams(temperature=0.8, seed=int(rng.integers(2**31))), [], model.tokenizer)

    running, waiting, later = job(), job(), job()
    try:
        scheduler.submit(running)
        deadline = time.monotonic() + 60
        while scheduler.counts() != (1, 0):
            assert time.monotonic() < deadline, scheduler.counts()
            time.sleep(0.01)
        app.submit(waiting)
        with pytest.raises(APIError) as e:
            app.submit(job())
        assert (e.value.status, e.value.code) == (503, "server_busy")
        assert int(e.value.headers["Retry-After"]) > 0
        waiting.cancelled.set()
        app.submit(later)
        assert scheduler.counts() == (1, 1)
    finally:
        for j in (running, waiting, later):
            j.cancelled.set()
        scheduler.close()       # its thread holds the model


def test_short_request_is_not_held_up_by_a_long_one(model, rng):
    """Running requests take turns a token each: a 2-token request sent just after a 40-token
    one finishes while the long one is still generating."""
    from brass.server import Job, Scheduler
    greedy = SamplingParams(temperature=0.0)
    for _ in range(5):  # a long prompt whose greedy reply does not end early
        long_ids = model.tokenizer.encode(words(rng, 4), add_special=True, parse_special=True)
        if expected(model, long_ids, 40)[1:] == (40, "length"):
            break
    else:
        pytest.fail("no prompt among 5 kept the model talking for 40 tokens")
    short_ids = model.tokenizer.encode(words(rng, 3), add_special=True, parse_special=True)
    long, short = Job(long_ids, 40, greedy, [], model.tokenizer), Job(short_ids, 2, greedy, [], model.tokenizer)
    scheduler = Scheduler(model, parallel=4, max_waiting=4)
    try:
        scheduler.submit(long)
        scheduler.submit(short)
        while (event := short.events.get(timeout=120))[0] == "delta":
            pass
        assert event[0] == "done"
        assert long.completion_tokens < 40, "the long request ran to its end first"
    finally:
        long.cancelled.set()
        short.cancelled.set()


@pytest.mark.parametrize("ending", ["done", "error"])
def test_last_event_comes_after_the_scheduler_lets_go(model, rng, ending):
    """A client that has read a job's last event finds it gone from the scheduler's counts
    (what /health and /metrics report): CI once caught /health saying 1 running right after
    the reply. The scheduler's release of the job is slowed here (a 0.3 s sleep where it
    starts letting go), so a last event sent before the release is seen every time."""
    from brass.server import Job, Scheduler
    greedy = SamplingParams(temperature=0.0)
    ids = model.tokenizer.encode(words(rng, 3), add_special=True, parse_special=True)
    job = Job(ids, 2, greedy, [], model.tokenizer)
    if ending == "error":       # the second token fails: on_error, then the release
        from brass.errors import BrassError
        take = job.on_token

        def fail_second(token):
            if job.completion_tokens >= 1:
                raise BrassError("planted failure")
            return take(token)
        job.on_token = fail_second
    scheduler = Scheduler(model, parallel=1, max_waiting=1)
    stop_solo = scheduler._stop_solo

    def slow_release(r):
        time.sleep(0.3)
        stop_solo(r)
    scheduler._stop_solo = slow_release         # the first thing the release does
    try:
        scheduler.submit(job)
        while (event := job.events.get(timeout=120))[0] == "delta":
            pass
        assert event[0] == ending, event
        assert scheduler.counts() == (0, 0), f"{ending} was sent while the job still ran"
    finally:
        job.cancelled.set()
        scheduler.close()


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_phase_seconds_count_the_step_that_ends_a_job(model, rng, phase):
    """The worker's seconds (/metrics' brass_scheduler_seconds_total) already count the prompt
    chunk or the decode step that gave a job its last token when the client reads the job's
    last event: CI once saw the decode seconds unchanged right after a reply. The step is slowed
    after it has ended the job (a 0.3 s sleep before it returns), so seconds added only once the
    step returns are missed every time."""
    from brass.server import Job, Scheduler
    greedy = SamplingParams(temperature=0.0)
    scheduler = Scheduler(model, parallel=1, max_waiting=1)
    name = "_prefill_chunk" if phase == "prefill" else "_decode"
    step = getattr(scheduler, name)

    def slow_step(*args):
        step(*args)
        time.sleep(0.3)
    setattr(scheduler, name, slow_step)
    # prefill: one token, given by the prompt's last chunk; decode: two, the second by a step
    max_tokens = 1 if phase == "prefill" else 2
    try:
        for _ in range(8):
            ids = model.tokenizer.encode(words(rng, 3), add_special=True, parse_special=True)
            job = Job(ids, max_tokens, greedy, [], model.tokenizer)
            before = dict(scheduler.seconds)
            scheduler.submit(job)
            while (event := job.events.get(timeout=120))[0] == "delta":
                pass
            assert event[0] == "done", event
            seen = dict(scheduler.seconds)
            if job.completion_tokens == max_tokens:
                break
        else:
            pytest.fail(f"8 prompts ended before {max_tokens} tokens")
        assert seen[phase] > before[phase], f"the {phase} that ended the job was not counted at its reply's end"
    finally:
        job.cancelled.set()
        scheduler.close()


def wait_idle(server, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        h = server.health()
        if h["requests_running"] == 0 and h["requests_waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"generation still running after the client left: {h}"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "blocking"])
def test_client_disconnect_stops_generation(server, rng, stream):
    """A client asks for 200 tokens and hangs up after the first (streaming) or after a moment
    (blocking): its generation must stop within a second or two, not run to 200 tokens."""
    before = server.health()["tokens_generated"]
    cancelled = server.metrics()["brass_requests_cancelled_total"]
    body = json.dumps({"prompt": words(rng, 4), "max_tokens": 200, "temperature": 0.8,
                       "seed": int(rng.integers(2**31)), "stream": stream}).encode()
    s = socket.create_connection((server.host, server.port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        seen = b""
        while b'"text": "' not in seen:
            seen += s.recv(4096)
    else:
        while server.health()["tokens_generated"] < before + 1:
            time.sleep(0.05)
    s.close()
    h = wait_idle(server, 10)
    time.sleep(1)
    assert server.health()["tokens_generated"] == h["tokens_generated"]
    assert h["tokens_generated"] - before < 100, "the abandoned request kept generating"
    assert server.metrics()["brass_requests_cancelled_total"] == cancelled + 1


# --------------------------------------------------------------------------------------------
# Counters, documents, the command


def test_metrics_count_requests_and_tokens(server, rng):
    """/metrics in Prometheus' text format; a completion adds its usage to the token counters
    and a 2xx, a bad request a 4xx; nothing is running afterwards."""
    assert server.request("GET", "/metrics", key=None)[0] == 401
    before = server.metrics()
    status, _, out = server.request("POST", COMPLETIONS, {"prompt": words(rng, 3), "max_tokens": 2,
                                                          "temperature": 0})
    assert status == 200, out
    assert server.request("POST", COMPLETIONS, {"prompt": 5})[0] == 400
    after = server.metrics()
    usage = out["usage"]
    assert after["brass_prompt_tokens_total"] - before["brass_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["brass_generated_tokens_total"] - before["brass_generated_tokens_total"] == usage["completion_tokens"]
    # the completion and the first /metrics (counted once its answer began)
    assert after['brass_requests_total{status="2xx"}'] - before['brass_requests_total{status="2xx"}'] == 2
    assert after['brass_requests_total{status="4xx"}'] - before['brass_requests_total{status="4xx"}'] == 1
    # The reply's last event waits until the worker has let go of the request, so a /metrics
    # read right after the reply no longer counts it.
    assert after["brass_requests_running"] == after["brass_requests_waiting"] == 0
    assert after["brass_parallel"] == 4 and after["brass_queue_limit"] == 64
    assert after["brass_tokens_per_second"] > 0
    # the numpy backend captures no graphs: both kinds are there, at 0
    assert after['brass_prompt_graph_bytes{kind="prompt"}'] == after['brass_prompt_graph_bytes{kind="start"}'] == 0
    # the worker's time went into prompts and decoding
    for phase in ("prefill", "decode"):
        key = f'brass_scheduler_seconds_total{{phase="{phase}"}}'
        assert after[key] > before[key], (phase, before[key], after[key])


def test_openapi_document_and_docs_page(server):
    """/openapi.json describes the API with the request bodies' schemas (from the pydantic
    models); /docs is FastAPI's page for it. Both are public, as the chat page is."""
    status, _, doc = server.request("GET", "/openapi.json", key=None)
    assert status == 200, doc
    for path in (CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics"):
        assert path in doc["paths"], path
    ref = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    chat = doc["components"]["schemas"][ref.split("/")[-1]]
    assert {"messages", "max_tokens", "temperature", "stream", "stop"} <= set(chat["properties"])
    assert chat["required"] == ["messages"]
    status, headers, page = server.request("GET", "/docs", key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"/openapi.json" in page


def test_port_in_use_is_one_line(server):
    proc = serve_synth("--port", str(server.port))
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1] == f"brass: error: cannot listen on 127.0.0.1:{server.port}: " \
                                          "Address already in use", err
    assert "Traceback" not in err


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="needs Linux's /proc/PID/limits")
def test_serve_raises_its_open_files_limit_to_the_hard_one():
    """Every connection holds a descriptor: under a soft limit of 256 (hard 4,096) 1,000 idle
    connections would stop the server accepting anyone, /health included; it raises its own."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)

    def low_soft_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    proc = serve_synth("--port", "0", preexec_fn=low_soft_limit)
    try:
        line = proc.stderr.readline()
        while "serving" not in line:
            assert line, "brass serve ended before serving"
            line = proc.stderr.readline()
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft = int(re.search(r"Max open files\s+(\d+)", limits)[1])
        assert soft == hard, limits
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def test_ctrl_c_stops_the_server_cleanly():
    """Ctrl-C while a reply is streaming: the server ends within seconds, says so, exit 0, no
    traceback."""
    import signal
    proc = serve_synth("--port", "0", "--ctx", "512", start_new_session=True)
    try:
        lines = [proc.stderr.readline()]
        while not (m := re.search(r"at http://([0-9.]+):([0-9]+)/", lines[-1])):
            assert lines[-1], lines
            lines.append(proc.stderr.readline())
        s = socket.create_connection((m.group(1), int(m.group(2))), timeout=30)
        # seeded: unseeded, the sampler drew synth-llama's end-of-generation token before the
        # signal once on the H200 runner (finish_reason "stop"); seed 2 runs to the 500 tokens
        body = b'{"prompt": "sea ship storm", "max_tokens": 500, "stream": true, "temperature": 0.9, "seed": 2}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = s.recv(4096)
        while b'"text": "' not in got:
            got += s.recv(4096)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        while chunk := s.recv(65536):
            got += chunk
        s.close()
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 15
    assert err.strip().splitlines()[-1] == "brass: stopped" and "Traceback" not in err, err
    # The stream was ended, not cut: its last event says why, then [DONE] and the last chunk.
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), got[-300:]
    assert b'"code": "server_stopping"' in got or b'"finish_reason": "length"' in got, got[-300:]


# --------------------------------------------------------------------------------------------
# The web page in headless Chromium


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or \
        next((p for p in ("/usr/bin/chromium",) if os.path.exists(p)), None)


def test_web_chat_streams_a_reply_in_chromium(server, model):
    """Type a message, press Enter, see the reply arrive in pieces, then a tokens/s figure."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); the web page is untested")
    from playwright.sync_api import sync_playwright  # a test dependency: pip install playwright

    question = "Name a color."
    text, n, _ = expected(model, chat_ids(model, [{"role": "user", "content": question}]), 8)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.locator("#settings summary").click()
            page.fill("#api-key", API_KEY)
            page.press("#api-key", "Tab")  # the page takes the key on change and lists the model
            page.wait_for_function("document.getElementById('model').textContent === 'smollm2-135m'")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "8")
            # Record every state of the reply bubble, to see it grow while it streams.
            page.evaluate("""() => { window.seen = [];
                new MutationObserver(() => { const m = document.querySelector('.msg.assistant');
                    if (m) window.seen.push(m.textContent); })
                .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
            page.fill("#input", question)
            page.press("#input", "Enter")
            page.wait_for_function("document.getElementById('stop').hidden === true && "
                                   "document.querySelector('.msg.assistant') !== null", timeout=180_000)
            assert page.locator(".msg.user").inner_text() == question
            assert page.locator(".msg.assistant").inner_text() == text
            seen = [s for s in page.evaluate("window.seen") if s]
            if n > 2:
                assert len(set(seen)) > 1, f"the reply appeared in one piece: {seen}"
            assert re.fullmatch(rf"{n} tokens · ([0-9.]+|–) tok/s", page.locator("#stats").inner_text())
        finally:
            browser.close()
