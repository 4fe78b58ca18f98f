"""Reports, saved notebooks and the playground run no code from the sandbox, and load nothing the code named.

Attacked as a reader of hostile code's results would meet them: a real run of a hostile notebook (real Docker, real
kernel, real ipywidgets) through `nbexec run --html-dir`, its HTML report opened in Debian's headless Chromium, its
saved notebook read back, and the same hostile code run in the playground of a real `nbexec serve`. The code names a
loopback HTTP server this test runs (as widget modules by URL, remote images, styles, scripts, ...) and npm names a
CDN would serve. The judges are outside the page: the server must receive zero requests, and Chromium's own
network log must show no request that left the page's file (or, for the playground, its origin). Every other host
name resolves nowhere (``--host-resolver-rules``), so no test traffic leaves this machine; an attempt still shows
in the network log. A positive control shows the same browser does reach the server when a page asks it to.
"""

from __future__ import annotations

import base64
import html
import http.server
import json
import socketserver
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest

from ..browser import chromium
from ..conftest import settle, wait_until
from ..test_cli import nbexec as run_cli

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# What a viewer may load for a saved notebook: the modules the widget HTML manager and JupyterLab bundle, at the
# exact versions ipywidgets 7 and 8 name (no range, no path, no URL).
PINNED = {"@jupyter-widgets/base": {"1.0.0", "1.1.0", "1.2.0", "2.0.0"},
          "@jupyter-widgets/controls": {"1.0.0", "1.1.0", "1.2.0", "1.4.0", "1.5.0", "2.0.0"},
          "@jupyter-widgets/output": {"1.0.0"}}
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()


# -- the judges: a loopback server that counts what reaches it, and Chromium's network log ------------------------

