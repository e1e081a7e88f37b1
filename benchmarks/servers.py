"""Server processes on loopback: how the benches and the tests start and stop them.

:func:`loopback_servers` is the one way this project starts ``vllm serve`` from Python
(the routing, gateway and served-parity benches and the tests reuse it); the gateway
bench's ``smg`` and :class:`~promptsplice.benchmarks._redis_server.RedisServer` start
through :func:`spawn_logged` / :func:`popen_watched` too.  A module of its own because
none of those benches owns it: it lived in the routing bench, and every other user
imported process handling from there.

Every server started here runs in a process group of its own with a watchdog in it
(:func:`popen_watched`) that stops the group when this process dies, even by SIGKILL;
:func:`stop_process_groups` stops whole groups (the API server's EngineCore outlives it).
A server counts as ready only when its own process group answers on its port
(:func:`answered_by`).  ``PROMPTSPLICE_SERVER_START_S`` (seconds) overrides how long a
server may take to start (:func:`start_deadline`; default 300 s, 60 s for ``smg``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptsplice.engine_adapters._config import auto_dtype
from promptsplice.errors import ConfigError, EngineStartError

__all__ = [
    "BLOCK_SIZE",
    "LoopbackServer",
    "START_ENV",
    "answered_by",
    "loopback_servers",
    "popen_watched",
    "spawn_logged",
    "start_deadline",
    "stop_process_group",
    "stop_process_groups",
    "stop_servers",
]

BLOCK_SIZE = 32
"""The block size of the servers started here (``--block-size``) and of the benches' routers."""
STARTUP_DEADLINE_S = 300.0
START_ENV = "PROMPTSPLICE_SERVER_START_S"
"""Environment variable: seconds a loopback server (vLLM, smg) may take to start."""


@dataclass(slots=True)
class LoopbackServer:
    """One server subprocess (``vllm serve``, ``smg``) on 127.0.0.1, in its own process group."""

    base_url: str
    proc: subprocess.Popen
    log: Path

    log_dir: Path | None = None
    """The folder made for the log (removed on :meth:`stop`); ``None``: the caller's."""
    keep_log: bool | None = None
    """Leave ``log_dir`` on :meth:`stop` (a server that failed: its error names the log);
    ``None``: only if the server had exited before (a crash); ``False``: never."""
    watch_fd: int | None = None
    """The write end of the watchdog's pipe (:func:`popen_watched`), closed on :meth:`stop`."""

    def tail(self, n: int = 40) -> str:
        """The log's last ``n`` lines, after the exception lines anywhere in it (vLLM's
        engine process logs the root cause well above the API server's last traceback,
        which ends in "see root cause above"), and the log's path."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        causes = list(dict.fromkeys(ln.strip() for ln in lines if _EXCEPTION_LINE.search(ln)))[-6:]
        head = ["exceptions in the log:", *causes, "..."] if causes else []
        return "\n".join([*head, *lines[-n:], f"(whole log: {self.log})"])

    def stop(self) -> None:
        """Stop the server's whole process group: SIGTERM, SIGKILL after 30 s (at once on
        an interrupt).  The group, not the API server alone: its EngineCore process
        outlives an API server that died (vLLM has no parent-death signal), ~2.5 GB each.
        ``log_dir`` goes too, unless ``keep_log`` or the server had exited before it was
        stopped (it crashed: its log is kept and named on stderr)."""
        stop_servers([self])

    def _release(self, crashed: bool) -> None:
        """After the group stopped: close the watchdog's pipe; remove or keep the log."""
        if self.watch_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.watch_fd)
            self.watch_fd = None
        if crashed and self.keep_log is None:
            self.keep_log = True
            print(f"{self.base_url}: the server had exited with {self.proc.returncode} before it was "
                  f"stopped; its log is kept: {self.log}", file=sys.stderr)
        if self.log_dir is not None and not self.keep_log:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def stop_servers(servers: Sequence[LoopbackServer], grace_s: float = 30.0) -> None:
    """Stop every server at once (:func:`stop_process_groups`): an interrupt while they
    stop (a second Ctrl-C) SIGKILLs every group, none is left behind."""
    crashed = [s.proc.poll() is not None for s in servers]
    try:
        stop_process_groups([s.proc for s in servers], grace_s)
    finally:
        for srv, dead in zip(servers, crashed):
            srv._release(dead)


_EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception): ")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """:func:`stop_process_groups` of one process."""
    stop_process_groups([proc], grace_s)


def _leads_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # exited and reaped: its group, if any, may live on
        return True


def _group_gone(pgid: int) -> bool:
    """No member left, or only zombies (exited, waiting for a parent to reap them: an
    orphan's is init, which may take seconds, or never in a container without one)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: the id went to another user's group
        return True
    states = [state for _, state in _members(pgid)]
    return bool(states) and all(st == "Z" for st in states)


def stop_process_groups(procs: Sequence[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM the process group each of ``procs`` leads (started with
    ``start_new_session``), all first, then wait until every member of every group is
    gone; SIGKILL what is left after ``grace_s``, or at once when the wait is interrupted
    (Ctrl-C, SystemExit): then nothing is left behind either.  Also when a process itself
    has exited: its children may not have.  A process that leads no group of its own is
    terminated alone."""
    groups = [p for p in procs if _leads_group(p)]
    alone = [p for p in procs if p not in groups]
    finished = False
    try:
        for p in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in alone:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        while True:
            for p in procs:
                p.poll()  # reap the leader: a zombie still counts as a member
            if all(_group_gone(p.pid) for p in groups) and all(p.returncode is not None for p in alone):
                finished = True
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
    finally:
        if not finished:  # past the grace, or interrupted: SIGKILL whatever is left
            for p in groups:
                if not _group_gone(p.pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
            for p in alone:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


# The launcher of every server started here: forks a watchdog, then execs the server (same
# pid, leader of its own group).  EOF on the pipe: the parent is gone (even by SIGKILL), so
# SIGTERM the group, wait for the server (up to the grace), SIGKILL the group, itself too.
_WATCHDOG = """\
import os, signal, sys, time
r, grace, cmd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
leader = os.getpid()
if os.fork() == 0:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while os.read(r, 64):
                pass
        except OSError:
            pass
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        end = time.monotonic() + grace
        while os.getppid() == leader and time.monotonic() < end:
            time.sleep(0.2)
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)
os.close(r)
os.execvp(cmd[0], cmd)
"""


def popen_watched(cmd: Sequence[str], *, grace_s: float = 10.0, **popen_kw: Any) -> tuple[subprocess.Popen, int]:
    """``subprocess.Popen(cmd)`` in a new session (its own process group) with a watchdog
    in the group that stops the group when this process dies (``_WATCHDOG``).  Returns the
    process (the server's own pid) and the write end of the watchdog's pipe: keep it open
    while the server should run, close it after stopping the group.  Unlike
    ``PR_SET_PDEATHSIG`` it is not tied to the thread that started the server; a child
    this process forks (not exec) holds the pipe open too, until it ends."""
    r, w = os.pipe()  # not inheritable: only the launcher gets ``r`` (pass_fds)
    try:
        proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(r), str(grace_s), *cmd],
                                pass_fds=(r,), start_new_session=True, **popen_kw)
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return proc, w


def spawn_logged(cmd: Sequence[str], log: Path, url: str, env: Mapping[str, str]) -> LoopbackServer:
    """Start ``cmd`` (:func:`popen_watched`, environment ``env``) with its stdout and
    stderr in ``log``, a file in a folder made for it: the server at ``url`` owns that
    folder (``log_dir``, removed on stop).  When the start fails, the folder is removed."""
    try:
        with log.open("wb") as out:
            proc, watch = popen_watched(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    except BaseException:
        shutil.rmtree(log.parent, ignore_errors=True)
        raise
    return LoopbackServer(url, proc, log, log_dir=log.parent, watch_fd=watch)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (all probe sockets held open together, so
    two cannot be the same port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def start_deadline(default: float) -> float:
    """Seconds a server may take to start: ``PROMPTSPLICE_SERVER_START_S`` or ``default``."""
    raw = os.environ.get(START_ENV, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{START_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _links(pid: str) -> Iterator[str]:
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                yield os.readlink(f"/proc/{pid}/fd/{fd}")


def _members(pgid: int) -> Iterator[tuple[str, str]]:
    """(pid, state) of each process in group ``pgid``, from ``/proc`` (none without it)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            f = _read(f"/proc/{entry.name}/stat").rsplit(")", 1)[-1].split() if entry.name.isdigit() else []
            if len(f) > 2 and int(f[2]) == pgid:
                yield entry.name, f[0]


def listened_by_group(pgid: int, port: int) -> bool | None:
    """Whether a process of group ``pgid`` listens on TCP ``port`` (Linux ``/proc``: the
    inodes of the sockets listening on it, ``/proc/net/tcp*``, against the descriptors of
    the group's processes); ``None`` when it cannot be told (no ``/proc``, no listener)."""
    rows = [ln.split() for t in ("/proc/net/tcp", "/proc/net/tcp6") for ln in _read(t).splitlines()[1:]]
    wanted = {f"socket:[{f[9]}]" for f in rows
              if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port}
    if not wanted:
        return None
    return any(wanted.intersection(_links(pid)) for pid, _ in _members(pgid))


def answered_by(proc: subprocess.Popen, port: int) -> bool:
    """After an answer on ``port``: was it ``proc``'s server?  It must still run, and
    (where ``/proc`` tells) its process group must hold the listening socket: a port
    taken by another process between choosing it and the server's bind answers too."""
    return proc.poll() is None and listened_by_group(proc.pid, port) is not False


def _start(
    model: Path, *, port: int, block_size: int, kv_cache_gib: int, max_model_len: int,
    extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
) -> LoopbackServer:
    log = Path(tempfile.mkdtemp(prefix="route-vllm-")) / "server.log"
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # GiB; the default would take ~19 GiB
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets the CPU platform keep the uni executor
    env.update(extra_env or {})
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(block_size), "--enable-prefix-caching",
        "--max-model-len", str(max_model_len), "--enforce-eager",
        "--enable-prompt-tokens-details", "--dtype", auto_dtype(),
        # one worker in the engine-core process: no third process importing torch+vLLM
        "--distributed-executor-backend", "uni",
        *extra_args,
    ]
    return spawn_logged(cmd, log, f"http://127.0.0.1:{port}", env)


def _lost_its_port(srv: LoopbackServer) -> bool:
    """The server exited because another process bound its port first (the port was
    free when chosen, then taken before the server's bind)."""
    try:
        return "Address already in use" in srv.log.read_text(errors="replace")
    except OSError:
        return False


def _wait_healthy(
    servers: list[LoopbackServer], deadline_s: float,
    restart: Callable[[LoopbackServer], LoopbackServer | None] | None = None,
) -> None:
    """Wait until every server answers ``/health`` from its own process group.  A server
    that lost its port to another process is started once more on a new port by
    ``restart`` (it replaces the old one in ``servers``; ``None``: no new port); any
    other exit is an error."""
    import httpx

    deadline = time.monotonic() + deadline_s
    pending = list(servers)
    restarted: set[int] = set()
    while pending:
        for srv in list(pending):
            again = None
            if srv.proc.poll() is not None and restart is not None and id(srv) not in restarted \
                    and _lost_its_port(srv):
                again = restart(srv)
            if again is not None:
                srv.keep_log = False  # the cause is known: no log to keep
                srv.stop()
                restarted.add(id(again))
                servers[servers.index(srv)] = again
                pending[pending.index(srv)] = again
                continue
            if srv.proc.poll() is not None:
                srv.keep_log = True
                raise EngineStartError(
                    f"vllm serve at {srv.base_url} exited with {srv.proc.returncode}:\n{srv.tail()}"
                )
            try:  # loopback: never through a proxy from the environment
                if httpx.get(srv.base_url + "/health", timeout=2, trust_env=False).status_code == 200:
                    if answered_by(srv.proc, int(srv.base_url.rsplit(":", 1)[1])):
                        pending.remove(srv)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            pending[0].keep_log = True
            raise EngineStartError(
                f"vllm serve at {pending[0].base_url} not healthy after {deadline_s:.0f} s "
                f"(on a busy machine, set {START_ENV} to more seconds):\n{pending[0].tail()}"
            )
        if pending:
            time.sleep(1)


@contextlib.contextmanager
def loopback_servers(
    n: int = 2,
    *,
    block_size: int = BLOCK_SIZE,
    kv_cache_gib: int = 1,
    max_model_len: int = 2048,
    deadline_s: float | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[list[LoopbackServer]]:
    """Start ``n`` real ``vllm serve`` (default model) at once, wait until all answer
    ``/health``, yield them, stop them all on exit (also on error).  ``extra_args`` /
    ``extra_env``: more ``vllm serve`` arguments / environment (e.g. the splice
    connector's ``--kv-transfer-config``).  ``deadline_s``: seconds to start, default
    ``PROMPTSPLICE_SERVER_START_S`` or 300."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be an int >= 1 (servers to start), got {n!r}")
    if deadline_s is None:
        deadline_s = start_deadline(STARTUP_DEADLINE_S)
    from promptsplice.engine_adapters._model import ensure_default_model

    model = ensure_default_model()
    servers: list[LoopbackServer] = []

    def start(port: int) -> LoopbackServer:
        return _start(model, port=port, block_size=block_size, kv_cache_gib=kv_cache_gib,
                      max_model_len=max_model_len, extra_args=extra_args, extra_env=extra_env)

    def restart(lost: LoopbackServer) -> LoopbackServer | None:
        taken = {int(s.base_url.rsplit(":", 1)[1]) for s in servers}
        fresh = [p for p in _free_ports(len(taken) + 1) if p not in taken]
        if not fresh:
            return None
        port = fresh[0]
        print(f"{lost.base_url}: another process took the port before vllm serve bound it; "
              f"starting it again on {port}", file=sys.stderr)
        return start(port)

    try:
        for port in _free_ports(n):
            servers.append(start(port))
        _wait_healthy(servers, deadline_s, restart)
        yield servers
    finally:
        stop_servers(servers)
