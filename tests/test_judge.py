"""judge() and judge_many(): verdicts per test, the comparisons, limits, the function-call style, batches.

The pure parts (comparisons, diffs, the checks of what a caller passes) run without Docker; the rest judges real
programs in real sandboxes. Attacks on the judge are in security/test_judge_attacks.py."""

from __future__ import annotations

import time

import pytest

import nbexec
from nbexec.engine import judge, judgecompare
from nbexec.engine.judgevalues import Comparison, Limits, Test

PROGRAM = r"""
import sys, time
command = sys.stdin.read().strip()
if command == "echo":
    print("hello  world")
elif command == "wrong":
    print("hello\nthere")
elif command == "crash":
    print("partial")
    raise SystemExit(3)
elif command == "sleep":
    time.sleep(30)
elif command == "spin":
    while True:
        pass
elif command == "memory":
    block = bytearray(4 * 1024**3)
elif command == "flood":
    while True:
        sys.stdout.write("x" * 65536)
elif command == "args":
    print(" ".join(sys.argv[1:]))
elif command == "float":
    print(0.1 + 0.2, 1e9 + 0.5)
"""


@pytest.mark.parametrize(("mode", "got", "want", "same"), [
    ("exact", b"1 2\n", b"1 2\n", True),
    ("exact", b"1 2\n", b"1 2", False),
    ("whitespace", b" 1\t2 \n\n", b"1 2\n", True),
    ("whitespace", b"1 2 3", b"1 2", False),
    ("whitespace", b"12", b"1 2", False),
    ("float", b"0.30000000000000004 1000000000.5", b"0.3 1000000000", True),
    ("float", b"0.31", b"0.3", False),
    ("float", b"nan", b"nan", True),
    ("float", b"nan", b"1.0", False),
    ("float", b"inf", b"1e999", True),
    ("float", b"abc", b"abc", True),
    ("float", b"1 2", b"1", False),
], ids=lambda v: v if isinstance(v, str) else None)
def test_comparisons(mode: str, got: bytes, want: bytes, same: bool) -> None:
    assert judgecompare.compare(mode, got, want, 1e-6) is same


def test_a_diff_names_the_first_differing_line_and_is_bounded() -> None:
    shown = judgecompare.diff(b"a\nb\n" + b"x" * 10_000_000, b"a\nc\n" + b"y" * 10_000_000)
    assert shown == "line 2: expected 'c', got 'b'"
    long = judgecompare.diff(b"\xff" * 1_000_000, b"z" * 1_000_000)
    assert long.startswith("line 1:") and len(long) < 1000 and "\ufffd" in long
    assert judgecompare.diff(b"1\n2", b"1\n2\n3").endswith("got '(no line)'") is False  # a missing line is said
    assert "(no line)" in judgecompare.diff(b"1\n2", b"1\n2\n3")


@pytest.mark.parametrize(("tests", "options", "said"), [
    ([], {}, "at least one test"),
    ("1 2", {}, "not a single one"),
    ([{"stdin": 5}], {}, "bytes or str"),
    ([{"stdin": "", "nonsense": 1}], {}, "unknown field"),
    ([{"args": ["a\0b"]}], {}, "without NUL"),
    ([{"args": ["x"] * 300}], {}, "at most 256"),
    ([{"args": [1]}], {}, "without NUL"),
    ([Test()] * 10_001, {}, "at most 10000 tests"),
    ([{"expected": "x" * (70 * 1024**2)}], {}, "exceed 256 MiB"),
    ([Test()], {"language": "cobol"}, "is not one nbexec judges"),
    ([Test()], {"compare": "fuzzy"}, "not one of"),
    ([Test()], {"compare": "checker"}, "takes a checker"),
    ([Test()], {"compare": 5}, "not one of"),
    ([Test()], {"limits": {"time": float("inf")}}, "limits.time"),
    ([Test()], {"limits": {"time": -1}}, "limits.time"),
    ([Test()], {"limits": {"memory": "1k"}}, "too small"),
    ([Test()], {"limits": "fast"}, "Limits value"),
], ids=["none", "str", "stdin-int", "unknown", "nul-arg", "many-args", "int-arg", "too-many", "huge-expected",
        "language", "mode", "checker-missing", "mode-int", "inf-time", "negative-time", "tiny-memory",
        "limits-str"])