@dataclass
class Recorder:
    """A loopback HTTP server that answers 404 to everything and remembers every connection and request line."""

    server: socketserver.ThreadingTCPServer
    connections: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    seen: dict[str, list[str]] = {"connections": [], "requests": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def setup(self) -> None:
            seen["connections"].append(str(self.client_address))
            super().setup()

        def do_GET(self) -> None:
            seen["requests"].append(f"{self.command} {self.path}")
            self.send_error(404)

        do_POST = do_HEAD = do_OPTIONS = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    recording = Recorder(server, seen["connections"], seen["requests"])
    try:
        yield recording
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium("--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--no-first-run", "--disable-extensions", "--window-size=1100,1250",
                  # Any name resolves nowhere: nothing leaves the machine, and an attempt still shows in the log.
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                  logs=("performance", "browser")) as driver:
        yield driver


def _requests(driver: Any) -> list[str]:
    """URLs the page asked for since the last call that were not blocked before they were sent (Chromium's
    network log: a request blocked by the page's Content-Security-Policy sends no byte)."""
    asked: dict[str, str] = {}
    blocked: set[str] = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            asked[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.loadingFailed" and params.get("blockedReason"):
            blocked.add(params["requestId"])
    return [url for request_id, url in asked.items() if request_id not in blocked]


def _open(driver: Any, url: str, recorder: Recorder | None = None) -> None:
    if recorder is not None:  # judge this page alone
        recorder.connections.clear()
        recorder.requests.clear()
    driver.get_log("performance")  # forget what came before
    driver.get(url)
    wait_until(lambda: driver.execute_script("return document.readyState") == "complete", 60,
               f"{url} never finished loading")
    settle(lambda: False, 1.0)  # a page that runs no script asks for nothing after `load`; one that does, might


def _own(url: str, allowed: tuple[str, ...]) -> bool:
    return url.startswith(allowed)


def test_the_judges_see_a_request_when_a_page_makes_one(recorder: Recorder, browser: Any, tmp_path: Path) -> None:
    """Positive control: the same browser, flags and server do see a page's image and CDN script requests."""
    page = tmp_path / "control.html"
    page.write_text(f'<!doctype html><img src="{recorder.url}/control.png">'
                    '<script src="https://cdn.jsdelivr.net/npm/control@1/x.js"></script>')
    _open(browser, page.as_uri(), recorder)
    wait_until(lambda: "GET /control.png" in recorder.requests, 30, "the loopback server never saw the control")
    urls = _requests(browser)
    assert f"{recorder.url}/control.png" in urls and "https://cdn.jsdelivr.net/npm/control@1/x.js" in urls, urls


# -- the hostile code ----------------------------------------------------------------------------------------------

WIDGETS = '''
import ipywidgets as w
from traitlets import Unicode
from IPython.display import display

class Remote(w.DOMWidget):  # a model and a view module named by URL
    _model_name = Unicode("RemoteModel").tag(sync=True)
    _model_module = Unicode("{url}/widget-model.js").tag(sync=True)
    _model_module_version = Unicode("1.0.0").tag(sync=True)
    _view_name = Unicode("RemoteView").tag(sync=True)
    _view_module = Unicode("{url}/widget-view.js").tag(sync=True)
    _view_module_version = Unicode("1.0.0").tag(sync=True)

class FromNpm(w.DOMWidget):  # an npm name a CDN would serve, at any version
    _model_name = Unicode("EvilModel").tag(sync=True)
    _model_module = Unicode("evil-widgets").tag(sync=True)
    _model_module_version = Unicode("*").tag(sync=True)
    _view_name = Unicode("EvilView").tag(sync=True)
    _view_module = Unicode("evil-widgets").tag(sync=True)
    _view_module_version = Unicode("^1.0.0").tag(sync=True)

class Walker(w.IntSlider):  # the real module name, with a version that walks the CDN's paths
    _view_module_version = Unicode("2.0.0/../../evil-widgets@1.0.0/dist").tag(sync=True)

display(Remote(), FromNpm(), Walker())
display(w.HTML('<img src="{url}/html-widget" onerror="window.PWNED_widget = 1">'))
display(w.Image(value=b"{url}/image-widget", format="url"))
label = w.HTML("styled")
label.style.background = "url({url}/widget-style)"
display(label)
out = w.Output()
out.outputs = ({{"output_type": "display_data", "metadata": {{}}, "data": {{
    "application/javascript": "fetch('{url}/output-widget-js')",
    "text/html": "<img src={url}/output-widget-html onerror=window.PWNED_output=1>", "text/plain": "o"}}}},)
display(out)
honest = w.IntSlider(value=5, description="kept")
honest.layout.border = "1px solid red"
display(honest)
'''

OUTPUTS = '''
from IPython.display import HTML, SVG, Javascript, Latex, Markdown, display
display(Markdown("![remote]({url}/markdown-output.png) and <img src='{url}/markdown-html'>"))
display(HTML('<img src="{url}/html-img"><link rel="stylesheet" href="{url}/html-link">'
             '<style>@import url({url}/html-style);</style><p style="background:url({url}/html-attr)">p</p>'
             '<table background="{url}/html-table"><tr><td>kept cell</td></tr></table>'
             '<video poster="{url}/html-video"></video><object data="{url}/html-object"></object>'
             '<meta http-equiv="refresh" content="0;url={url}/html-refresh"><base href="{url}/html-base/">'
             '<a href="{url}/html-anchor" ping="{url}/html-ping">a link</a>'
             '<img srcset="{url}/html-srcset 1x"><iframe src="{url}/html-iframe"></iframe>'))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
            '<image href="{url}/svg-image" width="1" height="1"/><use xlink:href="{url}/svg-use#x"/>'
            '<style>@import url({url}/svg-style);</style></svg>'))
display(Javascript("fetch('{url}/javascript-output'); window.PWNED_javascript = 1"))
display(Latex("$x^2$ \\\\href{{{url}/latex}}{{l}}"))
display({{"text/vnd.mermaid": "graph TD; A-->B", "text/plain": "mermaid"}}, raw=True)
display({{"image/png": "{png}", "text/plain": "image"}}, raw=True,
        metadata={{"image/png": {{"width": '1"><img src="{url}/image-width', "height": 1}}}})
print("the hostile outputs ran")
'''


def hostile_notebook(url: str) -> nbformat.NotebookNode:
    """A notebook whose every part is hostile: metadata, markdown, raw and code cells, and the code's outputs."""
    markdown = nbformat.v4.new_markdown_cell(
        f"![remote]({url}/markdown-cell.png) <img src='{url}/markdown-cell-html'> [link]({url}/markdown-link)\n\n"
        "![attached](attachment:a.png)")
    markdown.attachments = {"a.png": {"image/png": PNG}, "b.svg": {"image/svg+xml": f"<svg><image href='{url}/x'/>"}}
    raw = nbformat.v4.new_raw_cell(f"<img src='{url}/raw-cell'><script>fetch('{url}/raw-script')</script>")
    raw.metadata["raw_mimetype"] = "text/html"
    widgets = nbformat.v4.new_code_cell(WIDGETS.format(url=url))
    widgets.metadata["tags"] = [f'"><img src="{url}/cell-tag">']
    outputs = nbformat.v4.new_code_cell(OUTPUTS.format(url=url, png=PNG))
    nb = nbformat.v4.new_notebook(cells=[markdown, raw, widgets, outputs])
    nb.metadata["title"] = f'</title><meta http-equiv="refresh" content="0;url={url}/title">'
    nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0, "state": {
        "planted": {"model_name": "PlantedModel", "model_module": f"{url}/planted.js", "model_module_version": "1",
                    "state": {"_model_name": "PlantedModel", "_model_module": f"{url}/planted.js",
                              "_model_module_version": "1"}}}}}
    return nb


