"""What a training process does when it is told to stop: SIGTERM from a scheduler, or from the kernel when its
launcher or node agent died (PR_SET_PDEATHSIG, launcher/agent.py). It writes its rank's newest committed
snapshot to disk (with --persist-dir), within --stop-grace, and exits 143; so a job whose coordinator died
leaves a checkpoint that `--resume auto` completes and starts from.

The main thread may be inside a collective (C code, where Python runs no signal handler) for a long time, so
the work is done by a thread of its own, woken at once through the signal wakeup fd that the C-level handler
writes to. The main thread may also be ending at that very moment (it lost the coordinator's store too), so
the exit paths that end a process with os._exit call `before_exit()`: when the launcher is gone, they say the
last words first.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable

from deadpool.runtime.context import Context

EXIT_CODE = 128 + signal.SIGTERM


class LastWords:
    """A process's last words: said once, by whichever comes first (the SIGTERM thread or an exit path)."""

    def __init__(self, ctx: Context, words: Callable[[], None]) -> None:
        self.ctx, self.words = ctx, words
        self.parent = os.getppid()  # once the launcher (or node agent) dies, the process has another parent
        self.signalled = False
        self.once = threading.Lock()
        self.said = threading.Event()

    def launcher_gone(self) -> bool:
        """The parent is another (reparented) or on its way out: a launcher killed with SIGKILL ends its threads
        one by one, and a child is handed to a sibling of the thread that started it (same pid) while they end."""
        return os.getppid() != self.parent or exiting(self.parent)

    def due(self) -> bool:
        return self.signalled or self.launcher_gone()

    def say(self) -> None:
        """Says the last words, bounded by --stop-grace (the process then exits whatever happens); a second
        caller waits until they are said."""
        if not self.once.acquire(blocking=False):
            self.said.wait(self.ctx.config.stop_grace_s)
            return
        deadline = threading.Timer(self.ctx.config.stop_grace_s, os._exit, args=(EXIT_CODE,))
        deadline.daemon = True
        deadline.start()
        self.ctx.events.emit("terminated", signal="SIGTERM" if self.signalled else None,
                             launcher_gone=self.launcher_gone())
        try:
            self.words()
        except Exception as error:  # the disk, or a snapshot that moved on: said, and the process still exits
            self.ctx.events.emit("last_words_failed", error=f"{type(error).__name__}: {error}")
        finally:
            self.said.set()


PF_EXITING = 0x4  # linux/sched.h: the process has begun to exit


def exiting(pid: int) -> bool:
    """Whether process `pid` is gone or on its way out. A launcher that dies closes its sockets (its store)
    before its children are given another parent and sent SIGTERM, so a rank that lost the store in that
    window sees its old parent still there, exiting."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)


_installed: LastWords | None = None
_finally: list[Callable[[], None]] = []  # at_exit's functions, each run once


def at_exit(function: Callable[[], None]) -> None:
    """Runs `function` as the process ends, also when it ends with os._exit: DeadPool's exit paths that skip
    the interpreter's finalization (failures.end_quietly_after_errors, comms.guard_exit) call before_exit()
    first. A plain atexit handler registered before those would never run after an uncaught exception."""
    if not _finally:
        atexit.register(before_exit)
    _finally.append(function)


def on_termination(ctx: Context, last_words: Callable[[], None]) -> bool:
    """Says `last_words` on SIGTERM, then exits 143; False (nothing installed) off the main thread."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    _installed = LastWords(ctx, last_words)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler makes the C handler write the wakeup fd
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_wait, args=(_installed, read_fd), name="deadpool-terminate", daemon=True).start()
    atexit.register(before_exit)  # a process that ends without os._exit
    return True


def before_exit() -> None:
    """Called by the paths that end a process with os._exit: if its launcher is gone (or SIGTERM came), the last
    words are said now, before the exit, rather than lost with the threads that would have said them."""
    if _installed is not None and _installed.due():
        _installed.say()
    while _finally:
        _finally.pop(0)()


def _wait(last: LastWords, read_fd: int) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    last.signalled = True
    # Not a daemon (a thread started by a daemon is one unless told): an interpreter that exits meanwhile
    # waits for it before it runs its exit handlers.
    threading.Thread(target=_say_and_exit, args=(last,), name="deadpool-last-words", daemon=False).start()


def _say_and_exit(last: LastWords) -> None:
    last.say()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)
