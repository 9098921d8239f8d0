"""A Redis Cluster of a test's own, from Debian's redis-server and redis-cli:
masters with a replica each on loopback ports, joined by
`redis-cli --cluster create`, persistence off; killed when stopped; or one
standalone node (standalone=True). (The C++ tests have the same in
tools/redis_cluster_process.h.)"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _NodeDown(Exception):
    """A node of a cluster being started did not come up."""


class RedisCluster:
    # Starts with fresh ports this many times when a node does not come up
    # (its port taken between the check and its bind, say); the error names
    # each attempt's node and the end of its log.
    ATTEMPTS = 3

    def __init__(self, masters: int = 3, replicas: int = 1, standalone: bool = False) -> None:
        self.standalone = standalone
        if standalone:
            masters, replicas = 1, 0
        for exe in (REDIS_SERVER, REDIS_CLI):
            if not os.access(exe, os.X_OK):
                raise RuntimeError(f"{exe} is missing: tools/setup-deps.sh installs redis-server")
        failures: list[str] = []
        for attempt in range(self.ATTEMPTS):
            try:
                self._start(masters, replicas, attempt)
                return
            except _NodeDown as e:
                failures.append(str(e))
        raise RuntimeError("Redis Cluster: no cluster in %d attempts: %s" % (self.ATTEMPTS, "; ".join(failures)))

    def _start(self, masters: int, replicas: int, attempt: int) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvtier-py-redis-")
        rng = random.Random(os.getpid() * 7919 + int(time.time()) + attempt)
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            port = rng.randrange(12000, 30000)
            if port not in self.ports and _port_free(port) and _port_free(port + 10000):
                self.ports.append(port)
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            for port in self.ports:
                node_dir = os.path.join(self.directory, str(port))
                os.makedirs(node_dir)
                cluster = [] if self.standalone else [
                    "--cluster-enabled", "yes", "--cluster-config-file", os.path.join(node_dir, "nodes.conf"),
                    "--cluster-node-timeout", "1500", "--cluster-require-full-coverage", "no"]
                self.processes.append(
                    subprocess.Popen(
                        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                         "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", "--dir", node_dir,
                         "--logfile", os.path.join(node_dir, "redis.log"), *cluster],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                )
            for port, process in zip(self.ports, self.processes):
                self._wait_for_node(port, process)
            if self.standalone:
                return
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *self.seeds, "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=60,
            )
            for port in self.ports:
                self._wait(lambda p=port: "cluster_state:ok" in self._cli(p, "CLUSTER", "INFO"), "cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    @property
    def seeds(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def _cli(self, port: int, *args: str) -> str:
        r = subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    def _wait_for_node(self, port: int, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
        """Until redis-server on `port` answers PING; _NodeDown if it exits
        or stays silent, with the end of its log."""
        deadline = time.monotonic() + timeout_s
        while self._cli(port, "PING") != "PONG":
            if process.poll() is not None or time.monotonic() > deadline:
                log = os.path.join(self.directory, str(port), "redis.log")
                tail = ""
                if os.path.exists(log):
                    with open(log, errors="replace") as f:
                        tail = " | ".join(f.read().splitlines()[-3:])
                state = f"exited {process.returncode}" if process.poll() is not None else f"silent for {timeout_s} s"
                raise _NodeDown(f"redis-server :{port} {state} (log: {tail or 'none'})")
            time.sleep(0.05)

    @staticmethod
    def _wait(ready, what: str, timeout_s: float = 30) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster: no {what} within {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.processes:
            p.kill()
            p.wait()
        self.processes = []
        shutil.rmtree(self.directory, ignore_errors=True)
