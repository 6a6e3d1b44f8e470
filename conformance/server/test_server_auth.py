"""Who needs the API key: ONE table of every route of `brass serve` (method, path, whether it
needs the key, what it answers with the key), checked against the application's own route
list, so that a route added without a row fails here, and each route asked without a key,
with a wrong one and with the right one.

With --api-key, GET /health and GET /v1/models stay open (as in llama-server: load balancers
probe /health, clients list the model), and so does what a browser fetches by navigating, which
cannot carry the header: the chat page and its files, /favicon.ico, /docs and /openapi.json.
Everything else answers 401 without the right key. In process (the whole ASGI application over
SmolLM2's tokenizer and a stub forward pass), so every route is asked in well under a second.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="FastAPI is not installed, so brass serve cannot run (pip install -e .)")
from conformance.harness.server_harness import CHAT, COMPLETIONS, MODEL, ASGIClient, StubForward  # noqa: E402

KEY = "auth-test-key"

# (method, path): (needs the key, what the right key gets). "/web/*": every file of the page.
# A new route needs a row here: test_the_table_lists_every_route fails until it has one.
ROUTES = {
    ("GET", "/"): (False, 200),
    ("GET", "/web/*"): (False, 200),
    ("GET", "/favicon.ico"): (False, 200),
    ("GET", "/docs"): (False, 200),
    ("HEAD", "/docs"): (False, 200),
    ("GET", "/docs/oauth2-redirect"): (False, 200),
    ("HEAD", "/docs/oauth2-redirect"): (False, 200),
    ("GET", "/openapi.json"): (False, 200),
    ("HEAD", "/openapi.json"): (False, 200),
    ("GET", "/health"): (False, 200),
    ("GET", "/v1/models"): (False, 200),
    ("GET", "/v1/models/{model_id:path}"): (True, 200),
    ("GET", "/metrics"): (True, 200),
    ("POST", "/v1/chat/completions"): (True, 200),
    ("POST", "/v1/completions"): (True, 200),
    ("POST", "/tokenize"): (True, 200),
    ("POST", "/detokenize"): (True, 200),
    ("GET", "/tokenizer_info"): (True, 200),
}

BODIES = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
          COMPLETIONS: {"prompt": "The sea", "max_tokens": 1},
          "/tokenize": {"content": "The sea"}, "/detokenize": {"tokens": [504, 3]}}


@pytest.fixture(scope="module")
def app(model):
    from brass.http_api import create_app
    from brass.server import App
    brass_app = App(StubForward(model), MODEL, KEY, parallel=1, max_waiting=4)
    yield create_app(brass_app), brass_app
    brass_app.scheduler.close()


def app_routes(asgi) -> dict:
    """{(method, table path): [paths to ask]} from the application's own routes."""
    out = {}
    for route in asgi.routes:
        for method in route.methods:
            row = "/web/*" if route.path.startswith("/web/") else route.path
            out.setdefault((method, row), []).append(route.path.replace("{model_id:path}", MODEL))
    return out


def test_the_table_lists_every_route(app):
    asgi, _ = app
    routes = app_routes(asgi)
    assert set(routes) == set(ROUTES), ("routes without a row in ROUTES (add one, saying whether "
                                        f"they need the key): {sorted(set(routes) - set(ROUTES))}; "
                                        f"rows without a route: {sorted(set(ROUTES) - set(routes))}")
    assert len(routes[("GET", "/web/*")]) >= 2, "the page's script and style sheet"


def ask(asgi, method, path, headers):
    body = json.dumps(BODIES[path]).encode() if method == "POST" else b""
    client = ASGIClient(asgi)
    try:
        return client.request(method, path, body, {"Content-Type": "application/json", **headers})
    finally:
        client.close()


@pytest.mark.parametrize("auth", ["no key", "wrong key", "other scheme", "right key"])
@pytest.mark.parametrize("route", list(ROUTES), ids=[f"{m} {p}" for m, p in ROUTES])
def test_each_route_asks_for_the_key_as_the_table_says(app, route, auth):
    asgi, _ = app
    keyed, status = ROUTES[route]
    headers = {"no key": {}, "wrong key": {"Authorization": f"Bearer {KEY}x"},
               "other scheme": {"Authorization": f"Basic {KEY}"},
               "right key": {"Authorization": f"Bearer {KEY}"}}[auth]
    for path in app_routes(asgi)[route]:
        got, out_headers, body = ask(asgi, route[0], path, headers)
        if keyed and auth != "right key":
            assert got == 401, (path, got, body[:200])
            assert out_headers["www-authenticate"] == "Bearer"
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        else:
            assert got == status, (path, got, body[:300])


def test_without_a_key_configured_every_route_is_open(model):
    from brass.http_api import create_app
    from brass.server import App
    brass_app = App(StubForward(model), MODEL, None, parallel=1, max_waiting=4)
    try:
        asgi = create_app(brass_app)
        for route, paths in app_routes(asgi).items():
            for path in paths:
                got, _, body = ask(asgi, route[0], path, {})
                assert got == ROUTES[route][1], (route, got, body[:200])
    finally:
        brass_app.scheduler.close()


def test_the_favicon_is_an_icon(app):
    asgi, _ = app
    status, headers, body = ask(asgi, "GET", "/favicon.ico", {})
    assert status == 200 and headers["content-type"] == "image/x-icon"
    assert body[:4] == b"\x00\x00\x01\x00", "not an ICO file"


@pytest.mark.parametrize("env,option,expected", [
    (None, None, None), ("env-key", None, "env-key"), ("env-key", "flag-key", "flag-key"),
    (None, "flag-key", "flag-key"),
])
def test_serve_takes_the_key_from_the_option_else_brass_api_key(model, monkeypatch, env, option, expected):
    """`brass serve`'s key: --api-key, else $BRASS_API_KEY read (through brass.flags) when the
    command runs, not when the parser is built. The server itself is not started."""
    from brass import cli, cli_serve, http_api
    seen = {}
    monkeypatch.setattr(cli_serve, "load_model", lambda args: StubForward(model))

    class Sock:
        def getsockname(self):
            return ("127.0.0.1", 1)

        def close(self):
            pass

    monkeypatch.setattr(http_api, "listen", lambda host, port: Sock())
    monkeypatch.setattr(http_api, "serve", lambda app, sock: seen.setdefault("key", app.api_key))
    monkeypatch.delenv("BRASS_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "--backend", "numpy"] + (["--api-key", option] if option else []))
    if env is not None:
        monkeypatch.setenv("BRASS_API_KEY", env)
    cli_serve.cmd_serve(args)
    assert seen["key"] == expected
