"""The in-sandbox installer: hostile wheels refused (on the host, into a scratch prefix), and in the real sandbox a
cached wheel installed without pip (its INSTALLER file says who installed it) and visible to pip and import."""

from __future__ import annotations

import stat
import sys
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



# -- exact edges (each pins what a one-character change of the installer would move) -----------------------------

def _places(root: Path) -> dict[str, str]:
    """Places with purelib and platlib apart (on Debian they are one folder), so the root scheme shows."""
    return {"purelib": str(root / "pure"), "platlib": str(root / "plat"), "scripts": str(root / "bin"),
            "data": str(root), "headers": str(root / "include")}


def _build(path: Path, members: list[tuple[str, bytes, int]], wheel: bytes = WHEEL.encode()) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("bad-1.0.dist-info/WHEEL", wheel)
        for name, content, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, content)
    return path


def _digest(content: bytes) -> str:
    import base64
    import hashlib

    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(content).digest()).decode().rstrip("=")


@pytest.mark.parametrize(("declared", "root"), [(b"true", "pure"), (b" True ", "pure"), (b"TRUE", "pure"),
                                                (b"false", "plat"), (None, "plat")])
def test_the_root_scheme_follows_root_is_purelib(tmp_path: Path, declared: bytes | None, root: str) -> None:
    wheel = WHEEL.encode().replace(b"Root-Is-Purelib: true\n", b"" if declared is None
                                   else b"Root-Is-Purelib: " + declared + b"\n") + b"X-Junk: \xff\n"  # undecodable
    _build(tmp_path / "w.whl", [("bad/x.py", b"x", stat.S_IFREG | 0o644)], wheel)
    wheelinstall.unpack(str(tmp_path / "w.whl"), _places(tmp_path))
    assert (tmp_path / root / "bad" / "x.py").read_bytes() == b"x"
    assert not (tmp_path / ({"pure": "plat", "plat": "pure"}[root]) / "bad").exists()


def test_only_the_first_64_kib_of_wheel_is_read(tmp_path: Path) -> None:
    head = "Wheel-Version: 1.0\nX-Pad: "
    line = "\nRoot-Is-Purelib: tru"
    pad = "a" * (65536 - len(head) - len(line))
    wheel = (head + pad + line + "e\n").encode() + b"\xff"  # the cap falls between "tru" and "e"
    _build(tmp_path / "w.whl", [("bad/x.py", b"x", 0o644)], wheel)
    wheelinstall.unpack(str(tmp_path / "w.whl"), _places(tmp_path))
    assert (tmp_path / "plat" / "bad" / "x.py").exists() and not (tmp_path / "pure").exists()


def test_files_modes_shebangs_and_the_record_are_exact(tmp_path: Path) -> None:
    places = _places(tmp_path)
    members = [("bad/", b"", stat.S_IFDIR | 0o755),  # a folder entry: skipped, never a member
               ("bad/x.py", b"#!python\nx", stat.S_IFREG | 0o644), ("bad/tool.sh", b"run", 0o755),
               ("bad/other-x", b"o", 0o601), ("bad/other-w", b"w", 0o602),  # any x bit alone makes it executable
               ("bad-1.0.data/scripts/cli", b"#!python\nmain()", 0o644), ("bad-1.0.dist-info/RECORD", b"junk", 0o644)]
    written = wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), places, requested=False)
    site = tmp_path / "pure"
    modes = {p: stat.S_IMODE((site / p).stat().st_mode) for p in ("bad/x.py", "bad/tool.sh", "bad/other-x",
                                                                  "bad/other-w")}
    assert modes == {"bad/x.py": 0o644, "bad/tool.sh": 0o755, "bad/other-x": 0o755, "bad/other-w": 0o644}
    assert (site / "bad" / "x.py").read_bytes() == b"#!python\nx"  # only scripts get their interpreter line
    cli = tmp_path / "bin" / "cli"
    assert cli.read_bytes() == b"#!" + sys.executable.encode() + b"\nmain()"
    assert stat.S_IMODE(cli.stat().st_mode) == 0o755
    meta = site / "bad-1.0.dist-info"
    assert not (meta / "REQUESTED").exists() and (meta / "INSTALLER").read_bytes() == b"nbexec\n"
    for name in ("INSTALLER", "RECORD", "WHEEL"):
        assert stat.S_IMODE((meta / name).stat().st_mode) == 0o644, name
    record = (meta / "RECORD").read_bytes().decode()
    rows = [line.split(",") for line in record.split("\n")[:-1]]
    assert "\r" not in record and record.endswith("\n")
    content = {"bad/x.py": b"#!python\nx", "bad/tool.sh": b"run", "bad-1.0.dist-info/WHEEL": WHEEL.encode(),
               "bad/other-x": b"o", "bad/other-w": b"w",
               "../bin/cli": cli.read_bytes(), "bad-1.0.dist-info/INSTALLER": b"nbexec\n"}
    assert rows[:-1] == [[name, _digest(data), str(len(data))] for name, data in
                         [(n, content[n]) for n in ("bad-1.0.dist-info/WHEEL", "bad/x.py", "bad/tool.sh",
                                                    "bad/other-x", "bad/other-w", "../bin/cli",
                                                    "bad-1.0.dist-info/INSTALLER")]]
    assert rows[-1] == ["bad-1.0.dist-info/RECORD", "", ""]  # the wheel's own RECORD is never taken
    assert written == [row[0] for row in rows]
    requested = tmp_path / "again"
    wheelinstall.unpack(str(tmp_path / "w.whl"), _places(requested), requested=True)
    assert (requested / "pure" / "bad-1.0.dist-info" / "REQUESTED").read_bytes() == b""


