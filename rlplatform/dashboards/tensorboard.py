"""TensorBoard served from this process on run directories, bound to 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path

from rlplatform import console
from rlplatform.errors import UserError

DEFAULT_PORT = 6006
PORTS_TO_TRY = 20


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise UserError(f"cannot bind TensorBoard to {host}:{port}: {exc.strerror}") from None
    return True


def choose_port(host: str, port: int) -> int:
    if not 0 < port < 65536:
        raise UserError(f"--port must be between 1 and 65535, not {port}")
    for candidate in range(port, min(port + PORTS_TO_TRY, 65536)):
        if _port_is_free(host, candidate):
            if candidate != port:
                console.say(f"port {port} is in use; TensorBoard uses port {candidate}")
            return candidate
    raise UserError(f"ports {port}-{port + PORTS_TO_TRY - 1} on {host} are all in use; choose another with --port")


def start(logdir: Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> str:
    """Start TensorBoard in this process (a background server thread) and return its URL."""
    if not logdir.is_dir():
        raise UserError(f"no such runs directory: {logdir}")
    port = choose_port(host, port)
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    from tensorboard import program

    board = program.TensorBoard()
    board.configure(argv=[None, "--logdir", str(logdir), "--host", host, "--port", str(port), "--reload_interval", "5"])
    try:
        return board.launch()
    except program.TensorBoardServerException as exc:
        raise UserError(f"TensorBoard could not start on {host}:{port}: {exc.msg}") from None