def test_what_a_caller_passes_is_checked_before_any_sandbox(tests: object, options: dict[str, object],
                                                            said: str) -> None:
    started = time.monotonic()
    with pytest.raises(nbexec.ConfigError, match=said):
        nbexec.judge("print(1)", tests, **options)  # type: ignore[arg-type]
    assert time.monotonic() - started < 10  # refused on the spot (the Docker tier's engine is never asked)


@pytest.mark.parametrize("reuse", ["sandbox", "", True, "BATCH"])
def test_a_reuse_mode_nbexec_does_not_have_is_refused_on_the_spot(reuse: object) -> None:
    with pytest.raises(nbexec.ConfigError, match="reuse is None"):
        nbexec.judge_many([], reuse=reuse)  # type: ignore[arg-type]


@pytest.mark.parametrize("record", [
    None, [], "accepted", {"v": "ACCEPTED"}, {"v": ["accepted"]}, {}, {"v": "accepted\u0000"},
], ids=["none", "list", "str", "case", "list-verdict", "empty", "nul"])
def test_a_malformed_record_from_the_sandbox_is_a_judge_error(record: object) -> None:
    assert judge._record(3, record).verdict == "judge_error"


def test_a_records_numbers_and_texts_are_bounded() -> None:
    shown = judge._record(0, {"v": "wrong_answer", "t": float("nan"), "cpu": -5, "mem": float("inf"),
                              "exit": 10**30, "diff": "d" * 10**6, "err": ["x"], "why": "w" * 10**6})
    assert (shown.time, shown.cpu, shown.memory, shown.exit_code) == (0.0, 0.0, 0, None)
    assert len(shown.diff) == 2048 and shown.stderr == "" and len(shown.message) == 1024


def test_a_huge_program_and_bad_tolerances_are_refused() -> None:
    for tolerance in (float("nan"), float("inf"), -1e-9, "0.1"):
        with pytest.raises(nbexec.ConfigError, match="tolerance"):
            Comparison(mode="float", tolerance=tolerance)  # type: ignore[arg-type]
    with pytest.raises(nbexec.ConfigError, match="at most 4 MiB"):
        nbexec.judge("#" * (5 * 1024**2), [Test()])


def test_each_verdict_with_its_time_and_memory(config: nbexec.SandboxConfig) -> None:
    tests = [Test("echo", expected="hello world\n"), Test("wrong", expected="hello\nworld\n"),
             Test("crash", expected="partial"), Test("sleep", expected=""), Test("spin", expected=""),
             Test("memory", expected=""), Test("flood", expected=""),
             Test("args", args=("a b", "c"), expected="a b c"), Test("float", expected="0.3 1000000000.5")]
    result = nbexec.judge(PROGRAM, tests, limits=Limits(time=1.5, memory="256m", output="1m"), config=config)
    verdicts = [test.verdict for test in result.tests]
    assert verdicts == ["accepted", "wrong_answer", "runtime_error", "timeout", "timeout", "memory",
                        "output_limit", "accepted", "wrong_answer"], [t.to_dict() for t in result.tests]
    echo, wrong, crash, sleep, spin, memory = result.tests[:6]
    assert 0 < echo.time < 1.5 and echo.memory > 1024**2 and echo.exit_code == 0
    assert wrong.diff == "line 2: expected 'world', got 'there'"
    assert crash.exit_code == 3
    assert 1.5 <= sleep.time < 3 and sleep.cpu < 0.5  # the wall-clock limit, not the CPU one
    assert spin.cpu > 0 and spin.exit_code == -9  # a busy loop: killed at its wall limit (the CPU is shared)
    assert "MemoryError" in memory.stderr
    assert result.verdict == "wrong_answer" and result.passed == 2 and not result.ok


def test_float_comparison_and_exact(config: nbexec.SandboxConfig) -> None:
    tests = [Test("float", expected="0.3 1000000000.5"), Test("echo", expected="hello  world\n")]
    floats = nbexec.judge(PROGRAM, tests[:1], compare="float", config=config)
    exact = nbexec.judge(PROGRAM, tests[1:], compare="exact", config=config)
    assert floats.ok and exact.ok


