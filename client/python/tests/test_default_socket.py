"""One default socket: kvtierd started without socket.path and a client that
names none find each other (common/default_socket.h), and the vLLM
connector that finds no daemon says once, at WARNING, where it looked."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import time

import pytest
from conftest import kvtierd_path

import kvtier


def test_a_daemon_without_a_socket_path_is_where_a_client_without_one_looks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.path.exists("/run/kvtier/kvtierd.sock"):
        pytest.skip("a packaged kvtierd listens here: clients find it first")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    daemon = subprocess.Popen(
        [str(kvtierd_path()), "--foreground", "--set", f"state_dir={tmp_path}/state", "--set", "tiers.disk.enabled=false",
         "--set", "metrics.enabled=false", "--set", "tiers.host.bytes=16MiB"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    socket = runtime / "kvtier" / "kvtierd.sock"
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr.read().decode() if daemon.stderr else ""
            time.sleep(0.05)
        # A client elsewhere, with the same runtime directory, finds it.
        monkeypatch.delenv("KVTIER_SOCKET", raising=False)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        monkeypatch.chdir(tmp_path.parent)
        assert kvtier.default_socket() == str(socket)
        with kvtier.Client.connect(kvtier.default_socket(), name="default-socket") as client:
            assert client.daemon_release == kvtier.__version__
        # So does kvtierctl, with no --socket.
        ctl = kvtierd_path().with_name("kvtierctl")
        out = subprocess.run([str(ctl), "version"], capture_output=True, text=True, env={**env}, cwd=tmp_path.parent)
        assert out.returncode == 0 and kvtier.__version__ in out.stdout, out.stdout + out.stderr
        # KVTIER_SOCKET names it for both.
        monkeypatch.setenv("KVTIER_SOCKET", "/nowhere/kvtierd.sock")
        assert kvtier.default_socket() == "/nowhere/kvtierd.sock"
        assert kvtier.default_socket_candidates() == ["/nowhere/kvtierd.sock"]
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def test_a_vllm_connector_that_finds_no_daemon_says_once_where_it_looked(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM is not installed")
    if os.path.exists("/run/kvtier/kvtierd.sock"):
        pytest.skip("a packaged kvtierd listens here")
    from kvtier import _vllm_common

    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_vllm_common, "_RECONNECT_INTERVAL_S", 0.0)
    settings = _vllm_common._Settings(
        socket=None, token=None, model_id="m", lookup_timeout_s=1, lookup_wait_s=0, op_timeout_s=1
    )
    connection = _vllm_common._Connection(settings, "pytest")
    logger = logging.getLogger("vllm.kvtier")
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root's
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.kvtier"):
            assert connection.client() is None
            assert connection.client() is None
    finally:
        logger.removeHandler(caplog.handler)
    # Each record once, whichever handler caught it.
    warnings = [r.getMessage() for r in {id(r): r for r in caplog.records}.values() if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    for where in ("/run/kvtier/kvtierd.sock", f"{tmp_path}/kvtier/kvtierd.sock", "./var/kvtier/kvtierd.sock", "KVTIER_SOCKET"):
        assert where in warnings[0], warnings[0]
    assert sys.modules["kvtier"] is kvtier
