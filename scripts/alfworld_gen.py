"""ALFWorld games from the 120 real AI2-THOR scenes shipped inside the alfworld wheel.

The official ALFWorld games (`json_2.1.1`, 3,553 train / 140 valid_seen / 134 valid_unseen) are
fetched by `alfworld-download` from the internet. Where that is impossible (CI, this project's CPU
default), this module builds games of the same six task types from the scene data the wheel ships
(`alfworld/gen/layouts/FloorPlan*-{objects,openable}.json`: object types and receptacle ids with
poses), the `canContain` table (`alfworld.gen.constants.VAL_RECEPTACLE_OBJECTS`), the action-object
lists (`VAL_ACTION_OBJECTS`) and the PDDL goals and task texts of `alfworld.gen.goal_library`.
Games are written in the official layout, so alfworld's own tools load them unchanged:

    <root>/json_2.1.1/<split>/<task_type>-<Obj>-None-<Recep>-<scene>/trial_<id>/game.tw-pddl
                                                                      /traj_data.json
                                                                      /walkthrough.json   [ours]

`game.tw-pddl` holds the PDDL domain, the grammar with the task text filled in, the PDDL problem,
`solvable` and the `walkthrough`; `walkthrough.json` stores the walkthrough's per-step
(observation, admissible commands) trace so that warm-start data never needs the engine again.

Every walkthrough comes from a scripted expert that plays like a person who can read the screen:
it knows the task, not where things are; it visits receptacles in the order the room lists them,
opens what is closed, takes the first object of the right type it sees, and remembers where it saw
a lamp. Each walkthrough is checked by playing it in the real engine (textworld's PDDL backend):
a game is kept only if the expert wins. No planner runs (Fast Downward takes minutes on some
pick-two games).

Choices and deviations, all **[ours]**:
1. Object instances and their positions are sampled (the wheel ships object *types* per scene,
   not the official object placements); ids are ALFRED-mangled like the official ones.
2. Two room sizes: `full` keeps every receptacle of the scene (25-40 in kitchens, like ALFWorld);
   `small` keeps 5-8 receptacles (the ones the task needs plus random others) and 1-3 distractor
   objects, so that the tiny CPU model can learn in minutes. The shipped default set is `small`.
3. Splits: `train` and `valid_seen` use the wheel's training scenes (different seeds),
   `valid_unseen` uses its test scenes, which `train` never uses.
4. `look_at_obj_in_light` uses a DeskLamp placed on a desk, side table, dresser or shelf.
5. The PDDL domain is the wheel's `alfred.pddl` with comments removed (same actions), the grammar
   is the wheel's `alfred.twl2` re-dumped without indentation (same rules), and the problem
   declares only the types it uses, to keep each game small.
**Numbers on these games are not comparable to published ALFWorld numbers.**

Run:  python scripts/alfworld_gen.py --out data/alfworld --room small --train 120 --valid_seen 36 \
          --valid_unseen 60 --seed 0
Verify the whole set (every walkthrough replayed in the engine):
      python scripts/alfworld_gen.py --out data/alfworld --verify
Warm-start data of the tiny preset [ours] (walkthroughs only, no game files, other seed; every one
was won by the expert in the engine while it was generated; train scenes only):
      python scripts/alfworld_gen.py --out data/alfworld_sft --walkthroughs_only --train 480 --valid_seen 0 \
          --valid_unseen 0 --seed 1
Test: pytest tests/test_alfworld_gen.py
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TASK_TYPES = [
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
]
ROOM_SIZES = {"small": (5, 8), "medium": (12, 16), "full": (None, None)}
LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "Shelf")
# Objects that may be placed but are never task targets (large or fixed things).
NOT_TARGETS = {"DeskLamp", "FloorLamp", "Television", "Chair", "Painting", "Mirror", "Window",
               "Blinds", "Curtains", "LightSwitch", "StoveKnob", "ShowerDoor", "ShowerGlass",
               "HousePlant", "Footstool", "LaundryHamperLid", "Poster", "Sink", "Bathtub", "Faucet"}


def _alfworld_paths():
    import alfworld
    root = Path(alfworld.__file__).parent
    return root / "data" / "alfred.pddl", root / "data" / "alfred.twl2", root / "gen" / "layouts"


def mangle(name: str) -> str:
    """ALFRED id -> PDDL symbol: 'Apple|-01.50|+00.90' -> 'Apple_bar__minus_01_dot_50_bar__plus_00_dot_90'."""
    return (name.replace("|", "_bar_").replace("+", "_plus_").replace("-", "_minus_")
            .replace(".", "_dot_").replace(",", "_comma_"))


def _compact_grammar(grammar: str) -> str:
    """Re-dump the JSON inside the grammar's triple quotes without indentation (same content)."""
    head, body, tail = grammar.split('"""', 2)
    return head + '"""' + json.dumps(json.loads(body), separators=(",", ":")) + '"""' + tail