@dataclass(frozen=True)
class HostileRun:
    folder: Path
    report: Path
    notebook: Path
    result: dict[str, Any]


@pytest.fixture(scope="module")
def hostile_run(docker_ready: None, recorder: Recorder, tmp_path_factory: pytest.TempPathFactory) -> HostileRun:
    folder = tmp_path_factory.mktemp("reports")
    nbformat.write(hostile_notebook(recorder.url), folder / "hostile.ipynb")
    recorder.connections.clear()
    recorder.requests.clear()
    done = run_cli("run", "hostile.ipynb", "--json", "--html-dir", "html", "--output-dir", "runs", cwd=folder)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)["results"][0]["result"]
    assert "the hostile outputs ran" in result["stdout"], result["stdout"]
    assert (recorder.connections, recorder.requests) == ([], []), "the sandbox itself reached the loopback server"
    return HostileRun(folder, folder / "html" / "hostile.html", folder / "runs" / "hostile" / "notebook.ipynb",
                      result)


def test_a_report_of_hostile_code_makes_no_request_outside_its_file(hostile_run: HostileRun, recorder: Recorder,
                                                                    browser: Any) -> None:
    _open(browser, hostile_run.report.as_uri(), recorder)
    left = [url for url in _requests(browser) if not _own(url, (hostile_run.report.as_uri(), "data:"))]
    assert left == [], f"the report asked for {left}"
    assert (recorder.connections, recorder.requests) == ([], []), "the code's server was reached"
    ran = browser.execute_script("return Object.keys(window).filter(k => k.startsWith('PWNED'))")
    assert ran == [], f"the sandbox's script ran in the report: {ran}"
    text = browser.find_element("tag name", "body").text
    assert "the hostile outputs ran" in text and "kept cell" in text, "the report lost the honest output"
    images = browser.execute_script("return [...document.images].filter(i => i.complete && i.naturalWidth > 0)"
                                    ".map(i => i.src.slice(0, 22))")
    assert "data:image/png;base64," in images, "an embedded image no longer shows"


