"""Wire schema: every type round-trips; corrupt bytes and foreign versions raise typed errors."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra import schema
from infra.schema import (EnvKind, InvalidField, MalformedMessage, Status, Step, Task, Trajectory, UnknownSchemaVersion,
                          decode, encode, to_dict)


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


# ----- validation at decode: types, finiteness, agreeing lengths, bounds -----
# Each entry: (where, field, bad value). `where` is "step" (the first step), "traj" or "task".
POISON = [
    ("step", "reward", float("nan")), ("step", "reward", float("inf")), ("step", "reward", -float("inf")),
    ("step", "reward", "1.0"), ("step", "reward", None), ("step", "reward", [1.0]), ("step", "reward", True),
    ("step", "reward", 1e300), ("step", "value", float("nan")), ("step", "done", 1), ("step", "valid", "yes"),
    ("step", "logprobs", [float("nan")]), ("step", "logprobs", ["x"]), ("step", "logprobs", [float("-inf")]),
    ("step", "logprobs", [0.5]), ("step", "logprobs", [-0.1, -0.2]), ("step", "logprobs", "-0.7"),
    ("step", "logprobs", [None]), ("step", "action_token_ids", [81.0]), ("step", "action_token_ids", [-1]),
    ("step", "action_token_ids", ["81"]), ("step", "action_token_ids", [81, 82]), ("step", "loss_mask", [2]),
    ("step", "loss_mask", [1, 1]), ("step", "loss_mask", [float("nan")]), ("step", "choice_token_ids", [1, None]),
    ("step", "choice_token_ids", [2 ** 40]), ("step", "state", 7), ("step", "state", None),
    ("step", "state", "x" * (schema.MAX_TEXT_CHARS + 1)), ("step", "policy_prompt", b"bytes"),
    ("step", "reasoning_source", "y" * (schema.MAX_ID_CHARS + 1)),
    ("step", "temperature", 0.0), ("step", "temperature", float("nan")), ("step", "temperature", "1.5"),
    ("step", "temperature", 1e9),
    ("traj", "policy_version", -1), ("traj", "policy_version", 1.5), ("traj", "created_at", float("nan")),
    ("traj", "timings", {"policy": float("inf")}), ("traj", "timings", {"env": -1.0}), ("traj", "timings", [1]),
    ("traj", "timings", {"policy_name": "z" * (schema.MAX_ID_CHARS + 1)}), ("traj", "timings", {"env": None}),
    ("traj", "task_id", 3), ("traj", "group_id", "g" * (schema.MAX_ID_CHARS + 1)), ("traj", "success", "true"),
    ("traj", "steps", "not a list"), ("traj", "steps", [{"state": "s"}] * 2),
    ("task", "instruction", 5), ("task", "seed", "7"), ("task", "meta", [1]), ("task", "generated", 0),
]


def _poisoned(where: str, name: str, value) -> bytes:
    d = schema.to_dict(_trajectory())
    target = {"step": lambda: d["steps"][0], "traj": lambda: d, "task": lambda: d["task"]}[where]()
    target[name] = value
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("where, name, value", POISON, ids=[f"{w}.{n}={str(v)[:12]}" for w, n, v in POISON])
def test_poison_fields_raise_a_schema_error_naming_the_field(where, name, value):
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(_poisoned(where, name, value))
    if name != "steps":
        assert name in str(err.value), str(err.value)
    if where == "step":
        assert str(err.value).startswith("steps[0]."), str(err.value)


def test_good_edge_values_still_decode():
    tr = _trajectory()
    s = tr.steps[0]
    s.reward, s.value, s.logprobs, s.action_token_ids, s.loss_mask = 1, -2.5, [0.0], [0], [0]  # ints are numbers
    tr.steps[1].logprobs, tr.steps[1].loss_mask = [], []  # a step with no log-probs (offline, real env)
    tr.steps.append(Step("s", "look", logprobs=[-1e-7] * 3, action_token_ids=[1, 2, 3], loss_mask=[1, 0, 1]))
    tr.timings["policy_name"] = "expert"  # actors/collect.py labels offline trajectories here
    assert schema.decode(schema.encode(tr)) == tr


def test_step_count_and_message_size_are_bounded():
    many = Trajectory("t", "g", [Step("s", "a")] * (schema.MAX_STEPS + 1))
    with pytest.raises(schema.InvalidField, match="steps"):
        schema.decode(schema.encode(many))
    assert len(schema.decode_as(schema.encode(Trajectory("t", "g", [Step("s", "a")] * schema.MAX_STEPS)),
                                Trajectory).steps) == schema.MAX_STEPS
    with pytest.raises(schema.InvalidField, match="bytes"):
        schema.decode(b"\x00" * (schema.MAX_MESSAGE_BYTES + 1))


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=5), st.binary(max_size=5), st.lists(st.integers(0, 3), max_size=3),
                 st.lists(st.floats(), max_size=3), st.dictionaries(st.text(max_size=3), st.floats(), max_size=2))
_STEP_FIELDS = sorted(schema._FIELD_NAMES[Step])
_TRAJ_FIELDS = sorted(schema._FIELD_NAMES[Trajectory] - {"steps", "task", "env_kind", "status"})


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["step", "traj"]), st.data())
def test_any_value_in_any_field_decodes_to_a_valid_message_or_a_schema_error(where, data):
    """Whatever a hostile or buggy producer writes into one field, decode either returns a
    message whose numbers are finite and whose per-token lists agree, or raises SchemaError
    (never another exception, never a NaN that reaches the learner)."""
    name = data.draw(st.sampled_from(_STEP_FIELDS if where == "step" else _TRAJ_FIELDS))
    value = data.draw(_ANY)
    try:
        tr = schema.decode_as(_poisoned(where, name, value), Trajectory)
    except schema.SchemaError:
        return
    for s in tr.steps:
        for x in (s.reward, s.value, *s.logprobs):
            assert isinstance(x, (int, float)) and x == x and abs(x) < float("inf")
        assert all(isinstance(x, str) for x in (s.state, s.action, s.next_state, s.reasoning, s.policy_prompt))
        assert not s.logprobs or len(s.logprobs) == len(s.action_token_ids)
        assert not s.loss_mask or len(s.loss_mask) == len(s.action_token_ids)
        assert all(isinstance(t, int) and t >= 0 for t in s.action_token_ids + s.choice_token_ids)
    assert all(isinstance(x, str) or x == x and 0 <= x < float("inf") for x in tr.timings.values())
    assert isinstance(tr.policy_version, int) and tr.policy_version >= 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=6))
def test_logprob_lists_are_finite_and_non_positive_after_decode(lps):
    tr = _trajectory()
    tr.steps[0].logprobs, tr.steps[0].action_token_ids, tr.steps[0].loss_mask = lps, list(range(len(lps))), []
    ok = all(x == x and schema.LOGPROB_RANGE[0] <= x <= schema.LOGPROB_RANGE[1] for x in lps)
    if ok:
        assert schema.decode_as(schema.encode(tr), Trajectory).steps[0].logprobs == lps
    else:
        with pytest.raises(schema.InvalidField, match="logprobs"):
            schema.decode(schema.encode(tr))


def _reference_step_ok(d: dict) -> bool:
    """The schema's rules for one step, written out per element, slowly and plainly."""
    def number(x, lo, hi, allow_bool=False):
        if isinstance(x, bool) and not allow_bool:
            return False
        return isinstance(x, (int, float)) and math.isfinite(x) and lo <= x <= hi

    for name in ("state", "action", "next_state", "reasoning", "policy_prompt"):
        if not isinstance(d[name], str) or len(d[name]) > schema.MAX_TEXT_CHARS:
            return False
    if not isinstance(d["reasoning_source"], str) or len(d["reasoning_source"]) > schema.MAX_ID_CHARS:
        return False
    if not all(number(d[k], -schema.MAX_ABS_REWARD, schema.MAX_ABS_REWARD) for k in ("reward", "value")):
        return False
    if not (isinstance(d["done"], bool) and isinstance(d["valid"], bool)):
        return False
    if not number(d["temperature"], *schema.TEMPERATURE_RANGE):
        return False
    ids, lps, mask, choices = d["action_token_ids"], d["logprobs"], d["loss_mask"], d["choice_token_ids"]
    if not all(isinstance(v, list) and len(v) <= schema.MAX_TOKENS for v in (ids, lps, mask, choices)):
        return False
    for t in ids + choices:
        if not (isinstance(t, int) and 0 <= t <= schema.MAX_TOKEN_ID):
            return False
    for x in lps:
        if not number(x, *schema.LOGPROB_RANGE, allow_bool=True):
            return False
    for m in mask:
        if not (isinstance(m, (int, float)) and m in (0, 1)):
            return False
    lens = d["choice_lengths"]
    if not isinstance(lens, list) or len(lens) > schema.MAX_TOKENS:
        return False
    if lens and not (all(isinstance(n, int) and 1 <= n <= schema.MAX_TOKENS for n in lens)  # bools as ints, as token ids
                     and sum(lens) == len(choices)):
        return False
    per = 1 if lens else len(ids)  # score mode: one value for the whole choice
    return (not lps or len(lps) == per) and (not mask or len(mask) == per)


