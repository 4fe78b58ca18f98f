"""What `nbexec run` writes while it works: outputs as they arrive, batch progress, and colour only where a
person reads it (a terminal, NO_COLOR unset; never into a pipe or a file)."""

from __future__ import annotations

import os
import sys
from typing import IO, Any

import click

from nbexec.notebook.outputs import clean

from . import render

_STATUS_COLOURS = {"passed": "green", "failed": "red", "timeout": "red", "error": "red", "skipped": "yellow"}


def colour_for(stream: IO[str]) -> bool:
    """Colour on this stream: it is a terminal, NO_COLOR is unset or empty (no-color.org) and TERM is not dumb."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class Painter:
    """click.style for stdout and stderr, each coloured only when `colour_for` says so."""

    def __init__(self) -> None:
        self.out, self.err = colour_for(sys.stdout), colour_for(sys.stderr)

    def style(self, text: str, *, err: bool = True, **styles: Any) -> str:
        return click.style(text, **styles) if (self.err if err else self.out) else text

    def status(self, status: str, text: str, *, err: bool = False) -> str:
        """``text`` in the colour of a batch status (passed green, failed red, skipped yellow)."""
        return self.style(text, err=err, fg=_STATUS_COLOURS.get(status), bold=status != "passed")

    def echo(self, text: str, *, err: bool = False, nl: bool = True) -> None:
        # color=None lets click strip styles that reach a pipe; they are only added for a terminal anyway.
        click.echo(text, err=err, nl=nl, color=(self.err if err else self.out) or None)


class Live:
    """The ``on_output`` hook of a single run: each output printed and flushed as it arrives (click.echo
    flushes), the code's stdout on stdout and its stderr on stderr. Runs on the thread that reads the kernel."""

    def __init__(self, painter: Painter) -> None:
        self.painter = painter
        self.line_open = False

    def __call__(self, index: int, output: Any) -> None:
        where, text = render.output_lines(output)
        if not where or not text:
            return
        self.line_open = not text.endswith("\n")
        self.painter.echo(text, err=where == "stderr", nl=False)

    def finish(self) -> None:
        """End with a newline when the code's last text did not (what follows starts a line)."""
        if self.line_open:
            self.painter.echo("")
            self.line_open = False


class Progress:
    """A live status line on a terminal; one line per finished file otherwise (CI logs); nothing with quiet."""

    def __init__(self, total: int, *, live: bool, quiet: bool, painter: Painter) -> None:
        self.total, self.live, self.quiet, self.painter = total, live and not quiet, quiet, painter
        self.done = self.failed = 0
        self.running: list[str] = []

    def event(self, kind: str, subject: Any) -> None:
        if kind == "start":
            self.running.append(str(subject))
        else:
            self.done += 1
            self.failed += subject.status != "passed"
            if subject.name in self.running:
                self.running.remove(subject.name)
            if not self.live and not self.quiet:
                note = f" ({subject.message.splitlines()[0][:100]})" if subject.message else ""
                status = self.painter.status(subject.status, f"{subject.status.upper():7}", err=True)
                self.painter.echo(f"[{self.done}/{self.total}] {status} {subject.name} "
                                  f"{subject.duration_s:.1f} s{note}", err=True)
        if self.live:
            line = f"[{self.done}/{self.total}] {self.failed} failed; running: {', '.join(self.running)[:60]}"
            click.echo(f"\r\x1b[K{line}", err=True, nl=False)

    def close(self) -> None:
        if self.live:
            click.echo("\r\x1b[K", err=True, nl=False)


def footer(result: Any, painter: Painter, *, most: int = 5) -> None:
    """After a single run, on stderr and dimmed: nbexec's own notes on the run (a `sys.exit` that skipped later
    cells, a withheld .env, dropped widget state; at most ``most`` of them, each on one line of at most 200
    characters), then the node it ran on and where the notebook is."""
    notes = [" ".join(clean(note).split())[:200] for note in result.notes[:most]]
    more = len(result.notes) - len(notes)
    lines = [f"note: {note}" for note in notes] + ([f"note: ... and {more} more (--json shows them)"] if more else [])
    lines += [f"node: {result.node}"] if result.node else []
    for line in [*lines, f"notebook: {result.notebook_path}"]:
        painter.echo(painter.style(line, dim=True), err=True)