def _strip_comments(pddl: str) -> str:
    lines = [ln.split(";", 1)[0].rstrip() for ln in pddl.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip()) + "\n"


@dataclass
class Scene:
    num: int
    objects: list[str]                 # object types present in the real scene
    receptacles: dict[str, list[float]]  # receptacle id -> pose [x, z, rotation, horizon]

    @property
    def rtypes(self) -> set[str]:
        return {rtype(r) for r in self.receptacles}


def rtype(rec_id: str) -> str:
    return "SinkBasin" if rec_id.endswith("|SinkBasin") else rec_id.split("|")[0]


def load_scene(num: int) -> Scene:
    _, _, layouts = _alfworld_paths()
    objects = json.loads((layouts / f"FloorPlan{num}-objects.json").read_text())
    recs = json.loads((layouts / f"FloorPlan{num}-openable.json").read_text())
    # BathtubBasin ids end with '|BathtubBasin' like SinkBasin; keep them only if canContain knows them.
    return Scene(num, sorted(objects), dict(sorted(recs.items())))


def _loc(pose: list[float]) -> str:
    x, z, rot, hor = pose
    return mangle(f"loc|{int(round(x / 0.25))}|{int(round(z / 0.25))}|{int(rot) // 90 % 4}|{int(hor)}")


@dataclass
class GameSpec:
    """Everything needed to write one game; `placement` maps object id -> receptacle id."""
    task_type: str
    scene: int
    obj: str
    recep: str
    toggle: str
    receptacles: dict[str, list[float]]
    placement: dict[str, str]
    agent_pose: list[float]
    task_text: str
    seed: int
    room: str
    extra: dict = field(default_factory=dict)


def _can_contain():
    from alfworld.gen import constants as C
    return {r: set(objs) for r, objs in C.VAL_RECEPTACLE_OBJECTS.items()}


def _action_objects():
    from alfworld.gen import constants as C
    A = C.VAL_ACTION_OBJECTS
    return {"clean": A["Cleanable"], "heat": A["Heatable"], "cool": A["Coolable"]}


def _task_needs(scene: Scene, task_type: str, recs: dict[str, list[float]], rtypes: set[str],
                placeable: set[str]) -> tuple[str | None, set[str], str] | None:
    """What `task_type` needs of the scene: (the tool's receptacle type or None, the object types that may be
    the task's object, the toggle object or ""), or None if the scene cannot host the task (no receptacle of
    the tool's type; for look_at_obj_in_light, no DeskLamp or no receptacle that can hold one)."""
    acts = _action_objects()
    need = {"pick_clean_then_place_in_recep": ("SinkBasin", acts["clean"]),
            "pick_heat_then_place_in_recep": ("Microwave", acts["heat"]),
            "pick_cool_then_place_in_recep": ("Fridge", acts["cool"])}
    tool_type, targets = None, placeable
    if task_type in need:
        tool_type, allowed = need[task_type]
        if tool_type not in rtypes:
            return None
        targets = placeable & allowed
    toggle = ""
    if task_type == "look_at_obj_in_light":
        hosts = [r for r in recs if rtype(r) in LAMP_HOSTS]
        if "DeskLamp" not in scene.objects or not hosts:
            return None
        toggle = "DeskLamp"
    return tool_type, targets, toggle


