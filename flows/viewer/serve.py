"""Serving the viewer with uvicorn: loopback by default, the port bound before uvicorn starts (so a port in
use is one line, not a traceback), the URL printed once it listens."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from pathlib import Path

from storage.errors import CleanerError, WorkspaceError


class ViewError(CleanerError):
    """The viewer cannot start: its port, its address or its storage root."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), or one line saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart after Ctrl-C need not wait
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ViewError(
                f"port {port} on {host} is in use (another `cleaner view`, or another server); "
                "choose another with --port"
            ) from None
        if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise ViewError(f"--host {host}: not an address of this machine ({e.strerror or e})") from None
        if e.errno == errno.EACCES:
            raise ViewError(
                f"--port {port}: not allowed for this user (ports below 1024 need root); use a port above 1024"
            ) from None
        raise
    return sock


def serve(root: Path, catalog_file: Path, host: str = "127.0.0.1", port: int = 8765) -> int:
    import uvicorn

    from flows.viewer.app import create_app

    if not Path(root).is_dir():
        raise WorkspaceError(
            f"storage.root {root} does not exist (no run has written there; check storage.root or --config)"
        )
    loopback = is_loopback(host)
    if not loopback:
        print(
            f"cleaner view: warning: --host {host} is not a loopback address: anyone who can reach this machine "
            "can read every run's trajectories and query the catalog",
            file=sys.stderr,
        )
    sock = bind(host, port)
    port = sock.getsockname()[1]
    hosts = ("127.0.0.1", "localhost", "[::1]", "::1") if loopback else ("*",)
    app = create_app(root, catalog_file, hosts=hosts)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", server_header=False)
    )
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    print(f"cleaner view: http://{shown}:{port}/  (storage root {Path(root).resolve()}; Ctrl-C stops)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
