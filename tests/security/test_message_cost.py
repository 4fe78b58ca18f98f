"""Host CPU per MiB of kernel output, measured from outside (issue #36 item 4): a cell publishes 12 MiB of signed
messages for its own request in the shapes that cost a parser most, and the host process's CPU for the whole
run (user and system, every thread) divided by the MiB sent stays within the promise SECURITY.md states.

The costly part can be anywhere: in the header and parent header (charged to the output budget only past 1 KiB;
one full of containers is refused), in the content of a kind nbexec reads, or in the content of a kind it ignores.
The allowances are raised so every message is within them and read, the most a run can make the host parse. The
bound is the promise itself, not a margin over it. These tests run alone (the `alone` tier): another process's
load can only add to a run's CPU, and so can the machine's, so a run over the bound is measured again and the
cheapest counts.

Headers count against the output allowance too: messages of huge headers and a byte of content, kept or shown
in a result, are dropped and counted past it like any other flood.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import pytest

import nbexec
from nbexec import Session
from nbexec.service.settings import ServerSettings

from ..conftest import IMAGE
from ..test_server import TOKEN_A, running

PROMISE_S_PER_MIB = 0.11  # SECURITY.md, "host CPU per MiB of kernel output", every shape at the default allowances
# JSON the host keeps, allowances raised so all of it is: parsed once in C, then written as it came (0.10-0.18 s per
# MiB kept of lists nested 60 deep on a quiet 2-core machine; 0.14-0.36 when each value was encoded twice, 1.2-10.5
# when values were walked in Python). At the defaults it is charged what it holds, and little of it is kept.
PROMISE_KEPT_S_PER_MIB = 0.25

SEND_BYTES = 12 * 1024 * 1024
# Kept JSON is charged what it holds parsed: 12 MiB of lists nested 60 deep take about 600 MB. All of it kept, so
# all of it is parsed, the most an operator's allowance can make the host do.
KEPT_ALLOWANCE = "1g"
# Values of at most 60 KiB (a header's frame holds 64 KiB): many empty lists; lists nested 60 deep (a header's
# own two levels make 62, within the 64 allowed); lone surrogates among empty lists.
LISTS = "[[]] * 20000"
DEEP = "[functools.reduce(lambda v, _: [v], range(59), [])] * 500"
SURROGATES = "['\\ud800', []] * 4000"
# (kind, what pads both headers, the content, or None for the plain one)
SHAPES = {
    "unknown-kind-string-in-headers": ("x_unknown", "'h' * 60000", None),
    "unknown-kind-surrogates-in-headers": ("x_unknown", "'\\ud800' * 10000", None),
    "unknown-kind-deep-content": ("x_unknown", "[]", f"dict(pad={DEEP})"),
    "display-deep-content": ("display_data", "[]", f"dict(data={{'application/json': {DEEP}}}, metadata={{}})"),
    "display-lists-in-content": ("display_data", "[]", f"dict(data={{'application/json': {LISTS}}}, metadata={{}})"),
    "display-deep-metadata": ("display_data", "[]", f"dict(data={{'text/plain': '.'}}, metadata={{'m': {DEEP}}})"),
    "update-deep-content": ("update_display_data", "[]", f"dict(data={{'application/json': {{'v': {DEEP}}}}}, "
                                                      "metadata={}, transient={'display_id': 'shown'})"),
}
# Shapes refused at their first message, unparsed or parsed in C only: headers full of containers (a Jupyter header
# is flat), stream content holding lists (its name and text are strings), a display of many members (each one costs
# Python code). (kind, header pad, content, what the error says)
REFUSED = {
    "lists-in-headers": ("x_unknown", LISTS, None, "flat object"),
    "deep-headers": ("x_unknown", DEEP, None, "flat object"),
    "surrogates-among-lists-in-headers": ("x_unknown", SURROGATES, None, "flat object"),
    "stream-lists-in-content": ("stream", "[]", f"dict(name='stdout', text='.', pad={LISTS})", "list or an object"),
    "stream-deep-content": ("stream", "[]", f"dict(name='stdout', text='.', pad={DEEP})", "list or an object"),
    "stream-surrogates-in-content": ("stream", "[]", f"dict(name='stdout', text='.', pad={SURROGATES})",
                                     "list or an object"),
    "display-of-many-members": ("display_data", "[]", "dict(data={'text/plain': '.', **{f'application/x{i}': [[]] "
                                                      "for i in range(6000)}}, metadata={})", "members"),
}


KEPT = [shape for shape in SHAPES if shape.startswith(("display-", "update-"))]


def _cell(kind: str, pad: str, content: str | None) -> str:
    """Code that publishes SEND_BYTES of signed messages of ``kind`` for the cell's own request (an update reaches
    a display shown first)."""
    return f"""
