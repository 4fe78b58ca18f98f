"""scripts/setup.sh says what went wrong: it stops at the first failed step with that step's own error (a pip
install that fails TLS, as behind an intercepting proxy whose CA the machine lacks, is reported as such, with the
hint, never as a later ModuleNotFoundError), honours NBEXEC_CA_BUNDLE for the host's pip too, and installs only
what it will use (no debootstrap when a base image to build on is already there).

Run in a copy of the script (and of pyproject.toml) in a temporary folder, against the real Docker engine. pip is
pointed, through its environment only, at a loopback HTTPS server whose certificate no system trusts; nothing is
installed on the machine and no image is built: the pip step fails before the image step, and the image step is
run alone with apt and the nbexec command replaced by recorders (never the machine's packages)."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import os
import re
import shutil
import socketserver
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbexec.sandbox.docker import image

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup.sh"


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (what an intercepting proxy presents) and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "intercepting proxy")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "proxy-ca.pem", folder / "proxy-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class _Empty(http.server.BaseHTTPRequestHandler):
    """An index that has nothing: every page is a 404."""

    def do_GET(self) -> None:  # the name http.server calls
        self.send_error(404)

    def log_message(self, format: str, *args: Any) -> None:  # the base class's names
        pass


@pytest.fixture
def tls_index(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(index URL, CA file): an HTTPS index on loopback whose certificate only the CA file vouches for."""
    cert, key = _certificate(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Empty)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/simple/", cert
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _checkout(root: Path) -> Path:
    """The files setup.sh works on: itself and pyproject.toml (what its pip step installs)."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(SCRIPT, root / "scripts" / "setup.sh")
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def _pip_env(index: str, **extra: str) -> dict[str, str]:
    """The machine's environment with pip sent to ``index`` only (no config file, no retries)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NBEXEC_"))}
    return {**env, "PIP_INDEX_URL": index, "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "20",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1", **extra}


def _setup(checkout: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_pip_step_that_fails_tls_stops_setup_with_its_own_error_and_the_hint(docker_ready: None, tmp_path: Path,
                                                                              tls_index: tuple[str, Path]) -> None:
    index, _ = tls_index
    checkout = _checkout(tmp_path / "checkout")
    done = _setup(checkout, _pip_env(index))
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "ModuleNotFoundError" not in said  # not a later step's symptom...
    assert re.search(r"certificate verify failed|CERTIFICATE_VERIFY_FAILED", said), said  # ...but pip's own error
    assert "installing nbexec" in said and "failed" in said
    assert "NBEXEC_CA_BUNDLE" in said and "PIP_CERT" in said  # with what to do about it
    assert "runtime image" not in said  # stopped there: no later step ran


def test_nbexec_ca_bundle_is_trusted_by_the_hosts_pip(docker_ready: None, tmp_path: Path,
                                                      tls_index: tuple[str, Path]) -> None:
    index, ca = tls_index
    checkout = _checkout(tmp_path / "checkout")
    done = _setup(checkout, _pip_env(index, NBEXEC_CA_BUNDLE=str(ca)))
    said = done.stdout + done.stderr
    assert done.returncode != 0, said  # the index is empty: the step still fails...
    assert not re.search(r"certificate verify failed|CERTIFICATE_VERIFY_FAILED", said), said  # ...past TLS
    assert re.search(r"No matching distribution found for hatchling", said), said
    assert "ModuleNotFoundError" not in said and "runtime image" not in said


_FUNCTION = re.compile(r"^[a-z_]+\(\) \{(?:[^\n]*\}\n|\n.*?^\}\n)", re.MULTILINE | re.DOTALL)  # one-line ones too


def test_no_debootstrap_is_installed_when_a_base_image_is_there(docker_ready: None, tmp_path: Path) -> None:
    """The image step alone (the script's own functions, copied out of it), on a machine without debootstrap on
    PATH but with a base image to build on; apt and `nbexec` are recorders."""
    if not (image.exists(image.DEFAULT_BASE) or image.exists("python:3.12-slim")):
        pytest.fail(f"this test needs a base image on the engine ({image.DEFAULT_BASE} or python:3.12-slim): "
                    "run scripts/setup.sh once", pytrace=False)
    functions = "".join(m.group(0) for m in _FUNCTION.finditer(SCRIPT.read_text()))
    assert "ensure_image() {" in functions
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    fake = work / ".venv" / "bin" / "nbexec"
    fake.write_text(f'#!/bin/sh\necho "nbexec $*" >> {calls}\necho "built (recorded)"\n')
    fake.chmod(0o755)
    body = (f"set -euo pipefail\n{functions}\n"
            f'apt_install() {{ echo "apt_install $*" >> {calls}; }}\n'
            "ensure_image\n")
    path = "/usr/local/bin:/usr/bin:/bin"  # no /usr/sbin: debootstrap (and mkfs) are not found
    done = subprocess.run(["bash", "-c", body], cwd=work, capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("NBEXEC_")}, "PATH": path})
    assert done.returncode == 0, done.stdout + done.stderr
    made = calls.read_text().splitlines()
    assert not [c for c in made if c.startswith("apt_install")], made  # nothing installed
    builds = [c for c in made if c.startswith("nbexec image build")]
    assert len(builds) == 1, made
    if not image.exists("python:3.12-slim"):  # built on the base that is there, made once before
        assert "--debootstrap" in builds[0].split()