def _required_receptacles(recs: dict[str, list[float]], dest: str, tool_type: str | None, toggle: str,
                          sources: list[str], n_obj: int, rng: random.Random) -> tuple[set[str], list[str]]:
    """The receptacles the game cannot do without, and the object's start receptacles: one receptacle of the
    destination type, one of the tool's type, one lamp host, and `n_obj` start receptacles drawn from
    `sources`. Returns (must, obj_srcs)."""
    must = set()
    if dest:
        must.add(rng.choice(sorted(r for r in recs if rtype(r) == dest)))
    if tool_type:
        must.add(rng.choice(sorted(r for r in recs if rtype(r) == tool_type)))
    if toggle:
        must.add(rng.choice(sorted(r for r in recs if rtype(r) in LAMP_HOSTS and r not in must)
                            or sorted(r for r in recs if rtype(r) in LAMP_HOSTS)))
    obj_srcs = [rng.choice(sources) for _ in range(n_obj)]
    must.update(obj_srcs)
    return must, obj_srcs


def _room_receptacles(recs: dict[str, list[float]], must: set[str], room: str,
                      rng: random.Random) -> dict[str, list[float]]:
    """The receptacles the room keeps, id -> pose: every one in a `full` room; else the required ones (`must`)
    and random others, up to a size drawn from the room size's range (ROOM_SIZES)."""
    lo, hi = ROOM_SIZES[room]
    if lo is None:
        keep = set(recs)
    else:
        size = max(len(must), rng.randint(lo, hi))
        others = sorted(set(recs) - must)
        rng.shuffle(others)
        keep = must | set(others[: max(0, size - len(must))])
    return {r: recs[r] for r in sorted(keep)}


def _new_object_id(otype: str, used: set[str], rng: random.Random) -> str:
    """An ALFRED-style id for a new object of `otype` at a random position, one not in `used` (then added)."""
    while True:
        x, y, z = (rng.uniform(-3, 3) for _ in range(3))
        oid = f"{otype}|{x:+06.2f}|{abs(y):+06.2f}|{z:+06.2f}"
        if oid not in used:
            used.add(oid)
            return oid


