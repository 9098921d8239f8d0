"""SlowLink: a TCP proxy on loopback in front of one server (a standalone
Redis) whose replies trickle back `piece_bytes` at a time with `interval_s`
between pieces: a congested or distant link, for what Redis cannot do
itself. `interval_s` may change at any time (0: a link that recovered).
The C++ tests have the same in tests/tiers/remote/slow_proxy.h.

For tests only. Stops (closing every connection) on stop()."""

from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    def __init__(self, target_port: int, piece_bytes: int = 4096, interval_s: float = 0.002) -> None:
        self.target_port = target_port
        self.piece_bytes = piece_bytes
        self.interval_s = interval_s
        self._stopping = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, paced: bool) -> None:
        try:
            while not self._stopping:
                data = source.recv(64 << 10)
                if not data:
                    break
                interval = self.interval_s if paced else 0.0
                step = self.piece_bytes if interval > 0 else len(data)
                for at in range(0, len(data), step):
                    if at > 0:
                        time.sleep(interval)
                    sink.sendall(data[at : at + step])
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def stop(self) -> None:
        self._stopping = True
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
