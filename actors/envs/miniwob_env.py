"""MiniWoB++ behind the one text interface, in headless Chromium.

Owns the browser lifecycle, the page-to-abstract-state mapping, the element-diff
rationale and the scripted expert for a subset of tasks.

- Browser: miniwob's own Selenium instance, with Debian's chromium and chromedriver
  (`MINIWOB_CHROME_BINARY`, `MINIWOB_CHROMEDRIVER`). miniwob takes no Chrome flags, so
  the `webdriver` module it uses is replaced by a shim whose `ChromeOptions()` adds
  the headless/no-network flags and a fresh `--user-data-dir` (removed on close).
  One browser per environment (~200 MB); switching task family reopens it.
- Episode timer: `core.EPISODE_MAX_TIME` is lifted before every reset (slow LLM
  agents otherwise fail by timeout); rewards are miniwob's raw reward, mapped to the
  outcome reward 1.0 on success, else 0.0.
- State: `Task: <utterance>`, then `[ref] tag 'text'` / `[ref] input_text #id value="…"`
  for clickable or typeable elements and leaf elements that carry text (text nodes
  are folded into their element or checkbox label). Actions: `click [ref]`,
  `type [ref] "text"`. Candidates: click for clickable items, type for typeable
  ones with each of the task's field values.
- Expert: `expert_action(subdomain, fields, items, history)` solves click-test,
  click-button, click-link, click-tab, click-dialog, focus-text, enter-text,
  enter-password, login-user, click-checkboxes, click-option, click-button-sequence
  from the task's fields and the current page (so the noisy expert recovers).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from actors.dataset import TaskSplits
from actors.envs.base import (TYPEABLE_TAGS, AbstractState, ActionFormatError, EpisodeBookkeeping, StepResult,
                              candidate_actions, parse_action)
from infra.metrics import ENV_RESETS
from infra.schema import Task

CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage")
USER_DATA_PREFIX = "dreamgym-chrome-"
BROWSER_MB = 200  # one extra browser's memory, for sizing pools (measured: 170-190 MB PSS each)
CLICKABLE = {"button", "a", "span", "div", "p", "label", "li", "td", "option", "select", "img", "h1", "h2", "h3",
             "input_checkbox", "input_radio", "input_submit", "input_button", "tab"}
MAX_ITEMS = 40
SOLVED_TASKS = ("click-test", "click-button", "click-link", "click-tab", "click-dialog", "focus-text", "enter-text",
                "enter-password", "login-user", "click-checkboxes", "click-option", "click-button-sequence")

_live_dirs: set[str] = set()
_install_lock = threading.Lock()
_installed = False


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _live_dirs.discard(path)


atexit.register(lambda: [_remove_dir(d) for d in list(_live_dirs)])


def _install_chrome_shim() -> None:
    """Point miniwob at Debian's browser with our flags (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        os.environ.setdefault("MINIWOB_CHROME_BINARY", "/usr/bin/chromium")
        os.environ.setdefault("MINIWOB_CHROMEDRIVER", "/usr/bin/chromedriver")
        from miniwob import selenium_instance  # the browser stack: MiniWoB only
        from selenium import webdriver  # the browser stack: MiniWoB only

        class _WebdriverShim:
            Chrome = webdriver.Chrome

            @staticmethod
            def ChromeOptions():  # noqa: N802 (mirrors selenium's name)
                opts = webdriver.ChromeOptions()
                for flag in CHROME_FLAGS:
                    opts.add_argument(flag)
                d = tempfile.mkdtemp(prefix=USER_DATA_PREFIX)
                _live_dirs.add(d)
                opts.add_argument(f"--user-data-dir={d}")
                return opts

        selenium_instance.webdriver = _WebdriverShim
        _installed = True


@dataclass
class Item:
    ref: int
    tag: str
    text: str
    id: str
    value: Any
    classes: str

    def checked(self) -> bool:
        return self.value is True or str(self.value).lower() in ("true", "checked")

    def render(self) -> str:
        out = self.tag
        if self.text:
            out += f" '{self.text}'"
        if self.id and (not self.text or self.tag in TYPEABLE_TAGS):
            out += f" #{self.id}"
        if self.tag in TYPEABLE_TAGS and self.value:
            out += f' value="{self.value}"'
        if self.tag in ("input_checkbox", "input_radio") and self.checked():
            out += " (checked)"
        return out


