"""Length-prefixed JSON frames over raw file descriptors.

Reads are exact and unbuffered on purpose: the zygote must never pull the next
frame (the per-run nonce) into its memory before it has forked the grader.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from collections.abc import Callable

_HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20


def encode_files(files: dict[str, str | bytes]) -> dict[str, str | dict]:
    """A repository's files as JSON: text as it is, binary (bytes) as {"base64": ...}."""
    return {rel: c if isinstance(c, str) else {"base64": base64.b64encode(c).decode("ascii")}
            for rel, c in files.items()}


def decode_files(files: dict[str, str | dict]) -> dict[str, str | bytes]:
    """The inverse of `encode_files`."""
    return {rel: c if isinstance(c, str) else base64.b64decode(c["base64"])
            for rel, c in files.items()}


class FrameError(Exception):
    """The peer sent something that is not a valid frame."""


def send(fd: int, obj: object) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def send_sock(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def read_exact(read: Callable[[int], bytes], n: int) -> bytes | None:
    """n bytes from `read`, or None on EOF before the first byte."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = read(n - got)
        if not chunk:
            if got:
                raise FrameError(f"truncated frame: {got} of {n} bytes")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def relay(src: int, dst: int, buf: bytearray) -> None:
    """Copy one frame from src to dst through `buf` only, then zero `buf`.

    The frame is never parsed or turned into Python objects, so no copy of it
    lingers in this process's heap. If dst is gone, the rest is drained.
    """
    header = read_exact(lambda n: os.read(src, n), _HEADER.size)
    if header is None:
        raise FrameError("EOF before the relayed frame")
    (left,) = _HEADER.unpack(header)
    view = memoryview(buf)
    writable = write_all(dst, header)
    used = 0
    try:
        while left:
            got = os.readv(src, [view[: min(left, len(buf))]])
            if not got:
                raise FrameError("EOF inside the relayed frame")
            used = max(used, got)
            writable = writable and write_all(dst, view[:got])
            left -= got
    finally:
        view[:used] = bytes(used)


def write_all(fd: int, data) -> bool:
    """False once the reader is gone (EPIPE)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        return False
    return True


def recv(fd: int, max_bytes: int = MAX_FRAME) -> object | None:
    """The next frame's JSON value from a blocking fd, or None on EOF."""
    return recv_with(lambda n: os.read(fd, n), max_bytes)


def recv_with(
    read: Callable[[int], bytes], max_bytes: int = MAX_FRAME
) -> object | None:
    """The next frame's JSON value, or None on EOF."""
    header = read_exact(read, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes exceeds limit {max_bytes}")
    body = read_exact(read, size) if size else b""
    if body is None:
        raise FrameError("EOF inside frame")
    try:
        return json.loads(body)
    except ValueError as e:
        raise FrameError(f"bad JSON frame: {e}") from None
