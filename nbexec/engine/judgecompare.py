"""How the judge compares a test's output with the expected one, and the bounded diff it shows: shipped as text
into a judging sandbox and run into the runner's namespace (`judgerunner`) first. Standard library only."""

_DIFF_LINE = 160  # characters of a differing line shown in a diff


def _lines(data: bytes) -> list[bytes]:
    return [line.rstrip() for line in data.rstrip().split(b"\n")]


def _floats_equal(got: bytes, want: bytes, tolerance: float) -> bool:
    if got == want:
        return True
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    if a != a or b != b:  # NaN equals nothing but the same token
        return False
    if a == b:  # infinities too (their difference is NaN)
        return True
    return abs(a - b) <= tolerance * max(1.0, abs(b))


def compare(mode: str, got: bytes, want: bytes, tolerance: float) -> bool:
    """Whether ``got`` matches ``want`` under ``mode`` (exact, whitespace or float)."""
    if mode == "exact":
        return got == want
    a, b = got.split(), want.split()
    if mode == "whitespace":
        return a == b
    return len(a) == len(b) and all(_floats_equal(x, y, tolerance) for x, y in zip(a, b, strict=False))


def diff(got: bytes, want: bytes) -> str:
    """The first line where ``got`` and ``want`` differ, each side cut short: a bounded diff."""
    a, b = _lines(got), _lines(want)
    for number in range(max(len(a), len(b))):
        x = a[number] if number < len(a) else None
        y = b[number] if number < len(b) else None
        if x != y:
            def show(line: bytes | None) -> str:
                if line is None:
                    return "(no line)"
                text = line[:_DIFF_LINE * 4].decode("utf-8", "replace")
                return repr(text[:_DIFF_LINE]) + ("..." if len(text) > _DIFF_LINE else "")
            return f"line {number + 1}: expected {show(y)}, got {show(x)}"
    return "the outputs differ in whitespace" if got != want else ""
