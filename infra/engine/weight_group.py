"""Weights over a process group: SGLang's `/init_weights_update_group` and `/update_weights_from_distributed`.

Owns both ends of a weight-update group, as slime, AReaL and verl use SGLang's:
- `join_sender`: the learner's end, rank 0. It hosts the rendezvous (a TCPStore at
  `master_address:master_port`) and builds the group exactly as SGLang's
  `init_custom_process_group` does (`tcp://` rendezvous, a `PrefixStore(group_name)`,
  torch's `_new_process_group_helper`), so a real SGLang server and the embedded
  engine join the same way; `broadcast_tensors` then sends each tensor from rank 0.
- the embedded engine's two routes (`add_routes`): `/init_weights_update_group` joins the
  group in a worker thread (rank `rank_offset`, gloo on the CPU) and answers once the
  group has formed; `/update_weights_from_distributed` receives the broadcast of each
  named tensor (`names`, `dtypes`, `shapes`, in that order), copies them into a copy of
  the live model and swaps it in between decode steps, as `/update_weights_from_disk`
  does, then reports `weight_version` (an int here; SGLang's is a string).

Request and answer shapes are SGLang's (`python/sglang/srt/managers/io_struct.py`:
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`, their outputs
`{success, message}`), pinned in tests/test_engine_contract.py.

Where it departs from SGLang: the embedded engine joins over gloo only (`backend` "nccl"
is refused with a 400: it serves on a CPU); its end of the group is built by hand with
the store layout torch's helper uses (`_receiver_backend`), because torch registers
groups by name per process and the learner and an embedded engine often share one (the
local runtime): two registrations of one name fail. `flush_cache` and
`abort_all_requests` are accepted and implied: a swap waits for running sequences and
empties the prefix cache. A group has no recovery of its own: a member that dies breaks
it, and the sender forms a new one (learner/weight_sync.py).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web
from torch.distributed import PrefixStore, TCPStore
from torch.distributed import distributed_c10d as c10d

from infra.engine.request import RequestError

log = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in `dtypes` ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


def _store(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float,
           group_name: str) -> PrefixStore:
    # SGLang's rendezvous: tcp://master_address:master_port, rank 0 the store's server, then a prefix per group
    store = TCPStore(master_address, master_port, world_size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    return PrefixStore(group_name, store)


@dataclass
class SenderGroup:
    """Rank 0's end of a weight-update group (`join_sender`)."""

    group: Any
    group_name: str
    world_size: int

    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Send each tensor from rank 0, in order; blocks until every rank has it."""
        for t in tensors:
            dist.broadcast(t.contiguous(), src=0, group=self.group)

    def close(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError, KeyError) as exc:  # a broken group: nothing more to release
            log.debug("weight group %s: %r on destroy", self.group_name, exc)


def join_sender(master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "gloo",
                timeout_s: float = 300.0) -> SenderGroup:
    """Host the rendezvous and join as rank 0 (the learner); returns once all `world_size` ranks joined."""
    store = _store(master_address, master_port, 0, world_size, timeout_s, group_name)
    group, _ = c10d._new_process_group_helper(world_size, 0, [], backend, store, group_name=group_name,
                                              timeout=datetime.timedelta(seconds=timeout_s))
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # as SGLang's helper: group rank = rank
    return SenderGroup(group, group_name, world_size)


def _receiver_backend(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      timeout_s: float):
    """A gloo member of the group `join_sender` makes, built as torch's `_new_process_group_helper` builds
    one for backend "gloo" (every device maps to gloo, so one backend, under the first device's
    `<group>/<device>/` store prefix, then the group's sequence number), without registering the name."""
    device = next(iter(c10d.BackendConfig("gloo").get_device_backend_map()))  # 'cpu'
    store = PrefixStore(f"{group_name}/", _store(master_address, master_port, rank, world_size, timeout_s, group_name))
    backend = dist.ProcessGroupGloo(PrefixStore(f"{device}/", store), rank, world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
    backend._set_sequence_number_for_group()
    return backend


def receive_tensors(backend, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """Receive one broadcast from rank 0 per name, into a new CPU tensor of its dtype and shape."""
    out = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=DTYPES[dt])
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        backend.broadcast([t], opts).wait()
        out[name] = t
    return out


def loaded_copy(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` with `tensors` (state-dict names) as its weights, cast to its dtype and device;
    ValueError naming the first unknown name or wrong shape (the live model is untouched).

    The received tensors become the copy's parameters (deepcopy's memo maps each old parameter to
    its new one), so a parameter is never copied twice; a weight tied to a sent one (SmolLM2's
    `lm_head`) is the same parameter and follows it, as in the model loaded from disk."""
    state = model.state_dict()
    for name, t in tensors.items():
        if name not in state:
            raise ValueError(f"the served model has no weight {name!r}")
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{name}: shape {list(t.shape)} sent, the served model has {list(state[name].shape)}")
    params = dict(model.named_parameters(remove_duplicate=False))
    memo: dict[int, Any] = {}
    for name, t in tensors.items():
        if name in params:
            old = params[name]
            memo[id(old)] = torch.nn.Parameter(t.to(device=old.device, dtype=old.dtype), requires_grad=old.requires_grad)
    new = copy.deepcopy(model, memo)
    buffers = [n for n in tensors if n not in params]  # persistent buffers, if a sender names any
    if buffers:
        new_state = new.state_dict()
        with torch.no_grad():
            for name in buffers:
                new_state[name].copy_(tensors[name])
    return new.eval()


def _fields(body: Any, required: dict[str, type], optional: dict[str, type]) -> dict:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    for key, kind in required.items():
        if key not in body:
            raise RequestError(f"{key!r} is required")
    for key, kind in {**required, **optional}.items():
        if key in body and body[key] is not None and not (isinstance(body[key], kind)
                                                          and not (kind is int and isinstance(body[key], bool))):
            raise RequestError(f"{key!r} must be {getattr(kind, '__name__', kind)}")
    return body


class WeightGroupRoutes:
    """The embedded engine's end: one group at a time (a new init replaces the old one)."""

    def __init__(self, engine: Any, timeout_s: float = 300.0):
        self.engine = engine  # infra.engine.server.EngineApp: its batcher, update lock and JSON parsing
        self.timeout_s = timeout_s  # a rendezvous or broadcast waiting longer than this fails the request
        self.backend = None
        self.group_name = ""

    async def init_group(self, request: web.Request) -> web.Response:
        body = _fields(await self.engine._json_body(request),
                       {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int},
                       {"group_name": str, "backend": str})
        name, backend = body.get("group_name") or DEFAULT_GROUP, body.get("backend") or "nccl"
        if backend != "gloo":
            raise RequestError(f"backend {backend!r}: the embedded engine joins weight-update groups over gloo only")
        rank, world = body["rank_offset"], body["world_size"]
        if not 0 < rank < world:
            raise RequestError(f"rank_offset {rank} must lie in [1, world_size={world}): rank 0 is the sender")
        try:
            self.backend = await asyncio.to_thread(_receiver_backend, body["master_address"], body["master_port"],
                                                   rank, world, name, self.timeout_s)
        except (RuntimeError, OSError, ValueError) as exc:
            self.backend = None
            return web.json_response({"success": False, "message": f"Failed to initialize custom process group: {exc}"},
                                     status=400)
        self.group_name = name
        log.info("joined weight-update group %s as rank %d of %d", name, rank, world)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update(self, request: web.Request) -> web.Response:
        body = _fields(await self.engine._json_body(request), {"names": list, "dtypes": list, "shapes": list},
                       {"group_name": str, "flush_cache": bool, "abort_all_requests": bool, "weight_version": str,
                        "load_format": str, "torch_empty_cache": bool})
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise RequestError("'names', 'dtypes' and 'shapes' must be non-empty lists of one length")
        if not all(isinstance(n, str) for n in names) or any(d not in DTYPES for d in dtypes) or not all(
                isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s) for s in shapes):
            raise RequestError(f"names are strings, dtypes among {sorted(DTYPES)}, shapes lists of sizes")
        if self.backend is None or (body.get("group_name") or DEFAULT_GROUP) != self.group_name:
            raise RequestError(f"no weight-update group {body.get('group_name') or DEFAULT_GROUP!r}: "
                               "call /init_weights_update_group first")
        batcher = self.engine.batcher
        version = batcher.weight_version + 1
        if body.get("weight_version") is not None:
            try:
                version = int(body["weight_version"])
            except ValueError:
                raise RequestError(f"'weight_version' must be an integer, got {body['weight_version']!r}") from None
        async with self.engine._update_lock:
            try:  # receive whatever is wrong with the names: the sender's broadcast must not hang
                tensors = await asyncio.to_thread(receive_tensors, self.backend, names, dtypes, shapes)
            except RuntimeError as exc:  # a member died or timed out: this group is broken
                self.backend = None
                return web.json_response({"success": False, "message": f"broadcast failed: {exc}"}, status=500)
            try:
                model = await asyncio.to_thread(loaded_copy, batcher.model, tensors)
            except ValueError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            await asyncio.wrap_future(batcher.swap_weights(model, version))
        return web.json_response({"success": True, "message": f"serving {len(names)} tensors from group "
                                  f"{self.group_name} as weight version {version}"})


def add_routes(engine: Any) -> WeightGroupRoutes:
    """Serve SGLang's two weight-group routes on `engine` (an EngineApp, before its app starts)."""
    routes = WeightGroupRoutes(engine)
    engine.app.add_routes([web.post("/init_weights_update_group", routes.init_group),
                           web.post("/update_weights_from_distributed", routes.update)])
    return routes
