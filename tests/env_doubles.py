"""Test doubles for envs.EnvPool, injected through its `env_class` argument (the pool's workers are
spawned and import this module by name: multiprocessing's spawn hands them the parent's sys.path)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs import AlfWorldEnv  # noqa: E402

SLEEP = "__test_sleep__"  # the action "__test_sleep__ <seconds>" makes SleepyEnv hang that long


class SleepyEnv(AlfWorldEnv):
    """AlfWorldEnv whose step sleeps <seconds> on the action "__test_sleep__ <seconds>" (a hung
    engine), then plays it like any other text (the engine answers "Nothing happens.")."""

    def step(self, action):
        if isinstance(action, str) and action.startswith(SLEEP):
            time.sleep(float(action.split()[1]))
        return super().step(action)
