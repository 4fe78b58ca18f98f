"""A display when the code wants one: windows work by default (tkinter, turtle, matplotlib's TkAgg), under runc and
runsc, while a sandbox that opens none runs no X server. Judged from outside: the screenshots are decoded on the
host, the X server's process is found in the container's cgroup on the host (runc), its TCP ports are dialled from
the host, and it is looked for again once the sandbox is gone.

The sandboxes run this checkout's in-sandbox display scripts (environments/jupyter: nbexec_display.py, its .pth,
the kernel launcher and entrypoint) laid over the image under test (NBEXEC_IMAGE, which must have Tk: built from this
checkout's Dockerfile), so a change to them is tested without rebuilding that image.
"""

from __future__ import annotations

import functools
import socket
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec import Session, execute_notebook
from nbexec.sandbox.docker import daemon, pool

from .conftest import IMAGE, checkout_image, own_containers, wait_until

RUNTIMES = ("runc", "runsc")

# A window with a red rectangle, read back by the code itself through DISPLAY.
WINDOW = """\
import tkinter
root = tkinter.Tk()
root.geometry('+0+0')
canvas = tkinter.Canvas(root, width=300, height=200, bg='white', highlightthickness=0)
canvas.pack()
canvas.create_rectangle(20, 20, 180, 120, fill='#ff0000', outline='')
root.update()
from PIL import ImageGrab
print('pixel', ImageGrab.grab().getpixel((100, 70)))
"""

# The X server's processes as the sandbox sees them: uid, and whether any of their sockets is a listening TCP one.
X_SERVER = """\
import os, re
def listening():
    found = set()
    for name in ('/proc/net/tcp', '/proc/net/tcp6'):
        try:
            rows = open(name).read().splitlines()[1:]
        except OSError:
            continue
        found |= {row.split()[9] for row in rows if row.split()[3] == '0A'}
    return found
servers = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        if open(f'/proc/{pid}/comm').read().strip() != 'Xvfb':
            continue
        uid = int(re.search(r'^Uid:\\s+(\\d+)', open(f'/proc/{pid}/status').read(), re.M)[1])
        inodes = set()
        for fd in os.listdir(f'/proc/{pid}/fd'):
            link = os.readlink(f'/proc/{pid}/fd/{fd}')
            if link.startswith('socket:['):
                inodes.add(link[8:-1])
    except OSError:
        continue
    servers.append((uid == os.getuid(), bool(inodes & listening())))
print('x servers', servers, os.environ.get('DISPLAY'), os.path.exists('/tmp/.X11-unix/X0'))
"""


@functools.lru_cache(maxsize=8)
def png_pixels(path: str) -> tuple[int, int, list[bytes]]:
    """Width, height and rows (RGB or RGBA bytes) of an 8-bit, non-interlaced PNG: enough for Pillow's output."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, chunks, header = 8, [], b""
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        body = data[offset + 8:offset + 8 + length]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        offset += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    step = 3 if color == 2 else 4
    raw, stride, rows, previous = zlib.decompress(b"".join(chunks)), width * step, [], bytes(width * step)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - step] if x >= step else 0
            up, corner = previous[x], previous[x - step] if x >= step else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                near = min((abs(guess - left), 0, left), (abs(guess - up), 1, up), (abs(guess - corner), 2, corner))
                line[x] = (line[x] + near[2]) & 0xFF
        rows.append(bytes(line))
        previous = bytes(line)
    return width, height, rows


def colours(path: str) -> dict[tuple[int, int, int], int]:
    """How many pixels of each RGB colour a PNG the sandbox made has (decoded here, on the host)."""
    width, _, rows = png_pixels(path)
    step = len(rows[0]) // width
    counts: dict[tuple[int, int, int], int] = {}
    for row in rows:
        for x in range(0, len(row), step):
            key = (row[x], row[x + 1], row[x + 2])
            counts[key] = counts.get(key, 0) + 1
    return counts


def pixel(path: str, x: int, y: int) -> tuple[int, int, int]:
    width, _, rows = png_pixels(path)
    step = len(rows[0]) // width
    return rows[y][x * step], rows[y][x * step + 1], rows[y][x * step + 2]


# The display's steps of environments/jupyter/Dockerfile, on top of the image under test.
STEPS = """\
COPY nbexec_display.py nbexec_display.pth /opt/nbexec/display/
COPY kernel_launcher.py iopub_nodrop.py /opt/nbexec/
COPY nbexec-kernel /usr/local/bin/nbexec-kernel
RUN site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \\
 && install -m 0644 /opt/nbexec/display/nbexec_display.pth "$site"/ \\
 && chmod 0755 /usr/local/bin/nbexec-kernel && python -m compileall -q /opt/nbexec/display
