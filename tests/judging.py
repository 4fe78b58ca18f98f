"""What the judge image's tests share: a program per language, and compiling and running one in a session exactly as
the table (`nbexec.judgelangs`) says, with the table's argv and environment, in the session's /mnt/data."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from nbexec import judgelangs
from nbexec.engine.session import Session
from nbexec.result import ExecutionResult

# A test's limit, its fixtures included: the first to ask for the judge image waits for its build (minutes on a fresh
# machine, more under load; pytest's default of 600 s is for one test alone).
TIMEOUT_S = 1800

HELLO = {
    "python": 'print("hello, judge")',
    "c": '#include <stdio.h>\nint main(void) { printf("hello, judge\\n"); return 0; }',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello, judge" << std::endl; return 0; }',
    "java": 'public class Main {\n  public static void main(String[] args) { System.out.println("hello, judge"); }\n}',
    "go": 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello, judge") }',
    "rust": 'fn main() { println!("hello, judge"); }',
}
# Each reads whitespace-separated integers from stdin to its end and prints their sum and their count.
SUM = {
    "python": "import sys\nv = [int(w) for w in sys.stdin.read().split()]\nprint(sum(v), len(v))",
    "c": '#include <stdio.h>\nint main(void) {\n  long long x, s = 0; int n = 0;\n'
         '  while (scanf("%lld", &x) == 1) { s += x; n++; }\n  printf("%lld %d\\n", s, n);\n  return 0;\n}',
    "cpp": '#include <iostream>\nint main() {\n  long long x, s = 0; int n = 0;\n'
           '  while (std::cin >> x) { s += x; ++n; }\n  std::cout << s << \' \' << n << \'\\n\';\n}',
    "java": 'import java.io.*;\nimport java.util.*;\npublic class Main {\n'
            '  public static void main(String[] args) throws IOException {\n'
            '    BufferedReader in = new BufferedReader(new InputStreamReader(System.in));\n'
            '    long s = 0; int n = 0; String line;\n'
            '    while ((line = in.readLine()) != null) {\n'
            '      StringTokenizer t = new StringTokenizer(line);\n'
            '      while (t.hasMoreTokens()) { s += Long.parseLong(t.nextToken()); n++; }\n'
            '    }\n    System.out.println(s + " " + n);\n  }\n}',
    "go": 'package main\n\nimport (\n\t"bufio"\n\t"fmt"\n\t"os"\n)\n\nfunc main() {\n'
          '\tin := bufio.NewReader(os.Stdin)\n\tvar s int64\n\tn := 0\n\tfor {\n\t\tvar x int64\n'
          '\t\tif _, err := fmt.Fscan(in, &x); err != nil {\n\t\t\tbreak\n\t\t}\n\t\ts += x\n\t\tn++\n\t}\n'
          '\tfmt.Println(s, n)\n}',
    "rust": 'use std::io::Read;\nfn main() {\n    let mut text = String::new();\n'
            '    std::io::stdin().read_to_string(&mut text).unwrap();\n'
            '    let v: Vec<i64> = text.split_whitespace().map(|w| w.parse().unwrap()).collect();\n'
            '    println!("{} {}", v.iter().sum::<i64>(), v.len());\n}',
}


def command(lang: judgelangs.JudgeLanguage, argv: tuple[str, ...]) -> str:
    """A shell command running ``argv`` with the language's environment, as the table says."""
    env = " ".join(shlex.quote(f"{name}={value}") for name, value in lang.env)
    return f"env {env} {shlex.join(argv)}" if env else shlex.join(argv)


def compile_program(session: Session, lang: judgelangs.JudgeLanguage, source: str,
                    timeout: float = 120) -> tuple[ExecutionResult, float]:
    """Write ``source`` to the language's file in /mnt/data and compile it there (a language that is not compiled:
    nothing to do, an ok result of the write). The compile's result and its seconds."""
    session.upload(source.encode(), lang.source)
    started = time.monotonic()
    if lang.compile is None:
        return session.shell("true"), 0.0
    result = session.shell(command(lang, lang.compile), timeout=timeout)
    return result, time.monotonic() - started


def run_program(session: Session, lang: judgelangs.JudgeLanguage, stdin: str = "",
                timeout: float = 60) -> ExecutionResult:
    """Run the compiled program in /mnt/data with ``stdin`` on its standard input."""
    session.upload(stdin.encode(), "input.txt")
    return session.shell(f"{command(lang, lang.run)} < input.txt", timeout=timeout)


def memory_of(container: str) -> tuple[int, int]:
    """The container's peak memory (bytes) and how many of its processes the OOM killer ended, from its memory
    cgroup on the host (v1 or v2, either of Docker's drivers): what the kernel saw, not what the sandbox says."""
    root, scope = Path("/sys/fs/cgroup"), f"docker-{container}.scope"
    for path in (root / "memory" / "docker" / container, root / "memory" / "system.slice" / scope):
        if (path / "memory.oom_control").is_file():  # v1
            control = dict(line.split() for line in (path / "memory.oom_control").read_text().splitlines())
            return int((path / "memory.max_usage_in_bytes").read_text()), int(control["oom_kill"])
    for path in (root / "docker" / container, root / "system.slice" / scope):
        if (path / "memory.events").is_file():  # v2
            events = dict(line.split() for line in (path / "memory.events").read_text().splitlines())
            return int((path / "memory.peak").read_text()), int(events["oom_kill"])
    raise AssertionError(f"no memory cgroup found for container {container[:12]}")
