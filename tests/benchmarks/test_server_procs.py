"""How the benches start and stop their servers (``loopback_servers``, ``gateway``,
``RedisServer``), with FAKE ``vllm serve`` and ``smg`` (a tiny HTTP server put first on
``PYTHONPATH``) and a real ``redis-server``: a parent killed by SIGKILL or SIGTERM leaves
no server behind, a second Ctrl-C while stopping kills every server, readiness is never
taken from another process on the port, health checks skip proxies, a crashed server's
log is kept, failures name their reason."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from promptsplice.benchmarks import gateway as gw_mod
from promptsplice.benchmarks import servers as srv_mod
from promptsplice.errors import ConfigError, EngineResponseError, EngineStartError, PromptspliceError

_FAKE_SERVER = """\
import http.server, os, signal, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
if os.environ.get("FAKE_PIDFILE"):
    with open(os.environ["FAKE_PIDFILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
if os.environ.get("FAKE_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
if os.environ.get("FAKE_EXIT"):
    sys.exit(int(os.environ["FAKE_EXIT"]))


class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/readiness") else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


try:
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as exc:
    print(f"OSError: cannot bind {port}: {exc}", flush=True)
    sys.exit(1)
srv.serve_forever()
"""

_CHILD_PRELUDE = """\
import json, os, signal, sys, time
from pathlib import Path
from promptsplice.benchmarks import servers as srv_mod
import promptsplice.engine_adapters._model as _model
srv_mod.auto_dtype = lambda: "float32"
_model.ensure_default_model = lambda: Path("/nonexistent-model")
status = Path(sys.argv[1])
"""

DEADLINE_S = 120  # generous: a loaded 2-core machine


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake ``vllm`` and ``smg`` package; returns the ``extra_env`` that puts them first."""
    root = tmp_path / "fake"
    api = root / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", api):
        (d / "__init__.py").write_text("")
    (api / "api_server.py").write_text(_FAKE_SERVER)
    (root / "smg").mkdir()
    (root / "smg" / "__init__.py").write_text("")
    (root / "smg" / "__main__.py").write_text(_FAKE_SERVER)
    monkeypatch.setattr(srv_mod, "auto_dtype", lambda: "float32")  # no torch import
    import promptsplice.engine_adapters._model as model

    monkeypatch.setattr(model, "ensure_default_model", lambda: tmp_path / "no-model")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the servers' log folders
    pidfile = tmp_path / "fake.pids"
    env = {"PYTHONPATH": str(root), "FAKE_PIDFILE": str(pidfile)}
    yield env
    for pid in _pids(pidfile):  # whatever a failed test left behind
        _kill_group(pid)


def _pids(pidfile: Path) -> list[int]:
    try:
        return [int(x) for x in pidfile.read_text().split()]
    except FileNotFoundError:
        return []


def _kill_group(pgid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (an orphan's zombie waits for init)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                f = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(f[2]) == pgid and f[0] != "Z":
                out.append(int(name))
    return out


def _wait_gone(pgids: list[int], timeout: float = 60) -> list[int]:
    """The groups still alive after ``timeout`` (none once all are gone)."""
    end = time.monotonic() + timeout
    while True:
        alive = [g for g in pgids if _live_members(g)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.2)


def _wait_for(path: Path, what: str, proc: subprocess.Popen | None = None) -> str:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        text = path.read_text() if path.exists() else ""
        if what in text:
            return text
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the child exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.1)
    pytest.fail(f"no {what!r} in {path} after {DEADLINE_S} s")


def _child(script: str, status: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(script), str(status)],
                            env=dict(os.environ, TMPDIR=str(status.parent / "tmp"), **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# --------------------------------------------------------------------------- item 1, 8


def test_servers_go_when_their_parent_is_killed_by_sigkill(fake, tmp_path):
    """``start_new_session`` and no parent-death handling: two fake vLLM and a fake smg
    outlived a bench killed by SIGKILL.  Now a watchdog in each group stops it."""
    status = tmp_path / "status"
    child = _child("""
        from promptsplice.benchmarks.gateway import gateway
        env = json.loads(os.environ["EXTRA"])
        with srv_mod.loopback_servers(2, extra_env=env) as servers:
            with gateway([s.base_url for s in servers], "prefix_hash") as gw:
                status.write_text(json.dumps([s.proc.pid for s in servers] + [gw.proc.pid]) + "\\nup")
                time.sleep(600)
    """, status, {"EXTRA": json.dumps(fake), "PYTHONPATH": fake["PYTHONPATH"]})
    groups: list[int] = []
    try:
        groups = json.loads(_wait_for(status, "up", child).splitlines()[0])
        assert all(_live_members(g) for g in groups)
        child.kill()
        child.wait(timeout=60)
        assert _wait_gone(groups) == []
    finally:
        child.kill()
        for g in groups:
            _kill_group(g)


def test_sigterm_to_a_tool_runs_its_finally_blocks_and_stops_its_servers(fake, tmp_path):
    """``run_tool`` let SIGTERM end the process at once: no ``finally`` ran, the servers
    were left (exit -15).  Now SIGTERM is ``SystemExit(143)``."""
    status, marker = tmp_path / "status", tmp_path / "finally"
    child = _child(f"""
        from promptsplice.benchmarks.cli import run_tool
        env = json.loads(os.environ["EXTRA"])

        def main(argv):
            try:
                with srv_mod.loopback_servers(2, extra_env=env) as servers:
                    status.write_text(json.dumps([s.proc.pid for s in servers]) + "\\nup")
                    time.sleep(600)
            finally:
                Path({str(marker)!r}).write_text("ran")

        raise SystemExit(run_tool(main))
    """, status, {"EXTRA": json.dumps(fake)})
    groups: list[int] = []
    try:
        groups = json.loads(_wait_for(status, "up", child).splitlines()[0])
        child.terminate()
        assert child.wait(timeout=90) == 143
        assert marker.read_text() == "ran"
        assert _wait_gone(groups) == []
    finally:
        child.kill()
        for g in groups:
            _kill_group(g)


def test_a_redis_server_started_in_a_thread_outlives_the_thread():
    """``PR_SET_PDEATHSIG`` fires when the starting *thread* exits: a server started from
    a worker thread died with it.  The watchdog follows the process."""
    from promptsplice.benchmarks._redis_server import RedisServer

    _need_redis()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("s", RedisServer(maxmemory="16mb")))
    t.start()
    t.join()
    srv = box["s"]
    try:
        time.sleep(1.0)
        assert srv.proc is not None and srv.proc.poll() is None
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(16).startswith(b"+PONG")
    finally:
        srv.stop()


# --------------------------------------------------------------------------- item 2


def test_a_second_interrupt_while_stopping_kills_every_server(fake, tmp_path):
    """Ctrl-C while servers that ignore SIGTERM were stopping (30 s grace each, one after
    the other): the first was never SIGKILLed, the second never even signalled."""
    status = tmp_path / "status"
    child = _child("""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = dict(json.loads(os.environ["EXTRA"]), FAKE_IGNORE_TERM="1")
        box = []
        try:
            with srv_mod.loopback_servers(2, extra_env=env) as servers:
                box.extend(servers)
                status.write_text(json.dumps([s.proc.pid for s in servers]) + "\\nstopping")
        except KeyboardInterrupt:
            pass
        status.write_text(status.read_text() + "\\ndone")
        time.sleep(600)  # the test looks at the servers while this process still lives
    """, status, {"EXTRA": json.dumps(fake)})
    groups: list[int] = []
    try:
        groups = json.loads(_wait_for(status, "stopping", child).splitlines()[0])
        time.sleep(1.5)  # inside the stop's grace period
        child.send_signal(signal.SIGINT)
        _wait_for(status, "done", child)
        assert _wait_gone(groups, timeout=20) == []  # while the parent still lives
    finally:
        child.kill()
        for g in groups:
            _kill_group(g)


# --------------------------------------------------------------------------- item 3


def test_an_answer_from_another_process_on_the_port_is_not_readiness(fake, tmp_path, monkeypatch):
    """Another process took the chosen port before the (slow) server bound it: its 200 on
    ``/health`` was taken as the server's, while the server failed to bind."""
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    monkeypatch.setattr(srv_mod, "_free_ports", lambda n: [port] * n, raising=False)
    monkeypatch.setattr(srv_mod, "_free_port", lambda: port, raising=False)  # the code before the fix
    try:
        with pytest.raises(EngineStartError, match="exited with 1"):
            with srv_mod.loopback_servers(1, extra_env=dict(fake, FAKE_DELAY="2"), deadline_s=DEADLINE_S):
                pass
    finally:
        other.shutdown()
        other.server_close()


def test_a_server_that_lost_its_port_to_another_process_starts_again_on_a_new_one(fake, monkeypatch, capsys):
    """The port is free when chosen and bound seconds later; another process taking it in
    between made vllm serve exit ("Address already in use") and failed the whole start."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    real = srv_mod._free_ports
    calls = []

    def first_taken(n):
        calls.append(n)
        return [taken] if len(calls) == 1 else real(n)

    monkeypatch.setattr(srv_mod, "_free_ports", first_taken)
    try:
        with srv_mod.loopback_servers(1, extra_env=fake, deadline_s=DEADLINE_S) as (srv,):
            port = int(srv.base_url.rsplit(":", 1)[1])
            assert port != taken and len(calls) == 2
            assert httpx.get(srv.base_url + "/health", trust_env=False).status_code == 200
            assert srv_mod.answered_by(srv.proc, port)
    finally:
        holder.close()
    assert f"127.0.0.1:{taken}: another process took the port" in capsys.readouterr().err


def test_the_ports_of_one_start_are_distinct():
    ports = srv_mod._free_ports(64)
    assert len(set(ports)) == 64


def test_redis_on_a_port_another_server_holds_is_an_error_with_its_output(monkeypatch):
    """A second server on an occupied port failed to bind, but PING reached the first
    one: the start passed on someone else's server.  Also: the reason is named, no
    folder is left."""
    from promptsplice.benchmarks import _redis_server

    _need_redis()
    made = _record_mkdtemp(monkeypatch, _redis_server)
    with _redis_server.RedisServer(maxmemory="16mb") as first:
        with pytest.raises(EngineStartError, match="(?s)exited with 1.*(already in use|Could not create)"):
            _redis_server.RedisServer(maxmemory="16mb", port=first.port)
        assert first.proc.poll() is None
    assert len(made) == 2 and not any(os.path.exists(d) for d in made)


# --------------------------------------------------------------------------- item 4


def test_health_checks_never_go_through_a_proxy(fake, monkeypatch):
    """HTTP_PROXY without NO_PROXY sent the loopback ``/health`` and ``/readiness`` checks
    to the proxy: no server was ever ready."""
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", fake["PYTHONPATH"])  # the fake smg (gateway's own env)
    with srv_mod.loopback_servers(1, extra_env=fake, deadline_s=30) as servers:
        with gw_mod.gateway([servers[0].base_url], "prefix_hash", deadline_s=30) as gw:
            assert gw.proc.poll() is None


# --------------------------------------------------------------------------- item 5


def test_gateway_with_a_server_that_is_down_is_one_line(monkeypatch, capsys):
    from promptsplice.benchmarks.cli import run_tool

    monkeypatch.setattr(gw_mod, "_prompts", lambda *a: {"naive": [], "assembled": []})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens
    rc = run_tool(gw_mod.main, ["--url", f"http://127.0.0.1:{port}", "--requests", "1", "--mode", "affinity"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "cannot reach" in err and "Traceback" not in err


def test_answers_that_are_not_json_are_engine_response_errors():
    metrics = "\n".join(f"{n} 0" for n in ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                                            "vllm:request_success_total"))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(200, text="<html>a proxy page</html>")

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(EngineResponseError, match="not a completion"):
            gw_mod.send_through(client, ["http://s"], [("text", 1, "k")], route=lambda t, k: ("http://s", {}),
                                salt="s", model="m")
        with pytest.raises(EngineResponseError, match="no model"):
            gw_mod.served_model(client, "http://s")


# --------------------------------------------------------------------------- item 6, 7, 10b


def _need_redis() -> None:
    import shutil

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `make setup` (scripts/setup.sh installs it)")


def _record_mkdtemp(monkeypatch, module) -> list[str]:
    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(module.tempfile, "mkdtemp", mkdtemp)
    return made


def test_a_redis_server_that_cannot_start_names_why_and_leaves_nothing(monkeypatch):
    from promptsplice.benchmarks import _redis_server

    _need_redis()
    made = _record_mkdtemp(monkeypatch, _redis_server)
    with pytest.raises(EngineStartError, match="(?s)exited with 1.*maxmemory"):
        _redis_server.RedisServer(maxmemory="lots")
    assert len(made) == 1 and not os.path.exists(made[0])


def test_an_interrupt_while_redis_starts_leaves_no_server_and_no_folder(monkeypatch):
    from promptsplice.benchmarks import _redis_server

    _need_redis()
    made = _record_mkdtemp(monkeypatch, _redis_server)
    procs: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            procs.append(self)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(_redis_server.socket, "create_connection", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _redis_server.RedisServer(maxmemory="16mb")
    assert len(procs) == 1
    try:
        assert procs[0].wait(timeout=30) is not None
        assert _wait_gone([procs[0].pid], timeout=30) == []
        assert len(made) == 1 and not os.path.exists(made[0])
    finally:
        _kill_group(procs[0].pid)


def test_start_on_a_running_redis_keeps_that_server():
    from promptsplice.benchmarks._redis_server import RedisServer

    _need_redis()
    with RedisServer(maxmemory="16mb") as srv:
        first = srv.proc
        srv.start()
        assert srv.proc is first and first.poll() is None
    assert first.poll() is not None


def test_a_redis_that_answers_loading_is_polled_not_spun_on(tmp_path, monkeypatch):
    """A server answering ``-LOADING`` to PING: the wait loop reconnected at once, over
    and over (a core burnt for the whole deadline)."""
    from promptsplice.benchmarks import _redis_server

    counts = tmp_path / "connects"
    script = tmp_path / "redis-server"
    script.write_text(f"""#!{sys.executable}
import socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(64)
n = 0
while True:
    conn, _ = srv.accept()
    n += 1
    open({str(counts)!r}, "w").write(str(n))
    try:
        conn.recv(64)
        conn.sendall(b"-LOADING Redis is loading the dataset in memory\\r\\n")
    except OSError:
        pass
    conn.close()
""")
    script.chmod(0o755)
    monkeypatch.setattr(_redis_server.shutil, "which", lambda name: str(script))
    monkeypatch.setattr(_redis_server, "START_DEADLINE_S", 3.0, raising=False)
    with pytest.raises(PromptspliceError, match="did not answer"):
        _redis_server.RedisServer()
    # 3 s (10 s before the fix) at one try per 20 ms at most: ~150; a spin made thousands
    assert 0 < int(counts.read_text()) <= 600


# --------------------------------------------------------------------------- item 9, 10a


def test_a_server_that_crashed_keeps_its_log_and_says_where(fake, capsys):
    """``stop()`` deleted the log of a server that had died mid-bench (the reason was in it)."""
    with srv_mod.loopback_servers(3, extra_env=fake, deadline_s=DEADLINE_S) as servers:
        crashed, killed, fine = servers
        killed.keep_log = False  # a test that kills its server on purpose opts out
        for srv in (crashed, killed):
            os.kill(srv.proc.pid, signal.SIGKILL)  # a crash mid-bench
            srv.proc.wait(timeout=30)
    err = capsys.readouterr().err
    assert crashed.log.exists() and str(crashed.log) in err
    assert killed.log_dir is not None and not killed.log_dir.exists() and str(killed.log) not in err
    assert fine.log_dir is not None and not fine.log_dir.exists()


def test_a_gateway_leaves_no_log_folder(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", fake["PYTHONPATH"])
    temp = tmp_path / "tmp"  # the fixture's tempfile.tempdir
    with gw_mod.gateway(["http://127.0.0.1:9"], "prefix_hash", deadline_s=DEADLINE_S) as gw:
        assert gw.log.exists()
    assert list(temp.iterdir()) == []


def test_the_start_deadline_comes_from_the_environment(fake, monkeypatch):
    """The message said "raise the deadline", which no option did."""
    monkeypatch.setenv("PROMPTSPLICE_SERVER_START_S", "1")
    slow = dict(fake, FAKE_DELAY="20", FAKE_EXIT="3")  # before the fix: "exited with 3" after 20 s
    with pytest.raises(EngineStartError, match="not healthy after 1 s.*PROMPTSPLICE_SERVER_START_S"):
        with srv_mod.loopback_servers(1, extra_env=slow):
            pass
    monkeypatch.setenv("PYTHONPATH", fake["PYTHONPATH"])
    monkeypatch.setenv("FAKE_DELAY", "20")
    monkeypatch.setenv("FAKE_EXIT", "3")
    with pytest.raises(EngineStartError, match="not ready after 1 s.*PROMPTSPLICE_SERVER_START_S"):
        with gw_mod.gateway(["http://127.0.0.1:9"], "prefix_hash"):
            pass
    monkeypatch.setenv("PROMPTSPLICE_SERVER_START_S", "soon")
    with pytest.raises(ConfigError, match="PROMPTSPLICE_SERVER_START_S"):
        with srv_mod.loopback_servers(1, extra_env=fake):
            pass