_ELEMENT = st.one_of(st.integers(-3, 2 ** 33), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2))
_STEP_VALUES = {
    "reward": st.one_of(_ANY, st.floats(-2e6, 2e6)), "value": st.one_of(_ANY, st.floats(-2e6, 2e6)),
    "done": _ANY, "valid": _ANY, "state": st.one_of(st.text(max_size=3), _ANY), "reasoning_source": _ANY,
    "temperature": st.one_of(_ANY, st.floats(-1, 200)),
    "action_token_ids": st.one_of(st.lists(st.integers(0, 100), max_size=3), st.lists(_ELEMENT, max_size=3), _ANY),
    "choice_token_ids": st.one_of(st.lists(st.integers(0, 100), max_size=3), st.lists(_ELEMENT, max_size=3)),
    "logprobs": st.one_of(st.lists(st.floats(-20, 0), max_size=3), st.lists(_ELEMENT, max_size=3), _ANY),
    "loss_mask": st.one_of(st.lists(st.sampled_from([0, 1]), max_size=3), st.lists(_ELEMENT, max_size=3), _ANY),
    "choice_lengths": st.one_of(st.lists(st.integers(0, 3), max_size=3), st.lists(_ELEMENT, max_size=2), _ANY),
}


@settings(max_examples=1500, deadline=None)
@given(st.fixed_dictionaries({}, optional=_STEP_VALUES))
def test_fast_step_check_matches_the_slow_reference(changes):
    d = dict(schema.to_dict(_trajectory())["steps"][0])
    d.update(changes)
    try:
        schema._check_step(d)
        fast_ok = True
    except schema.InvalidField:
        fast_ok = False
    assert fast_ok == _reference_step_ok(d), changes


