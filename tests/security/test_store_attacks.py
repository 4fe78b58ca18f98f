"""The S3 and GCS stores (and where the rule is shared, Azure's) against real local servers, judged from outside:
what an anonymous reader gets, what a link answers and for how long it is signed, what a changed file leaves in
the bucket, how much memory a huge upload takes, what a bad setting does before any sandbox, what a secret
leaves in reprs, logs and errors."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, parse_qsl, quote, urlsplit

import pytest

from nbexec.errors import ConfigError
from nbexec.result import File
from nbexec.stores import uploads
from nbexec.stores.gcs import GCSSettings, GCSStore
from nbexec.stores.s3 import S3Settings, S3Store
from nbexec.stores.storage import ArtifactStore

from .. import cloudstores
from ..azurite import KEY, free_port
from ..test_cli import nbexec as run_cli

MiB = 1024**2


def fetch(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()}


def s3_store(server: cloudstores.Server, **options: object) -> S3Store:
    bucket = f"t{time.time_ns()}"
    cloudstores.make_bucket(server.url, bucket)
    return S3Store(S3Settings(bucket=bucket, endpoint_url=server.url, access_key_id=cloudstores.S3_KEY_ID,
                              secret_access_key=cloudstores.S3_SECRET, **options))  # type: ignore[arg-type]


def gcs_store(server: cloudstores.Server, key: tuple[Path, bytes], **options: object) -> GCSStore:
    bucket = f"t{time.time_ns()}"
    cloudstores.gcs_bucket(server.url, bucket)
    return GCSStore(GCSSettings(bucket=bucket, emulator_host=server.url, credentials_file=str(key[0]),
                                **options))  # type: ignore[arg-type]


@pytest.fixture(params=["azure", "s3", "gcs"])
def any_store(request: pytest.FixtureRequest) -> Callable[..., ArtifactStore]:
    """A maker of a store of each kind on a fresh bucket (container) of its real local server."""
    if request.param == "azure":
        from ..test_storage import store_for

        azurite = request.getfixturevalue("azurite")
        return lambda **options: store_for(azurite, **options)
    if request.param == "s3":
        moto = request.getfixturevalue("moto_s3")
        return lambda **options: s3_store(moto, **options)
    emulator, key = request.getfixturevalue("gcs_emulator"), request.getfixturevalue("gcs_key")
    return lambda **options: gcs_store(emulator, key, **options)


def stored_names(store: ArtifactStore) -> list[str]:
    """Every object in the store's bucket (container), listed through the service's own API."""
    if isinstance(store, S3Store):
        client = store._client()
        return [o["Key"] for o in client.list_objects_v2(Bucket=store.settings.bucket).get("Contents", [])]
    if isinstance(store, GCSStore):
        client, _ = store._client()
        return [b.name for b in client.list_blobs(store.settings.bucket)]
    container = store._client().get_container_client(store.settings.container)  # type: ignore[attr-defined]
    return [b.name for b in container.list_blobs()]


def put_file(folder: Path, name: str, content: bytes) -> File:
    """A file in a run's data folder and its manifest entry (what the result lists)."""
    path = folder / name
    path.write_bytes(content)
    return File(name=name, path=str(path), size=len(content), mime="application/octet-stream",
                sha256=hashlib.sha256(content).hexdigest())


# -- private by default -------------------------------------------------------------------------------------------

def test_s3_objects_are_not_readable_without_the_link(moto_s3: cloudstores.Server) -> None:
    store = s3_store(moto_s3)
    url = store.upload("nbexec/run/secret.csv", b"a,b\n", "text/csv")
    assert fetch(url)[:2] == (200, b"a,b\n")
    plain = url.split("?", 1)[0]
    assert fetch(plain)[0] == 403, "an anonymous GET read the object"
    acl = store._client().get_object_acl(Bucket=store.settings.bucket, Key="nbexec/run/secret.csv")
    assert all("AllUsers" not in str(g.get("Grantee")) and "AuthenticatedUsers" not in str(g.get("Grantee"))
               for g in acl["Grants"]), acl["Grants"]


