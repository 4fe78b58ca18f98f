"""A real package index for tests: tiny wheels written by hand, served as a PEP 503 index on loopback.

Every request the index answers is logged, so a test can prove what the host downloaded (and what it never did).
A project can be held (its page is answered only when the test says so), so a test can look at the host's pip
while it waits, or let it wait past a time limit.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import threading
import zipfile
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name


def make_wheel(folder: Path, name: str, version: str, code: str, requires: tuple[str, ...] = (),
               extras: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of project ``name`` whose package (``name`` with _ for -) runs ``code`` on import;
    ``extras`` are declared (Provides-Extra), ``requires`` are its Requires-Dist lines."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": code,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                            + "".join(f"Provides-Extra: {e}\n" for e in extras)
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: nbexec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in_zip, text in files.items():
            archive.writestr(name_in_zip, text)
    return path


class Index:
    """``root/simple/<project>/`` pages over the wheels added, served on 127.0.0.1 until ``close``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        self.held: dict[str, tuple[threading.Event, threading.Event]] = {}  # project -> (reached, released)
        (root / "simple").mkdir(parents=True)
        index = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self) -> None:  # the name http.server calls
                index.requests.append(self.path)
                for name, (reached, released) in list(index.held.items()):
                    if f"/simple/{name}/" in self.path or self.path.rstrip("/").endswith(f"/simple/{name}"):
                        reached.set()
                        released.wait(600)
                        with contextlib.suppress(OSError):  # the client may have given up meanwhile
                            super().do_GET()
                        return
                super().do_GET()

            def log_message(self, format: str, *args: Any) -> None:  # the base class's names
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{self.base}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, name: str, version: str, code: str, requires: tuple[str, ...] = (),
            extras: tuple[str, ...] = ()) -> Path:
        folder = self.root / "simple" / canonicalize_name(name)
        folder.mkdir(exist_ok=True)
        wheel = make_wheel(folder, name, version, code, requires, extras)
        self._page(folder)
        return wheel

    def add_file(self, name: str, path: Path) -> Path:
        """Serve the file at ``path`` (a wheel made by the test, hostile or not) on project ``name``'s page."""
        folder = self.root / "simple" / canonicalize_name(name)
        folder.mkdir(exist_ok=True)
        served = folder / path.name
        served.write_bytes(path.read_bytes())
        self._page(folder)
        return served

    def _page(self, folder: Path) -> None:
        links = "".join(f'<a href="{p.name}#sha256={hashlib.sha256(p.read_bytes()).hexdigest()}">{p.name}</a>\n'
                        for p in sorted(folder.iterdir()) if p.name != "index.html")
        (folder / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")

    def hold(self, name: str) -> tuple[threading.Event, threading.Event]:
        """Hold project ``name``'s page: (reached, released); the page is answered once ``released`` is set."""
        gate = (threading.Event(), threading.Event())
        self.held[canonicalize_name(name)] = gate
        return gate

    def fetched(self, name: str) -> list[str]:
        """The requests that touched project ``name``'s page or files."""
        return [path for path in self.requests if f"/{canonicalize_name(name)}/" in path]

    def close(self) -> None:
        for _, released in self.held.values():
            released.set()
        self.server.shutdown()
        self.server.server_close()
