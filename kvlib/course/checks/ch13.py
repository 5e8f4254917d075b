"""Chapter 13's graded questions: the text each byte-level token releases when streamed (never a
partial UTF-8 character), a stop-string matcher with hold-back, and a goodput count under an SLO.
Oracles: the rules of `kvlib.serve.detokenize` and `kvlib.serve.load` written out here (Python's
incremental UTF-8 decoder for the first)."""

from __future__ import annotations

import codecs

import numpy as np

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_list, question

# --- question 1: incremental UTF-8 ---------------------------------------------------------------


def _utf8_deltas(token_bytes):
    decoder = codecs.getincrementaldecoder("utf-8")()
    return [decoder.decode(b) for b in token_bytes]


def _held_whole(token_bytes):
    """A token's bytes held back whole until everything pending decodes."""
    pending, deltas = b"", []
    for token in token_bytes:
        pending += token
        try:
            deltas.append(pending.decode())
            pending = b""
        except UnicodeDecodeError:
            deltas.append("")
    return deltas


def _utf8_mistakes(token_bytes) -> dict:
    """utf8_deltas's common mistakes, the first two from the chapter's pitfall 1 (each token
    decoded on its own)."""
    return {
        "each token decoded on its own (errors='replace' sends U+FFFD for a cut character): keep "
        "a token's incomplete character for the next": lambda: [
            b.decode("utf-8", errors="replace") for b in token_bytes
        ],
        "each token decoded on its own (errors='ignore' drops a cut character): keep a token's "
        "incomplete character for the next": lambda: [
            b.decode("utf-8", errors="ignore") for b in token_bytes
        ],
        "nothing released until every pending byte decodes: a token releases the characters it "
        "completes even when it also starts another": lambda: _held_whole(token_bytes),
    }


def _split_bytes(text: str, rng) -> list[bytes]:
    """`text`'s UTF-8 bytes cut into tokens of 1 to 4 bytes (characters get cut)."""
    data, tokens, i = text.encode(), [], 0
    while i < len(data):
        n = int(rng.integers(1, 5))
        tokens.append(data[i : i + n])
        i += n
    return tokens


_ALPHABET = list("ab ,") + ["é", "ï", "ß", "€", "日", "本", "🦙", "🙂"]


@question(function="utf8_deltas")
def test_utf8_deltas(submission: Submission) -> None:
    utf8_deltas = submission.function("utf8_deltas")
    rng = submission.rng()
    cases = submission.fixed([
        ([b"\xf0\x9f", b"\xa6\x99", b" l", b"lama"], "an emoji cut in two tokens"),
        ([b"na", b"\xc3", b"\xafve"], "a 2-byte character cut after its lead byte"),
        ([b"\xe6\x97", b"\xa5\xe6", b"\x9c\xac"], "two 3-byte characters cut twice"),
        ([b"plain", b" ascii"], "ASCII only"),
        ([b"\xf0", b"\x9f", b"\x99", b"\x82"], "one byte per token"),
    ])  # fmt: skip
    for _ in range(6):
        text = "".join(rng.choice(_ALPHABET, size=int(rng.integers(3, 12))))
        cases.append((_split_bytes(text, rng), f"random text {text!r}"))
    for token_bytes, what in cases:
        expected = _utf8_deltas(token_bytes)
        got = utf8_deltas(list(token_bytes))
        expect_list(got, lambda d: isinstance(d, str), "utf8_deltas should return a list of str")
        with naming_mistakes(got, _utf8_mistakes(token_bytes)):
            assert got == expected, (
                f"{what}: tokens {token_bytes!r}: expected {expected!r} (each token releases the "
                f"characters it completes, and nothing of a character still missing bytes), got "
                f"{got!r}"
            )


# --- question 2: stop strings with hold-back ----------------------------------------------------


def _stop_stream(pieces, stops, *, earliest=True):
    """The matcher written out; `earliest=False`: a common mistake, the first stop string of
    `stops` found wins, not the one that starts earliest."""
    held, sent = "", []
    for piece in pieces:
        held += piece
        starts = [i for i in (held.find(s) for s in stops) if i >= 0]
        if starts:
            sent.append(held[: min(starts) if earliest else starts[0]])
            return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False


