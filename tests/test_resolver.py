"""The breadth-first resolver (`nbexec.packages.resolver`) against scripted indexes (it is pure: fetching is a
function it is given), the METADATA reader against hostile text, and the resolver child's bounded read of a
wheel's METADATA (`nbexec.packages.pipchild.describe`)."""

from __future__ import annotations

import contextlib
import hashlib
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from nbexec.errors import PackageError, PackageRefusedError
from nbexec.packages import Policy, pipchild, resolver
from nbexec.packages.wheelhouse import Target

ENVIRONMENT = Target(python="3.11", machine="x86_64", glibc="2.36", python_full="3.11.2").markers()
ANY = Policy("any")


class Index:
    """A scripted index: project -> version -> dependency lines; records every round asked of it."""

    def __init__(self, projects: dict[str, dict[str, tuple[str, ...]]], extras: tuple[str, ...] = ()) -> None:
        self.projects = projects
        self.extras = frozenset(extras)  # every project declares these
        self.rounds: list[list[str]] = []

    def fetch(self, lines: list[str]) -> list[resolver.Fetched]:
        self.rounds.append(lines)
        found = []
        for line in lines:
            requirement = Requirement(line)
            versions = [v for v in self.projects.get(requirement.name, {})
                        if requirement.specifier.contains(v, prereleases=True)]
            if not versions:
                raise PackageError(f"no version of {line}")
            best = max(versions, key=Version)
            found.append(resolver.Fetched(f"{requirement.name.replace('-', '_')}-{best}-py3-none-any.whl",
                                          requirement.name, best, self.projects[requirement.name][best],
                                          self.extras))
        return found


def _resolve(index: Index, *roots: str, policy: Policy = ANY) -> list[tuple[str, str]]:
    found = resolver.resolve([Requirement(r) for r in roots], policy, ENVIRONMENT, index.fetch, max_rounds=12)
    return [(f.name, f.version) for f in found]


def test_each_level_is_one_round_and_dependencies_are_read_before_they_are_fetched() -> None:
    index = Index({"a": {"1": ("b", "c>=2")}, "b": {"1": ("d",)}, "c": {"1": (), "2": ()}, "d": {"1": ()}})
    assert _resolve(index, "a") == [("a", "1"), ("b", "1"), ("c", "2"), ("d", "1")]
    assert index.rounds == [["a"], ["b", "c>=2"], ["d"]]


def test_a_tighter_requirement_found_later_fetches_again_and_the_old_version_is_dropped() -> None:
    index = Index({"a": {"1": ("b",)}, "b": {"1": ("c<2",)}, "c": {"1": (), "2": ("gone",)}, "x": {"1": ("c",)}})
    assert _resolve(index, "x", "a") == [("x", "1"), ("a", "1"), ("c", "1"), ("b", "1")]
    assert index.rounds == [["x", "a"], ["c", "b"], ["c<2"]]  # "gone", needed only by c 2, is never asked for


def test_cycles_extras_and_markers() -> None:
    projects = {"a": {"1": ("b", "e ; extra == 'more'", "old ; python_version < '3'")}, "b": {"1": ("a",)},
                "e": {"1": ()}}
    assert _resolve(Index(projects, extras=("more",)), "a") == [("a", "1"), ("b", "1")]
    assert _resolve(Index(projects, extras=("more",)), "a[More]") == [("a", "1"), ("b", "1"), ("e", "1")]
    assert _resolve(Index(projects), "a[more]") == [("a", "1"), ("b", "1")]  # an extra a does not declare: ignored


@pytest.mark.parametrize(("line", "refused_because"), [
    ("evil @ https://example.com/evil-1.0.tar.gz", "direct reference"),
    ("evil @ file:///tmp/evil", "direct reference"),
    ("evil @ git+https://example.com/evil.git", "direct reference"),
    ("unlisted", "not on this nbexec's allowlist"),
], ids=["url", "path", "vcs", "unlisted"])
def test_a_refused_dependency_stops_the_resolution_before_it_is_fetched(line: str, refused_because: str) -> None:
    index = Index({"a": {"1": ("b",)}, "b": {"1": (line,)}, "evil": {"1": ()}, "unlisted": {"1": ()}})
    policy = Policy("allowlist", {"a": "", "b": "", "evil": ""})
    with pytest.raises(PackageRefusedError, match=f"^b 1 depends on evil.*{refused_because}|^b 1 depends on unlisted"
                                                  f".*{refused_because}"):
        _resolve(index, "a", policy=policy)
    assert index.rounds == [["a"], ["b"]]


def test_the_allowlist_bounds_the_versions_of_dependencies() -> None:
    index = Index({"a": {"1": ("b",)}, "b": {"1": (), "2": ()}})
    assert _resolve(index, "a", policy=Policy("allowlist", {"a": "", "b": "<2"})) == [("a", "1"), ("b", "1")]