def test_the_report_carries_a_strict_content_security_policy(hostile_run: HostileRun) -> None:
    """The policy is the first element of <head>, so it covers every later one: no script at all, images and
    fonts only from the file itself (data:), styles only inline, no <base>, no form targets."""
    from html.parser import HTMLParser

    class First(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.in_head = False
            self.first: tuple[str, dict[str, str | None]] | None = None

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if self.in_head and self.first is None:
                self.first = (tag, dict(attrs))
            self.in_head = self.in_head or tag == "head"

    parser = First()
    parser.feed(hostile_run.report.read_text(encoding="utf-8"))
    assert parser.first is not None
    tag, attrs = parser.first
    assert tag == "meta" and (attrs.get("http-equiv") or "").lower() == "content-security-policy", parser.first
    policy = [d.strip() for d in (attrs.get("content") or "").split(";")]
    assert "default-src 'none'" in policy and "img-src data:" in policy, policy
    assert "base-uri 'none'" in policy and "form-action 'none'" in policy, policy
    assert not [d for d in policy if d.startswith(("script-src", "connect-src", "frame-src", "object-src"))]
    assert not [d for d in policy if "http" in d or "*" in d], policy


def test_the_report_holds_no_script_and_nothing_of_the_notebooks_metadata(hostile_run: HostileRun,
                                                                        recorder: Recorder) -> None:
    """Behind the policy, the page itself: no script element (no CDN loader, no widget state or view, no
    JavaScript output), the title is the file's own name, and nothing the notebook's or an output's metadata
    said (title, tags, image sizes) became markup."""
    from html.parser import HTMLParser

    class Elements(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[str] = []
            self.attributes: list[str] = []
            self.title = ""
            self._in_title = False

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.tags.append(tag)
            self.attributes += [f"{name}={value}" for name, value in attrs]
            self._in_title = tag == "title"

        def handle_data(self, data: str) -> None:
            if self._in_title:
                self.title += data

        def handle_endtag(self, tag: str) -> None:
            self._in_title = False

    page = Elements()
    page.feed(hostile_run.report.read_text(encoding="utf-8"))
    assert "script" not in page.tags and "iframe" not in page.tags and "object" not in page.tags
    assert page.title == "hostile", page.title
    made = [a for a in page.attributes if any(word in a for word in ("image-width", "cell-tag", "/title"))]
    assert made == [], made


def test_the_saved_notebook_names_only_pinned_jupyter_widgets_modules(hostile_run: HostileRun,
                                                                      recorder: Recorder) -> None:
    """What a viewer (JupyterLab, nbviewer, the widget HTML manager) loads from the saved notebook: only
    @jupyter-widgets modules at versions it bundles; no URL, npm name or path the code chose; no markup or
    remote resource inside the kept models; the honest slider is still there."""
    nb = json.loads(hostile_run.notebook.read_text(encoding="utf-8"))
    models = nb["metadata"]["widgets"][WIDGET_STATE]["state"]
    for model in models.values():  # the code's URL survives only as text an HTML widget shows (escaped)
        if recorder.url in json.dumps(model):
            assert model["model_name"] == "HTMLModel" and recorder.url not in json.dumps(
                {k: v for k, v in model["state"].items() if k != "value"}), model
    saved = json.dumps(nb["metadata"]["widgets"])
    assert "evil-widgets" not in saved and "url(" not in saved and "planted" not in saved, saved[:3000]
    for model in models.values():
        values = model["state"]
        for kind in ("model", "view"):
            module, version = values.get(f"_{kind}_module"), values.get(f"_{kind}_module_version")
            assert module is None or version in PINNED[module], (module, version)
        assert (model["model_module"], model["model_module_version"]) == (values["_model_module"],
                                                                          values["_model_module_version"])
        assert "<img" not in json.dumps(values), values
    sliders = [m["state"] for m in models.values() if m["model_name"] == "IntSliderModel"]
    assert any(s.get("value") == 5 and s.get("description") == "kept" for s in sliders), "the honest slider was lost"
    notes = " ".join(hostile_run.result["notes"])
    assert "widget" in notes and "RemoteModel" in notes, notes


# -- the saved widget state, shape by shape (pure) -----------------------------------------------------------------

def _model(name: str = "IntSliderModel", module: Any = "@jupyter-widgets/controls", version: Any = "2.0.0",
           **state: Any) -> dict[str, Any]:
    values = {"_model_name": name, "_model_module": module, "_model_module_version": version,
              "_view_name": "IntSliderView", "_view_module": "@jupyter-widgets/controls",
              "_view_module_version": "2.0.0", **state}
    return {"model_name": name, "model_module": module, "model_module_version": version, "state": values}


DROPPED = [
    pytest.param(_model(module="http://127.0.0.1:9/m.js"), id="module-by-url"),
    pytest.param(_model(module="//127.0.0.1:9/m.js"), id="module-protocol-relative"),
    pytest.param(_model(module="evil-widgets"), id="module-by-npm-name"),
    pytest.param(_model(module="@jupyter-widgets/controls-evil"), id="module-lookalike"),
    pytest.param(_model(module="@jupyter-widgets/../evil"), id="module-walking-up"),
    pytest.param(_model(module="@JUPYTER-WIDGETS/controls"), id="module-other-case"),
    pytest.param(_model(version="*"), id="version-any"),
    pytest.param(_model(version="^2.0.0"), id="version-range"),
    pytest.param(_model(version="2.0.0/../../evil@1/dist"), id="version-walking"),
    pytest.param(_model(version="2.0.0 "), id="version-padded"),
    pytest.param(_model(version=""), id="version-empty"),
    pytest.param(_model(version=None), id="version-missing"),
    pytest.param(_model(version=2), id="version-not-a-string"),
    pytest.param(_model(module=None), id="module-missing"),
    pytest.param(_model(module=["@jupyter-widgets/controls"]), id="module-not-a-string"),
    pytest.param(_model(_model_name=None), id="model-name-missing"),
    pytest.param(_model(_view_name=None), id="view-name-missing"),
    pytest.param(_model(_view_module=None), id="view-module-missing"),
    pytest.param(_model(_view_module="http://127.0.0.1:9/v.js"), id="view-by-url"),
    pytest.param(_model(_view_module_version="*"), id="view-version-any"),
    pytest.param(_model(name="Evil Model<script>"), id="model-name-markup"),
    pytest.param(_model(name="ImageModel", format="url", value="http://127.0.0.1:9/i"), id="image-by-url"),
    pytest.param(_model(name="VideoModel", format="URL"), id="video-by-url"),
    pytest.param(_model(name="HTMLStyleModel", background="url(http://127.0.0.1:9/s)"), id="style-url"),
    pytest.param(_model(name="HTMLStyleModel", background="u\\72l(http://127.0.0.1:9/s)"), id="style-escaped-url"),
    pytest.param(_model(name="LayoutModel", border="image-set('http://127.0.0.1:9/s' 1x)"), id="style-image-set"),
    pytest.param(_model(name="LayoutModel", grid_area="a; background: red"), id="style-second-property"),
    pytest.param({"model_name": "X", "state": "not a mapping"}, id="state-not-a-mapping"),
    pytest.param("not a model", id="model-not-a-mapping"),
    pytest.param({**_model(), "buffers": [{"encoding": "hex", "data": "00", "path": ["value"]}]},
                 id="buffer-not-base64"),
    pytest.param({**_model(), "buffers": [{"encoding": "base64", "data": 7, "path": ["value"]}]},
                 id="buffer-data-not-text"),
    pytest.param({**_model(), "buffers": [{"encoding": "base64", "data": "AA==", "path": "value"}]},
                 id="buffer-path-not-a-list"),
]


@pytest.mark.parametrize("model", DROPPED)
def test_a_widget_model_that_could_load_what_the_code_named_is_dropped(model: Any) -> None:
    from nbexec.notebook import viewer

    kept, notes = viewer.widget_state({"version_major": 2, "version_minor": 0,
                                       "state": {"bad": model, "good": _model()}})
    assert list(kept["state"]) == ["good"] and kept["state"]["good"] == _model()
    assert len(notes) == 1 and "1 of 2 widget models" in notes[0], notes


def test_markup_in_kept_widgets_is_shown_as_text() -> None:
    from nbexec.notebook import viewer

    state = {"h": _model("HTMLModel", value='<img src="http://127.0.0.1:9/x" onerror="x()">50%'),
             "m": _model("HTMLMathModel", value="<b>$x$</b>"),
             "b": _model("ButtonModel", description="<img src=http://127.0.0.1:9/d>", description_allow_html=True),
             "o": _model("OutputModel", module="@jupyter-widgets/output", version="1.0.0", outputs=[
                 {"output_type": "display_data", "metadata": {}, "data": {
                     "text/html": "<img src=http://127.0.0.1:9/o>", "application/javascript": "f()",
                     "image/svg+xml": "<svg/>", "text/plain": "kept", "image/png": PNG}},
                 {"output_type": "stream", "name": "stdout", "text": "kept too"},
                 {"output_type": "display_data", "data": {"text/html": "<script>f()</script>"}}])}
    kept, notes = viewer.widget_state({"state": state})
    assert notes == []
    models = kept["state"]
    assert models["h"]["state"]["value"] == html.escape('<img src="http://127.0.0.1:9/x" onerror="x()">50%')
    assert models["m"]["state"]["value"] == "&lt;b&gt;$x$&lt;/b&gt;"
    assert models["b"]["state"]["description_allow_html"] is False
    outputs = models["o"]["state"]["outputs"]
    assert outputs == [{"output_type": "display_data", "metadata": {}, "data": {"text/plain": "kept",
                                                                                "image/png": PNG}},
                       {"output_type": "stream", "name": "stdout", "text": "kept too"}]


def test_honest_widget_state_is_kept_whole() -> None:
    layout = _model("LayoutModel", module="@jupyter-widgets/base", version="2.0.0", border="1px solid rgb(1, 2, 3)",
                    width="calc(100% - 10px)", grid_template_columns="repeat(2, minmax(0, 1fr))")
    style = _model("ButtonStyleModel", button_color="#ff0000", font_weight="bold")
    slider7 = _model(version="1.5.0", _view_module_version="1.5.0")
    state = {"version_major": 2, "version_minor": 0, "state": {"l": layout, "s": style, "v7": slider7,
                                                               "i": _model(value=3, layout="IPY_MODEL_l"),
                                                               "t": _model("TextModel", value="a<b> & c")}}
    from nbexec.notebook import viewer

    kept, notes = viewer.widget_state(state)
    assert (kept, notes) == (state, [])


@pytest.mark.parametrize("saved", ["not a mapping", ["x"], None, {"state": ["x"]}, {"state": "x"}],
                         ids=["text", "list", "none", "state-a-list", "state-text"])
def test_a_widget_state_of_the_wrong_shape_is_an_empty_one(saved: Any) -> None:
    from nbexec.notebook import viewer

    assert viewer.widget_state(saved) == ({"version_major": 2, "version_minor": 0, "state": {}}, [])


def test_a_widget_state_keeps_its_own_versions_when_they_are_numbers() -> None:
    from nbexec.notebook import viewer

    assert viewer.widget_state({"version_major": 2, "version_minor": 1, "state": {}})[0]["version_minor"] == 1
    assert viewer.widget_state({"version_major": "3", "state": {}})[0] == {"version_major": 2, "version_minor": 0,
                                                                           "state": {}}


@pytest.mark.parametrize("count", [4, 6])
def test_the_note_on_dropped_widgets_names_the_first_five_and_counts_the_rest(count: int) -> None:
    from nbexec.notebook import viewer

    models = {f"bad{i}": _model(module="evil") for i in range(count)}
    models["url"] = _model(name="ImageModel", format="url")
    _, notes = viewer.widget_state({"state": {**models, "good": _model()}})
    reason = "its model module 'evil' at '2.0.0' is not a @jupyter-widgets module at a pinned version"
    said = [f"'bad{i}' ('IntSliderModel': {reason})" for i in range(count)] + [
        "'url' ('ImageModel': it shows a URL the code chose)"]
    more = "" if len(said) <= 5 else f"; and {len(said) - 5} more"
    assert notes == [f"nbexec dropped {count + 1} of {count + 2} widget models from the saved widget state, since a "
                     f"viewer would load or render what the code named: {'; '.join(said[:5])}{more}."]


@pytest.mark.parametrize(("model", "reason"), [
    (_model(name="ImageModel", format="url"), "it shows a URL the code chose"),
    (_model(name="LayoutModel", border="url(x)"), "a style value could fetch a resource"),
    ({**_model(), "buffers": "x"}, "its buffers are not base64 data at key paths"),
    ({"model_name": "X", "state": 1}, "not a model with a state"),
    (_model(_view_name="1x"), "its view name '1x' is not an identifier"),
])
def test_each_reason_to_drop_a_widget_is_said_as_it_is(model: Any, reason: str) -> None:
    from nbexec.notebook import viewer

    _, notes = viewer.widget_state({"state": {"m": model}})
    assert len(notes) == 1 and notes[0].endswith(f": {reason})."), notes


def test_an_output_widget_whose_outputs_are_not_a_list_shows_none() -> None:
    from nbexec.notebook import viewer

    kept, notes = viewer.widget_state({"state": {"o": _model("OutputModel", module="@jupyter-widgets/output",
                                                             version="1.0.0", outputs=5)}})
    assert notes == [] and kept["state"]["o"]["state"]["outputs"] == []


def test_a_report_shows_every_cell_but_raw_ones_for_other_formats() -> None:
    from nbexec.notebook import viewer

    latex = nbformat.v4.new_raw_cell("\\section{x}", metadata={"raw_mimetype": "text/latex"})
    code = nbformat.v4.new_code_cell("1", outputs=[nbformat.v4.new_output("stream", name="stderr", text="e")])
    nb = nbformat.v4.new_notebook(cells=[latex, code, nbformat.v4.new_markdown_cell("after")])
    copy = viewer.report_copy(nb)
    assert [cell.cell_type for cell in copy.cells] == ["code", "markdown"]
    assert copy.cells[0].outputs[0]["name"] == "stderr"
    assert viewer.report_copy(nbformat.from_dict({"metadata": {}})).cells == []


def test_a_widget_state_the_input_notebook_carried_is_held_to_the_same_rule() -> None:
    """A run that makes no widget leaves the notebook's widget state as it was (as nbclient does): a planted one
    must still name nothing a viewer would load."""
    from nbexec.engine.widgets import WidgetState

    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0, "state": {
        "planted": _model(module="http://127.0.0.1:9/planted.js"), "kept": _model()}}}
    state = WidgetState()
    state.save(nb)
    assert list(nb.metadata["widgets"][WIDGET_STATE]["state"]) == ["kept"]
    assert "planted" in " ".join(state.take_notes())
    only_planted = nbformat.v4.new_notebook()
    only_planted.metadata["widgets"] = {WIDGET_STATE: {"state": {"p": _model(module="evil")}}, "other": "x"}
    WidgetState().save(only_planted)
    assert "widgets" not in only_planted.metadata


