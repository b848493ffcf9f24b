// A headless Chromium driven over stdin/stdout, one JSON command per line, for tests and benchmarks in
// any language (tests/browser.py is the Python side). The browser is the system's (CHROMIUM, default
// /usr/bin/chromium), driven by puppeteer-core: nothing is downloaded.
//
//   {"id": 1, "cmd": "goto", "url": "http://127.0.0.1:8000/?autostart=1", "timeout": 60000}
//   {"id": 2, "cmd": "wait", "expr": "window.edgeattn && window.edgeattn.done", "timeout": 60000}
//   {"id": 3, "cmd": "eval", "expr": "window.edgeattn.tokens"}
//   {"id": 4, "cmd": "type", "selector": "#input", "text": "Hello"}   keystrokes into an element
//   {"id": 4, "cmd": "click", "selector": "#send"}
//   {"id": 4, "cmd": "metrics"}       CDP Performance.getMetrics + performance.memory
//   {"id": 5, "cmd": "gc"}            CDP HeapProfiler.collectGarbage
//   {"id": 6, "cmd": "processes"}     CDP SystemInfo.getProcessInfo: [{type, id (pid), cpuTime}]
//   {"id": 7, "cmd": "screenshot", "path": "/tmp/page.png"}
//   {"id": 8, "cmd": "logs"}          console messages and page errors so far
//   {"id": 9, "cmd": "close"}
// Each answer is one line: {"id", "ok": true, "value"} or {"id", "ok": false, "error"}.
import readline from "node:readline";
import puppeteer from "puppeteer-core";

const logs = [];
const browser = await puppeteer.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: [
    "--no-sandbox", // tests run as root in containers
    "--enable-precise-memory-info", // performance.memory without rounding
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    ...(process.env.CHROMIUM_ARGS ? process.env.CHROMIUM_ARGS.split(" ") : []),
  ],
});
const page = await browser.newPage();
await page.setViewport({ width: 1000, height: 800 });
page.on("console", (m) => logs.push(`console.${m.type()}: ${m.text()}`));
page.on("pageerror", (e) => logs.push(`pageerror: ${e.message}`));
const cdp = await page.createCDPSession();
const browserCdp = await browser.target().createCDPSession();

async function handle(msg) {
  switch (msg.cmd) {
    case "goto":
      await page.goto(msg.url, { timeout: msg.timeout ?? 60000, waitUntil: "load" });
      return null;
    case "wait":
      await page.waitForFunction(msg.expr, { timeout: msg.timeout ?? 60000, polling: msg.polling ?? 100 });
      return null;
    case "type":
      await page.type(msg.selector, msg.text);
      return null;
    case "click":
      await page.click(msg.selector);
      return null;
    case "eval":
      return await page.evaluate(msg.expr);
    case "metrics": {
      const { metrics } = await cdp.send("Performance.getMetrics");
      const memory = await page.evaluate(() =>
        performance.memory
          ? { usedJSHeapSize: performance.memory.usedJSHeapSize, totalJSHeapSize: performance.memory.totalJSHeapSize }
          : null,
      );
      return { ...Object.fromEntries(metrics.map((m) => [m.name, m.value])), performance_memory: memory };
    }
    case "gc":
      await cdp.send("HeapProfiler.collectGarbage");
      return null;
    case "processes":
      return (await browserCdp.send("SystemInfo.getProcessInfo")).processInfo;
    case "screenshot":
      await page.screenshot({ path: msg.path, fullPage: msg.fullPage ?? false });
      return msg.path;
    case "logs":
      return logs;
    case "close":
      return null;
    default:
      throw new Error(`unknown command ${JSON.stringify(msg.cmd)}`);
  }
}

await cdp.send("Performance.enable");
process.stdout.write(JSON.stringify({ id: 0, ok: true, value: await browser.version() }) + "\n");
const lines = readline.createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  let msg = {};
  try {
    msg = JSON.parse(line);
    const value = await handle(msg);
    process.stdout.write(JSON.stringify({ id: msg.id, ok: true, value: value ?? null }) + "\n");
  } catch (e) {
    process.stdout.write(JSON.stringify({ id: msg.id, ok: false, error: String(e?.message ?? e) }) + "\n");
  }
  if (msg.cmd === "close") break;
}
await browser.close();
process.exit(0); // stdin stays open otherwise