def test_version_1_messages_are_still_read_with_the_generate_fields_defaulted():
    """A trajectory written before the generate mode (schema 1) decodes; its steps get the defaults."""
    traj = Trajectory(task_id="t", group_id="g", steps=[Step(state="s", action="a", action_token_ids=[5],
                                                             logprobs=[-0.5], loss_mask=[1], choice_token_ids=[5, 6])])
    d = to_dict(traj)
    d["v"] = 1
    for s in d["steps"]:
        for name in ("prompt_token_ids", "new_chat", "reply", "invalid_reason", "temperature"):
            del s[name]
    back = decode(msgpack.packb(d, use_bin_type=True))
    assert back.steps[0].prompt_token_ids == [] and back.steps[0].new_chat is False
    assert back.steps[0].temperature == 1.0  # written before the field: its log-prob was read at 1
    assert back.steps[0].reply == "" and back.steps[0].invalid_reason == ""
    assert back.steps[0].logprobs == [-0.5]


def test_a_generate_mode_step_round_trips_and_its_fields_are_checked():
    step = Step(state="s", action="go north", action_token_ids=[10, 11, 2], logprobs=[-0.1, -0.2, -0.01],
                loss_mask=[1, 1, 1], prompt_token_ids=[1, 2, 3, 4], new_chat=True,
                reply="<think>x</think><action>go north</action>", invalid_reason="")
    back = decode(encode(Trajectory(task_id="t", group_id="g", steps=[step])))
    assert back.steps[0] == step
    for field_name, bad in (("prompt_token_ids", [-1]), ("prompt_token_ids", ["x"]), ("new_chat", 1),
                            ("reply", 5), ("invalid_reason", "x" * 300)):
        d = to_dict(Trajectory(task_id="t", group_id="g", steps=[step]))
        d["steps"][0][field_name] = bad
        with pytest.raises(InvalidField, match=field_name):
            decode(msgpack.packb(d, use_bin_type=True))
    # one log-prob per sampled token, as in label mode
    d = to_dict(Trajectory(task_id="t", group_id="g", steps=[step]))
    d["steps"][0]["logprobs"] = [-0.1]
    with pytest.raises(InvalidField, match="logprobs"):
        decode(msgpack.packb(d, use_bin_type=True))


@pytest.mark.parametrize("version", [0, 3, True, "2", None, [2]])
def test_other_versions_are_refused_by_version(version):
    d = to_dict(Task("t", "x"))
    d["v"] = version
    with pytest.raises(UnknownSchemaVersion):
        decode(msgpack.packb(d, use_bin_type=True))
