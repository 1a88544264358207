// Drive ComfyUI's page in Debian's headless chromium for tests/comfyui/test_browser.py.
//
//   node keepfast_page.mjs PHASE CONFIG.json
//
// PHASE: compile | background | library | delete | badname. CONFIG names the server url, the chromium binary, the
// artifacts folder, the result file and what the phase needs. The script only observes and clicks; it writes
// what it saw as JSON to the result file, and the Python test asserts on that and on the files on disk.

import { chromium } from "playwright-core";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const [, , phase, configPath] = process.argv;
const config = JSON.parse(fs.readFileSync(configPath, "utf8"));
const result = { phase, steps: [], console: [], failed_requests: [] };

function step(text) {
  result.steps.push(`${new Date().toISOString()} ${text}`);
}

async function openPage(context) {
  const page = await context.newPage();
  page.setDefaultTimeout(120_000);
  page.on("console", (message) => {
    if (["error", "warning"].includes(message.type())) result.console.push(`${message.type()}: ${message.text()}`.slice(0, 500));
  });
  page.on("pageerror", (error) => result.console.push(`pageerror: ${error.message}`.slice(0, 500)));
  page.on("response", (response) => {
    if (response.status() >= 400) result.failed_requests.push(`${response.status()} ${response.url()}`);
  });
  page.on("requestfailed", (request) => result.failed_requests.push(`failed ${request.url()}`));
  page.on("dialog", (dialog) => dialog.accept());  // the library's confirm() before delete and trust
  await page.setViewportSize({ width: 1400, height: 900 });
  await page.goto(config.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.comfyAPI?.app?.app?.graph && window.keepfast?.library, null, { timeout: 180_000 });
  step("page and KeepFast extension loaded");
  return page;
}

async function openLibrary(page) {
  const button = page.locator(".side-bar-button:has(.pi-bolt)").first();
  await button.waitFor();
  await button.click();
  await page.locator('[data-kf="library"]').waitFor();
  await page.waitForFunction(() => window.keepfast.library.listing !== null);
  step("library tab opened");
}

async function libraryRows(page) {
  return page.$$eval('[data-kf="library"] .kf-graph', (rows) => rows.map((row) => ({
    name: row.getAttribute("data-name"), root: row.getAttribute("data-root"), text: row.innerText,
  })));
}

async function statusText(page) {
  return page.locator('[data-kf="status"]').innerText();
}

// -- phases ---------------------------------------------------------------------------------------

async function compile(page, { expectCompiling = true } = {}) {
  const workflow = JSON.parse(fs.readFileSync(config.workflow, "utf8"));
  await page.evaluate(async ({ workflow, widgets }) => {
    const app = window.comfyAPI.app.app;
    await app.loadGraphData(workflow);
    for (const [id, values] of Object.entries(widgets)) {
      const node = app.graph.getNodeById(Number(id));
      for (const [name, value] of Object.entries(values)) {
        const widget = node.widgets.find((w) => w.name === name);
        if (!widget) throw new Error(`node ${id} has no widget ${name}`);
        widget.value = value;
      }
    }
  }, { workflow, widgets: config.widgets });
  step("workflow loaded, widgets set");
  // UI-only nodes to move out of the screenshots (a Note's text box is HTML over the canvas, so it covers badges).
  await page.evaluate((ids) => {
    const app = window.comfyAPI.app.app;
    for (const id of ids) {
      const node = app.graph.getNodeById(id);
      if (node) node.pos = [node.pos[0] - 3000, node.pos[1]];
    }
  }, config.move_aside || []);

  // Watch every badge change, and when the speedup node first shows progress, photograph it.
  await page.evaluate(() => {
    window.kfSeen = [];
    window.kfDone = new Promise((resolve) => {
      const api = window.comfyAPI.api.api;
      api.addEventListener("execution_success", (e) => resolve({ ok: true, detail: e.detail }));
      api.addEventListener("execution_error", (e) => resolve({ ok: false, detail: e.detail }));
    });
  });
  await watchBadges(page);

  await page.evaluate(() => window.comfyAPI.app.app.queuePrompt(0, 1));
  step("prompt queued from the page");

  const compiling = !expectCompiling ? null : await page.waitForFunction((id) => {
    const badge = window.comfyAPI.app.app.graph.getNodeById(id)?.keepfast;
    return badge && badge.state === "compiling" && badge.fraction > 0 && badge.fraction < 1 ? badge : null;
  }, config.watch[0], { timeout: config.compile_timeout_ms, polling: 100 }).then((h) => h.jsonValue()).catch(() => null);
  if (compiling) {
    await frame(page, config.watch);
    await page.screenshot({ path: path.join(config.artifacts, "node-compiling.png") });
    step(`compiling badge seen: ${compiling.text}`);
  }

  const done = await page.evaluate((ms) => Promise.race([window.kfDone, new Promise((r) => setTimeout(() => r({ ok: false, detail: "timeout" }), ms))]),
    config.compile_timeout_ms);
  step(`prompt finished: ${JSON.stringify(done).slice(0, 300)}`);
  await page.waitForTimeout(500);
  await page.evaluate(() => clearInterval(window.kfTimer));
  await frame(page, config.watch);
  await page.screenshot({ path: path.join(config.artifacts, "node-compiled.png") });
  Object.assign(result, await page.evaluate(({ watched }) => {
    const app = window.comfyAPI.app.app;
    const badges = {};
    for (const id of watched) {
      const badge = app.graph.getNodeById(id)?.keepfast;
      badges[id] = badge ? { state: badge.state, text: badge.text, reason: badge.reason, history: badge.history } : null;
    }
    return { badges, seen: window.kfSeen, events: window.keepfast.recent.map((e) => ({ kind: e.kind, node: e.node ?? null, reason: e.reason, fraction: e.fraction ?? null })) };
  }, { watched: config.watch }));
  result.done = done;
  result.screenshots = ["node-compiling.png", "node-compiled.png"].filter((f) => fs.existsSync(path.join(config.artifacts, f)));
}

