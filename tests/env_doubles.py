"""Test doubles. SleepyEnv for envs.EnvPool, injected through its `env_class` argument (the pool's workers are
spawned and import this module by name: multiprocessing's spawn hands them the parent's sys.path). SimPool and
SimEngine: a one-step environment whose win probability is known and a generator that writes and follows skills,
so that the trainer's own sections (write_skills, replay, trust) run where the truth is known (tests/test_sections.py,
tests/test_replay_control.py, scripts/replay_sim.py)."""
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
from envs import AlfWorldEnv  # noqa: E402
from rollout import Generation  # noqa: E402
from skills import ANALYZER_HEAD, SKILL_PREFIX  # noqa: E402

SLEEP = "__test_sleep__"  # the action "__test_sleep__ <seconds>" makes SleepyEnv hang that long


class SleepyEnv(AlfWorldEnv):
    """AlfWorldEnv whose step sleeps <seconds> on the action "__test_sleep__ <seconds>" (a hung
    engine), then plays it like any other text (the engine answers "Nothing happens.")."""

    def step(self, action):
        if isinstance(action, str) and action.startswith(SLEEP):
            time.sleep(float(action.split()[1]))
        return super().step(action)


TASK = "put a apple in fridge."   # an ALFWorld task sentence: the skill rule's terms are (apple, fridge)


class SimPool:
    """A pool of one-step episodes: task i is won with probability p_i, plus `effects[kind]` when the action
    says it followed a skill of that kind ("won" or "lost"). Same calls as envs.EnvPool."""

    task_key, task_prefix, stop_texts = "gamefile", envs.TASK_PREFIX, ("</action>",)
    build_prompt = staticmethod(envs.build_prompt)
    parse_action = staticmethod(envs.parse_action)
    task_terms = staticmethod(envs.task_terms)

    def __init__(self, p: dict[str, float], effects: dict[str, float], seed: int, r_win: float = envs.R_WIN):
        self.p, self.effects, self.r_win = p, effects, r_win
        self.rng = np.random.default_rng(seed)
        self.tasks: list[str] = []
        self.done: list[bool] = []
        self.env_steps = 0

    def win_prob(self, task: str, action: str) -> float:
        kind = action.split()[-1] if action.startswith("follow skill") else None
        return min(1.0, max(0.0, self.p[task] + self.effects.get(kind, 0.0)))

    def reset(self, tasks: list[str]):
        self.tasks, self.done = list(tasks), [False] * len(tasks)
        return [("You are in a room.", {"task_type": "pick", "task": TASK, "admissible": []}) for _ in tasks]

    def step(self, actions: list):
        out = []
        for i, (task, action) in enumerate(zip(self.tasks, actions)):
            if self.done[i]:
                out.append(None)
                continue
            won = bool(self.rng.random() < self.win_prob(task, action or ""))
            self.done[i] = True
            self.env_steps += 1
            out.append(("done", self.r_win * won, True, {"won": won, "task_type": "pick", "admissible": []}))
        return out


class SimEngine:
    """The generator of the simulation: a skill that names the task's object and target and the outcome of
    the episode it read; an action that says whether a skill was in the prompt, and which kind."""

    max_prompt_tokens = 10_000

    def prompt_len(self, prompt: str) -> int:
        return len(prompt.split())

    def encode(self, prompt: str) -> list[int]:
        return [0] * self.prompt_len(prompt)

    def generate(self, prompts, **kw) -> list[Generation]:
        return [Generation(text, [1], [0.0], [0]) for text in map(self._answer, prompts)]

    @staticmethod
    def _answer(prompt: str) -> str:
        if prompt.startswith(ANALYZER_HEAD):
            kind = "won" if "Outcome: SUCCESS" in prompt else "lost"
            return '{"skill": "take the apple to the fridge; written from a %s episode"}' % kind
        skill = re.search(re.escape(SKILL_PREFIX) + r"\[(.*)\]", prompt)
        if skill is None:
            return "<action> act </action>"
        return "<action> follow skill %s </action>" % skill.group(1).split()[-2]