import functools, json
from IPython.display import display
display({{'text/plain': 'shown'}}, raw=True, display_id='shown')
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


def _cheapest(shape: str, run: Callable[[str], Callable[[], str]], bound: float) -> float:
    """Host CPU per MiB sent of ``shape``'s cell, the cheapest of up to four runs: contention on a loaded machine
    only adds. ``run`` runs the code and gives what reads its stdout after the measure."""
    costs = []
    for _ in range(4):
        cpu, start = _cpu(), time.monotonic()
        stdout = run(_cell(*SHAPES[shape]))
        spent, wall = _cpu() - cpu, time.monotonic() - start
        count, sent = (int(word.lstrip(".")) for word in stdout().split()[-2:])
        costs.append(spent / (sent / 2**20))
        print(f"{shape}: {count} messages, {sent / 2**20:.1f} MiB, {wall:.1f} s, host CPU {spent:.2f} s "
              f"= {costs[-1]:.3f} s/MiB")
        if costs[-1] <= bound:
            break
    return min(costs)


def _in_session(shape: str, bound: float, **allowances: str) -> float:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="16m",
                                  **allowances)

    def run(code: str) -> Callable[[], str]:
        result = session.run(code)
        assert result.ok, (result.error, result.notes)
        return lambda: result.stdout

    with Session(config) as session:
        assert session.run("1").ok
        return _cheapest(shape, run, bound)


@pytest.mark.alone  # host CPU is measured: another worker's load on the shared caches only adds
@pytest.mark.parametrize("shape", list(SHAPES))
def test_host_cpu_per_mib_of_kernel_output_stays_within_the_promise(shape: str, cleanup_ledger: None) -> None:
    """At the default display allowance (the text one raised so every stream message is read)."""
    cost = _in_session(shape, PROMISE_S_PER_MIB)
    assert cost <= PROMISE_S_PER_MIB, f"{cost:.3f} s of host CPU per MiB"


@pytest.mark.alone  # host CPU is measured: another worker's load on the shared caches only adds
@pytest.mark.parametrize("shape", KEPT)
def test_kept_json_costs_the_host_in_proportion_to_what_it_keeps(shape: str, cleanup_ledger: None) -> None:
    """Allowances raised so every message is kept, the most the host can be made to parse and hold."""
    cost = _in_session(shape, PROMISE_KEPT_S_PER_MIB, max_display=KEPT_ALLOWANCE)
    assert cost <= PROMISE_KEPT_S_PER_MIB, f"{cost:.3f} s of host CPU per MiB"


@pytest.mark.parametrize("shape", list(REFUSED))
def test_a_shape_that_costs_python_code_is_refused_at_its_first_message(shape: str, cleanup_ledger: None) -> None:
    """Before: each header was parsed whole (0.04-0.12 s of host CPU per MiB), stream content holding lists too
    (0.03-0.10), and a display of 6,000 members cost 0.29-0.57 s/MiB, here 12 MiB of each. After: the first
    message stops the run as the kernel breaking the protocol, for next to no host CPU."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="16m",
                                  max_display="16m")
    kind, pad, content, said = REFUSED[shape]
    with Session(config) as session:
        assert session.run("1").ok
        cpu = _cpu()
        result = session.run(_cell(kind, pad, content))
        spent = _cpu() - cpu
    assert not result.ok and result.error is not None and result.error.kind == "protocol", result.error
    assert said in result.error.evalue
    assert spent < 0.5, f"{spent:.2f} s of host CPU to refuse it"


@pytest.mark.alone  # host CPU is measured: another worker's load on the shared caches only adds
@pytest.mark.parametrize("shape", ["display-deep-content", "update-deep-content"])
def test_the_http_answer_of_nested_display_data_stays_within_the_promise(shape: str, cleanup_ledger: None) -> None:
    """The node's whole process (one-shot, result, JSON answer) within the promise; the answer is parsed after
    the measure. Before: `to_dict` copied every value of the outputs in Python."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="16m",
                                  max_display=KEPT_ALLOWANCE)
    settings = ServerSettings(config=config, tokens=(TOKEN_A,), max_sessions_per_token=1, max_running_per_token=1)

    def run(code: str) -> Callable[[], str]:
        answer = client.post("/v1/execute", json={"code": code}, timeout=120)
        assert answer.status_code == 200, answer.text[:500]
        return lambda: str(answer.json()["stdout"])

    with running(settings) as service, service.client(TOKEN_A) as client:
        cost = _cheapest(shape, run, PROMISE_KEPT_S_PER_MIB)
    assert cost <= PROMISE_KEPT_S_PER_MIB, f"{cost:.3f} s of host CPU per MiB"