async function background(page) {
  // The default build: the prompt finishes uncompiled, then the Model Speedup's badge follows the background
  // build (no prompt runs meanwhile: the events come from the pack's progress thread) until it is built.
  await compile(page, { expectCompiling: false });
  await watchBadges(page);
  const building = await page.waitForFunction((id) => {
    const badge = window.comfyAPI.app.app.graph.getNodeById(id)?.keepfast;
    return badge && badge.state === "building" && / of \d+ in background/.test(badge.text) ? badge : null;
  }, config.watch[0], { timeout: 60_000, polling: 100 }).then((h) => h.jsonValue()).catch(() => null);
  if (building) {
    await frame(page, config.watch);
    await page.screenshot({ path: path.join(config.artifacts, "node-building.png") });
    step(`building badge seen: ${building.text}`);
  }
  const built = await page.waitForFunction((id) => {
    const badge = window.comfyAPI.app.app.graph.getNodeById(id)?.keepfast;
    return badge && badge.state === "built" ? badge : null;
  }, config.watch[0], { timeout: config.compile_timeout_ms, polling: 200 }).then((h) => h.jsonValue()).catch(() => null);
  step(`built badge ${built ? "seen: " + built.text : "not seen"}`);
  await page.waitForTimeout(500);  // the badge watcher's next round records it too
  await page.evaluate(() => clearInterval(window.kfTimer));
  await frame(page, config.watch);
  await page.screenshot({ path: path.join(config.artifacts, "node-built.png") });
  Object.assign(result, await page.evaluate(() => ({
    seen: window.kfSeen,
    events: window.keepfast.recent.map((e) => ({ kind: e.kind, node: e.node ?? null, reason: e.reason, done: e.done ?? null, total: e.total ?? null, left_s: e.left_s ?? null })),
  })));
  result.building = building;
  result.built = built;
  result.screenshots = ["node-building.png", "node-built.png"].filter((f) => fs.existsSync(path.join(config.artifacts, f)));
}

async function watchBadges(page) {
  // Record every change of the watched nodes' badges in window.kfSeen (stopped with clearInterval(kfTimer)).
  await page.evaluate(({ watched }) => {
    const app = window.comfyAPI.app.app;
    window.kfTimer = setInterval(() => {
      for (const id of watched) {
        const badge = app.graph.getNodeById(id)?.keepfast;
        const last = window.kfSeen.filter((s) => s.node === id).at(-1);
        if (badge && (!last || last.text !== badge.text)) window.kfSeen.push({ node: id, state: badge.state, text: badge.text, fraction: badge.fraction ?? null });
      }
    }, 100);
  }, { watched: config.watch });
}

async function frame(page, ids) {
  // Fit the watched nodes, their badges included, into the canvas at up to 100%.
  await page.evaluate((ids) => {
    const app = window.comfyAPI.app.app;
    const nodes = ids.map((id) => app.graph.getNodeById(id)).filter(Boolean);
    const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
    const left = Math.min(...nodes.map((n) => n.pos[0])) - 20;
    const top = Math.min(...nodes.map((n) => n.pos[1])) - title - 40;
    const right = Math.max(...nodes.map((n) => n.pos[0] + Math.max(n.size[0], 160))) + 20;
    const bottom = Math.max(...nodes.map((n) => n.pos[1] + n.size[1])) + 20;
    const canvas = app.canvas.canvas;
    const scale = Math.min(1, canvas.clientWidth / (right - left), (canvas.clientHeight - 120) / (bottom - top));
    app.canvas.ds.scale = scale;
    app.canvas.ds.offset[0] = -left + 80 / scale;
    app.canvas.ds.offset[1] = -top + 110 / scale;
    app.canvas.setDirty(true, true);
    app.canvas.draw(true, true);
  }, ids);
  await page.waitForTimeout(300);
}

