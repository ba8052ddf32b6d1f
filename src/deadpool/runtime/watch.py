"""Watches the store for the abort of this process's generation, so that no wait outlives it."""

from __future__ import annotations

import threading

from deadpool.runtime.context import Context, connect


class AbortWatcher:
    """A thread that polls `abort/{gen}` every poll interval; `aborted()` is then a free check
    for the training thread, the snapshot engine and any collective being waited on."""

    def __init__(self, ctx: Context, gen: int) -> None:
        self.ctx = ctx
        self.gen = gen
        self._event = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deadpool-abort-watch", daemon=True)
        self._thread.start()

    def watch(self, gen: int) -> None:
        """Follows a new generation (the old one's abort no longer applies)."""
        self.gen = gen
        self._event.clear()

    def aborted(self) -> bool:
        return self._event.is_set()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        store = connect(self.ctx.config)  # its own client: never queued behind another thread's call
        while not self._closed.wait(self.ctx.config.poll_interval_s):
            gen = self.gen
            if store.check([self.ctx.keys.abort(gen)]) and gen == self.gen:
                self._event.set()
