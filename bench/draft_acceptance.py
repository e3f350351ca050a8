"""How many decode steps drafting from a group's sibling samples would save (issue 47, deliver 3), measured
on the completions a run logged (`completions.jsonl`: every sample of the batch step it logs every
`log_completions_steps` updates; with dynamic sampling, the groups trained, whose rewards differ).

No draft model: a row's draft is the k tokens that followed the last occurrence of its latest n tokens in a
sibling's text (then the prompt, then its own earlier text), as Seer and prompt-lookup decoding draft. Verified
with exact rejection sampling, a drafted token of a fixed draft is kept exactly when the token sampled there
equals it (a rejection resamples without the drafted token), so the completions the policy sampled tell what
verification would have kept: the drafted tokens that lead and equal the sampled ones. A verification step
yields those plus one sampled token. A row never drafts across its turn's end (a tool call stops it there).

A group's rows advance together, step by step, as in one running batch; three views of the siblings' text:
`none` (only the prompt and the row's own text), `lockstep` (what each sibling had written when the step began)
and `whole` (the siblings' whole completions: a ceiling no schedule reaches, since some rows must decode first).
Tokens are the logged texts tokenized again, piece by piece: the model's turns sampled, the tool's output forced
(rendered with --forced, the calculator's `<result>...</result>` by default); the prompt is the question and the
prefill, without the system prompt.

usage: python bench/draft_acceptance.py COMPLETIONS.jsonl [...] --tokenizer MODEL_DIR [--k 2,4,8] [--ngram 3]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    """One completion: its tokens, which of them the model sampled, and the turn each one belongs to."""

    tokens: list[int]
    sampled: list[bool]
    turn: list[int]


def sample_of(record: dict, encode, eos: int, forced: str = "<result>{}</result>") -> Sample:
    """A logged completion's pieces tokenized in order: the model's turns (its end token appended where it
    ended at one) sampled, the tool's output (`forced` with the output in its braces) forced."""
    tokens, sampled, turn, k = [], [], [], 0
    for piece in record.get("turns") or [{"origin": "model", "text": record["completion"], "info": {}}]:
        model = piece["origin"] == "model"
        ids = list(encode(piece["text"] if model else forced.format(piece["text"])))
        if model and piece["info"].get("ended") == "eos":
            ids.append(eos)
        tokens += ids
        sampled += [model] * len(ids)
        turn += [k] * len(ids)
        k += model
    return Sample(tokens, sampled, turn)


class Index:
    """Where each n-gram of a token list ends (the positions after it), for the last occurrence before a bound."""

    def __init__(self, tokens: list[int], n: int):
        self.tokens, self.ends = tokens, defaultdict(list)
        for p in range(n, len(tokens) + 1):
            self.ends[tuple(tokens[p - n:p])].append(p)

    def draft(self, gram: tuple, k: int, bound: int) -> list[int]:
        """The tokens after gram's last occurrence that ends at most `bound` tokens in, within tokens[:bound]."""
        ends = self.ends.get(gram)
        if not ends:
            return []
        i = bisect.bisect_right(ends, bound - 1) - 1  # an occurrence with at least one token after it
        return self.tokens[ends[i]:min(ends[i] + k, bound)] if i >= 0 else []


SIBLINGS = ("none", "lockstep", "whole")


def sampled_in_turn(row: Sample, p: int, q: int) -> bool:
    """Whether position q of row holds a token the model sampled in the turn of position p."""
    return q < len(row.tokens) and row.sampled[q] and row.turn[q] == row.turn[p]


def verify_steps(group: list[Sample], prompt: list[int], k: int, n: int, siblings: str) -> list[tuple[int, int]]:
    """Per sample: (tokens sampled, verification steps) when every row of the group steps together, each step
    drafting k tokens after the row's latest n-gram (siblings first, seen as `siblings` says, then the prompt,
    then the row's own text) and keeping what exact verification keeps."""
    indexes, prompt_index = [Index(s.tokens, n) for s in group], Index(prompt, n)
    positions = [[p for p, s in enumerate(row.sampled) if s] for row in group]
    at, steps = [0] * len(group), [0] * len(group)  # per row: its sampled tokens so far, its steps
    while any(a < len(ps) for a, ps in zip(at, positions)):
        # what each row had written when this step began: up to its next sampled token, the forced ones included
        begun = [ps[a] if a < len(ps) else len(row.tokens) for a, ps, row in zip(at, positions, group)]
        for i, row in enumerate(group):
            if at[i] == len(positions[i]):
                continue
            p = positions[i][at[i]]
            context, draft = prompt + row.tokens[:p], []
            if len(context) >= n:
                gram = tuple(context[-n:])
                for other, index in enumerate(indexes):
                    if siblings != "none" and other != i:
                        draft = index.draft(gram, k, len(group[other].tokens) if siblings == "whole" else begun[other])
                        if draft:
                            break
                draft = draft or prompt_index.draft(gram, k, len(prompt)) or indexes[i].draft(gram, k, p)
            kept = 0  # drafted tokens for positions p, p + 1, ... that equal what was sampled there
            while kept < len(draft) and sampled_in_turn(row, p, p + kept) and row.tokens[p + kept] == draft[kept]:
                kept += 1
            # and the step's own token after them, unless the turn ended with the last one kept
            at[i] += kept + (1 if kept == 0 or sampled_in_turn(row, p, p + kept) else 0)
            steps[i] += 1
    return [(len(ps), s) for ps, s in zip(positions, steps)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("completions", nargs="+", type=Path)
    ap.add_argument("--tokenizer", required=True, help="a model folder with the run's tokenizer")
    ap.add_argument("--k", default="2,4,8", help="drafted tokens a step, comma-separated")
    ap.add_argument("--ngram", type=int, default=3, help="tokens a draft's match spans")
    ap.add_argument("--prefill", default="<reasoning>\n", help="the run's prefill, which ends each prompt")
    ap.add_argument("--forced", default="<result>{}</result>",
                    help="how the tool's output was rendered ({}: the output)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for path in args.completions:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                groups[(str(path), r.get("update_step"), r["prompt"])].append(r)
    samples = {key: [sample_of(r, encode, tok.eos_token_id, args.forced) for r in rows] for key, rows in groups.items()}
    prompts = {key: encode(key[2] + "\n" + args.prefill) for key in groups}
    print(f"{len(groups)} groups, {sum(len(v) for v in samples.values())} samples, "
          f"{sum(sum(s.sampled) for v in samples.values() for s in v)} sampled tokens")
    print("| k | siblings | sampled tokens a step (rows) | decode steps of a group's longest row (tokens / steps) |")
    print("| ---: | --- | ---: | ---: |")
    for k in (int(x) for x in args.k.split(",")):
        for siblings in SIBLINGS:
            tokens = steps = longest = longest_steps = 0
            for key, group in samples.items():
                res = verify_steps(group, prompts[key], k, args.ngram, siblings)
                tokens += sum(t for t, _ in res)
                steps += sum(s for _, s in res)
                longest += max(t for t, _ in res)
                longest_steps += max(s for _, s in res)
            print(f"| {k} | {siblings} | {tokens / steps:.2f} | {longest / longest_steps:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
