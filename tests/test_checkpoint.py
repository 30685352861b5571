"""Checkpoints and published weight directories: round trips, atomicity, pruning, bad files."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from learner import checkpoint as ckpt
from learner.weights import WeightPublisher, published_versions, version_path


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)
        self.body.weight.requires_grad_(False)  # frozen, like a LoRA base: not checkpointed


def train_one(model, opt):
    loss = model.head(model.body(torch.randn(3, 4))).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_round_trip_restores_model_optimizer_rng_and_state(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    train_one(model, opt)
    state = ckpt.TrainState(weight_version=7, updates=7, last_entry_id="123-4", consumed_ids=["a", "b"],
                            extra={"curriculum": {"pool": [1, 2]}})
    path = ckpt.save(tmp_path, model, opt, state)
    assert path.name == "step_000007" and ckpt.latest(tmp_path) == path
    saved = torch.load(path / ckpt.STATE_FILE, weights_only=False)
    assert "body.weight" not in saved["model"] and "head.weight" in saved["model"]  # trainable only
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    other = Tiny()
    other.body.load_state_dict(model.body.state_dict())
    opt2 = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=0.1)
    random.random(), np.random.rand(), torch.rand(1)  # move the RNGs on
    got = ckpt.load(path, other, opt2)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    assert got == state
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    # The optimizer moments came back: one more identical step keeps the two in lockstep.
    torch.manual_seed(1)
    train_one(model, opt)
    torch.manual_seed(1)
    train_one(other, opt2)
    assert torch.allclose(model.head.weight, other.head.weight)


def test_latest_ignores_partial_writes_and_prunes(tmp_path):
    model = Tiny()
    assert ckpt.latest(tmp_path) is None
    for u in (1, 2, 3):
        ckpt.save(tmp_path, model, None, ckpt.TrainState(updates=u), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    # A crash mid-save leaves a temporary directory and a step dir without state.pt: both ignored.
    (ckpt.checkpoints_dir(tmp_path) / ".step_000004.tmp99").mkdir()
    (ckpt.checkpoints_dir(tmp_path) / "step_000005").mkdir()
    assert ckpt.latest(tmp_path).name == "step_000003"


def test_bad_checkpoints_raise_typed_errors(tmp_path):
    model = Tiny()
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(tmp_path / "nowhere", model)
    path = ckpt.save(tmp_path, model, None, ckpt.TrainState(updates=1))
    (path / ckpt.STATE_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(path, model)
    path = ckpt.save(tmp_path, model, None, ckpt.TrainState(updates=2))
    with pytest.raises(ckpt.CheckpointError):  # a different model's parameters
        ckpt.load(path, torch.nn.Linear(2, 2))


class DirModel:
    """Anything with save_hf(path) can be published; this one writes a marker file."""

    def __init__(self):
        self.saves = 0
        self.dtypes = []

    def save_hf(self, path, dtype="float32"):
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        shutil.move(tmp, path)
        self.saves += 1
        self.dtypes.append(dtype)


class Engines:
    """Records update calls (the real engine round trip is in tests/test_policy.py)."""

    def __init__(self):
        self.calls = []

    async def update_weights_from_disk(self, model_path, weight_version):
        self.calls.append((model_path, weight_version))


async def test_publisher_versions_and_keeps_the_last_few(tmp_path):
    engines = Engines()
    pub = WeightPublisher(tmp_path, engines, keep=2)
    model = DirModel()
    for v in (1, 2, 3):
        await pub.publish(model, v)
    assert published_versions(tmp_path) == [2, 3] and pub.last_published == 3
    assert engines.calls[-1] == (str(version_path(tmp_path, 3).resolve()), 3)
    assert [v for _, v in engines.calls] == [1, 2, 3]


async def test_publisher_with_a_shared_root_writes_there_and_links_the_run(tmp_path):
    engines, model = Engines(), DirModel()
    run_dir, root = tmp_path / "runs" / "r1", tmp_path / "shared"
    pub = WeightPublisher(run_dir, engines, keep=1, dtype="bfloat16", root=root)
    for v in (1, 2):
        await pub.publish(model, v)
    assert sorted(p.name for p in (root / "r1").iterdir()) == ["v2"]  # pruned in the shared directory
    assert published_versions(run_dir) == [2] and (run_dir / "weights").is_symlink()
    assert engines.calls[-1] == (str((root / "r1" / "v2").resolve()), 2)  # the engines get the shared path
    assert model.dtypes == ["bfloat16", "bfloat16"]
    WeightPublisher(run_dir, engines, root=root)  # a resumed run finds its link
    (tmp_path / "runs" / "r2" / "weights").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="infra.weights_dir"):
        WeightPublisher(tmp_path / "runs" / "r2", engines, root=root)  # never hides a run's own weights