def _per_piece(pieces, stops):
    """Each piece searched on its own, and sent whole when it holds no stop string."""
    sent = []
    for piece in pieces:
        starts = [i for i in (piece.find(s) for s in stops) if i >= 0]
        if starts:
            return [*sent, piece[: min(starts)]], True
        sent.append(piece)
    return [*sent, ""], False


def _sent_at_once(pieces, stops):
    """The text received so far searched, but each piece sent as it arrives (no hold-back)."""
    received, sent = "", []
    for piece in pieces:
        done = len(received)
        received += piece
        starts = [i for i in (received.find(s) for s in stops) if i >= 0]
        if starts:
            return [*sent, received[done : max(done, min(starts))]], True
        sent.append(piece)
    return [*sent, ""], False


def _stop_mistakes(pieces, stops) -> dict:
    """stop_stream's common mistakes, the first two from the chapter's pitfall 2 (the first named
    wherever the two give the same answer: neither holds anything back)."""
    return {
        "each piece sent as it arrives: hold back the longest tail that could still begin a "
        "stop string, or the client sees its start": lambda: _sent_at_once(pieces, stops),
        "each piece searched on its own: a stop string can span pieces, search the text held "
        "back plus the new piece": lambda: _per_piece(pieces, stops),
        "the first stop string of `stops` found, not the one that starts earliest in the "
        "text": lambda: _stop_stream(pieces, stops, earliest=False),
    }


@question(function="stop_stream")
def test_stop_stream(submission: Submission) -> None:
    stop_stream = submission.function("stop_stream")
    rng = submission.rng()
    cases = [
        ([" v2", " SET", " k4", " v16"], ["SET k4"], "a stop string spanning two pieces"),
        ([" v2", " SE", "T x"], ["SET k4"], "a partial match that fails: released"),
        (["ab", "c\n", "\nd"], ["\n\n"], "a stop string made of two newlines"),
        (["hello", " world"], ["xyz"], "no stop string anywhere"),
        (["a", "XbYc"], ["bY", "X"], "two stop strings in one piece: the earliest wins"),
        (["xabc"], ["b", "abc"], "one stop string inside another: the earliest start wins"),
        (["hi\n", "\nmore"], ["END", "\n\n"], "the second stop string's start held back"),
        (["xaa", "b"], ["aab"], "a repeated character: hold back the longest possible start"),
        (
            ["a", "b", "c"],
            ["abcd", "bc"],
            "a longer stop string still possible, a shorter one hits",
        ),
        (["ab", "", "c"], ["bc"], "an empty piece while a stop string's start is held"),
        ([], ["x"], "no pieces at all"),
        (["", ""], ["x"], "only empty pieces"),
    ]
    cases = submission.fixed(cases)
    for _ in range(8):
        text = "".join(rng.choice(list("ab\n"), size=int(rng.integers(0, 16))))
        cuts = sorted(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 5))).tolist())
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]  # some may be empty
        stops = ["".join(rng.choice(list("ab\n"), size=int(rng.integers(1, 4)))) for _ in "ab"]
        cases.append((pieces, stops, f"random pieces {pieces!r}"))
    for pieces, stops, what in cases:
        expected_sent, expected_stopped = _stop_stream(pieces, stops)
        got = stop_stream(list(pieces), list(stops))
        assert isinstance(got, tuple) and len(got) == 2, (
            f"stop_stream should return a tuple (sent, stopped), got {got!r}"
        )
        sent, stopped = got
        with naming_mistakes((list(sent), stopped), _stop_mistakes(pieces, stops)):
            assert stopped == expected_stopped, (
                f"{what}, stops {stops!r}: expected stopped={expected_stopped}, got {stopped!r}"
            )
            assert list(sent) == expected_sent, (
                f"{what}, stops {stops!r}: expected sent {expected_sent!r} (after each piece, "
                f"release all but the longest tail that is a proper prefix of some stop string; "
                f"on a match, release the text before the earliest stop string and end; at the "
                f"end, release what is held), got {sent!r}"
            )


# --- question 3: goodput -------------------------------------------------------------------------