def test_the_answer_holds_a_large_display_value_as_the_kernel_sent_it(cleanup_ledger: None) -> None:
    """The kernel writes JSON with spaces after its commas; nbexec's encoders never do. Seen in the notebook and in
    the HTTP answer only when the value's text was kept and written as it came, never encoded again."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60)
    settings = ServerSettings(config=config, tokens=(TOKEN_A,), max_sessions_per_token=1, max_running_per_token=1)
    code = "display({'application/json': [[i] for i in range(500)]}, raw=True)"
    with running(settings) as service, service.client(TOKEN_A) as client:
        answer = client.post("/v1/execute", json={"code": code}, timeout=120)
    assert answer.status_code == 200, answer.text[:500]
    assert b"[0], [1], [2]" in answer.content
    assert answer.json()["outputs"][0]["data"]["application/json"] == [[i] for i in range(500)]


# -- header bytes are charged to the output budget ---------------------------------------------------------------

HEADER_PAD = 60 * 1024  # bytes padding each header of a message (a header's frame holds 64 KiB)
HEADED = {  # kind -> its tiny content
    "stream": "dict(name='stdout', text='.')",
    "display_data": "dict(data={'text/plain': '.'}, metadata={})",
}


def _headed_cell(kind: str, count: int) -> str:
    """Code that publishes ``count`` signed messages of ``kind`` for its own request, each with a tiny content and
    both headers padded to HEADER_PAD bytes."""
    return f"""
import json
k = get_ipython().kernel; s = k.session; parent = k.get_parent()
dump = lambda value: json.dumps(value, default=str, separators=(",", ":")).encode()
above = dump(dict(parent['header'], pad='p' * {HEADER_PAD}))
body = dump({HEADED[kind]})
for _ in range({count}):
    parts = [dump(dict(s.msg_header({kind!r}), pad='h' * {HEADER_PAD})), above, b'{{}}', body]
    k.iopub_socket.send_multipart([b'x', b'<IDS|MSG>', s.sign(parts), *parts])
"""


@pytest.mark.parametrize("kind", list(HEADED))
def test_header_bytes_are_charged_to_the_output_budget(kind: str, cleanup_ledger: None) -> None:
    """Before: 200 messages of 120 KiB headers and a byte of content (23 MiB sent) were all kept under a 1 MiB
    allowance, nothing truncated. After: past the allowance they are dropped and counted, with the marker."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="1m",
                                  max_display="1m")
    with Session(config) as session:
        result = session.run(_headed_cell(kind, 200))
    assert result.ok, (result.error, result.notes)
    kept = result.stdout.count(".") if kind == "stream" else sum(
        1 for output in result.outputs if output.get("output_type") == "display_data")
    assert result.truncated_bytes > 10 * 1024**2, f"{result.truncated_bytes:,} bytes truncated; {kept} kept"
    assert kept < 20, f"{kept} of 200 messages with 120 KiB headers were kept under a 1 MiB allowance"


# -- headers just under the 1 KiB a message carries free ---------------------------------------------------------

@pytest.mark.alone  # host CPU is measured: another worker's load on the shared caches only adds
def test_messages_of_headers_just_under_their_allowance_stay_within_the_cpu_promise(cleanup_ledger: None) -> None:
    """12 MiB of stream messages whose two headers hold just under 1 KiB (charged nothing) and a byte of text:
    the most messages per MiB a kernel can send free of header charges. Here the cost is per message, not per
    byte (about 1,160 messages a MiB): host CPU per MiB stays within 0.11 s (0.156 before the frames already
    received were read in one loop; 0.085 after, on a 2-core machine), and the output is honest: every byte of
    text is kept, nothing is counted truncated."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="16m")
    with Session(config) as session:
        assert session.run("1").ok
        costs = []
        for _ in range(4):  # contention on a loaded machine only adds: the cheapest run counts
            cpu = _cpu()
            result = session.run(_cell("stream", "'p' * 230", None))
            spent = _cpu() - cpu
            assert result.ok, (result.error, result.notes)
            count, sent = (int(word.lstrip(".")) for word in result.stdout.split()[-2:])
            costs.append(spent / (sent / 2**20))
            print(f"{count} messages, {sent / 2**20:.1f} MiB, host CPU {spent:.2f} s = {spent / count * 1e6:.0f} us a "
                  f"message, {costs[-1]:.3f} s/MiB")
            assert result.stdout.count(".") >= count and result.truncated_bytes == 0, "output was not honest"
            if costs[-1] <= PROMISE_S_PER_MIB:
                break
        assert min(costs) <= PROMISE_S_PER_MIB, f"{min(costs):.3f} s of host CPU per MiB"