def test_console_scripts_are_written_as_pip_would(tmp_path: Path) -> None:
    entry_points = ("[gui_scripts]\ng = m:f\n[console_scripts]\n.hidden = m:f\nbad/name = m:f\nempty =  :f\n"
                    "good = pkg.mod:obj.method\nplain = pkg.mod\npercent = m:f%\na:b = m:f\n# ")
    members = [("bad-1.0.dist-info/entry_points.txt", entry_points.encode() + b"\xff\n", 0o644)]
    wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(tmp_path))
    scripts = {p.name: p.read_text() for p in (tmp_path / "bin").iterdir()}
    head = f"#!{sys.executable}\n"
    assert scripts == {
        "good": head + "import sys\nfrom pkg.mod import obj\nsys.exit(obj.method())\n",
        "plain": head + "import pkg.mod\n",
        "percent": head + "import sys\nfrom m import f%\nsys.exit(f%())\n",
        "a:b": head + "import sys\nfrom m import f\nsys.exit(f())\n",
    }  # gui_scripts are no console scripts; hidden, slashed and module-less names are skipped, never the rest
    assert all(stat.S_IMODE((tmp_path / "bin" / name).stat().st_mode) == 0o755 for name in scripts)


def test_entry_points_without_console_scripts_write_none(tmp_path: Path) -> None:
    members = [("bad-1.0.dist-info/entry_points.txt", b"[gui_scripts]\ng = m:f\n", 0o644), ("bad/x.py", b"", 0o644)]
    wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(tmp_path))  # not asked for by name
    assert not (tmp_path / "bin").exists() and (tmp_path / "pure" / "bad" / "x.py").exists()
    assert not (tmp_path / "pure" / "bad-1.0.dist-info" / "REQUESTED").exists()


def test_only_the_first_64_kib_of_entry_points_is_read(tmp_path: Path) -> None:
    text = "[console_scripts]\n" + "# " + "p" * 65507 + "\nab = m:fg\n"  # the cap falls between "f" and "g"
    members = [("bad-1.0.dist-info/entry_points.txt", text.encode(), 0o644)]
    wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(tmp_path))
    assert (tmp_path / "bin" / "ab").read_text().endswith("from m import f\nsys.exit(f())\n")


@pytest.mark.parametrize(("name", "words"), [
    ("bad//x.py", "not a plain relative file"), ("c:/x.py", "not a plain relative file"),
    ("c:x.py", "not a plain relative file"), ("/" + "x" * 300, f"{('/' + 'x' * 300)[:200]!r} is not a plain"),
    ("bad-1.0.data/" + "y" * 300, "names no scheme"), ("bad-1.0.data/purelib", "names no scheme"),
])
def test_each_refusal_says_which_member(tmp_path: Path, name: str, words: str) -> None:
    path = _build(tmp_path / "w.whl", [(name, b"x", 0o644)])
    with pytest.raises(wheelinstall.UnsafeWheel) as refused:
        wheelinstall.unpack(str(path), _places(tmp_path / "p"))
    assert words in str(refused.value)
    if "scheme" in words and len(name) > 200:
        assert repr(name[:200]) in str(refused.value) and repr(name[:201]) not in str(refused.value)
    assert not (tmp_path / "p").exists()


def test_a_wheel_without_one_dist_info_is_refused(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as archive:
        archive.writestr("a-1.dist-info/WHEEL", WHEEL)
        archive.writestr("b-1.dist-info/WHEEL", WHEEL)
    with pytest.raises(wheelinstall.UnsafeWheel,
                       match=r"^a wheel needs exactly one \.dist-info folder with a WHEEL file$"):
        wheelinstall.unpack(str(tmp_path / "w.whl"), _places(tmp_path / "p"))


@pytest.mark.parametrize("members", [
    [("bad", b"x", 0o644), ("bad/x.py", b"y", 0o644)],  # a file where a later member needs a folder
    [("bad/x.py", b"y", 0o644), ("bad", b"x", 0o644)],  # a folder where a later member is a file
    [("bad-1.0.dist-info", b"x", 0o644)],  # the file in the way of the wheel's own metadata folder
    [("bad-1.0.data/scripts/tool", b"x", 0o644), ("bad-1.0.data/scripts/tool/x", b"y", 0o644)],
    [("bad-1.0.dist-info/INSTALLER/x", b"y", 0o644)],  # in the way of the files the installer adds
    [("bad-1.0.dist-info/REQUESTED/x", b"y", 0o644)],
    [("bad-1.0.dist-info/RECORD/x", b"y", 0o644)],
], ids=["file-then-folder", "folder-then-file", "dist-info", "scripts", "installer", "requested", "record"])
def test_a_name_that_is_both_a_file_and_a_folder_is_refused_whole(tmp_path: Path,
                                                                   members: list[tuple[str, bytes, int]]) -> None:
    """Found by tests/test_fuzz_names.py: such a wheel stopped half-way with an OSError, some files written."""
    path = _build(tmp_path / "w.whl", members)
    with pytest.raises(wheelinstall.UnsafeWheel, match="both a file and a folder"):
        wheelinstall.unpack(str(path), _places(tmp_path / "p"))
    assert not (tmp_path / "p").exists(), "a refused wheel wrote something"
