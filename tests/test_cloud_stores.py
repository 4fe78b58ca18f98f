"""Artifacts in S3 (moto's server) and Google Cloud Storage (gcp-storage-emulator): a run's files and images come
back as links that read the exact bytes; the CLI and `store_from_env` read the usual variables of each cloud."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

import nbexec
from nbexec.stores.gcs import GCSStore
from nbexec.stores.s3 import S3Store
from nbexec.stores.storage import ArtifactStore

from . import cloudstores
from .security.test_store_attacks import fetch, gcs_store, s3_store
from .test_cli import nbexec as run_cli


@pytest.fixture(params=["s3", "gcs"])
def cloud_store(request: pytest.FixtureRequest) -> Callable[..., ArtifactStore]:
    if request.param == "s3":
        moto = request.getfixturevalue("moto_s3")
        return lambda **options: s3_store(moto, **options)
    emulator, key = request.getfixturevalue("gcs_emulator"), request.getfixturevalue("gcs_key")
    return lambda **options: gcs_store(emulator, key, **options)


PRODUCE = (
    "import matplotlib.pyplot as plt, os\n"
    "open('/mnt/data/table.csv', 'w').write('a,b\\n1,2\\n')\n"
    "os.makedirs('/mnt/data/deep', exist_ok=True)\n"
    "open('/mnt/data/deep/blob.bin', 'wb').write(bytes(range(256)) * 40)\n"
    "open('/mnt/data/odd name (1).txt', 'w').write('spaces and brackets')\n"
    "os.symlink('/etc/passwd', '/mnt/data/link')\n"
    "plt.plot([1, 3, 2]); plt.show()\n"
    "print('see [the table](sandbox:/mnt/data/table.csv)')\n"
)


def test_files_and_images_upload_with_links(config: nbexec.SandboxConfig,
                                            cloud_store: Callable[..., ArtifactStore]) -> None:
    store = cloud_store()
    result = nbexec.execute_notebook(PRODUCE, config=config, store=store)
    assert result.ok, result.error
    statuses = {u.name: u.status for u in result.uploads}
    assert statuses == {"table.csv": "uploaded", "deep/blob.bin": "uploaded", "odd name (1).txt": "uploaded",
                        "images/cell0-1.png": "uploaded"}
    for item in result.files:
        assert item.url is not None
        status, body, headers = fetch(item.url)
        assert status == 200 and hashlib.sha256(body).hexdigest() == item.sha256
        assert body == Path(item.path).read_bytes()
        assert headers["content-type"] == item.mime
    image = result.images[0]
    assert image.url and fetch(image.url)[1] == Path(image.path).read_bytes()
    table_url = next(f.url for f in result.files if f.name == "table.csv")
    assert f"[the table]({table_url})" in result.stdout
    assert {u.blob for u in result.uploads if u.kind == "file"} >= {f"nbexec/{result.execution_id}/table.csv"}
    assert [s.name for s in result.skipped_files] == ["link"]


def test_a_session_uploads_only_new_and_changed(config: nbexec.SandboxConfig,
                                                cloud_store: Callable[..., ArtifactStore]) -> None:
    with nbexec.Session(config, store=cloud_store()) as session:
        first = session.run("open('a.txt', 'w').write('1'); open('b.txt', 'w').write('1')")
        assert sorted(u.name for u in first.uploads) == ["a.txt", "b.txt"]
        second = session.run("open('b.txt', 'w').write('2'); open('c.txt', 'w').write('3')")
        assert sorted(u.name for u in second.uploads) == ["b.txt", "c.txt"]
        b_url = next(f.url for f in second.files if f.name == "b.txt")
        assert b_url and fetch(b_url)[1] == b"2"


def test_store_from_env_reads_each_clouds_variables(tmp_path: Path) -> None:
    s3 = nbexec.store_from_env("s3", {
        "NBEXEC_S3_BUCKET": "my-bucket", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_DEFAULT_REGION": "eu-west-3",
        "AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_SESSION_TOKEN": "t0k3n",
        "NBEXEC_BLOB_PREFIX": "runs", "NBEXEC_LINK_EXPIRY": "120", "NBEXEC_S3_ADDRESSING_STYLE": "path"})
    assert isinstance(s3, S3Store)
    assert (s3.settings.bucket, s3.settings.endpoint_url, s3.settings.region) == \
        ("my-bucket", "http://127.0.0.1:9", "eu-west-3")
    assert (s3.settings.prefix, s3.settings.link_expiry_s, s3.settings.addressing_style) == ("runs", 120, "path")
    assert (s3.settings.session_token, s3.prefix) == ("t0k3n", "runs")
    preferred = nbexec.store_from_env("s3", {"NBEXEC_S3_BUCKET": "b-1", "AWS_ENDPOINT_URL": "http://a",
                                             "AWS_ENDPOINT_URL_S3": "http://b", "AWS_REGION": "r1",
                                             "AWS_DEFAULT_REGION": "r2"})
    assert isinstance(preferred, S3Store) and (preferred.settings.endpoint_url, preferred.settings.region) == \
        ("http://b", "r1")
    gcs = nbexec.store_from_env("gcs", {"NBEXEC_GCS_BUCKET": "g-bucket", "STORAGE_EMULATOR_HOST": "http://e",
                                        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json"})
    assert isinstance(gcs, GCSStore)
    assert (gcs.settings.bucket, gcs.settings.emulator_host, gcs.settings.credentials_file) == \
        ("g-bucket", "http://e", "/k.json")
    azure = nbexec.store_from_env("azure", {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "NBEXEC_SAS_EXPIRY": "60"})
    assert azure.settings.sas_expiry_s == 60  # type: ignore[attr-defined]
    both = nbexec.store_from_env("azure", {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "NBEXEC_SAS_EXPIRY": "60",
                                           "NBEXEC_LINK_EXPIRY": "90"})
    assert both.settings.sas_expiry_s == 90  # type: ignore[attr-defined]
    with pytest.raises(nbexec.ConfigError, match="use one of local, azure, s3, gcs"):
        nbexec.store_from_env("dropbox", {})


def test_cli_store_s3_and_gcs_print_links(cleanup_ledger: None, moto_s3: cloudstores.Server,
                                          gcs_emulator: cloudstores.Server, gcs_key: tuple[Path, bytes],
                                          tmp_path: Path) -> None:
    s3 = s3_store(moto_s3)
    gcs = gcs_store(gcs_emulator, gcs_key)
    envs = {
        "s3": {"NBEXEC_S3_BUCKET": s3.settings.bucket, "AWS_ENDPOINT_URL_S3": moto_s3.url,
               "AWS_ACCESS_KEY_ID": cloudstores.S3_KEY_ID, "AWS_SECRET_ACCESS_KEY": cloudstores.S3_SECRET},
        "gcs": {"NBEXEC_GCS_BUCKET": gcs.settings.bucket, "STORAGE_EMULATOR_HOST": gcs_emulator.url,
                "GOOGLE_APPLICATION_CREDENTIALS": str(gcs_key[0])},
    }
    for kind, env in envs.items():
        done = run_cli("run", "--upload", kind, "--json", "-", cwd=tmp_path, env=env,
                       stdin="open('/mnt/data/r.txt', 'w').write('r')\n")
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        assert fetch(data["files"][0]["url"])[1] == b"r"
        assert cloudstores.S3_SECRET not in done.stdout + done.stderr
