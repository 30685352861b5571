"""The learner's end of `learner.weight_sync=distributed`: new weights broadcast to the policy engines.

Owns the process group between the learner (rank 0) and the policy engines (ranks 1..N),
formed through SGLang's `/init_weights_update_group` the first time a version is
published, and each version's transfer: the policy's Hugging Face weights (LoRA merged,
in `learner.publish_dtype`), named as a checkpoint names them, announced with
`/update_weights_from_distributed` (names, dtypes, shapes, weight_version) while this
process broadcasts them one by one. The engines answer once they serve the new version,
so versions and staleness work as with the disk (learner/weights.py): an engine reports
the version it serves. How slime, AReaL and verl feed SGLang, without the shared disk.

Choices:
- a weight tied to an earlier one (SmolLM2's `lm_head` is its embedding) is sent once:
  the engine's model ties them too (a fifth of SmolLM2's bytes);
- the group's address is `learner.weight_sync_host`, or the address of this machine's
  interface that routes to the first engine (loopback when every engine is local), on a
  free port; its backend `learner.weight_sync_backend` (auto: NCCL from a CUDA learner,
  else gloo: the embedded engine's);
- a failed transfer (an engine gone, a refusal, a timeout of `engines.request_timeout_s`)
  abandons the group: the publish fails as a disk publish does (the learner keeps
  training, the engines keep their version) and the next one forms a new group with
  every engine, a restarted one included. A restarted engine serves its old version
  until that next publish (the disk path pushes it at once).
- learner ranks (`learner.num_gpus` > 1) have no gathered state to hand out in this
  process: their weights are gathered into a local temporary directory (`save_hf`) and
  read back before the broadcast; no shared filesystem is involved.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import socket
import tempfile
import threading
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
from safetensors.torch import load_file

from infra.config import Config
from infra.engine.client import EngineError
from infra.engine.weight_group import SenderGroup, dtype_name, join_sender

_groups = itertools.count()


def hf_state(policy: Any, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The weights `policy.save_hf` would write, by name, in `dtype`, each tied weight once (CPU tensors)."""
    lm = getattr(policy, "lm", None)
    if lm is None:  # FSDP ranks: only their gathered save exists here
        with tempfile.TemporaryDirectory(prefix="dreamgym-sync-") as tmp:
            policy.save_hf(tmp, dtype=dtype)
            state: dict[str, torch.Tensor] = {}
            for f in sorted(os.listdir(tmp)):
                if f.endswith(".safetensors"):
                    state.update(load_file(os.path.join(tmp, f)))
            return state
    merged = copy.deepcopy(lm).merge_and_unload() if getattr(policy, "lora_rank", 0) > 0 else lm
    cast = getattr(torch, dtype)
    seen: set[int] = set()
    out = {}
    for name, t in merged.state_dict().items():
        ptr = t.data_ptr()
        if ptr in seen:
            continue  # tied to a weight already sent
        seen.add(ptr)
        t = t.detach()
        out[name] = (t.to(cast) if t.is_floating_point() else t).to("cpu").contiguous()
    return out


def reachable_address(urls: list[str]) -> str:
    """This machine's address as the engines at `urls` see it: loopback if all are local, else the
    interface that routes to the first remote one (no packet is sent: a UDP socket only picks the route)."""
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    remote = [h for h in hosts if h not in ("127.0.0.1", "localhost", "::1")]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        return s.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` in a daemon thread of its own, as a future of this loop: a collective left blocked by a
    failed peer ends at the group's timeout without holding up the loop's executor or the process's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable[[], Any]) -> None:
        try:
            loop.call_soon_threadsafe(lambda: future.done() or outcome())
        except RuntimeError:  # the loop has closed: nobody waits for this any more
            pass

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting side)
            settle(lambda: future.set_exception(exc))
        else:
            settle(lambda: future.set_result(result))

    threading.Thread(target=run, name=f"weight-sync-{fn.__name__}", daemon=True).start()
    return future


class DistributedSync:
    """Publishes versions over a weight-update group with the engines behind `client` (an EngineClient)."""

    def __init__(self, client: Any, *, backend: str = "gloo", host: str = "", timeout_s: float = 300.0,
                 dtype: str = "float32", ranks_per_server: int = 1):
        self.client, self.backend, self.host, self.timeout_s, self.dtype = client, backend, host, timeout_s, dtype
        self.ranks_per_server = ranks_per_server  # an SGLang server joins one rank per tensor-parallel GPU
        self.group: SenderGroup | None = None

    async def send(self, policy: Any, version: int) -> None:
        """Broadcast `policy`'s weights as `version`; returns when every engine serves it (EngineError if not)."""
        state = await asyncio.to_thread(hf_state, policy, self.dtype)
        if self.group is None:
            await self._form()
        group = self.group
        names, tensors = list(state), list(state.values())
        announce = asyncio.ensure_future(self.client.update_weights_from_distributed(
            names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], group.group_name, version))
        await self._together(announce, in_daemon_thread(group.broadcast_tensors, tensors), f"weights v{version}")

    async def _form(self) -> None:
        host = self.host or reachable_address(self.client.urls)
        port = free_port(host)
        name = f"dreamgym-weights-{os.getpid()}-{next(_groups)}"
        world = 1 + len(self.client.urls) * self.ranks_per_server
        invite = asyncio.ensure_future(self.client.init_weights_update_group(host, port, name, self.backend,
                                                                             self.ranks_per_server))
        join = in_daemon_thread(join_sender, host, port, world, name, self.backend, self.timeout_s)
        await self._together(invite, join, f"the weight-update group at {host}:{port}")
        self.group = join.result()

    async def _together(self, http: asyncio.Future, local: asyncio.Future, what: str) -> None:
        """Wait for the engines' answers and this process's side of the collective; the first failure
        abandons the group (a thread still blocked in it ends at the group's timeout) and raises EngineError."""
        done, _ = await asyncio.wait({http, local}, return_when=asyncio.FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if not failed:
            return
        group, self.group = self.group, None
        if group is not None and local.done():
            group.close()
        for f in (http, local):
            if not f.done():
                f.add_done_callback(lambda f: f.exception())  # retrieved later; never "never retrieved"
        exc = failed[0].exception()
        raise EngineError(f"{what}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def distributed_sync(cfg: Config, policy_engines: Any, dtype: str) -> DistributedSync | None:
    """The run's sync with `learner.weight_sync=distributed` and policy engines to send to; else None (disk)."""
    lc = cfg.learner
    if lc.weight_sync != "distributed" or policy_engines is None:
        return None
    backend = lc.weight_sync_backend if lc.weight_sync_backend != "auto" else \
        ("nccl" if lc.device.startswith("cuda") else "gloo")
    e = cfg.engines
    sglang = bool(e.policy_endpoints) or e.launch == "sglang"  # listed servers: SGLang, or `dreamgym serve` (TP 1)
    return DistributedSync(policy_engines, backend=backend, host=lc.weight_sync_host, timeout_s=e.request_timeout_s,
                           dtype=dtype, ranks_per_server=e.sglang_tp_size if sglang else 1)
