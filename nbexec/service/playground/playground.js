// The nbexec playground: runs code in a session of this server through its HTTP API.
// The token lives in this page's memory only (never in a URL or in storage) and is sent only to this origin.
// Everything the sandbox made is shown as text (textContent), images as blobs: nothing of it is ever HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const ANSI = /\u001b\[[0-9;]*[A-Za-z]/g;
const IMAGES = ["image/png", "image/jpeg", "image/gif", "image/svg+xml"];
const state = { token: "", session: null, busy: false, abort: null };

function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  headers.set("Authorization", "Bearer " + state.token);
  return fetch(path, { ...options, headers, credentials: "omit", cache: "no-store", redirect: "error" });
}

async function problem(response) {
  try {
    const body = await response.json();
    return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch {
    return response.statusText;
  }
}

function setStatus(text, stateName) {
  const status = $("status");
  status.textContent = text;
  status.dataset.state = stateName;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// A link of this server's API ("/v1/...") is fetched with the token; an https link (an artifact store's) opens
// as is, without the token; anything else is not a link.
function classify(url) {
  if (typeof url !== "string" || !url) return null;
  const parsed = new URL(url, location.origin);
  if (parsed.origin === location.origin && parsed.pathname.startsWith("/v1/")) return { api: parsed.pathname };
  if (parsed.protocol === "https:") return { external: parsed.href };
  return null;
}

async function fetchBlob(path) {
  const response = await api(path);
  if (!response.ok) throw new Error(await problem(response));
  return response.blob();
}

function base64Blob(data, mime) {
  const bytes = Uint8Array.from(atob(String(data).replace(/\s/g, "")), (c) => c.charCodeAt(0));
  return new Blob([bytes], { type: mime });
}

function showImage(block, blob, name) {
  const img = element("img");
  img.alt = name || "image output";
  img.src = URL.createObjectURL(blob);
  block.append(img);
  block.imageCount += 1;
}

function showError(block, lines, fallback) {
  const text = (lines && lines.length ? lines.join("\n") : fallback).replace(ANSI, "");
  block.append(element("pre", "error", text));
  block.errorShown = true;
}

function showOutput(block, output) {
  if (output.output_type === "stream") {
    const last = block.lastElementChild;
    if (last && last.dataset.stream === output.name) {
      last.textContent += output.text;
    } else {
      const pre = element("pre", "stream " + output.name, output.text);
      pre.dataset.stream = output.name;
      block.append(pre);
    }
  } else if (output.output_type === "error") {
    showError(block, output.traceback, output.ename + ": " + output.evalue);
  } else if (output.data) {
    const mime = IMAGES.find((m) => output.data[m]);
    if (mime) {
      const data = mime === "image/svg+xml" ? new Blob([output.data[mime]], { type: mime })
        : base64Blob(output.data[mime], mime);
      showImage(block, data);
    } else if (output.data["text/plain"] !== undefined) {
      const text = output.data["text/plain"];
      block.append(element("pre", "result", Array.isArray(text) ? text.join("") : String(text)));
    }
  }
}

function fileLink(file) {
  const target = classify(file.url);
  const size = typeof file.size === "number" ? " (" + file.size.toLocaleString() + " bytes)" : "";
  if (!target) return element("span", "file", file.name + size);
  const link = element("a", "file", file.name);
  if (target.external) {
    link.href = target.external;
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  } else {
    link.href = target.api;
    link.addEventListener("click", async (event) => {
      event.preventDefault();
      try {
        const url = URL.createObjectURL(await fetchBlob(target.api));
        const save = element("a");
        save.href = url;
        save.download = file.name.split("/").pop();
        save.click();
        setTimeout(() => URL.revokeObjectURL(url), 30000);
      } catch (error) {
        setStatus("Download failed: " + error.message, "failed");
      }
    });
  }
  const item = element("li");
  item.append(link, size);
  return item;
}

async function showResult(block, result) {
  if (result.error && !block.errorShown) {
    showError(block, result.error.traceback, result.error.ename + ": " + result.error.evalue);
  }
  if (!block.imageCount) {
    for (const image of result.images || []) {
      const target = classify(image.url);
      if (target && target.api) showImage(block, await fetchBlob(target.api), image.name);
    }
  }
  if (result.files && result.files.length) {
    const list = element("ul", "files");
    for (const file of result.files) list.append(fileLink(file));
    const files = element("div", "files-box");
    files.append(element("h3", null, "Files in /mnt/data"), list);
    block.append(files);
  }
  for (const note of result.notes || []) block.append(element("p", "note", note));
}

// Server-sent events over fetch (EventSource cannot send an Authorization header).
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let kind = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) kind = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { kind, data: JSON.parse(data.join("\n")) };
    }
  }
}

