"""The server's OpenAPI document as the server behaves (chapter 13): `GET /openapi.json`.

FastAPI derives a document from the routes and the pydantic request models, and it is wrong for
this server in four ways: it documents a 422 that is never sent (validation errors are OpenAI's
400), JSON bodies for `/health` (no body) and `/metrics` (Prometheus' text), no
`text/event-stream` answer for `stream: true`, and requests the server refuses (another model
name, penalties other than 0, a token id beyond the vocabulary, five stop strings). `true_openapi`
starts from FastAPI's document and states what the server does: each operation's status codes
with OpenAI's error object, the media types it answers with, and the request fields narrowed to
what it accepts. What no schema can say (prompt + `max_tokens` within the context, words of the
course model's vocabulary, `best_of` equal to `n`, a chat template) stays a documented 400.
The test (tests/test_server_openapi.py) validates real responses against it with schemathesis.
"""

from __future__ import annotations

import copy

from fastapi.openapi.utils import get_openapi

__all__ = ["true_openapi"]

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

GENERATION_ERRORS = {
    "400": "a field out of range or refused (param names it), or a request too long",
    "404": "a model this server does not serve",
    "413": "a request body over the server's limit",
    "429": "the queue is full for now (Retry-After)",
    "500": "an engine step failed",
    "503": "the engine loop is not running",
}


def _error(description: str) -> dict:
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    return {"description": description, "content": content}


def _only(*values) -> dict:
    """A field accepted only at these values (null included, if listed)."""
    return {"enum": list(values)}


def true_openapi(app, *, model_name: str, vocab_size: int, keyed: bool) -> dict:
    """FastAPI's document for `app`, corrected (see the module docstring).

    Args:
        model_name: the one model name requests may give.
        vocab_size: token ids in a prompt are in [0, vocab_size).
        keyed: whether `/v1/*` needs an API key (adds its 401).
    """
    schema = copy.deepcopy(get_openapi(title=app.title, version=app.version, routes=app.routes))
    components = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):  # the 422 FastAPI never sends here
        components.pop(name, None)
    components["ErrorResponse"] = ERROR_SCHEMA
    paths = schema["paths"]
    paths["/health"]["get"]["responses"] = {
        "200": {"description": "the engine loop runs (no body)"},
        "503": _error("the engine loop is not running"),
    }
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus' text format, version 0.0.4", "content": text}
    }
    models = paths["/v1/models"]["get"]["responses"]
    models["200"]["content"]["application/json"]["schema"] = {"type": "object"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        operation = paths[path]["post"]
        answers = {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        }
        operation["responses"] = {
            "200": {"description": "the completion; with stream: true, events", "content": answers},
            **{status: _error(description) for status, description in GENERATION_ERRORS.items()},
        }
    if keyed:
        for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            for operation in paths[path].values():
                operation["responses"]["401"] = _error("a missing or wrong API key")
    _narrow_requests(components, model_name, vocab_size)
    return schema


def _narrow_requests(components: dict, model_name: str, vocab_size: int) -> None:
    """Request fields as the server accepts them."""
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
    }
    stop = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}},
            {"type": "null"},
        ]
    }
    shared = {
        "model": {"type": "string", "enum": [model_name]},
        "stop": stop,
        "frequency_penalty": _only(0, None),
        "presence_penalty": _only(0, None),
        "logit_bias": {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]},
    }
    completion = components["CompletionRequest"]["properties"]
    completion.update(shared)
    completion["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            token_ids,
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": token_ids},
        ]
    }
    completion["echo"] = _only(False, None)
    completion["suffix"] = _only(None, "")
    chat = components["ChatCompletionRequest"]["properties"]
    chat.update(shared)
    chat["logprobs"] = _only(False, None)
    chat["top_logprobs"] = _only(0, None)
    chat["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}
    chat["tool_choice"] = _only("none", None)
    chat["store"] = _only(False, None)
    text_format = {
        "type": "object",
        "properties": {"type": {"enum": ["text"]}},
        "required": ["type"],
        "additionalProperties": False,
    }
    chat["response_format"] = {"anyOf": [text_format, {"type": "null"}]}
    message = components["ChatMessage"]["properties"]
    message["role"] = {"enum": ["system", "developer", "user", "assistant"]}  # no tool results
    for refused in ("tool_calls", "tool_call_id"):
        message.pop(refused, None)
    components["TextPart"]["properties"]["type"] = {"enum": ["text"]}
    components["TextPart"]["properties"]["text"] = {"type": "string"}
    components["TextPart"]["required"] = ["type", "text"]
