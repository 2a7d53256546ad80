"""What a local Ray instance leaves running, for the tests that check Ray shuts down cleanly."""

from __future__ import annotations

import subprocess


def ray_processes(session_dir: str) -> list[str]:
    """Live raylet/gcs processes of the Ray instance of ``session_dir`` (others may run
    beside it)."""
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True,
                         timeout=30).stdout
    return [line for line in out.splitlines()
            if ("raylet" in line or "gcs_server" in line) and session_dir in line
            and line.split()[1][:1] != "Z"]
