"""What every lab worker shares: the host's wire counters and the record it prints."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

__all__ = ["Window", "emit", "reducer_layout", "wire_bytes"]

_DEV = Path("/sys/class/net/eth0/statistics")


def wire_bytes() -> tuple[int, int]:
    """``(tx, rx)`` link-layer bytes of this host's ``eth0`` so far ((0, 0) where there is none)."""
    try:
        return int((_DEV / "tx_bytes").read_text()), int((_DEV / "rx_bytes").read_text())
    except OSError:
        return 0, 0


def emit(**record: object) -> None:
    """Print one ``LAB {json}`` line (with this host's name and the launcher's rank)."""
    record.setdefault("host", socket.gethostname())
    record.setdefault("rank", int(os.environ.get("RANK", "0")))
    print("LAB " + json.dumps(record, sort_keys=True), flush=True)


class Window:
    """Seconds and wire bytes between :meth:`start` and :meth:`stop` (call both after a barrier)."""

    def start(self) -> None:
        self._tx, self._rx = wire_bytes()
        self._t = time.perf_counter()

    @property
    def started(self) -> float:
        """``time.perf_counter()`` at :meth:`start`."""
        return self._t

    def stop(self) -> dict[str, float]:
        seconds = time.perf_counter() - self._t
        tx, rx = wire_bytes()
        return {"seconds": seconds, "tx": tx - self._tx, "rx": rx - self._rx}


def reducer_layout(reducer: object | None) -> dict[str, object]:
    """Our gradient reducer's bucket sizes (bytes) and the link it measured (bytes/s, or None),
    for a record; nothing without a reducer (DDP, a local run)."""
    if reducer is None:
        return {}
    link = reducer.link  # type: ignore[attr-defined]
    return {"bucket_bytes": reducer.bucket_sizes_bytes,  # type: ignore[attr-defined]
            "probed_bytes_per_s": None if link is None else link.bytes_per_s}