def test_a_checker_runs_in_the_sandbox(config: nbexec.SandboxConfig) -> None:
    def check(input: str, output: str, expected: str | None) -> tuple[bool, str]:
        import os as checker_os
        total = sum(int(x) for x in input.split())
        return int(output) == total, f"{checker_os.path.exists('/mnt/data')}:{total}"

    program = "print(sum(map(int, input().split())) + (1 if '9' in open(0).read() else 0))"
    tests = [Test("1 2 3\n", expected=None), Test("4 5\n", expected=None)]
    result = nbexec.judge("import sys\nprint(sum(map(int, sys.stdin.read().split())) + (1 if '9' in '45' else 0))",
                          tests, compare=Comparison(mode="checker", checker=check), config=config)
    assert [t.verdict for t in result.tests] == ["accepted", "accepted"]
    assert result.tests[0].message == "True:6"
    wrong = nbexec.judge("print(0)", tests, compare=Comparison(mode="checker", checker=check), config=config)
    assert [t.verdict for t in wrong.tests] == ["wrong_answer", "wrong_answer"]
    assert program  # the program above is the honest one; this one prints 0


def test_the_function_call_style_is_judged_by_exit_status(config: nbexec.SandboxConfig) -> None:
    solution = "def add(a, b):\n    return a + b\n"
    tests = [Test(expected=None), {"stdin": "", "expected": None}]
    passing = nbexec.judge(solution + "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n", tests[:1], config=config)
    failing = nbexec.judge(solution + "assert add(2, 2) == 5\n", tests[1:], config=config)
    assert passing.ok
    assert failing.tests[0].verdict == "runtime_error" and "AssertionError" in failing.tests[0].stderr


def test_the_program_limit_stops_the_rest(config: nbexec.SandboxConfig) -> None:
    started = time.monotonic()
    result = nbexec.judge(PROGRAM, [Test("sleep")] * 6, limits=Limits(time=2, program=3), config=config)
    assert time.monotonic() - started < 60
    assert all(t.verdict == "timeout" for t in result.tests)
    assert any("not run" in t.message for t in result.tests)


def test_judge_many_yields_each_submission_with_its_index(config: nbexec.SandboxConfig) -> None:
    submissions = [
        {"program": "print(int(input()) * 2)",
         "tests": [{"input": "2", "output": "4"}, {"input": "5", "output": "10"}]},
        {"program": "print(1)", "tests": [{"input": "", "output": "2"}]},
        {"program": "print(1)", "tests": [], "language": "python"},  # not judgeable: its own error
        {"program": "print(1)"},
    ]
    items = {item.index: item for item in nbexec.judge_many(submissions, concurrency=2, config=config)}
    assert sorted(items) == [0, 1, 2, 3]
    assert items[0].ok and items[0].result is not None and items[0].result.passed == 2
    assert items[1].result is not None and items[1].result.verdict == "wrong_answer"
    assert isinstance(items[2].error, nbexec.ConfigError) and isinstance(items[3].error, nbexec.ConfigError)


def test_a_language_the_image_cannot_compile_names_the_judge_image(config: nbexec.SandboxConfig) -> None:
    with pytest.raises(nbexec.ConfigError, match="nbexec image build --kernels judge"):
        nbexec.judge("int main(void) { return 0; }", [Test()], language="c", config=config)


@pytest.mark.parametrize(("language", "program"), [
    ("c", '#include <stdio.h>\nint main(void){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a+b);}'),
    ("cpp", "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"),
    ("java", "import java.util.*;\npublic class Main{public static void main(String[] x){Scanner s=new Scanner("
             "System.in);System.out.println(s.nextLong()+s.nextLong());}}"),
    ("go", 'package main\nimport "fmt"\nfunc main(){var a,b int64;fmt.Scan(&a,&b);fmt.Println(a+b)}'),
    ("rust", "use std::io::*;\nfn main(){let mut s=String::new();stdin().read_to_string(&mut s).unwrap();"
             "let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!(\"{}\",v[0]+v[1]);}"),
])
def test_compiled_languages(config: nbexec.SandboxConfig, judge_image: str, language: str, program: str) -> None:
    result = nbexec.judge(program, [Test("1 2", expected="3"), Test("40 2", expected="42")], language=language,
                          config=config.replace(image=judge_image))
    assert result.ok, result.to_dict()
    broken = nbexec.judge(program[:-3], [Test("1 2", expected="3")], language=language,
                          config=config.replace(image=judge_image))
    assert broken.verdict == "compile_error" and broken.compile_log


