"""HTTP plumbing the routes share: the request-body limit, server-sent events, errors as OpenAI's JSON.

Nothing here knows about models or the engine: it is what any OpenAI-style server needs between
the socket and its routes (`minillm.serving.server`).
"""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .openai_api import APIError


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before the app reads any of it.

    Counting the bytes as they arrive (not trusting Content-Length) also bounds chunked
    uploads, which declare no length.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                error = APIError(413, f"the request body is over {self.max_bytes} bytes: send a shorter prompt "
                                      f"(or start the server with a larger --max-body-mb)")
                return await api_response(error)(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect message, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def sse(chunks, on_close):
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`; an error after the
    200 status went out becomes a last `data: {"error": ...}` chunk. `on_close()` runs however
    the stream ends, a client's disconnect (this generator cancelled) included."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        on_close()
    yield "data: [DONE]\n\n"


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint as one line: which field, what was wrong."""
    first = error.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}): "
                             f"send a JSON object")
    if not where:
        return APIError(400, f"the body must be a JSON object: {first.get('msg')}")
    return APIError(400, f"{'.'.join(where)}: {first.get('msg')}", param=where[0])


def api_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)