"""
SCRIPTS = ("nbexec_display.py", "nbexec_display.pth", "kernel_launcher.py", "iopub_nodrop.py", "nbexec-kernel")


@pytest.fixture(scope="session")
def display_image(docker_ready: None) -> Iterator[str]:
    """The image under test with this checkout's display scripts; removed at the end of the session."""
    with checkout_image(IMAGE, SCRIPTS, STEPS, "display-test") as tag:
        yield tag


@pytest.fixture
def cold(cold: nbexec.SandboxConfig, display_image: str) -> nbexec.SandboxConfig:
    return cold.replace(image=display_image)


def on(cold: nbexec.SandboxConfig, runtime: str) -> nbexec.SandboxConfig:
    return cold.replace(runtime=runtime, warm_imports=(), timeout=60)


def the_screenshot(result: nbexec.ExecutionResult) -> str:
    shots = [i for i in result.images if i.mime == "image/png"]
    assert len(shots) == 1, f"expected one screenshot, got {result.images}"
    return shots[0].path


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_tkinter_window_draws_and_comes_back_as_a_screenshot(cold: nbexec.SandboxConfig, runtime: str) -> None:
    result = execute_notebook(WINDOW, config=on(cold, runtime))
    assert result.ok, result.error
    assert "pixel (255, 0, 0)" in result.stdout, result.stdout
    shot = the_screenshot(result)  # the window was still open at the end of the cell
    assert pixel(shot, 100, 70) == (255, 0, 0) and pixel(shot, 250, 150) == (255, 255, 255)
    assert pixel(shot, 1000, 800) == (0, 0, 0)  # the root window around it


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_turtle_draws(cold: nbexec.SandboxConfig, runtime: str) -> None:
    code = ("import turtle\npen = turtle.Turtle()\npen.hideturtle()\npen.pensize(9)\npen.pencolor('#0000ff')\n"
            "pen.forward(150)\nprint('canvas', turtle.Screen().window_width() > 0)")
    result = execute_notebook(code, config=on(cold, runtime))
    assert result.ok, result.error
    assert "canvas True" in result.stdout
    seen = colours(the_screenshot(result))
    assert seen.get((0, 0, 255), 0) > 9 * 100, "the blue line is not on the screen"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_matplotlib_draws_through_tkagg(cold: nbexec.SandboxConfig, runtime: str) -> None:
    code = ("import matplotlib\nmatplotlib.use('TkAgg')\nimport matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots()\nax.plot([0, 1], [0, 1], color='#00ff00', linewidth=12)\n"
            "plt.show(block=False)\nfig.canvas.draw()\nfig.canvas.flush_events()\n"
            "plt.pause(1.0)\n"  # drawn before the cell ends: under gVisor on a loaded machine 0.3 s was not enough
            "print(type(fig.canvas).__name__, matplotlib.get_backend())")
    result = execute_notebook(code, config=on(cold, runtime))
    assert result.ok, result.error
    assert "FigureCanvasTkAgg TkAgg" in result.stdout, result.stdout
    assert colours(the_screenshot(result)).get((0, 255, 0), 0) > 12 * 100, "the green line is not on the screen"


def test_no_x_server_until_a_window_is_opened(cold: nbexec.SandboxConfig) -> None:
    with Session(on(cold, "runc")) as session:
        idle = session.run("import numpy, json, subprocess\n" + X_SERVER)
        cgroup = _cgroup_processes(_own_container(cold.image).id)
        drawn = session.run(WINDOW + X_SERVER)
    assert idle.ok and drawn.ok, (idle.error, drawn.error)
    assert "x servers [] :0 False" in idle.stdout, idle.stdout
    assert not any("Xvfb" in line for line in cgroup.values()), cgroup
    assert "x servers [(True, False)] :0 True" in drawn.stdout, drawn.stdout
    assert idle.images == ()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_x_server_is_the_sandbox_users_with_no_tcp_port(cold: nbexec.SandboxConfig, runtime: str) -> None:
    with Session(on(cold, runtime).replace(network=True)) as session:
        result = session.run(WINDOW + X_SERVER)
        container = _own_container(cold.image)
        # From the host (runc; runsc's processes live in its own kernel): the X server's process in the sandbox's
        # cgroup and its uid, and its TCP ports dialled on the sandbox's bridge address.
        outside = {pid: (line, _uid(pid)) for pid, line in _cgroup_processes(container.id).items()
                   if line.startswith("Xvfb ")} if runtime == "runc" else {}
        address = container.attrs["NetworkSettings"]["IPAddress"]
        dialled = {port: _connects(address, port) for port in range(6000, 6011)} if runtime == "runc" else {}
    assert result.ok, result.error
    assert "x servers [(True, False)] :0 True" in result.stdout, result.stdout  # its uid, no listening TCP socket
    assert not any(dialled.values()), f"a TCP port of the X server answered from the host: {dialled}"
    if runtime == "runc":
        uid = int(container.attrs["Config"]["User"].split(":")[0])
        assert [found[1] for found in outside.values()] == [uid] and uid != 0, outside


