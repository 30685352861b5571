"""Time to publish a policy version: through the disk against over a process group (learner.weight_sync).

For each model, one embedded policy engine in its own process (`dreamgym serve`, as on a
node of its own) and, in this process, the learner's publisher (learner/weights.py) on the
model's weights:
- disk: `WeightPublisher.publish` writes the version as safetensors (publish dtype = the
  engine's) and the engine loads it (`/update_weights_from_disk`) and swaps it in;
- distributed: the same publisher with `DistributedSync` (learner/weight_sync.py): the first
  publish forms the group (`/init_weights_update_group`, reported on its own line), every
  one broadcasts the tensors while the engine receives them (`/update_weights_from_distributed`)
  and swaps them in.
Each publish returns once the engine serves the new version (checked). Between versions every
weight moves a little, as an update moves them. Prints each publish's seconds with the load
average beside it, the medians, and the ratio disk / distributed (> 1: the group is faster).
Both ends share this machine, so the broadcast crosses loopback: a cluster adds the network,
the disk path a shared filesystem.

    PYTHONPATH=. python benchmarks/weight_sync.py [--models tiny,smollm2] [--versions 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from infra.engine.client import EngineClient  # noqa: E402
from infra.engine.models import save_tiny_model  # noqa: E402
from infra.engine.server import launch_engine_process  # noqa: E402
from learner.policy_model import PolicyModel  # noqa: E402
from learner.weight_sync import DistributedSync  # noqa: E402
from learner.weights import WeightPublisher  # noqa: E402


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def nudge(policy: PolicyModel) -> None:
    with torch.no_grad():
        for p in policy.lm.parameters():
            p.add_(torch.randn_like(p) * 1e-3)


async def publish_times(policy: PolicyModel, url: str, run_dir: Path, mode: str, versions: int) -> list[float]:
    async with EngineClient([url], role="policy", timeout_s=600) as client:
        sync = DistributedSync(client, backend="gloo", timeout_s=600) if mode == "distributed" else None
        publisher = WeightPublisher(run_dir, client, keep=2, sync=sync)
        base = (await client.model_info())["weight_version"]
        times = []
        try:
            for i in range(1, versions + 1):
                nudge(policy)
                t0 = time.perf_counter()
                if sync is not None and sync.group is None:
                    await sync._form()  # the group's formation, once per learner: timed apart
                    print(f"  {mode:<11} group formed in {time.perf_counter() - t0:6.3f} s   ({load()})", flush=True)
                    t0 = time.perf_counter()
                await publisher.publish(policy, base + i)
                times.append(time.perf_counter() - t0)
                served = (await client.model_info())["weight_version"]
                assert served == base + i, f"engine serves {served}, published {base + i}"
                print(f"  {mode:<11} v{base + i}: {times[-1]:6.3f} s   ({load()})", flush=True)
        finally:
            publisher.close()
    return times


def bench(name: str, model: str, versions: int, tmp: Path) -> tuple[float, float]:
    policy = PolicyModel(model)
    n = sum(p.numel() for p in policy.lm.parameters())
    print(f"{name}: {n / 1e6:.1f} M parameters, fp32 ({n * 4 / 2 ** 20:.0f} MB per version); {load()}", flush=True)
    with launch_engine_process(model, max_batch_size=2, weights_root=str(tmp)) as engine:
        disk = asyncio.run(publish_times(policy, engine.url, tmp / f"{name}-disk", "disk", versions))
        dist = asyncio.run(publish_times(policy, engine.url, tmp / f"{name}-dist", "distributed", versions))
    d, g = statistics.median(disk), statistics.median(dist)
    print(f"{name}: median publish disk {d:.3f} s, distributed {g:.3f} s; disk / distributed ratio: {d / g:.2f}  "
          f"({load()})", flush=True)
    return d, g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny (the 2-layer test Llama), "
                    "smollm2 (SmolLM2-135M-Instruct), or model directories")
    ap.add_argument("--versions", type=int, default=4, help="versions published each way")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="dreamgym-weight-sync-") as d:
        tmp = Path(d)
        ratios = []
        for name in args.models.split(","):
            model = str(save_tiny_model(tmp / "tiny-model")) if name == "tiny" else name
            disk, dist = bench(Path(name).name, model, args.versions, tmp)
            ratios.append(f"{Path(name).name} {disk / dist:.2f}")
        print(f"publish time, disk / distributed ratio: {', '.join(ratios)}  ({load()})")


if __name__ == "__main__":
    main()
