"""Frames (`wire.py`) over aiohttp: content negotiation, a bounded body reader, a frame response.

A client that wants a frame back sends `Accept: application/x-mopd-tensors` (`ACCEPT_HEADERS`); a client
that sends one sets `Content-Type: application/x-mopd-tensors` (`FRAME_HEADERS`). A server answers a frame
only when asked and JSON otherwise (errors are always JSON), so outside callers keep their JSON shapes.
"""

from __future__ import annotations

import asyncio

import aiohttp
import torch
from aiohttp import web

from mopd_hpc.engines.buffer_pool import BufferPool
from mopd_hpc.engines.wire import CONTENT_TYPE, DEFAULT_MAX_BODY_BYTES, Frame, FrameLayout, WireError, decode

#: Request headers of a client that wants a frame back (JSON stays acceptable: errors are JSON).
ACCEPT_HEADERS = {"Accept": f"{CONTENT_TYPE}, application/json;q=0.5"}
#: Request headers of a client that sends a frame and wants one back.
FRAME_HEADERS = {"Content-Type": CONTENT_TYPE} | ACCEPT_HEADERS


def accepts_frame(request: web.Request) -> bool:
    """True when the request's Accept header names `CONTENT_TYPE`."""
    return CONTENT_TYPE in request.headers.get("Accept", "")


def is_frame(message: web.Request | aiohttp.ClientResponse) -> bool:
    """True when a request's or response's Content-Type is `CONTENT_TYPE`."""
    return message.content_type == CONTENT_TYPE


#: Bytes per piece of a streamed frame: each is filled (in a worker thread) while the previous one is sent.
CHUNK_BYTES = 4 << 20


async def send_frame(
    request: web.Request, frame: FrameLayout, pool: BufferPool | None = None
) -> web.StreamResponse:
    """Answer `request` (200) with `frame`, streamed: piece k + 1 is copied out of the tensors in a worker
    thread while piece k is written to the socket, so no whole-frame buffer is ever built. The pieces'
    buffers come from `pool` (a server keeps one across answers; None: a new one). Return the response
    from the handler."""
    resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
    resp.content_length = frame.size
    await resp.prepare(request)
    pieces = frame.chunks(CHUNK_BYTES, pool)
    nxt = asyncio.ensure_future(asyncio.to_thread(next, pieces, None))
    try:
        while (piece := await nxt) is not None:
            nxt = asyncio.ensure_future(asyncio.to_thread(next, pieces, None))  # fills the next piece
            await resp.write(piece)  # the transport may keep the piece until sent: it has its own buffer
    finally:
        nxt.cancel()  # a client gone mid-answer: nothing waits for the piece being filled
    await resp.write_eof()
    return resp


async def read_body(
    stream: aiohttp.StreamReader,
    content_length: int | None,
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    pool: BufferPool | None = None,
) -> memoryview:
    """The whole body of a request or response, as one writable byte buffer (one copy from the socket's
    chunks; `wire.decode` then makes tensors of it without another). With `pool`, the buffer is lent by
    it (and reused for a later body once every tensor decoded from this one is gone).

    Raises:
        WireError: the declared Content-Length or the bytes received exceed `max_bytes`, or fewer bytes
            arrived than the Content-Length declared (a truncated body).
    """
    if content_length is not None and content_length > max_bytes:
        raise WireError(
            f"body is {content_length} bytes (Content-Length); max_body_bytes is {max_bytes}: send fewer "
            "rows per request, or raise max_body_bytes on the reading side"
        )
    if content_length is None:  # chunked: grow as it comes
        grown = bytearray()
        while chunk := await stream.readany():
            grown += chunk
            if len(grown) > max_bytes:
                raise WireError(f"body exceeds max_body_bytes ({max_bytes}) after {len(grown)} bytes")
        return memoryview(grown)
    if pool is not None:
        out = pool.lend(content_length)
    else:
        out = memoryview(torch.empty(content_length, dtype=torch.uint8).numpy())  # not zero-filled
    pos = 0
    while chunk := await stream.readany():
        end = pos + len(chunk)
        if end > content_length:
            raise WireError(f"body longer than its Content-Length ({content_length} bytes)")
        out[pos:end] = chunk
        pos = end
    if pos != content_length:
        raise WireError(f"truncated body: {pos} bytes arrived; Content-Length declared {content_length}")
    return out


async def read_frame(
    message: web.Request | aiohttp.ClientResponse,
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    pool: BufferPool | None = None,
) -> Frame:
    """Read and decode the frame body of a request (server side) or a response (client side); `pool` as
    in `read_body`.

    Raises:
        WireError: the body is too large, truncated or not a valid frame (`wire.decode`).
    """
    body = await read_body(message.content, message.content_length, max_bytes, pool)
    return decode(body, max_bytes=max_bytes)
