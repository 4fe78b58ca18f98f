"""The distribution as a user gets it: the wheel's metadata, its declared dependencies, and a fresh virtualenv.

The install test builds the wheel, installs it with the mcp extra into a new virtualenv in a temporary folder (no
system site-packages, nothing from the checkout: dependencies come from pip's index and cache, about 20 s here),
then runs that virtualenv's `nbexec doctor` and `nbexec run` from a folder outside the checkout, with no PYTHONPATH.
"""

from __future__ import annotations

import ast
import email.parser
import json
import os
import re
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from nbexec.sandbox.docker import daemon

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "nbexec-sandbox"
IMAGE = os.environ.get("NBEXEC_IMAGE", "nbexec-jupyter:latest")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required(wheel_metadata: email.message.Message) -> set[str]:
    """Distribution names the wheel requires, with or without an extra."""
    return {_normal(re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0]) for r in wheel_metadata.get_all("Requires-Dist", [])}


def _outside_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing that points Python at the checkout or another venv."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("NBEXEC_")}
    env.update(NBEXEC_IMAGE=IMAGE, **extra)
    return env


def _run(args: list[str | Path], cwd: Path, timeout: float, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=_outside_env(**extra), capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("the packaging tests need `build` (the test extra: pip install -e '.[test]')", pytrace=False)
    done = _run([sys.executable, "-m", "build", "--wheel", "--outdir", out, ROOT], cwd=out, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (found,) = out.glob("*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))


def test_wheel_passes_twine_check(wheel: Path) -> None:
    """The check PyPI's upload does (twine check --strict: metadata fields and a README that renders)."""
    done = _run([sys.executable, "-m", "twine", "check", "--strict", wheel], cwd=wheel.parent, timeout=300)
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr


def test_wheel_metadata_and_files(wheel: Path, wheel_metadata: email.message.Message) -> None:
    assert wheel_metadata["Name"] == DISTRIBUTION
    assert wheel_metadata["License-Expression"] == "MIT"
    assert "Typing :: Typed" in wheel_metadata.get_all("Classifier", [])
    requires = _required(wheel_metadata)
    assert {"requests", "python-dotenv", "docker", "click"} <= requires
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "nbexec/py.typed" in names
    assert "nbexec/environment/Dockerfile" in names  # `nbexec image build` works from the wheel
    assert {f"nbexec/environment/{n}" for n in ("named.Dockerfile", "nbexec_display.py", "nbexec_display.pth")} <= names
    assert {f"nbexec/service/playground/{n}" for n in ("index.html", "playground.js", "playground.css")} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert re.search(r"^nbexec = nbexec\.cli\.main:main$", entry_points, re.MULTILINE)
    for extra in ("azure", "s3", "gcs", "server", "mcp", "langchain", "test", "dev"):
        assert extra in wheel_metadata.get_all("Provides-Extra", []), extra


def _imported_top_modules(wheel: Path) -> dict[str, str]:
    """Top-level modules the shipped nbexec/*.py import, each with one file that imports it.

    nbexec/environment/ is the runtime image's build context: it runs in the sandbox, with the image's packages."""
    found: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not (name.startswith("nbexec/") and name.endswith(".py")) or name.startswith("nbexec/environment/"):
                continue
            for node in ast.walk(ast.parse(archive.read(name), name)):
                if isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    found.setdefault(top, name)
    return {m: f for m, f in found.items() if m not in sys.stdlib_module_names and m != "nbexec"}


def test_every_third_party_import_is_declared(wheel: Path, wheel_metadata: email.message.Message) -> None:
    """Each module nbexec imports comes from a distribution it declares, as a dependency or in an extra."""
    declared = _required(wheel_metadata)
    providers = metadata.packages_distributions()
    undeclared = []
    for module, where in sorted(_imported_top_modules(wheel).items()):
        if module not in providers:
            pytest.fail(f"{where} imports {module}, which is not installed here, so its distribution is unknown "
                        "(install the test extra)", pytrace=False)
        if not {_normal(d) for d in providers[module]} & declared:
            undeclared.append(f"{module} ({where}; from {', '.join(providers[module])})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


@pytest.fixture
def node_name() -> Iterator[str]:
    """A node name of its own, so the containers the installed nbexec makes can be found and must be gone."""
    name = f"pk-{uuid.uuid4().hex[:12]}"
    yield name
    client = daemon.connect()
    left = client.containers.list(all=True, sparse=True, filters={"label": f"{daemon.LABEL_NODE}={name}"})
    for container in left:
        container.remove(force=True)
    assert not left, f"the installed nbexec left containers: {[c.id for c in left]}"


def test_fresh_virtualenv_runs_doctor_and_code(wheel: Path, tmp_path: Path, docker_ready: None,
                                               node_name: str) -> None:
    assert not tmp_path.is_relative_to(ROOT)
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    made = _run([sys.executable, "-m", "venv", venv], cwd=work, timeout=300)
    assert made.returncode == 0, f"creating a virtualenv failed (python3-venv missing?): {made.stderr}"
    installed = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}[mcp]"], cwd=work,
                     timeout=900)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    where = _run([venv / "bin" / "python", "-c", "import nbexec, nbexec.integrations.mcp; print(nbexec.__file__)"],
                 cwd=work, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's copy, not the checkout

    doctor = _run([venv / "bin" / "nbexec", "doctor"], cwd=work, timeout=300, NBEXEC_NODE_NAME=node_name)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok   Docker engine" in doctor.stdout and f"ok   image {IMAGE}" in doctor.stdout, doctor.stdout

    (work / "tiny.py").write_text("print(6 * 7)\nopen('/mnt/data/answer.txt', 'w').write('42')\n")
    ran = _run([venv / "bin" / "nbexec", "run", "tiny.py", "--json"], cwd=work, timeout=300,
               NBEXEC_NODE_NAME=node_name, NBEXEC_POOL_SIZE="0")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    result = json.loads(ran.stdout)
    assert result["ok"] is True and result["stdout"] == "42\n", result
    assert [f["name"] for f in result["files"]] == ["answer.txt"], result["files"]
    assert Path(result["output_dir"]).is_relative_to(work)
    assert (Path(result["output_dir"]) / "data" / "answer.txt").read_text() == "42"


_OLD_NAME = re.compile(r"(?<![\w/-])nbexec\[|pip install [\"']?nbexec(?![\w-])|[\"']nbexec @ ")


def test_install_hints_name_the_distribution() -> None:
    """Every install hint names nbexec-sandbox: `pip install 'nbexec[...]'` installs an unrelated project."""
    places = [*ROOT.glob("nbexec/**/*.py"), *ROOT.glob("examples/**/*"), *ROOT.glob("deploy/*"), ROOT / "README.md",
              *ROOT.glob("docs/**/*.md"),
              ROOT / ".env.example", ROOT / "pyproject.toml", *ROOT.glob("scripts/*.sh")]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in places if path.is_file() and path.suffix not in {".png", ".ipynb"}
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if _OLD_NAME.search(line)]
    assert not found, "install hints with the old name:\n" + "\n".join(found)


def _source_imports() -> set[str]:
    """Top-level modules the package's source imports (nbexec/environment/ runs in the sandbox: left out)."""
    found = set()
    for path in (ROOT / "nbexec").rglob("*.py"):
        if "environment" in path.relative_to(ROOT / "nbexec").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_every_declared_dependency_is_imported() -> None:
    """Each distribution in [project].dependencies provides a module the package imports (none is dead weight)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block, "pyproject.toml has no [project] dependencies list"
    declared = {_normal(re.split(r"[ ;<>=!~\[]", d, maxsplit=1)[0]) for d in re.findall(r'^\s*"([^"]+)"', block[1],
                                                                                         re.M)}
    assert declared, "no dependency parsed"
    providers = metadata.packages_distributions()
    used = {_normal(dist) for module in _source_imports() for dist in providers.get(module, [])}
    assert declared - used == set(), f"declared but never imported by nbexec: {sorted(declared - used)}"
