"""A TCP proxy the tests can cut, to take "the database" away from the service and give it back,
to lose an answer after the request was served, or to lose every gRPC answer on the way back."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self.listener: socket.socket | None = None
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        self._cut_after: tuple[bytes, bytes] | None = None
        self.cuts = 0
        """How many answers `cut_after_request` has lost so far."""

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Closes the listener and every connection: new connects are refused, old ones die."""
        with self.lock:
            sockets, self.connections = self.connections, []
            if self.listener:
                sockets.append(self.listener)
                self.listener = None
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut_after_request(self, marker: bytes, answer: bytes = b"") -> None:
        """The next request holding `marker` reaches the server, which runs it (and commits);
        its answer never comes back: the link is cut the moment the server sends bytes holding
        `answer` (for Postgres, b"SELECT 1\x00": the CommandComplete sent after the commit)."""
        with self.lock:
            self._cut_after = (marker, answer)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            # Registered only while the listener that accepted it is still the proxy's, under
            # the lock `cut` takes: a link accepted just before a cut and connected upstream just
            # after it would otherwise escape the cut, and keep the database reachable through
            # it (health stayed SERVING in one of four loaded runs of the outage test).
            with self.lock:
                live = self.listener is listener
                if live:
                    self.connections += [client, server]
            if not live:
                client.close()
                server.close()
                return
            link = _Link(self, client, server)
            threading.Thread(target=link.up, daemon=True).start()
            threading.Thread(target=link.down, daemon=True).start()

    def _take_cut(self, data: bytes) -> bytes | None:
        """The answer marker to cut at, when `data` is the request armed for."""
        with self.lock:
            if self._cut_after is not None and self._cut_after[0] in data:
                answer, self._cut_after = self._cut_after[1], None
                return answer
        return None

    def answers(self, data: bytes, state: _Link) -> bytes:
        """What of the server's bytes reaches the client (all of it, here)."""
        return data


class _Link:
    """One client connection and its upstream twin."""

    def __init__(self, proxy: TcpProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.cut_on_answer: bytes | None = None
        self.pending = b""

    def up(self) -> None:
        self._pump(self.client, self.server, upstream=True)

    def down(self) -> None:
        self._pump(self.server, self.client, upstream=False)

    def _pump(self, source: socket.socket, sink: socket.socket, *, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if upstream:
                    if (answer := self.proxy._take_cut(data)) is not None:
                        self.cut_on_answer = answer
                    sink.sendall(data)
                elif self.cut_on_answer is not None and self.cut_on_answer in data:
                    self.proxy.cuts += 1
                    return  # the answer is dropped and the link closed below
                else:
                    sink.sendall(self.proxy.answers(data, self))
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class AnswerDroppingProxy(TcpProxy):
    """In front of a gRPC server: the link stays up (connection-level HTTP/2 frames pass), but
    every frame of a call's stream from the server is dropped: each call is served and its
    answer lost on the way, so the client runs into its deadline."""

    def answers(self, data: bytes, state: _Link) -> bytes:
        state.pending += data
        passed = b""
        while len(state.pending) >= 9:
            length = int.from_bytes(state.pending[:3], "big")
            if len(state.pending) < 9 + length:
                break
            frame, state.pending = state.pending[: 9 + length], state.pending[9 + length :]
            (stream,) = struct.unpack(">I", frame[5:9])
            if stream & 0x7FFFFFFF == 0:
                passed += frame
        return passed
