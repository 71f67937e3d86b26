"""A daemon in the test's own process, on an event loop of its own thread: for tests that hand it
parts they built here (a store of a scheme registered by the test, monitors of a provider it added)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import AbstractAsyncContextManager
from typing import Self

from spotguard.config import DaemonConfig
from spotguard.daemon.app import Daemon
from spotguard.harness import daemon_answers, wait_for


class DaemonThread:
    """``running()`` (a subclass's) makes the daemon on the thread's loop and holds what it uses
    until it stops; ``with`` starts it, waits ``wait`` seconds at most for it to answer, and stops it
    at the end.

    >>> class MyDaemon(DaemonThread):
    ...     @asynccontextmanager
    ...     async def running(self):
    ...         yield Daemon(self.config, provider="none", storage=my_store)
    >>> with MyDaemon(config, wait=30):
    ...     request(config.socket, "status")
    """

    def __init__(self, config: DaemonConfig, *, wait: float) -> None:
        self.config = config
        self.wait = wait
        self.daemon: Daemon | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),))

    def running(self) -> AbstractAsyncContextManager[Daemon]:
        raise NotImplementedError

    async def _main(self) -> None:
        async with self.running() as daemon:
            self.daemon = daemon
            await daemon.serve_until_stopped()

    def __enter__(self) -> Self:
        self.thread.start()
        wait_for(self._answers, self.wait, "the daemon to answer")
        return self

    def _answers(self) -> bool:
        if not self.thread.is_alive():
            raise RuntimeError("the daemon's thread ended before it answered; see the log above")
        return daemon_answers(self.config.socket)

    def __exit__(self, *_exc: object) -> None:
        if self.daemon is not None:
            self.loop.call_soon_threadsafe(self.daemon.request_stop)
        self.thread.join(60)
        self.loop.close()
