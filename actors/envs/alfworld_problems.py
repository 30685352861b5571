"""ALFWorld household problems generated offline from the layouts the `alfworld` package ships.

Owns the problem generator and the ALFWorld task splits:

- `load_layout(scene)`: one of the 120 bundled AI2-THOR floorplans: its receptacles
  with the pose the agent stands at to reach them (`FloorPlanN-openable.json`), the
  object types present in the room (`FloorPlanN-objects.json`) and its reachable
  floor points (`FloorPlanN-layout.npy`).
- `sample_problem(layout, task_type, rng)`: a PDDL problem over ALFWorld's own domain
  (`alfred.pddl`) for one of the six task types. The target object's instances and
  some distractor objects of the room's other types are placed in receptacles that
  ALFRED allows to hold them (`constants.VAL_RECEPTACLE_OBJECTS`); openable
  receptacles start closed; the agent starts in the middle of the room. The goal is
  ALFWorld's PDDL goal for the type (`goal_library.gdict`) and the task text is one of
  ALFWorld's templates for it ("put a hot apple in countertop."), written into
  ALFWorld's grammar (`alfred.twl2`) as `alfworld-generate` does.
- `generate_game(...)`: the game file (`.tw-pddl`, the JSON that ALFWorld's own
  game files use: domain, grammar, problem, `solvable`, `walkthrough`), generated once
  from (task type, scene, seed), checked solvable by TextWorld's planner (a plan
  whose replay wins the game) and cached under `<data_dir>/alfworld/games/`.
- `make_alfworld_tasks(...)`: train and held-out tasks. Held-out tasks use ALFRED's
  test floorplans (`constants.TEST_SCENE_NUMBERS`, 6 of 30 per room type: unseen
  rooms), train tasks only the others; `heldout_task_types` appear only in the
  held-out split. `only=(split, n)` makes just the first n tasks of one split (what
  `dreamgym eval --limit n` needs; they are the same n as in the whole split), and
  every problem prints a line as it is made or read from the cache.

The cache is keyed by a problem's parameters: the game file is named by (task type,
floorplan, seed), and a (task type, floorplan, seed) whose placements the planner could
not solve leaves an empty `.unsolvable` marker beside it, so a second run neither
generates nor re-plans anything it made or tried before (a slot falls back to its next
floorplan; each try costs up to 4 planner runs), and a generated game's Task (its first
state, read off a reset that parses ALFWorld's grammar) is kept beside it as `.task.json`. Few problems to make (at most
`SERIAL_UP_TO`) are made in this process: a spawned worker first spends seconds importing
TextWorld and ALFWorld.

Where this departs from ALFWorld: ALFWorld's 3 553 training games are ALFRED
trajectories replayed in AI2-THOR (which places every object of the scene and needs
the simulator and the downloaded data); here objects are placed by a seeded sampler
over the same layouts, with fewer distractors (`MAX_DISTRACTORS` types) so the
planner answers in well under a second. Receptacles that a room has but whose
interaction pose the layout files do not record (coffee machines, garbage cans,
stove burners, ...) get one instance at a reachable floor point. Sliced objects and
movable receptacles used as containers (ALFRED's `movable` and `Sliced` variants,
which ALFWorld also skips) are left out; `look_at_obj_in_light` uses desk lamps, the
lamp that ALFRED places on furniture.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from actors.dataset import TaskSplits
from actors.envs.alfworld_env import AlfWorldEnv
from infra.schema import Task, from_fields

TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
# The receptacle each state-changing task type needs, and the predicate its objects must carry.
_TOOL = {"pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
         "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
         "pick_cool_then_place_in_recep": ("Fridge", "Coolable")}
LAMP = "DeskLamp"
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser", "Shelf", "Nightstand")
MAX_DISTRACTORS = 6  # distractor object types per problem (ALFRED scenes hold 20-40)
MAX_ATTEMPTS = 12  # floorplans tried for one task slot before it is declared impossible
GAME_SUFFIX = ".tw-pddl"
UNSOLVABLE_SUFFIX = ".unsolvable"  # the marker of a (task type, floorplan, seed) that yields no solvable game
TASK_SUFFIX = ".task.json"  # a generated game's Task (its first state), kept beside it
TASK_FORMAT = 1  # bump when AlfWorldEnv renders states differently: kept Tasks are then read off a reset again
# Most problems made without a worker process (a spawned one spends 10-16 s importing on a loaded 2-core CPU).
SERIAL_UP_TO = 8
_MANGLE = {"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}
_MANGLE_RE = re.compile("|".join(re.escape(k) for k in _MANGLE))


class ProblemGenerationError(RuntimeError):
    """No solvable problem of a task type could be generated where one was asked for."""


def _alfworld() -> tuple[Any, Any, Path]:
    """(constants, goal_library, package dir): imported lazily, alfworld is an optional install."""
    try:  # alfworld is an optional install (and slow to import)
        import alfworld.gen.constants as constants  # optional install, only when used
        import alfworld.gen.goal_library as goal_library  # optional install, only when used
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("actors.env_family=alfworld needs the alfworld package: "
                          "pip install --no-deps alfworld==0.4.2 (infra/setup.sh does this)") from exc
    import alfworld  # optional install; see above

    return constants, goal_library, Path(alfworld.__file__).parent


def mangle(name: str) -> str:
    """ALFRED's object id -> a PDDL name ('Apple|+01.00|...' -> 'Apple_bar__plus_01_dot_00...'), as ALFWorld writes them."""
    return _MANGLE_RE.sub(lambda m: _MANGLE[m.group(0)], name)


