"""What a training process does when it is told to stop: SIGTERM from a scheduler, or from the kernel when its
launcher or node agent died (PR_SET_PDEATHSIG, launcher/agent.py). It writes its rank's newest committed
snapshot to disk (with --persist-dir), within --stop-grace, and exits 143; so a job whose coordinator died
leaves a checkpoint that `--resume auto` completes and starts from.

The main thread may be inside a collective (C code, where Python runs no signal handler) for a long time, so
the work is done by a thread of its own, woken at once through the signal wakeup fd that the C-level handler
writes to.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

from deadpool.runtime.context import Context

EXIT_CODE = 128 + signal.SIGTERM


def on_termination(ctx: Context, last_words: Callable[[], None]) -> bool:
    """Runs `last_words` on SIGTERM, then exits; False (nothing installed) off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler makes the C handler write the wakeup fd
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_wait, args=(ctx, read_fd, last_words), name="deadpool-terminate", daemon=True).start()
    return True


def _wait(ctx: Context, read_fd: int, last_words: Callable[[], None]) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    deadline = threading.Timer(ctx.config.stop_grace_s, os._exit, args=(EXIT_CODE,))  # bounded, whatever happens
    deadline.daemon = True
    deadline.start()
    # Not a daemon (a thread started by a daemon is one unless told): the main thread may be ending meanwhile (its
    # store is gone too), and an interpreter that exits waits for this thread before it runs its exit handlers.
    threading.Thread(target=_last, args=(ctx, last_words), name="deadpool-last-words", daemon=False).start()


def _last(ctx: Context, last_words: Callable[[], None]) -> None:
    ctx.events.emit("terminated", signal="SIGTERM")
    try:
        last_words()
    except Exception as error:  # the disk, or a snapshot that moved on: said, and the process still exits
        ctx.events.emit("last_words_failed", error=f"{type(error).__name__}: {error}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)
