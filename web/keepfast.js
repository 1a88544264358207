// KeepFast's page extension: node badges from the server's "keepfast.event" messages, and the graph
// library as a sidebar tab (or a dialog where the frontend has no sidebar API).
// Plain ES modules served from the pack's WEB_DIRECTORY; nothing to build.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { KEEPFAST_TYPES, applyEvent, drawBadge } from "./lib/badges.js";
import { GraphLibrary, toggleDialog } from "./lib/library.js";

const EVENT = "keepfast.event";
const recent = [];
let runningNode = null;
const library = new GraphLibrary(api, () => recent);

function titleHeight() {
  return window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
}

function onKeepFastEvent(event) {
  const data = event.detail || {};
  recent.push(data);
  recent.splice(0, Math.max(0, recent.length - 200));
  const changed = applyEvent(app.graph, data, runningNode);
  if (changed.length) app.graph?.setDirtyCanvas?.(true, true);
  if (data.kind !== "progress" && library.mounted) library.renderEvents();
}

function onExecuting(event) {
  const detail = event.detail;
  runningNode = detail && typeof detail === "object" ? (detail.display_node ?? detail.node ?? null) : detail;
}

app.registerExtension({
  name: "KeepFast.Page",

  commands: [{ id: "KeepFast.GraphLibrary", label: "KeepFast: graph library", icon: "pi pi-bolt",
    function: () => toggleDialog(library) }],

  async setup() {
    api.addEventListener(EVENT, onKeepFastEvent);
    api.addEventListener("executing", onExecuting);
    api.addEventListener("execution_success", () => library.mounted && library.refresh());
    const manager = app.extensionManager;
    if (typeof manager?.registerSidebarTab === "function") {
      manager.registerSidebarTab({
        id: "keepfast-graphs", icon: "pi pi-bolt", title: "KeepFast", tooltip: "KeepFast graph library",
        type: "custom", render: (element) => { library.mount(element); },
      });
    } else {
      const button = document.createElement("button");
      button.textContent = "KeepFast graphs";
      button.setAttribute("data-kf", "open-dialog");
      button.style.cssText = "position:fixed;left:8px;bottom:8px;z-index:9999";
      button.onclick = () => toggleDialog(library);
      document.body.append(button);
    }
    window.keepfast = { library, recent, toggleDialog: () => toggleDialog(library) };
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!KEEPFAST_TYPES.has(nodeData?.name)) return;
    const draw = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx, ...rest) {
      const result = draw?.call(this, ctx, ...rest);
      drawBadge(this, ctx, titleHeight());
      return result;
    };
  },
});
