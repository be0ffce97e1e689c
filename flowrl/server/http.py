"""HTTP plumbing shared by flowrl's services (the reward service and `flowrl serve`).

- `read_body(request, limit, fix)`: the body, refused with BadRequest(413) past `limit` bytes
  without ever holding more than that (the rest is drained unread, so the client gets the answer);
- `drain(request)`: read and drop a body (answering before the body is read makes some clients
  fail with a broken pipe instead of reading the answer);
- `has_bearer_token(request, token)`: the `Authorization: Bearer` check, in constant time;
- `RequestLimit(app, limit, busy_body)`: at most `limit` requests served at once; past it a 503
  whose JSON body is the service's own error shape (uvicorn's own limit answers plain text);
- `serve_in_background(app, ...)`: uvicorn in a daemon thread, its URL yielded, stopped on exit;
- `serve_until_signal(app, ...)`: a command's main loop: serve until SIGINT / SIGTERM;
- `warn_if_exposed(command, host, who)`: the warning a command prints when it binds beyond loopback.

It knows HTTP and uvicorn, nothing about what the services do.
"""

from __future__ import annotations

import contextlib
import hmac
import signal
import sys
import threading
import time
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from flowrl.server.score_request import BadRequest

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# Past this many bytes a refused body is no longer drained: the connection is closed instead.
_DRAIN_LIMIT = 1 << 30


async def drain(request: Request) -> None:
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > _DRAIN_LIMIT:
                return
    except (RuntimeError, ClientDisconnect):  # the body was read already, or the client is gone
        return


async def read_body(request: Request, limit: int, fix: str) -> bytes:
    """The request body, or BadRequest(413) naming `limit` and `fix` once it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    parts: list[bytes] | None = None if declared.isdigit() and int(declared) > limit else []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if parts is not None and size > limit:
            parts = None
        if parts is not None:
            parts.append(chunk)
        elif size > _DRAIN_LIMIT:
            break
    if parts is None:
        raise BadRequest(f"request body over {limit} bytes; {fix}", 413)
    return b"".join(parts)


def has_bearer_token(request: Request, token: str) -> bool:
    sent = request.headers.get("authorization", "")
    return hmac.compare_digest(sent.encode("utf-8", "replace"), f"Bearer {token}".encode())


class RequestLimit:
    """ASGI middleware: at most `limit` HTTP requests are served at once (one event loop: a plain
    counter); past it a request gets 503, `busy_body` (JSON) and `Retry-After: 1` before the app
    sees it, its body drained first (module docstring: `drain`). Requests to `exempt_paths` (a
    service's token-guarded admin endpoints: a resume must reach a server whose slots are held by
    paused requests) and other scopes pass through, uncounted."""

    def __init__(self, app, limit: int, busy_body: bytes, exempt_paths: tuple[str, ...] = ()):
        self.app = app
        self.limit = limit
        self.busy_body = busy_body
        self.exempt_paths = exempt_paths
        self.num_active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        if self.num_active >= self.limit:
            seen, message = 0, {"more_body": True}
            while message.get("more_body") and seen <= _DRAIN_LIMIT:
                message = await receive()
                if message["type"] != "http.request":
                    break
                seen += len(message.get("body", b""))
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.busy_body)).encode()),
                (b"retry-after", b"1"),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": self.busy_body})
            return
        self.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_active -= 1


@contextlib.contextmanager
def serve_in_background(
    app,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    startup_timeout_s: float = 20.0,
    max_connections: int | None = None,
    name: str = "flowrl-server",
    graceful_timeout_s: float | None = None,
    busy_body: bytes = b'{"error": "busy", "detail": "too many requests at once; retry later"}',
    exempt_paths: tuple[str, ...] = (),
):
    """Run `app` with uvicorn in a daemon thread; yields its base URL; stops it on exit.

    port=0 picks a free port (the URL carries the real one). Binds loopback unless told otherwise.
    max_connections: requests served at once; past it a 503 with `busy_body`, the service's own
    JSON error (`RequestLimit`), which clients retry; `exempt_paths` are served whatever the count.
    graceful_timeout_s: on exit, how long requests in flight may take to finish (None: as long as they need).
    """
    import uvicorn

    if max_connections is not None:
        app = RequestLimit(app, max_connections, busy_body, exempt_paths)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=graceful_timeout_s,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"{name} did not start on {host}:{port} (port in use? see the log above)")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    try:
        yield f"http://{url_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def warn_if_exposed(command: str, host: str, who: str) -> None:
    """Warn on stderr when `host` is not loopback: `who` says what anyone reaching the port can do."""
    if host not in LOOPBACK_HOSTS:
        print(f"flowrl {command}: warning: --host {host} {who}", file=sys.stderr, flush=True)


def serve_until_signal(app, banner: Callable[[str], str], on_stop: Callable[[], None] | None = None, **options) -> None:
    """Serve `app` (serve_in_background's `options`) until SIGINT or SIGTERM; print `banner(url)` once
    it listens; on the signal call `on_stop()` (if any), then stop the HTTP server. RuntimeError
    when it cannot start."""
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop.set())
    with serve_in_background(app, log_level="info", **options) as url:
        print(banner(url), flush=True)
        stop.wait()
        if on_stop is not None:
            on_stop()
