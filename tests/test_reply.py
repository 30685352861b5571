"""Generate-mode replies: parsing, normalising and matching are total and say why a reply is invalid."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from actors.reply import (INVALID_REASONS, MAX_ACTION_CHARS, NO_ACTION, NOT_ADMISSIBLE, TRUNCATED, Reply, match_action,
                          normalise, parse_reply)

CANDIDATES = ["go east", "take coin", "open box", 'type [3] "Bob"', "look"]


def test_a_well_formed_reply_gives_its_reasoning_and_action():
    assert parse_reply("<think>the coin is here</think><action> take coin </action>") == \
        Reply("the coin is here", "take coin", "")
    assert parse_reply("<action>go east</action>") == Reply("", "go east", "")
    assert parse_reply("Sure.\n<THINK>x</THINK>\n<Action>open box</Action> trailing") == Reply("x", "open box", "")
    # the first complete action counts
    assert parse_reply("<action>look</action><action>go east</action>").action == "look"


def test_invalid_replies_say_why():
    assert parse_reply("<think>long reasoning that never", "length").invalid_reason == TRUNCATED
    assert parse_reply("<think>x</think><action>go ea", "length").invalid_reason == TRUNCATED
    # a complete action that ends right at the limit is an action
    assert parse_reply("<think>x</think><action>go east</action>", "length") == Reply("x", "go east", "")
    assert parse_reply("I will go east.", "stop").invalid_reason == NO_ACTION
    assert parse_reply("<action>go east", "stop").invalid_reason == NO_ACTION  # unclosed: not an action
    assert parse_reply("<action>   </action>").invalid_reason == NO_ACTION
    assert parse_reply("<action>" + "x" * (MAX_ACTION_CHARS + 1) + "</action>").invalid_reason == NO_ACTION
    assert parse_reply("<action><action>go east</action>").invalid_reason == NO_ACTION
    assert parse_reply("").invalid_reason == NO_ACTION
    assert parse_reply(None, "length").invalid_reason == TRUNCATED  # type: ignore[arg-type]


def test_match_folds_case_spacing_quotes_and_trailing_punctuation():
    assert match_action("take coin", CANDIDATES) == "take coin"
    assert match_action("  Take   COIN. ", CANDIDATES) == "take coin"
    assert match_action('"go east"', CANDIDATES) == "go east"
    assert match_action("`open box`!", CANDIDATES) == "open box"
    assert match_action("'look'.", CANDIDATES) == "look"
    assert match_action('TYPE [3] "bob"', CANDIDATES) == 'type [3] "Bob"'
    assert match_action("take the coin", CANDIDATES) is None
    assert match_action("go", CANDIDATES) is None
    assert match_action("", CANDIDATES) is None and match_action("...", CANDIDATES) is None
    assert match_action("Look", ["look", "Look"]) == "Look"  # an exact candidate wins over a folded one


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_normalise_is_idempotent_and_match_is_total(text):
    once = normalise(text)
    assert normalise(once) == once
    hit = match_action(text, CANDIDATES)
    assert hit is None or hit in CANDIDATES


_FRAGMENTS = ["<think>", "</think>", "<action>", "</action>", "<Action>", "</ACTION>", "<action", "action>", "<",
              ">", "/", " ", "\n", "\t", "go east", "take coin", "Open Box.", '"look"', "é", "漢字", "\u200b", "\x00",
              "<|im_end|>", "<|im_start|>assistant\n", "🙂", "\\", "{", "}", "[3]", '"Bob"', "type", "x" * 700,
              "<think></think>", "<action></action>"]


def _fuzzed(rng: random.Random) -> str:
    parts = [rng.choice(_FRAGMENTS) for _ in range(rng.randrange(0, 12))]
    if rng.random() < 0.3:  # a near-miss of a well-formed reply somewhere in the noise
        act = rng.choice([*CANDIDATES, "fly", "Go  East.", "'take coin'"])
        parts.insert(rng.randrange(len(parts) + 1), f"<action>{act}</action>")
    if rng.random() < 0.2:
        parts.append("".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(rng.randrange(1, 40))))
    if rng.random() < 0.01:
        parts.append("<think>" + "y" * 200_000)  # a very long reply
    return "".join(parts)


def test_ten_thousand_fuzzed_replies_never_raise_and_each_gives_a_reason_or_an_action():
    rng = random.Random(60)
    seen = {r: 0 for r in ("", *INVALID_REASONS)}
    for _ in range(10_000):
        text, finish = _fuzzed(rng), rng.choice(["stop", "length", "abort", ""])
        reply = parse_reply(text, finish)
        assert reply.invalid_reason in ("", TRUNCATED, NO_ACTION)
        assert (reply.invalid_reason == "") == bool(reply.action)
        if reply.action:
            assert reply.action in text and 0 < len(reply.action) <= MAX_ACTION_CHARS
            hit = match_action(reply.action, CANDIDATES)
            assert hit is None or hit in CANDIDATES
            seen["" if hit else NOT_ADMISSIBLE] += 1
        else:
            assert reply.invalid_reason != TRUNCATED or finish == "length"
            seen[reply.invalid_reason] += 1
    assert all(n > 50 for n in seen.values()), seen  # the fuzz reaches every outcome
