"""How the runtime image starts its kernel: no X server until a window is opened (tests/test_display.py) or asked
for, and what the launcher skips at start-up stays usable by the code."""

from __future__ import annotations

import nbexec
from nbexec import execute_notebook

PROCESSES = ("import os\nnames = []\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
             "    try:\n        names.append(open(f'/proc/{pid}/comm').read().strip())\n"
             "    except OSError:\n        pass\n")

# An X11 connection set-up (little-endian, protocol 11.0, no authorisation): the server answers 1 when it
# accepts the client. Waits up to 10 s for the server, which starts in the background.
X_HANDSHAKE = (
    "import socket, struct, time\n"
    "deadline = time.monotonic() + 10\n"
    "while True:\n"
    "    try:\n"
    "        s = socket.socket(socket.AF_UNIX)\n"
    "        s.connect('/tmp/.X11-unix/X' + os.environ['DISPLAY'].split(':')[1])\n"
    "        break\n"
    "    except OSError:\n"
    "        if time.monotonic() > deadline:\n            raise\n"
    "        time.sleep(0.05)\n"
    "s.sendall(b'l\\0' + struct.pack('<HHHH', 11, 0, 0, 0) + b'\\0\\0')\n"
    "print('X server answered', s.recv(1)[0])\n"
)


def test_no_x_server_by_default(config: nbexec.SandboxConfig) -> None:
    result = execute_notebook(PROCESSES + "print(sorted(set(names)), os.environ.get('DISPLAY'))", config=config)
    assert result.ok, result.error
    assert "Xvfb" not in result.stdout and result.stdout.rstrip().endswith(":0"), result.stdout


def test_a_display_when_asked_for(cold: nbexec.SandboxConfig) -> None:
    result = execute_notebook(PROCESSES + X_HANDSHAKE + "print('Xvfb' in names, os.environ['DISPLAY'])",
                              config=cold.replace(env={"NBEXEC_XVFB": "1"}, warm_imports=()))
    assert result.ok, result.error
    assert result.stdout == "X server answered 1\nTrue :0\n", result.stdout


def test_what_the_launcher_skips_stays_importable(config: nbexec.SandboxConfig) -> None:
    code = ("import sys\nprint('debugpy' in sys.modules, 'jupyter_client.manager' in sys.modules)\n"
            "import debugpy, jupyter_client\nprint(jupyter_client.__version__.split('.')[0].isdigit())\n"
            "from jupyter_client import BlockingKernelClient, KernelManager\n"
            "print(debugpy.__name__, BlockingKernelClient.__name__, jupyter_client.KernelManager is KernelManager)")
    result = execute_notebook(code, config=config)
    assert result.ok, result.error
    assert result.stdout == "False False\nTrue\ndebugpy BlockingKernelClient True\n", result.stdout
