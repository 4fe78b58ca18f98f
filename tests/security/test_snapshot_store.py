"""Snapshots in a shared blob store (NBEXEC_SNAPSHOT_STORE=azure), against Azurite and the real Docker engine: a
session snapshotted by one process is restored by another that shares only the store and the key, and every
tampered shape of the blobs (changed, added, removed, renamed with ``..`` or ``/``, swapped from another snapshot,
larger than signed, a huge manifest) or of the id is refused with SnapshotError before a byte reaches a sandbox,
leaving no container, staging folder or blob container behind.

Judged by the effect: the restored session's variables and files; the refusal; the containers, the host's staging
folder and the blob containers after it; the bytes pulled from the store and the host memory a refusal takes.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec import Session
from nbexec.engine import snapshotblobs, snapshots
from nbexec.files import folders
from nbexec.stores import blobspace

from .. import cloudstores
from ..conftest import IMAGE, unaccounted_containers

KEY_HEX = "5e" * 32


def cfg(**changes: Any) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=3,
                                **changes)


@dataclass
class Shared:
    """The blob settings both 'nodes' share (in this process's environment) and a client to tamper with the store
    directly (Azure: a container; S3, GCS: a bucket)."""

    kind: str
    env: dict[str, str]
    client: Any
    where: str  # the container or bucket

    def blobs(self, snapshot_id: str) -> dict[str, str]:
        """The snapshot's blobs: name inside the snapshot -> full blob name."""
        raw = snapshot_id.split(".")[0]
        return {n.split(f"/{raw}/", 1)[1]: n for n in self.names() if f"/{raw}/" in n}

    def names(self) -> list[str]:
        if self.kind == "gcs":
            return [b.name for b in self.client.list_blobs(self.where)]
        if self.kind == "azure":
            return [b.name for b in self.client.list_blobs()] if self.client.exists() else []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.where)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def read(self, name: str) -> bytes:
        if self.kind == "gcs":
            return bytes(self.client.bucket(self.where).blob(name).download_as_bytes())
        if self.kind == "azure":
            return bytes(self.client.download_blob(name).readall())
        return bytes(self.client.get_object(Bucket=self.where, Key=name)["Body"].read())

    def write(self, name: str, data: bytes) -> None:
        if self.kind == "gcs":
            self.client.bucket(self.where).blob(name).upload_from_string(data)
        elif self.kind == "azure":
            if not self.client.exists():
                self.client.create_container()
            self.client.upload_blob(name, data, overwrite=True)
        else:
            self.client.put_object(Bucket=self.where, Key=name, Body=data)

    def delete(self, name: str) -> None:
        if self.kind == "gcs":
            self.client.bucket(self.where).blob(name).delete()
        elif self.kind == "azure":
            self.client.delete_blob(name)
        else:
            self.client.delete_object(Bucket=self.where, Key=name)

    def rename(self, name: str, new: str) -> None:
        self.write(new, self.read(name))
        self.delete(name)

    def untouched(self) -> bool:
        """Nothing was made: no container (Azure), no object (S3, GCS: the bucket is the operator's)."""
        return not self.client.exists() if self.kind == "azure" else self.names() == []


