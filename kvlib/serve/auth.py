"""API keys and where a server may listen without one (chapter 13), as vLLM's `--api-key`.

- `BearerAuth`: ASGI middleware. With a key set, every request whose path is under `/v1` must
  carry `Authorization: Bearer KEY`; any other gets HTTP 401 with OpenAI's error body
  (`invalid_request_error`; code `invalid_api_key` for a wrong key). `/health` and `/metrics`
  stay open (vLLM guards only `/v1`), so a load balancer's probe and a monitoring system need no
  key. Keys are compared in constant time (`secrets.compare_digest`). It is plain ASGI rather
  than Starlette's `BaseHTTPMiddleware`, which would wrap the request's receive channel that the
  server watches for disconnects.
- `check_bind(host, api_key, allow_no_auth)`: a server without a key answers whoever reaches its
  port. On a loopback address (127.0.0.0/8, ::1, `localhost`) that is this machine only; beyond
  it (0.0.0.0, a LAN address) the server refuses to start without a key unless told to
  (`--allow-no-auth`), and says why.

What it deliberately does not do: several keys, scopes, rate limits per key, TLS (put a reverse
proxy in front for that).
"""

from __future__ import annotations

import ipaddress
import secrets
import socket

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from kvlib.serve.api import error_body

__all__ = ["BearerAuth", "check_api_key", "check_bind", "is_loopback"]


def check_api_key(api_key) -> None:
    """Raises TypeError for a key that is not a str, ValueError for an empty one."""
    if not isinstance(api_key, str):
        raise TypeError(f"api_key: expected a str, got {type(api_key).__name__}")
    if not api_key:
        raise ValueError("api_key: expected a non-empty string, got ''")


class BearerAuth:
    """ASGI middleware: `app.add_middleware(BearerAuth, api_key=KEY)` (see the module docstring).

    Raises:
        ValueError: an empty key; TypeError: a key that is not a str.
    """

    def __init__(self, app, api_key: str):
        check_api_key(api_key)
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/"))
        if not guarded or scope["method"] == "OPTIONS":  # CORS preflights carry no credentials
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization")
        if given is not None and secrets.compare_digest(given.encode(), self.expected):
            return await self.app(scope, receive, send)
        if given is None:
            message = (
                "You didn't provide an API key: send it in an Authorization header, "
                "'Authorization: Bearer YOUR_KEY'"
            )
            code = None
        else:
            message = "Incorrect API key provided"
            code = "invalid_api_key"
        response = JSONResponse(
            error_body(message, code=code),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def is_loopback(host: str) -> bool:
    """True when `host` (an address or a name) reaches this machine only: a loopback address,
    or a name all of whose addresses are loopback (an unresolvable name is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_bind(host: str, api_key: str | None, allow_no_auth: bool = False) -> None:
    """Refuse to serve beyond loopback without a key (see the module docstring).

    Raises:
        PermissionError: `host` is not loopback, `api_key` is None and `allow_no_auth` is False;
            the message says why and what to pass.
    """
    if api_key is not None or allow_no_auth or is_loopback(host):
        return
    raise PermissionError(
        f"host: refusing to serve on {host!r} without an API key: beyond loopback (127.0.0.1, "
        "::1) anyone who reaches this port could run the model; pass --api-key KEY (or set "
        "KVLIB_API_KEY), or --allow-no-auth to serve it open anyway"
    )
