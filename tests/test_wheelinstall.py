"""The in-sandbox installer: hostile wheels refused (on the host, into a scratch prefix), and in the real sandbox a
cached wheel installed without pip (its INSTALLER file says who installed it) and visible to pip and import."""

from __future__ import annotations

import stat
import sys
import types
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
    assert (Path(places["scripts"]) / "bad-cli").read_text() == _launcher("bad", "main", "main")
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
    expected = [[name, _digest(data), str(len(data))] for name, data in content.items()]
    expected.append(["bad-1.0.dist-info/RECORD", "", ""])  # the wheel's own RECORD is never taken
    # pypa/installer's RECORD: one row per file written, sorted by the path within its scheme
    assert rows == sorted(expected, key=lambda row: row[0].removeprefix("../bin/"))
    assert sorted(written) == sorted(row[0] for row in rows)
    requested = tmp_path / "again"
    wheelinstall.unpack(str(tmp_path / "w.whl"), _places(requested), requested=True)
    assert (requested / "pure" / "bad-1.0.dist-info" / "REQUESTED").read_bytes() == b""


def _launcher(module: str, name: str, call: str) -> str:
    """pypa/installer's posix launcher."""
    return (f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom {module} import {name}\n"
            'if __name__ == "__main__":\n    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])\n'
            f"    sys.exit({call}())\n")


def test_console_scripts_are_written_as_pip_would(tmp_path: Path) -> None:
    entry_points = ("[gui_scripts]\ng = m:f\n[console_scripts]\n.hidden = m:f\nbad/name = m:f\nempty =  :f\n"
                    "good = pkg.mod:obj.method\nplain = pkg.mod\npercent = m:f%\na:b = m:f\nspaced =  m : f \n"
                    "back\\slash = m:f\nextras = m:f [x]\nXtool = m:f\n# ")
    members = [("bad-1.0.dist-info/entry_points.txt", entry_points.encode() + b"\xff\n", 0o644)]
    wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(tmp_path))
    scripts = {p.name: p.read_text() for p in (tmp_path / "bin").iterdir()}
    assert scripts == {"good": _launcher("pkg.mod", "obj", "obj.method"), "a:b": _launcher("m", "f", "f"),
                       "spaced": _launcher("m", "f", "f"), "Xtool": _launcher("m", "f", "f")}
    # gui_scripts are no console scripts; hidden, slashed and module-less names are skipped, and so are references
    # that are not module:attr (no callable, a "%", extras): pypa/installer would stop half-way on them
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
    assert (tmp_path / "bin" / "ab").read_text() == _launcher("m", "f", "f")


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
    [("bad-1.0.dist-info/entry_points.txt", b"[console_scripts]\ntool = m:f\n", 0o644),
     ("bad-1.0.data/scripts/tool/x", b"y", 0o644)],  # a launcher in the way of a data script's folder
    [("bad-1.0.data/purelib/bad", b"x", 0o644), ("bad/x.py", b"y", 0o644)],  # through the data folder into the root
], ids=["file-then-folder", "folder-then-file", "dist-info", "scripts", "installer", "requested", "record", "launcher",
        "data-into-root"])
def test_a_name_that_is_both_a_file_and_a_folder_is_refused_whole(tmp_path: Path,
                                                                   members: list[tuple[str, bytes, int]]) -> None:
    """Found by tests/test_fuzz_names.py: such a wheel stopped half-way with an OSError, some files written."""
    path = _build(tmp_path / "w.whl", members)
    with pytest.raises(wheelinstall.UnsafeWheel, match="both a file and a folder"):
        wheelinstall.unpack(str(path), _places(tmp_path / "p"))
    assert not (tmp_path / "p").exists(), "a refused wheel wrote something"


# -- pypa/installer behind nbexec's checks (issue #25, point 6) ---------------------------------------------------

@pytest.mark.parametrize("planted", ["pure/bad/x.py", "bin/tool", "bin/cli", "pure/bad-1.0.dist-info/INSTALLER",
                                     "pure/bad-1.0.dist-info/RECORD"],
                         ids=["member", "data-script", "launcher", "installer", "record"])
