"""One HTTP request run through an ASGI app in-process, its response streamed back in pieces.

A replica holds the single-process server's FastAPI app and answers each forwarded request with
it, so routes, auth, tenants and limits are the same code. httpx's ASGITransport would do, but it
reads the whole body before returning: no server-sent events, and a flash stream never ends.
"""

import asyncio
from collections.abc import AsyncIterator

DISCONNECT_GRACE_S = 1.0  # the server's routes check for a disconnect every 0.25 s


async def run_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> AsyncIterator[dict | bytes]:
    """Yield the response's head ({"status", "headers": [(name, value), ...]}), then its body
    chunks (bytes). Closing the iteration early is a client disconnect: the app reads
    `http.disconnect` and aborts its engine request; an app still running DISCONNECT_GRACE_S later
    is cancelled."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("replica", 80), "state": {},
    }
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    pending_body = [body]

    async def receive() -> dict:
        if pending_body:
            return {"type": "http.request", "body": pending_body.pop(), "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)  # the app returned (or raised): nothing more will come

    task = asyncio.create_task(run())
    try:
        message = await sent.get()
        if message is None:  # the app ended without a response (Starlette would have sent its 500)
            yield {"status": 500, "headers": [("content-type", "application/json")]}
            yield b'{"error": {"message": "internal server error", "type": "internal_error", ' \
                  b'"param": null, "code": null}}'
            return
        yield {"status": message["status"],
               "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
        while (message := await sent.get()) is not None:
            if message["type"] != "http.response.body":
                continue
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                break
        await asyncio.wait({task}, timeout=5)  # its last work after the body (a heap give-back)
    finally:
        disconnected.set()
        if not task.done():  # a route polls for the disconnect (server/app.py, final_output), then aborts
            await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()
        # (an exception the app raised was answered as a 500 by its own middleware already)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
