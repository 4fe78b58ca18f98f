"""Artifacts in Azure Blob Storage, against Azurite: SAS links that read the exact bytes and nothing more."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs

import pytest

import nbexec
from nbexec.stores.storage import AzureBlobSettings, AzureBlobStore

from .azurite import KEY, Azurite
from .conftest import wait_until


def fetch(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, method=method, data=data, headers={"x-ms-blob-type": "BlockBlob"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), ""


def store_for(azurite: Azurite, **options: object) -> AzureBlobStore:
    container = f"t{time.time_ns()}"
    return AzureBlobStore(AzureBlobSettings(connection_string=azurite.connection_string, container=container,
                                            **options))  # type: ignore[arg-type]


PRODUCE = (
    "import matplotlib.pyplot as plt, os\n"
    "open('/mnt/data/table.csv', 'w').write('a,b\\n1,2\\n')\n"
    "os.makedirs('/mnt/data/deep', exist_ok=True)\n"
    "open('/mnt/data/deep/blob.bin', 'wb').write(bytes(range(256)) * 40)\n"
    "os.symlink('/etc/passwd', '/mnt/data/link')\n"
    "plt.plot([1, 3, 2]); plt.show()\n"
    "print('see [the table](sandbox:/mnt/data/table.csv)')\n"
)


def test_files_and_images_upload_with_read_only_links(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    store = store_for(azurite)
    result = nbexec.execute_notebook(PRODUCE, config=config, store=store)
    assert result.ok, result.error
    statuses = {u.name: u.status for u in result.uploads}
    assert statuses == {"table.csv": "uploaded", "deep/blob.bin": "uploaded", "images/cell0-1.png": "uploaded"}
    for item in result.files:
        assert item.url is not None
        status, body, content_type = fetch(item.url)
        assert status == 200 and hashlib.sha256(body).hexdigest() == item.sha256
        assert body == Path(item.path).read_bytes()
        assert content_type == item.mime
        assert f"/nbexec/{result.execution_id}/{item.name}?" in item.url
    image = result.images[0]
    assert image.url and fetch(image.url)[1] == Path(image.path).read_bytes()
    table_url = next(f.url for f in result.files if f.name == "table.csv")
    assert f"[the table]({table_url})" in result.stdout  # sandbox: link rewritten
    assert nbexec.rewrite_links("final: sandbox:/mnt/data/table.csv", result) == f"final: {table_url}"
    assert [s.name for s in result.skipped_files] == ["link"]
    data = json.loads(result.to_json())
    assert {f["name"]: f["url"] for f in data["files"]}["table.csv"] == table_url
    assert KEY not in result.to_json()


def test_sas_refuses_writes_and_expires(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    store = store_for(azurite, sas_expiry_s=2)
    result = nbexec.execute_notebook("open('/mnt/data/x.txt', 'w').write('x')", config=config, store=store)
    url = result.files[0].url
    assert url is not None and fetch(url)[0] == 200
    assert fetch(url, method="PUT", data=b"overwritten")[0] == 403
    assert fetch(url)[1] == b"x"
    # The SAS ends 2 s after upload; allow the emulator's clock some slack.
    wait_until(lambda: fetch(url)[0] == 403, 30, "the SAS did not expire")


def test_a_sas_reads_only_its_own_blob(azurite: Azurite) -> None:
    """Each link is a blob SAS (sr=b) for its blob: it reads neither another blob nor the container's list."""
    store = store_for(azurite)
    first = store.upload("nbexec/run-1/a.txt", b"a", "text/plain")
    second = store.upload("nbexec/run-2/b.txt", b"b", "text/plain")
    blob_a, sas_a = first.split("?", 1)
    assert parse_qs(sas_a)["sr"] == ["b"] and parse_qs(sas_a)["sp"] == ["r"]
    assert fetch(first)[:2] == (200, b"a") and fetch(second)[:2] == (200, b"b")
    assert fetch(f"{second.split('?', 1)[0]}?{sas_a}")[0] == 403
    container_url = blob_a.rsplit("/nbexec/run-1/", 1)[0]
    assert fetch(f"{container_url}?restype=container&comp=list&{sas_a}")[0] == 403


