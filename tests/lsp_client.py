"""A few lines of LSP client: `ppdsl lsp` as a subprocess, JSON-RPC with Content-Length framing.

Used by tests/test_lsp.py and benchmarks/bench_lsp.py. A reader thread files every message
from the server: responses by id, notifications in arrival order.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def ppdsl_command() -> list[str]:
    script = Path(sys.executable).with_name("ppdsl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ppdsl"]


class LspClient:
    def __init__(self, *extra: str, cwd: Path = ROOT) -> None:
        self.proc = subprocess.Popen([*ppdsl_command(), "lsp", *extra], cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._next_id = 0
        self._responses: dict[int, Any] = {}
        self._cond = threading.Condition()
        self.notifications: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    # ---- framing -------------------------------------------------------------------------------

    def send(self, message: dict) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode("utf-8")
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def _read_loop(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while True:
                header = out.readline()
                if not header:
                    return  # the server exited
                header = header.strip()
                if not header:
                    break
                name, _, value = header.decode("ascii").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            assert length is not None, "a message without Content-Length"
            message = json.loads(out.read(length))
            if "id" in message and "method" not in message:
                with self._cond:
                    self._responses[message["id"]] = message
                    self._cond.notify_all()
            elif "id" in message:  # a request from the server (e.g. window/workDoneProgress/create)
                self.send({"id": message["id"], "result": None})
            else:
                self.notifications.put(message)

    # ---- JSON-RPC ------------------------------------------------------------------------------

    def request(self, method: str, params: Any, timeout: float = 60.0) -> Any:
        self._next_id += 1
        rid = self._next_id
        self.send({"id": rid, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        with self._cond:
            while rid not in self._responses:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer to {method} within {timeout} s")
                self._cond.wait(left)
            message = self._responses.pop(rid)
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        return message.get("result")

    def notify(self, method: str, params: Any) -> None:
        self.send({"method": method, "params": params})

    def wait_notification(self, method: str, timeout: float = 30.0) -> dict:
        """The next notification of `method` (others are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} within {timeout} s")
            try:
                message = self.notifications.get(timeout=left)
            except queue.Empty:
                continue
            if message.get("method") == method:
                return message["params"]

    # ---- the LSP conversation ------------------------------------------------------------------

    def initialize(self, options: dict | None = None, encodings: list[str] | None = None) -> dict:
        caps: dict = {"textDocument": {"hover": {"contentFormat": ["markdown"]}}}
        if encodings:
            caps["general"] = {"positionEncodings": encodings}
        result = self.request("initialize", {"processId": None, "rootUri": ROOT.as_uri(), "capabilities": caps,
                                             "initializationOptions": options or {}})
        self.notify("initialized", {})
        return result

    def open(self, uri: str, text: str, version: int = 1) -> dict:
        self.notify("textDocument/didOpen",
                    {"textDocument": {"uri": uri, "languageId": "ppspec", "version": version, "text": text}})
        return self.diagnostics_of(uri, version)

    def change(self, uri: str, text: str, version: int) -> dict:
        self.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                               "contentChanges": [{"text": text}]})
        return self.diagnostics_of(uri, version)

    def diagnostics_of(self, uri: str, version: int, timeout: float = 30.0) -> dict:
        """The next diagnostics published for this version of the document (the server publishes
        a document's diagnostics again when the model its checks wait for is built)."""
        deadline = time.monotonic() + timeout
        while True:
            published = self.wait_notification("textDocument/publishDiagnostics", max(0.0, deadline - time.monotonic()))
            if published["uri"] == uri and published.get("version") == version:
                return published

    def close(self) -> int:
        try:
            self.request("shutdown", None, timeout=10)
            self.notify("exit", None)
            return self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            return self.proc.wait()
        finally:
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
