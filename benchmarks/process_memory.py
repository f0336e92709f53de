"""The resident memory of this process, read from ``/proc/self/status`` (Linux)."""

from __future__ import annotations

from pathlib import Path

MB = 2**20


def rss_bytes(field: str) -> int:
    """A field of ``/proc/self/status`` (``VmRSS`` or ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")