# -- the playground ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from .test_service import assert_nothing_left, start_serve, stop

    server = start_serve(tmp_path_factory.mktemp("playground"), env={"NBEXEC_TIMEOUT": "90"})
    try:
        yield server
    finally:
        stop(server)
    assert_nothing_left(server)


def test_the_playground_shows_hostile_code_without_loading_anything_it_named(served: Any, recorder: Recorder,
                                                                             browser: Any) -> None:
    from .test_service import TOKEN_A

    _open(browser, f"{served.url}/", recorder)
    field_ = browser.find_element("id", "token")
    field_.send_keys(TOKEN_A)
    browser.find_element("id", "connect").click()
    wait_until(lambda: browser.find_element("id", "status").get_attribute("data-state") == "idle", 60,
               "the playground never connected")
    code = (WIDGETS + OUTPUTS).format(url=recorder.url, png=PNG)
    browser.execute_script("document.getElementById('code').value = arguments[0];", code)
    browser.find_element("id", "run").click()
    wait_until(lambda: browser.find_element("id", "status").get_attribute("data-state") in ("done", "error",
                                                                                            "failed"), 180,
               "the run never finished")
    settle(lambda: False, 1.0)
    status = browser.find_element("id", "status").get_attribute("data-state")
    assert status == "done", browser.find_element("id", "status").text
    assert "the hostile outputs ran" in browser.find_element("id", "output").text
    left = [url for url in _requests(browser) if not _own(url, (served.url + "/", "blob:", "data:"))]
    assert left == [], f"the playground asked for {left}"
    assert (recorder.connections, recorder.requests) == ([], []), "the code's server was reached"
    ran = browser.execute_script("return Object.keys(window).filter(k => k.startsWith('PWNED'))")
    assert ran == []
