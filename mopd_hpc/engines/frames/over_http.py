"""Frames (`codec.py`) over aiohttp: content negotiation, a bounded body reader, a frame response.

A client that wants a frame back sends `Accept: application/x-mopd-tensors` (`ACCEPT_HEADERS`); a client
that sends one sets `Content-Type: application/x-mopd-tensors` (`FRAME_HEADERS`). A server answers a frame
only when asked and JSON otherwise (errors are always JSON), so outside callers keep their JSON shapes.

A large frame skips asyncio's buffers, which (before Python 3.12) copy whatever part of a write the socket
does not take at once, deliver reads 256 KiB at a time, and wake the event loop for each: the server sends
the body by blocking `sendall`s in one worker thread on a duplicate of the connection's socket, from the
tensors' own memory where they already hold the frame's bytes (`send_frame`); the client receives a large
answer by `recv_into` straight into its buffer, then closes that connection (`read_frame`). Where the socket
is not a plain TCP or Unix one (TLS) both fall back to aiohttp's reads and writes.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import aiohttp
import torch
from aiohttp import web

from mopd_hpc.engines.frames.buffer_pool import BufferPool
from mopd_hpc.engines.frames.codec import (
    CONTENT_TYPE,
    DEFAULT_MAX_BODY_BYTES,
    Frame,
    FrameLayout,
    WireError,
    decode,
)

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


#: aiohttp's read buffer limit for a frame body (`read_bufsize` of a client request): the socket's bytes
#: are taken as they arrive until 2x this is waiting, not paused and resumed at every 128 KiB (the default).
READ_BUFSIZE = 16 << 20
#: Bytes per piece of a streamed frame that is copied out of the tensors (cast, packed, moved off a GPU).
CHUNK_BYTES = 4 << 20
#: Seconds a direct socket send or receive of a frame body waits for the peer before it gives up (a
#: client that stopped reading, a server that stopped sending); as long as a client's request timeout.
IO_TIMEOUT_S = 600.0
#: The smallest frame answer a client reads straight from the socket (`read_frame`); a smaller one goes
#: through aiohttp and keeps its connection for the next request.
DIRECT_MIN_BYTES = 1 << 20


async def send_frame(
    request: web.Request, frame: FrameLayout, pool: BufferPool | None = None
) -> web.StreamResponse:
    """Answer `request` (200) with `frame`, streamed piece by piece (`FrameLayout.batches`), no whole-frame
    buffer ever built. The HTTP head and the frame header go through aiohttp; the body then leaves in one
    worker thread by blocking `sendall`s on a duplicate of the connection's socket (the event loop keeps
    serving, the GIL is released while the kernel copies): tensors already in the frame's bytes straight
    from their own memory, the others copied (cast, packed) into `pool`'s buffers (a server keeps one
    across answers; None: a new one) just before they are sent. This is zero-copy in user space: asyncio
    transports (before Python 3.12) copy whatever part of a write the socket does not take at once, and
    wake the event loop for every few hundred KB. Where the connection's socket is not a plain idle one
    (TLS, bytes still queued in the transport), each piece goes through aiohttp instead, filled in a
    worker thread while the previous one is written. The tensors must not change until this returns.
    Return the response from the handler.

    Raises:
        OSError: the client went away (or stopped reading for `IO_TIMEOUT_S`) mid-answer.
    """
    resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
    resp.content_length = frame.size
    await resp.prepare(request)
    batches = frame.batches(CHUNK_BYTES, pool)
    for piece in next(batches):  # the frame header, sent with the HTTP head
        await resp.write(piece)
    sock = _idle_socket(request)
    if sock is not None:
        with sock:
            await asyncio.to_thread(_send_all, sock, batches)
    else:
        nxt = asyncio.ensure_future(asyncio.to_thread(next, batches, None))
        try:
            while (batch := await nxt) is not None:
                nxt = asyncio.ensure_future(asyncio.to_thread(next, batches, None))  # the next batch's work
                for piece in batch:
                    await resp.write(
                        piece
                    )  # the transport may keep a piece until sent: it has its own buffer
        finally:
            nxt.cancel()  # a client gone mid-answer: nothing waits for the piece being filled
    await resp.write_eof()
    return resp


def _idle_socket(request: web.Request) -> socket.socket | None:
    """`_plain_socket` of the request's connection, None too while its transport still has bytes to write
    (they would come after ours)."""
    transport = request.transport
    if transport is None or transport.get_write_buffer_size():
        return None
    return _plain_socket(transport)


def _plain_socket(transport: asyncio.BaseTransport) -> socket.socket | None:
    """A duplicate (own file descriptor, same connection) of `transport`'s TCP or Unix socket, with the
    timeout `IO_TIMEOUT_S` set; None when there is none, it is closing, or it carries TLS."""
    if transport.is_closing() or transport.get_extra_info("sslcontext") is not None:
        return None
    raw = transport.get_extra_info("socket")
    if raw is None or raw.family not in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
        return None
    if raw.type != socket.SOCK_STREAM:
        return None
    sock = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
    sock.settimeout(IO_TIMEOUT_S)  # the descriptor stays non-blocking (the event loop's is the same one)
    return sock


def _send_all(sock: socket.socket, batches: Iterator[list[memoryview]]) -> None:
    """Send every remaining piece of `batches` on `sock` (a worker thread: fills and sends release the GIL)."""
    for batch in batches:
        for piece in batch:
            sock.sendall(piece)


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
    in `read_body`. A client reads an answer of >= `DIRECT_MIN_BYTES` (with a Content-Length, on a plain
    TCP or Unix socket) straight into its buffer (`_read_direct`: the kernel's copy only); any other body
    comes through aiohttp in large chunks (`_large_reads`), copied once into the buffer.

    Raises:
        WireError: the body is too large, truncated or not a valid frame (`wire.decode`).
        OSError: the server went away (or stopped sending for `IO_TIMEOUT_S`) mid-answer.
    """
    size = message.content_length
    if isinstance(message, aiohttp.ClientResponse):
        if size is not None and DIRECT_MIN_BYTES <= size <= max_bytes:
            body = await _read_direct(message, size, pool)
            if body is not None:
                return decode(body, max_bytes=max_bytes)
        _large_reads(message.connection.transport if message.connection else None)
    else:
        _large_reads(message.transport)
    body = await read_body(message.content, size, max_bytes, pool)
    return decode(body, max_bytes=max_bytes)


