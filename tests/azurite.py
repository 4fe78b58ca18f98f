"""Start Azurite (the Azure Storage emulator from npm) on a free loopback port, in memory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ACCOUNT = "devstoreaccount1"
# Azurite's published development key (the same for every installation; not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def find_binary() -> str | None:
    local = Path(__file__).parent.parent / ".tools" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Azurite:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(binary: str) -> Azurite:
    port = free_port()
    process = subprocess.Popen([binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                                "--silent", "--skipApiVersionCheck", "--loose"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return Azurite(process, port)
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"Azurite exited with code {process.returncode}") from None
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("Azurite did not start within 30 s")
