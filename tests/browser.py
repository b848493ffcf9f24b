"""A real headless Chromium for tests and benchmarks: Debian's ``chromium`` driven by puppeteer-core
(web/driver.mjs, the repository's npm project; nothing is downloaded). Usable for any page:

    from tests.browser import Browser, browser_missing
    from edgeattn.web.serve import serve_site

    with serve_site(site) as url, Browser() as b:
        b.goto(url + "?prompt=hi&max_new_tokens=8&temperature=0&autostart=1")
        b.wait_for("window.edgeattn && window.edgeattn.done", timeout=60)
        b.type("#prompt", " more"); b.click("#run")   # keystrokes and clicks, for pages with a form
        ids = b.evaluate("window.edgeattn.tokens")
        b.metrics()            # CDP Performance.getMetrics (JSHeapUsedSize, ...) + performance.memory
        b.renderer_rss()       # resident bytes of the page's renderer process (WASM heap included)
        b.screenshot(tmp_path / "page.png")

``browser_missing()`` is the reason to skip (no chromium, no node, no web/node_modules), or None.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "web" / "driver.mjs"
NODE_MODULES = REPO / "web" / "node_modules"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def browser_missing() -> str | None:
    """Why a browser test cannot run here (None when it can): `bash scripts/setup_env.sh` installs all three."""
    if not Path(CHROMIUM).is_file():
        return "no chromium (apt-get install chromium; scripts/setup_env.sh does)"
    if shutil.which("node") is None:
        return "no node (apt-get install nodejs npm)"
    if not (NODE_MODULES / "puppeteer-core").is_dir() or not (NODE_MODULES / "onnxruntime-web").is_dir():
        return "web/node_modules is missing (npm ci in web/; scripts/setup_env.sh does)"
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page; each method is one command to web/driver.mjs."""

    def __init__(self, timeout: float = 60.0, args: list[str] | None = None):
        env = {**os.environ, "CHROMIUM": CHROMIUM, "CHROMIUM_ARGS": " ".join(args or [])}
        self.proc = subprocess.Popen(
            ["node", str(DRIVER)],
            cwd=DRIVER.parent,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._answers: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_answers, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()
        self._id = 0
        self.version = self._answer(0, timeout)

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put(None)  # the driver exited

    def _answer(self, want: int, timeout: float):
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the browser did not answer within {timeout} s; {self._tail()}") from None
        if line is None:
            raise BrowserError(f"the browser driver exited; {self._tail()}")
        msg = json.loads(line)
        if msg.get("id") != want:
            raise BrowserError(f"answer {msg.get('id')} to command {want}")
        if not msg["ok"]:
            raise BrowserError(f"{msg['error']}; {self._tail()}")
        return msg["value"]

    def _tail(self) -> str:
        return "driver stderr: " + "".join(self._stderr[-5:]).strip()[-800:]

    def command(self, cmd: str, timeout: float = 60.0, **args):
        """Send one command and return its value; the driver's own timeout is ``timeout`` too."""
        self._id += 1
        self.proc.stdin.write(
            json.dumps({"id": self._id, "cmd": cmd, "timeout": timeout * 1000, **args}) + "\n"
        )
        self.proc.stdin.flush()
        return self._answer(self._id, timeout + 10)

    def goto(self, url: str, timeout: float = 60.0) -> None:
        self.command("goto", timeout, url=url)

    def wait_for(self, expr: str, timeout: float = 60.0) -> None:
        """Wait until the JavaScript expression ``expr`` is truthy in the page."""
        try:
            self.command("wait", timeout, expr=expr)
        except BrowserError as e:
            raise BrowserError(f"{e}; page logs: {self.logs()[-10:]}") from None

    def evaluate(self, expr: str, timeout: float = 60.0):
        """The JSON value of the JavaScript expression ``expr`` (a Promise is awaited)."""
        return self.command("eval", timeout, expr=expr)

    def type(self, selector: str, text: str) -> None:
        """Type ``text`` into the element ``selector`` as keystrokes."""
        self.command("type", selector=selector, text=text)

    def click(self, selector: str) -> None:
        self.command("click", selector=selector)

    def metrics(self) -> dict:
        """CDP ``Performance.getMetrics`` by name (JSHeapUsedSize, JSHeapTotalSize, ...) and
        ``performance_memory`` (usedJSHeapSize, totalJSHeapSize)."""
        return self.command("metrics")

    def gc(self) -> None:
        self.command("gc")

    def renderer_rss(self) -> int:
        """Resident bytes of the renderer processes (the page's JS and WASM heaps live there)."""
        total = 0
        for p in self.command("processes"):
            if p["type"] == "renderer":
                try:
                    status = Path(f"/proc/{p['id']}/status").read_text()
                except OSError:
                    continue
                total += next(
                    int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")
                )
        return total

    def screenshot(self, path: str | os.PathLike, full_page: bool = False) -> Path:
        self.command("screenshot", path=str(path), fullPage=full_page)
        return Path(path)

    def logs(self) -> list[str]:
        return self.command("logs")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("close", timeout=20)
            except (BrowserError, TimeoutError, OSError):
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
