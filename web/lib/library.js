// The graph library: every graph in models/graphs with what it was built for, whether this machine trusts
// it, and buttons to verify, trust and delete it. It talks only to the pack's routes (nodes/routes.py);
// every change is a POST and every refusal comes back as {"error": message}, shown here as it is.
// No imports (see badges.js): the caller passes ComfyUI's api object.

const CSS = `
.kf-library { padding: 8px; font-size: 13px; color: var(--fg-color, #ddd); overflow: auto; height: 100%; box-sizing: border-box; }
.kf-library h3 { margin: 4px 0 8px; font-size: 15px; }
.kf-library .kf-bar { display: flex; gap: 6px; margin-bottom: 8px; flex-wrap: wrap; }
.kf-library button { cursor: pointer; font-size: 12px; padding: 2px 8px; border-radius: 4px;
  border: 1px solid var(--border-color, #555); background: var(--comfy-input-bg, #333); color: inherit; }
.kf-library button.kf-danger { border-color: #b23c17; }
.kf-library .kf-status { min-height: 18px; margin: 6px 0; white-space: pre-wrap; }
.kf-library .kf-status.kf-error { color: #ff7b6b; }
.kf-library .kf-graph { border: 1px solid var(--border-color, #444); border-radius: 6px; padding: 6px 8px; margin-bottom: 8px; }
.kf-library .kf-graph .kf-title { font-weight: 600; word-break: break-all; }
.kf-library .kf-graph dl { display: grid; grid-template-columns: max-content 1fr; gap: 1px 10px; margin: 4px 0; }
.kf-library .kf-graph dt { opacity: 0.7; }
.kf-library .kf-graph dd { margin: 0; word-break: break-all; }
.kf-library .kf-yes { color: #7bd88f; }
.kf-library .kf-no { color: #ffb86b; }
.kf-library .kf-events { margin-top: 12px; font-size: 12px; opacity: 0.9; }
.kf-library .kf-events li { margin-bottom: 3px; }
.kf-dialog { position: fixed; left: 50%; top: 10%; transform: translateX(-50%); width: min(640px, 92vw); height: 75vh;
  z-index: 10000; background: var(--comfy-menu-bg, #222); border: 1px solid var(--border-color, #555); border-radius: 8px;
  box-shadow: 0 8px 30px rgba(0,0,0,.5); }
`;

export function injectStyle(doc = document) {
  if (doc.getElementById("kf-library-style")) return;
  const style = doc.createElement("style");
  style.id = "kf-library-style";
  style.textContent = CSS;
  doc.head.appendChild(style);
}

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "className") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

/** POST or GET one of the pack's routes; resolves to {ok, status, data}; never throws on an HTTP error. */
export async function callRoute(api, path, body) {
  const options = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  try {
    const response = await api.fetchApi(path, options);
    let data;
    try {
      data = await response.json();
    } catch {
      data = { error: `HTTP ${response.status}: not JSON` };
    }
    return { ok: response.ok, status: response.status, data };
  } catch (error) {
    return { ok: false, status: 0, data: { error: String(error) } };
  }
}

function range(shapeRange) {
  if (!shapeRange) return "";
  return Object.entries(shapeRange).map(([role, [low, high]]) => `${role} ${low}–${high}`).join(", ");
}

function megabytes(bytes) {
  return `${(Number(bytes || 0) / 1e6).toFixed(1)} MB`;
}

function created(text) {
  const date = new Date(text);
  return Number.isNaN(date.getTime()) ? String(text || "") : date.toLocaleString();
}

export class GraphLibrary {
  constructor(api, recentEvents = () => []) {
    this.api = api;
    this.recentEvents = recentEvents;
    this.root = null;
    this.status = null;
    this.list = null;
    this.listing = null;
  }