def page_items(dom_elements: Any) -> list[Item]:
    """The actionable and text-bearing elements of a page, in document order."""
    elems = list(dom_elements)
    texts: dict[int, list[str]] = {}
    for e in elems:  # text nodes (negative refs) carry the words of their parent element
        if int(e["ref"]) < 0 and str(e["text"]).strip():
            texts.setdefault(int(e["parent"]), []).append(" ".join(str(e["text"]).split()))
    items = []
    for e in elems:
        ref, tag = int(e["ref"]), str(e["tag"])
        if ref <= 0 or tag in ("body", "t"):
            continue
        text = " ".join(str(e["text"] or "").split()) or " ".join(texts.get(ref, []))
        if tag in ("input_checkbox", "input_radio") and not text:
            text = " ".join(texts.get(int(e["parent"]), []))  # <label><input> word</label>
        leaf = bool(e["flags"][3])
        if tag in TYPEABLE_TAGS or tag in ("button", "a", "input_checkbox", "input_radio", "input_submit", "select") \
                or (tag in CLICKABLE and text and (leaf or ref in texts)):
            items.append(Item(ref, tag, text[:60], str(e["id"] or ""), e["value"], str(e["classes"] or "")))
    return items[:MAX_ITEMS]


def page_candidates(items: list[Item], type_values: list[str]) -> list[str]:
    """base.candidate_actions, plus a click on each typeable element (focusing is an action too)."""
    values = list(dict.fromkeys(type_values))
    out = []
    for it in items:
        if it.tag in TYPEABLE_TAGS:
            out.append(f"click [{it.ref}]")
        out += candidate_actions(AbstractState("", [(it.ref, it.render())]), values)
    return out


def render_page(utterance: str, items: list[Item], status: str = "") -> str:
    desc = f"Task: {' '.join(str(utterance).split())}"
    if status:
        desc += f"\nStatus: {status}"
    if not items:  # a page with nothing on it still needs one item to be a valid state
        items = [Item(1, "body", "(empty page)", "", None, "")]
    return AbstractState(desc, [(it.ref, it.render()) for it in items]).render()


def dom_rationale(action: str, before: list[Item], after: list[Item], done: bool, won: bool) -> str:
    """The element diff of a step, e.g. 'type [7] "kenda": #username value now "kenda"'."""
    b, a = {i.ref: i for i in before}, {i.ref: i for i in after}
    changes = []
    for ref, it in a.items():
        old = b.get(ref)
        if old is None:
            changes.append(f"[{ref}] {it.tag} appeared")
        elif it.value != old.value:
            name = f"#{it.id}" if it.id else f"[{ref}] {it.tag}"
            if it.tag in ("input_checkbox", "input_radio"):
                changes.append(f"{name} '{it.text}' now {'checked' if it.checked() else 'unchecked'}")
            else:
                changes.append(f'{name} value now "{it.value}"')
        elif it.text != old.text:
            changes.append(f"[{ref}] text now '{it.text}'")
    gone = [f"[{r}] {i.tag}" for r, i in b.items() if r not in a]
    if gone and not done:
        changes.append("gone: " + ", ".join(gone[:4]))
    if done:
        changes.append("the task is complete" if won else "the episode ended without success")
    return f"{action}: " + ("; ".join(changes[:6]) if changes else "nothing on the page changed")


def _find(items: list[Item], tag: str | tuple[str, ...], text: str | None = None) -> Item | None:
    tags = (tag,) if isinstance(tag, str) else tag
    for it in items:
        if it.tag in tags and (text is None or it.text == text):
            return it
    return None


