"""A throwaway Redis server on loopback for the shared-tier bench and tests.

Starts the ``redis-server`` binary (installed by ``scripts/setup.sh``) on a free port,
without persistence, bounded by ``maxmemory`` with the ``allkeys-lru`` policy (the
shared tier relies on the server's own LRU), and stops it with SIGKILL (what an outage
looks like) or SIGTERM.  :meth:`RedisServer.restart` brings a killed server back, empty,
on the same port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from promptsplice.errors import EngineStartError

__all__ = ["RedisServer", "free_port"]

START_DEADLINE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(port: int, command: bytes) -> bytes:
    """One command's whole reply (a status line, or a bulk string's payload)."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(command + b"\r\n")
        data = b""
        while b"\r\n" not in data or (data.startswith(b"$") and len(data) < _bulk_end(data)):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
    return data[data.index(b"\r\n") + 2:_bulk_end(data) - 2] if data.startswith(b"$") else data


def _bulk_end(data: bytes) -> int:
    head = data.index(b"\r\n")
    return head + 2 + max(int(data[1:head]), 0) + 2


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (a context manager), in a process group
    of its own with the watchdog of :func:`promptsplice.benchmarks.servers.popen_watched`:
    the server goes when the process that started it dies (from any thread).  Its output
    goes to ``redis.log`` in its folder; a start that fails names the log's tail, and
    leaves no server and no folder behind."""

    def __init__(self, *, maxmemory: str = "256mb", port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise EngineStartError("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
        self.binary = binary
        self.maxmemory = maxmemory
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="promptsplice-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._watch: int | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> str:
        return os.path.join(self.dir, "redis.log")

    def _tail(self, n: int = 15) -> str:
        try:
            with open(self.log, errors="replace") as f:
                lines = f.read().splitlines()[-n:]
        except OSError:
            lines = ["(no log)"]
        return "\n".join(lines)

    def _fail(self, what: str) -> EngineStartError:
        self.kill()
        return EngineStartError(f"redis-server on port {self.port} {what}; its output:\n{self._tail()}")

    def start(self) -> None:
        """Start the server (empty) and wait until it answers PING, as itself (``INFO``'s
        ``process_id``: not another server that holds the port).  A running server is
        left as it is."""
        from promptsplice.benchmarks.servers import popen_watched

        if self.proc is not None and self.proc.poll() is None:
            return
        self.kill()  # an exited server's watchdog
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru", "--dir", self.dir, "--protected-mode", "yes",
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc, self._watch = popen_watched(args, grace_s=5.0, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            try:
                if _ask(self.port, b"PING").startswith(b"+PONG"):
                    info = _ask(self.port, b"INFO server").decode(errors="replace")
                    if f"process_id:{self.proc.pid}\r\n" in info and self.proc.poll() is None:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.02)  # also after an answer that is not ours (-LOADING, another server)
        raise self._fail(f"did not answer as itself within {START_DEADLINE_S:.0f} s")

    def kill(self) -> None:
        """SIGKILL the server (an outage: clients see their connections drop), its
        watchdog too."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # gone (the id may be another's now)
                pass
            self.proc.wait()
        self._release()

    def _release(self) -> None:
        if self._watch is not None:
            os.close(self._watch)
            self._watch = None
        self.proc = None

    def restart(self) -> None:
        """Kill it if it runs, then start it again, empty, on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL after 5 s), remove its folder."""
        if self.proc is not None:
            from promptsplice.benchmarks.servers import stop_process_groups

            stop_process_groups([self.proc], grace_s=5.0)
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
