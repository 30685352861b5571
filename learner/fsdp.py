"""The learner on several GPUs of one node: FSDP2 ranks (`learner.num_gpus`).

Owns the ranks of a learner with `learner.num_gpus` = N > 1: starting and ending them,
what every rank holds, and the orders rank 0 gives the others; not the update maths
(learner/update.py, which every rank runs with its `RankShare`) nor the loop
(learner/learner.py, which is rank 0 and goes through `Ranks` wherever it would touch
the policy's weights):

- Rank 0 is the learner's own process. Ranks 1..N-1 are `python -m learner.fsdp`
  children it starts; each gets its orders over a private socket pair as msgpack frames
  (the batch as the wire schema's Trajectory bytes, infra/schema.py: no pickle crosses
  between them), and the process group meets at a TCPStore rank 0 opens on a free
  port of 127.0.0.1. Rank k computes on `cuda:<i+k>` when `learner.device` is
  `cuda:<i>` (NCCL), or on the CPU with gloo (how tests/test_fsdp.py runs two ranks).
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
  (one node, one disk) and keeps its shard (`Ranks.load`).

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

Limits, as errors rather than silent: `learner.lora_rank > 0` with N > 1 is a
ConfigError (publishing merges the adapter in one process); a rank that fails other
than non-finite (a bug, an out-of-memory) leaves the collectives out of step, so rank 0
raises `RankFailure`, which the learner does not undo: its loop ends, and `--resume`
gives the batch a strike (learner/inflight.py). Each rank loads the whole model before
sharding it, and with `kl_coef > 0` keeps a whole frozen reference copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from infra.config import ConfigError, LearnerConfig
from infra.processes import stop_process
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
ROOT = Path(__file__).resolve().parents[1]  # on the ranks' PYTHONPATH: `python -m learner.fsdp` from any cwd


class RankFailure(RuntimeError):
    """A rank failed other than non-finite, or died: the ranks' collectives are out of step, so the
    learner cannot go on (not undone like a failed update)."""


def check_ranks(cfg: LearnerConfig) -> None:
    """ConfigError unless this machine can run `learner.num_gpus` ranks from `learner.device` on."""
    n = cfg.num_gpus
    if n == 1:
        return
    if cfg.lora_rank > 0:
        raise ConfigError(f"learner.num_gpus={n} shards a fully fine-tuned policy; LoRA's adapter is merged in one "
                          f"process: set learner.lora_rank=0 or learner.num_gpus=1")
    if cfg.device.startswith("cuda"):
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


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def encode_units(units: Sequence[Unit]) -> list[dict]:
    return [{"trajs": [encode(t) for t in u.trajs],
             "advantages": [float(a) for a in u.advantages] if u.advantages is not None else None,
             "corrected": [bool(c) for c in u.corrected]} for u in units]


def decode_units(raw: list[dict]) -> list[Unit]:
    return [Unit([decode_as(b, Trajectory) for b in u["trajs"]], u["advantages"], u["corrected"]) for u in raw]


def _end(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Tell every other rank to stop, give it a moment to leave the group, then end it."""
    for conn in conns:
        try:
            conn.send_bytes(_pack({"op": "stop"}))
            conn.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # stuck in a collective after a failure
            stop_process(proc, 20)


