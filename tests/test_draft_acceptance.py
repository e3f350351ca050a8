"""bench/draft_acceptance.py: the decode steps drafting from a group's siblings would take, against steps worked
by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from draft_acceptance import Sample, main, sample_of, verify_steps  # noqa: E402


def plain(tokens, sampled=None, turn=None) -> Sample:
    n = len(tokens)
    return Sample(list(tokens), sampled or [True] * n, turn or [0] * n)


def test_a_sibling_that_wrote_it_first_drafts_what_is_sampled_next():
    a, b = plain([1, 2, 3, 4, 5]), plain([1, 2, 3, 4, 6])
    # b at position 2 (context 9 1 | 1 2): a's 1 2 was followed by 3 4, which b samples, then its own token
    assert verify_steps([a, b], [9, 1], k=2, n=2, siblings="whole")[1] == (5, 3)
    # k = 1: 1 2 drafts 3 at position 2, kept, the step's own token 4 after it; 3 4 drafts 5 at position 4, rejected
    assert verify_steps([a, b], [9, 1], k=1, n=2, siblings="whole")[1] == (5, 4)


def test_in_lockstep_a_sibling_offers_only_what_it_had_written_when_the_step_began():
    a, b = plain([1, 2, 3, 4, 5]), plain([1, 2, 3, 4, 6])
    # at b's third token a has written 1 2 only: nothing follows its 1 2 yet, so every step samples one token
    assert verify_steps([a, b], [9, 1], k=2, n=2, siblings="lockstep")[1] == (5, 5)
    # a sibling a token ahead in the same text: b's 7 drafts the 8 a wrote after its 7 a step before
    assert verify_steps([plain([7, 8, 9]), plain([0, 7, 8, 9])], [5], k=2, n=1, siblings="lockstep")[1] == (4, 3)
    assert verify_steps([plain([7, 8, 9]), plain([0, 7, 8, 9])], [5], k=2, n=1, siblings="none")[1] == (4, 4)
    # b drafts 1 2 3 4 from the prompt in its first step and runs ahead of a: at its steps 2, 3, 4 a had written
    # 1, 2, 4 tokens (9s), so b's 9 drafts nothing, then one 9 (kept, then its own 9), then one 9 again
    a, b = plain([9, 9, 9, 9, 9, 7, 8]), plain([1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert verify_steps([a, b], [4, 1, 2, 3, 4], k=4, n=1, siblings="lockstep")[1] == (9, 4)
    # b's first step keeps the 3 that the prompt's 3 3 drafts, then samples its 2: a token ahead of a. At b's second
    # step a had written only its 2 (its 1 comes in that same step), so b's 2 drafts nothing; nor does its 1 next
    # (a's 1 has nothing after it yet)
    assert verify_steps([plain([2, 1, 1]), plain([3, 2, 1, 1])], [3, 3], k=2, n=1, siblings="lockstep")[1] == (4, 3)
    # a row's own earlier text drafts: at its second 7 8, the 9 1 after the first, both sampled, in one step
    assert verify_steps([plain([7, 8, 9, 1, 7, 8, 9, 1])], [0], k=2, n=2, siblings="lockstep")[0] == (8, 7)


def test_a_draft_never_crosses_the_end_of_a_turn():
    a = plain([1, 2, 3, 4, 5])
    b = plain([1, 2, 3, 4, 6], sampled=[True, True, True, False, True], turn=[0, 0, 0, 0, 1])
    # b's turn ends at 3 (4 is the tool's): the step at position 2 keeps the drafted 3 and no token after it
    assert verify_steps([a, b], [9, 1], k=2, n=2, siblings="whole")[1] == (4, 4)
    # nor the end of a turn that no forced token follows (an environment's turns)
    two_turns = plain([1, 2, 3, 4, 6], turn=[0, 0, 0, 1, 1])
    assert verify_steps([a, two_turns], [9, 1], k=2, n=2, siblings="whole")[1] == (5, 4)
    b_whole = plain([1, 2, 3, 4, 6])
    assert verify_steps([a, b_whole], [9, 1], k=2, n=2, siblings="whole")[1] == (5, 3)


def test_a_logged_episode_is_tokenized_piece_by_piece():
    record = {"completion": "x", "turns": [
        {"origin": "model", "text": "ab", "info": {"ended": "stop"}},
        {"origin": "tool", "text": "4", "info": {}},
        {"origin": "model", "text": "c", "info": {"ended": "eos"}}]}
    s = sample_of(record, lambda text: [ord(ch) for ch in text], eos=0)
    forced = [ord(ch) for ch in "<result>4</result>"]
    assert s.tokens == [97, 98, *forced, 99, 0]
    assert s.sampled == [True, True] + [False] * len(forced) + [True, True]
    assert s.turn == [0, 0] + [1] * len(forced) + [1, 1]


def test_the_report_runs_on_a_logged_file(tiny_model_dir, tmp_path, capsys):
    rows = [{"update_step": 8, "prompt": "2+2?", "completion": text, "turns": None} for text in ("4 and 4", "4 and 5")]
    path = tmp_path / "completions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(path), "--tokenizer", str(tiny_model_dir), "--k", "2"])
    out = capsys.readouterr().out
    assert "1 groups, 2 samples" in out and all(f"| 2 | {view} |" in out for view in ("none", "lockstep", "whole"))
