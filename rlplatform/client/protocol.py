"""The wire format between an external simulator and a run: RLlib's RLlink framing, our messages (docs/external.md).

A message is an 8-byte header, the body's length in ASCII decimal digits, zero-padded (RLlib's RLlink
framing), then the body: a msgpack map with a `type` string. Arrays travel as maps
`{"__ndarray__": true, "dtype": "float32", "shape": [..], "data": <bytes, C order, little-endian>}`,
so that a client in any language with a msgpack library can read and write them.

Only numpy and msgpack are imported here: a simulator embeds this without Ray or torch.
"""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import numpy as np

PROTOCOL = "rlplatform-rllink/1"
HEADER_BYTES = 8
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_ARRAY_KEY = "__ndarray__"
_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}

# Client -> server
PING, GET_CONFIG, GET_STATE, EPISODES, EPISODES_AND_GET_STATE = "PING", "GET_CONFIG", "GET_STATE", "EPISODES", "EPISODES_AND_GET_STATE"
# Server -> client
PONG, SET_CONFIG, SET_STATE, ERROR = "PONG", "SET_CONFIG", "SET_STATE", "ERROR"
CLIENT_TYPES = (PING, GET_CONFIG, GET_STATE, EPISODES, EPISODES_AND_GET_STATE)


class ProtocolError(Exception):
    """A message that breaks the protocol: the connection is closed after an ERROR message saying why."""


class PeerError(Exception):
    """The other side sent ERROR (the message's text), or closed the connection."""


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {_ARRAY_KEY: True, "dtype": array.dtype.newbyteorder("<").name if array.dtype.byteorder == ">" else array.dtype.name,
                "shape": list(array.shape), "data": array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__}")


def _decode(value: dict[str, Any]) -> Any:
    if not value.get(_ARRAY_KEY):
        return value
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if dtype not in _DTYPES or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) \
            or not isinstance(data, bytes):
        raise ProtocolError(f"a malformed array: dtype {dtype!r}, shape {shape!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise ProtocolError(f"an array of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def pack(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, default=_encode, use_bin_type=True)
    if len(body) >= 10**HEADER_BYTES:
        raise ProtocolError(f"a message of {len(body):,} bytes does not fit the 8-digit header")
    return str(len(body)).zfill(HEADER_BYTES).encode("ascii") + body


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(pack(message))


def receive(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[str, dict[str, Any]]:
    """The next message's type and body. PeerError when the peer closed; ProtocolError when the bytes break the protocol."""
    header = _exactly(sock, HEADER_BYTES)
    if not header.isdigit():
        raise ProtocolError(f"the header must be 8 ASCII digits, got {header[:8]!r}")
    length = int(header)
    if length > max_bytes:
        raise ProtocolError(f"a message of {length:,} bytes is over the limit of {max_bytes:,}")
    return unpack(_exactly(sock, length))


def unpack(body: bytes) -> tuple[str, dict[str, Any]]:
    try:
        message = msgpack.unpackb(body, object_hook=_decode, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several kinds on bad bytes
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("a message must be a map with a `type` string")
    kind = message.pop("type")
    if kind == ERROR:
        raise PeerError(str(message.get("error", "the peer reported an error")))
    return kind, message


def _exactly(sock: socket.socket, count: int) -> bytes:
    chunks, received = [], 0
    while received < count:
        chunk = sock.recv(min(count - received, 1 << 20))
        if not chunk:
            raise PeerError("the connection was closed")
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)
