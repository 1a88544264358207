// Badges on KeepFast nodes: compiling (with progress), compiled, loaded from disk, eager with the reason, or
// a graph that disagreed with the model run uncompiled (a pack error: the first-use check ran eager instead).
//
// The server sends each compile, load, fallback, refusal and mismatch as a "keepfast.event" with the id of the node
// ComfyUI was running (a KSampler compiles the UNet, a VAE Decode the VAE). The badge belongs to the KeepFast
// node that made that model, so we walk up the running node's MODEL, VAE and GUIDER inputs to it.
// No imports: ComfyUI loads every .js file of the pack as an extension, so this one only defines things.

export const KEEPFAST_TYPES = new Set([
  "KeepFastModelSpeedup", "KeepFastVAESpeedup", "KeepFastLoadGraph", "KeepFastWarmupGraphs", "KeepFastSaveGraph",
]);
const FOLLOWED_TYPES = new Set(["MODEL", "VAE", "GUIDER"]);

const STYLE = {
  compiling: { bg: "#8a5a00", fg: "#fff" },
  building: { bg: "#5e35b1", fg: "#fff" },
  built: { bg: "#00796b", fg: "#fff" },
  compiled: { bg: "#2e7d32", fg: "#fff" },
  loaded: { bg: "#1565c0", fg: "#fff" },
  eager: { bg: "#b23c17", fg: "#fff" },
  refused: { bg: "#8e1b1b", fg: "#fff" },
  mismatch: { bg: "#d50000", fg: "#fff" },
};

/** The KeepFast nodes behind `nodeId`: itself if it is one, else those its model/VAE inputs come from. */
export function badgeTargets(graph, nodeId) {
  const start = graph?.getNodeById?.(nodeId);
  if (!start) return [];
  if (KEEPFAST_TYPES.has(start.type)) return [start];
  const found = [];
  const seen = new Set([start.id]);
  const queue = [start];
  while (queue.length && seen.size < 200) {
    const node = queue.shift();
    (node.inputs || []).forEach((input, slot) => {
      if (input?.link == null || !FOLLOWED_TYPES.has(String(input.type))) return;
      const origin = node.getInputNode?.(slot);
      if (!origin || seen.has(origin.id)) return;
      seen.add(origin.id);
      if (KEEPFAST_TYPES.has(origin.type)) found.push(origin);
      else queue.push(origin);
    });
  }
  return found;
}

/** What an event means for a badge, or null when it changes none (evictions, unknown kinds). */
export function badgeState(event) {
  const reason = String(event.reason || "");
  switch (event.kind) {
    case "progress": {
      if (event.background) return { state: "building", fraction: 0, text: "building in the background", reason };
      const fraction = Math.min(Math.max(Number(event.fraction) || 0, 0), 1);
      if (fraction >= 1) return null;  // "done" arrives after the compile event, which says how it went
      return { state: "compiling", fraction, text: `compiling ${Math.round(100 * fraction)}%`, reason };
    }
    case "building": {
      // A model's background builds (server: build_status.progress): graph k of n, the time left.
      const total = Math.max(Number(event.total) || 1, 1);
      const done = Math.min(Math.max(Number(event.done) || 0, 0), total);
      if (done >= total) {
        const text = event.ready ? "built: serves from the next step" : "background builds ended";
        return { state: event.ready ? "built" : "eager", text: event.failed ? `${text}, ${event.failed} failed` : text, reason };
      }
      const left = event.left_s == null ? "" : `, ~${Math.round(Number(event.left_s))} s left`;
      return { state: "building", fraction: done / total, text: `building ${done + 1} of ${total} in background${left}`, reason };
    }
    case "compile":
      return { state: "compiled", text: `compiled (${Number(event.seconds || 0).toFixed(1)} s)`, reason };
    case "load":
      return { state: "loaded", text: "loaded from disk", reason };
    case "fallback":
      if (/building in the background/.test(reason)) {
        return { state: "building", fraction: 0, text: "building in the background", reason };
      }
      return { state: "eager", text: `eager: ${shortReason(reason)}`, reason };
    case "refused":
      return { state: "refused", text: `refused: ${shortReason(reason)}`, reason };
    case "mismatch":
      return { state: "mismatch", text: `pack error, ran eager: ${shortReason(reason)}`, reason };
    default:
      return null;
  }
}

