"""Test fixtures: a real kvtierd on a temporary socket, and its clients.

kvtierd is found in $KVTIER_PROGRAMS_DIR (tools/test.sh sets it to the installed
wheel's kvtier/bin), else in build/debug/bin of this checkout.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import tempfile
import time
from typing import Iterator

import pytest

import kvtier

ROOT = pathlib.Path(__file__).resolve().parents[3]


def kvtierd_path() -> pathlib.Path:
    programs = os.environ.get("KVTIER_PROGRAMS_DIR")
    path = pathlib.Path(programs) / "kvtierd" if programs else ROOT / "build" / "debug" / "bin" / "kvtierd"
    if not path.exists():
        pytest.fail(f"no kvtierd at {path}: build the project first or set KVTIER_PROGRAMS_DIR")
    return path


class Daemon:
    """A kvtierd process of the tests' own, stopped at the end."""

    def __init__(self, directory: str, settings: list[str]) -> None:
        self.directory = directory
        self.socket = os.path.join(directory, "kvtierd.sock")
        self.settings = settings
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(directory, "kvtierd.log")

    def start(self) -> None:
        args = [str(kvtierd_path()), "--foreground"]
        defaults = [
            f"socket.path={self.socket}",
            f"state_dir={self.directory}/state",
            f"tiers.disk.paths=[{self.directory}/disk]",
            "tiers.disk.enabled=false",
            "metrics.enabled=false",
            "tiers.host.bytes=64MiB",
        ]
        for s in defaults + self.settings:
            args += ["--set", s]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.process.poll() is not None:
                pytest.fail(f"kvtierd exited at start-up:\n{self.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"kvtierd did not listen within 20 s:\n{self.log()}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        self.process = None
        if os.path.exists(self.socket) and sig == signal.SIGKILL:
            os.unlink(self.socket)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="kvtier-py-") as directory:
        d = Daemon(directory, [])
        d.start()
        try:
            yield d
        finally:
            d.stop()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[kvtier.Client]:
    c = kvtier.Client.connect(daemon.socket, name="pytest", reconnect_interval=0.02)
    try:
        yield c
    finally:
        c.close()


def small_layout() -> kvtier.Layout:
    # 16 KiB blocks: 2 layers x (K, V) x 16 tokens x 2 heads x 64 dims x bf16.
    return kvtier.Layout("kvtier/python-tests", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", block_tokens=16)
