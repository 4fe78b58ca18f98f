"""Attack (#36): parameter values are data in every kernel. Bash's kernel types its cells into readline, which acts
on control characters (Ctrl-U erased an assignment and ran the rest of the value); each hostile value must come
back byte for byte, and a value shaped as a command must run nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nbformat import NotebookNode

import nbexec
from nbexec import languages, notebook
from nbexec.errors import ConfigError
from nbexec.notebook import assignments, parameters

from .conftest import IMAGE, KERNELS, own_containers

# Every byte readline, a terminal or a quote could act on, a trailing newline, and text outside ASCII.
HOSTILE = ("a\x15b\tc\x03d\x04e\x1bf\rg\nh\x7fi\x08j\x01k\x12l\x16m\x1a ' \" \\ $HOME `id` $(id) !! ~ * "
           "é ☃ 😀\n")
PWNED = "x\x15touch /mnt/data/pwned\n"

HEX = {  # per language: the parameters cell's defaults, and a cell printing each value's UTF-8 bytes in hex
    "python": ("s = ''; p = ''; l = []", "for v in (s, p, *l): print(v.encode('utf-8').hex())"),
    "r": ("s <- ''; p <- ''; l <- list()",
          'for (v in c(s, p, unlist(l))) cat(paste(as.character(charToRaw(enc2utf8(v))), collapse = ""), "\\n")'),
    "deno": ("let s = ''\nlet p = ''\nlet l: string[] = []",
             "for (const v of [s, p, ...l]) console.log(Array.from(new TextEncoder().encode(v))"
             ".map((b) => b.toString(16).padStart(2, '0')).join(''))"),
    "bash": ("s=''; p=''; l=()",
             """for v in "$s" "$p" "${l[@]}"; do printf '%s' "$v" | od -An -tx1 | tr -d ' \\n'; echo; done"""),
}


def _config(language: str) -> nbexec.SandboxConfig:
    image = {"image": IMAGE} if language == "python" else {"kernels_image": KERNELS}
    return nbexec.SandboxConfig(language=language, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=3,
                                **image)  # type: ignore[arg-type]


def _notebook(language: str, defaults: str, use: str) -> NotebookNode:
    spec = languages.get(language).spec
    cell = {"id": "c1", "cell_type": "code", "metadata": {"tags": ["parameters"]}, "execution_count": None,
            "outputs": [], "source": defaults}
    nb = notebook.from_json(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": spec},
                                        "cells": [cell]}))
    nb.cells.append(notebook.from_script(use, language).cells[0])
    return nb


@pytest.mark.parametrize("language", list(HEX))
def test_hostile_values_reach_each_kernel_byte_for_byte(cleanup_ledger: None, kernels_image: str,
                                                         language: str) -> None:
    defaults, use = HEX[language]
    nb = parameters.inject(_notebook(language, defaults, use), {"s": HOSTILE, "p": PWNED, "l": ["\t", "x\x15y"]})
    result = nbexec.execute_notebook(nb, config=_config(language))
    assert result.ok, (result.text, result.error)
    expected = [v.encode("utf-8").hex() for v in (HOSTILE, PWNED, "\t", "x\x15y")]
    assert result.text.split() == expected, result.text
    assert not (Path(result.output_dir) / "pwned").exists() and "pwned" not in [f.name for f in result.files]


@pytest.mark.parametrize("language", ["r", "bash"])
def test_a_nul_is_refused_before_any_sandbox(cleanup_ledger: None, language: str) -> None:
    before = set(own_containers())
    with pytest.raises(ConfigError, match="NUL"):
        parameters.inject(_notebook(language, "s = 1", "1"), {"s": "a\0b"})
    assert set(own_containers()) <= before


def test_bash_parameters_are_typed_as_printable_ascii() -> None:
    """What readline sees: printable ASCII only, so no key of it is an editing command."""
    source = assignments.render(languages.get("bash"), {"s": HOSTILE, "l": [PWNED, 3, None]})
    assert all(" " <= c <= "~" for c in source.replace("\n", "")), source
