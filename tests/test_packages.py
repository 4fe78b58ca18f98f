"""Packages: the policy and the pip-line scan (pure), the host wheelhouse against a real index on loopback, and
real pip in the real sandbox installing offline from /mnt/wheels."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import nbexec
from nbexec import packages
from nbexec.errors import PackageError
from nbexec.packages import wheelhouse

from .conftest import IMAGE, own_children, settle
from .pyindex import Index

TARGET = wheelhouse.Target(python="3.11", machine="x86_64", glibc="2.36")
ANY = packages.Policy("any")


def _resolve(wanted: list[str], source: wheelhouse.Source) -> list[wheelhouse.Wheel]:
    return wheelhouse.resolve(wanted, ANY, TARGET, wheelhouse.Budget(source), deadline=time.monotonic() + 120)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Index]:
    served = Index(tmp_path_factory.mktemp("index"))
    served.add("nbexec-tiny", "1.0", "VALUE = 42\n", requires=("nbexec-dep>=2",))
    served.add("nbexec-dep", "2.0", "X = 2\n")
    served.add("nbexec-big", "1.0", "DATA = '" + "x" * 300_000 + "'\n")
    served.add("evil-pkg", "1.0", "raise SystemExit('never installed')\n")
    yield served
    served.close()


def _config(index: Index, cache: Path, **changes: object) -> nbexec.SandboxConfig:
    values: dict[str, object] = {"image": IMAGE, "pool_size": 0, "warm_imports": (), "timeout": 90,
                                 "package_index": index.url,
                                 "allowed_packages": ("nbexec-tiny", "nbexec-dep", "nbexec-big"),
                                 "package_cache": str(cache)}
    values.update(changes)
    return nbexec.SandboxConfig(**values)  # type: ignore[arg-type]


# -- pure: the scan and the policy ---------------------------------------------------------------------

@pytest.mark.parametrize(("line", "requirements", "skipped"), [
    ("%pip install tabulate", ("tabulate",), ()),
    ("!pip install -q 'pyarrow==17.*' polars", ("pyarrow==17.*", "polars"), ()),
    ("  !python -m pip install --upgrade seaborn", ("seaborn",), ()),
    ("pip3 install -r requirements.txt x", ("x",), ("requirements.txt",)),
    ("%pip install {name}", (), ("{name}",)),
    ("!pip install -e ./here", ("",), ("./here",)),
], ids=["magic", "bang-quoted", "python-m-indented", "requirements-file", "ipython-variable", "editable"])
def test_scan_finds_pip_lines(line: str, requirements: tuple[str, ...], skipped: tuple[str, ...]) -> None:
    (found,) = packages.scan(f"x = 1\n{line}\nprint(x)")
    assert (found.line, found.requirements, found.skipped) == (1, requirements, skipped)


@pytest.mark.parametrize("source", ["import pip", "# %pip install x", "pipx install y", "print('pip install z')",
                                    "%pipe install a"])
def test_scan_ignores_other_lines(source: str) -> None:
    assert packages.scan(source) == []


def test_the_shipped_allowlist_parses_and_covers_the_usual_libraries() -> None:
    names = {Requirement(line).name for line in packages.shipped()}
    assert {"pandas", "polars", "pyarrow", "scipy", "statsmodels", "plotly", "openpyxl", "pypdf", "nltk",
            "tabulate"} <= names
    assert len(names) == len(packages.shipped()) > 50


@pytest.mark.parametrize(("mode", "text", "refused_because"), [
    ("allowlist", "tabulate", None),
    ("allowlist", "Tabulate>=0.9", None),
    ("allowlist", "evil-pkg", "not on this nbexec's allowlist"),
    ("allowlist", "pandas @ https://example.com/pandas.whl", "only names from the package index"),
    ("allowlist", "not a requirement!", "not a valid requirement"),
    ("any", "evil-pkg", None),
    ("off", "tabulate", "turned off"),
], ids=["listed", "listed-other-spelling", "unlisted", "url", "invalid", "any", "off"])
def test_policy(mode: str, text: str, refused_because: str | None) -> None:
    policy = packages.Policy.of(nbexec.SandboxConfig(packages=mode))
    requirement, reason = policy.check(text)
    if refused_because is None:
        assert requirement is not None and reason is None
    else:
        assert requirement is None and reason is not None and refused_because in reason


def test_operator_entries_extend_the_list_and_bound_versions() -> None:
    policy = packages.Policy.of(nbexec.SandboxConfig(allowed_packages=("evil-pkg<2",)))
    assert policy.check("evil-pkg")[1] is None
    assert "evil-pkg<2" in policy.constraints()
    assert packages.Policy.of(nbexec.SandboxConfig(packages="any")).constraints() == []


# -- the host wheelhouse against a real index ----------------------------------------------------------

def test_resolve_downloads_wheels_once_and_serves_them_from_the_cache(index: Index, tmp_path: Path) -> None:
    source = wheelhouse.Source(index=index.url, max_bytes=10**7, max_count=10, cache=tmp_path / "cache")
    before, descriptors = len(index.requests), len(os.listdir("/proc/self/fd"))
    wheels = _resolve(["nbexec-tiny"], source)
    assert len(os.listdir("/proc/self/fd")) == descriptors, "the resolution left descriptors open"
    assert [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("nbexec-pip-")] == []
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert {(w.name, w.version) for w in wheels} == {("nbexec-tiny", "1.0"), ("nbexec-dep", "2.0")}
    served = index.root / "simple" / "nbexec-tiny" / "nbexec_tiny-1.0-py3-none-any.whl"
    tiny = next(w for w in wheels if w.name == "nbexec-tiny")
    assert tiny.sha256 == hashlib.sha256(served.read_bytes()).hexdigest()
    assert (tmp_path / "cache" / "blobs" / tiny.sha256).read_bytes() == served.read_bytes()
    assert os.stat(tmp_path / "cache").st_mode & 0o777 == 0o700
    asked = len(index.requests)
    assert asked > before
    assert _resolve(["nbexec-tiny"], source) == wheels
    assert len(index.requests) == asked, "the second resolution went to the index"


def test_a_download_past_the_byte_cap_is_stopped_and_nothing_is_kept(index: Index, tmp_path: Path) -> None:
    source = wheelhouse.Source(index=index.url, max_bytes=50_000, max_count=10, cache=tmp_path / "cache")
    with pytest.raises(PackageError, match="cap"):
        _resolve(["nbexec-big"], source)
    assert os.listdir(tmp_path / "cache" / "blobs") == []
    assert os.listdir(tmp_path / "cache" / "resolved") == []


@pytest.mark.parametrize("failure", ["byte-cap", "count-cap", "unknown-project", "deadline"])
def test_a_resolution_that_fails_leaves_nothing_behind(index: Index, tmp_path: Path, failure: str) -> None:
    """Whatever ends a resolution early (a cap, pip's own failure, the deadline while the index is still answering),
    it leaves no descriptor, scratch folder, cached part or process behind on the host."""
    source = wheelhouse.Source(index=index.url, max_bytes=50_000 if failure == "byte-cap" else 10**7,
                               max_count=1 if failure == "count-cap" else 10, cache=tmp_path / "cache")
    wanted = {"byte-cap": "nbexec-big", "count-cap": "nbexec-tiny", "unknown-project": "nbexec-nowhere",
              "deadline": "nbexec-slow"}[failure]
    if failure == "deadline":
        index.add("nbexec-slow", "1.0", "X = 1\n")
        reached, released = index.hold("nbexec-slow")
    descriptors, children = len(os.listdir("/proc/self/fd")), set(own_children())
    started = time.monotonic()
    try:
        with pytest.raises(PackageError):
            wheelhouse.resolve([wanted], ANY, TARGET, wheelhouse.Budget(source), deadline=started + 5)
    finally:
        if failure == "deadline":
            assert reached.is_set(), "pip never asked the index: the deadline was not what ended it"
            released.set()  # the index's handler answers the request pip left; its connection closes
            del index.held["nbexec-slow"]
    settle(lambda: len(os.listdir("/proc/self/fd")) == descriptors and set(own_children()) <= children, 10)
    assert len(os.listdir("/proc/self/fd")) == descriptors, "the resolution left descriptors open"
    assert set(own_children()) <= children, "pip is still running"
    assert [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("nbexec-pip-")] == []
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert os.listdir(tmp_path / "cache" / "resolved") == []  # no resolution is recorded
    for blob in (tmp_path / "cache" / "blobs").iterdir():  # a wheel fetched whole before the cap is cached whole
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, "a part of a download was kept"
    if failure != "count-cap":  # only the count cap comes after a whole download
        assert os.listdir(tmp_path / "cache" / "blobs") == []


def test_too_many_distributions_are_refused(index: Index, tmp_path: Path) -> None:
    source = wheelhouse.Source(index=index.url, max_bytes=10**7, max_count=1, cache=tmp_path / "cache")
    with pytest.raises(PackageError, match="max_packages"):
        _resolve(["nbexec-tiny"], source)


def test_a_tampered_cache_file_is_never_linked(index: Index, tmp_path: Path) -> None:
    source = wheelhouse.Source(index=index.url, max_bytes=10**7, max_count=10, cache=tmp_path / "cache")
    wheels = _resolve(["nbexec-dep"], source)
    blob = tmp_path / "cache" / "blobs" / wheels[0].sha256
    blob.write_bytes(b"not the wheel")
    with pytest.raises(PackageError, match="sha256"):
        wheelhouse.files(wheels, source)
    assert not blob.exists()


# -- real pip in the real sandbox ----------------------------------------------------------------------

_NO_NETWORK = """
import os, socket
print(sorted(os.listdir('/sys/class/net')))
for host, port in [({gateway!r}, {port}), ('169.254.169.254', 80), ('pypi.org', 443)]:
    try:
        socket.create_connection((host, port), timeout=3)
        print('connected', host)
    except OSError as exc:
        print('refused', host, type(exc).__name__)
try:
    open('/mnt/wheels/planted.whl', 'wb')
    print('wheels writable')
except OSError as exc:
    print('wheels read-only', exc.errno)
"""


def test_pip_lines_install_offline_and_refused_packages_are_never_downloaded(
        index: Index, tmp_path: Path, cleanup_ledger: None) -> None:
    config = _config(index, tmp_path / "cache")
    code = ("%pip install nbexec-tiny\nimport nbexec_tiny, nbexec_dep\nprint('value', nbexec_tiny.VALUE)\n"
            "%pip install evil-pkg\n")
    # The index is on the host's loopback; the sandbox reaches neither it nor the bridge gateway nor the internet.
    check = _NO_NETWORK.format(gateway="172.17.0.1", port=index.server.server_address[1])
    result = nbexec.execute_notebook(code + check, config=config)
    assert result.ok, result.error
    assert "value 42" in result.stdout
    assert "nbexec refused to install evil-pkg" in result.stderr and "allowlist" in result.stderr
    assert "['lo']" in result.stdout and "connected" not in result.stdout
    assert "wheels read-only 30" in result.stdout  # EROFS: the sandbox cannot plant a wheel for a later install
    assert index.fetched("evil-pkg") == [], "a refused package was downloaded"
    shown = {p.name: p for p in result.packages}
    assert shown["nbexec-tiny"].status == "provided" and shown["nbexec-tiny"].version == "1.0"
    assert shown["nbexec-dep"].requested is False
    assert shown["evil-pkg"].status == "refused"
    saved = json.loads(Path(result.notebook_path or "").read_text())
    assert saved["cells"][0]["source"] == code + check, "the saved notebook must keep the code as written"
    assert {p["name"] for p in saved["metadata"]["nbexec"]["packages"]} == {"nbexec-tiny", "nbexec-dep", "evil-pkg"}


def test_call_packages_install_before_the_code_and_sessions_reuse_them(
        index: Index, tmp_path: Path, cleanup_ledger: None) -> None:
    config = _config(index, tmp_path / "cache")
    result = nbexec.execute_notebook("import nbexec_tiny; print(nbexec_tiny.VALUE)", config=config,
                                     packages=["nbexec-tiny==1.0", "evil-pkg"])
    assert result.ok and result.stdout == "42\n"
    assert {(p.name, p.status) for p in result.packages} >= {("nbexec-tiny", "installed"), ("evil-pkg", "refused")}
    assert any("evil-pkg was refused" in note for note in result.notes)
    requests = len(index.requests)
    with nbexec.Session(config) as session:
        installed = session.install("nbexec-tiny==1.0")  # the same request: resolved from the cache
        assert [p.status for p in installed if p.requested] == ["installed"]
        assert session.run("import nbexec_dep; print(nbexec_dep.X)").stdout == "2\n"
        again = session.run("print(1)", packages=["nbexec-tiny==1.0"]).packages
        assert [p.status for p in again if p.requested] == ["installed"]
    assert len(index.requests) == requests, "cached wheels went to the index again"


def test_installs_off_refuse_with_a_reason(index: Index, tmp_path: Path, cleanup_ledger: None) -> None:
    config = _config(index, tmp_path / "cache", packages="off")
    before = len(index.requests)
    result = nbexec.execute_notebook("!pip install nbexec-tiny\nprint('ran')", config=config)
    assert result.ok and "ran" in result.stdout and "turned off" in result.stderr
    assert len(index.requests) == before


def test_nbexec_run_with_package_and_a_pip_line(index: Index, tmp_path: Path, cleanup_ledger: None) -> None:
    script = tmp_path / "script.py"
    script.write_text("%pip install nbexec-tiny\nimport nbexec_tiny\nprint('tiny', nbexec_tiny.VALUE)\n")
    env = {**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_PACKAGE_INDEX": index.url,
           "NBEXEC_ALLOWED_PACKAGES": "nbexec-tiny,nbexec-dep", "NBEXEC_PACKAGE_CACHE": str(tmp_path / "cache"),
           "NBEXEC_WARM_IMPORTS": ""}
    done = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", str(script), "--json", "--package",
                           "evil-pkg", "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert "tiny 42" in shown["stdout"]
    statuses = {p["name"]: p["status"] for p in shown["packages"]}
    assert (statuses["nbexec-tiny"], statuses["evil-pkg"]) == ("provided", "refused")


def test_earlier_code_cannot_crash_the_host_through_the_interpreter_description(
        index: Index, tmp_path: Path, cleanup_ledger: None) -> None:
    # A session's earlier cell makes every str display as a 100,000-deep expression, which the host parsed unsized.
    hostile = ("get_ipython().display_formatter.formatters['text/plain'].for_type(\n"
               "    str, lambda value, printer, cycle: printer.text('-' * 100_000 + '1'))")
    with nbexec.Session(_config(index, tmp_path / "cache")) as session:
        assert session.run(hostile).ok
        result = session.run("%pip install nbexec-tiny\nprint('after')")
    assert result.stdout.strip().endswith("after")
    (record,) = result.packages
    assert record.status == "failed" and "did not describe its interpreter" in (record.reason or "")


def test_the_caps_hold_for_all_the_pip_lines_of_an_execution(index: Index, tmp_path: Path,
                                                             cleanup_ledger: None) -> None:
    # Each line alone fits the caps; before, every pip line had caps of its own, so a cell of many lines had the
    # host download many times max_package_download.
    config = _config(index, tmp_path / "cache", max_packages=2)
    fetched = len(index.fetched("nbexec-big"))
    result = nbexec.execute_notebook("%pip install nbexec-tiny\n%pip install nbexec-big\n", config=config)
    shown = {p.name: p.status for p in result.packages}
    assert shown == {"nbexec-tiny": "provided", "nbexec-dep": "provided", "nbexec-big": "failed"}, shown
    assert "max_packages" in result.stderr
    assert len(index.fetched("nbexec-big")) == fetched, "a request past the execution's cap was downloaded"
    (big,) = [p for p in result.packages if p.name == "nbexec-big"]
    assert "(max_packages" in (big.reason or "")


def test_a_budget_counts_each_wheel_once_and_caps_bytes() -> None:
    source = wheelhouse.Source(index="unused", max_bytes=1000, max_count=3)
    budget = wheelhouse.Budget(source)
    wheel = wheelhouse.Wheel("a", "1", "a-1-py3-none-any.whl", "0" * 64, 600)
    budget.charge([wheel])
    budget.charge([wheel])  # the same wheel again (a shared dependency): counted once
    assert budget.remaining().max_bytes == 400
    with pytest.raises(PackageError, match="max_package_download"):
        budget.charge([wheelhouse.Wheel("b", "1", "b-1-py3-none-any.whl", "1" * 64, 500)])
