"""Stop strings and output assembly: cut before the stop, never stream part of one."""

from __future__ import annotations

import random

from anneal.engine.output_stream import OutputAssembler
from anneal.engine.sequence import RequestOutput, TokenLogprobs
from anneal.engine.stop_strings import StopStringMatcher
from anneal.engine.tokenizer import ByteTokenizer


def feed_all(stops, pieces):
    m = StopStringMatcher(stops)
    out = [m.feed(piece) for piece in pieces]
    out.append(m.finish())
    return m, out


def test_cut_before_the_first_stop_across_pieces():
    m, out = feed_all(["</a>", "STOP"], ["hello <", "/", "a> never", " seen"])
    assert m.stopped
    assert "".join(out) == m.text == "hello "
    assert out[0] == "hello "  # "<" is held back: it may start "</a>"


def test_earliest_stop_wins():
    m, out = feed_all(["bb", "a"], ["xxbba"])
    assert "".join(out) == "xx"


def test_partial_stop_is_released_when_it_does_not_complete():
    m, out = feed_all(["</a>"], ["x </", "b>", " y"])
    assert not m.stopped
    assert out[0] == "x "
    assert "".join(out) == "x </b> y"


def test_no_stops_releases_everything_at_once():
    m, out = feed_all([], ["ab", "cd"])
    assert out == ["ab", "cd", ""]


def test_streamed_text_equals_cut_full_text_for_random_pieces():
    rng = random.Random(1)
    alphabet = "ab<>/ "
    for _ in range(300):
        full = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        cuts = sorted(rng.sample(range(len(full) + 1), min(3, len(full) + 1)))
        pieces = [full[i:j] for i, j in zip([0, *cuts], [*cuts, len(full)])]
        m, out = feed_all(stops, pieces)
        hits = [full.find(s) for s in stops if s in full]
        expected = full[: min(hits)] if hits else full
        assert "".join(out) == expected, (full, stops, pieces)
        assert m.stopped == bool(hits)


def _out(rid, ids, finished=False, reason=None, logprobs=None):
    return RequestOutput(rid, ids, finished, reason, 3, 0, 0, new_logprobs=logprobs)


def test_assembler_finishes_with_stop_on_a_stop_string():
    tok = ByteTokenizer(512)
    asm = OutputAssembler(tok, [1, 2, 3], ["lo"], want_logprobs=False)
    deltas = [asm.add(_out("r", [b])) for b in b"hel"]
    deltas.append(asm.add(_out("r", [ord("o")])))
    assert [d.text for d in deltas] == ["h", "e", "", ""]
    assert deltas[-1].finish_reason == "stop"
    assert asm.text == "he"
    assert asm.add(_out("r", [ord("x")])).text == ""  # nothing after a finish


def test_assembler_flushes_held_text_on_the_engines_finish():
    tok = ByteTokenizer(512)
    asm = OutputAssembler(tok, [], ["xyz"], want_logprobs=True)
    lp = [TokenLogprobs(ord("x"), -0.5, {ord("x"): -0.5, ord("q"): -1.0})]
    d1 = asm.add(_out("r", [ord("a")], logprobs=[TokenLogprobs(ord("a"), -0.1, {})]))
    d2 = asm.add(_out("r", [ord("x")], finished=True, reason="length", logprobs=lp))
    assert (d1.text, d2.text, d2.finish_reason) == ("a", "x", "length")
    assert d2.tokens[0].top == [("x", -0.5), ("q", -1.0)]
    assert d2.tokens[0].text_offset == 1
    assert d1.tokens[0].top == [("a", -0.1)]  # the sampled token is always in the top list