async function remoteLibrary(page) {
  // The library tab's remote section: Check (what fits, nothing downloaded), then Pull what fits.
  await openLibrary(page);
  await page.locator('[data-kf="remote"] summary').click();
  await page.locator('[data-kf="remote-url"]').fill(config.url_remote);
  const rows = async () => page.$$eval('[data-kf="remote-list"] .kf-remote-graph', (items) => items.map((item) => ({
    name: item.getAttribute("data-name"), status: item.getAttribute("data-status"), text: item.innerText })));
  await page.locator('[data-kf="remote-check"]').click();
  await page.waitForFunction(() => document.querySelectorAll('[data-kf="remote-list"] .kf-remote-graph').length > 0);
  result.checked = await rows();
  result.check_status = await statusText(page);
  step(`remote check: ${result.checked.length} graphs`);
  await page.locator('[data-kf="remote-pull"]').click();
  await page.waitForFunction(() => /pulled/.test(document.querySelector('[data-kf="status"]')?.innerText || ""));
  result.pulled = await rows();
  result.pull_status = await statusText(page);
  result.rows = await libraryRows(page);
  await page.screenshot({ path: path.join(config.artifacts, "remote-library.png") });
  step(`remote pull: ${result.pull_status}`);
}

async function library(page) {
  await openLibrary(page);
  result.rows = await libraryRows(page);
  await page.screenshot({ path: path.join(config.artifacts, "library.png") });
  step(`library lists ${result.rows.length} graphs`);
  if (config.trust) {
    const row = page.locator(`.kf-graph[data-name="${config.trust}"]`);
    result.before_trust = await row.locator('[data-kf="trusted"]').innerText();
    await row.locator('button[data-action="trust"]').click();
    await page.waitForFunction((name) => document.querySelector(`.kf-graph[data-name="${name}"] [data-kf="trusted"]`)?.classList.contains("kf-yes"), config.trust);
    result.after_trust = await page.locator(`.kf-graph[data-name="${config.trust}"] [data-kf="trusted"]`).innerText();
    result.trust_status = await statusText(page);
    await page.locator(`.kf-graph[data-name="${config.trust}"] button[data-action="verify"]`).click();
    await page.waitForFunction(() => /verified|sha256|bytes/.test(document.querySelector('[data-kf="status"]')?.innerText || ""));
    result.verify_status = await statusText(page);
    await page.screenshot({ path: path.join(config.artifacts, "library-trusted.png") });
    step("trusted and verified from the library");
  }
}

async function remove(page) {
  await openLibrary(page);
  const row = page.locator(`.kf-graph[data-name="${config.name}"]`);
  await row.waitFor();
  await row.locator('button[data-action="delete"]').click();
  await page.waitForFunction((name) => !document.querySelector(`.kf-graph[data-name="${name}"]`), config.name);
  result.status = await statusText(page);
  result.rows = await libraryRows(page);
  step("deleted from the library");
}

async function badName(page) {
  await openLibrary(page);
  result.attempts = [];
  for (const name of config.names) {
    const answer = await page.evaluate(([name]) => window.keepfast.library.act("delete", name, 0), [name]);
    result.attempts.push({ name, status: answer?.status ?? null, error: answer?.data?.error ?? null,
      shown: await statusText(page), error_class: await page.locator('[data-kf="status"]').getAttribute("class") });
  }
  result.get_delete = await page.evaluate(async () => {
    const response = await window.comfyAPI.api.api.fetchApi("/keepfast/graphs/delete?name=x");
    return { status: response.status, body: await response.json() };
  });
  result.rows = await libraryRows(page);
  step("bad names tried");
}

// -- main -----------------------------------------------------------------------------------------

const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "keepfast-chromium-"));
let context;
let exitCode = 0;
try {
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: config.chromium,
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const page = await openPage(context);
  const phases = { compile, background, library, remote: remoteLibrary, delete: remove, badname: badName };
  if (!phases[phase]) throw new Error(`unknown phase ${phase}`);
  await phases[phase](page);
} catch (error) {
  result.error = String(error?.stack || error);
  exitCode = 1;
  try {
    const page = context?.pages()?.at(-1);
    if (page) await page.screenshot({ path: path.join(config.artifacts, `${phase}-failure.png`) });
  } catch { /* the failure is already recorded */ }
} finally {
  fs.writeFileSync(config.result, JSON.stringify(result, null, 1));
  await context?.close().catch(() => {});
  fs.rmSync(userDataDir, { recursive: true, force: true });
}
process.exit(exitCode);
