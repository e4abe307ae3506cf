"""What every child process of the server does at start: die with the parent, log, report ready."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback

_PR_SET_PDEATHSIG = 1


def configure_logging(log_level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"[%(asctime)s {name}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def die_with_parent() -> None:
    """Make this process exit when its parent does, however the parent goes (even SIGKILL).

    Linux: the kernel sends SIGKILL on parent death (prctl PR_SET_PDEATHSIG). Everywhere: a daemon
    thread polls the parent pid as a backstop (and covers the race where the parent died before
    prctl ran).
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def child_process_setup(name: str, log_level: str) -> None:
    die_with_parent()
    # Ctrl-C reaches the whole process group; the parent alone decides how children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level, name)


def report_ready(conn, info: dict | None = None, error: BaseException | None = None) -> None:
    """Tell the parent this child is ready (with `info`) or could not start (with the error)."""
    if error is not None:
        msg = {"ok": False, "error": "".join(traceback.format_exception(error)).strip()}
    else:
        msg = {"ok": True, "info": info or {}}
    try:
        conn.send(msg)
    finally:
        conn.close()
