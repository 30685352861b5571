"""Which of a TextWorld state's listed actions its own description rules out.

Owns TextWorld's command grammar read backwards: given an abstract state as
`render_state` writes it (actors/envs/textworld_env.py: "Room:", "You see:", "Exits:",
"Inventory:", then numbered commands), `ruled_out(state)` names the listed commands that
the game could not offer in the world that description shows: `drop`, `put`, `insert`,
`eat` of something not in the inventory, `take` of something carried or not in sight,
`go` through an exit the room does not have, `open` of what is already open, `close`
of what is closed, `insert` into a closed container, `unlock`/`lock` of something not in
sight or without the key in hand.

It exists for synthetic states. A real state is consistent by construction (tests check
that `ruled_out` names nothing on every state of real games); the 135M experience model
often writes a description and an action list that disagree ("Inventory: nothing" above
"[3] drop cloak"), and a policy trained on choices among actions that no real game
offers learns nothing it can use. `simulator.action_check` (simulator/experience_model.py)
drops them from Mexp's next state.

It only removes: what the description implies but the list leaves out stays out, since the
description does not say which things are portable, containers or supporters.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"^(Room|You see|Exits|Inventory):\s*(.*)$", re.M)
_DIRECTIONS = ("north", "south", "east", "west")


def _split_top(text: str) -> list[str]:
    """'a, b (open, in it: c), d' -> ['a', 'b (open, in it: c)', 'd']: commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    return [p for p in parts if p and p != "nothing"]


class _World:
    """The things a state's description shows: carried, in the room (with their open/closed state and
    contents), and the exits."""

    def __init__(self, state: str) -> None:
        lines = {k: v.strip() for k, v in _LINE.findall(state)}
        self.parsed = "Inventory" in lines and "You see" in lines
        self.inventory = {x.lower() for x in _split_top(lines.get("Inventory", ""))}
        self.here: dict[str, set[str]] = {}  # thing in sight -> its states (open, closed, locked)
        self.contents: dict[str, set[str]] = {}  # container or supporter -> what is in or on it
        for entry in _split_top(lines.get("You see", "")):
            self._add(entry)
        exits = lines.get("Exits", "").lower()
        self.directions = {d for d in _DIRECTIONS if re.search(rf"\b{d} to\b", exits)}
        for m in re.finditer(r"through (.+?)(?:;|$)", exits):  # doors: "north to hall through door (closed)"
            self._add(m.group(1).strip())
        self.text = state.lower()

    def _add(self, entry: str) -> None:
        name, _, rest = entry.partition(" (")
        name = name.strip().lower()
        details = _split_top(rest[:-1] if rest.endswith(")") else rest)
        self.here[name] = {d.lower() for d in details if d.lower() in ("open", "closed", "locked")}
        self.contents[name] = {d.split(":", 1)[1].strip().lower() for d in details if ":" in d}

    def sees(self, thing: str) -> bool:
        return thing in self.here or any(thing in c for c in self.contents.values())


_RULES = [  # (pattern, check(world, groups) -> True when the command fits the world)
    (re.compile(r"^go (\w+)$"), lambda w, g: g[0] not in _DIRECTIONS or g[0] in w.directions),
    (re.compile(r"^take (.+) from (.+)$"), lambda w, g: g[0] not in w.inventory and g[0] in w.contents.get(g[1], set())),
    (re.compile(r"^take (.+)$"), lambda w, g: g[0] not in w.inventory and g[0] in w.here),
    (re.compile(r"^(?:drop|eat) (.+)$"), lambda w, g: g[0] in w.inventory),
    (re.compile(r"^(?:put (.+) on|insert (.+) into) (.+)$"),
     lambda w, g: (g[0] or g[1]) in w.inventory and g[2] in w.here and not (g[1] and w.here[g[2]] & {"closed", "locked"})),
    (re.compile(r"^open (.+)$"), lambda w, g: g[0] in w.here and "open" not in w.here[g[0]]),
    (re.compile(r"^close (.+)$"), lambda w, g: g[0] in w.here and not w.here[g[0]] & {"closed", "locked"}),
    (re.compile(r"^(?:unlock|lock) (.+) with (.+)$"), lambda w, g: g[0] in w.here and g[1] in w.inventory),
]


def ruled_out(state: str, actions: list[str]) -> list[str]:
    """The `actions` (a state's listed commands) that `state`'s own description rules out.
    A state without the Inventory and You see lines (not TextWorld's rendering) rules out nothing."""
    world = _World(state)
    if not world.parsed:
        return []
    out = []
    for action in actions:
        a = " ".join(action.lower().split())
        for pattern, fits in _RULES:
            m = pattern.match(a)
            if m:
                if not fits(world, m.groups()):
                    out.append(action)
                break
    return out
