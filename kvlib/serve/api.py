"""The OpenAI API's request bodies and error objects, as the server checks them (chapter 13).

Request bodies are pydantic models: a field of the wrong type or range, or a field the server does
not know, becomes an OpenAI-style error (HTTP 400, `{"error": {"message", "type", "param",
"code"}}`) whose message and `param` name the field, never a stack trace. Fields OpenAI defines
that this server does not implement are accepted only at their neutral value (`echo=False`,
penalties 0, ...), so a client is told, not silently ignored. `top_k` is an extension (vLLM's).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "error_body",
    "validation_error",
]


class APIError(Exception):
    """An error to send as OpenAI sends errors: HTTP `status` and a JSON body naming `param`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param=None, type="invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: ValidationError | Exception) -> APIError:
    """A pydantic (or FastAPI) validation error as a 400 naming the first bad field."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, f"invalid request body: {exc}")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a union's errors name the member type tried ("str", "list[int]"): keep the field's path
    location = [p for p in location if not any(c in p for c in "[]") and p not in ("str", "int")]
    param = ".".join(location) or None
    kind = first.get("type", "")
    detail = "unknown field" if kind == "extra_forbidden" else first.get("msg", "invalid")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {detail}")
    if kind == "missing":
        detail = "this field is required"
    if param is None:  # the body as a whole: not an object, or absent
        return APIError(400, f"the request body: {detail}")
    return APIError(400, f"{param}: {detail}", param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension: -1 or None = all tokens
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = 0.0  # not implemented: only 0
    presence_penalty: float | None = 0.0  # not implemented: only 0
    user: str | None = None

    def check_unsupported(self) -> None:
        """Refuse, naming the field, what this server accepts only at its neutral value."""
        neutral = {"frequency_penalty": (0, None), "presence_penalty": (0, None)}
        neutral.update(getattr(self, "NEUTRAL", {}))
        for name, allowed in neutral.items():
            if getattr(self, name) not in allowed:
                raise APIError(
                    400,
                    f"{name}: not supported by this server (got {getattr(self, name)!r})",
                    param=name,
                )

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise APIError(400, "stop: expected up to 4 non-empty strings", param="stop")
        return stops


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`: a prompt as text or token ids (or a list of either)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # no true/false/1.0 ids
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # not implemented
    best_of: int | None = None
    suffix: str | None = None  # not implemented
    NEUTRAL: ClassVar[dict] = {"echo": (False,), "suffix": (None, "")}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False  # not implemented for chat
    NEUTRAL: ClassVar[dict] = {"logprobs": (False,)}
