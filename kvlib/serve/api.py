"""The OpenAI API's request bodies and error objects, as the server checks them (chapter 13).

Request bodies are pydantic models: a field of the wrong type or range, or a field the server does
not know, becomes an OpenAI-style error (HTTP 400, `{"error": {"message", "type", "param",
"code"}}`) whose message and `param` name the field, never a stack trace. Fields OpenAI defines
that this server does not implement are accepted only at their neutral value, an explicit null
included (`echo`: false; penalties: 0; `logit_bias`: {}; `tools`: []; `tool_choice`: "none";
`response_format`: {"type": "text"}; `store`: false; chat `logprobs`: false, `top_logprobs`: 0),
so a client is told, not silently ignored; `n` and `stream` may be null (1, false). A string
that UTF-8 cannot encode (a lone surrogate, `"\ud800"`, valid JSON) is refused naming its field.
`top_k` and `skip_special_tokens` (default true) are extensions (vLLM's).

Chat messages take OpenAI's forms as vLLM accepts them: `content` as a string, a list of text
parts (joined with newlines), or null for an assistant; a `name`; the `developer` role (rendered
as `system`, the role the model's template knows). Tool calls and tool results (`tool_calls`, the
`tool` role) are accepted in shape and refused with a 400 saying this server has no tools.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "TextPart",
    "error_body",
    "unencodable_field",
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
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )
        self.headers = headers  # extra response headers (Retry-After on a 429)

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
    if kind == "value_error" and param is None:  # a model validator's "field: reason"
        detail = str(first.get("ctx", {}).get("error", detail))
        field = detail.split(":", 1)[0]
        if field.isidentifier():
            return APIError(400, detail, param=field)
    if param is None:  # the body as a whole: not an object, or absent
        return APIError(400, f"the request body: {detail}")
    return APIError(400, f"{param}: {detail}", param=param)


def unencodable_field(value, path: str = "") -> str | None:
    """The dotted path of the first string in `value` (a request body as dicts, lists and
    scalars) that UTF-8 cannot encode, e.g. `messages.0.content`; None when every string can.
    A tokenizer given such a string raises (the `tokenizers` library: "TextInputSequence must
    be str"), so the server refuses it first."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or None
        return None
    if not isinstance(value, dict | list | tuple):
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(key, str) and unencodable_field(key) is not None:
            return f"{path}.{key}".lstrip(".")
        found = unencodable_field(item, f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


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
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # vLLM's range: a signed 64-bit int
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = 0.0  # not implemented: only 0
    presence_penalty: float | None = 0.0  # not implemented: only 0
    logit_bias: dict[str, float] | None = None  # not implemented: only {}
    user: str | None = None
    skip_special_tokens: bool = True  # extension (vLLM's): special tokens are not text

    @model_validator(mode="after")
    def _nulls_and_stream_options(self):
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    def check_unsupported(self) -> None:
        """Refuse, naming the field, what this server accepts only at its neutral value."""
        neutral = {
            "frequency_penalty": (0, None),
            "presence_penalty": (0, None),
            "logit_bias": (None, {}),
        }
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
    echo: bool | None = False  # not implemented
    best_of: int | None = None
    suffix: str | None = None  # not implemented
    NEUTRAL: ClassVar[dict] = {"echo": (False, None), "suffix": (None, "")}


class TextPart(BaseModel):
    """One part of a message's content: `{"type": "text", "text": ...}`; other types (images,
    audio) are accepted in shape and refused by `check_tools`, naming the part."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message in OpenAI's forms (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # accepted in shape, refused by `check_tools`
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        """The content as one string: text parts joined with newlines (as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """`{"role", "content"}` for the chat template (`developer` rendered as `system`)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False  # not implemented for chat
    top_logprobs: int | None = Field(None, ge=0, le=20)  # not implemented: only 0
    response_format: dict | None = None  # only {"type": "text"}
    tools: list[dict] | None = None  # only []
    tool_choice: str | dict | None = None  # only "none"
    parallel_tool_calls: bool | None = None  # meaningless without tools
    store: bool | None = False  # only false
    NEUTRAL: ClassVar[dict] = {
        "logprobs": (False, None),
        "top_logprobs": (None, 0),
        "response_format": (None, {"type": "text"}),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "store": (None, False),
    }

    def check_tools(self) -> None:
        """Refuse tool calls and tool results (this server has no tools) and content parts other
        than text, naming the message; a message without content must be an assistant's."""
        for i, message in enumerate(self.messages):
            if message.role == "tool" or message.tool_calls:
                field = "role" if message.role == "tool" else "tool_calls"
                raise APIError(
                    400,
                    f"messages.{i}.{field}: tool calls and tool results are not supported by "
                    "this server (it has no tools)",
                    param=f"messages.{i}.{field}",
                )
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages.{i}.content.{j}: only text parts are supported by this "
                        f"server (got type {part.type!r})",
                        param=f"messages.{i}.content.{j}.type",
                    )
            if message.content is None and message.role != "assistant":
                raise APIError(
                    400,
                    f"messages.{i}.content: required for a {message.role} message",
                    param=f"messages.{i}.content",
                )