  /** Build the panel inside `container` (a sidebar tab or the dialog) and load the list. */
  mount(container) {
    injectStyle();
    container.replaceChildren();
    this.status = element("div", { className: "kf-status", "data-kf": "status" });
    this.list = element("div", { "data-kf": "list" });
    this.events = element("div", { className: "kf-events", "data-kf": "events" });
    this.remoteUrl = element("input", { "data-kf": "remote-url", placeholder: "s3://bucket/prefix, hf://org/repo or a folder" });
    this.remoteList = element("div", { "data-kf": "remote-list" });
    const remote = element("details", { className: "kf-remote", "data-kf": "remote" },
      element("summary", {}, "Remote library (pull graphs that fit this machine)"),
      this.remoteUrl,
      element("div", { className: "kf-bar" },
        element("button", { "data-kf": "remote-check", onclick: () => this.remote(true) }, "Check"),
        element("button", { "data-kf": "remote-pull", onclick: () => this.remote(false) }, "Pull what fits")),
      this.remoteList);
    this.root = element("div", { className: "kf-library", "data-kf": "library" },
      element("h3", {}, "KeepFast graphs"),
      element("div", { className: "kf-bar" },
        element("button", { "data-kf": "refresh", onclick: () => this.refresh() }, "Refresh"),
        element("button", { "data-kf": "verify-all", onclick: () => this.verifyAll() }, "Verify all")),
      this.status, this.list, remote, this.events);
    container.append(this.root);
    return this.refresh();
  }

  get mounted() {
    return !!this.root?.isConnected;
  }

  say(text, error = false) {
    if (!this.status) return;
    this.status.textContent = text;
    this.status.classList.toggle("kf-error", error);
  }

  async refresh() {
    const answer = await callRoute(this.api, "/keepfast/graphs");
    if (!answer.ok) {
      this.say(answer.data.error || `listing failed (HTTP ${answer.status})`, true);
      return answer;
    }
    this.listing = answer.data;
    this.render();
    return answer;
  }

  render() {
    const { graphs = [], folders = [], torch_version: here = "" } = this.listing || {};
    this.list.replaceChildren();
    if (!graphs.length) {
      this.list.append(element("div", { "data-kf": "empty" }, `No graphs in ${folders.join(", ") || "models/graphs"}.`));
    }
    for (const graph of graphs) this.list.append(this.row(graph, here));
    this.renderEvents();
  }

  row(graph, torchHere) {
    const keyAttributes = { className: "kf-graph", "data-name": graph.name, "data-root": String(graph.root) };
    if (graph.problem) {
      return element("div", keyAttributes,
        element("div", { className: "kf-title" }, graph.name),
        element("div", { className: "kf-no" }, `unreadable: ${graph.problem}`),
        element("div", { className: "kf-bar" }, this.button("delete", graph, "Delete", true)));
    }
    const torchNote = graph.torch_version === torchHere ? "" : ` (this machine: ${torchHere})`;
    const fields = [
      ["architecture", graph.block
        ? `${graph.architecture} blocks (${graph.block.instances} in ${graph.block.model}: ${graph.block.paths.join(" .. ")})`
        : graph.architecture],
      ["dtype", `${graph.dtype} on ${graph.device}, ${graph.backend}`],
      ["shape range", range(graph.shape_range)],
      ["size", megabytes(graph.bytes)],
      ["torch", graph.torch_version + torchNote],
      ["created", created(graph.created)],
    ];
    const trusted = element("dd", { className: graph.trusted ? "kf-yes" : "kf-no", "data-kf": "trusted" },
      graph.trusted ? "trusted by this machine" : "not trusted here (native code: trust it only if you know where it came from)");
    const list = element("dl", {}, ...fields.flatMap(([label, value]) => [element("dt", {}, label), element("dd", {}, value)]),
      element("dt", {}, "trust"), trusted);
    const buttons = [this.button("verify", graph, "Verify")];
    if (!graph.trusted) buttons.push(this.button("trust", graph, "Trust"));
    buttons.push(this.button("delete", graph, "Delete", true));
    return element("div", keyAttributes, element("div", { className: "kf-title" }, graph.name), list,
      element("div", { className: "kf-bar" }, ...buttons));
  }