async function ensureSession() {
  if (state.session) return state.session;
  const response = await api("/v1/sessions", { method: "POST" });
  if (!response.ok) throw new Error(response.status + ": " + (await problem(response)));
  state.session = (await response.json()).id;
  $("session").textContent = "session " + state.session;
  $("reset").disabled = false;
  return state.session;
}

async function connect(event) {
  event.preventDefault();
  state.token = $("token").value.trim();
  state.session = null;
  setStatus("Connecting...", "busy");
  try {
    await ensureSession();
    $("token").value = "";
    $("token").placeholder = "connected (token kept in this page only)";
    $("run").disabled = false;
    setStatus("Connected. Run some code.", "idle");
  } catch (error) {
    state.token = "";
    $("session").textContent = "not connected";
    setStatus("Cannot connect: " + error.message, "failed");
  }
}

async function run() {
  if (state.busy || !state.token) return;
  state.busy = true;
  state.abort = new AbortController();
  $("run").disabled = true;
  $("stop").disabled = false;
  const block = element("article", "run");
  block.imageCount = 0;
  block.append(element("pre", "code", $("code").value));
  $("output").prepend(block);
  setStatus("Running...", "busy");
  try {
    const session = await ensureSession();
    const response = await api("/v1/sessions/" + encodeURIComponent(session) + "/execute?stream=true", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ code: $("code").value }), signal: state.abort.signal,
    });
    if (response.status === 404) {
      state.session = null;
      $("session").textContent = "session expired";
    }
    if (!response.ok) throw new Error(response.status + ": " + (await problem(response)));
    await follow(block, response);
  } catch (error) {
    if (error.name === "AbortError") {
      block.append(element("p", "failure", "Stopped: the server interrupts the run when the stream closes."));
      setStatus("Stopped.", "stopped");
    } else {
      block.append(element("p", "failure", String(error.message || error)));
      setStatus("Failed: " + (error.message || error), "failed");
    }
  } finally {
    state.busy = false;
    state.abort = null;
    $("run").disabled = false;
    $("stop").disabled = true;
  }
}

async function follow(block, response) {
  for await (const { kind, data } of events(response)) {
    if (kind === "output") {
      showOutput(block, data);
    } else if (kind === "result") {
      await showResult(block, data);
      const took = typeof data.duration_s === "number" ? " in " + data.duration_s.toFixed(2) + " s" : "";
      setStatus((data.ok ? "Done" : "Failed (" + data.error.kind + ")") + took, data.ok ? "done" : "error");
      return;
    } else if (kind === "error") {
      throw new Error(data.status + ": " + data.detail);
    }
  }
  throw new Error("the stream ended without a result");
}

async function reset() {
  const old = state.session;
  state.session = null;
  $("output").replaceChildren();
  if (old) await api("/v1/sessions/" + encodeURIComponent(old), { method: "DELETE" });
  try {
    await ensureSession();
    setStatus("New session.", "idle");
  } catch (error) {
    setStatus("Cannot start a session: " + error.message, "failed");
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("token-form").addEventListener("submit", connect);
  $("run").addEventListener("click", run);
  $("reset").addEventListener("click", reset);
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("code").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      run();
    }
  });
});