def scene_number(scene: str) -> int:
    m = re.fullmatch(r"FloorPlan(\d+)", scene)
    if not m:
        raise ValueError(f"not an ALFRED floorplan name: {scene!r} (expected FloorPlan<N>)")
    return int(m.group(1))


def room_type(scene: str) -> str:
    n = scene_number(scene)
    return {0: "Kitchen", 2: "LivingRoom", 3: "Bedroom", 4: "Bathroom"}[n // 100]


def all_scenes() -> list[str]:
    _c, _g, pkg = _alfworld()
    names = [p.name.split("-")[0] for p in (pkg / "gen" / "layouts").glob("FloorPlan*-openable.json")]
    return sorted(names, key=scene_number)


def heldout_scenes() -> set[str]:
    """ALFRED's test floorplans (6 of 30 per room type): the unseen rooms."""
    constants, _g, _p = _alfworld()
    return {f"FloorPlan{n}" for n in constants.TEST_SCENE_NUMBERS}


def _loc(x: float, z: float, rot: float, horizon: float) -> str:
    return f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{round(rot / 90) % 4}|{round(horizon)}"


def _receptacle_type(rid: str) -> str:
    parts = rid.split("|")
    return parts[4] if len(parts) == 5 else parts[0]  # 'Sink|x|y|z|SinkBasin' is a SinkBasin


@dataclass
class Layout:
    scene: str
    receptacles: dict[str, tuple[str, str]]  # id -> (type, location)
    object_types: list[str]  # pickupable object types present in the room
    start: str  # the agent's starting location, where no receptacle is
    has_lamp: bool = False  # a desk lamp stands in the room (look_at_obj_in_light)

    def receptacles_of(self, rtype: str) -> list[str]:
        return [r for r, (t, _l) in self.receptacles.items() if t == rtype]

    @property
    def receptacle_types(self) -> set[str]:
        return {t for t, _l in self.receptacles.values()}


def load_layout(scene: str) -> Layout:
    constants, _g, pkg = _alfworld()
    base = pkg / "gen" / "layouts"
    if not (base / f"{scene}-openable.json").exists():
        raise ValueError(f"ALFWorld has no layout {scene!r}; it ships {len(all_scenes())} (e.g. FloorPlan1, FloorPlan301)")
    poses = json.loads((base / f"{scene}-openable.json").read_text())
    present = json.loads((base / f"{scene}-objects.json").read_text())
    points = np.load(base / f"{scene}-layout.npy")
    static = (set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES)) & set(constants.VAL_RECEPTACLE_OBJECTS)
    recs: dict[str, tuple[str, str]] = {}
    for rid, (x, z, rot, hor) in sorted(poses.items()):
        if _receptacle_type(rid) in static:
            recs[rid] = (_receptacle_type(rid), _loc(x, z, rot, hor))
    used = {tuple(l.split("|")[1:3]) for _t, l in recs.values()}
    free = [(float(x), float(z)) for x, z in points if (str(round(x / 0.25)), str(round(z / 0.25))) not in used]
    # Receptacle types the room holds but whose interaction pose was not recorded: one instance each.
    for i, rtype in enumerate(sorted(t for t in set(present) & static if t not in {t for t, _l in recs.values()})):
        x, z = free[(7 * i + 3) % len(free)]
        recs[f"{rtype}|{x:+06.2f}|+00.90|{z:+06.2f}"] = (rtype, _loc(x, z, 0, 30))
    holdable = set().union(*constants.VAL_RECEPTACLE_OBJECTS.values())
    objects = sorted(t for t in set(present) if t in holdable and t not in static and "Sliced" not in t)
    x, z = free[len(free) // 2] if free else (0.0, 0.0)
    return Layout(scene, recs, objects, _loc(x, z, 0, 30), LAMP in present)


@dataclass
class Problem:
    task_type: str
    scene: str
    object_target: str
    parent_target: str  # receptacle type of the goal ('' for look_at_obj_in_light)
    toggle_target: str  # 'DeskLamp' for look_at_obj_in_light, else ''
    description: str  # the task as ALFWorld states it, e.g. "put a hot apple in countertop"
    placements: dict[str, str] = field(default_factory=dict)  # object id -> receptacle id
    pddl: str = ""


def _holders(layout: Layout, otype: str, constants: Any, exclude: set[str] = frozenset()) -> list[str]:
    return [r for r, (t, _l) in layout.receptacles.items()
            if t not in exclude and otype in constants.VAL_RECEPTACLE_OBJECTS.get(t, ())]


def _object_id(otype: str, rng: random.Random, taken: set[str]) -> str:
    while True:
        oid = f"{otype}|{rng.uniform(-3, 3):+06.2f}|{rng.uniform(0, 2):+06.2f}|{rng.uniform(-3, 3):+06.2f}"
        if oid not in taken:
            taken.add(oid)
            return oid


def feasible_targets(layout: Layout, task_type: str) -> list[tuple[str, str]]:
    """Every (object type, goal receptacle type) this layout allows for `task_type`, sorted."""
    constants, _g, _p = _alfworld()
    if task_type not in TASK_TYPES:
        raise ValueError(f"unknown ALFWorld task type {task_type!r}; expected one of {', '.join(TASK_TYPES)}")
    if room_type(layout.scene) not in constants.GOALS_VALID[task_type]:
        return []
    if task_type == "look_at_obj_in_light":
        if not layout.has_lamp or not any(layout.receptacles_of(h) for h in LAMP_HOLDERS):
            return []
        return [(o, "") for o in layout.object_types if _holders(layout, o, constants)]
    tool, ability = _TOOL.get(task_type, ("", ""))
    if tool and not layout.receptacles_of(tool):
        return []
    out = []
    for o in layout.object_types:
        if ability and o not in constants.VAL_ACTION_OBJECTS[ability]:
            continue
        for rtype in sorted(layout.receptacle_types - {tool}):
            # The goal receptacle must hold it, and some other receptacle (not the tool) must hold it at the start.
            if o in constants.VAL_RECEPTACLE_OBJECTS.get(rtype, ()) and _holders(layout, o, constants, {rtype, tool}):
                out.append((o, rtype))
    return out


def sample_problem(layout: Layout, task_type: str, rng: random.Random) -> Problem | None:
    """A problem of `task_type` in `layout`, or None when the room cannot host that type."""
    constants, goals, _p = _alfworld()
    targets = feasible_targets(layout, task_type)
    if not targets:
        return None
    obj, recep = rng.choice(targets)
    tool, _ability = _TOOL.get(task_type, ("", ""))
    taken: set[str] = set()
    placements: dict[str, str] = {}
    n_target = 2 + rng.randint(0, 1) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    start_holders = _holders(layout, obj, constants, {recep, tool})
    for _ in range(n_target):
        placements[_object_id(obj, rng, taken)] = rng.choice(start_holders)
    toggle = ""
    if task_type == "look_at_obj_in_light":
        toggle = LAMP
        lamp_holders = [r for h in LAMP_HOLDERS for r in layout.receptacles_of(h)]
        placements[_object_id(LAMP, rng, taken)] = rng.choice(lamp_holders)
    others = [o for o in layout.object_types if o != obj and _holders(layout, o, constants, {recep, tool})]
    for o in rng.sample(others, min(MAX_DISTRACTORS, len(others))):
        for _ in range(rng.randint(1, 2)):
            placements[_object_id(o, rng, taken)] = rng.choice(_holders(layout, o, constants, {recep, tool}))
    template = rng.choice(goals.gdict[task_type]["templates"])
    description = template.format(obj=obj.lower(), recep=recep.lower(), toggle=toggle.lower(), mrecep="")
    goal = goals.gdict[task_type]["pddl"].format(obj=obj, recep=recep, toggle=toggle, mrecep="")
    prob = Problem(task_type, layout.scene, obj, recep, toggle, description, placements)
    prob.pddl = problem_pddl(layout, prob, goal, constants)
    return prob


def problem_pddl(layout: Layout, prob: Problem, goal: str, constants: Any) -> str:
    """The PDDL problem text, in the shape and naming of ALFWorld's own `initial_state.pddl` files."""
    m = mangle
    objs = sorted(prob.placements)
    otypes = sorted({o.split("|")[0] for o in objs})
    rtypes = sorted(layout.receptacle_types)
    locs = sorted({l for _t, l in layout.receptacles.values()} | {layout.start})
    typ = {o: o.split("|")[0] for o in objs}
    init = [f"(atLocation agent1 {m(layout.start)})"]
    for r, (t, l) in sorted(layout.receptacles.items()):
        init += [f"(receptacleType {m(r)} {t}Type)", f"(receptacleAtLocation {m(r)} {m(l)})"]
        if t in constants.OPENABLE_CLASS_SET:
            init.append(f"(openable {m(r)})")
    for rt in rtypes:
        for ot in otypes:
            if ot in constants.VAL_RECEPTACLE_OBJECTS.get(rt, ()):
                init.append(f"(canContain {rt}Type {ot}Type)")
    for o in objs:
        r = prob.placements[o]
        init += [f"(objectType {m(o)} {typ[o]}Type)", f"(inReceptacle {m(o)} {m(r)})",
                 f"(wasInReceptacle {m(o)} {m(r)})", f"(objectAtLocation {m(o)} {m(layout.receptacles[r][1])})"]
        if typ[o] == LAMP:
            init.append(f"(toggleable {m(o)})")
            continue
        init.append(f"(pickupable {m(o)})")
        for ability, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
            if typ[o] in constants.VAL_ACTION_OBJECTS[ability]:
                init.append(f"({pred} {m(o)})")
        if typ[o] in constants.MOVABLE_RECEPTACLES:
            init.append(f"(isReceptacleObject {m(o)})")
    decl = (["agent1 - agent"] + [f"{m(o)} - object" for o in objs]
            + [f"{m(r)} - receptacle" for r in sorted(layout.receptacles)] + [f"{m(l)} - location" for l in locs]
            + [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes])
    sep = "\n        "
    return (f"\n(define (problem plan_{prob.scene}_{prob.task_type})\n    (:domain alfred)\n"
            f"    (:objects{sep}{sep.join(decl)}\n    )\n    (:init{sep}{sep.join(init)}\n    )\n"
            + goal.replace(" # ", " - "))


def game_data(prob: Problem) -> dict:
    """The game file's JSON: ALFWorld's domain and grammar (with the task text), the problem, provenance."""
    _c, _g, pkg = _alfworld()
    grammar = (pkg / "data" / "alfred.twl2").read_text().replace("UNKNOWN GOAL", prob.description)
    return {"pddl_domain": (pkg / "data" / "alfred.pddl").read_text(), "grammar": grammar,
            "pddl_problem": prob.pddl, "solvable": None, "walkthrough": None,
            "dreamgym": {"task_type": prob.task_type, "scene": prob.scene, "object_target": prob.object_target,
                         "parent_target": prob.parent_target, "toggle_target": prob.toggle_target,
                         "description": prob.description}}


def solve(data: dict, max_steps: int = 60) -> list[str] | None:
    """TextWorld's planner on the game (what `policy_commands` holds at the start): a plan whose replay wins, or None."""
    # the game engine and ALFWorld's wrappers: optional installs, only when games are generated
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler  # optional install, only when used
    from textworld.envs import PddlEnv  # optional install, only when used

    # Demangled as in play, so the walkthrough reads "go to countertop 1", the game's own commands.
    env = AlfredDemangler(PddlEnv(textworld.EnvInfos(admissible_commands=True)))
    env.load(data)
    env.reset()
    plan = list(env._pddl_state.replan(env._entity_infos) or [])  # once; asking policy_commands replans every step
    if not plan or len(plan) > max_steps:
        return None
    state = None
    for cmd in plan:
        state, _score, _done = env.step(cmd)
    return plan if state is not None and state["won"] else None


def game_path(games_dir: str | Path, task_type: str, scene: str, seed: int) -> Path:
    return Path(games_dir) / f"{task_type}-{scene}-s{seed}{GAME_SUFFIX}"


def unsolvable_marker(game: Path) -> Path:
    return game.with_name(game.name[: -len(GAME_SUFFIX)] + UNSOLVABLE_SUFFIX)


def cached_game(task_type: str, scene: str, seed: int, games_dir: str | Path) -> Path | None | bool:
    """What the cache knows of (task type, scene, seed): its game file, False when it was tried and
    yields none, or None when it was never tried."""
    out = game_path(games_dir, task_type, scene, seed)
    if out.exists() and out.stat().st_size > 0:
        return out
    return False if unsolvable_marker(out).exists() else None


def generate_game(task_type: str, scene: str, seed: int, games_dir: str | Path) -> Path | None:
    """The solvable game of (task type, scene, seed), generated once then read from the cache; None if the room
    cannot host it (remembered by a marker file, so it is not tried again)."""
    known = cached_game(task_type, scene, seed, games_dir)
    if known is not None:
        return known or None
    out = game_path(games_dir, task_type, scene, seed)
    rng = random.Random(f"{task_type}/{scene}/{seed}")
    layout = load_layout(scene)
    for _ in range(4):  # a placement the planner cannot solve is re-drawn
        prob = sample_problem(layout, task_type, rng)
        if prob is None:
            break
        data = game_data(prob)
        plan = solve(data)
        if plan is not None:
            data["solvable"], data["walkthrough"] = True, plan
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(out)  # a crash never leaves half a game
            return out
    out.parent.mkdir(parents=True, exist_ok=True)
    unsolvable_marker(out).touch()
    return None


def read_game_meta(path: str | Path) -> dict:
    return dict(json.loads(Path(path).read_text()).get("dreamgym", {}))


def _check_types(names: list[str], what: str) -> list[str]:
    for t in names:
        if t not in TASK_TYPES:
            raise ValueError(f"{what}: unknown ALFWorld task type {t!r}; expected one of {', '.join(TASK_TYPES)}")
    return list(names)


def eligible_scenes(task_type: str, scenes: list[str]) -> list[str]:
    """The floorplans among `scenes` that can host `task_type` (ALFRED's room types for it, the tools it needs)."""
    return [s for s in scenes if feasible_targets(load_layout(s), task_type)]


def plan_games(n_train: int, n_heldout: int, task_types: list[str], heldout_task_types: list[str] | tuple[str, ...] = (),
               seed: int = 0) -> list[tuple[str, str, list[str], int]]:
    """(split, task type, candidate floorplans, seed) slots; task types round-robin.

    Train slots draw from the seen floorplans, held-out slots only from ALFRED's test
    floorplans; `heldout_task_types` get held-out slots only. A slot's floorplans are
    the eligible ones of its split in a seeded order (the first is used unless the
    planner finds no solvable placement there). Slot seeds are `seed*10000 + i` (train)
    and `seed*10000 + 5000 + i` (held-out), as for TextWorld games.
    """
    train_types = _check_types(list(task_types), "task_types")
    held_types = train_types + [t for t in _check_types(list(heldout_task_types), "heldout_task_types") if t not in train_types]
    if not train_types and n_train:
        raise ValueError("no ALFWorld task types given")
    held_set = heldout_scenes()
    every = all_scenes()
    pools = {"train": [s for s in every if s not in held_set], "heldout": [s for s in every if s in held_set]}
    eligible: dict[tuple[str, str], list[str]] = {}
    plan = []
    for split, n, types, base in (("train", n_train, train_types, seed * 10000),
                                  ("heldout", n_heldout, held_types, seed * 10000 + 5000)):
        for i in range(n):
            ttype = types[i % len(types)]
            if (split, ttype) not in eligible:
                eligible[split, ttype] = eligible_scenes(ttype, pools[split])
                if not eligible[split, ttype]:
                    raise ProblemGenerationError(f"no {split} floorplan can host {ttype}")
            order = list(eligible[split, ttype])
            random.Random(f"slot/{split}/{seed}/{i}").shuffle(order)
            plan.append((split, ttype, order, base + i))
    return plan


def _make_slot(slot: tuple[str, str, list[str], int], games_dir: Path) -> Path:
    split, ttype, scenes, s = slot
    for scene in scenes[:MAX_ATTEMPTS]:
        path = generate_game(ttype, scene, s, games_dir)
        if path is not None:
            return path
    raise ProblemGenerationError(f"no floorplan of the {split} split hosts a solvable {ttype} problem (seed {s})")


def cached_slot(slot: tuple[str, str, list[str], int], games_dir: Path) -> Path | None:
    """The slot's game when the cache settles it without generating anything (the first floorplan not
    marked unsolvable has its game on disk), else None."""
    _split, ttype, scenes, s = slot
    for scene in scenes[:MAX_ATTEMPTS]:
        known = cached_game(ttype, scene, s, games_dir)
        if known is None:
            return None
        if known:
            return known
    return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def make_games(plan: list[tuple[str, str, list[str], int]], games_dir: Path, workers: int = 2,
               progress: Callable[[str], None] | None = _say) -> list[Path]:
    """The game of every slot of `plan`, in order: read from the cache, or generated (here when at most
    SERIAL_UP_TO are missing or `workers` is 1, else in `workers` processes), one progress line each."""
    say = progress or (lambda _line: None)
    paths: list[Path | None] = [cached_slot(slot, games_dir) for slot in plan]
    missing = [i for i, p in enumerate(paths) if p is None]
    n, done = len(plan), 0
    for i, p in enumerate(paths):
        if p is not None:
            done += 1
            say(f"alfworld: problem {done}/{n} ({plan[i][0]}, {plan[i][1]}, seed {plan[i][3]}): cached {p.name}")
    if missing:
        say(f"alfworld: generating {len(missing)} problem(s) in {games_dir} (0.5-7 s each on a 2-core CPU)")

    def made(i: int, path: Path, took: str) -> None:
        nonlocal done
        paths[i], done = path, done + 1
        say(f"alfworld: problem {done}/{n} ({plan[i][0]}, {plan[i][1]}, seed {plan[i][3]}): generated {path.name} {took}")

    if len(missing) <= SERIAL_UP_TO or workers <= 1:
        for i in missing:
            t0 = time.perf_counter()
            made(i, _make_slot(plan[i], games_dir), f"in {time.perf_counter() - t0:.1f} s")
    else:
        # Processes: TextWorld's grammar parser is not thread-safe, and the planner is CPU-bound.
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=min(workers, len(missing)), mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_make_slot, plan[i], games_dir): i for i in missing}
            for f in as_completed(futures):
                made(futures[f], f.result(), f"({time.perf_counter() - t0:.0f} s since the first)")
    return [p for p in paths if p is not None]


