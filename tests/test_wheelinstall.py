"""The in-sandbox installer: hostile wheels refused (on the host, into a scratch prefix), and in the real sandbox a
cached wheel installed without pip (its INSTALLER file says who installed it) and visible to pip and import."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path

import pytest

import nbexec
from nbexec.packages import wheelinstall

from .conftest import IMAGE
from .pyindex import Index

WHEEL = "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _wheel(folder: Path, members: dict[str, str], *, link: str | None = None) -> Path:
    path = folder / "bad-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("bad-1.0.dist-info/WHEEL", WHEEL)
        archive.writestr("bad-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: bad\nVersion: 1.0\n")
        for name, text in members.items():
            archive.writestr(name, text)
        if link is not None:
            info = zipfile.ZipInfo(link)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, "/etc/passwd")
    return path


@pytest.mark.parametrize("members", [
    {"/tmp/owned.py": "x"},
    {"bad/../../../owned.py": "x"},
    {"bad\\..\\owned.py": "x"},
    {"bad-1.0.data/elsewhere/owned.py": "x"},
    {"bad-1.0.data/purelib": "x"},
    {"bad/./x.py": "x"},
], ids=["absolute", "dot-dot", "backslash", "unknown-scheme", "scheme-without-file", "dot"])
def test_a_wheel_that_writes_outside_its_places_is_refused_whole(members: dict[str, str], tmp_path: Path) -> None:
    places = wheelinstall.paths(str(tmp_path / "prefix"))
    with pytest.raises(wheelinstall.UnsafeWheel):
        wheelinstall.unpack(str(_wheel(tmp_path, {"bad/__init__.py": "", **members})), places)
    assert not (tmp_path / "prefix").exists(), "a refused wheel wrote something"
    assert not (tmp_path / "owned.py").exists()


def test_links_and_duplicates_are_refused(tmp_path: Path) -> None:
    places = wheelinstall.paths(str(tmp_path / "prefix"))
    with pytest.raises(wheelinstall.UnsafeWheel, match="not a plain relative file"):
        wheelinstall.unpack(str(_wheel(tmp_path, {}, link="bad/passwd")), places)
    twice = _wheel(tmp_path, {"bad/x.py": "1"})
    with zipfile.ZipFile(twice, "a") as archive, pytest.warns(UserWarning, match="Duplicate name"):
        archive.writestr("bad/x.py", "2")
    with pytest.raises(wheelinstall.UnsafeWheel, match="twice"):
        wheelinstall.unpack(str(twice), places)


def test_a_wheel_is_unpacked_with_its_record_scripts_and_data(tmp_path: Path) -> None:
    places = wheelinstall.paths(str(tmp_path / "prefix"))
    path = _wheel(tmp_path, {"bad/__init__.py": "V = 1\n", "bad-1.0.data/scripts/tool": "#!python\nprint(1)\n",
                             "bad-1.0.data/data/share/bad.txt": "data",
                             "bad-1.0.dist-info/entry_points.txt": "[console_scripts]\nbad-cli = bad:main\n"})
    written = wheelinstall.unpack(str(path), places, requested=True)
    site = Path(places["purelib"])
    assert (site / "bad" / "__init__.py").read_text() == "V = 1\n"
    assert (tmp_path / "prefix" / "share" / "bad.txt").read_text() == "data"
    tool = Path(places["scripts"]) / "tool"
    assert tool.read_text().startswith("#!/") and tool.stat().st_mode & 0o111
    assert "from bad import main" in (Path(places["scripts"]) / "bad-cli").read_text()
    meta = site / "bad-1.0.dist-info"
    assert (meta / "INSTALLER").read_text() == "nbexec\n" and (meta / "REQUESTED").exists()
    record = (meta / "RECORD").read_text()
    assert "bad/__init__.py,sha256=" in record and "../../../bin/tool,sha256=" in record
    assert set(written) == {line.split(",")[0] for line in record.splitlines()}


def test_a_cached_wheel_installs_without_pip_in_the_sandbox(tmp_path: Path, cleanup_ledger: None) -> None:
    served = Index(tmp_path / "index")
    try:
        served.add("nbexec-tiny", "1.0", "VALUE = 42\n", requires=("nbexec-dep>=2",))
        served.add("nbexec-dep", "2.0", "X = 2\n")
        config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=90, packages="any",
                                      package_index=served.url, package_cache=str(tmp_path / "cache"))
        code = ("%pip install nbexec-tiny\nimport importlib.metadata as m, nbexec_tiny, subprocess, sys\n"
                "print(nbexec_tiny.VALUE, m.distribution('nbexec-tiny').read_text('INSTALLER').strip(),\n"
                "      m.distribution('nbexec-dep').read_text('INSTALLER').strip())\n"
                "shown = subprocess.run([sys.executable, '-m', 'pip', 'list', '--path', '/mnt/packages/lib/python'\n"
                "    + '%d.%d' % sys.version_info[:2] + '/site-packages'], capture_output=True, text=True).stdout\n"
                "print('listed' if 'nbexec-tiny' in shown and 'nbexec-dep' in shown else shown)\n")
        result = nbexec.execute_notebook(code, config=config)
        assert result.ok, result.error
        assert "Successfully installed nbexec-tiny-1.0 nbexec-dep-2.0" in result.stdout \
            or "Successfully installed nbexec-dep-2.0 nbexec-tiny-1.0" in result.stdout
        assert "42 nbexec nbexec\n" in result.stdout and "listed" in result.stdout
        with nbexec.Session(config) as session:
            done = session.install("nbexec-tiny")
            assert {p.name: p.status for p in done} == {"nbexec-tiny": "installed", "nbexec-dep": "provided"}
            shown = session.run("import importlib.metadata as m\nprint(m.distribution('nbexec-tiny')"
                                ".read_text('INSTALLER').strip())")
            assert shown.stdout == "nbexec\n"
    finally:
        served.close()

