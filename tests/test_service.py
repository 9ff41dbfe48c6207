"""``kvspec conform --service`` and ``--extra``: a service started, waited for (bounded) and
stopped; the connector's configuration checked and carried to every engine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvspec._service import parse_address, running_service
from kvspec.conformance.harness.config import EXTRA_ENV, HarnessConfig, connector_extra
from kvspec.protocols import InvalidArgumentError, TransferTimeoutError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_service_is_waited_for_and_stopped() -> None:
    port = _free_port()
    cmd = f"{sys.executable} -m http.server {port} --bind 127.0.0.1"
    with running_service(cmd, f"127.0.0.1:{port}", timeout_s=30) as proc:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # ready
    assert proc.poll() is not None  # stopped with the block


def test_a_service_that_exits_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="exited with code 3"):
        with running_service(f"{sys.executable} -c 'import sys; sys.exit(3)'",
                             f"127.0.0.1:{_free_port()}", timeout_s=30):
            pass
    assert time.monotonic() - start < 10


def test_a_service_that_never_answers_times_out() -> None:
    with pytest.raises(TransferTimeoutError, match="within 1 s"):
        with running_service(f"{sys.executable} -c 'import time; time.sleep(60)'",
                             f"127.0.0.1:{_free_port()}", timeout_s=1):
            pass


@pytest.mark.parametrize("bad", ["localhost", ":5555", "host:0", "host:99999", "host:x"])
def test_bad_service_addresses_fail_typed(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match="HOST:PORT"):
        parse_address(bad)


def test_connector_extra_reaches_every_engine_view(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXTRA_ENV, json.dumps({"server": "tcp://h:1", "size": 3}))
    view = HarnessConfig(extra={"size": 4}).engine_view("/tmp/x")
    assert view.extra["server"] == "tcp://h:1" and view.extra["size"] == 4  # the test's own wins
    assert view.extra["kvspec.tmpdir"] == "/tmp/x"


@pytest.mark.parametrize("raw", ["{", "[1]", '{"kvspec.tmpdir": "/x"}'])
def test_bad_connector_extra_fails_typed(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(EXTRA_ENV, raw)
    with pytest.raises(InvalidArgumentError, match=EXTRA_ENV):
        connector_extra()


@pytest.mark.parametrize("args, match", [
    (["--extra", "novalue"], "expected KEY=VALUE"),
    (["--extra-file", "/no/such/file.json"], "--extra-file"),
    (["--extra", "kvspec.tmpdir=/x"], "harness's own"),
    (["--service", "/no/such/server", "--service-wait", "127.0.0.1:9"], "cannot start service"),
])
def test_cli_refuses_bad_extra_and_service(tmp_path: Path, args: list[str], match: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvspec", "conform",
                           "kvspec.conformance.connectors.null:NullConnector", *args,
                           "--", "-k", "capabilities_are_declared"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert match in proc.stderr


def test_a_service_launcher_and_the_server_it_detaches_are_both_stopped(tmp_path: Path) -> None:
    """mooncake_master's launcher starts the server in a session of its own: stopping the
    launcher's process group left the server holding its port after the run."""
    port = _free_port()
    pidfile = tmp_path / "server.pid"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'http.server', '{port}', '--bind',"
        " '127.0.0.1'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n")
    with running_service(f"{sys.executable} {launcher}", f"127.0.0.1:{port}", timeout_s=30):
        server = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the detached server {server} still runs")
