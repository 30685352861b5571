"""Makes an experiment file's games, splits and offline trajectories here, and embeds the offline
transitions into the run's MiniLM cache, for a GPU machine whose short lease has no time for
`tw-make` and collection (benchmarks/gpu/pack.sh). With the embeddings cached, the replay buffer
is seeded and Mexp SFT runs there before MiniLM's weights have arrived."""

from __future__ import annotations

import sys

from infra.config import load_config
from infra.run.artifacts import embedding_cache, prepare_data
from infra.run.experiment import load_experiment
from simulator.embedder import Embedder, transition_text
from simulator.replay_buffer import transitions_from_trajectory


def data_dir(experiment: str) -> str:
    exp = load_experiment(experiment)
    return load_config(exp.base, exp.overrides).infra.data_dir


if __name__ == "__main__":  # collection spawns processes
    if "--data-dir" in sys.argv:  # where the data go (pack.sh tars them from there)
        print(data_dir(sys.argv[1]))
        sys.exit(0)
    exp = load_experiment(sys.argv[1])
    cfg = load_config(exp.base, exp.overrides)
    splits, offline = prepare_data(cfg)
    texts = [transition_text(t.state, t.action) for traj in offline for t in transitions_from_trajectory(traj, "real")]
    Embedder(cache_path=embedding_cache(cfg)).embed(texts)
    print(f"{len(splits.train)} train / {len(splits.heldout)} held-out tasks, {len(offline)} offline "
          f"trajectories, {len(texts)} transitions embedded into {embedding_cache(cfg)}")
