"""`WorkerPool`, the plumbing of `envs.EnvPool`: episodes stepped in lock-step by worker processes. Each
worker owns ALFWorld engines (one per live episode, reused) and one game cache, and answers the pool's reset
and step messages over a pipe. Spawned, not forked (safe next to torch, CUDA and threads); they ignore SIGINT
and SIGTERM (the trainer finishes its step and closes the pool) and exit when their pipe closes, so a killed
parent leaves none behind. Every pool still open at exit is closed (`LIVE_POOLS`)."""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import time
import traceback
import weakref
from multiprocessing.connection import wait as mp_wait

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


class WorkerPool:
    """Episodes of `env_class` stepped in lock-step by `num_workers` worker processes (envs.EnvPool is the
    ALFWorld one, and documents the failure rules). `env_class(max_steps, cache=...)` runs one episode at a
    time, `reset(gamefile) -> (obs, info)`, `step(action) -> (obs, reward, done, info)`, and its
    `blank_info(gamefile)` is the info of an episode that has not started (or could not)."""

    def __init__(self, env_class: type, num_workers: int = 2, max_steps: int = 50, step_timeout: float = 30.0,
                 reset_timeout: float = 120.0, start_timeout: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers, self.max_steps = num_workers, max_steps
        self.step_timeout, self.reset_timeout, self.start_timeout = step_timeout, reset_timeout, start_timeout
        self.env_class = env_class
        self._ctx = mp.get_context("spawn")
        self.stats = {"errors": 0, "crashes": 0, "timeouts": 0, "restarts": 0}
        self._closed = False
        self._workers: list[Worker] = []
        self._infos: list[dict] = []  # last info of each episode of the batch
        self.active: list[bool] = []
        LIVE_POOLS.add(self)
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            self._wait_ready(self._workers)
        except BaseException:
            self.close()
            raise

    # -- worker management
    def _start_worker(self) -> Worker:
        return Worker(self._ctx, self.env_class, self.max_steps)

    def _wait_ready(self, workers: list[Worker]) -> None:
        wait_ready(workers, self.start_timeout)

    def _restart(self, k: int) -> None:
        self._workers[k].kill()
        self._workers[k] = self._start_worker()
        self.stats["restarts"] += 1
        self._wait_ready([self._workers[k]])

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _exchange(self, messages: dict[int, tuple], timeout: float) -> dict[int, list | str]:
        """Send one message to each listed worker, collect the replies in parallel.
        Returns worker -> list of (slot, result, error) or the failure string."""
        replies: dict[int, list | str] = {}
        pending: dict = {}
        for k, msg in messages.items():
            try:
                self._workers[k].conn.send(msg)
                pending[self._workers[k].conn] = k
            except (OSError, ValueError):  # broken pipe: the worker is gone
                replies[k] = "worker crashed"
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = mp_wait(list(pending), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                for conn, k in pending.items():
                    replies[k] = "timeout"
                break
            for conn in ready:
                k = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                    replies[k] = payload if kind == "ok" else "worker crashed"
                except (EOFError, OSError):
                    replies[k] = "worker crashed"
        for k, reply in replies.items():
            if isinstance(reply, str):
                self.stats["crashes" if reply == "worker crashed" else "timeouts"] += 1
                self._restart(k)
        return replies

    def _fail(self, i: int, error: str) -> tuple[str, float, bool, dict]:
        info = dict(self._infos[i], won=False, truncated=False, invalid_action=False, error=error,
                    admissible=[])
        self._infos[i] = info
        self.active[i] = False
        self.stats["errors"] += 1
        return "", 0.0, True, info

    # -- episodes
    def reset(self, gamefiles: list[str]) -> list[tuple[str, dict]]:
        """Start one episode per gamefile (copies of a game are independent episodes)."""
        self._check_open()
        n = len(gamefiles)
        self._infos = [self.env_class.blank_info(g) for g in gamefiles]
        self.active = [False] * n
        messages = {k: ("reset", [(i, gamefiles[i]) for i in range(k, n, self.num_workers)])
                    for k in range(self.num_workers)}
        replies = self._exchange(messages, self.reset_timeout)
        out: list = [None] * n
        for k, reply in replies.items():
            if isinstance(reply, str):
                for i in range(k, n, self.num_workers):
                    obs, _, _, info = self._fail(i, reply)
                    out[i] = (obs, info)
                continue
            for i, result, error in reply:
                if error is not None:
                    obs, _, _, info = self._fail(i, error)
                    out[i] = (obs, info)
                else:
                    obs, info = result
                    self._infos[i], self.active[i] = info, True
                    out[i] = (obs, info)
        return out

    def step(self, actions: list) -> list:
        """One action per episode (ignored for inactive ones); None for episodes that are over."""
        self._check_open()
        if len(actions) != len(self.active):
            raise ValueError(f"{type(self).__name__}.step got {len(actions)} actions for {len(self.active)} "
                             "episodes")
        messages = {}
        for k in range(self.num_workers):
            batch = [(i, actions[i]) for i in range(k, len(actions), self.num_workers) if self.active[i]]
            if batch:
                messages[k] = ("step", batch)
        replies = self._exchange(messages, self.step_timeout)
        out: list = [None] * len(actions)
        for k, reply in replies.items():
            if isinstance(reply, str):
                for i, _ in messages[k][1]:
                    self._infos[i]["steps"] += 1
                    out[i] = self._fail(i, reply)
                continue
            for i, result, error in reply:
                if error is not None:
                    self._infos[i]["steps"] += 1
                    out[i] = self._fail(i, error)
                    continue
                obs, reward, done, info = result
                self._infos[i] = info
                self.active[i] = not done
                out[i] = (obs, reward, done, info)
        return out

    # -- shutdown
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop all workers: ask, wait up to `timeout`, then terminate/kill. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(("close", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=1)
            w.kill()
        LIVE_POOLS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=1.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
