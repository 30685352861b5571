"""BrowserGym behind the one text interface: MiniWoB++ through BrowserGym, and the road to WebArena.

Owns `BrowserGymEnv`, the accessibility-tree-to-abstract-state mapping, the two-way
mapping between BrowserGym's action vocabulary and the project's, and the
BrowserGym task splits.

- Tasks are BrowserGym env ids without the `browsergym/` prefix, in `task.game_file`:
  `miniwob.click-button` (needs `browsergym-miniwob`; `MINIWOB_URL` defaults to the
  HTML pages the `miniwob` package ships) or `webarena.310` (needs
  `browsergym-webarena` and the user's WebArena servers; see docs/environments.md).
- Browser: BrowserGym launches Playwright's bundled Chromium twice (the task page and
  a chat window) and takes no executable path for the chat. Playwright's browsers
  are not downloaded here, so BrowserGym is handed a Playwright object whose
  `chromium.launch` adds Debian's `/usr/bin/chromium` (`BROWSERGYM_CHROMIUM`) and
  sandbox-free flags to every launch. Playwright's sync API belongs to the thread that
  started it: every BrowserGym call of this process runs on one dedicated thread.
- State: `Task: <goal>`, then one item per visible accessibility node that carries a
  BrowserGym id (`bid`) and is interactive, or holds text of its own:
  `[16] input_text`, `[20] button 'Login'`, `[18] input_checkbox 'Gh'`. Roles are
  named with the tags the MiniWoB state uses, so candidates, rationales and the
  scripted expert are shared with actors/envs/miniwob_env.py. A numeric bid is the
  item's number; other bids (frames: `a12`) get stable numbers from 100000 up.
- Actions: `click [20]` <-> `click('20')`, `type [16] "x"` <-> `fill('16', 'x')`
  (`to_browsergym`, `from_browsergym`; the env also accepts BrowserGym's own form).
  BrowserGym executes action strings as Python, so only strings built here, for a bid
  on the current page, ever reach it; anything else is answered as invalid.
- Reward: 1.0 when the task's own reward is positive at the end of the episode.
- Expert: for MiniWoB tasks whose fields `miniwob.fields` extracts from the goal and
  whose page the accessibility tree shows unambiguously (`EXPERT_TASKS`), the MiniWoB
  scripted solver; elsewhere (password fields show only bullets; WebArena) none.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from actors.dataset import TaskSplits
from actors.envs.base import TYPEABLE_TAGS, ActionFormatError, EpisodeBookkeeping, StepResult, parse_action
from actors.envs.miniwob_env import MAX_ITEMS, Item, dom_rationale, expert_action, page_candidates, render_page
from infra.metrics import ENV_RESETS
from infra.schema import Task

CHROMIUM = os.environ.get("BROWSERGYM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
ROLE_TAGS = {"button": "button", "link": "a", "textbox": "input_text", "searchbox": "input_search",
             "spinbutton": "input_number", "checkbox": "input_checkbox", "radio": "input_radio", "combobox": "select",
             "listbox": "select", "option": "option", "tab": "tab", "menuitem": "button", "switch": "input_checkbox",
             "LabelText": "label", "paragraph": "p", "heading": "h1", "cell": "td", "gridcell": "td", "listitem": "li",
             "image": "img", "img": "img", "StaticText": "span"}
INTERACTIVE = {"button", "link", "textbox", "searchbox", "spinbutton", "checkbox", "radio", "combobox", "listbox",
               "option", "tab", "menuitem", "switch"}
EXPERT_TASKS = ("click-test", "click-button", "click-link", "click-tab", "click-dialog", "focus-text", "enter-text",
                "click-checkboxes", "click-option", "click-button-sequence")
FRAME_REF_BASE = 100000
WEB_MAX_ITEMS = 150  # items of a page outside MiniWoB (WebArena pages run to hundreds of elements)
_BG_CLICK = re.compile(r"""^click\(\s*(['"])(\w+)\1\s*\)$""")
_BG_FILL = re.compile(r"""^fill\(\s*(['"])(\w+)\1\s*,\s*(['"])(.*)\3\s*\)$""", re.S)

# --- the Playwright thread -------------------------------------------------------
_PW_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playwright")
_pw_lock = threading.Lock()
_pw_started = False


class _Chromium:
    """Playwright's BrowserType with every launch pointed at Debian's Chromium."""

    def __init__(self, browser_type: Any):
        self._bt = browser_type

    def launch(self, **kw: Any) -> Any:
        kw.setdefault("executable_path", CHROMIUM)
        kw["args"] = list(kw.get("args") or []) + [f for f in CHROMIUM_FLAGS if f not in (kw.get("args") or [])]
        return self._bt.launch(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bt, name)


class _Playwright:
    def __init__(self, pw: Any):
        self._pw, self.chromium = pw, _Chromium(pw.chromium)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pw, name)


def _start_playwright() -> None:
    """On the Playwright thread: one Playwright for BrowserGym, launching Debian's Chromium."""
    global _pw_started
    with _pw_lock:
        if _pw_started:
            return
        if not Path(CHROMIUM).exists():
            raise FileNotFoundError(f"BrowserGym needs Chromium at {CHROMIUM} (apt-get install chromium, "
                                    "or set BROWSERGYM_CHROMIUM)")
        # BrowserGym and Playwright: the browsergym extra, only when a page is opened
        import browsergym.core
        import playwright.sync_api  # optional install, only when used

        browsergym.core._set_global_playwright(_Playwright(playwright.sync_api.sync_playwright().start()))
        _pw_started = True


def on_playwright_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` on the one thread that owns Playwright, and wait for it."""
    if threading.current_thread().name.startswith("playwright"):
        return fn(*args)
    return _PW_THREAD.submit(fn, *args).result()


def _register(env_id: str) -> None:
    import browsergym.core  # noqa: F401  (optional extra; importing registers the open-ended task)

    family = env_id.split(".", 1)[0]
    if family == "miniwob":
        if "MINIWOB_URL" not in os.environ:
            import miniwob  # a browser benchmark package: only for MiniWoB pages

            html = Path(miniwob.__file__).parent / "html" / "miniwob"
            os.environ["MINIWOB_URL"] = html.as_uri() + "/"
        import browsergym.miniwob  # noqa: F401  (optional extra; importing registers the MiniWoB tasks)
    elif family in ("webarena", "visualwebarena", "workarena", "assistantbench", "weblinx"):
        try:
            importlib.import_module(f"browsergym.{family}")
        except ImportError as exc:
            raise ImportError(f"BrowserGym task {env_id!r} needs `pip install browsergym-{family}` "
                              "and its servers (docs/environments.md: WebArena through BrowserGym)") from exc


# --- the accessibility tree -> items -------------------------------------------------
def _prop(node: dict, name: str) -> Any:
    for p in node.get("properties") or []:
        if p.get("name") == name:
            return (p.get("value") or {}).get("value")
    return None


def _value(node: dict, key: str) -> str:
    return " ".join(str((node.get(key) or {}).get("value") or "").split())


def axtree_items(axtree: dict, extra: dict | None = None, refs: dict[str, int] | None = None,
                 max_items: int = MAX_ITEMS) -> list[Item]:
    """The page's items from BrowserGym's accessibility tree (visible, bid-bearing, interactive or with own text)."""
    extra, refs = extra or {}, refs if refs is not None else {}
    nodes = axtree.get("nodes") or []
    by_id = {n.get("nodeId"): n for n in nodes}
    items: list[Item] = []
    for n in nodes:
        bid = n.get("browsergym_id")
        if bid is None or n.get("ignored"):
            continue
        bid = str(bid)
        if (extra.get(bid) or {}).get("visibility", 1.0) < 0.5:
            continue
        role = _value(n, "role")
        kids = [by_id.get(c) for c in n.get("childIds") or []]
        own_text = " ".join(_value(k, "name") for k in kids if k and _value(k, "role") == "StaticText" and _value(k, "name"))
        text = _value(n, "name") or own_text
        clickable = bool((extra.get(bid) or {}).get("clickable"))
        if role not in INTERACTIVE and not own_text and not (clickable and text):
            continue
        leaf = not any(k and k.get("browsergym_id") is not None for k in kids)
        tag = ROLE_TAGS.get(role, "span" if leaf else "div")
        if role in ("checkbox", "radio", "switch"):
            value: Any = str(_prop(n, "checked")).lower() == "true"
        else:
            value = _value(n, "value")
        items.append(Item(_ref(bid, refs), tag, text[:60], "", value, ""))
    return items[:max_items]


def _ref(bid: str, refs: dict[str, int]) -> int:
    if bid not in refs:
        refs[bid] = int(bid) if bid.isdigit() else FRAME_REF_BASE + len([b for b in refs if not b.isdigit()])
    return refs[bid]


# --- actions, both ways ---------------------------------------------------------------
def to_browsergym(action: str, items: list[Item], refs: dict[str, int] | None = None) -> str:
    """`click [20]` -> `click('20')`, `type [16] "x"` -> `fill('16', 'x')`, for an item on the page; else ActionFormatError.

    `refs` maps bids to item numbers (needed only for non-numeric bids)."""
    act = parse_action(action)
    if act.kind not in ("click", "type"):
        raise ActionFormatError("expected click [n] or type [n] \"text\"")
    item = next((it for it in items if it.ref == act.ref), None)
    if item is None:
        raise ActionFormatError(f"no element [{act.ref}] on the page")
    if act.kind == "type" and item.tag not in TYPEABLE_TAGS:
        raise ActionFormatError(f"[{act.ref}] {item.tag} does not take text")
    bid = next((b for b, r in (refs or {}).items() if r == item.ref), str(item.ref))
    if act.kind == "click":  # repr: BrowserGym runs the string as Python, so the text is a quoted literal
        return f"click({bid!r})"
    return f"fill({bid!r}, {act.text!r})"


def from_browsergym(action: str, refs: dict[str, int] | None = None) -> str:
    """BrowserGym's `click('20')` / `fill('16', 'x')` -> the project's `click [20]` / `type [16] "x"`; other text unchanged."""
    t = action.strip() if isinstance(action, str) else ""
    refs = refs if refs is not None else {}
    if m := _BG_CLICK.match(t):
        return f"click [{_ref(m.group(2), refs)}]"
    if m := _BG_FILL.match(t):
        return f'type [{_ref(m.group(2), refs)}] "{m.group(4)}"'
    return action


def _fields(env_id: str, goal: str) -> dict[str, str]:
    """MiniWoB's task fields, extracted from the goal text as miniwob does; {} elsewhere."""
    family, _, sub = env_id.partition(".")
    if family != "miniwob":
        return {}
    try:
        from miniwob.fields import get_field_extractor  # only MiniWoB pages have fields

        return {str(k): str(v) for k, v in get_field_extractor(sub)(goal)}
    except (ImportError, KeyError, ValueError):
        return {}


class BrowserGymEnv(EpisodeBookkeeping):
    """One BrowserGym environment at a time; `reset(task)` opens `task.game_file` (e.g. 'miniwob.click-button') with `task.seed`."""

    family = "browsergym"
    # generate mode (actors.free_text_actions): `type [n] "any text"` fills element n with that text
    accepts_free_text = True

    def __init__(self, max_steps: int = 20):
        self.max_steps = max_steps
        self._env = None
        self._env_id = ""
        self.refs: dict[str, int] = {}
        self.items: list[Item] = []
        self.goal = ""
        self.fields: dict[str, str] = {}
        self.state = ""
        self.history: list[str] = []
        self.steps = 0
        self.invalid = 0
        self.done = True
        self.won = False

    # --- sync core: runs on the Playwright thread ------------------------------------
    def _open(self, env_id: str) -> None:
        if self._env is not None and env_id == self._env_id:
            return
        self._close()
        _start_playwright()
        _register(env_id)
        import gymnasium as gym  # only when a page is opened

        self._env = gym.make(f"browsergym/{env_id}", headless=True)
        self._env_id = env_id

    def _observe(self, obs: dict) -> None:
        limit = MAX_ITEMS if self._env_id.startswith("miniwob.") else WEB_MAX_ITEMS
        self.items = axtree_items(obs.get("axtree_object") or {}, obs.get("extra_element_properties"), self.refs, limit)

    def _expert(self) -> str | None:
        sub = self._env_id.partition(".")[2]
        if not self._env_id.startswith("miniwob.") or sub not in EXPERT_TASKS:
            return None
        return expert_action(sub, self.fields, self.items, self.history)

    def _info(self, valid: bool, **extra: Any) -> dict[str, Any]:
        return self._book_info(page_candidates(self.items, list(self.fields.values())), valid, self._expert, **extra)

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        env_id = task.game_file or task.family.removeprefix("browsergym/")
        if not env_id:
            raise ValueError(f"task {task.task_id} names no BrowserGym environment (game_file 'miniwob.click-button')")
        self._open(env_id)
        self.refs = {}
        obs, _info = self._env.reset(seed=int(task.seed))
        self.goal = " ".join(str(obs.get("goal") or task.instruction).split())
        self.fields = _fields(env_id, self.goal)
        self._observe(obs)
        self.history = []
        self._begin()
        self.state = render_page(self.goal, self.items)
        ENV_RESETS.labels(family="browsergym").inc()
        return self.state, self._info(True)

    def _invalid(self, action: str, reason: str) -> StepResult:
        return self._refuse(self.state, action, reason)

    def _step(self, action: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return self._over(self.state, action)
        self._count_step()
        ours = from_browsergym(action, self.refs) if isinstance(action, str) else ""
        try:
            code = to_browsergym(ours, self.items, self.refs)
        except ActionFormatError as exc:
            return self._invalid(str(action), str(exc))
        obs, reward, terminated, truncated_env, _info = self._env.step(code)
        before = self.items
        self.history.append(ours.strip())
        if obs.get("last_action_error"):
            self._observe(obs)
            self.state = render_page(self.goal, self.items)
            return self._invalid(ours, str(obs["last_action_error"]).splitlines()[0][:200])
        ended = bool(terminated or truncated_env)
        truncated = self._end_step(ended and float(reward) > 0, ended)
        if ended:
            self.state = render_page(self.goal, before, "done, success" if self.won else "done, failure")
            rationale = dom_rationale(ours, before, before, True, self.won)
        else:
            self._observe(obs)
            self.state = render_page(self.goal, self.items)
            rationale = dom_rationale(ours, before, self.items, False, False)
        return StepResult(self.state, self._outcome(), self.done,
                          self._info(True, truncated=truncated, rationale=rationale, raw_reward=float(reward),
                                     browsergym_action=code))

    def _close(self) -> None:
        env, self._env, self._env_id = self._env, None, ""
        if env is not None:
            try:
                env.close()
            except Exception:  # a browser that already died must not fail the close
                pass

    # --- callable from any thread -----------------------------------------------------
    def reset_sync(self, task: Task) -> tuple[str, dict[str, Any]]:
        return on_playwright_thread(self._reset, task)

    def step_sync(self, action: str) -> StepResult:
        return on_playwright_thread(self._step, action)

    def close_sync(self) -> None:
        on_playwright_thread(self._close)

    # --- the async Environment interface -------------------------------------------------
    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return await asyncio.get_running_loop().run_in_executor(_PW_THREAD, self._reset, task)

    async def step(self, action: str) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(_PW_THREAD, self._step, action)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(_PW_THREAD, self._close)


def make_browsergym_tasks(train_tasks: list[str], heldout_tasks: list[str], seeds_per_task: int = 2, seed: int = 0):
    """Like MiniWoB's splits: train tasks at seeds seed*1000+j; held-out tasks at those seeds plus each
    train task at an unseen seed (seed*1000+500). Visits each page once to record its goal and state."""
    plan = [("train", t, seed * 1000 + j) for t in train_tasks for j in range(seeds_per_task)]
    plan += [("heldout", t, seed * 1000 + j) for t in heldout_tasks for j in range(seeds_per_task)]
    plan += [("heldout", t, seed * 1000 + 500) for t in train_tasks]
    env = BrowserGymEnv()
    splits = TaskSplits()
    try:
        for split, env_id, s in plan:
            task = Task(task_id=f"browsergym/{env_id}/s{s}", instruction="", family=f"browsergym/{env_id}",
                        game_file=env_id, seed=s)
            state, _ = env.reset_sync(task)
            task.instruction, task.initial_state = env.goal, state
            task.meta = {"fields": [[k, v] for k, v in env.fields.items()],
                         "expert": env_id.partition(".")[2] in EXPERT_TASKS and env_id.startswith("miniwob.")}
            (splits.train if split == "train" else splits.heldout).append(task)
    finally:
        env.close_sync()
    return splits
