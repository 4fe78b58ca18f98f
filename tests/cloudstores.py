"""Real local servers of the S3 and GCS APIs, started like Azurite: moto's S3 server (open, and with IAM
authentication on, which checks every signed request's key and signature) and gcp-storage-emulator, each a
subprocess on a free loopback port; and a freshly made service-account key to sign GCS links with."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .azurite import free_port

# moto accepts any key pair while IAM authentication is off; these are placeholders, not secrets.
S3_KEY_ID = "AKIANBEXECTESTKEY001"
S3_SECRET = "nbexec-test-secret-0123456789abcdefghijkl"


def _binary(name: str) -> str:
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is needed: pip install -e '.[test]'")
    return found


def _wait(process: subprocess.Popen[bytes], port: int, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with code {process.returncode}") from None
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{what} did not start within 60 s")


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_moto() -> Server:
    port = free_port()
    process = subprocess.Popen([_binary("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(process, port, "moto_server")
    return Server(process, port)


def s3_client(url: str, key_id: str = S3_KEY_ID, secret: str = S3_SECRET) -> object:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, aws_access_key_id=key_id, aws_secret_access_key=secret,
                        region_name="us-east-1", config=Config(signature_version="s3v4"))


def make_bucket(url: str, name: str, key_id: str = S3_KEY_ID, secret: str = S3_SECRET) -> None:
    s3_client(url, key_id, secret).create_bucket(Bucket=name)  # type: ignore[attr-defined]


def enable_moto_auth(url: str) -> tuple[str, str]:
    """Make an IAM user allowed s3:* and its key pair, then turn IAM authentication on: from here every
    header-signed request must carry that key and a valid signature. Returns (key id, secret)."""
    import boto3
    import requests

    iam = boto3.client("iam", endpoint_url=url, aws_access_key_id=S3_KEY_ID, aws_secret_access_key=S3_SECRET,
                       region_name="us-east-1")
    iam.create_user(UserName="nbexec")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="nbexec", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="nbexec")["AccessKey"]
    requests.post(f"{url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    return key["AccessKeyId"], key["SecretAccessKey"]


def start_gcs() -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    process = subprocess.Popen([_binary("gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port",
                                str(port), "--in-memory", "-q"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    _wait(process, port, "gcp-storage-emulator")
    return Server(process, port)


def gcs_bucket(url: str, name: str) -> None:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="nbexec", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": url})
    client.create_bucket(name)


def service_account_key(folder: Path) -> tuple[Path, bytes]:
    """A new RSA service-account key file (0600) and its public key (PEM), to sign links and check them."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    info = {"type": "service_account", "project_id": "nbexec-test", "private_key_id": "k1", "private_key": private,
            "client_email": "uploader@nbexec-test.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": "https://oauth2.googleapis.com/token"}
    path = folder / "service-account.json"
    path.write_text(json.dumps(info))
    path.chmod(0o600)
    return path, public
