"""Host CPU per MiB of kernel output, measured from outside (issue #36 item 4): a cell publishes 12 MiB of signed
messages for its own request in the shapes that cost a parser most, and the host process's CPU for the whole
run (user and system, every thread) divided by the MiB sent stays within the promise SECURITY.md states.

The costly part can be anywhere: in the header and parent header (never charged to the output budget), in the
content of a kind nbexec reads, or in the content of a kind it ignores. The allowances are raised so every
message is within them and read, the most a run can make the host parse. The bound is the promise itself, not a
margin over it: the figures measured are 0.02-0.09 s/MiB on a shared 2-core machine. Contention there (a load of
7 on 2 cores) can only add to a run's CPU, so a run over the bound is measured once more and the cheaper counts.
"""

from __future__ import annotations

import resource
import time

import pytest

import nbexec
from nbexec import Session

from ..conftest import IMAGE

PROMISE_S_PER_MIB = 0.11  # SECURITY.md, "host CPU per MiB of kernel output"
SEND_BYTES = 12 * 1024 * 1024
# Values of at most 60 KiB (a header's frame holds 64 KiB): many empty lists; lists nested 60 deep (a header's
# own two levels make 62, within the 64 allowed); lone surrogates among empty lists.
LISTS = "[[]] * 20000"
DEEP = "[functools.reduce(lambda v, _: [v], range(59), [])] * 500"
SURROGATES = "['\\ud800', []] * 4000"
# (kind, what pads both headers, the content, or None for the plain one)
SHAPES = {
    "unknown-kind-lists-in-headers": ("x_unknown", LISTS, None),
    "unknown-kind-deep-headers": ("x_unknown", DEEP, None),
    "unknown-kind-surrogates-in-headers": ("x_unknown", SURROGATES, None),
    "stream-lists-in-content": ("stream", "[]", f"dict(name='stdout', text='.', pad={LISTS})"),
    "stream-deep-content": ("stream", "[]", f"dict(name='stdout', text='.', pad={DEEP})"),
    "stream-surrogates-in-content": ("stream", "[]", f"dict(name='stdout', text='.', pad={SURROGATES})"),
    "unknown-kind-deep-content": ("x_unknown", "[]", f"dict(pad={DEEP})"),
}


def _cell(kind: str, pad: str, content: str | None) -> str:
    """Code that publishes SEND_BYTES of signed messages of ``kind`` for the cell's own request."""
    return f"""
import functools, json
k = get_ipython().kernel; s = k.session; parent = k.get_parent()
pad = {pad}
dump = lambda value: json.dumps(value, default=str, separators=(",", ":")).encode()
above = dump(dict(parent['header'], pad=pad))
body = dump({content or "dict(name='stdout', text='.')"})
sent = n = 0
while sent < {SEND_BYTES}:
    n += 1
    parts = [dump(dict(s.msg_header({kind!r}), pad=pad)), above, b'{{}}', body]
    k.iopub_socket.send_multipart([b'x', b'<IDS|MSG>', s.sign(parts), *parts])
    sent += sum(map(len, parts))
print(n, sent)
"""


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("shape", list(SHAPES))
def test_host_cpu_per_mib_of_kernel_output_stays_within_the_promise(shape: str, cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="16m",
                                  max_display="16m")
    session = Session(config)
    try:
        assert session.run("1").ok
        costs = []
        for _ in range(4):  # contention on a loaded machine only adds: more runs, and the cheapest one counts
            cpu, start = _cpu(), time.monotonic()
            result = session.run(_cell(*SHAPES[shape]))
            spent, wall = _cpu() - cpu, time.monotonic() - start
            assert result.ok, (result.error, result.notes)
            count, sent = (int(word.lstrip(".")) for word in result.stdout.split()[-2:])
            costs.append(spent / (sent / 2**20))
            print(f"{shape}: {count} messages, {sent / 2**20:.1f} MiB, {wall:.1f} s, host CPU {spent:.2f} s "
                  f"= {costs[-1]:.3f} s/MiB")
            if costs[-1] <= PROMISE_S_PER_MIB:
                break
        assert min(costs) <= PROMISE_S_PER_MIB, f"{min(costs):.3f} s of host CPU per MiB"
    finally:
        session.close()
