"""Helpers shared by the examples: read .env, load a recorded conversation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def load_dotenv(path: Path = HERE.parent / ".env") -> None:
    """Put KEY=value lines of .env into os.environ (existing variables win)."""
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            os.environ.setdefault(key.strip(), value.strip().strip('"').strip("'"))


def recording(name: str) -> list[dict[str, Any]]:
    """The model replies stored in examples/recordings/<name>.json, in order."""
    data: list[dict[str, Any]] = json.loads((HERE / "recordings" / f"{name}.json").read_text())["responses"]
    return data


QUESTION = ("Make a table of 200 synthetic orders (region, units, price), compute revenue per region, "
            "save it as CSV and chart it. Give me a link to the CSV.")