def make_alfworld_tasks(data_dir: str | Path, n_train: int, n_heldout: int, task_types: list[str],
                        heldout_task_types: list[str] | tuple[str, ...] = (), seed: int = 0, workers: int = 2,
                        only: tuple[str, int] | None = None, progress: Callable[[str], None] | None = _say):
    """Generate (or load from the cache) games and split them into train and held-out tasks.

    `only=(split, n)`: just the first n tasks of that split (the other split empty), the same
    tasks the whole split starts with. `progress`: where the per-problem lines go (None: nowhere)."""

    plan = plan_games(n_train, n_heldout, task_types, heldout_task_types, seed)
    if only is not None:
        split, n = only
        if split not in ("train", "heldout"):
            raise ValueError(f"only: split {split!r}; expected 'train' or 'heldout'")
        plan = [slot for slot in plan if slot[0] == split][: max(0, n)]
    paths = make_games(plan, Path(data_dir).resolve() / "alfworld" / "games", workers, progress)
    t0 = time.perf_counter()
    tasks = tasks_from_games(paths, [s for (_split, _t, _scenes, s) in plan], cache=True)
    if progress is not None and tasks:
        progress(f"alfworld: {len(tasks)} task(s) read off their games' first states in {time.perf_counter() - t0:.1f} s")
    return TaskSplits(train=[t for t, p in zip(tasks, plan) if p[0] == "train"],
                      heldout=[t for t, p in zip(tasks, plan) if p[0] == "heldout"])