def test_a_conflict_narrowing_cannot_settle_fails_with_the_fetchs_message() -> None:
    index = Index({"a": {"1": ("c<2",)}, "b": {"1": ("c>=2",)}, "c": {"1": (), "2": ()}})
    with pytest.raises(PackageError, match="no version of c"):
        _resolve(index, "a", "b")


def test_a_fetch_that_brings_something_else_is_refused() -> None:
    def fetch(lines: list[str]) -> list[resolver.Fetched]:
        return [resolver.Fetched("other-1-py3-none-any.whl", "other", "1", ())]

    with pytest.raises(PackageError, match="pip brought other"):
        resolver.resolve([Requirement("a")], ANY, ENVIRONMENT, fetch, max_rounds=3)


def test_a_fetch_that_brings_a_version_the_demand_refuses_is_refused() -> None:
    def fetch(lines: list[str]) -> list[resolver.Fetched]:
        return [resolver.Fetched("a-3-py3-none-any.whl", "a", "3", ())]

    with pytest.raises(PackageError, match=r"^pip brought a 3, which <2 does not accept$"):
        resolver.resolve([Requirement("a<2")], ANY, ENVIRONMENT, fetch, max_rounds=3)


@pytest.mark.parametrize(("text", "problem"), [
    ("Name: a\nVersion: 1\n", None),
    ("Name: A_\nVersion: 1.0\n", "not what its file name says"),
    ("Name: a\nVersion: 2\n", "not what its file name says"),
    ("Name: a\nVersion: not-a-version\n", "not what its file name says"),
    ("Version: 1\n", "not what its file name says"),
    ("Name: a\n", "not what its file name says"),
    ("", "not what its file name says"),
    ("Name: A\nVersion: 1.0\n", None),  # the same project and version, normalised
    ("Name: a\nName: evil\nVersion: 1\n", None),  # a second Name is read by no one (pip reads the first)
    ("Name: evil\nName: a\nVersion: 1\n", "not what its file name says"),
    ("Name: a\nVersion: 1\n" + "Requires-Dist: b\n" * 1001, "1,001 dependencies"),
    ("Name: a\nVersion: 1\n" + "Provides-Extra: b\n" * 1001, "1,001 dependencies or extras"),
])
def test_metadata_must_match_the_file_name(text: str, problem: str | None) -> None:
    if problem is None:
        assert resolver.read_metadata("a-1-py3-none-any.whl", text).requires == ()
    else:
        with pytest.raises(PackageError, match=problem):
            resolver.read_metadata("a-1-py3-none-any.whl", text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000), st.lists(st.text(max_size=80), max_size=5))
def test_hostile_metadata_and_dependency_lines_raise_nothing_but_package_errors(text: str, lines: list[str]) -> None:
    with contextlib.suppress(PackageError):
        resolver.read_metadata("a-1-py3-none-any.whl", text)
    with contextlib.suppress(PackageError):
        _resolve(Index({"a": {"1": tuple(lines)}}), "a")


def test_policy_bound_is_empty_outside_the_allowlist() -> None:
    assert ANY.bound("b") == SpecifierSet("")


def _wheel_with_metadata(path: Path, head: bytes, filler: int) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("a-1.dist-info/WHEEL", "Wheel-Version: 1.0\n")
        with archive.open("a-1.dist-info/METADATA", "w", force_zip64=True) as handle:
            handle.write(head)
            for _ in range(filler):
                handle.write(b"a" * (1 << 20))
    return path


