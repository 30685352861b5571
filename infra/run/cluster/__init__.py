"""Ray at the edges: thin `@ray.remote` wrappers, one file per role, and the runtime.

Nothing outside this package imports Ray (but RLlib's env registration in
actors/envs/gym_wrapper.py). Every wrapped class is a plain (async) Python class that
also runs in one process for tests and the quickstart:

- runtime.py        ray.init for a local machine or a cluster; placement by role labels
- rollout_fleet.py  `dreamgym train`'s workers as actors: the recipe each builds from
                    (infra/run/workers.py's make_policy / make_env_factory), the shared buffer actor
- worker_actor.py   the rollout worker (actors/rollout_worker.py)
- buffer_actor.py   the replay buffer (simulator team)
- engine_actor.py   an embedded engine (engines team)
- scheduler_actor.py the curriculum scheduler (curriculum team)
"""
