"""The worker processes behind `envs.EnvPool`: each owns ALFWorld engines (one per live episode, reused)
and one game cache, and answers the pool's reset and step messages over a pipe. Spawned, not forked
(safe next to torch, CUDA and threads); they ignore SIGINT and SIGTERM (the trainer finishes its step
and closes the pool) and exit when their pipe closes, so a killed parent leaves none behind. Every pool
still open at exit is closed (`LIVE_POOLS`)."""
from __future__ import annotations

import atexit
import os
import signal
import time
import traceback
import weakref

from infra import env_backends
from infra.env_backends import GameCache, engine_class


def worker_main(conn, env_class: type, max_steps: int, memo_textgen: bool) -> None:
    """Worker process: owns envs of `env_class` (one per live episode, reused across episodes, so
    the worker holds as many engines as its largest batch of concurrent episodes) and one game
    cache."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a scheduler's SIGTERM are the parent's business:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it finishes its step and closes the pool (harness/run.Preemption)
    env_backends.MEMO_TEXTGEN = memo_textgen
    engine_class()  # import textworld/alfworld now, so that start-up is not billed to a reset
    import alfworld.agents.environment.alfred_tw_env  # noqa: F401
    cache = GameCache()
    free: list = []
    live: dict[int, object] = {}
    conn.send(("ready", os.getpid()))

    def error_result(e: BaseException) -> str:
        return f"{type(e).__name__}: {e}"

    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if kind == "close":
            conn.send(("closed", None))
            return
        out = []
        if kind == "reset":
            free.extend(live.values())
            live.clear()
            for slot, gamefile in payload:
                env = free.pop() if free else env_class(max_steps, cache=cache)
                try:
                    out.append((slot, env.reset(gamefile), None))
                    live[slot] = env
                except Exception as e:  # noqa: BLE001 - one bad game fails one episode
                    free.append(env)
                    out.append((slot, None, error_result(e)))
        elif kind == "step":
            for slot, action in payload:
                env = live.get(slot)
                if env is None:
                    out.append((slot, None, "no such episode in this worker"))
                    continue
                try:
                    result = env.step(action)
                    out.append((slot, result, None))
                    if result[2]:
                        free.append(live.pop(slot))
                except Exception as e:  # noqa: BLE001 - an engine error fails one episode
                    traceback.print_exc()  # the worker's stderr is the parent's
                    free.append(live.pop(slot))
                    out.append((slot, None, error_result(e)))
        conn.send(("ok", out))


class Worker:
    """One worker process and the parent's end of its pipe (`ready` once it has said so)."""

    def __init__(self, ctx, env_class: type, max_steps: int):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker_main,
                                args=(child, env_class, max_steps, env_backends.MEMO_TEXTGEN),
                                daemon=True, name="rsipo-env-worker")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)


LIVE_POOLS: "weakref.WeakSet" = weakref.WeakSet()   # the open envs.EnvPool objects


@atexit.register
def _close_live_pools() -> None:
    for pool in list(LIVE_POOLS):
        pool.close()


def wait_ready(workers: list[Worker], start_timeout: float) -> None:
    """Wait for each new worker's "ready" (all within `start_timeout` s); a worker that died or is late raises."""
    deadline = time.monotonic() + start_timeout
    for w in workers:
        left = deadline - time.monotonic()
        if not w.conn.poll(max(left, 0)):
            raise RuntimeError(f"env worker {w.proc.pid} did not start within {start_timeout}s")
        try:
            kind, _ = w.conn.recv()
        except (EOFError, OSError):
            kind = "died"
        if kind != "ready":
            raise RuntimeError(f"env worker {w.proc.pid} died while starting (exit code "
                               f"{w.proc.exitcode}, its traceback is on stderr). Workers are "
                               f"spawned: the main script needs an `if __name__ == '__main__':` "
                               f"guard")
        w.ready = True