async def _read_direct(resp: aiohttp.ClientResponse, size: int, pool: BufferPool | None) -> memoryview | None:
    """The `size`-byte body of `resp` received into one buffer by blocking `recv_into`s in a worker thread,
    on a duplicate of the connection's socket: the event loop stops reading it, hands over the bytes
    aiohttp already holds, and the rest goes from the kernel into the buffer with no other copy. aiohttp
    never sees those bytes, so the connection is closed afterwards (the next request opens another: on a
    local network, well under a millisecond against the seconds of a large answer). None (nothing read)
    when the connection has no plain socket.

    Raises:
        WireError: the body is longer or shorter than `size`.
    """
    transport = resp.connection.transport if resp.connection else None
    sock = None if transport is None else _plain_socket(transport)
    if sock is None:
        return None
    with sock:
        out = (
            pool.lend(size) if pool is not None else memoryview(torch.empty(size, dtype=torch.uint8).numpy())
        )
        pos = 0
        try:
            while chunk := resp.content.read_nowait():  # what arrived with the HTTP head
                if pos + len(chunk) > size:
                    raise WireError(f"body longer than its Content-Length ({size} bytes)")
                out[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
            # after the drain (which resumes reading where aiohttp had paused it) and before the event
            # loop runs again: from here on, only the worker reads this socket
            transport.pause_reading()  # type: ignore[union-attr]
            if pos < size:
                pos = await asyncio.to_thread(_recv_into, sock, out, pos)
        except BaseException:
            sock.shutdown(socket.SHUT_RDWR)  # a cancelled read: the worker's recv returns at once
            raise
        finally:
            resp.close()  # the body did not go through aiohttp's parser: the connection is not reused
    if pos != size:
        raise WireError(f"truncated body: {pos} bytes arrived; Content-Length declared {size}")
    return out


def _recv_into(sock: socket.socket, out: memoryview, pos: int) -> int:
    """Receive into out[pos:] until it is full or the peer closes; returns the new `pos`."""
    size = out.nbytes
    while pos < size:
        got = sock.recv_into(out[pos:], min(size - pos, RECV_BYTES))
        if not got:
            break
        pos += got
    return pos


#: Bytes one socket read of a frame body may take (asyncio's selector transports read 256 KiB at a time).
RECV_BYTES = 4 << 20


def _large_reads(transport: asyncio.BaseTransport | None) -> None:
    """Let `transport` take up to `RECV_BYTES` per socket read (`max_size` of asyncio's selector socket
    transport; left alone on a transport without one): a frame body then arrives in a few large chunks, each
    one event-loop wake-up, not in thousands of 256 KiB ones."""
    if transport is not None and getattr(transport, "max_size", RECV_BYTES) < RECV_BYTES:
        transport.max_size = RECV_BYTES  # type: ignore[attr-defined]
