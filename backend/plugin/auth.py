"""Engine auth: vLLM's own API-key middleware, widened to every route but /health.

vLLM 0.32.0 checks the key only under /v1, /v2, /inference and /cohere, leaving /invocations
(which runs generation), /tokenize, /detokenize, /metrics, /load, /ping, /version and the scaling
routes open even with --api-key. Its `init_entrypoints_middleware` imports
`AuthenticationMiddleware` from its module when the app is built, so rebinding that name before
then swaps in this subclass: same keys (--api-key / VLLM_API_KEY), same constant-time check,
same 401 body, only the set of guarded paths changes. With no key configured vLLM adds no
middleware at all, and the engine binds 127.0.0.1 behind the proxy.
"""
from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

OPEN_PATHS = frozenset({"/health"})


def is_guarded(path: str, method: str | None) -> bool:
    """Whether a request needs the key (CORS preflight never does, as upstream)."""
    if method == "OPTIONS":
        return False
    return path.rstrip("/") not in OPEN_PATHS


def _middleware_class() -> Any:
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    class EngineAuthMiddleware(AuthenticationMiddleware):
        """Upstream's check on every path except /health."""

        hyperharness = True

        def __call__(self, scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            if scope["type"] not in ("http", "websocket"):
                return self.app(scope, receive, send)
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if is_guarded(path, scope.get("method")) and not self.verify_token(Headers(scope=scope)):
                return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return self.app(scope, receive, send)

    return EngineAuthMiddleware


def install() -> bool:
    """Rebind vLLM's middleware name to ours; False when the API server code is not importable."""
    try:
        import vllm.entrypoints.serve.middleware.authenticate as upstream
    except ImportError:  # a worker image without the API server extras
        return False
    if getattr(upstream.AuthenticationMiddleware, "hyperharness", False):
        return True
    setattr(upstream, "AuthenticationMiddleware", _middleware_class())  # noqa: B010 - rebinding a module global
    return True