class _Engine(http.server.BaseHTTPRequestHandler):
    """A Docker engine right after a reload: `docker info` says ExperimentalBuild and lists the runtimes of
    daemon.json, while the checkpoint route answers ``checkpoint_status`` (501 until a real restart)."""

    checkpoint_status = 501
    daemon_json = Path()

    def _reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Api-Version", "1.45")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_HEAD(self) -> None:  # the name http.server calls (the CLI pings with HEAD)
        self._reply(200, "OK")

    def do_GET(self) -> None:  # the name http.server calls
        if self.path.endswith("/_ping"):
            self._reply(200, "OK")
        elif self.path.endswith("/checkpoints"):
            self._reply(self.checkpoint_status, {"message": "This experimental feature is disabled by default."})
        elif self.path.endswith("/info"):
            runtimes = json.loads(self.daemon_json.read_text()).get("runtimes", {})
            self._reply(200, {"ExperimentalBuild": True, "Runtimes": runtimes})
        else:
            self._reply(404, {"message": "page not found"})

    def log_message(self, format: str, *args: Any) -> None:  # the base class's names
        pass


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[Any, Any]:  # http.server wants a (host, port) client address
        request, _ = super().get_request()
        return request, ("local", 0)


@pytest.mark.parametrize("route", [501, 404], ids=["reloaded-only", "restarted"])
def test_gvisor_setup_asks_the_engine_whether_it_can_checkpoint(tmp_path: Path, route: int) -> None:
    """After a reload the engine says ExperimentalBuild yet has no checkpoint route: setup-gvisor.sh must ask
    the route (501: say to restart), never trust `docker info`. Run against a fake engine on a socket of the test's
    own, with a stand-in runsc on PATH, so nothing is installed and the machine's engine is never touched."""
    if os.geteuid() != 0:
        pytest.skip("setup-gvisor.sh runs as root only")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "runsc").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "runsc").chmod(0o755)
    daemon_json = tmp_path / "daemon.json"
    handler = type("Engine", (_Engine,), {"checkpoint_status": route, "daemon_json": daemon_json})
    server = _UnixServer(str(tmp_path / "docker.sock"), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DAEMON_JSON": str(daemon_json),
               "DOCKER_HOST": f"unix://{tmp_path / 'docker.sock'}"}
        done = subprocess.run(["bash", str(ROOT / "scripts" / "setup-gvisor.sh")], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(daemon_json.read_text())["experimental"] is True
    if route == 501:
        assert "cannot checkpoint" in done.stderr and "--restart" in done.stderr, done.stderr
    else:
        assert "cannot checkpoint" not in done.stderr, done.stderr
