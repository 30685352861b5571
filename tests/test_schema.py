"""Wire schema: every type round-trips; corrupt bytes and foreign versions raise typed errors."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra import schema
from infra.schema import EnvKind, MalformedMessage, Status, Step, Task, Trajectory, UnknownSchemaVersion


def _trajectory() -> Trajectory:
    task = Task("t1", "put the apple in the fridge", family="tw-cooking", initial_state="Room\nActions:\n[1] look",
                game_file="/x.z8", seed=3, parent_id="t0", generated=True, meta={"level": 2})
    steps = [Step("s0", "open fridge", 0.0, False, "s1", "fridge opens", "mexp", True, "prompt", [81], [-0.7], [1],
                  [81, 82, 83], 0.1),
             Step("s1", "put apple in fridge", 1.0, True, "s2", "", "", True, "p2", [82], [-0.2], [1], [81, 82])]
    return Trajectory("t1", "g1", steps, EnvKind.REAL, Status.SUCCESS, True, 7, "w0",
                      timings={"policy": 0.5, "env": 0.25}, task=task)


def test_task_roundtrip():
    t = Task("t1", "do it", family="f", meta={"a": [1, 2]})
    assert schema.decode(schema.encode(t)) == t


def test_step_roundtrip():
    s = Step("state", "click [3]", 1.0, True, logprobs=[-0.1, -2.5], action_token_ids=[5, 6], loss_mask=[1, 0])
    assert schema.decode(schema.encode(s)) == s


def test_trajectory_roundtrip_keeps_every_field():
    tr = _trajectory()
    back = schema.decode_as(schema.encode(tr), Trajectory)
    assert back == tr
    assert back.env_kind is EnvKind.REAL and back.status is Status.SUCCESS
    assert isinstance(back.steps[0], Step) and isinstance(back.task, Task)
    assert back.total_reward == 1.0


def test_no_pickle_on_the_wire():
    data = schema.encode(_trajectory())
    assert b"\x80\x04" not in data[:2]  # not a pickle protocol header
    assert isinstance(msgpack.unpackb(data), dict)


def test_unknown_version_is_typed():
    d = schema.to_dict(Task("t", "x"))
    d["v"] = 99
    with pytest.raises(UnknownSchemaVersion):
        schema.decode(msgpack.packb(d))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all \xff\xfe", msgpack.packb([1, 2]),
                                  msgpack.packb({"v": 1, "type": "nope"}), msgpack.packb({"v": 1, "type": "task"}),
                                  msgpack.packb({"v": 1, "type": "trajectory", "task_id": "t", "group_id": "g",
                                                 "status": "exploded"}),
                                  msgpack.packb({"v": 1, "type": "trajectory", "task_id": "t", "group_id": "g",
                                                 "steps": [1, 2]})])
def test_malformed_is_typed(data):
    with pytest.raises(MalformedMessage):
        schema.decode(data)


def test_decode_as_rejects_other_kind():
    with pytest.raises(MalformedMessage):
        schema.decode_as(schema.encode(Task("t", "x")), Trajectory)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data):
    try:
        schema.decode(data)
    except schema.SchemaError:
        pass
