"""Warm sandboxes for one-shot executions, and background teardown of used ones.

A pooled sandbox is started and hardened exactly like a cold one, optionally imports a few modules while it
waits, is handed to exactly one execution, and is then destroyed. Pools are made lazily, one per distinct
container shape, and everything they hold is removed at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.errors import NbexecError
from nbexec.files.workdir import remove_stale_workdirs

from . import daemon, kernels, runtimes
from .container import Sandbox

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pools: dict[tuple[Any, ...], Pool] = {}
_executors: dict[str, ThreadPoolExecutor] = {}
_pending: set[Future[None]] = set()
_refills: set[threading.Timer] = set()  # refills waiting for their delay (see `_refill_later`)
_swept = False
REFILL_DELAY = 1.0  # seconds from a call's end to its pool's refill (see `_refill_later`)


def start_sandbox(config: SandboxConfig, *, role: str, warm_up: bool, claim: str = "") -> Sandbox:
    """Start a sandbox, warming it when asked; never leaves a container behind on failure."""
    sweep_orphans()
    runtimes.require(config)  # an unregistered runtime fails here with how to register it, before any container
    kernels.require(config)  # so does an image without the language's kernel
    sandbox = Sandbox.start(config, role=role, claim=claim)
    if warm_up:
        try:
            sandbox.warm()
        except BaseException:
            sandbox.destroy()
            raise
    return sandbox


def _workers(kind: str) -> ThreadPoolExecutor:
    """The background threads that start ("start") or destroy ("teardown") sandboxes."""
    with _lock:
        executor = _executors.get(kind)
        if executor is None:
            if not _executors:
                atexit.register(shutdown)
            executor = _executors[kind] = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"nbexec-{kind}")
        return executor


def dispose(sandbox: Sandbox) -> None:
    """Destroy a used sandbox in the background; the caller does not wait."""
    executor = _workers("teardown")
    try:
        with _lock:
            future = executor.submit(sandbox.destroy)
            _pending.add(future)
    except RuntimeError:  # the interpreter is shutting down: no more background threads
        sandbox.destroy()
        return
    future.add_done_callback(_pending.discard)


def wait_for_teardown() -> None:
    """Block until every background teardown has finished, and every delayed refill has begun."""
    for timer in list(_refills):
        timer.join()
    for future in list(_pending):
        with contextlib.suppress(Exception):
            future.result()


def sweep_orphans() -> None:
    """Once per process: remove containers and folders left by nbexec processes that died."""
    global _swept
    if _swept:
        return
    _swept = True
    with contextlib.suppress(NbexecError, OSError):
        removed = daemon.cleanup(daemon.connect())
        removed_dirs = remove_stale_workdirs()
        if removed or removed_dirs:
            log.info("removed %d orphaned containers and %d folders", len(removed), len(removed_dirs))


class Pool:
    """Ready sandboxes of one shape. ``acquire`` hands one out for a single execution."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.size = config.pool_size
        self._ready: deque[Sandbox] = deque()
        self._starting = 0
        self._waiting = 0
        self._closed = False
        self._failure: BaseException | None = None
        self._cond = threading.Condition()
        self.filled = False  # reached its size at least once (readiness of a service)

    def acquire(self) -> Sandbox:
        """Take a ready sandbox, waiting for one being started if none is ready."""
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    self._fill_locked(self._waiting)
                    while not self._ready:
                        if self._failure is not None:
                            failure, self._failure = self._failure, None
                            raise failure
                        if self._closed:
                            raise NbexecError("the sandbox pool is closed")
                        self._cond.wait()
                    sandbox = self._ready.popleft()
                    if sandbox.seems_alive():
                        return sandbox
                    # Killed from outside while it waited, or the engine restarted: never hand it out.
                    log.warning("a pooled sandbox died while waiting; using another")
                    dispose(sandbox)
            finally:
                self._waiting -= 1

    def idle(self) -> bool:
        """No sandbox is ready or being started."""
        with self._cond:
            return not self._ready and not self._starting and not self._closed

    def replenish(self) -> None:
        """Start replacements for handed-out sandboxes (called once an execution is done, so the start-up
        does not compete with it for CPU)."""
        with self._cond:
            self._fill_locked(max(self.size, self._waiting))

    @property
    def ready(self) -> int:
        return len(self._ready)

    def _fill_locked(self, want: int) -> None:
        while not self._closed and len(self._ready) + self._starting < want:
            self._starting += 1
            try:
                _workers("start").submit(self._start_one)
            except RuntimeError:  # the interpreter is shutting down
                self._starting -= 1
                return

    def _start_one(self) -> None:
        try:
            sandbox = start_sandbox(self.config, role="pool", warm_up=True)
        except BaseException as exc:  # reported to a waiting caller
            with self._cond:
                self._starting -= 1
                if self._waiting:
                    self._failure = exc
                else:
                    log.warning("could not start a pooled sandbox: %s", exc)
                self._cond.notify_all()
            return
        with self._cond:
            self._starting -= 1
            if self._closed:
                dispose(sandbox)
            else:
                self._ready.append(sandbox)
                self.filled = self.filled or len(self._ready) >= self.size
            self._cond.notify_all()

    def close(self) -> None:
        """Destroy the waiting sandboxes; sandboxes still starting are destroyed when they are up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            # Wait for sandboxes being started so none outlives the process (each disposes itself).
            self._cond.wait_for(lambda: self._starting == 0, timeout=self.config.startup_timeout)
            ready, self._ready = list(self._ready), deque()
        for sandbox in ready:
            sandbox.destroy()


def _key(config: SandboxConfig) -> tuple[Any, ...]:
    """Configs with equal keys share a pool."""
    return (*config.container_key, config.pool_size, config.startup_timeout)


def _pool_for(config: SandboxConfig) -> Pool:
    key = _key(config)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = Pool(config)
    return pool


def acquire(config: SandboxConfig) -> Sandbox:
    """A sandbox for one execution: from the pool for this shape, or started now when pooling is off or the
    pool has nothing ready or starting."""
    pool = _pool_for(config) if config.pool_size else None
    if pool is None or pool.idle():
        # Nothing ready or on its way (the first call of a process): start this call's sandbox the cold way
        # (no warm imports to wait for); `release` fills the pool in the background once the result is built.
        return start_sandbox(config, role="oneshot", warm_up=False)
    return pool.acquire()


def release(sandbox: Sandbox) -> None:
    """Hand back a used sandbox: it is destroyed in the background and its pool refilled a little later."""
    dispose(sandbox)
    if sandbox.config.pool_size:
        _refill_later(_pool_for(sandbox.config))


def _refill_later(pool: Pool) -> None:
    """Refill ``pool`` after REFILL_DELAY, unless the process ends first: a script that made its one call and
    exits has nobody to use a warm sandbox, and would otherwise wait at exit for it to start and be removed."""
    def refill() -> None:
        try:
            pool.replenish()
        finally:
            _refills.discard(timer)

    timer = threading.Timer(REFILL_DELAY, refill)
    timer.daemon = True  # never keeps the process alive; a refill at exit is refused (executor shut down)
    _refills.add(timer)
    timer.start()


def shutdown() -> None:
    """Close every pool and wait for background teardown (runs at interpreter exit)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for timer in list(_refills):  # nobody will use a refilled pool now
        timer.cancel()
        _refills.discard(timer)
    for pool in pools:
        pool.close()
    wait_for_teardown()


def ready_count(config: SandboxConfig) -> int:
    """How many sandboxes wait ready in the pool for this config (0 when pooling is off or not started)."""
    key = _key(config)
    with _lock:
        found = _pools.get(key)
    return found.ready if found is not None else 0


def has_filled(config: SandboxConfig) -> bool:
    """Whether the pool for this config has been full at least once (always true when pooling is off)."""
    if not config.pool_size:
        return True
    key = _key(config)
    with _lock:
        found = _pools.get(key)
    return found is not None and found.filled


def warm_up(config: SandboxConfig) -> None:
    """Start filling the pool for this config now instead of on the first execution."""
    if config.pool_size:
        _pool_for(config).replenish()
