"""A run's monitoring: the driver's /metrics, the scrape targets of every process, `dreamgym monitor`.

Owns what Prometheus sees of a run. With `infra.metrics_port` set, `Monitoring`:

- serves the driver's own registry (learner, curriculum, local rollout workers, engine
  clients) on `infra.metrics_host:infra.metrics_port`;
- lists every process that serves /metrics in `<run_dir>/monitoring/targets.json`
  (infra/targets.py, Prometheus `file_sd_configs`): the driver, each embedded engine
  (its own registry, on its own port), each Ray rollout-worker actor and the buffer
  actor (free ports, reported back by the actor), and Ray's own per-node exporter
  where Ray provides one. Targets leave the file when their process stops;
- samples the run's stream backlog and pending counts every few seconds into gauges
  (only Redis knows them; no process owns them);
- exports the gap between synthetic and held-out real success after a real evaluation.

`dreamgym monitor RUN_DIR` prints the live targets and whether each answers now.
With `infra.metrics_port: 0` none of this starts and nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from infra import metrics
from infra.config import InfraConfig
from infra.stream_backlog import stream_status
from infra.streams import tasks_stream, trajectories_stream
from infra.targets import Targets, address_of, read_targets, targets_path

log = logging.getLogger(__name__)


class Monitoring:
    """The run's metrics endpoint, scrape targets and stream sampler (inactive when metrics_port is 0)."""

    def __init__(self, cfg: InfraConfig, run_dir: Path, run: str):
        self.cfg, self.run_dir, self.run = cfg, run_dir, run
        self.enabled = cfg.metrics_port > 0
        self.server: metrics.MetricsServer | None = None
        self.targets: Targets | None = None
        self._sampler: asyncio.Task | None = None
        self._lingered = False

    @property
    def host(self) -> str:
        return self.cfg.metrics_host

    def start(self) -> "Monitoring":
        if not self.enabled:
            return self
        self.server = metrics.serve_metrics(self.cfg.metrics_port, self.host)
        self.targets = Targets(self.run_dir, self.run)
        self.targets.add("driver", "driver", f"{advertised(self.host)}:{self.server.port}")
        log.info("driver metrics on http://%s:%d/metrics; targets in %s", self.host, self.server.port,
                 targets_path(self.run_dir))
        return self

    async def linger(self) -> None:
        """Wait `infra.metrics_linger_s` with everything still serving, so Prometheus scrapes the final
        values of every target (driver, engines, workers) before the run stops them. Once per run."""
        if self.server is not None and self.cfg.metrics_linger_s > 0 and not self._lingered:
            self._lingered = True
            await asyncio.sleep(self.cfg.metrics_linger_s)

    async def aclose(self) -> None:
        """Linger (if nothing did yet), then stop and unlist everything."""
        await self.linger()
        self.close()

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        if self.targets is not None:
            self.targets.clear()  # the run is over: nothing of it is scraped any more
        if self.server is not None:
            self.server.close()

    # ---- targets -----------------------------------------------------------------
    def add(self, job: str, name: str, address: str) -> None:
        if self.targets is not None and address:
            self.targets.add(job, name, address)

    def add_url(self, job: str, name: str, url: str) -> None:
        """A target given by its base URL (an embedded engine serves /metrics beside its API)."""
        if self.targets is not None:
            address, path = address_of(url)
            self.targets.add(job, name, address, path)

    def remove(self, job: str, name: str) -> None:
        if self.targets is not None:
            self.targets.remove(job, name)

    def add_ray_nodes(self, nodes: list[dict]) -> None:
        """Ray's own metrics exporter on each live node (`ray.nodes()` rows), where Ray runs one."""
        for n in nodes:
            port = n.get("MetricsExportPort")
            if n.get("Alive") and port:
                self.add("ray", str(n.get("NodeID", ""))[:12] or n["NodeManagerAddress"],
                         f"{n['NodeManagerAddress']}:{port}")

    # ---- sampled gauges ----------------------------------------------------------
    def sample_streams(self, client: Any, prefix: str, every_s: float = 5.0) -> None:
        """Keep stream_backlog / stream_pending current for the run's two streams until close()."""
        if not self.enabled or self._sampler is not None:
            return

        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):  # Redis busy or restarting: the next sample will do
                    for stream in (tasks_stream(prefix), trajectories_stream(prefix)):
                        s = await stream_status(client, stream)
                        metrics.STREAM_BACKLOG.labels(stream).set(sum(int(g["lag"]) for g in s["groups"]))
                        metrics.STREAM_PENDING.labels(stream).set(sum(int(g["pending"]) for g in s["groups"]))
                await asyncio.sleep(every_s)
        self._sampler = asyncio.create_task(loop())


def record_success_gap(train_success: float | None, real: dict | None) -> None:
    """After a held-out real evaluation: the success rate of the last update's trajectories (synthetic in
    DreamGym: how much the simulator flatters the policy) minus held-out real success."""
    if train_success is not None and real:
        metrics.SIMULATOR_FIDELITY_SUCCESS_GAP.set(train_success - real["success_rate"])


def advertised(host: str) -> str:
    """The address others reach a socket bound to `host` at (a wildcard bind advertises this node's IP)."""
    if host in ("0.0.0.0", "::", ""):
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this picks the outward interface
            return s.getsockname()[0]
        return socket.gethostname()
    return host


# ---- `dreamgym monitor` -------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's directory (runs/<name>)")
    p.add_argument("--json", action="store_true", help="print the targets as JSON (the file_sd list) and exit")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each /metrics (default: %(default)s)")


def probe(address: str, path: str, timeout: float) -> tuple[bool, int, float]:
    """(answers, sample lines, seconds) of one GET of a target's metrics."""
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as r:
            body = r.read().decode(errors="replace")
        return True, sum(1 for line in body.splitlines() if line and not line.startswith("#")), time.perf_counter() - t0
    except OSError:
        return False, 0, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    targets = read_targets(run_dir)
    if args.json:
        print(json.dumps(targets, indent=1))
        return 0
    console = Console()
    if not targets:
        console.print(f"no live targets in {targets_path(run_dir)} (monitoring off, or the run has ended)")
        return 1
    table = Table(title=f"scrape targets of {run_dir} ({targets_path(run_dir)})")
    for col in ("job", "instance", "address", "up", "samples", "ms"):
        table.add_column(col)
    down = 0
    for t in targets:
        labels = t["labels"]
        for address in t["targets"]:
            ok, n, dt = probe(address, labels.get("__metrics_path__", "/metrics"), args.timeout)
            down += not ok
            table.add_row(labels["job"], labels["instance_name"], address, "yes" if ok else "[red]no[/]", str(n),
                          f"{dt * 1000:.0f}")
    console.print(table)
    return 0 if not down else 1
