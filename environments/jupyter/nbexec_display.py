"""A display for code that opens windows, started when a GUI library is imported.

`nbexec-kernel` sets DISPLAY=:0 for the kernel and everything it starts, but no X server runs until some Python
process of the sandbox imports a library that opens windows (tkinter and so turtle and matplotlib's TkAgg, OpenCV,
Qt, wx, GTK, pygame, pyglet, pyautogui, ...). That import first starts Xvfb on :0 (as the sandbox user, no TCP
listener, in its own session so an interrupt leaves it alone) and waits until it accepts clients; once. Every
Python of the sandbox runs this check: the venv's `nbexec_display.pth` installs it at start-up. A sandbox that
never imports such a library pays one look-up per import and nothing else; one that does pays for Xvfb (about
50 ms of CPU and 20 MB) from then on.

Why not a listener on the X socket that starts the server on the first connection: the connection it accepted
would have to be relayed for its whole life (an X server cannot adopt an accepted connection), and a relay thread
inside the kernel deadlocks, because Tk opens its display while holding Python's global lock; a relay process
would cost every sandbox its memory.

After each cell the kernel looks at the screen if Xvfb runs: a window still open whose picture changed during the
cell comes back as a PNG of the root window (`after_cell`). NBEXEC_XVFB=0 in the sandbox's environment turns the
display off (no DISPLAY); NBEXEC_XVFB=1 starts Xvfb with the kernel. A DISPLAY set by the caller is left alone.
This runs inside the sandbox and is not trusted by the host: it only keeps the sandbox's own windows working.
"""

import os
import sys

DISPLAY = ":0"
SOCKET = "/tmp/.X11-unix/X0"
LOCK = "/tmp/.X11-unix/.nbexec-start"
SCREEN = "1280x1024x24"
START_TIMEOUT = 20.0
_servers = []
# Modules whose import means a window may be opened (the top-level name, or the whole name).
OPENS_WINDOWS = frozenset({
    "_tkinter", "cv2", "PyQt5", "PyQt6", "PySide2", "PySide6", "wx", "gi", "pygame", "pyglet", "Xlib",
    "pyautogui", "pynput", "mss", "kivy", "OpenGL", "vtkmodules", "pyvista",
})


def managed():
    """Whether this sandbox's display is the one started here (DISPLAY=:0 set by nbexec-kernel)."""
    return os.environ.get("DISPLAY") == DISPLAY and os.environ.get("NBEXEC_XVFB", "") != "0"


class _Finder:
    """A meta path finder that never finds anything: it starts the display before a GUI library is imported."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in OPENS_WINDOWS:
            _uninstall()
            start()
        return None


def install():
    """Start the display before the first GUI import of this process (the .pth file calls this)."""
    if managed() and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def running():
    """Whether an X server accepts clients on :0."""
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(SOCKET)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def start():
    """Start Xvfb on :0 unless it runs, and wait until it accepts clients; never raises (a GUI library then
    says it cannot open the display). One process starts it: the others wait on the lock."""
    import fcntl

    try:
        os.makedirs(os.path.dirname(SOCKET), mode=0o1777, exist_ok=True)
        lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return running() or _launch()
    except OSError:
        return False
    finally:
        os.close(lock)


def _launch():
    import select
    import subprocess
    import time

    read, write = os.pipe()
    try:
        server = subprocess.Popen(
            ["Xvfb", DISPLAY, "-screen", "0", SCREEN, "-nolisten", "tcp", "-displayfd", str(write)],
            pass_fds=(write,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
    finally:
        os.close(write)
    deadline, said = time.monotonic() + START_TIMEOUT, b""
    try:  # Xvfb writes its display number to -displayfd once it accepts clients; EOF means it exited
        while not said.endswith(b"\n") and select.select([read], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(read, 16)
            if not chunk:
                break
            said += chunk
    finally:
        os.close(read)
    if not said.endswith(b"\n"):
        server.kill()
        server.wait()
        return False
    _servers.append(server)  # kept for the life of this process; tini, the sandbox's init, reaps it after
    return True


class Screen:
    """Screenshots after cells: the root window when a window is open and its picture changed."""

    def __init__(self):
        self.last = None  # digest of the picture shown last

    def after_cell(self, *_):
        if not os.path.exists(SOCKET):  # no X server was ever started in this sandbox: nothing to look at
            return
        try:
            png = self.changed()
            if png is not None:
                from IPython.display import Image, display

                display(Image(data=png, format="png", metadata={"nbexec": {"screenshot": True}}))
        except (Exception, KeyboardInterrupt):  # never an error in the user's cell for a picture it did not ask
            pass  # for; an interrupt that lands here (a second one, after the cell) only skips the picture

    def changed(self):
        """The screen as PNG bytes when it shows something new; None when it is empty, unchanged or unreadable."""
        import hashlib
        import io

        try:
            from PIL import ImageGrab

            image = ImageGrab.grab(xdisplay=DISPLAY)
        except Exception:  # Pillow without X support, or the server is gone: no picture, no failure
            return None
        if image.getbbox() is None:  # all black: no window is open
            self.last = None
            return None
        digest = hashlib.sha256(image.tobytes()).digest()
        if digest == self.last:
            return None
        self.last = digest
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()


def watch(shell):
    """Screenshot windows left open at the end of each cell (IPython's post_run_cell event)."""
    if managed():
        shell.events.register("post_run_cell", Screen().after_cell)