def task_cache(game: Path) -> Path:
    return game.with_name(game.name[: -len(GAME_SUFFIX)] + TASK_SUFFIX)


def _cached_task(game: Path, seed: int) -> Task | None:
    """The Task kept beside a generated game by an earlier `tasks_from_games(..., cache=True)`, if it was
    made by this state format from this very file (its size and mtime), else None."""
    try:
        doc = json.loads(task_cache(game).read_text())
        st = game.stat()
        if doc.get("format") != TASK_FORMAT or doc.get("game") != [st.st_size, st.st_mtime_ns]:
            return None
        task = from_fields(Task, doc["task"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    task.game_file, task.seed = str(game), seed  # the data dir may have moved; the seed is the slot's
    return task


def tasks_from_games(paths: list[Path], seeds: list[int] | None = None, cache: bool = False) -> list[Task]:
    """One Task per generated game file, its instruction and initial state read off a reset.

    `cache`: keep each Task beside its game (`.task.json`) and read it back next time: a reset parses
    ALFWorld's grammar, 0.4 s a game on an idle 2-core CPU and 4 s at load 12 (60 games: 246 s)."""
    env = AlfWorldEnv()
    tasks = []
    try:
        for i, path in enumerate(paths):
            path = Path(path)
            seed = seeds[i] if seeds else 0
            if cache and (kept := _cached_task(path, seed)) is not None:
                tasks.append(kept)
                continue
            meta = read_game_meta(path)
            task = Task(task_id=path.name[: -len(GAME_SUFFIX)], instruction=meta["description"],
                        family=f"alfworld/{meta['task_type']}", game_file=str(path), seed=seed,
                        meta={"scene": meta["scene"], "task_type": meta["task_type"]})
            state, _info = env.reset_sync(task)
            task.instruction, task.initial_state = env.objective, state
            if env._walkthrough:  # the expert's plan: the results table's "longer than training" slice reads it
                task.meta["plan_length"] = len(env._walkthrough)
            tasks.append(task)
            if cache:
                st = path.stat()
                out = task_cache(path)
                tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"format": TASK_FORMAT, "game": [st.st_size, st.st_mtime_ns],
                                           "task": asdict(task)}))
                tmp.replace(out)
    finally:
        env.close_sync()
    return tasks
