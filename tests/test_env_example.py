"""`.env.example` against the code: every variable nbexec reads is listed there, and `.env` is loaded right."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbexec.cli import envfile
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
# A literal variable name read from the environment in Python source (os.environ / os.getenv / click's envvar).
_READ = re.compile(
    r"""(?:environ\.get\(|environ\[|getenv\(|environ\.setdefault\(|envvar=)\s*f?["']([A-Z][A-Z0-9_]*)["']"""
)
# Reads that no literal shows: libraries nbexec calls read these.
_IMPLICIT = {
    "docker.from_env(": {"DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"},
    "tempfile.": {"TMPDIR"},
}
# Read by the SDKs the examples use, not by a line of ours.
_SDK_READ = {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}
# Shipped into the sandbox and run there: they read the sandbox's environment, never the operator's.
_IN_SANDBOX = {"nbexec/engine/judgerunner.py", "nbexec/engine/judgechecker.py", "nbexec/engine/judgeinit.py",
               "nbexec/engine/judgereset.py", "nbexec/engine/judgefork.py", "nbexec/engine/judgecompare.py",
               "nbexec/engine/judgeprocess.py"}
_DOCUMENTED = re.compile(r"^#?\s*([A-Z][A-Z0-9_]*)(=|<NAME>=)", re.MULTILINE)


def _sources(*folders: str, pattern: str = "*.py") -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for f in folders for p in sorted((ROOT / f).rglob(pattern)) if p.is_file()}


def read_by_code() -> set[str]:
    """Every variable nbexec (and its examples) reads, from the source text and the config's fields."""
    names = {f"NBEXEC_{f.name.upper()}" for f in dataclasses.fields(SandboxConfig) if f.name != "env"}
    names.add("NBEXEC_ENV_")  # the prefix: NBEXEC_ENV_<NAME> passes NAME into the sandbox
    for path, text in _sources("nbexec", "examples").items():
        if str(path.relative_to(ROOT)) in _IN_SANDBOX:
            continue
        names.update(_READ.findall(text))
        names.update(v for marker, found in _IMPLICIT.items() if marker in text for v in found)
    return names


def documented() -> set[str]:
    text = (ROOT / ".env.example").read_text(encoding="utf-8")
    return {name for name, _ in _DOCUMENTED.findall(text)}


def test_every_variable_the_code_reads_is_in_env_example() -> None:
    missing = sorted(read_by_code() - documented())
    assert not missing, f".env.example lacks {missing}: add each with its default and what it does"


def test_env_example_lists_no_variable_nothing_reads() -> None:
    shell = "\n".join(_sources("scripts", ".ci", pattern="*").values())
    stale = sorted(n for n in documented() - read_by_code() - _SDK_READ if not re.search(rf"\b{n}\b", shell))
    assert not stale, f".env.example lists {stale}, which no code, script or SDK reads"


def test_env_file_fills_gaps_and_never_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text(
        "# comment\nPK_ONLY_IN_FILE=from-file\nPK_ALREADY_SET=from-file\nPK_EMPTY_IN_ENV=from-file\n"
        "export PK_EXPORTED='quoted value'\nPK_REF=${PK_ALREADY_SET}-ref\n", encoding="utf-8")
    monkeypatch.setenv("PK_ALREADY_SET", "from-env")
    monkeypatch.setenv("PK_EMPTY_IN_ENV", "")
    for name in ("PK_ONLY_IN_FILE", "PK_EXPORTED", "PK_REF"):
        monkeypatch.delenv(name, raising=False)
    set_names = envfile.load(tmp_path)
    assert set_names == ["PK_EXPORTED", "PK_ONLY_IN_FILE", "PK_REF"]
    assert os.environ["PK_ONLY_IN_FILE"] == "from-file"
    assert os.environ["PK_ALREADY_SET"] == "from-env"
    assert os.environ["PK_EMPTY_IN_ENV"] == ""
    assert os.environ["PK_EXPORTED"] == "quoted value"
    assert os.environ["PK_REF"] == "from-env-ref"  # the real environment wins inside the file too


def test_no_env_file_is_no_error(tmp_path: Path) -> None:
    assert envfile.load(tmp_path) == []


@pytest.mark.parametrize("make", [
    pytest.param(lambda p: p.mkdir(), id="a-folder"),
    pytest.param(lambda p: p.write_bytes(b"A=" + b"x" * envfile.MAX_BYTES), id="over-the-cap"),
    pytest.param(lambda p: p.write_bytes(b"A=\xff\xfe\n"), id="not-utf8"),
    pytest.param(lambda p: os.mkfifo(p), id="a-fifo"),
    pytest.param(lambda p: (p.write_text("NBEXEC_NETWORK=1\n"), p.chmod(0o666)), id="world-writable"),
    pytest.param(lambda p: (p.write_text("NBEXEC_NETWORK=1\n"), os.chown(p, os.getuid() + 4242, -1)),
                 id="another-users"),
])
def test_odd_env_file_is_a_config_error(tmp_path: Path, make: object) -> None:
    make(tmp_path / ".env")  # type: ignore[operator]
    with pytest.raises(ConfigError, match=r"\.env"):
        envfile.load(tmp_path)


def _cli(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from nbexec.cli.main import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.usefixtures("docker_ready")  # doctor prints the policy once the engine answers
def test_cli_reads_env_file_of_the_current_folder(tmp_path: Path) -> None:
    """`.env` of the folder nbexec runs in sets the policy `nbexec doctor` prints; the real environment wins."""
    (tmp_path / ".env").write_text("NBEXEC_MEMORY=777m\nNBEXEC_CPUS=0.5\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBEXEC_")}
    env.update(PYTHONPATH=str(ROOT), NBEXEC_CPUS="0.25")
    done = _cli(tmp_path, "doctor", env=env)
    assert "policy:" in done.stdout, done.stdout + done.stderr
    assert "memory='777m'" in done.stdout and "cpus=0.25" in done.stdout, done.stdout


def test_cli_bad_env_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / ".env").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = _cli(tmp_path, "doctor", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ".env is a folder" in done.stderr
    assert "Traceback" not in done.stderr