def expert_action(subdomain: str, fields: dict[str, str], items: list[Item], history: list[str]) -> str | None:
    """The scripted solver's next action for the tasks in SOLVED_TASKS; None elsewhere."""
    target = fields.get("target", "")
    submit = _find(items, "button", "Submit") or _find(items, "button") or _find(items, "input_submit")

    def click(it: Item | None) -> str | None:
        return f"click [{it.ref}]" if it else None

    def fill(it: Item | None, value: str) -> str | None:
        return f'type [{it.ref}] "{value}"' if it and str(it.value or "") != value else None

    if subdomain == "click-test":
        return click(_find(items, "button"))
    if subdomain == "click-button":
        return click(_find(items, "button", target))
    if subdomain == "click-link":
        return click(_find(items, ("span", "a"), target))
    if subdomain == "click-tab":
        return click(_find(items, "a", f"Tab #{target}"))
    if subdomain == "click-dialog":
        return click(next((i for i in items if i.tag == "button" and ("close" in i.text.lower() or "close" in i.classes)), None))
    if subdomain == "focus-text":
        return click(_find(items, "input_text"))
    if subdomain == "enter-text":
        return fill(_find(items, "input_text"), target) or click(submit)
    if subdomain == "enter-password":
        for it in items:
            if it.tag == "input_password" and str(it.value or "") != target:
                return fill(it, target)
        return click(submit)
    if subdomain == "login-user":
        user = next((i for i in items if i.id == "username"), None)
        pw = next((i for i in items if i.id == "password"), None)
        return fill(user, fields.get("username", "")) or fill(pw, fields.get("password", "")) or click(submit)
    if subdomain in ("click-checkboxes", "click-option"):
        wanted = {v for k, v in fields.items() if k.startswith("target")}
        box = "input_checkbox" if subdomain == "click-checkboxes" else "input_radio"
        for it in items:
            if it.tag == box and (it.text in wanted) != it.checked():
                return click(it)
        return click(submit)
    if subdomain == "click-button-sequence":
        one, two = _find(items, "button", "ONE"), _find(items, "button", "TWO")
        return click(two) if one and f"click [{one.ref}]" in history else click(one)
    return None