/** The reason without the "<label>: " prefix and "; running eager" suffix the compiler adds. */
function shortReason(reason) {
  return reason.replace(/^[^:]{1,80}: /, "").replace(/; running eager$/, "");
}

/** The KeepFast nodes whose events named one of `families` (a background build belongs to the node that made
 * the model, whatever node runs when it progresses). */
export function familyTargets(graph, families) {
  const wanted = new Set((families || []).filter(Boolean));
  if (!wanted.size) return [];
  const nodes = graph?._nodes ?? graph?.nodes ?? [];
  return Array.from(nodes instanceof Map ? nodes.values() : nodes).filter(
    (node) => KEEPFAST_TYPES.has(node.type) && (node.keepfastFamilies || []).some((family) => wanted.has(family)));
}

/** Record the event's badge on each target node; returns the nodes changed. */
export function applyEvent(graph, event, fallbackNodeId) {
  const badge = badgeState(event);
  if (!badge) return [];
  let targets;
  if (event.kind === "building") {
    targets = familyTargets(graph, event.families);
  } else {
    targets = event.node != null ? badgeTargets(graph, event.node) : [];
    if (!targets.length && fallbackNodeId != null) targets = badgeTargets(graph, fallbackNodeId);
    if (!targets.length && event.family) targets = familyTargets(graph, [event.family]);
  }
  for (const node of targets) {
    const previous = node.keepfast;
    // A call run eager while its graph builds says only "building": keep the build's count and time left.
    if (badge.state === "building" && event.kind !== "building" && previous?.state === "building") continue;
    node.keepfast = { ...badge, at: Date.now(), family: event.family, history: [...(previous?.history || []), badge].slice(-20) };
    const families = [event.family, ...(event.families || [])].filter((f) => f && f !== "-");
    node.keepfastFamilies = [...new Set([...(node.keepfastFamilies || []), ...families])].slice(-50);
  }
  return targets;
}

function fitText(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let low = 0;
  let high = text.length;
  while (low < high) {
    const mid = Math.ceil((low + high) / 2);
    if (ctx.measureText(text.slice(0, mid) + "…").width <= width) low = mid;
    else high = mid - 1;
  }
  return text.slice(0, low) + "…";
}

/** Draw the node's badge just above its title bar (a progress bar while compiling). */
export function drawBadge(node, ctx, titleHeight) {
  const badge = node.keepfast;
  if (!badge || node.flags?.collapsed) return;
  const style = STYLE[badge.state] || STYLE.eager;
  const height = 20;
  const y = -(titleHeight || 30) - height - 4;
  ctx.save();
  ctx.font = "12px sans-serif";
  const width = Math.max((node.size?.[0] || 200) - 72, 120);  // leave ComfyUI's node-source badge (top right) free
  const text = fitText(ctx, badge.text, width - 12);
  const barred = badge.state === "compiling" || badge.state === "building";
  const boxWidth = barred ? width : Math.min(width, ctx.measureText(text).width + 12);
  ctx.beginPath();
  ctx.roundRect ? ctx.roundRect(0, y, boxWidth, height, 5) : ctx.rect(0, y, boxWidth, height);
  ctx.fillStyle = barred ? "#2a2a2a" : style.bg;
  ctx.fill();
  if (barred) {
    ctx.beginPath();
    ctx.rect(0, y, boxWidth * badge.fraction, height);
    ctx.fillStyle = style.bg;
    ctx.fill();
  }
  ctx.fillStyle = style.fg;
  ctx.textBaseline = "middle";
  ctx.fillText(text, 6, y + height / 2 + 1);
  ctx.restore();
}