def test_gcs_objects_carry_no_public_acl(gcs_emulator: cloudstores.Server, gcs_key: tuple[Path, bytes]) -> None:
    """The emulator serves every object to anyone, so the test reads what real GCS would judge by: the object's
    ACL (no allUsers / allAuthenticatedUsers entry), asked of the service's JSON API."""
    store = gcs_store(gcs_emulator, gcs_key)
    store.upload("nbexec/run/secret.csv", b"a,b\n", "text/csv")
    name = quote("nbexec/run/secret.csv", safe="")
    status, body, _ = fetch(f"{gcs_emulator.url}/storage/v1/b/{store.settings.bucket}/o/{name}/acl")
    assert status == 200
    entities = [item["entity"] for item in json.loads(body).get("items", [])]
    assert not {"allUsers", "allAuthenticatedUsers"} & set(entities), entities


# -- read-only, time-limited links --------------------------------------------------------------------------------

def _canonical_query(query: str, drop: str) -> str:
    pairs = sorted((quote(k, safe="-_.~"), quote(v, safe="-_.~")) for k, v in parse_qsl(query, keep_blank_values=True)
                   if k != drop)
    return "&".join(f"{k}={v}" for k, v in pairs)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sigv4_signature_ok(url: str, secret: str) -> bool:
    """Check a presigned S3 URL's SigV4 signature from scratch (AWS's published algorithm): the method, the
    object, the date and the lifetime are all under it."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    canonical = "\n".join(["GET", parts.path, _canonical_query(parts.query, "X-Amz-Signature"),
                           f"host:{parts.netloc}", "", query["X-Amz-SignedHeaders"], "UNSIGNED-PAYLOAD"])
    scope = query["X-Amz-Credential"].split("/", 1)[1]
    to_sign = "\n".join(["AWS4-HMAC-SHA256", query["X-Amz-Date"], scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    day, region, service, _ = scope.split("/")
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret}".encode(), day), region), service), "aws4_request")
    return hmac.compare_digest(hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest(), query["X-Amz-Signature"])


def goog4_signature_ok(url: str, public_pem: bytes) -> bool:
    """Check a V4 signed GCS URL's RSA signature from scratch with the service account's public key."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    canonical = "\n".join(["GET", parts.path, _canonical_query(parts.query, "X-Goog-Signature"),
                           f"host:{parts.netloc}", "", query["X-Goog-SignedHeaders"], "UNSIGNED-PAYLOAD"])
    scope = query["X-Goog-Credential"].split("/", 1)[1]
    to_sign = "\n".join(["GOOG4-RSA-SHA256", query["X-Goog-Date"], scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    public = serialization.load_pem_public_key(public_pem)
    try:
        public.verify(bytes.fromhex(query["X-Goog-Signature"]), to_sign.encode(),  # type: ignore[union-attr,call-arg]
                      padding.PKCS1v15(), hashes.SHA256())  # type: ignore[arg-type]
    except InvalidSignature:
        return False
    return True


def _signed_at(stamp: str) -> dt.datetime:
    return dt.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("lifetime", [1, 900, 7 * 24 * 3600], ids=["1s", "15min", "7days"])
def test_s3_links_are_signed_get_links_that_end_after_the_lifetime(moto_s3: cloudstores.Server,
                                                                   lifetime: int) -> None:
    store = s3_store(moto_s3, link_expiry_s=lifetime)
    url = store.upload("nbexec/run/a.txt", b"a", "text/plain")
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert query["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256" and query["X-Amz-SignedHeaders"] == "host"
    assert int(query["X-Amz-Expires"]) == lifetime
    assert abs((_signed_at(query["X-Amz-Date"]) - dt.datetime.now(dt.timezone.utc)).total_seconds()) < 120
    assert sigv4_signature_ok(url, cloudstores.S3_SECRET), "the link's signature does not cover what it says"
    longer = url.replace(f"X-Amz-Expires={lifetime}", f"X-Amz-Expires={lifetime + 1}")
    assert not sigv4_signature_ok(longer, cloudstores.S3_SECRET), "a longer lifetime kept the signature valid"


def test_gcs_links_are_signed_get_links_that_end_after_the_lifetime(gcs_emulator: cloudstores.Server,
                                                                    gcs_key: tuple[Path, bytes]) -> None:
    """The emulator does not verify signatures: the link's fields are read and its RSA signature is checked with
    the service account's public key, as GCS does."""
    store = gcs_store(gcs_emulator, gcs_key, link_expiry_s=600)
    url = store.upload("nbexec/run/a.txt", b"a", "text/plain")
    assert fetch(url)[:2] == (200, b"a")
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert query["X-Goog-Algorithm"] == "GOOG4-RSA-SHA256" and query["X-Goog-SignedHeaders"] == "host"
    assert int(query["X-Goog-Expires"]) == 600
    assert abs((_signed_at(query["X-Goog-Date"]) - dt.datetime.now(dt.timezone.utc)).total_seconds()) < 120
    assert goog4_signature_ok(url, gcs_key[1]), "the link's signature does not cover what it says"
    assert not goog4_signature_ok(url.replace("X-Goog-Expires=600", "X-Goog-Expires=6000"), gcs_key[1])


@pytest.mark.parametrize("lifetime", [0, -5, 7 * 24 * 3600 + 1, float("nan")], ids=["zero", "negative", "8days", "nan"])
def test_link_lifetimes_the_services_refuse_are_config_errors(lifetime: float) -> None:
    with pytest.raises(ConfigError, match="NBEXEC_LINK_EXPIRY"):
        S3Settings(bucket="some-bucket", link_expiry_s=lifetime)
    with pytest.raises(ConfigError, match="NBEXEC_LINK_EXPIRY"):
        GCSSettings(bucket="some-bucket", link_expiry_s=lifetime)


# -- active types are downloaded ----------------------------------------------------------------------------------

ACTIVE_PAGE = b"<html><body><script>document.title = 'ran'</script></body></html>"
ACTIVE_SVG = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(document.domain)</script></svg>'
TYPES = [("page.html", "text/html", ACTIVE_PAGE, True),
         ("drawing.svg", "image/svg+xml", ACTIVE_SVG, True),
         ("app.js", "text/javascript", b"alert(1)", True),
         ("feed.xml", "application/xml", b"<a/>", True),
         ("page.xhtml", "application/xhtml+xml", ACTIVE_PAGE, True),
         ("looks-plain.html", "text/plain", ACTIVE_PAGE, True),
         ("notes.txt", "text/html; charset=utf-8", ACTIVE_PAGE, True),
         ("noext", "image/SVG+XML", ACTIVE_SVG, True),
         ("header.bin", "text/plain\r\nX-Injected: 1", b"x", True),
         ("table.csv", "text/csv", b"a,b\n1,2\n", False),
         ("chart.png", "image/png", b"\x89PNG\r\n\x1a\n", False)]


@pytest.mark.parametrize(("name", "mime", "content", "active"), TYPES, ids=[t[0] for t in TYPES])
def test_active_files_come_back_as_octet_stream_attachments(any_store: Callable[..., ArtifactStore], name: str,
                                                            mime: str, content: bytes, active: bool) -> None:
    url = any_store().upload(f"nbexec/x/{name}", content, mime)
    status, body, headers = fetch(url)
    assert status == 200 and body == content
    disposition, served_type = headers.get("content-disposition", ""), headers.get("content-type", "")
    assert disposition.startswith("attachment") is active, disposition
    if active:
        assert served_type == "application/octet-stream", served_type
    else:
        assert served_type == mime
    assert "x-injected" not in headers


# -- what was sent is what was hashed ----------------------------------------------------------------------------

def _same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CHANGES: dict[str, Callable[[Path], None]] = {
    "same-size": _same_size,
    "last-byte": lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])),
    "grown": lambda p: p.write_bytes(p.read_bytes() + b"more"),
    "shrunk": lambda p: p.write_bytes(p.read_bytes()[:-10]),
    "emptied": lambda p: p.write_bytes(b""),
    "symlink": lambda p: (p.unlink(), p.symlink_to("/etc/passwd")),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_file_changed_after_the_manifest_is_not_stored(any_store: Callable[..., ArtifactStore], tmp_path: Path,
                                                         change: str) -> None:
    """Between the run's manifest (name, size, sha256) and the upload the file changes on the host: the upload
    fails honestly and the bucket holds nothing under its name; the other file still goes."""
    store = any_store()
    item = put_file(tmp_path, "victim.bin", os.urandom(300_000))
    other = put_file(tmp_path, "other.bin", b"kept")
    CHANGES[change](Path(item.path))
    stored = uploads.store_all([item, other], [], store, execution_id="run1", data_dir=tmp_path)
    status = {u.name: u for u in stored.uploads}
    assert status["victim.bin"].status == "failed", status["victim.bin"]
    assert status["other.bin"].status == "uploaded"
    assert stored_names(store) == ["nbexec/run1/other.bin"]
    assert KEY not in (status["victim.bin"].reason or "")


def test_a_multipart_upload_of_a_changed_file_leaves_no_object_and_no_parts(moto_s3: cloudstores.Server,
                                                                            tmp_path: Path) -> None:
    store = s3_store(moto_s3, part_size=5 * MiB)
    item = put_file(tmp_path, "big.bin", os.urandom(12 * MiB))
    path = Path(item.path)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00" if path.read_bytes()[-1] else b"\x01")
    stored = uploads.store_all([item], [], store, execution_id="run1", data_dir=tmp_path)
    assert stored.uploads[0].status == "failed" and "changed" in (stored.uploads[0].reason or "")
    client = store._client()
    assert stored_names(store) == []
    assert client.list_multipart_uploads(Bucket=store.settings.bucket).get("Uploads", []) == []


# -- huge files stream ---------------------------------------------------------------------------------------------

STREAM_CHILD = """
import hashlib, json, resource, sys
from pathlib import Path
from nbexec.result import File
from nbexec.stores import storage, uploads
path = Path(sys.argv[1])
digest = hashlib.sha256()
with open(path, 'rb') as handle:
    for block in iter(lambda: handle.read(1 << 20), b''):
        digest.update(block)
item = File(name=path.name, path=str(path), size=path.stat().st_size, mime='application/octet-stream',
            sha256=digest.hexdigest())
store = storage.from_env(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stored = uploads.store_all([item], [], store, execution_id='big', data_dir=path.parent)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({'status': stored.uploads[0].status, 'reason': stored.uploads[0].reason,
                  'url': stored.uploads[0].url, 'growth_kib': after - before}))
"""
HUGE = 192 * MiB


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_huge_file_is_streamed_in_bounded_memory(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> None:
    """A 192 MiB file uploads from a process whose peak memory grows by far less than the file."""
    path = tmp_path / "huge.bin"
    with open(path, "wb") as handle:
        block = os.urandom(MiB)
        for _ in range(HUGE // MiB):
            handle.write(block)
    if kind == "s3":
        server: cloudstores.Server = request.getfixturevalue("moto_s3")
        store = s3_store(server)
        env = {"NBEXEC_S3_BUCKET": store.settings.bucket, "AWS_ENDPOINT_URL_S3": server.url,
               "AWS_ACCESS_KEY_ID": cloudstores.S3_KEY_ID, "AWS_SECRET_ACCESS_KEY": cloudstores.S3_SECRET}
    else:
        server = request.getfixturevalue("gcs_emulator")
        gstore = gcs_store(server, request.getfixturevalue("gcs_key"))
        env = {"NBEXEC_GCS_BUCKET": gstore.settings.bucket, "STORAGE_EMULATOR_HOST": server.url,
               "GOOGLE_APPLICATION_CREDENTIALS": str(gstore.settings.credentials_file)}
    done = subprocess.run([sys.executable, "-c", STREAM_CHILD, str(path), kind], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "uploaded", report
    assert report["growth_kib"] * 1024 < 64 * MiB, f"peak memory grew by {report['growth_kib'] // 1024} MiB"
    if kind == "s3":
        head = store._client().head_object(Bucket=store.settings.bucket, Key="nbexec/big/huge.bin")
        assert head["ContentLength"] == HUGE and head["ETag"].strip('"').endswith("-24"), head["ETag"]  # 8 MiB parts


# -- bad settings stop the CLI before any sandbox -------------------------------------------------------------------

CODE = "open('/mnt/data/ran.txt', 'w').write('ran')\n"


def _cli_stops(tmp_path: Path, store: str, env: dict[str, str], exit_code: int, message: str,
               secrets: tuple[str, ...] = ()) -> None:
    done = run_cli("run", "--store", store, "--output-dir", "out", "-", cwd=tmp_path, env=env, stdin=CODE)
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    for secret in secrets:
        assert secret not in done.stderr + done.stdout
    assert not (tmp_path / "out").exists()  # nothing ran


def _shadow(tmp_path: Path, module: str) -> dict[str, str]:
    shadow = tmp_path / "shadow"
    shadow.mkdir(exist_ok=True)
    (shadow / f"{module}.py").write_text("raise ImportError('not installed')\n")
    return {"PYTHONPATH": f"{shadow}:{os.environ.get('PYTHONPATH', '')}"}


def test_s3_bad_settings_stop_the_cli_early(moto_s3_auth: tuple[cloudstores.Server, tuple[str, str]],
                                            tmp_path: Path) -> None:
    server, (key_id, secret) = moto_s3_auth
    good = {"NBEXEC_S3_BUCKET": "checked", "AWS_ENDPOINT_URL_S3": server.url, "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": ""}
    wrong_secret = secret[:-6] + "WRONG1"
    cases = [
        ({**good, "AWS_SECRET_ACCESS_KEY": wrong_secret}, 2, "refused the credentials"),
        ({**good, "AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000"}, 2, "refused the credentials"),
        ({**good, "NBEXEC_S3_BUCKET": "no-such-bucket"}, 2, "the bucket does not exist"),
        ({**good, "NBEXEC_S3_BUCKET": ""}, 2, "NBEXEC_S3_BUCKET"),
        ({**good, "NBEXEC_S3_BUCKET": "Not_A_Bucket"}, 2, "not a valid S3 bucket name"),
        ({**good, "AWS_SECRET_ACCESS_KEY": ""}, 2, "set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        ({**good, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "nbexec-missing"}, 2,
         "AWS_PROFILE"),
        ({**good, "NBEXEC_LINK_EXPIRY": "700000"}, 2, "at most"),
        ({**good, "NBEXEC_LINK_EXPIRY": "soon"}, 2, "NBEXEC_LINK_EXPIRY must be a number"),
        ({**good, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}"}, 3, "is not reachable"),
        ({**good, **_shadow(tmp_path, "boto3")}, 2, "pip install 'nbexec-sandbox[s3]'"),
    ]
    for env, exit_code, message in cases:
        _cli_stops(tmp_path, "s3", env, exit_code, message, (secret, wrong_secret))


def test_gcs_bad_settings_stop_the_cli_early(gcs_emulator: cloudstores.Server, gcs_key: tuple[Path, bytes],
                                             tmp_path: Path) -> None:
    cloudstores.gcs_bucket(gcs_emulator.url, "checked")
    key_text = gcs_key[0].read_text()
    private = json.loads(key_text)["private_key"]
    secrets = tuple(line for line in private.splitlines()[1:-1])
    truncated = tmp_path / "truncated.json"
    truncated.write_text(key_text[: len(key_text) // 2])
    bad_key = tmp_path / "bad-key.json"
    bad_key.write_text(json.dumps({**json.loads(key_text), "private_key": private[:200] + private[400:]}))
    not_sa = tmp_path / "user.json"
    not_sa.write_text(json.dumps({"type": "authorized_user", "client_id": "x", "client_secret": "y",
                                  "refresh_token": "z"}))
    good = {"NBEXEC_GCS_BUCKET": "checked", "STORAGE_EMULATOR_HOST": gcs_emulator.url,
            "GOOGLE_APPLICATION_CREDENTIALS": str(gcs_key[0])}
    cases = [
        ({**good, "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json")}, 2, "cannot read"),
        ({**good, "GOOGLE_APPLICATION_CREDENTIALS": str(truncated)}, 2, "not a usable service-account key"),
        ({**good, "GOOGLE_APPLICATION_CREDENTIALS": str(bad_key)}, 2, "not a usable service-account key"),
        ({**good, "GOOGLE_APPLICATION_CREDENTIALS": str(not_sa)}, 2, "not a usable service-account key"),
        ({**good, "NBEXEC_GCS_BUCKET": "no-such-bucket"}, 2, "the bucket does not exist"),
        ({**good, "NBEXEC_GCS_BUCKET": ""}, 2, "NBEXEC_GCS_BUCKET"),
        ({**good, "NBEXEC_LINK_EXPIRY": "0"}, 2, "above 0"),
        ({**good, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}, 3, "is not reachable"),
        ({**good, **_shadow(tmp_path, "google")}, 2, "pip install 'nbexec-sandbox[gcs]'"),
    ]
    for env, exit_code, message in cases:
        _cli_stops(tmp_path, "gcs", env, exit_code, message, secrets)


def test_serve_checks_the_store_before_it_listens(moto_s3_auth: tuple[cloudstores.Server, tuple[str, str]],
                                                  tmp_path: Path) -> None:
    server, (key_id, _) = moto_s3_auth
    port = free_port()
    env = {**os.environ, "NBEXEC_S3_BUCKET": "checked", "AWS_ENDPOINT_URL_S3": server.url,
           "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": "not-the-secret-at-all"}
    done = subprocess.run([sys.executable, "-m", "nbexec.cli", "serve", "--no-auth", "--port", str(port), "--store",
                           "s3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "refused the credentials" in done.stderr and "not-the-secret-at-all" not in done.stderr


# -- secrets ---------------------------------------------------------------------------------------------------------

def test_s3_secrets_stay_out_of_reprs_logs_and_errors(moto_s3: cloudstores.Server,
                                                      moto_s3_auth: tuple[cloudstores.Server, tuple[str, str]],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    token = "FwoGZXIvYXdzEXAMPLESESSIONTOKEN" + "x" * 40
    store = s3_store(moto_s3, session_token=token)
    caplog.set_level(logging.DEBUG)
    url = store.upload("n/x.txt", b"x", "text/plain")
    assert fetch(url)[1] == b"x"
    store.check()
    server, (key_id, secret) = moto_s3_auth
    refused = S3Store(S3Settings(bucket="checked", endpoint_url=server.url, access_key_id=key_id,
                                 secret_access_key=secret + "x", session_token=token))
    with pytest.raises(ConfigError) as refusal:
        refused.check()
    for shown in (repr(store), repr(store.settings), repr(refused.settings), caplog.text, str(refusal.value)):
        for hidden in (cloudstores.S3_SECRET, token, secret):
            assert hidden not in shown


def test_gcs_key_stays_out_of_reprs_logs_and_errors(gcs_emulator: cloudstores.Server, gcs_key: tuple[Path, bytes],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    private = json.loads(gcs_key[0].read_text())["private_key"]
    body = "".join(private.splitlines()[1:-1])
    store = gcs_store(gcs_emulator, gcs_key)
    caplog.set_level(logging.DEBUG)
    url = store.upload("n/x.txt", b"x", "text/plain")
    assert fetch(url)[1] == b"x"
    der = base64.b64decode(body)
    for shown in (repr(store), repr(store.settings), caplog.text, url):
        assert body[:64] not in shown and body[-64:] not in shown and der.hex()[:64] not in shown