def test_no_write_follows_a_link_planted_in_the_prefix(tmp_path: Path, planted: str) -> None:
    """pypa/installer's own destination opens with open("wb"): it would write through a link earlier code left in
    /mnt/packages. nbexec's destination refuses to (O_NOFOLLOW) and the file the link names keeps its bytes."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    root = tmp_path / "prefix"
    (root / planted).parent.mkdir(parents=True)
    (root / planted).symlink_to(outside)
    members = [("bad/x.py", b"x", 0o644), ("bad-1.0.data/scripts/tool", b"#!python\nt", 0o755),
               ("bad-1.0.dist-info/entry_points.txt", b"[console_scripts]\ncli = bad:main\n", 0o644)]
    with pytest.raises(OSError):
        wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(root))
    assert outside.read_bytes() == b"precious" and (root / planted).is_symlink()


def _as_the_kernel_loads_it() -> types.ModuleType:
    """This module's source run as the kernel runs it: in a fresh module that is not in sys.modules."""
    module = types.ModuleType("_nbexec_wheels_unregistered")
    exec(compile(Path(wheelinstall.__file__).read_text(), "<nbexec-wheels>", "exec"), module.__dict__)
    return module


def test_an_image_without_pypa_installer_installs_with_pip_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An image built before pypa/installer was in it: the kernel's import fails, pip (offline, the sandbox's
    PIP_* settings) installs the cached wheels instead, and the output says so."""
    from .pyindex import make_wheel

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    made = make_wheel(wheels, "nbexec-hidden", "1.0", "V = 7\n")
    monkeypatch.setitem(sys.modules, "installer", None)  # import installer raises ImportError
    for name, value in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_NO_CACHE_DIR": "1",
                        "PIP_PREFIX": str(tmp_path / "prefix"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}.items():
        monkeypatch.setenv(name, value)
    module = _as_the_kernel_loads_it()
    said = module.install(["nbexec-hidden"], [[made.name, "nbexec-hidden", "1.0"]], folder=str(wheels),
                          prefix=str(tmp_path / "prefix"))
    assert said.startswith(f"pip ({wheelinstall.NO_INSTALLER}): ") and wheelinstall.NO_INSTALLER in \
        capsys.readouterr().err
    site = Path(wheelinstall.paths(str(tmp_path / "prefix"))["purelib"])
    assert (site / "nbexec_hidden" / "__init__.py").read_text() == "V = 7\n"
    assert (site / "nbexec_hidden-1.0.dist-info" / "INSTALLER").read_text() == "pip\n"


@pytest.mark.parametrize("version", [b"2.0", b"", None, b"10.1", b" 0.9"], ids=["2.0", "empty", "missing", "10.1",
                                                                               "0.9"])
def test_a_wheel_of_another_wheel_version_is_refused_whole(tmp_path: Path, version: bytes | None) -> None:
    """Deliberate change: a wheel that is not Wheel-Version 1.x is refused (pip and pypa/installer refuse it too)."""
    wheel = WHEEL.encode().replace(b"Wheel-Version: 1.0\n", b"" if version is None
                                   else b"Wheel-Version: " + version + b"\n")
    path = _build(tmp_path / "w.whl", [("bad/x.py", b"x", 0o644)], wheel)
    with pytest.raises(wheelinstall.UnsafeWheel, match=r"no Wheel-Version 1\.x wheel"):
        wheelinstall.unpack(str(path), _places(tmp_path / "p"))
    assert not (tmp_path / "p").exists(), "a refused wheel wrote something"


def test_bytecode_a_wheel_ships_in_pycache_is_not_installed(tmp_path: Path) -> None:
    """A .pyc beside its source is run instead of it: a wheel could ship code its source does not show.
    pypa/installer skips __pycache__ members (with a warning); the rest installs."""
    members = [("bad/x.py", b"X = 1\n", 0o644), ("bad/__pycache__/x.cpython-311.pyc", b"evil", 0o644)]
    with pytest.warns(RuntimeWarning, match=r"__pycache__/x\.cpython-311\.pyc from bad-1\.0\."):
        written = wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(tmp_path))
    assert (tmp_path / "pure" / "bad" / "x.py").exists() and not (tmp_path / "pure" / "bad" / "__pycache__").exists()
    assert not any("__pycache__" in row for row in written)


@pytest.mark.parametrize("record", [b"\xff\x00junk", b"", b"bad/x.py,sha256=AAAA,1\n../../../owned.py,sha256=x,3\n",
                                    b'"unclosed,\n' * 3], ids=["binary", "empty", "lies", "bad-csv"])
def test_the_wheels_own_record_is_never_read(tmp_path: Path, record: bytes) -> None:
    """pypa/installer's WheelFile reads RECORD (and stops on a malformed one); nbexec's source never does: what it
    says changes nothing, and the RECORD written lists what was written, with the true digests."""
    members = [("bad/x.py", b"X = 1\n", 0o644), ("bad-1.0.dist-info/RECORD", record, 0o644)]
    wheelinstall.unpack(str(_build(tmp_path / "w.whl", members)), _places(tmp_path / "p"))
    rows = (tmp_path / "p" / "pure" / "bad-1.0.dist-info" / "RECORD").read_text().splitlines()
    assert f"bad/x.py,{_digest(b'X = 1' + bytes([10]))},6" in rows and len(rows) == 4  # x.py, WHEEL, INSTALLER, RECORD
    assert not list(tmp_path.rglob("owned.py"))


def test_the_module_installs_as_the_kernel_loads_it(tmp_path: Path) -> None:
    """The kernel runs this module's source in a module not (yet) in sys.modules: nothing in it may need to be
    (a @dataclass did, and every install in the sandbox failed)."""
    _as_the_kernel_loads_it().unpack(str(_build(tmp_path / "w.whl", [("bad/x.py", b"X", 0o644)])), _places(tmp_path))
    assert (tmp_path / "pure" / "bad" / "x.py").read_bytes() == b"X"


def test_a_big_member_is_recorded_with_its_whole_size(tmp_path: Path) -> None:
    big = bytes(range(256)) * 700  # 179,200 bytes: several blocks of the copy
    _build(tmp_path / "w.whl", [("bad/big.bin", big, 0o644)])
    wheelinstall.unpack(str(tmp_path / "w.whl"), _places(tmp_path))
    assert (tmp_path / "pure" / "bad" / "big.bin").read_bytes() == big
    rows = (tmp_path / "pure" / "bad-1.0.dist-info" / "RECORD").read_text().splitlines()
    assert f"bad/big.bin,{_digest(big)},{len(big)}" in rows


def test_a_refused_wheel_version_is_shown_to_20_characters(tmp_path: Path) -> None:
    version = "2" + "0123456789" * 3
    _build(tmp_path / "w.whl", [("bad/x.py", b"x", 0o644)], WHEEL.encode().replace(b"1.0", version.encode(), 1))
    with pytest.raises(wheelinstall.UnsafeWheel) as refused:
        wheelinstall.unpack(str(tmp_path / "w.whl"), _places(tmp_path / "p"))
    assert f"({version[:20]!r})" in str(refused.value)


@pytest.mark.parametrize(("name", "where", "scheme"), [
    ("bad/x.py", "pure/bad/x.py", "purelib"), ("bad-1.0.data/scripts/sub/t", "bin/sub/t", "scripts"),
    ("bad-1.0.data/platlib/m.so", "plat/m.so", "platlib"), ("bad-1.0.data/data/share/f", "share/f", "data"),
    ("bad-1.0.data/headers/h.h", "include/h.h", "headers")])
def test_each_member_is_placed_in_its_scheme(tmp_path: Path, name: str, where: str, scheme: str) -> None:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    assert wheelinstall.target(name, info, "bad-1.0.dist-info", _places(tmp_path), "purelib") == \
        (str(tmp_path / where), scheme)
