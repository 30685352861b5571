"""The application: `dreamgym train` and the services, workers and reports around it.

- driver.py     `dreamgym train`: the run, in the order of the architecture diagram
- artifacts.py  what a run builds once and caches on disk (task splits, offline data, Mexp and policy checkpoints)
- services.py   one async context manager owning Redis, the engines, the replay buffer and the Ray fleet
- workers.py    building rollout workers (one way for the local and the Ray path), the elastic pool, autoscaling
- scale.py      `dreamgym scale`
- report.py     the run's time series, plots, summary.json, the progress bar and the final table
- status.py     `dreamgym status`
- experiment.py `dreamgym experiment`: the paper's regimes on the same held-out tasks, one table
- results_table.py the experiment's results: one row per regime (Mexp-answered share included), results.md, the plot
- claims.py     the paper's claims, judged on the mean of each regime's repeats (undecided below claims.repeats_needed)
- generalisation.py held-out success by slice: families seen in training, never seen, plans longer than training's
- fork.py       a finished run continued under another name (a regime that `continues` another)
- cluster/      Ray at the edges: the thin actor wrappers and the runtime

The only place in infra/ (with infra/cli.py) that imports actors/, simulator/ and learner/.
"""
