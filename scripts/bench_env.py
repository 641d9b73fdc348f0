"""Benchmark of the ALFWorld environment (envs.py, infra/env_backends.py): load + reset time, and env
steps per second for one in-process AlfWorldEnv and for an EnvPool of worker processes, playing
random admissible actions (fixed seed) on the shipped games until each episode ends (win or
max_steps).

Run:  python scripts/bench_env.py [--data data/alfworld] [--split train] [--games 12] [--batch 16]
                                  [--workers 2] [--max_steps 50] [--seed 0]
Numbers depend on the room size: data/alfworld holds small rooms (5-8 receptacles),
data/alfworld_full full-size ones.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from infra import env_backends  # noqa: E402
import envs  # noqa: E402


def bench_single(games, max_steps, seed):
    """Cold load+reset, warm reset and steps/s of one AlfWorldEnv (its own, empty game cache)."""
    rng = random.Random(seed)
    env_backends.engine_class()  # imports textworld, so that the next line times the library copy only
    t = time.perf_counter()
    env = envs.AlfWorldEnv(max_steps=max_steps, cache=env_backends.GameCache())
    env._engine = env_backends._make_engine()  # count the library copy separately from the first load
    engine_s = time.perf_counter() - t
    cold, warm, steps, step_s = [], [], 0, 0.0
    for g in games:
        t = time.perf_counter()
        env.reset(g)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, info = env.reset(g)
        warm.append(time.perf_counter() - t)
        done = False
        t = time.perf_counter()
        while not done:
            _, _, done, info = env.step(rng.choice(info["admissible"]))
            steps += 1
        step_s += time.perf_counter() - t
    return {"engine_s": engine_s, "cold": sum(cold) / len(cold), "warm": sum(warm) / len(warm),
            "steps": steps, "steps_per_s": steps / step_s}


def bench_pool(games, batch, workers, max_steps, seed):
    """Steps/s of EnvPool(workers) on `batch` episodes in lock-step (a cold and a warm reset)."""
    rngs = [random.Random(seed * 1000 + i) for i in range(batch)]
    batch_games = [games[i % len(games)] for i in range(batch)]
    t = time.perf_counter()
    with envs.EnvPool(num_workers=workers, max_steps=max_steps) as pool:
        start_s = time.perf_counter() - t
        t = time.perf_counter()
        pool.reset(batch_games)
        cold_s = time.perf_counter() - t
        t = time.perf_counter()
        resets = pool.reset(batch_games)
        warm_s = time.perf_counter() - t
        infos = [info for _, info in resets]
        steps, t = 0, time.perf_counter()
        while any(pool.active):
            actions = [rngs[i].choice(infos[i]["admissible"]) if pool.active[i] else None
                       for i in range(batch)]
            for i, out in enumerate(pool.step(actions)):
                if out is not None:
                    infos[i] = out[3]
                    steps += 1
        step_s = time.perf_counter() - t
        errors = pool.stats["errors"]
    return {"start_s": start_s, "cold_reset_s": cold_s, "warm_reset_s": warm_s, "steps": steps,
            "steps_per_s": steps / step_s, "errors": errors}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/alfworld")
    p.add_argument("--split", default="train")
    p.add_argument("--games", type=int, default=12, help="games (spread over the task types)")
    p.add_argument("--batch", type=int, default=16, help="episodes per pool batch")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    all_games = env_backends.list_games(a.data, a.split)
    by_type: dict[str, list[str]] = {}
    for g in all_games:
        by_type.setdefault(env_backends.game_task_type(g), []).append(g)
    games = [by_type[t][k] for k in range(len(all_games)) for t in sorted(by_type)
             if k < len(by_type[t])][:a.games]

    s = bench_single(games, a.max_steps, a.seed)
    q = bench_pool(games, a.batch, a.workers, a.max_steps, a.seed)
    rows = [
        ("engine (Fast Downward library copy)", f"{s['engine_s'] * 1e3:.0f} ms", "once per env"),
        ("load + reset, cold (per game)", f"{s['cold'] * 1e3:.0f} ms", f"mean of {len(games)} games"),
        ("reset, cached game", f"{s['warm'] * 1e3:.0f} ms", f"mean of {len(games)} games"),
        ("AlfWorldEnv steps/s", f"{s['steps_per_s']:.1f}", f"{s['steps']} steps, 1 process"),
        (f"EnvPool({a.workers}) start", f"{q['start_s']:.2f} s", "spawn + imports"),
        (f"EnvPool({a.workers}) reset {a.batch} episodes, cold", f"{q['cold_reset_s']:.2f} s",
         "engines + loads"),
        (f"EnvPool({a.workers}) reset {a.batch} episodes, warm", f"{q['warm_reset_s']:.2f} s", "cached"),
        (f"EnvPool({a.workers}) steps/s", f"{q['steps_per_s']:.1f}",
         f"{q['steps']} steps, {a.batch} episodes lock-step, {q['errors']} errors"),
    ]
    print(f"data {a.data} split {a.split}, random admissible actions, seed {a.seed}, "
          f"max_steps {a.max_steps}")
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'value':>10}  note")
    for name, value, note in rows:
        print(f"{name:<{w}}  {value:>10}  {note}")


if __name__ == "__main__":
    main()
