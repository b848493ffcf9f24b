"""Shared by the serve tests: tiny artifacts (session-scoped fixtures in conftest.py) and a real
`edgeattn serve` process on 127.0.0.1 (a free port chosen by the OS, stopped by the test)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SERVE_PREFILL = 16  # the prefill graph's tokens in the serve artifacts


def export_tiny(
    root: Path,
    mixer: str = "gla",
    *,
    dynamic_batch: bool = True,
    target: str = "onnxruntime",
    prefill_logits: str | None = None,
    **kw,
):
    """``kw``: the model's config (``make_checkpoint``); ``prefill_logits``: the export's (None: its default)."""
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint

    tag = mixer.replace(",", "_") + "".join(f"_{k}{v}" for k, v in sorted(kw.items()))
    ckpt = root / f"ckpt_{tag}"
    if not ckpt.exists():
        make_checkpoint(ckpt, mixer, **kw)
    name = f"{tag}_{target}{'_dyn' if dynamic_batch else ''}{f'_{prefill_logits}' if prefill_logits else ''}"
    if (root / name / "edgeattn.json").exists():  # exported once per session, whichever test asks first
        return root / name
    return export_model(
        ckpt,
        root / name,
        target=target,
        prefill_chunk=SERVE_PREFILL,
        dynamic_batch=dynamic_batch,
        prefill_logits=prefill_logits,
    )


def greedy_ids(artifact, ids: list[int], max_tokens: int) -> list[int]:
    from edgeattn.runtimes import open_session

    return list(open_session(artifact).generate_ids(ids, max_tokens, temperature=0))


def greedy_text(artifact, prompt: str | list[int], max_tokens: int) -> str:
    """What a lone ``Session.generate(..., temperature=0)`` gives: the reference of every greedy check."""
    from edgeattn.runtimes import open_session

    sess = open_session(artifact)
    tok = sess.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return "".join(tok.stream(sess.generate_ids(ids, max_tokens, temperature=0)))


def text_prompt(n: int, seed: int) -> str:
    """An ASCII prompt of ``n`` characters (= n byte tokens)."""
    rng = np.random.default_rng(seed)
    return "".join(chr(c) for c in rng.integers(32, 127, n))


class Server:
    """``edgeattn serve ARTIFACT ARGS --port 0`` in a subprocess; ``url``, ``log()``, ``stop()``."""

    def __init__(self, artifact, *args, env=None, timeout: float = 60):
        self.log_path = (
            Path(os.environ.get("TMPDIR", "/tmp")) / f"edgeattn-serve-{os.getpid()}-{time.monotonic_ns()}.log"
        )
        self._log = open(self.log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "edgeattn.cli.main",
            "serve",
            str(artifact),
            "--port",
            "0",
            *map(str, args),
        ]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
        self.url = None
        self._terminated = False
        self._final = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"edgeattn serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"edgeattn serve did not start in {timeout} s:\n{self.log()}")
        self.wait_healthy(deadline - time.monotonic())

    def wait_healthy(self, timeout: float = 30) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.url}/health did not answer 200 in {timeout} s:\n{self.log()}")

    def client(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def log(self) -> str:
        if self._final is not None:
            return self._final
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """One SIGTERM (a second one during the interpreter's teardown would end it by the signal)."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20) -> int:
        self.terminate()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        if self._final is None:  # the text stays readable, the file goes
            self._final = self.log_path.read_text(errors="replace")
            self.log_path.unlink(missing_ok=True)
        return rc


def start_server(artifact, *args, **kw) -> Server:
    try:
        return Server(artifact, *args, **kw)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


def health_times_while(url: str, send, workers: int, probes: int, warmup: float = 0.5) -> list[float]:
    """Seconds of ``probes`` ``GET /health`` calls made while ``workers`` threads call ``send()`` in a loop
    (each asserting its own answer): how long the event loop keeps a client waiting under that load."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    stop = threading.Event()

    def flood():
        while not stop.is_set():
            send()

    took = []
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(flood) for _ in range(workers)]
        time.sleep(warmup)
        try:
            with httpx.Client(timeout=5) as h:
                for _ in range(probes):
                    t0 = time.perf_counter()
                    assert h.get(url + "/health").status_code == 200
                    took.append(time.perf_counter() - t0)
                    time.sleep(0.02)
        finally:
            stop.set()
        for f in futures:
            f.result(60)
    return took
