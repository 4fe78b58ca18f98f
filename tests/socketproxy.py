"""A unix-socket proxy in front of the Docker socket that a test can cut, as if the engine went away."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path


class SocketProxy:
    def __init__(self, path: Path, target: str = "/var/run/docker.sock") -> None:
        self.path, self.target = path, target
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(64)
        self.connections: list[socket.socket] = []
        self.open = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.open:  # cut: hang up at once, like an engine that is gone
                client.close()
                continue
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.target)
            self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        """Drop open connections and hang up on new ones."""
        self.open = False
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        self.server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
