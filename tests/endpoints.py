"""Stand-ins for the network the tests may not reach."""

from __future__ import annotations

import socket
import threading


class DroppingPort:
    """A port on localhost that accepts every connection and closes it at once, counting them: a hub that cannot
    be reached, where each attempt the client makes is seen."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            conn.close()