@pytest.fixture(params=["azure", "s3", "gcs"])
def shared(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Shared:
    where = f"snap{time.time_ns()}"
    env = {"NBEXEC_SNAPSHOT_STORE": request.param, "NBEXEC_SNAPSHOT_KEY": KEY_HEX}
    if request.param == "azure":
        from azure.storage.blob import BlobServiceClient

        azurite = request.getfixturevalue("azurite")
        env |= {"NBEXEC_SNAPSHOT_CONTAINER": where, "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}
        client = BlobServiceClient.from_connection_string(azurite.connection_string).get_container_client(where)
    elif request.param == "gcs":
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        emulator, key = request.getfixturevalue("gcs_emulator"), request.getfixturevalue("gcs_key")
        env |= {"NBEXEC_SNAPSHOT_BUCKET": where, "STORAGE_EMULATOR_HOST": emulator.url,
                "GOOGLE_APPLICATION_CREDENTIALS": str(key[0])}
        cloudstores.gcs_bucket(emulator.url, where)
        client = storage.Client(project="nbexec", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emulator.url})
    else:
        moto = request.getfixturevalue("moto_s3")
        env |= {"NBEXEC_SNAPSHOT_BUCKET": where, "AWS_ENDPOINT_URL_S3": moto.url, "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": cloudstores.S3_KEY_ID, "AWS_SECRET_ACCESS_KEY": cloudstores.S3_SECRET,
                "NBEXEC_S3_ADDRESSING_STYLE": "path"}
        client = cloudstores.s3_client(moto.url)
        cloudstores.make_bucket(moto.url, where)
    monkeypatch.delenv("NBEXEC_SNAPSHOT_DIR", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Shared(request.param, env, client, where)


def staged() -> set[str]:
    root = Path(folders.private_root("nbexec-snapshot-staging"))
    return {str(p) for p in root.rglob("*")}


@pytest.fixture
def snap(shared: Shared, cleanup_ledger: None) -> tuple[Shared, str]:
    """Alice's snapshot (``x``, a note and a 1000-byte file) in the shared store; (shared, id)."""
    with Session(cfg(), owner="alice") as session:
        session.upload(b"a" * 1000, "sub/data.bin")
        assert session.run("x = 41\nopen('note.txt', 'w').write('hello')").ok
        return shared, session.snapshot()


def test_another_process_snapshots_and_this_one_restores(shared: Shared, cleanup_ledger: None,
                                                          tmp_path: Path) -> None:
    """Node A (another process, its own temp folder) snapshots; this process restores from the blobs alone."""
    code = ("import nbexec\n"
            f"c = nbexec.SandboxConfig(image={IMAGE!r}, pool_size=0, warm_imports=(), timeout=30)\n"
            "with nbexec.Session(c, owner='alice') as s:\n"
            "    assert s.run(\"import numpy as np\\nx = np.arange(5) * 3\\n"
            "open('made.txt', 'w').write(str(x.sum()))\").ok\n"
            "    s.upload(bytes(range(256)) * 10, 'deep/raw.bin')\n"
            "    print(s.snapshot())\n")
    env = {**os.environ, **shared.env, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    snapshot_id = done.stdout.strip().splitlines()[-1]
    assert not any(KEY_HEX in shared.read(n).hex() or bytes.fromhex(KEY_HEX) in shared.read(n)
                   for n in shared.names())  # the key is never in the store
    before = staged()
    with Session.from_snapshot(snapshot_id, owner="alice") as restored:
        result = restored.run("print(x.tolist(), open('made.txt').read(), "
                              "open('deep/raw.bin', 'rb').read() == bytes(range(256)) * 10)")
        assert result.ok and result.stdout == "[0, 3, 6, 9, 12] 30 True\n", result
        assert result.restored == "replay"
        assert restored.notebook.cells[0].source.startswith("import numpy")
    assert staged() == before  # the host copy is gone


def _flip(shared: Shared, name: str) -> None:
    data = bytearray(shared.read(name))
    data[len(data) // 2] ^= 1
    shared.write(name, bytes(data))


def _dots(shared: Shared, name: str) -> str:
    """``name``; on GCS (whose emulator holds no name with ``..`` in it) with each ``..`` spelled ``%2E%2E``."""
    return name.replace("..", "%2E%2E") if shared.kind == "gcs" else name


def _base(shared: Shared, snapshot_id: str) -> str:
    return shared.blobs(snapshot_id)["manifest.json"].removesuffix("manifest.json")


TAMPER: dict[str, Callable[[Shared, str], str]] = {
    "blob-byte": lambda s, i: (_flip(s, s.blobs(i)["files/note.txt"]), i)[1],
    "notebook-byte": lambda s, i: (_flip(s, s.blobs(i)["notebook.ipynb"]), i)[1],
    "manifest-byte": lambda s, i: (_flip(s, s.blobs(i)["manifest.json"]), i)[1],
    "signature-zeros": lambda s, i: (s.write(s.blobs(i)["manifest.sig"], b"0" * 64), i)[1],
    "blob-added": lambda s, i: (s.write(_base(s, i) + "files/extra.txt", b"more"), i)[1],
    "blob-removed": lambda s, i: (s.delete(s.blobs(i)["files/sub/data.bin"]), i)[1],
    "manifest-removed": lambda s, i: (s.delete(s.blobs(i)["manifest.json"]), i)[1],
    "name-dotdot": lambda s, i: (s.rename(s.blobs(i)["files/note.txt"],
                                          _base(s, i) + _dots(s, "files/sub\\..\\note.txt")), i)[1],
    "name-slash": lambda s, i: (s.rename(s.blobs(i)["files/sub/data.bin"], _base(s, i) + "files/sub//data.bin"),
                                i)[1],
    "name-escapes": lambda s, i: (s.write(_base(s, i) + _dots(s, "files\\..\\..\\..\\escape.txt"), b"x"), i)[1],
    "blob-larger": lambda s, i: (s.write(s.blobs(i)["files/sub/data.bin"], b"a" * 5000), i)[1],
    "blob-shorter": lambda s, i: (s.write(s.blobs(i)["files/sub/data.bin"], b"a" * 999), i)[1],
    "blob-empty": lambda s, i: (s.write(s.blobs(i)["files/note.txt"], b""), i)[1],
    "manifest-huge": lambda s, i: (s.write(s.blobs(i)["manifest.json"], b" " * (5 * 2**20)), i)[1],
    "id-one-char": lambda s, i: i[:-1] + ("0" if i[-1] != "0" else "1"),
    "id-raw-one-char": lambda s, i: ("0" if i[0] != "0" else "1") + i[1:],
    "id-truncated": lambda s, i: i[:20],
    "id-empty": lambda s, i: "",
    "id-path": lambda s, i: "../" + i,
}


@pytest.mark.parametrize("shape", list(TAMPER))
def test_tampered_blob_snapshot_is_refused(snap: tuple[Shared, str], shape: str) -> None:
    shared, snapshot_id = snap
    asked = TAMPER[shape](shared, snapshot_id)
    before, copies = unaccounted_containers(), staged()
    with pytest.raises(nbexec.SnapshotError):
        Session.from_snapshot(asked, owner="alice")
    assert unaccounted_containers() == before  # refused before any sandbox was started
    assert staged() == copies  # and no host copy is left


def test_manifest_swapped_from_another_snapshot_is_refused(shared: Shared, cleanup_ledger: None) -> None:
    with Session(cfg(), owner="alice") as session:
        assert session.run("x = 1").ok
        first = session.snapshot()
        assert session.run("x = 2").ok
        second = session.snapshot()
    a, b = shared.blobs(first), shared.blobs(second)
    first_signature = shared.read(a["manifest.sig"])
    for name in ("manifest.json", "manifest.sig", "notebook.ipynb"):
        shared.write(a[name], shared.read(b[name]))
    with pytest.raises(nbexec.SnapshotError, match="another snapshot"):
        Session.from_snapshot(first, owner="alice")
    shared.write(b["manifest.sig"], first_signature)  # only the signature, of the other snapshot's manifest
    with pytest.raises(nbexec.SnapshotError, match="changed"):
        Session.from_snapshot(second, owner="alice")


def test_another_owner_or_another_key_finds_no_snapshot(snap: tuple[Shared, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _, snapshot_id = snap
    for owner in ("mallory", ""):
        with pytest.raises(nbexec.SnapshotError, match="no snapshot"):
            Session.from_snapshot(snapshot_id, owner=owner)
    monkeypatch.setenv("NBEXEC_SNAPSHOT_KEY", "a7" * 32)  # a node with another key: not its snapshot
    with pytest.raises(nbexec.SnapshotError, match="no snapshot"):
        Session.from_snapshot(snapshot_id, owner="alice")


def test_restore_from_a_missing_container_makes_nothing(shared: Shared, cleanup_ledger: None) -> None:
    store = snapshotblobs.from_env(shared.env)
    snapshot_id = f"{'ab' * 16}.{snapshots.mac(bytes.fromhex(KEY_HEX), 'alice', 'ab' * 16)}"
    with pytest.raises(nbexec.SnapshotError):
        store.open("alice", snapshot_id)
    assert shared.untouched()  # no blob container (or object) was made by a read


class Lying:
    """The real blob space, answering as if the limit were not asked (a store that grew a blob between lookups or
    ignores the range): counts what the host pulled, and the modes of the host copy as it is written."""

    def __init__(self, real: blobspace.BlobSpace) -> None:
        self.real, self.kind, self.pulled, self.modes = real, real.kind, dict[str, int](), set[int]()

    def get(self, name: str, limit: int) -> Iterator[bytes]:
        for path in Path(folders.private_root("nbexec-snapshot-staging")).rglob("*"):
            self.modes.add(stat.S_IMODE(path.lstat().st_mode))
        for chunk in self.real.get(name, 10**12):
            self.pulled[name] = self.pulled.get(name, 0) + len(chunk)
            yield chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_larger_blob_is_never_pulled_past_its_size(snap: tuple[Shared, str]) -> None:
    """A blob of 48 MiB where the manifest says 1000 bytes: refused having pulled at most one chunk, and the host
    copy was private (0700 folders, 0600 files) while it was written."""
    shared, snapshot_id = snap
    shared.write(shared.blobs(snapshot_id)["files/sub/data.bin"], b"a" * (48 * 2**20))
    real = snapshotblobs.from_env(shared.env)
    lying = Lying(real.space)
    store = snapshotblobs.BlobSnapshotStore(lying, bytes.fromhex(KEY_HEX))
    before = staged()
    tracemalloc.start()
    try:
        with pytest.raises(nbexec.SnapshotError, match="larger"):
            store.open("alice", snapshot_id)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    pulled = [n for n in lying.pulled if n.endswith("/files/sub/data.bin")]
    assert pulled and lying.pulled[pulled[0]] <= 1000 + blobspace.CHUNK, lying.pulled
    assert peak < 16 * 2**20, peak  # a chunk and the client's copies of it, not the blob
    assert lying.modes and all(m & 0o077 == 0 for m in lying.modes), lying.modes
    assert staged() == before


def test_a_larger_blob_is_refused_by_its_size_before_a_byte(shared: Shared) -> None:
    """The blob space itself: a 48 MiB blob asked within 1000 bytes is refused before any byte is read."""
    shared.write("x/big.bin", b"a" * (48 * 2**20))
    space = snapshotblobs.from_env(shared.env).space
    assert space.names("x/") == ["x/big.bin"]  # the client is made (its own memory) before the count starts
    tracemalloc.start()
    try:
        with pytest.raises(nbexec.StorageError, match="more than"):
            next(iter(space.get("x/big.bin", 1000)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak


def test_a_huge_manifest_is_capped_before_parsing(snap: tuple[Shared, str]) -> None:
    shared, snapshot_id = snap
    shared.write(shared.blobs(snapshot_id)["manifest.json"], b"[" * (64 * 2**20))
    store = snapshotblobs.BlobSnapshotStore(Lying(snapshotblobs.from_env(shared.env).space),
                                            bytes.fromhex(KEY_HEX))
    tracemalloc.start()
    try:
        with pytest.raises(nbexec.SnapshotError, match="manifest"):
            store.open("alice", snapshot_id)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * snapshots.MAX_MANIFEST + 8 * 2**20, peak  # held: the cap and a chunk, a few copies of them


def test_snapshot_count_is_capped_per_owner_in_the_store(shared: Shared, cleanup_ledger: None) -> None:
    with Session(cfg(), owner="alice") as session:
        assert session.run("x = 1").ok
        made = [session.snapshot() for _ in range(snapshots.MAX_SNAPSHOTS)]
        blobs = len(shared.names())
        with pytest.raises(nbexec.SessionLimitError, match="snapshots are kept"):
            session.snapshot()
        assert len(shared.names()) == blobs  # nothing written past the cap
        snapshotblobs.from_env(shared.env).delete("alice", made[0])
        assert shared.blobs(made[0]) == {}
        session.snapshot()
    with Session(cfg(), owner="bob") as other:  # the cap is per owner
        assert other.run("y = 1").ok
        other.snapshot()


@pytest.mark.parametrize("key", ["", "abcd", "5e" * 31, "not hex or base64!"])
def test_a_blob_store_without_a_good_key_is_a_config_error(shared: Shared, monkeypatch: pytest.MonkeyPatch,
                                                           key: str) -> None:
    monkeypatch.setenv("NBEXEC_SNAPSHOT_KEY", key)
    with pytest.raises(nbexec.ConfigError, match="NBEXEC_SNAPSHOT_KEY") as caught:
        snapshotblobs.store_for(None)
    assert not key or key not in str(caught.value)
    assert shared.untouched()


def test_secrets_stay_out_of_reprs_and_errors(snap: tuple[Shared, str]) -> None:
    shared, snapshot_id = snap
    store = snapshotblobs.from_env(shared.env)
    shown = repr(store) + repr(store.space)
    secrets = [KEY_HEX, shared.env.get("AWS_SECRET_ACCESS_KEY", "")[:20],
               shared.env.get("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=").split("AccountKey=")[1][:20]]
    assert not [secret for secret in secrets if secret and secret in shown], shown
    shared.write(shared.blobs(snapshot_id)["manifest.json"], json.dumps({"id": KEY_HEX}).encode())
    with pytest.raises(nbexec.SnapshotError) as caught:
        store.open("alice", snapshot_id)
    assert KEY_HEX not in str(caught.value)


def test_a_forged_manifest_is_refused_before_any_file_is_pulled(snap: tuple[Shared, str]) -> None:
    """Whoever can write the store (but has no key) rewrites the manifest to admit a 48 MiB file: the signature is
    checked before its sizes are trusted, so not one byte of the file is pulled."""
    import hashlib

    shared, snapshot_id = snap
    blobs = shared.blobs(snapshot_id)
    big = b"a" * (48 * 2**20)
    body = json.loads(shared.read(blobs["manifest.json"]))
    body["files"] = [{"name": "sub/data.bin", "size": len(big), "sha256": hashlib.sha256(big).hexdigest()}
                     if f["name"] == "sub/data.bin" else f for f in body["files"]]
    shared.write(blobs["manifest.json"], json.dumps(body, sort_keys=True).encode())
    shared.write(blobs["files/sub/data.bin"], big)
    lying = Lying(snapshotblobs.from_env(shared.env).space)
    store = snapshotblobs.BlobSnapshotStore(lying, bytes.fromhex(KEY_HEX))
    with pytest.raises(nbexec.SnapshotError, match="changed"):
        store.open("alice", snapshot_id)
    assert not [n for n in lying.pulled if n.endswith("/files/sub/data.bin")], lying.pulled


def test_a_restore_is_admitted_on_disk_before_it_downloads(snap: tuple[Shared, str]) -> None:
    """A (validly signed) snapshot whose config keeps more disk margin than the host has: DiskSpaceError before a
    byte of its files is pulled or written, and no host copy left."""
    import hashlib
    import hmac

    shared, snapshot_id = snap
    blobs = shared.blobs(snapshot_id)
    body = json.loads(shared.read(blobs["manifest.json"]))
    body["config"]["disk_margin"] = "1000t"  # the host as if it had no room left
    manifest = json.dumps(body, sort_keys=True).encode()
    shared.write(blobs["manifest.json"], manifest)
    shared.write(blobs["manifest.sig"], hmac.new(bytes.fromhex(KEY_HEX), manifest, hashlib.sha256).hexdigest().encode())
    lying = Lying(snapshotblobs.from_env(shared.env).space)
    store = snapshotblobs.BlobSnapshotStore(lying, bytes.fromhex(KEY_HEX))
    before = staged()
    with pytest.raises(nbexec.DiskSpaceError):
        store.open("alice", snapshot_id)
    assert not [n for n in lying.pulled if "/files/" in n or n.endswith("notebook.ipynb")], lying.pulled
    assert staged() == before


def test_serve_refuses_to_start_with_a_shared_store_and_a_short_key(tmp_path: Path) -> None:
    """`nbexec serve` with NBEXEC_SNAPSHOT_STORE=azure and a 6-byte key: a usage error at start that names the
    setting and does not echo the key (not a failure at the first snapshot)."""
    from ..azurite import free_port

    env = {**os.environ, "NBEXEC_SNAPSHOT_STORE": "azure", "NBEXEC_SNAPSHOT_KEY": "deadbeefcafe",
           "AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"}
    env.pop("NBEXEC_SNAPSHOT_DIR", None)
    done = subprocess.run([sys.executable, "-m", "nbexec.cli", "serve", "--no-auth", "--host", "127.0.0.1",
                           "--port", str(free_port())], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "NBEXEC_SNAPSHOT_KEY" in done.stderr and "deadbeefcafe" not in done.stderr


@pytest.mark.parametrize("fails_at", [1, 3, 5], ids=["first-file", "a-later-file", "the-signature"])
def test_an_upload_that_fails_midway_leaves_no_blob_and_no_slot(shared: Shared, cleanup_ledger: None,
                                                               monkeypatch: pytest.MonkeyPatch, fails_at: int) -> None:
    """The store goes away while a snapshot's blobs are written (the ``fails_at``-th write fails, as a dropped
    connection makes it): the blobs already written are removed from the real store, nothing is staged on this
    host, and the owner's count cap does not lose a slot to a half-written snapshot."""
    space = {"azure": blobspace.AzureBlobSpace, "s3": blobspace.S3BlobSpace, "gcs": blobspace.GCSBlobSpace}[shared.kind]
    real_put, writes = space.put, []

    def dropped(self: Any, name: str, content: Any, length: int) -> None:
        writes.append(name)
        if len(writes) == fails_at:
            raise nbexec.errors.StorageError(f"storing {name} failed: the connection was reset")
        real_put(self, name, content, length)

    before = staged()
    with Session(cfg(), owner="erin") as session:
        session.upload(b"a" * 1000, "one.bin")
        session.upload(b"b" * 1000, "two.bin")
        assert session.run("x = 1\nopen('three.txt', 'w').write('3')").ok
        monkeypatch.setattr(space, "put", dropped)
        with pytest.raises(nbexec.errors.StorageError, match="reset"):
            session.snapshot()
        assert len(writes) == fails_at
        assert shared.names() == [], "blobs of a snapshot whose upload failed were left in the store"
        assert staged() == before
        monkeypatch.setattr(space, "put", real_put)
        store = snapshotblobs.store_for(None, None)
        assert store.count("erin") == 0
        snapshot_id = session.snapshot()  # the store back: the next snapshot is whole and counted once
        assert store.count("erin") == 1 and len(shared.blobs(snapshot_id)) == 6, shared.names()
