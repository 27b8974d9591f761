"""Replay of QMP conversations recorded from real QEMU (``qmp_fixtures/``).

A fixture is one JSON file (``tests/record_fixtures.py`` writes them)::

    {"description": ..., "recorded_with": {...}, "greeting": {"QMP": ...},
     "exchanges": [{"command": {"execute": ..., "arguments": ...},
                    "reply": {"return": ...} | {"error": {...}}},
                   {"nbd": {"export": ..., "bitmaps": [...], "length": N},
                    "extents": [[offset, length], ...]}   (or "error": "...")
                   , ...]}

``FakeQMP`` serves a fixture on a unix socket to one client (qemu.qmp's
handshake included) and answers each command with the recorded reply, in
order; the ``nbd`` steps are answered by ``FakeQMP.reader`` (a stand-in for
``read_dirty_extents``). Anything the recording did not contain - another
command, other arguments, a step out of order - is an error reply to the
client and a failure raised by ``close()``, as are steps never reached.

Values that differ between runs are tokens in the files: ``@WORKDIR@``
(the test's directory) and ``@SESSION@`` (the tracker's random tag); a
``Normaliser`` maps them both ways.
"""

from __future__ import annotations

import json
import os

import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vmcache.errors import BitmapReadError

__all__ = ["FIXTURES", "Normaliser", "load_fixture", "FakeQMP"]

FIXTURES = Path(__file__).resolve().parents[1] / "qmp_fixtures"


class Normaliser:
    """Replaces run-specific strings by tokens (``normalise``) and back (``restore``)."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self.tokens: dict[str, str] = dict(tokens or {})

    def bind(self, token: str, value: str) -> None:
        self.tokens[token] = value

    def _map(self, obj: Any, pairs: list[tuple[str, str]]) -> Any:
        if isinstance(obj, str):
            for old, new in pairs:
                obj = obj.replace(old, new)
            return obj
        if isinstance(obj, list):
            return [self._map(x, pairs) for x in obj]
        if isinstance(obj, dict):
            return {self._map(k, pairs): self._map(v, pairs) for k, v in obj.items()}
        return obj

    def normalise(self, obj: Any) -> Any:
        # Longest value first, so a path inside another is not cut short.
        pairs = sorted(((v, t) for t, v in self.tokens.items() if v), key=lambda p: -len(p[0]))
        return self._map(obj, pairs)

    def restore(self, obj: Any) -> Any:
        return self._map(obj, [(t, v) for t, v in self.tokens.items()])


def load_fixture(name: str) -> dict[str, Any]:
    """A fixture by file name (with or without ``.json``)."""
    path = FIXTURES / (name if name.endswith(".json") else f"{name}.json")
    return json.loads(path.read_text())


class FakeQMP:
    """A fake QMP server on ``socket_path`` replaying ``fixture``."""

    def __init__(self, fixture: str | Mapping[str, Any], socket_path: Path, normaliser: Normaliser) -> None:
        self.fixture = load_fixture(fixture) if isinstance(fixture, str) else dict(fixture)
        self.exchanges: list[dict[str, Any]] = list(self.fixture["exchanges"])
        self.cursor = 0
        self.failures: list[str] = []
        self.normaliser = normaliser
        self.socket_path = str(socket_path)
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.socket_path)
        self._server.listen(1)
        self._server.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fakeqmp", daemon=True)
        self._thread.start()

    # -- the script -------------------------------------------------------

    def _next(self, kind: str, got: Any) -> dict[str, Any] | None:
        """The next step if it is ``kind`` and matches ``got`` (normalised); else record a failure."""
        with self._lock:
            if self.cursor >= len(self.exchanges):
                self.failures.append(f"unexpected {kind} after the recording ended: {got}")
                return None
            step = self.exchanges[self.cursor]
            want = step.get(kind)
            if want != got:
                self.failures.append(f"step {self.cursor}: expected {kind} {want or step}, got {got}")
                return None
            self.cursor += 1
            return step

    def reader(self, socket_path: str, export: str, bitmaps: list[str], length: int, *, timeout: float,
               ranges: np.ndarray | None = None) -> np.ndarray:
        """Stand-in for ``read_dirty_extents``: the recorded extents of the next ``nbd`` step.

        ``ranges`` is not checked: the recordings were read over the whole image.
        """
        got = self.normaliser.normalise({"export": export, "bitmaps": list(bitmaps), "length": length})
        step = self._next("nbd", got)
        if step is None:
            raise AssertionError(self.failures[-1])
        if not os.path.isdir(os.path.dirname(socket_path)):
            self.failures.append(f"nbd read: no runtime directory for {socket_path}")
        if "error" in step:
            raise BitmapReadError(step["error"])
        return np.array(step["extents"], dtype=np.int64).reshape(-1, 2)

    # -- the server -------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        conn.sendall(json.dumps(self.fixture["greeting"]).encode() + b"\r\n")
        decoder = json.JSONDecoder()
        buf = ""
        while not self._stop.is_set():
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buf += data.decode()
            # QMP is a JSON stream: messages need no newline between them.
            while buf.strip():
                try:
                    msg, end = decoder.raw_decode(buf.lstrip())
                except ValueError:
                    break
                buf = buf.lstrip()[end:]
                conn.sendall(json.dumps(self._answer(msg)).encode() + b"\r\n")

    def _answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        msg_id = msg.get("id")
        if msg.get("execute") == "qmp_capabilities":
            reply: dict[str, Any] = {"return": {}}
        else:
            command = {"execute": msg.get("execute")}
            if msg.get("arguments"):
                command["arguments"] = msg["arguments"]
            step = self._next("command", self.normaliser.normalise(command))
            if step is None:
                reply = {"error": {"class": "GenericError", "desc": f"fakeqmp: unexpected {command}"}}
            else:
                reply = self.normaliser.restore(step["reply"])
        if msg_id is not None:
            reply["id"] = msg_id
        return reply

    def close(self) -> None:
        """Stop serving; raise AssertionError on any unexpected or missing step."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        if self.failures:
            raise AssertionError("fakeqmp: " + "; ".join(self.failures))
        if self.cursor != len(self.exchanges):
            left = self.exchanges[self.cursor]
            raise AssertionError(f"fakeqmp: {len(self.exchanges) - self.cursor} recorded steps never reached: {left}")


