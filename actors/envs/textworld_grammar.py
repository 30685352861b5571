"""Which actions a TextWorld state's own description allows: the command grammar read backwards.

Owns two reads of an abstract state as `render_state` writes it (actors/envs/textworld_env.py:
"Room:", "You see:", "Exits:", "Inventory:", then numbered commands, sorted):

- `ruled_out(state, actions)`: the listed commands the game could not offer in the world the
  description shows: `drop`, `put`, `insert`, `eat` of something not in the inventory, `take`
  of something carried or not in sight, `go` through an exit the room does not have, `open`
  of what is already open, `close` of what is closed, `insert` into a closed container,
  `unlock`/`lock` of something not in sight or without the key in hand;
- `implied(state)`: the commands the game always offers in that world: `drop` each thing
  carried, `take X from Y` of what an open container or a supporter shows, `open` what is
  closed, `close` what is open, `go` each exit. (Not `take` of a thing in the room, `put`,
  `insert`, `eat` or `unlock`: the description does not say which things are portable,
  supporters, containers, food or keys.)

`consistent_actions` applies both and sorts, as TextWorld lists its commands.
`refusal(state, action)`: why TextWorld would refuse a command written as free text in that world
(generate mode's `actors.free_text_actions`, in DreamGym): a verb its grammar does not have, or a
command the description rules out; "" when only the game (here: Mexp) can say what it does.

It exists for synthetic states. A real state is consistent by construction (tests check, on
the states of real games, that nothing is ruled out and everything implied is listed); the
135M experience model often writes a description and an action list that disagree
("Inventory: nothing" above "[3] drop cloak") and leaves out commands the world offers, and a
policy trained on choices no real game offers learns nothing it can use.
`simulator.action_check` (simulator/experience_model.py) applies it to Mexp's next states.
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
        carried = _split_top(lines.get("Inventory", ""))
        self.names = {x.lower(): x for x in carried}  # lower-case name -> as the state writes it
        self.inventory = set(self.names)
        self.here: dict[str, set[str]] = {}  # thing in sight -> its states (open, closed, locked)
        self.contents: dict[str, set[str]] = {}  # container or supporter -> what is in or on it
        for entry in _split_top(lines.get("You see", "")):
            self._add(entry)
        exits = lines.get("Exits", "").lower()
        self.directions = {d for d in _DIRECTIONS if re.search(rf"\b{d} to\b", exits)}
        for m in re.finditer(r"through (.+?)(?:;|$)", exits):  # doors: "north to hall through door (closed)"
            self._add(m.group(1).strip())

    def _add(self, entry: str) -> None:
        name, _, rest = entry.partition(" (")
        details = _split_top(rest[:-1] if rest.endswith(")") else rest)
        inside = [d.split(":", 1)[1].strip() for d in details if ":" in d]
        self.names.update({x.lower(): x for x in [name.strip(), *inside]})
        name = name.strip().lower()
        self.here[name] = {d.lower() for d in details if d.lower() in ("open", "closed", "locked")}
        self.contents[name] = {x.lower() for x in inside}

    def implied(self) -> list[str]:
        n = self.names
        out = [f"drop {n[x]}" for x in self.inventory] + [f"go {d}" for d in sorted(self.directions)]
        for thing, states in self.here.items():
            if "closed" in states:
                out.append(f"open {n.get(thing, thing)}")
            elif "open" in states:
                out.append(f"close {n.get(thing, thing)}")
            if not states & {"closed", "locked"}:
                out += [f"take {n[x]} from {n.get(thing, thing)}" for x in self.contents.get(thing, ())
                        if x not in self.inventory]  # a description that has it in both places: not both
        return out


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


# every command form of TextWorld's grammars (its logic files' command templates, the cooking games' too)
_COMMAND = re.compile(r"^(look|inventory|goal|wait|prepare meal|examine .+|go \w+|go to .+|take .+|drop .+|eat .+|"
                      r"drink .+|put .+ on .+|insert .+ into .+|open .+|close .+|(?:un)?lock .+ with .+|"
                      r"(?:cook|chop|dice|slice) .+ with .+)$")


def refusal(state: str, action: str) -> str:
    """Why TextWorld would refuse `action` (free text, not one of the listed commands) in the world
    `state` describes: "not a command" (no verb of its grammar), "ruled out by the state" (`ruled_out`;
    only for a state in TextWorld's rendering); "" when the grammar allows it."""
    a = " ".join(str(action).lower().split())
    if not _COMMAND.match(a):
        return "not a command"
    world = _World(state)
    return "ruled out by the state" if world.parsed and _ruled_out(world, [a]) else ""


def implied(state: str) -> list[str]:
    """The commands TextWorld always offers in the world `state` describes (see the module docstring);
    none for a state without the Inventory and You see lines."""
    world = _World(state)
    return world.implied() if world.parsed else []


def consistent_actions(state: str, actions: list[str]) -> list[str]:
    """`actions` without the ones `state` rules out, with the ones it implies, sorted as TextWorld
    sorts them; `actions` as they are for a state that is not TextWorld's rendering."""
    world = _World(state)
    if not world.parsed:
        return list(actions)
    bad = set(_ruled_out(world, actions))
    kept = [a for a in actions if a not in bad]
    have = {" ".join(a.lower().split()) for a in kept}
    return sorted(kept + [a for a in dict.fromkeys(world.implied()) if a.lower() not in have])


def ruled_out(state: str, actions: list[str]) -> list[str]:
    """The `actions` (a state's listed commands) that `state`'s own description rules out.
    A state without the Inventory and You see lines (not TextWorld's rendering) rules out nothing."""
    world = _World(state)
    return _ruled_out(world, actions) if world.parsed else []


def _ruled_out(world: _World, actions: list[str]) -> list[str]:
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
