"""Fixtures the server tests share (conformance/harness/server_harness.py): `model`, a real
catalog model; `server`, a live `brass serve` on it; `openai_client`, the openai client
pointed at that server. Without FastAPI there is no server: each test module skips on its own
(pytest.importorskip), so the fixtures are defined only where FastAPI is installed."""

import importlib.util

if importlib.util.find_spec("fastapi") is not None:
    from conformance.harness.server_harness import model, openai_client, server  # noqa: F401
