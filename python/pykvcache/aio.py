"""asyncio integration: await engine operations without a thread per wait.

The store's ``completion_fd`` is an eventfd signalled on every completion; one
reader per (store, event loop) drains it and resolves the futures of the
handles that are done.
"""

from __future__ import annotations

import asyncio
import os
import weakref

from pykvcache._core import BlockStore, IoHandle, IoResult

_dispatchers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, _Dispatcher]]" = weakref.WeakKeyDictionary()


class _Dispatcher:
    def __init__(self, loop: asyncio.AbstractEventLoop, store: BlockStore) -> None:
        self._loop = loop
        self._fd = store.completion_fd
        self._pending: list[tuple[IoHandle, asyncio.Future[IoResult]]] = []
        loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        self._resolve()

    def _resolve(self) -> None:
        still = []
        for handle, fut in self._pending:
            if fut.done():
                continue
            if handle.done():
                fut.set_result(handle.wait(0))
            else:
                still.append((handle, fut))
        self._pending = still

    def watch(self, handle: IoHandle) -> asyncio.Future[IoResult]:
        fut = self._loop.create_future()
        self._pending.append((handle, fut))
        self._resolve()  # it may already be complete: never wait for an edge that passed
        return fut


async def wait(store: BlockStore, handle: IoHandle) -> IoResult:
    """Awaits ``handle`` (an operation of ``store``) on the running loop."""
    loop = asyncio.get_running_loop()
    per_loop = _dispatchers.setdefault(loop, {})
    dispatcher = per_loop.get(id(store))
    if dispatcher is None:
        dispatcher = per_loop[id(store)] = _Dispatcher(loop, store)
    return await dispatcher.watch(handle)
