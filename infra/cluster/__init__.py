"""Ray at the edges: thin `@ray.remote` wrappers, one file per role, and the runtime.

Nothing outside this package imports Ray. Every wrapped class is a plain (async)
Python class that also runs in one process for tests and the quickstart:

- runtime.py        ray.init for a local machine or a cluster; placement by role labels
- worker_actor.py   the rollout worker (actors/rollout_worker.py)
- buffer_actor.py   the replay buffer (simulator team)
- engine_actor.py   an embedded engine (engines team)
- scheduler_actor.py the curriculum scheduler (curriculum team)
"""
