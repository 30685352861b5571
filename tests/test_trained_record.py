"""learner/trained_record.py: the final weights' updates rebuilt from an append-only record that a
killed learner leaves with lines a resumed one writes again (benchmarks/chaos.py counts from it)."""

from __future__ import annotations

import json

from learner.trained_record import TRAINED_FILE, TrainedRecord, lineage, read


def test_the_last_line_of_each_version_is_the_one_in_the_final_weights(tmp_path):
    rec = TrainedRecord(tmp_path)
    # segment 1: updates 1-4, checkpoint at 2, killed after 4 (3 and 4 are lost with it)
    for v, ids in [(1, ["a", "b"]), (2, ["c"]), (3, ["d", "e"]), (4, ["f"])]:
        rec.append(v, ids)
    # segment 2 resumes at version 2: d is retrained in its version 3, f never comes back into an update
    for v, ids in [(3, ["d", "g"]), (4, ["h"]), (5, ["i"])]:
        rec.append(v, ids)
    with open(tmp_path / TRAINED_FILE, "a") as f:
        f.write('{"version": 6, "t": 1.0, "ids": ["j"')  # torn by a kill mid-line
    assert [r["version"] for r in read(tmp_path / TRAINED_FILE)] == [1, 2, 3, 4, 3, 4, 5]
    final = lineage(tmp_path / TRAINED_FILE, 5)
    assert final == {1: ["a", "b"], 2: ["c"], 3: ["d", "g"], 4: ["h"], 5: ["i"]}
    ids = [i for v in sorted(final) for i in final[v]]
    assert len(ids) == len(set(ids))  # nothing twice, though d and the lost f were written twice or in vain
    # a final version below the last lines' leaves out what a dead segment wrote past it
    assert lineage(tmp_path / TRAINED_FILE, 3) == {1: ["a", "b"], 2: ["c"], 3: ["d", "g"]}


def test_a_trajectory_in_two_surviving_updates_shows_twice(tmp_path):
    rec = TrainedRecord(tmp_path)
    rec.append(1, ["a"])
    rec.append(2, ["a", "b"])  # what a learner that trained a redelivery again would leave
    final = lineage(tmp_path / TRAINED_FILE, 2)
    assert sum(ids.count("a") for ids in final.values()) == 2
    row = json.loads((tmp_path / TRAINED_FILE).read_text().splitlines()[0])
    assert set(row) == {"version", "t", "ids"} and row["t"] > 0


def test_a_missing_record_reads_empty(tmp_path):
    assert read(tmp_path / TRAINED_FILE) == [] and lineage(tmp_path / TRAINED_FILE, 3) == {}