@pytest.mark.parametrize(("head", "expected"), [
    (b"Metadata-Version: 2.1\r\nName: a\r\nVersion: 1\r\n\r\n", "Metadata-Version: 2.1\nName: a\nVersion: 1"),
    (b"Metadata-Version: 2.1\nName: a\nVersion: 1\nSummary: ", None),
], ids=["a-long-description-after-the-headers", "headers-without-end"])
def test_the_resolvers_metadata_reader_reads_no_more_than_its_cap(tmp_path: Path, head: bytes,
                                                                   expected: str | None) -> None:
    """64 MiB of METADATA (a bomb inflates the same way): the child reads the cap and no more."""
    wheel = _wheel_with_metadata(tmp_path / "a-1-py3-none-any.whl", head, 64)
    tracemalloc.start()
    try:
        found = pipchild.describe(str(wheel), 1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"{peak:,} bytes to read the header block"
    assert found["metadata"] == expected
    assert (found["problem"] is None) == (expected is not None), found["problem"]
    assert found["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()


# -- exactly what is read and said (each value and message as it is, at the edges of its limits) -----------------

def test_the_metadata_read_is_the_wheel_as_it_says_it_is() -> None:
    text = ("Name: a\nVersion: 1.0\nRequires-Dist: b>=1\nRequires-Dist: c ; extra == 'x_y'\n"
            "Provides-Extra:  X_y \n")
    assert resolver.read_metadata("a-1.0-py3-none-any.whl", text) == resolver.Fetched(
        "a-1.0-py3-none-any.whl", "a", "1.0", ("b>=1", "c ; extra == 'x_y'"), frozenset({"x-y"}))


def test_a_thousand_dependencies_and_a_thousand_extras_are_read() -> None:
    text = "Name: a\nVersion: 1\n" + "Requires-Dist: b\n" * 1000 + "Provides-Extra: e\n" * 1000
    found = resolver.read_metadata("a-1-py3-none-any.whl", text)
    assert len(found.requires) == 1000 and found.extras == frozenset({"e"})


@pytest.mark.parametrize("project", ["none", "xxxx"])
def test_metadata_without_a_name_or_version_is_refused_whatever_the_file_is_called(project: str) -> None:
    for text in ("Version: 1\n", "Name: " + project + "\n"):
        with pytest.raises(PackageError, match="not what its file name says"):
            resolver.read_metadata(f"{project}-1-py3-none-any.whl", text)


def test_each_refusal_of_a_wheels_metadata_says_it_in_those_words() -> None:
    with pytest.raises(PackageError) as refused:
        resolver.read_metadata("x" * 300, "")
    assert str(refused.value) == f"the index served {'x' * 200!r}, which is not a wheel"
    with pytest.raises(PackageError) as refused:
        resolver.read_metadata("a-1-py3-none-any.whl", f"Name: {'n' * 150}\nVersion: {'1' * 80}\n")
    assert str(refused.value) == (f"a-1-py3-none-any.whl says it is {'n' * 100!r} {'1' * 50!r} in its metadata, "
                                  "not what its file name says; it was not used")


def _fetching(*wheels: resolver.Fetched) -> resolver.Fetch:
    return lambda lines: list(wheels)


def test_each_refusal_of_a_resolution_says_it_in_those_words() -> None:
    long = ["p" * 200 + str(n) for n in range(3)]
    with pytest.raises(PackageError) as refused:
        resolver.resolve([Requirement(n) for n in long], ANY, ENVIRONMENT, _fetching(), max_rounds=3)
    assert str(refused.value) == f"pip brought nothing for {', '.join(long)[:300]}"
    brought = [resolver.Fetched(f"{n}-1-py3-none-any.whl", n, "1", ()) for n in ("q" * 200, "r" * 200)]
    with pytest.raises(PackageError) as refused:
        resolver.resolve([Requirement("a")], ANY, ENVIRONMENT, _fetching(*brought), max_rounds=3)
    assert str(refused.value) == f"pip brought {', '.join(['q' * 200, 'r' * 200])[:300]} for a"
    with pytest.raises(PackageError) as refused:
        resolver.resolve([Requirement("a")], ANY, ENVIRONMENT,
                         _fetching(resolver.Fetched("a-1-py3-none-any.whl", "a", "1", ("b",))), max_rounds=1)
    assert str(refused.value) == "the resolution did not settle in 1 rounds; pin the versions you need"


def test_each_unreadable_dependency_is_refused_in_those_words() -> None:
    bad = "!" * 300
    with pytest.raises(PackageError) as refused:
        _resolve(Index({"a": {"1": (bad,)}}), "a")
    assert str(refused.value) == f"a 1 declares a dependency that is not a requirement: {bad[:200]!r}"
    marker = "b" * 250 + " ; python_version ~= '1'"
    with pytest.raises(PackageError) as refused:
        _resolve(Index({"a": {"1": (marker,)}}), "a")
    assert str(refused.value).startswith(f"the marker of {str(Requirement(marker))[:200]!r} cannot be evaluated: ")


def test_a_prerelease_pip_brought_is_taken_when_the_specifier_allows_it() -> None:
    rc = resolver.Fetched("a-1.1rc1-py3-none-any.whl", "a", "1.1rc1", ())
    assert resolver.resolve([Requirement("a>=1")], ANY, ENVIRONMENT, _fetching(rc), max_rounds=3) == [rc]


def test_roots_are_judged_by_their_markers_with_no_extra() -> None:
    index = Index({"a": {"1": ()}, "b": {"1": ()}, "c": {"1": ()}})
    assert _resolve(index, "a ; python_version >= '3'", "b ; python_version < '3'", "c ; extra == 'XXXX'") == [
        ("a", "1")]


def test_the_extras_of_every_requirement_of_a_project_are_joined() -> None:
    index = Index({"a": {"1": ("b ; extra == 'x'", "c ; extra == 'y'")}, "b": {"1": ()}, "c": {"1": ()}},
                  extras=("x", "y"))
    assert _resolve(index, "a[x]", "a[y]") == [("a", "1"), ("b", "1"), ("c", "1")]


def test_a_dependency_whose_marker_does_not_hold_is_passed_over_and_the_next_one_read() -> None:
    index = Index({"a": {"1": ("x ; python_version < '3'", "y ; extra == 'XXXX'", "b")}, "b": {"1": ()}})
    assert _resolve(index, "a") == [("a", "1"), ("b", "1")]


def test_the_dependencies_of_a_wheel_that_fits_a_specifier_are_read() -> None:
    assert _resolve(Index({"a": {"1": ("b",)}, "b": {"1": ()}}), "a>=1") == [("a", "1"), ("b", "1")]