def _place_objects(obj: str, obj_srcs: list[str], must: set[str], kept: dict[str, list[float]],
                   placeable: set[str], toggle: str, room: str, can: dict[str, set[str]],
                   rng: random.Random) -> dict[str, str]:
    """Object id -> receptacle id: the task's objects in their start receptacles, the lamp (if any) on its
    host, and distractors in the kept receptacles: 1-3 in a sized room, half to all of the receptacles' count
    in a `full` one."""
    lo, _ = ROOM_SIZES[room]
    placement: dict[str, str] = {}
    used: set[str] = set()
    for src in obj_srcs:
        placement[_new_object_id(obj, used, rng)] = src
    if toggle:
        lamp_host = next(r for r in sorted(must) if rtype(r) in LAMP_HOSTS)
        placement[_new_object_id("DeskLamp", used, rng)] = lamp_host
    # Distractors: other placeable types (never the target type) in receptacles that can hold them.
    others_t = sorted(placeable - {obj})
    n_dis = rng.randint(1, 3) if lo is not None else rng.randint(len(kept) // 2, len(kept))
    for _ in range(n_dis):
        if not others_t:
            break
        o = rng.choice(others_t)
        hosts = [r for r in kept if o in can[rtype(r)]]
        if hosts:
            host = rng.choice(hosts)
            placement[_new_object_id(o, used, rng)] = host
    return placement


def sample_game(scene: Scene, task_type: str, rng: random.Random, room: str, seed: int) -> GameSpec | None:
    """Sample one game of `task_type` in `scene`, or None if the scene cannot host that task."""
    from alfworld.gen import goal_library
    can = _can_contain()
    recs = {r: p for r, p in scene.receptacles.items() if rtype(r) in can}
    rtypes = {rtype(r) for r in recs}
    placeable = {o for o in scene.objects if any(o in can[t] for t in rtypes)} - NOT_TARGETS
    needs = _task_needs(scene, task_type, recs, rtypes, placeable)
    if needs is None:
        return None
    tool_type, targets, toggle = needs
    targets = sorted(targets)
    rng.shuffle(targets)
    for obj in targets:
        # Target receptacle types that can hold obj (not the tool itself).
        dests = sorted({t for t in rtypes if obj in can[t] and t != tool_type})
        if task_type == "look_at_obj_in_light":
            dests = [""]
        if not dests:
            continue
        dest = rng.choice(dests)
        # Receptacles where obj may start: can hold it, not of the destination type, not the tool.
        sources = [r for r in recs if obj in can[rtype(r)] and rtype(r) not in (dest, tool_type)]
        if not sources:
            continue
        n_obj = 2 if task_type == "pick_two_obj_and_place" else rng.choice([1, 1, 2])
        must, obj_srcs = _required_receptacles(recs, dest, tool_type, toggle, sources, n_obj, rng)
        kept = _room_receptacles(recs, must, room, rng)
        placement = _place_objects(obj, obj_srcs, must, kept, placeable, toggle, room, can, rng)
        tmpl = goal_library.gdict[task_type]["templates"]
        text = rng.choice(tmpl).format(obj=obj.lower(), recep=dest.lower(), toggle=toggle.lower(), mrecep="")
        start = [rng.uniform(-2, 2), rng.uniform(-2, 2), 90 * rng.randint(0, 3), 30]
        return GameSpec(task_type, scene.num, obj, dest, toggle, kept, placement, start, text, seed, room)
    return None


def problem_pddl(spec: GameSpec, name: str) -> str:
    """The PDDL problem of a game, compact: only the types it uses are declared."""
    from alfworld.gen import goal_library
    can = _can_contain()
    acts = _action_objects()
    objs = {mangle(o): o.split("|")[0] for o in spec.placement}
    recs = {mangle(r): rtype(r) for r in spec.receptacles}
    locs = {mangle(r): _loc(p) for r, p in spec.receptacles.items()}
    agent_loc = _loc(spec.agent_pose)
    otypes = sorted(set(objs.values()) | {spec.obj, spec.toggle or "DeskLamp", "Knife", "ButterKnife"})
    rt = sorted(set(recs.values()) | {"SinkBasin", "Sink", "Microwave", "Fridge"}
                | ({spec.recep} if spec.recep else set()))
    lines = [f"(define (problem {name})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rt]
    lines += [f"{o} - object" for o in sorted(objs)] + [f"{r} - receptacle" for r in sorted(recs)]
    lines += [f"{loc} - location" for loc in sorted(set(locs.values()) | {agent_loc})] + [")", "(:init"]
    lines.append(f"(atLocation agent1 {agent_loc})")
    for r, t in sorted(recs.items()):
        lines.append(f"(receptacleType {r} {t}Type)")
        lines.append(f"(receptacleAtLocation {r} {locs[r]})")
        if t in ("Fridge", "Cabinet", "Microwave", "Drawer", "Safe", "Box"):
            lines.append(f"(openable {r})")
    for t in sorted(set(recs.values())):
        for ot in sorted(set(objs.values())):
            if ot in can.get(t, ()):
                lines.append(f"(canContain {t}Type {ot}Type)")
    rec_of = {mangle(o): mangle(r) for o, r in spec.placement.items()}
    for o, t in sorted(objs.items()):
        lines.append(f"(objectType {o} {t}Type)")
        lines.append(f"(inReceptacle {o} {rec_of[o]})")
        lines.append(f"(objectAtLocation {o} {locs[rec_of[o]]})")
        if t == "DeskLamp":
            lines.append(f"(toggleable {o})")
            continue
        lines.append(f"(pickupable {o})")
        for pred, key in (("cleanable", "clean"), ("heatable", "heat"), ("coolable", "cool")):
            if t in acts[key]:
                lines.append(f"({pred} {o})")
    lines.append(")")
    goal = goal_library.gdict[spec.task_type]["pddl"].replace("#", "-")
    goal = goal.format(obj=spec.obj, recep=spec.recep, toggle=spec.toggle, mrecep="")
    return "\n".join(lines) + "\n" + goal.strip() + "\n"


# ---------------------------------------------------------------------------------------------
# The engine and the scripted expert
# ---------------------------------------------------------------------------------------------

def load_engine(game: dict | str):
    """A textworld PDDL env with ALFWorld's name demangler, loaded with a game (dict or path)."""
    import textworld
    from textworld.envs.pddl import PddlEnv
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    env = AlfredDemangler(PddlEnv(infos))
    env.load(game)
    return env


class ExpertFailed(RuntimeError):
    pass


def _name(otype: str) -> str:
    return otype.lower()


class _Expert:
    """The scripted expert in one game: what it sees (obs, adm), where it is, what it holds, where it saw the
    lamp, the (actions, trace) played so far, and its moves. The receptacles are explored in the order the
    engine lists them."""

    def __init__(self, env, spec_obj: str, toggle: str, max_steps: int):
        state = env.reset()
        self.env, self.toggle, self.max_steps = env, toggle, max_steps
        self.obs, self.adm = state.feedback, sorted(state.admissible_commands)
        self.actions, self.trace = [], []
        self.won = False
        self.at = None
        self.holding = None
        self.done_objs: set[str] = set()
        self.lamp_at = None
        recs = [c[len("go to "):] for c in self.adm if c.startswith("go to ")]
        self.order = [r for r in recs]  # listed order (sorted by the engine) is the exploration order
        self.obj = _name(spec_obj)
        self.pat = re.compile(rf"^take ({re.escape(self.obj)} \d+) from (.+)$")

    def act(self, cmd):
        """Play one admissible command, recording what was seen before it; fail past `max_steps` actions."""
        if cmd not in self.adm:
            raise ExpertFailed(f"expert command not admissible: {cmd!r}")
        self.trace.append((self.obs, self.adm))
        self.actions.append(cmd)
        st, _, _ = self.env.step(cmd)
        self.obs, self.adm, self.won = st.feedback, sorted(st.admissible_commands), bool(st["won"])
        if cmd.startswith("go to "):
            self.at = cmd[len("go to "):]
        if len(self.actions) > self.max_steps:
            raise ExpertFailed(f"expert needs more than {self.max_steps} steps")

    def goto(self, r):
        """Go to receptacle r (unless there already) and open it if it is closed."""
        if self.at != r:
            self.act(f"go to {r}")
        if f"open {r}" in self.adm:
            self.act(f"open {r}")

    def note_lamp(self):
        """Remember the first place the lamp was seen."""
        if (self.toggle and self.lamp_at is None
                and f" {_name(self.toggle)} " in f" {self.obs} ".replace(",", " ").replace(".", " ")):
            self.lamp_at = self.at

    def find_and_take(self, skip_rec=None, first=None):
        """Visit receptacles (`first` before the listed order, never `skip_rec`) and take the first object of the
        task's type not already placed."""
        for r in ([first] if first in self.order else []) + [r for r in self.order if r != first]:
            if r == skip_rec:
                continue
            self.goto(r)
            self.note_lamp()
            for c in self.adm:
                m = self.pat.match(c)
                if m and m.group(1) not in self.done_objs and m.group(2) == r:
                    self.act(c)
                    self.holding = m.group(1)
                    return
        raise ExpertFailed(f"no {self.obj} found")

    def first_of(self, rec_type):     # a room may lack the receptacle (no sinkbasin in a small bathroom)
        """The first listed receptacle of type rec_type."""
        r = next((r for r in self.order if r.rsplit(" ", 1)[0] == _name(rec_type)), None)
        if r is None:
            raise ExpertFailed(f"no {_name(rec_type)} in this room")
        return r

    def place(self, target_type):
        """Put the held object in the first receptacle of target_type; return that receptacle."""
        dest = self.first_of(target_type)
        self.goto(dest)
        self.act(f"move {self.holding} to {dest}")
        return dest

    def use_tool(self, verb, tool_type):
        """Clean / heat / cool the held object with the first receptacle of tool_type."""
        tool = self.first_of(tool_type)
        self.goto(tool)
        self.act(f"{verb} {self.holding} with {tool}")


def _play_look_at_obj_in_light(ex: _Expert, first: str | None):
    """Take the object, look for the lamp unless it was seen on the way, go to it and use it."""
    ex.find_and_take(first=first)
    if ex.lamp_at is None:
        for r in ex.order:
            ex.goto(r)
            ex.note_lamp()
            if ex.lamp_at:
                break
    ex.goto(ex.lamp_at)
    lamp = next((c for c in ex.adm if c.startswith(f"use {_name(ex.toggle)}")), None)
    if lamp is None:
        raise ExpertFailed("lamp not usable")
    ex.act(lamp)


def _play_pick_and_place(ex: _Expert, recep: str, task_type: str, first: str | None):
    """Take the object, clean / heat / cool it if the task type asks, and put it in the first `recep`; for
    pick_two_obj_and_place, then take a second one (not from there) and put it there too."""
    ex.find_and_take(first=first)
    tool = {"pick_clean_then_place_in_recep": ("clean", "SinkBasin"),
            "pick_heat_then_place_in_recep": ("heat", "Microwave"),
            "pick_cool_then_place_in_recep": ("cool", "Fridge")}.get(task_type)
    if tool:
        ex.use_tool(*tool)
    dest = ex.place(recep)
    if task_type == "pick_two_obj_and_place":
        ex.done_objs.add(ex.holding)
        ex.holding = None
        ex.find_and_take(skip_rec=dest)
        ex.place(recep)


def play_expert(env, spec_obj: str, recep: str, task_type: str, toggle: str = "", max_steps: int = 80,
                first: str | None = None):
    """Play one game like a person: explore receptacles in listed order; return (actions, trace).

    trace[k] = (observation, admissible commands) seen *before* action k; the last entry is the
    final observation with an empty command list. Raises ExpertFailed if it does not win within
    `max_steps` actions. `first` [ours]: the informed expert, told where the object is (the
    receptacle the uninformed expert took it from), looks there before the listed order.
    """
    ex = _Expert(env, spec_obj, toggle, max_steps)
    if task_type == "look_at_obj_in_light":
        _play_look_at_obj_in_light(ex, first)
    else:
        _play_pick_and_place(ex, recep, task_type, first)
    ex.trace.append((ex.obs, []))
    if not ex.won:
        raise ExpertFailed("expert finished its plan without winning")
    return ex.actions, ex.trace


# ---------------------------------------------------------------------------------------------
# Writing games
# ---------------------------------------------------------------------------------------------

_DOMAIN_GRAMMAR: tuple[str, str] | None = None


def _domain_and_grammar() -> tuple[str, str]:
    global _DOMAIN_GRAMMAR
    if _DOMAIN_GRAMMAR is None:
        dom, gram, _ = _alfworld_paths()
        _DOMAIN_GRAMMAR = (_strip_comments(dom.read_text()), _compact_grammar(gram.read_text()))
    return _DOMAIN_GRAMMAR


def build_game(spec: GameSpec, trial: str) -> dict:
    domain, grammar = _domain_and_grammar()
    return {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", spec.task_text),
            "pddl_problem": problem_pddl(spec, f"plan_{trial}"), "solvable": True}


def _steps(actions, trace) -> list[dict]:
    return [{"obs": o, "admissible": a, "action": actions[i] if i < len(actions) else None}
            for i, (o, a) in enumerate(trace)]


def write_game(split_dir: Path, spec: GameSpec, trial: str, game: dict, actions, trace,
               with_game: bool = True, informed=None) -> Path:
    folder = split_dir / f"{spec.task_type}-{spec.obj}-None-{spec.recep or spec.toggle}-{spec.scene}" / trial
    folder.mkdir(parents=True, exist_ok=True)
    game = dict(game, walkthrough=actions)
    if with_game:   # walkthrough-only folders (warm-start data) leave the 25 KB game file out
        (folder / "game.tw-pddl").write_text(json.dumps(game))
    traj = {
        "task_type": spec.task_type,
        "task_id": trial,
        "scene": {"floor_plan": f"FloorPlan{spec.scene}", "scene_num": spec.scene},
        "pddl_params": {"object_target": spec.obj, "parent_target": spec.recep, "toggle_target": spec.toggle,
                        "mrecep_target": "", "object_sliced": False},
        "turk_annotations": {"anns": [{"task_desc": spec.task_text, "votes": []}]},
        "generator": {"name": "rsipo alfworld_gen.py", "seed": spec.seed, "room": spec.room,
                      "n_receptacles": len(spec.receptacles)},
    }
    (folder / "traj_data.json").write_text(json.dumps(traj, indent=1))
    wt = {"task": spec.task_text, "steps": _steps(actions, trace)}
    if informed is not None:   # [ours] the informed expert's (actions, trace): skill-conditioned warm-start data
        wt["informed"] = _steps(*informed)
    (folder / "walkthrough.json").write_text(json.dumps(wt))
    return folder / "game.tw-pddl"


def scenes_for(split: str) -> list[int]:
    from alfworld.gen import constants as C
    return sorted(C.TEST_SCENE_NUMBERS if split == "valid_unseen" else C.TRAIN_SCENE_NUMBERS)


def long_types(spec: str) -> tuple[str, ...]:
    """'all' or a comma list of short (heat) or long (pick_heat_then_place_in_recep) task type names → long names."""
    short = dict(zip(("pick", "look", "clean", "heat", "cool", "pick2"), TASK_TYPES))
    return tuple(TASK_TYPES) if spec == "all" else tuple(short.get(t, t) for t in spec.split(","))


def generate_split(out: Path, split: str, n: int, room: str, seed: int, verbose: bool = True,
                   with_game: bool = True, max_steps: int = 80, informed: bool = False,
                   types: tuple[str, ...] = tuple(TASK_TYPES)) -> list[Path]:
    """Generate n engine-verified games for `split`, cycling through `types` (default the six task types;
    with_game=False: only traj_data.json and walkthrough.json, the warm-start data of the tiny preset).
    A game is kept only if the expert wins it within `max_steps` actions. informed=True [ours] also plays
    the informed expert (told where the object is) and stores its trace in walkthrough.json."""
    if room not in ROOM_SIZES:
        raise ValueError(f"--room must be one of {sorted(ROOM_SIZES)}, got {room!r}")
    bad = [t for t in types if t not in TASK_TYPES]
    if bad or not types:
        raise ValueError(f"--types must name some of {', '.join(TASK_TYPES)}, got {','.join(types) or 'none'}")
    split_seed = {"train": 0, "valid_seen": 1, "valid_unseen": 2}[split]
    rng = random.Random(seed * 1000 + split_seed)
    split_dir = out / "json_2.1.1" / split
    scenes = {s: load_scene(s) for s in scenes_for(split)}
    paths, tries, t0 = [], 0, time.time()
    try:
        from tqdm import tqdm
        bar = tqdm(total=n, desc=f"{split} ({room})", disable=not verbose)
    except ImportError:  # pragma: no cover
        bar = None
    i = 0
    while len(paths) < n:
        tries += 1
        if tries > 20 * n + 100:
            raise RuntimeError(f"could not generate {n} games for {split} ({len(paths)} made)")
        task_type = types[i % len(types)]
        game_seed = rng.randrange(2**31)
        g_rng = random.Random(game_seed)
        scene = scenes[g_rng.choice(sorted(scenes))]
        spec = sample_game(scene, task_type, g_rng, room, game_seed)
        if spec is None:
            continue
        trial = f"trial_{room}_{split_seed}_{len(paths):05d}_{game_seed:010d}"
        game = build_game(spec, trial)
        try:
            env = load_engine(game)
            actions, trace = play_expert(env, spec.obj, spec.recep, spec.task_type, spec.toggle, max_steps)
            told = None
            if informed:
                place = next(a.split(" from ", 1)[1] for a in actions if a.startswith("take "))
                told = play_expert(env, spec.obj, spec.recep, spec.task_type, spec.toggle, max_steps, first=place)
        except ExpertFailed as e:
            if verbose:
                print(f"  skipped {task_type} in FloorPlan{scene.num}: {e}", file=sys.stderr)
            continue
        paths.append(write_game(split_dir, spec, trial, game, actions, trace, with_game, told))
        i += 1
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    if verbose:
        print(f"{split}: {n} games in {time.time() - t0:.1f}s ({tries} samples)")
    return paths


def verify(root: str | Path, verbose: bool = True) -> dict:
    """Replay every stored walkthrough under <root>/json_2.1.1 in the engine; count games that win."""
    files = sorted(Path(root).glob("json_2.1.1/*/*/*/game.tw-pddl"))
    if not files:
        raise FileNotFoundError(f"no games under {Path(root) / 'json_2.1.1'}")
    won, failed = 0, []
    for f in files:
        game = json.loads(f.read_text())
        env = load_engine(str(f))
        env.reset()
        ok = False
        for a in game["walkthrough"]:
            st, _, _ = env.step(a)
            ok = bool(st["won"])
        won += ok
        if not ok:
            failed.append(str(f))
    if verbose:
        print(f"{won}/{len(files)} walkthroughs win in the engine")
        for f in failed:
            print("  FAILED", f)
    return {"games": len(files), "won": won, "failed": failed}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/alfworld", help="root folder; games go to <out>/json_2.1.1/<split>/")
    p.add_argument("--room", default="small", choices=sorted(ROOM_SIZES), help="room size [ours]")
    p.add_argument("--train", type=int, default=120)
    p.add_argument("--valid_seen", type=int, default=36)
    p.add_argument("--valid_unseen", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action="store_true", help="replay every stored walkthrough under --out and exit")
    p.add_argument("--walkthroughs_only", action="store_true",
                   help="[ours] write only traj_data.json + walkthrough.json (no game file): warm-start data")
    p.add_argument("--max_steps", type=int, default=80,
                   help="keep a game only if the expert wins it within this many actions (set it to the "
                        "episode cap the games are played with)")
    p.add_argument("--informed", action="store_true",
                   help="[ours] also store the informed expert's trace (it is told where the object is): the "
                        "tiny warm start pairs it with the skill that names that place")
    p.add_argument("--types", default="all",
                   help="comma list of the task types to generate in turn, short (pick,look,clean,heat,cool,pick2) "
                        "or long names (default: all six)")
    a = p.parse_args(argv)
    if a.verify:
        sys.exit(0 if not verify(a.out)["failed"] else 1)
    if a.max_steps < 1:
        p.error("--max_steps must be >= 1")
    for split in ("train", "valid_seen", "valid_unseen"):
        n = getattr(a, split)
        if n < 0:
            p.error(f"--{split} must be >= 0")
        if n:
            try:
                generate_split(Path(a.out), split, n, a.room, a.seed, with_game=not a.walkthroughs_only,
                               max_steps=a.max_steps, informed=a.informed, types=long_types(a.types))
            except ValueError as e:
                p.error(str(e))


if __name__ == "__main__":
    main()