def test_store_unreachable_keeps_files_and_reports(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    from .azurite import free_port

    dead = AzureBlobStore(AzureBlobSettings(
        connection_string=azurite.connection_string.replace(str(azurite.port), str(free_port())), retries=1,
        timeout_s=2))
    started = time.monotonic()
    result = nbexec.execute_notebook("open('/mnt/data/kept.txt', 'w').write('kept')", config=config, store=dead)
    assert time.monotonic() - started < 60
    assert result.ok
    assert [(u.name, u.status) for u in result.uploads] == [("kept.txt", "failed")]
    assert "failed" in (result.uploads[0].reason or "") and KEY not in (result.uploads[0].reason or "")
    assert Path(result.files[0].path).read_text() == "kept" and result.files[0].url is None


def test_stopped_azurite_mid_way(config: nbexec.SandboxConfig) -> None:
    from . import azurite as azurite_module

    binary = azurite_module.find_binary()
    assert binary, "Azurite is needed"
    server = azurite_module.start(binary)
    store = AzureBlobStore(AzureBlobSettings(connection_string=server.connection_string, retries=1, timeout_s=2))
    first = nbexec.execute_notebook("open('/mnt/data/a.txt', 'w').write('a')", config=config, store=store)
    assert first.uploads[0].status == "uploaded"
    server.stop()
    second = nbexec.execute_notebook("open('/mnt/data/b.txt', 'w').write('b')", config=config, store=store)
    assert second.uploads[0].status == "failed" and Path(second.files[0].path).read_text() == "b"


def test_upload_caps_are_reported(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    from nbexec.stores import uploads

    result = nbexec.execute_notebook("open('/mnt/data/big.bin', 'wb').write(b'x' * 5000)\n"
                                     "open('/mnt/data/small.bin', 'wb').write(b'x')", config=config)
    published = uploads.publish(result, store_for(azurite), limits=uploads.UploadLimits(max_file=1000))
    assert {u.name: u.status for u in published.uploads} == {"big.bin": "skipped", "small.bin": "uploaded"}


def test_session_uploads_only_new_and_changed(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    with nbexec.Session(config, store=store_for(azurite)) as session:
        first = session.run("open('a.txt', 'w').write('1'); open('b.txt', 'w').write('1')")
        assert sorted(u.name for u in first.uploads) == ["a.txt", "b.txt"]
        second = session.run("open('b.txt', 'w').write('2'); open('c.txt', 'w').write('3')")
        assert sorted(u.name for u in second.uploads) == ["b.txt", "c.txt"]
        b_url = next(f.url for f in second.files if f.name == "b.txt")
        assert b_url and fetch(b_url)[1] == b"2"


def test_secrets_stay_out_of_reprs_and_logs(azurite: Azurite, caplog: pytest.LogCaptureFixture) -> None:
    store = store_for(azurite)
    assert KEY not in repr(store) and KEY not in repr(store.settings)
    caplog.set_level(logging.DEBUG)
    url = store.upload("n/x.txt", b"x", "text/plain")
    assert fetch(url)[1] == b"x"
    assert KEY not in caplog.text


def test_cli_upload_azure_prints_urls(cleanup_ledger: None, azurite: Azurite, tmp_path: Path) -> None:
    from .test_cli import nbexec as run_cli

    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string, "AZURE_BLOB_CONTAINER_NAME": "cli"}
    done = run_cli("run", "--upload", "azure", "--json", "-", cwd=tmp_path, env=env,
                   stdin="open('/mnt/data/r.txt', 'w').write('r')\n")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert fetch(data["files"][0]["url"])[1] == b"r"
    human = run_cli("run", "--store", "azure", "-", cwd=tmp_path, env=env, stdin="open('/mnt/data/h.txt','w')\n")
    assert "h.txt (0 bytes) -> http://127.0.0.1" in human.stdout
    missing = run_cli("run", "--upload", "azure", "-", cwd=tmp_path, env={"AZURE_STORAGE_CONNECTION_STRING": ""},
                      stdin="1\n")
    assert missing.returncode == 2 and "AZURE_STORAGE_CONNECTION_STRING" in missing.stderr


ACTIVE_PAGE = b"<html><body><script>document.title = 'ran'</script></body></html>"
ACTIVE_SVG = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(document.domain)</script></svg>'


def headers_of(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        response.read()
        return {k.lower(): v for k, v in response.headers.items()}


@pytest.mark.parametrize(
    ("name", "mime", "content", "attachment"),
    [("page.html", "text/html", ACTIVE_PAGE, True),
     ("drawing.svg", "image/svg+xml", ACTIVE_SVG, True),
     ("app.js", "text/javascript", b"alert(1)", True),
     ("feed.xml", "application/xml", b"<a/>", True),
     ("page.xhtml", "application/xhtml+xml", ACTIVE_PAGE, True),
     ("looks-plain.html", "text/plain", ACTIVE_PAGE, True),  # the extension decides too
     ("notes.txt", "text/html; charset=utf-8", ACTIVE_PAGE, True),  # and the MIME, parameters and all
     ("noext", "image/SVG+XML", ACTIVE_SVG, True),
     ("table.csv", "text/csv", b"a,b\n1,2\n", False),
     ("chart.png", "image/png", b"\x89PNG\r\n\x1a\n", False)],
    ids=["html", "svg", "js", "xml", "xhtml", "html-named-plain", "plain-named-html", "mime-case", "csv", "png"])
def test_active_uploads_are_served_as_attachments(azurite: Azurite, name: str, mime: str, content: bytes,
                                                  attachment: bool) -> None:
    url = store_for(azurite).upload(f"nbexec/x/{name}", content, mime)
    disposition = headers_of(url).get("content-disposition", "")
    assert disposition.startswith("attachment") is attachment, disposition


def test_active_files_from_an_execution_are_attachments(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    code = (f"open('/mnt/data/page.html', 'wb').write({ACTIVE_PAGE!r})\n"
            f"open('/mnt/data/pic.svg', 'wb').write({ACTIVE_SVG!r})\n"
            "from IPython.display import SVG, display\n"
            f"display(SVG({ACTIVE_SVG.decode()!r}))\n")
    result = nbexec.execute_notebook(code, config=config, store=store_for(azurite))
    assert result.ok, result.error
    urls = [f.url for f in result.files] + [i.url for i in result.images]
    assert len(urls) == 3 and all(urls)
    for url in urls:
        assert url is not None and headers_of(url).get("content-disposition", "").startswith("attachment"), url


# -- HTML reports: outputs are hostile markup too -----------------------------------------------------------------

HOSTILE_OUTPUTS = '''
from IPython.display import HTML, SVG, Markdown, Javascript, display
display(HTML("<script>window.PWNED_script = 1</script><p>kept text</p>"))
display(HTML('<img src="x" onerror="window.PWNED_onerror = 1">'))
display(HTML('<a href="javascript:window.PWNED_href = 1">click</a>'))
display(HTML('<a href=" JaVaScRiPt:window.PWNED_href2 = 1">click</a>'))
display(HTML('<svg xmlns="http://www.w3.org/2000/svg" onload="window.PWNED_svgload = 1">'
             '<script>window.PWNED_svgscript = 1</script></svg>'))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg"><script>window.PWNED_svg = 1</script>'
            '<a xlink:href="javascript:window.PWNED_xlink = 1" xmlns:xlink="http://www.w3.org/1999/xlink">'
            '<text>x</text></a></svg>'))
display(Markdown("[md link](javascript:window.PWNED_markdown = 1) <script>window.PWNED_mdscript = 1</script>"))
display(Javascript("window.PWNED_javascript = 1"))
import pandas as pd
display(pd.DataFrame({"column": ["cell"]}))
display({"text/html": "<iframe srcdoc=\\"<script>parent.PWNED_iframe = 1</script>\\"></iframe>"}, raw=True)
'''


class _Markup:
    """Every element, attribute and script body of an HTML page, as a browser's tokenizer sees them."""

    def __init__(self, page: str) -> None:
        from html.parser import HTMLParser

        self.scripts: list[str] = []
        self.attributes: list[tuple[str, str, str]] = []
        self.tags: list[str] = []
        markup = self

        class Parser(HTMLParser):
            in_script = False

            def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
                markup.tags.append(tag)
                markup.attributes += [(tag, name, value or "") for name, value in attrs]
                self.in_script = tag == "script"

            def handle_endtag(self, tag: str) -> None:
                self.in_script = False

            def handle_data(self, data: str) -> None:
                if self.in_script:
                    markup.scripts.append(data)

        Parser(convert_charrefs=True).feed(page)


def test_html_reports_neutralise_scripts_and_handlers(cleanup_ledger: None, tmp_path: Path) -> None:
    import nbformat

    from .test_cli import nbexec as run_cli

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(HOSTILE_OUTPUTS)])
    nbformat.write(nb, tmp_path / "hostile.ipynb")
    done = run_cli("run", "hostile.ipynb", "--html-dir", "html", "--output-dir", "runs", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "html" / "hostile.html").read_text()
    markup = _Markup(page)
    assert "<p>kept text</p>" in page and "table" in markup.tags  # passive markup and tables still render
    assert [s for s in markup.scripts if "PWNED" in s] == [], "a script from the outputs survived"
    assert [a for a in markup.attributes if a[1].startswith("on")] == [], "an event handler survived"
    links = [a for a in markup.attributes if a[1] in ("href", "src", "xlink:href", "action", "formaction")]
    assert [a for a in links if a[2].strip().lower().startswith("javascript:")] == [], "a javascript: link survived"
    assert [a for a in markup.attributes if a[1] == "srcdoc"] == [], "an iframe srcdoc survived"
    assert "iframe" not in markup.tags


def test_tool_handlers_with_an_uploading_store_keep_no_run_folder(config: nbexec.SandboxConfig,
                                                                   azurite: Azurite) -> None:
    """A tool handler that serves many calls: once the reply is built and the files uploaded, the one-shot's
    folder is gone from the host; the link in the reply still reads the file."""
    from nbexec.integrations.toolcall import handle_anthropic_tool_use

    seen: list[nbexec.ExecutionResult] = []
    code = "open('/mnt/data/out.txt', 'w').write('kept in the store')\nprint('done')"
    reply = handle_anthropic_tool_use({"id": "t1", "input": {"code": code}}, config=config,
                                      store=store_for(azurite), on_result=seen.append)
    assert not reply["is_error"] and seen, reply
    result = seen[0]
    assert not Path(result.output_dir).exists(), "the run's folder stayed on the host"
    url = result.files[0].url
    assert url and url.startswith("http")
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.read() == b"kept in the store"
    local = handle_anthropic_tool_use({"id": "t2", "input": {"code": code}}, config=config, on_result=seen.append)
    assert not local["is_error"] and Path(seen[1].output_dir).is_dir(), "a local store's files must stay"


def test_cli_checks_the_store_before_any_code_runs(azurite: Azurite, tmp_path: Path) -> None:
    """A missing extra, a store nobody answers at and a wrong key each stop the run before a sandbox starts."""
    from .azurite import free_port
    from .test_cli import nbexec as run_cli

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "azure.py").write_text("")  # `import azure.storage.blob` fails as without the azure extra
    code = "open('/mnt/data/ran.txt', 'w').write('ran')\n"
    good = azurite.connection_string
    cases = [
        ({"PYTHONPATH": f"{shadow}:{os.environ.get('PYTHONPATH', '')}", "AZURE_STORAGE_CONNECTION_STRING": good},
         2, "pip install 'nbexec-sandbox[azure]'"),
        ({"AZURE_STORAGE_CONNECTION_STRING": good.replace(str(azurite.port), str(free_port()))}, 3,
         "is not reachable"),
        ({"AZURE_STORAGE_CONNECTION_STRING": good.replace(KEY, KEY[:-8] + "AAAAAAA=")}, 2, "refused the credentials"),
    ]
    for env, exit_code, message in cases:
        done = run_cli("run", "--upload", "azure", "--output-dir", "out", "-", cwd=tmp_path, env=env, stdin=code)
        assert done.returncode == exit_code, done.stderr
        assert message in done.stderr and KEY not in done.stderr
        assert not (tmp_path / "out").exists()  # nothing ran