class Ranks:
    """Rank 0's side: the other ranks' processes, and the calls every rank makes together."""

    def __init__(self, policy: PolicyModel, share: RankShare, procs: list[subprocess.Popen],
                 conns: list[Connection]):
        self.policy, self.share, self.procs, self.conns = policy, share, procs, conns
        self._end = weakref.finalize(self, _end, procs, conns)  # at interpreter exit at the latest
        self._lock = threading.Lock()  # one order at a time: the update, publish and checkpoint threads

    @classmethod
    def start(cls, cfg: LearnerConfig, model_name: str, policy: PolicyModel) -> Ranks:
        """Start ranks 1..N-1, join them in a process group and shard `policy` (rank 0's, built from `model_name`)."""
        check_ranks(cfg)
        n, device = cfg.num_gpus, rank_device(cfg, 0)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        procs, conns = [], []
        try:
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, PYTHONPATH=path)
            for rank in range(1, n):
                mine, theirs = socket.socketpair()
                procs.append(subprocess.Popen([sys.executable, "-m", "learner.fsdp", str(theirs.fileno())],
                                              pass_fds=[theirs.fileno()], env=env))
                theirs.close()
                conns.append(Connection(mine.detach()))
                conns[-1].send_bytes(_pack({"rank": rank, "world": n, "port": store.port, "model": model_name,
                                            "cfg": dataclasses.asdict(cfg)}))
            for rank, (proc, conn) in enumerate(zip(procs, conns), start=1):  # each is up before the rendezvous
                while not conn.poll(1.0) and proc.poll() is None:
                    pass
                try:
                    conn.recv_bytes()
                except (EOFError, OSError):
                    raise RankFailure(f"FSDP rank {rank} exited with code {proc.wait()} while starting") from None
            dist.init_process_group(_backend(device), store=store, rank=0, world_size=n, timeout=TIMEOUT)
            ranks = cls(policy, shard(policy, n, device), procs, conns)
            ranks._replies()  # every rank loaded and sharded its policy
        except BaseException:
            _end(procs, conns)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        log.info("learner: %d FSDP ranks on %s", n, ", ".join(rank_device(cfg, k) for k in range(n)))
        return ranks

    def update(self, policy: PolicyModel, optimizer: torch.optim.Optimizer, cfg: LearnerConfig,
               units: Sequence[Unit], version: int) -> UpdateStats:
        """`update.apply_update` on every rank, each with its share of the micro-batches."""
        # A batch that cannot train raises here, before any other rank starts: an ordinary undone update.
        plan(units, cfg, self.policy.lm.config.vocab_size)
        with self._lock:
            self._send({"op": "update", "units": encode_units(units), "version": version})
            try:
                with self._device():
                    stats = apply_update(policy, optimizer, cfg, units, version, self.share)
            except NonFiniteUpdate:
                self._replies(nonfinite=True)  # every rank decided alike: the learner undoes it on all of them
                raise
            except Exception as exc:
                raise self._failed(f"rank 0: {type(exc).__name__}: {exc}") from exc
            self._replies()
        return stats

    def call(self, order: dict, local: Callable[[], Any]) -> Any:
        """Give every other rank `order`, run `local` here meanwhile, wait for them; `local`'s result."""
        with self._lock:
            self._send(order)
            try:
                with self._device():
                    out = local()
            except Exception as exc:
                raise self._failed(f"rank 0: {type(exc).__name__}: {exc}") from exc
            self._replies()
        return out

    def save_hf(self, path: str | Path, dtype: str = "float32") -> Path:
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

    def load(self, path: str | Path, optimizer: torch.optim.Optimizer) -> ckpt.TrainState:
        """Restore a checkpoint on every rank (each reads the file); rank 0 takes its RNG and train state."""
        payload = ckpt.read(path)  # unreadable: CheckpointError here, before any rank is told
        self.call({"op": "load", "path": str(path)}, lambda: load_full(self.policy, optimizer, payload))
        ckpt.set_rng_state(payload["rng"])
        return ckpt.train_state(payload)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (a later learner in this process makes its own)."""
        self._end()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _device(self) -> contextlib.AbstractContextManager:
        """Rank 0's GPU as the current device of the calling thread (the update thread, a publish or
        checkpoint thread), which CUDA keeps per thread; nothing on the CPU."""
        device = self.share.device
        return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()

    def _send(self, order: dict) -> None:
        data = _pack(order)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise self._failed(f"rank {rank} is gone: {exc}") from exc

    def _replies(self, nonfinite: bool = False) -> None:
        errors = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                reply = _unpack(conn.recv_bytes())
            except (EOFError, OSError):
                errors.append(f"rank {rank} exited (code {self.procs[rank - 1].poll()})")
                continue
            if not (reply.get("ok") or (nonfinite and reply.get("nonfinite"))):
                errors.append(f"rank {rank}: {reply.get('error') or 'non-finite where rank 0 was not'}")
        if errors:
            raise self._failed("; ".join(errors))

    def _failed(self, what: str) -> RankFailure:
        """The ranks are out of step: collect what the others said, end them; the error to raise."""
        said = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                if conn.poll(5.0):
                    said.append(f"rank {rank}: {_unpack(conn.recv_bytes()).get('error')}")
                    continue
            except (EOFError, OSError):
                pass
            try:
                said.append(f"rank {rank} exited with code {proc.wait(5)}")
            except subprocess.TimeoutExpired:  # alive, waiting in a collective: close() ends it
                pass
        self.close()
        return RankFailure(f"FSDP learner ranks failed ({'; '.join([what, *said])}); the learner stops")


class RanksGuard:
    """learner/guard.WeightGuard on every rank: each snapshots and restores its own shard."""

    def __init__(self, ranks: Ranks, local: WeightGuard):
        self.ranks, self.local = ranks, local

    def snapshot(self) -> None:
        self.ranks.call({"op": "snapshot"}, self.local.snapshot)

    def restore(self) -> None:
        self.ranks.call({"op": "restore"}, self.local.restore)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def serve(fd: int) -> int:
    """A rank k > 0: join the group, build and shard the policy, then carry out rank 0's orders until it stops."""
    conn = Connection(fd)
    init = _unpack(conn.recv_bytes())
    cfg, rank, world = LearnerConfig(**init["cfg"]), init["rank"], init["world"]
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.nice > 0:
        try:
            os.nice(cfg.nice)  # the whole rank process: rank 0's update thread takes the same niceness
        except OSError as exc:
            log.warning("learner.nice=%d not applied on FSDP rank %d: %s", cfg.nice, rank, exc)
    device = rank_device(cfg, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    conn.send_bytes(_pack({"ok": True}))  # up: rank 0 joins the rendezvous now
    try:
        store = dist.TCPStore("127.0.0.1", init["port"], world, is_master=False, timeout=TIMEOUT)
        dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        policy = PolicyModel.for_learner(cfg, init["model"], Precision(device, cfg.dtype))
        share = shard(policy, world, device)
        optimizer = new_optimizer(policy, cfg)
        guard = WeightGuard(policy.trainable_parameters(), optimizer)
    except Exception as exc:  # rank 0 reports it (RankFailure) and ends the others
        log.exception("FSDP rank %d could not start", rank)
        conn.send_bytes(_pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    conn.send_bytes(_pack({"ok": True}))
    while True:
        try:
            order = _unpack(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone
            return 1
        op = order["op"]
        if op == "stop":
            dist.destroy_process_group()
            return 0
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
            conn.send_bytes(_pack({"ok": True}))
        except NonFiniteUpdate as exc:
            conn.send_bytes(_pack({"ok": False, "nonfinite": exc.where}))
        except Exception as exc:  # out of step with rank 0 now: say why and exit, so its collectives fail fast
            log.exception("FSDP rank %d: %s failed", rank, op)
            conn.send_bytes(_pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
            return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    os._exit(serve(int(sys.argv[1])))
