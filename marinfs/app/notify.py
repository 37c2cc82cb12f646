"""sd_notify without libsystemd: tell a Type=notify unit we are mounted (READY=1) or stopping."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def sd_notify(state: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send ``state`` (e.g. "READY=1", "STOPPING=1", "STATUS=...") to $NOTIFY_SOCKET.

    Returns False when not run by systemd or when the send fails: a lost notification must
    never take a mount down, so errors are only logged at debug.
    """
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
        return True
    except OSError as exc:
        log.debug("sd_notify(%r) to %r failed: %s", state, environ.get("NOTIFY_SOCKET"), exc)
        return False
