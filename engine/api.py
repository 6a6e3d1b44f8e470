"""OpenAI's error body, and a request body read as strict JSON: what every layer of `brass
serve` needs and nothing heavier (the request models are in engine/api_models.py, the HTTP
server in engine/http_api.py; `brass` imports this module for every command)."""

from __future__ import annotations

import json


class APIError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        if self.status == 401:
            kind = "authentication_error"
        elif self.status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}


def json_type(v) -> str:
    return _JSON_TYPES.get(type(v), type(v).__name__)


# --------------------------------------------------------------------------------------------
# The body itself


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON value")


def parse_json_body(body: bytes) -> dict:
    """The body as a JSON object: UTF-8, strict JSON (no NaN), not nested beyond Python's limit."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 (byte 0x{body[e.start]:02x} at offset "
                            f"{e.start})", code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                            f"column {e.colno}", code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_type(obj)}",
                       code="invalid_json")
    return obj
