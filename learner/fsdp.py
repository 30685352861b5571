"""The learner on several GPUs: FSDP2 ranks (`learner.num_gpus`), and the orders rank 0 gives them.

Owns what every rank holds and does, and the calls they make together; not the update
maths (learner/update.py, which every rank runs with its `RankShare`), nor the loop
(learner/learner.py, which is rank 0 and goes through `Ranks` wherever it would touch
the policy's weights), nor how the other ranks' processes start (a `RankLauncher`):

- Rank 0 is the learner's own process. Ranks 1..N-1 are started by a launcher: torch's
  elastic launcher on this node (learner/elastic_ranks.py, `dreamgym train` without Ray)
  or Ray actors placed by the `learner_gpu` label, possibly on other nodes
  (infra/run/cluster/learner_ranks.py, with `actors.runtime=ray`). Each runs `serve`.
  All meet in torch's own rendezvous (`init_process_group("tcp://<rank 0's host>:<free
  port>")`, the env:// contract torchrun and Ray Train use): NCCL on GPUs, gloo on the CPU
  (how tests/test_fsdp.py runs two ranks). Rank k computes on the device its launcher
  gives it (`cuda:<i+k>` of `learner.device=cuda:<i>` on one node; a Ray actor's own GPU).
- Orders travel over the process group itself (a gloo group beside NCCL's): rank 0
  broadcasts each as msgpack bytes (the batch as the wire schema's Trajectory bytes,
  infra/schema.py: no pickle crosses between ranks), every rank carries it out, and all
  answer in one all-reduce of their status (done, or non-finite). One channel for both
  launchers, and a rank that died breaks it at once: gloo's next collective with it fails.
- Every rank builds the policy as the learner does (`PolicyModel.for_learner`: the
  same weights from the same model directory, the KL reference copied before
  sharding), shards it with `fully_shard`, and keeps an AdamW and a WeightGuard over
  its shards.
- An update: rank 0 plans the batch (`update.plan`, so a batch that cannot train fails
  there, before any other rank starts, as an ordinary undone update), sends it, and
  every rank runs `update.apply_update` with its share: the micro-batches dealt round
  robin, a zero-weighted stand-in where a rank has one fewer (FSDP's collectives need
  the same forward/backward calls on every rank), each loss scaled by its share of the
  whole batch and the ranks' gradients summed (`set_gradient_divide_factor(1)`), so the
  gradient is the single-process one; `clip_grad_norm_` over FSDP's DTensor gradients
  clips by the global norm; the loss terms and the weights check are summed over the
  ranks, so all make the same non-finite decision and raise alike. The learner's guard
  snapshots and restores every rank's shard (`RanksGuard`).
- Weights out: publishing (`Ranks.save_hf`) and checkpoints (`Ranks.state`) gather the
  full state dict to rank 0 (`get_model_state_dict(full_state_dict, cpu_offload)`), in
  the single-process formats, so engines load it as before and a checkpoint resumes
  with any `learner.num_gpus`; on resume every rank reads the checkpoint file itself
  (`infra.run_dir` is one shared path on every node) and keeps its shard (`Ranks.load`).

Where it departs from the usual recipe (a unit per decoder layer, then the root): the
whole policy is one FSDP unit, with `forward_choice` registered as its forward. One
`forward_choice` calls the language model a data-dependent number of times (a padded
batch of lone prompts and one of packed trajectories; in score mode once per distinct
prompt), and a unit per layer all-gathers at every call, so two ranks on different
micro-batches issue different collectives and hang (units per layer on the score-mode
batch of tests/test_fsdp.py: gloo's 60 s timeout on a recv; one unit: the single-process
gradients to 3e-8). One unit all-gathers once per forward and once per backward, and
reduce-scatters once per backward, whatever the micro-batch holds: the master weights,
the gradients between micro-batches and AdamW's moments are sharded (1/N each); the
parameters and gradients inside one micro-batch's forward/backward are whole.

Failures, as errors rather than silent: `learner.lora_rank > 0` with N > 1 is a
ConfigError (publishing merges the adapter in one process). A rank that fails other than
non-finite (a bug, an out-of-memory, a kill) exits, which breaks the collectives; rank 0
then raises `RankFailure`, naming the rank and how it ended, and ends the others. The
learner cannot undo that update (the shards are out of step), so it restarts its ranks
from the last checkpoint (learner/learner.py). On NCCL a dead peer is noticed when the
collective times out (`TIMEOUT`), on gloo at once. Each rank loads the whole model before
sharding it, and with `kl_coef > 0` keeps a whole frozen reference copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable, Protocol, Sequence

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from infra.config import ConfigError, LearnerConfig
from infra.schema import Trajectory, decode_as, encode
from learner import checkpoint as ckpt
from learner.guard import NonFiniteUpdate, WeightGuard
from learner.policy_model import PolicyModel
from learner.precision import Precision, check_device
from learner.update import Unit, UpdateStats, apply_update, new_optimizer, plan

log = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(minutes=10)  # the ranks' rendezvous, or one collective, waiting longer fails
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU only
SCATTER = StateDictOptions(full_state_dict=True, strict=False)  # each rank keeps its shard of whole tensors
DONE, NONFINITE = 0.0, 1.0  # a rank's answer to an order


class RankFailure(RuntimeError):
    """A rank failed other than non-finite, or died: the ranks' collectives are out of step, so this
    update cannot be undone (the learner restarts its ranks from the last checkpoint)."""


class RankLauncher(Protocol):
    """Starts and ends ranks 1..N-1 of a learner whose rank 0 is this process (each runs `serve`)."""

    host: str  # the address the other ranks reach this process at (the rendezvous)

    def check(self, cfg: LearnerConfig) -> None:
        """ConfigError if `cfg`'s ranks cannot run where this launcher puts them."""

    def device(self, cfg: LearnerConfig, rank: int) -> str:
        """The device rank `rank` computes on (rank 0: this process's)."""

    def start(self, init: dict) -> None:
        """Start ranks 1..init['world']-1, each calling `serve(init, rank, device)`."""

    def failures(self) -> list[str]:
        """How each rank that ended ended (empty while all run); non-blocking."""

    def pids(self) -> dict[int, int]:
        """rank -> process id (tests kill one)."""

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to leave, then end those that did not."""


def check_ranks(cfg: LearnerConfig, one_node: bool = True) -> None:
    """ConfigError unless `learner.num_gpus` ranks can run: a fully fine-tuned policy and, with every rank on
    this node (`one_node`), as many CUDA devices from `learner.device` on."""
    n = cfg.num_gpus
    if n == 1:
        return
    if cfg.lora_rank > 0:
        raise ConfigError(f"learner.num_gpus={n} shards a fully fine-tuned policy; LoRA's adapter is merged in one "
                          f"process: set learner.lora_rank=0 or learner.num_gpus=1")
    if cfg.device.startswith("cuda") and one_node:
        check_device(cfg.device, "learner.device")
        first, count = torch.device(cfg.device).index or 0, torch.cuda.device_count()
        if first + n > count:
            raise ConfigError(f"learner.num_gpus={n} from learner.device={cfg.device} needs cuda:{first}.."
                              f"cuda:{first + n - 1}; this machine has {count} CUDA device(s)")


def rank_device(cfg: LearnerConfig, rank: int) -> str:
    return "cpu" if cfg.device == "cpu" else f"cuda:{(torch.device(cfg.device).index or 0) + rank}"


class RankShare:
    """One rank's `update.Share`: micro-batches dealt round robin, sums by all-reduce."""

    def __init__(self, rank: int, world: int, device: str):
        self.rank, self.world, self.device = rank, world, device

    def runs(self, chunks: Sequence[Sequence[int]]) -> list[tuple[Sequence[int], bool]]:
        mine = [(c, True) for c in chunks[self.rank::self.world]]
        calls = -(-len(chunks) // self.world)
        return mine + [(min(chunks, key=len), False)] * (calls - len(mine))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        out = values.to(self.device)
        dist.all_reduce(out)
        return out.cpu()

    def any(self, flag: bool) -> bool:
        return bool(self.sum(torch.tensor([float(flag)])).item() > 0)


def shard(policy: PolicyModel, world: int, device: str) -> RankShare:
    """Shard `policy` over the process group as one FSDP unit (see the module docstring); this rank's share."""
    mesh = init_device_mesh(torch.device(device).type, (world,))
    fully_shard(policy, mesh=mesh, reshard_after_forward=True)
    register_fsdp_forward_method(policy, "forward_choice")
    register_fsdp_forward_method(policy, "forward_tokens")  # generate mode (learner/token_logprobs.py)
    policy.set_gradient_divide_factor(1.0)  # summed, not averaged: each rank's losses carry their share
    policy.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return RankShare(dist.get_rank(), world, device)


def param_names(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by name, in its order (the index of a single-process state dict)."""
    name = {id(p): n for n, p in policy.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g["params"]]


def gather(policy: PolicyModel, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """Every rank: (model, optimizer by parameter name) state dicts with whole tensors on rank 0 (empty
    elsewhere); no optimizer state before AdamW's first step (DCP would make one with a zero step)."""
    model = get_model_state_dict(policy, options=GATHER)
    if optimizer is None or not optimizer.state:  # the same on every rank: all stepped, or none
        return model, None
    return model, get_optimizer_state_dict(policy, optimizer, options=GATHER)


def load_full(policy: PolicyModel, optimizer: torch.optim.Optimizer, payload: dict) -> None:
    """Every rank: a checkpoint's whole tensors (learner/checkpoint.py's format) into its shards."""
    set_model_state_dict(policy, dict(payload["model"]), options=SCATTER)
    saved = payload.get("optimizer")
    if saved is None:
        return
    if not saved["state"]:  # saved before AdamW's first step: none here either
        optimizer.state.clear()
        return
    names = param_names(policy, optimizer)
    by_name = {"state": {names[i]: s for i, s in saved["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(policy, optimizer, by_name, options=SCATTER)


def encode_units(units: Sequence[Unit]) -> list[dict]:
    return [{"trajs": [encode(t) for t in u.trajs],
             "advantages": [float(a) for a in u.advantages] if u.advantages is not None else None,
             "corrected": [bool(c) for c in u.corrected]} for u in units]


def decode_units(raw: list[dict]) -> list[Unit]:
    return [Unit([decode_as(b, Trajectory) for b in u["trajs"]], u["advantages"], u["corrected"]) for u in raw]


def free_port(host: str) -> int:
    """A port free on `host` now, for the rendezvous (the way torchrun and Ray Train pick theirs)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join(init: dict, rank: int) -> Any:
    """Join the ranks' process group (torch's TCP rendezvous at rank 0's host); the group orders go over."""
    backend = init["backend"]
    dist.init_process_group(backend, init_method=f"tcp://{init['addr']}:{init['port']}", rank=rank,
                            world_size=init["world"], timeout=TIMEOUT)
    # Orders are bytes on the CPU: beside NCCL they travel over a gloo group of the same ranks.
    return dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else dist.group.WORLD


def broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """Rank 0's `data` on every rank of `group` (others pass None): its length, then its bytes."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None \
        else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group)
    return buf.numpy().tobytes()


def answer(status: float, group: Any) -> list[float]:
    """Every rank's answer to the last order (DONE or NONFINITE), on every rank."""
    out = torch.zeros(dist.get_world_size(group))
    out[dist.get_rank(group)] = status
    dist.all_reduce(out, group=group)
    return out.tolist()


class Ranks:
    """Rank 0's side: the launcher of the others, and the calls every rank makes together."""

    def __init__(self, policy: PolicyModel, share: RankShare, launcher: RankLauncher, control: Any):
        self.policy, self.share, self.launcher, self.control = policy, share, launcher, control
        self._end = weakref.finalize(self, launcher.stop, 0.0)  # at interpreter exit at the latest
        self._lock = threading.Lock()  # one order at a time: the update, publish and checkpoint threads

    @classmethod
    def start(cls, cfg: LearnerConfig, model_name: str, policy: PolicyModel, launcher: RankLauncher) -> Ranks:
        """Start ranks 1..N-1 with `launcher`, join them in a process group and shard `policy` (rank 0's,
        built from `model_name`); RankFailure if a rank ends before every rank is up."""
        launcher.check(cfg)
        n, device = cfg.num_gpus, launcher.device(cfg, 0)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        init = {"world": n, "addr": launcher.host, "port": free_port(launcher.host), "model": model_name,
                "cfg": dataclasses.asdict(cfg), "backend": _backend(device)}
        launcher.start(init)
        try:
            control = _watched(lambda: join(init, 0), launcher, "joining the process group")
            try:
                ranks = cls(policy, shard(policy, n, device), launcher, control)
            finally:
                forget_sharding_cache()
            # every rank loaded and sharded its policy: they answer once
            if _watched(lambda: answer(DONE, control), launcher, "loading the policy") != [DONE] * n:
                raise RankFailure("a rank did not start")
        except BaseException:
            launcher.stop(0.0)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        log.info("learner: %d FSDP ranks on %s", n, ", ".join(launcher.device(cfg, k) for k in range(n)))
        return ranks

    def update(self, policy: PolicyModel, optimizer: torch.optim.Optimizer, cfg: LearnerConfig,
               units: Sequence[Unit], version: int) -> UpdateStats:
        """`update.apply_update` on every rank, each with its share of the micro-batches."""
        # A batch that cannot train raises here, before any other rank starts: an ordinary undone update.
        plan(units, cfg, self.policy.lm.config.vocab_size)
        return self.call({"op": "update", "units": encode_units(units), "version": version},
                         lambda: apply_update(policy, optimizer, cfg, units, version, self.share))

    def call(self, order: dict, local: Callable[[], Any]) -> Any:
        """Give every other rank `order`, run `local` here meanwhile, collect their answers; `local`'s result.
        NonFiniteUpdate when every rank found the same non-finite value, RankFailure on anything else."""
        with self._lock:
            try:
                broadcast_bytes(msgpack.packb(order, use_bin_type=True), self.control)
                with self._device():
                    try:
                        out, status, raised = local(), DONE, None
                    except NonFiniteUpdate as exc:  # every rank decided alike: all answer so
                        out, status, raised = None, NONFINITE, exc
                    finally:
                        forget_sharding_cache()
                said = answer(status, self.control)
            except Exception as exc:
                raise self._failed(f"rank 0: {type(exc).__name__}: {exc}") from exc
            if any(s != status for s in said):
                raise self._failed(f"ranks answered {said} to {order['op']!r}, rank 0 {status}")
            if raised is not None:
                raise raised
        return out

    def save_hf(self, path: str | os.PathLike, dtype: str = "float32") -> Any:
        """The publisher's call (learner/weights.py): the gathered weights as a Hugging Face directory."""
        model, _ = self.call({"op": "gather", "optimizer": False}, lambda: gather(self.policy, None))
        return self.policy.save_hf(path, lm_state={k[3:]: v for k, v in model.items() if k.startswith("lm.")},
                                   dtype=dtype)

    def state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(trainable weights, optimizer state dict) for learner/checkpoint.save, as one process saves them."""
        model, optim = self.call({"op": "gather", "optimizer": True}, lambda: gather(self.policy, optimizer))
        names = param_names(self.policy, optimizer)
        if optim is None:
            return {n: model[n] for n in names}, optimizer.state_dict()  # no state yet: nothing sharded in it
        index = {n: i for i, n in enumerate(names)}
        return ({n: model[n] for n in names},
                {"state": {index[n]: s for n, s in optim["state"].items()},
                 "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]]})

    def load(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer) -> ckpt.TrainState:
        """Restore a checkpoint on every rank (each reads the file); rank 0 takes its RNG and train state."""
        payload = ckpt.read(path)  # unreadable: CheckpointError here, before any rank is told
        self.call({"op": "load", "path": str(path)}, lambda: load_full(self.policy, optimizer, payload))
        ckpt.set_rng_state(payload["rng"])
        return ckpt.train_state(payload)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (a later learner in this process makes its own)."""
        if not self._end.alive:
            return
        try:
            with self._lock:
                broadcast_bytes(msgpack.packb({"op": "stop"}), self.control)
        except Exception:  # a rank is gone already: the launcher ends the rest
            pass
        self._end.detach()
        self.launcher.stop(20.0)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _device(self) -> contextlib.AbstractContextManager:
        """Rank 0's GPU as the current device of the calling thread (the update thread, a publish or
        checkpoint thread), which CUDA keeps per thread; nothing on the CPU."""
        device = self.share.device
        return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()

    def _failed(self, what: str) -> RankFailure:
        """The ranks are out of step: say how the others ended, end them, leave the group; the error to raise."""
        said: list[str] = []
        end = time.monotonic() + 5.0
        while not said and time.monotonic() < end:  # a killed rank's exit reaches its launcher a moment later
            said = self.launcher.failures()
            time.sleep(0.1)
        self._end.detach()
        self.launcher.stop(0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        return RankFailure(f"FSDP learner ranks failed ({'; '.join([what, *said])})")


def forget_sharding_cache() -> None:
    """Empty this thread's DTensor sharding-propagation cache (torch keeps one per thread, in the thread's
    state). Its entries hold the device mesh and so the gloo/NCCL process group: left in an idle thread
    (the calls run on asyncio.to_thread's executor threads), they outlive `close()`, and a later fork
    (subprocess with a preexec_fn, as Ray starts its GCS) clears that thread's state in the child, runs the
    group's destructor there and hangs or segfaults before exec. Measured in the test suite: Ray's GCS
    child died with SIGSEGV (backtrace: PyOS_AfterFork_Child -> PyThreadState_Clear ->
    get_thread_local_native_sharding_propagator_cache -> ~ProcessGroupGloo) and every later ray.init in
    that process timed out. The cost: each call's first use of an op recomputes its sharding."""
    torch._C._clear_DTensor_sharding_propagator_cache()


def _watched(call: Callable[[], Any], launcher: RankLauncher, what: str) -> Any:
    """`call()` (a collective of rank 0 with ranks still starting) while watching them: RankFailure as soon
    as one has ended, instead of waiting out the rendezvous timeout for a rank that will never come."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = call()
        except BaseException as exc:
            box["error"] = exc
    thread = threading.Thread(target=run, name="learner-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        failed = launcher.failures()
        if failed and thread.is_alive():
            raise RankFailure(f"FSDP learner ranks failed while {what}: {'; '.join(failed)}")
    if "error" in box:
        failed = launcher.failures()
        raise RankFailure(f"FSDP learner ranks failed while {what}: "
                          f"{'; '.join([repr(box['error']), *failed])}") from box["error"]
    return box["out"]


class RanksGuard:
    """learner/guard.WeightGuard on every rank: each snapshots and restores its own shard."""

    def __init__(self, ranks: Ranks, local: WeightGuard):
        self.ranks, self.local = ranks, local

    def snapshot(self) -> None:
        self.ranks.call({"op": "snapshot"}, self.local.snapshot)

    def restore(self) -> None:
        self.ranks.call({"op": "restore"}, self.local.restore)


def serve(init: dict, rank: int, device: str) -> None:
    """A rank k > 0 (any launcher's): join the group, build and shard the policy, then carry out rank 0's
    orders until it says stop. Any error but a non-finite update propagates: the caller exits the process,
    which breaks the collectives, so rank 0 fails at once instead of waiting in one."""
    cfg = LearnerConfig(**init["cfg"])
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.nice > 0:
        try:
            os.nice(cfg.nice)  # the whole rank process: rank 0's update thread takes the same niceness
        except OSError as exc:
            log.warning("learner.nice=%d not applied on FSDP rank %d: %s", cfg.nice, rank, exc)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    control = join(init, rank)
    policy = PolicyModel.for_learner(cfg, init["model"], Precision(device, cfg.dtype))
    share = shard(policy, init["world"], device)
    optimizer = new_optimizer(policy, cfg)
    guard = WeightGuard(policy.trainable_parameters(), optimizer)
    answer(DONE, control)  # up
    while True:
        order = msgpack.unpackb(broadcast_bytes(None, control), raw=False)
        op = order["op"]
        if op == "stop":
            dist.destroy_process_group()
            return
        status = DONE
        try:
            if op == "update":
                apply_update(policy, optimizer, cfg, decode_units(order["units"]), order["version"], share)
            elif op == "snapshot":
                guard.snapshot()
            elif op == "restore":
                guard.restore()
            elif op == "gather":
                gather(policy, optimizer if order["optimizer"] else None)
            elif op == "load":
                load_full(policy, optimizer, ckpt.read(order["path"]))
            else:
                raise ValueError(f"unknown order {op!r}")
        except NonFiniteUpdate:
            status = NONFINITE
        answer(status, control)
