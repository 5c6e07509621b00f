"""asyncio integration: await engine operations without a thread per wait.

The store's ``completion_fd`` is an eventfd signalled on every completion; one
reader per (store, event loop) drains it and resolves the futures of the
handles that are done.

Several loops (one per thread) may await one store. They share its one
eventfd, and the first reader to drain it takes the wake-up: the others' fd
is no longer readable and their selectors sleep on. So the reader that
drained it wakes every other loop that awaits the store
(``call_soon_threadsafe``), and each checks its own handles. Before this, one
of two loops never completed.

A reader belongs to the store object, not to its ``id()`` or fd number: once a
store is gone both are reused (the next store's eventfd usually gets the same
number), and the loop's selector still holds the dead fd's registration, which
the kernel dropped when the fd closed. A store that finds a stale reader on
its fd number removes it and registers afresh, so the new eventfd is armed.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref

from pykvcache._core import BlockStore, IoHandle, IoResult

_dispatchers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, _Dispatcher]]" = weakref.WeakKeyDictionary()
# Every loop's reader of a store, to wake each other (read from any loop's thread).
_readers: "weakref.WeakKeyDictionary[BlockStore, weakref.WeakSet[_Dispatcher]]" = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


class _Dispatcher:
    def __init__(self, loop: asyncio.AbstractEventLoop, store: BlockStore) -> None:
        self._fd = store.completion_fd
        self._store = weakref.ref(store)
        # Weakly: _dispatchers holds this under a weak key of the loop.
        self._loop = weakref.ref(loop)
        self._pending: list[tuple[IoHandle, asyncio.Future[IoResult]]] = []
        with _readers_lock:
            _readers.setdefault(store, weakref.WeakSet()).add(self)
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
            pass  # another loop drained it first; that loop wakes this one
        else:
            self._wake_other_loops()
        self._resolve()

    def _wake_other_loops(self) -> None:
        store = self._store()
        if store is None:
            return
        with _readers_lock:
            others = [d for d in _readers.get(store, ()) if d is not self]
        for d in others:
            # `_pending` is only changed on d's thread; reading it from here
            # misses nothing: d appends a handle before it checks done(), and
            # an operation it found unfinished signals the eventfd later, so
            # the drain that takes that signal sees the append.
            loop = d._loop()
            if d._pending and loop is not None:
                try:
                    loop.call_soon_threadsafe(d._resolve)
                except RuntimeError:  # that loop is closed: nothing waits there any more
                    pass

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
