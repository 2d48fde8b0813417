"""A tiny stand-in service for the supervisor tests: real process, real HTTP /health.

usage: python child_server.py PORT [--ignore-sigterm] [--exit-after S] [--never-healthy]
It also spawns a grandchild (`sleep`) in its own process group, so the tests can
check that stopping a child stops everything it started.
"""

from __future__ import annotations

import http.server
import signal
import subprocess
import sys
import threading
import time


def main() -> None:
    port = int(sys.argv[1])
    flags = set(sys.argv[2:])
    if "--ignore-sigterm" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "600"])
    print(f"grandchild pid {grandchild.pid}", flush=True)
    healthy = "--never-healthy" not in flags

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if healthy and self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"listening on {port}", flush=True)
    if "--exit-after" in sys.argv:
        time.sleep(float(sys.argv[sys.argv.index("--exit-after") + 1]))
        print("exiting on purpose", flush=True)
        sys.exit(3)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
