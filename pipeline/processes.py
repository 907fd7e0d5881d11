"""Whether a process we started still runs: shared by the services cleaner starts and stops by pid
(the project's Prefect server, the local Dask cluster)."""
from __future__ import annotations

import psutil


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