def test_a_batch_over_http_takes_judge_items(docker_ready: None) -> None:
    from .cluster import NODE_TOKEN, client, running_node
    from .security.test_batches import events

    env = {"NBEXEC_API_TOKENS": NODE_TOKEN, "NBEXEC_POOL_SIZE": "0"}
    with running_node("judge", env, running=2) as server, client(server, NODE_TOKEN) as http:
        refused = http.post("/v1/batches", json=[{"program": "print(1)", "tests": [{"args": ["a\0"]}]}])
        assert refused.status_code == 422, refused.text
        made = http.post("/v1/batches", json=[
            {"program": "print(int(input()) + 1)", "tests": [{"stdin": "1", "expected": "2"},
                                                              {"stdin": "5", "expected": "7"}]},
            {"code": "print('an execution beside')"},
            {"program": "int main(void){return 0;}", "language": "c", "tests": [{"expected": None}]},
        ])
        assert made.status_code == 202, made.text
        seen = {data["index"]: data for kind, data in events(http, made.json()["id"]) if kind == "item"}
        judged = seen[0]["result"]["judge"]
        assert [t["verdict"] for t in judged["tests"]] == ["accepted", "wrong_answer"]
        assert judged["tests"][1]["diff"] == "line 1: expected '7', got '6'" and seen[0]["result"]["ok"] is False
        assert seen[1]["result"]["ok"] is True
        assert seen[2]["error"]["status"] == 400, seen[2]
        assert "--kernels judge" in seen[2]["error"]["detail"]


def test_leaving_judge_many_stops_the_running_judgements(config: nbexec.SandboxConfig) -> None:
    sleeper = {"program": "import time\ntime.sleep(600)", "tests": [{"expected": None}],
               "limits": {"time": 600, "program": 600}}
    quick = {"program": "print(1)", "tests": [{"expected": "1"}]}
    items = nbexec.judge_many([quick, sleeper, sleeper], concurrency=3, config=config)
    first = next(items)
    assert first.index == 0 and first.ok
    time.sleep(3)  # the sleepers are under way
    started = time.monotonic()
    items.close()
    assert time.monotonic() - started < 30  # interrupted, not waited for (the cleanup ledger checks what is left)


def test_a_kept_batch_record_that_is_not_a_judge_item_is_left_to_the_execute_parse() -> None:
    import pydantic

    from nbexec.service import judgeitems

    assert judgeitems.load(b"[" * 200_000) is None and judgeitems.load(b"\xff") is None
    assert judgeitems.load(b'{"code": "print(1)"}') is None
    with pytest.raises(pydantic.ValidationError):
        judgeitems.load(b'{"program": 1, "tests": []}')


@pytest.mark.parametrize(("language", "program"), [
    ("cpp", "#include <cstdio>\n#include <vector>\nint main(){int n;scanf(\"%d\",&n);"
            "std::vector<char> v((size_t)n<<20,1);printf(\"%zu\\n\",v.size()>>20);}"),
    ("java", "import java.util.*;\npublic class Main{public static void main(String[] x){int n=new Scanner(System.in)"
             ".nextInt();byte[] b=new byte[n<<20];Arrays.fill(b,(byte)1);System.out.println(b.length>>20);}}"),
    ("go", 'package main\nimport "fmt"\nfunc main(){var n int;fmt.Scan(&n);b:=make([]byte,n<<20)\n'
           "for i:=range b{b[i]=1}\nfmt.Println(len(b)>>20)}"),
], ids=["cpp", "java", "go"])
def test_each_compiled_language_is_held_to_its_memory_limit(config: nbexec.SandboxConfig, judge_image: str,
                                                            language: str, program: str) -> None:
    """C++ by its address space, Java by its heap, Go by the memory it writes (once, Go had no limit at all)."""
    result = nbexec.judge(program, [Test("64", expected="64"), Test("1024", expected="1024")], language=language,
                          limits=Limits(memory="256m"), config=config.replace(image=judge_image))
    assert [test.verdict for test in result.tests] == ["accepted", "memory"], result.to_dict()
