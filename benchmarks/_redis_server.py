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

from promptsplice.errors import ConfigError

__all__ = ["RedisServer", "free_port"]


def _die_with_parent() -> None:
    """In the child: SIGKILL the server when the process that started it dies (Linux),
    so a killed bench or test run leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (a context manager)."""

    def __init__(self, *, maxmemory: str = "256mb", port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
        self.binary = binary
        self.maxmemory = maxmemory
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="promptsplice-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server (empty) and wait until it answers PING."""
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru", "--dir", self.dir, "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise ConfigError(f"redis-server did not answer on port {self.port} within 10 s")

    def kill(self) -> None:
        """SIGKILL the server (an outage: clients see their connections drop)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Kill it if it runs, then start it again, empty, on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