def _slo_goodput(requests, ttft_slo_s, tpot_slo_s, *, gaps=True, bounds_met=True,
                 span=True):  # fmt: skip
    """The count and rate written out. The common mistakes, switchable: `gaps=False` divides the
    token span by the tokens, not the gaps between them; `bounds_met=False` excludes a request
    exactly at a bound; `span=False` times the run from the first listed request's arrival to the
    last listed one's last token."""
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1 if gaps else n) if n > 1 else 0.0
        if bounds_met:
            good += ttft <= ttft_slo_s and tpot <= tpot_slo_s
        else:
            good += ttft < ttft_slo_s and tpot < tpot_slo_s
    start = min(a for a, _ in requests) if span else requests[0][0]
    end = max(t[-1] for _, t in requests) if span else requests[-1][1][-1]
    return good, good / (end - start)


@question(function="slo_goodput")
def test_slo_goodput(submission: Submission) -> None:
    slo_goodput = submission.function("slo_goodput")
    rng = submission.rng()
    cases = submission.fixed([
        ([(0.0, [0.1, 0.15, 0.2]), (0.5, [0.9, 0.95])], 0.25, 0.06, "one TTFT too slow"),
        ([(0.0, [0.1, 0.3]), (0.1, [0.2, 0.25, 0.3])], 0.25, 0.1, "one TPOT too slow"),
        ([(1.0, [1.05]), (2.0, [2.5])], 0.25, 0.01, "one-token requests: TPOT 0"),
        ([(0.0, [0.25, 0.28125])], 0.25, 0.0625, "TTFT exactly at its bound counts"),
        ([(0.0, [0.125, 0.25, 0.375])], 0.25, 0.125, "TPOT exactly at its bound counts"),
        ([(0.0, [0.125, 0.25, 0.3125, 0.375])], 0.25, 0.1, "uneven gaps: TPOT is their mean"),
        (
            [(0.5, [0.75, 0.875]), (0.0, [2.0]), (0.25, [0.5, 0.625])],
            0.25,
            0.125,
            "requests in no particular order (the first arrival and the last token are the "
            "middle request's)",
        ),
    ])  # fmt: skip
    for _ in range(4):
        requests = []
        for arrival in np.cumsum(rng.exponential(0.1, size=int(rng.integers(2, 8)))):
            first = arrival + rng.exponential(0.2)
            gaps = rng.exponential(0.04, size=int(rng.integers(0, 6)))
            times = (first + np.concatenate([[0.0], np.cumsum(gaps)])).round(4).tolist()
            requests.append((round(float(arrival), 4), times))
        requests = [requests[i] for i in rng.permutation(len(requests))]  # in any order
        cases.append((requests, 0.2, 0.05, f"{len(requests)} random requests"))
    for requests, ttft_slo, tpot_slo, what in cases:
        expected = _slo_goodput(requests, ttft_slo, tpot_slo)
        got = slo_goodput([(a, list(t)) for a, t in requests], ttft_slo, tpot_slo)
        assert isinstance(got, tuple) and len(got) == 2, (
            f"slo_goodput should return (count, per_second), got {got!r}"
        )
        args = (requests, ttft_slo, tpot_slo)
        mistakes = {
            "TPOT divided by the tokens: (last - first token) spans tokens - 1 gaps": lambda: (
                _slo_goodput(*args, gaps=False)
            ),
            "a request exactly at a bound left out: it meets the SLO (TTFT <= and TPOT <=)": (
                lambda: _slo_goodput(*args, bounds_met=False)
            ),
            "the run timed from the first listed request to the last listed one: the requests "
            "come in any order, take the earliest arrival and the latest token": lambda: (
                _slo_goodput(*args, span=False)
            ),
        }
        with naming_mistakes(tuple(got), mistakes, rtol=1e-9, atol=0.0, expected=expected):
            assert got[0] == expected[0], (
                f"{what}: expected {expected[0]} requests meeting TTFT <= {ttft_slo} s and TPOT "
                f"<= {tpot_slo} s, got {got[0]!r} (TTFT = first token - arrival; TPOT = (last - "
                f"first token) / (tokens - 1), 0 for one token; both within the SLO); requests "
                f"{requests}"
            )
            assert abs(got[1] - expected[1]) <= 1e-9 * max(1.0, abs(expected[1])), (
                f"{what}: expected {expected[1]:.6f} requests/s (the count divided by the time "
                f"from the first arrival to the last token of any request), got {got[1]!r}"
            )
