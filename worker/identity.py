"""Who this worker is, as the run rows record it: host and thread (one task per thread in the
prefork pool). Its own module so the tasks and the jobs they run name the worker alike without
importing each other."""

from __future__ import annotations

import socket
import threading


def worker_name() -> str:
    return f"{socket.gethostname()}:{threading.get_native_id()}"