def test_the_x_server_is_gone_with_the_sandbox(cold: nbexec.SandboxConfig) -> None:
    with Session(on(cold, "runc")) as session:
        assert session.run(WINDOW).ok
        container = _own_container(cold.image)
        servers = [pid for pid, line in _cgroup_processes(container.id).items() if line.startswith("Xvfb ")]
        assert len(servers) == 1
    pool.wait_for_teardown()
    wait_until(lambda: not _alive_as_xvfb(servers[0]), 10, "the X server outlived its sandbox")
    assert container.name not in own_containers(include_pool=True)


def test_screenshots_come_only_when_the_screen_changed(cold: nbexec.SandboxConfig) -> None:
    with Session(on(cold, "runc")) as session:
        opened = session.run(WINDOW)
        quiet = session.run("print('no drawing')")
        more = session.run("canvas.create_oval(200, 20, 280, 100, fill='#0000ff', outline='')\nroot.update()")
        closed = session.run("root.destroy()")
    assert all(r.ok for r in (opened, quiet, more, closed))
    assert [len(r.images) for r in (opened, quiet, more, closed)] == [1, 0, 1, 0]
    assert pixel(the_screenshot(more), 240, 60) == (0, 0, 255)


def test_an_interrupt_in_the_screenshot_hook_stays_out_of_the_cell(cold: nbexec.SandboxConfig) -> None:
    """A second interrupt (a client that pressed twice) may land in nbexec's own post-cell hook: that skips the
    picture and leaves the cell's output and outcome as they were (no "Error in callback" in its stdout)."""
    interrupted = ("import nbexec_display\ndef interrupted(self):\n    raise KeyboardInterrupt\n"
                   "nbexec_display.Screen.changed = interrupted\nprint('mine')")
    with Session(on(cold, "runc")) as session:
        opened = session.run(WINDOW)  # the X server runs: the hook looks at the screen after every cell
        hooked = session.run(interrupted)
        after = session.run("print('next')")
    assert opened.ok and len(opened.images) == 1, opened.error
    assert hooked.ok and hooked.error is None, hooked.error
    assert (hooked.stdout, hooked.stderr, hooked.images) == ("mine\n", "", ()), (hooked.stdout, hooked.stderr)
    assert after.ok and after.stdout == "next\n"


def test_no_display_when_turned_off(cold: nbexec.SandboxConfig) -> None:
    code = ("import os, tkinter\nprint('DISPLAY' in os.environ)\ntry:\n    tkinter.Tk()\n"
            "except tkinter.TclError as exc:\n    print('refused:', exc)\n" + X_SERVER)
    result = execute_notebook(code, config=on(cold, "runc").replace(env={"NBEXEC_XVFB": "0"}))
    assert result.ok, result.error
    assert result.stdout.startswith("False\nrefused: no display name"), result.stdout
    assert "x servers [] None False" in result.stdout


# -- helpers: what the host sees -----------------------------------------------------------------------------


def _own_container(image: str) -> Any:
    """This test's sandbox: the one container of this process on ``image`` (the display overlay; other tests of
    this worker may keep sandboxes of other images, a warm pool among them)."""
    found = daemon.connect().containers.list(all=True, ignore_removed=True, filters={
        "label": f"{daemon.LABEL_OWNER}={daemon.owner()}", "ancestor": image})
    assert len(found) == 1, [c.name for c in found]
    return found[0]


def _cgroup_processes(container_id: str) -> dict[int, str]:
    """pid -> command line of every process in the sandbox's pids cgroup, read on the host."""
    for folder in (Path("/sys/fs/cgroup/pids/docker") / container_id,
                   Path("/sys/fs/cgroup/system.slice") / f"docker-{container_id}.scope"):
        if folder.is_dir():
            found = {}
            for pid in map(int, (folder / "cgroup.procs").read_text().split()):
                try:
                    found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                except OSError:
                    continue
            return found
    pytest.fail(f"no pids cgroup found for container {container_id}", pytrace=False)


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def _alive_as_xvfb(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"Xvfb")
    except OSError:
        return False


def _connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False