  button(action, graph, label, danger = false) {
    return element("button", {
      "data-action": action, className: danger ? "kf-danger" : "",
      onclick: () => this.act(action, graph.name, graph.root),
    }, label);
  }

  /** verify, trust or delete one graph by name; the server's message is shown either way. */
  async act(action, name, root) {
    if (action === "delete" && !window.confirm(`Delete graph ${name}? Its files are removed from disk.`)) return null;
    if (action === "trust" && !window.confirm(`Trust graph ${name}? A graph is native code that runs in ComfyUI.`)) return null;
    const answer = await callRoute(this.api, `/keepfast/graphs/${action}`, { name, root });
    if (!answer.ok) {
      this.say(`${action} ${name}: ${answer.data.error || `HTTP ${answer.status}`}`, true);
      return answer;
    }
    if (action === "verify") {
      const problems = answer.data.problems || [];
      this.say(problems.length ? `${name}: ${problems.map((p) => p.problem).join("; ")}` : `${name}: verified (size and sha256 match)`,
        problems.length > 0);
      return answer;
    }
    await this.refresh();
    this.say(action === "delete" ? `deleted ${name} (${answer.data.removed.length} files)` : `trusted ${name}`);
    return answer;
  }

  /** Check a remote library (what fits here, nothing downloaded but manifests) or pull what fits. */
  async remote(dryRun) {
    const url = this.remoteUrl.value.trim();
    this.say(dryRun ? `checking ${url || "$KEEPFAST_REMOTE_LIBRARY"}…` : `pulling from ${url || "$KEEPFAST_REMOTE_LIBRARY"}…`);
    const answer = await callRoute(this.api, dryRun ? "/keepfast/remote/check" : "/keepfast/remote/pull", { url });
    if (!answer.ok) {
      this.say(answer.data.error || `HTTP ${answer.status}`, true);
      return answer;
    }
    this.remoteList.replaceChildren(...(answer.data.graphs || []).map((graph) => element("div",
      { className: "kf-remote-graph", "data-name": graph.name, "data-status": graph.status },
      `${graph.status}: ${graph.name}${graph.reason ? ` (${graph.reason})` : ""}${graph.signer ? `, signed by ${graph.signer}` : ""}`)));
    if (!dryRun) await this.refresh();
    this.say(answer.data.summary);
    return answer;
  }

  async verifyAll() {
    const answer = await callRoute(this.api, "/keepfast/graphs/verify", {});
    if (!answer.ok) return this.say(answer.data.error || `HTTP ${answer.status}`, true);
    const { checked, problems } = answer.data;
    this.say(problems.length ? problems.map((p) => `BAD ${p.file}: ${p.problem}`).join("\n") : `${checked} graphs verified`,
      problems.length > 0);
    return answer;
  }

  renderEvents() {
    if (!this.events) return;
    const recent = this.recentEvents().filter((e) => e.kind !== "progress").slice(-8).reverse();
    this.events.replaceChildren();
    if (!recent.length) return;
    this.events.append(element("div", {}, "Recent events"),
      element("ul", {}, ...recent.map((e) => element("li", {}, `${e.kind}: ${e.reason}`))));
  }
}

/** The library in a floating dialog, for a frontend without sidebar tabs. */
export function toggleDialog(library) {
  injectStyle();
  let dialog = document.getElementById("kf-library-dialog");
  if (dialog) {
    dialog.remove();
    return null;
  }
  const body = element("div", { style: "height: calc(100% - 30px)" });
  dialog = element("div", { id: "kf-library-dialog", className: "kf-dialog" },
    element("div", { style: "text-align: right; padding: 4px 8px" },
      element("button", { onclick: () => dialog.remove() }, "Close")), body);
  document.body.append(dialog);
  library.mount(body);
  return dialog;
}
