"""DreamGym's infrastructure, in three layers (tests/test_layout.py keeps their imports pointing down).

The kernel, this package's own modules, which everything may import and which import
nothing above them:

- config.py        one dataclass per component, YAML presets, overrides, the `[config]` CLI arguments
- schema.py        the wire schema: Task, Step, Trajectory (versioned msgpack)
- streams.py       Redis streams and their delivery rules; the consumer group names; backlog
- task_stats.py    per-task reward statistics in Redis
- metrics.py       every Prometheus metric, declared once
- processes.py     stopping the child processes DreamGym starts
- redis_server.py  the embedded Redis
- dashboards.py    Grafana dashboards and the Prometheus scrape config, as code

Above it: `infra/engine/` (the serving engine; imports only the kernel), then the domain
packages actors/, simulator/ and learner/, then `infra/run/` (the application) and
`cli.py` (the `dreamgym` command), the only places in infra/ that import the domain.
"""