def browsers_that_fit(reserve_mb: int = 2048) -> int:
    """How many ~BROWSER_MB browsers the available memory holds after `reserve_mb` (at least 1)."""
    try:
        with open("/proc/meminfo") as fh:
            avail_kb = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 1
    return max(1, (avail_kb // 1024 - reserve_mb) // BROWSER_MB)


def subdomain_of(task: Task) -> str:
    name = task.game_file or task.family
    name = name.split("/", 1)[1] if "/" in name else name
    return re.sub(r"-v\d+$", "", name)


class MiniWoBEnv(EpisodeBookkeeping):
    """One headless browser; `reset(task)` opens `task.game_file` (e.g. 'miniwob/login-user-v1') with `task.seed`."""

    family = "miniwob"

    def __init__(self, max_steps: int = 20):
        self.max_steps = max_steps
        self._env = None
        self._subdomain = ""
        self.user_data_dir = ""
        self.items: list[Item] = []
        self.utterance = ""
        self.fields: dict[str, str] = {}
        self.state = ""
        self.history: list[str] = []
        self.steps = 0
        self.invalid = 0
        self.done = True
        self.won = False

    # --- browser -----------------------------------------------------------
    def _open(self, subdomain: str) -> None:
        if self._env is not None and subdomain == self._subdomain:
            return
        self.close_sync()
        _install_chrome_shim()
        import gymnasium as gym  # the page env: only when a page opens
        import miniwob  # the page env: its gym ids
        from miniwob.reward import get_raw_reward  # the page env: only when a page opens

        gym.register_envs(miniwob)
        self._env = gym.make(f"miniwob/{subdomain}-v1", reward_processor=get_raw_reward)
        self._subdomain = subdomain
        try:
            caps = self._env.unwrapped.instance.driver.capabilities
            self.user_data_dir = (caps.get("chrome") or {}).get("userDataDir", "")
        except Exception:
            self.user_data_dir = ""

    @property
    def browser_pid(self) -> int | None:
        """The chromedriver process id (its children are the browser)."""
        try:
            return self._env.unwrapped.instance.driver.service.process.pid
        except Exception:
            return None

    # --- sync core -----------------------------------------------------------
    def _info(self, valid: bool, **extra: Any) -> dict[str, Any]:
        return self._book_info(page_candidates(self.items, list(self.fields.values())), valid,
                               lambda: expert_action(self._subdomain, self.fields, self.items, self.history), **extra)

    def reset_sync(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._open(subdomain_of(task))
        # The page's 10 s episode timer turns slow-but-correct answers into failures.
        self._env.unwrapped.instance.driver.execute_script("core.EPISODE_MAX_TIME = 3600*1000;")
        obs, _ = self._env.reset(seed=int(task.seed), options={"record_screenshots": False})
        self.utterance = str(obs["utterance"])
        self.fields = {str(k): str(v) for k, v in obs["fields"]}
        self.items = page_items(obs["dom_elements"])
        self.history = []
        self._begin()
        self.state = render_page(self.utterance, self.items)
        ENV_RESETS.labels(family="miniwob").inc()
        return self.state, self._info(True)

    def _invalid(self, action: str, reason: str) -> StepResult:
        return self._refuse(self.state, action, reason)

    def step_sync(self, action: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return self._over(self.state, action)
        self._count_step()
        try:
            act = parse_action(action)
        except ActionFormatError as exc:
            return self._invalid(str(action), str(exc))
        target = next((it for it in self.items if it.ref == act.ref), None)
        if act.kind not in ("click", "type"):
            return self._invalid(action, "expected click [n] or type [n] \"text\"")
        if target is None:
            return self._invalid(action, f"no element [{act.ref}] on the page")
        if act.kind == "type" and target.tag not in TYPEABLE_TAGS:
            return self._invalid(action, f"[{act.ref}] {target.tag} does not take text")
        u = self._env.unwrapped
        if act.kind == "click":
            raw = u.create_action("CLICK_ELEMENT", ref=act.ref)
        else:
            raw = u.create_action("FOCUS_ELEMENT_AND_TYPE_TEXT", ref=act.ref, text=act.text)
        obs, reward, terminated, truncated_env, _info = self._env.step(raw)
        before = self.items
        self.history.append(action.strip())
        ended = bool(terminated or truncated_env)
        truncated = self._end_step(ended and float(reward) > 0, ended)
        if ended:
            status = "done, success" if self.won else "done, failure"
            self.state = render_page(self.utterance, before, status)
            rationale = dom_rationale(action, before, before, True, self.won)
        else:
            self.items = page_items(obs["dom_elements"])
            self.state = render_page(self.utterance, self.items)
            rationale = dom_rationale(action, before, self.items, False, False)
        return StepResult(self.state, self._outcome(), self.done,
                          self._info(True, truncated=truncated, rationale=rationale, raw_reward=float(reward)))

    def close_sync(self) -> None:
        env, self._env, self._subdomain = self._env, None, ""
        if env is not None:
            try:
                env.close()
            except Exception:
                pass
        if self.user_data_dir:
            _remove_dir(self.user_data_dir)
            self.user_data_dir = ""

    # --- the async Environment interface ---------------------------------------
    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return await asyncio.to_thread(self.reset_sync, task)

    async def step(self, action: str) -> StepResult:
        return await asyncio.to_thread(self.step_sync, action)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)


def make_miniwob_tasks(train_tasks: list[str], heldout_tasks: list[str], seeds_per_task: int = 3, seed: int = 0):
    """Train: each train task at seeds seed*1000+j; held-out: the held-out tasks at those seeds
    plus each train task at one unseen seed (seed*1000+500). Visits each page once to record
    the utterance, fields and initial state."""
    plan = [("train", t, seed * 1000 + j) for t in train_tasks for j in range(seeds_per_task)]
    plan += [("heldout", t, seed * 1000 + j) for t in heldout_tasks for j in range(seeds_per_task)]
    plan += [("heldout", t, seed * 1000 + 500) for t in train_tasks]
    env = MiniWoBEnv()
    splits = TaskSplits()
    try:
        for split, sub, s in sorted(plan, key=lambda p: p[1]):  # one browser per task family
            task = Task(task_id=f"miniwob/{sub}/s{s}", instruction="", family=f"miniwob/{sub}",
                        game_file=f"miniwob/{sub}-v1", seed=s)
            state, _ = env.reset_sync(task)
            task.instruction, task.initial_state = env.utterance, state
            task.meta = {"fields": [[k, v] for k, v in env.fields.items()], "expert": sub in SOLVED_TASKS}
            (splits.train if split == "train" else splits.heldout).append(task)
    finally:
        env.close_sync()
    order = {(sub, s): i for i, (_, sub, s) in enumerate(plan)}
    splits.train.sort(key=lambda t: order[(subdomain_of(t), t.seed)])
    splits.heldout.sort(key=lambda t: order[(subdomain_of(t), t.seed)])
    return splits
