"""asyncio integration: await engine operations without a thread per wait.

The store's ``completion_fd`` is an eventfd signalled on every completion; one
reader per (store, event loop) drains it and resolves the futures of the
handles that are done.

A reader belongs to the store object, not to its ``id()`` or fd number: once a
store is gone both are reused (the next store's eventfd usually gets the same
number), and the loop's selector still holds the dead fd's registration, which
the kernel dropped when the fd closed. A store that finds a stale reader on
its fd number removes it and registers afresh, so the new eventfd is armed.
"""

from __future__ import annotations

import asyncio
import os
import weakref

from pykvcache._core import BlockStore, IoHandle, IoResult

_dispatchers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, _Dispatcher]]" = weakref.WeakKeyDictionary()


class _Dispatcher:
    def __init__(self, loop: asyncio.AbstractEventLoop, store: BlockStore) -> None:
        self._fd = store.completion_fd
        self._store = weakref.ref(store)
        self._pending: list[tuple[IoHandle, asyncio.Future[IoResult]]] = []
        # Whatever reader this loop has on the fd number is stale (its store is
        # gone): remove it, so that the selector registers the new file and not
        # merely a new callback on the dead registration.
        loop.remove_reader(self._fd)
        loop.add_reader(self._fd, self._on_readable)
        # The fd closes soon after the store object goes: drop the reader then
        # (weakly held: neither the loop nor this dispatcher is kept alive).
        weakref.finalize(store, _forget, weakref.ref(loop), self._fd, weakref.ref(self))

    def serves(self, store: BlockStore) -> bool:
        return self._store() is store

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

    def watch(self, loop: asyncio.AbstractEventLoop, handle: IoHandle) -> asyncio.Future[IoResult]:
        fut = loop.create_future()
        self._pending.append((handle, fut))
        self._resolve()  # it may already be complete: never wait for an edge that passed
        return fut


def _forget(loop_ref: "weakref.ref[asyncio.AbstractEventLoop]", fd: int, ref: "weakref.ref[_Dispatcher]") -> None:
    """Unregisters a gone store's reader on its loop's thread, unless the fd
    number already serves another store there."""
    loop = loop_ref()
    if loop is None or loop.is_closed():
        return

    def remove() -> None:
        per_loop = _dispatchers.get(loop)
        d = ref()
        if per_loop is not None and d is not None and per_loop.get(fd) is d:
            del per_loop[fd]
            loop.remove_reader(fd)

    try:
        loop.call_soon_threadsafe(remove)
    except RuntimeError:  # closed meanwhile: nothing left to unregister from
        pass


async def wait(store: BlockStore, handle: IoHandle) -> IoResult:
    """Awaits ``handle`` (an operation of ``store``) on the running loop."""
    loop = asyncio.get_running_loop()
    per_loop = _dispatchers.setdefault(loop, {})
    fd = store.completion_fd
    dispatcher = per_loop.get(fd)
    if dispatcher is None or not dispatcher.serves(store):
        dispatcher = per_loop[fd] = _Dispatcher(loop, store)
    return await dispatcher.watch(loop, handle)
