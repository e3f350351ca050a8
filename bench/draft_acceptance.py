"""How many decode steps drafting from a group's sibling samples would save (issue 47, deliver 3), measured
on the completions a run logged (`completions.jsonl`: every sample of a batch step, `log_completions_steps`).

No draft model: a row's draft is the k tokens that followed the last occurrence of its latest n tokens in a
sibling's text (then the prompt, then its own earlier text), as Seer and prompt-lookup decoding draft. Verified
with exact rejection sampling, a drafted token of a fixed draft is kept exactly when the token sampled there
equals it (a rejection resamples without the drafted token), so the completions the policy sampled tell what
verification would have kept: the drafted tokens that lead and equal the sampled ones. A verification step
yields those plus one sampled token. A row never drafts across its turn's end (a tool call stops it there).

Two views of the siblings' text: `lockstep`, a sibling's tokens up to the row's own count of sampled tokens (one
running batch, every row at the same step), and `ahead`, the siblings' whole completions (the bound that a
schedule decoding some of a group's samples first, as Seer does, could reach). Tokens are the logged texts
tokenized again, piece by piece (the model's turns sampled, the tool's output forced).

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


def sample_of(record: dict, encode, eos: int) -> Sample:
    """A logged completion's pieces tokenized in order: the model's turns (its end token appended where it
    ended at one) sampled, the tool's output (`<result>...</result>`) forced."""
    tokens, sampled, turn, k = [], [], [], 0
    for piece in record.get("turns") or [{"origin": "model", "text": record["completion"], "info": {}}]:
        model = piece["origin"] == "model"
        ids = list(encode(piece["text"] if model else f"<result>{piece['text']}</result>"))
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


def written(sample: Sample) -> list[int]:
    """[c]: how many of sample's tokens are written once c of them were sampled (the forced ones between)."""
    return [p for p, s in enumerate(sample.sampled) if s] + [len(sample.tokens)]


def verify_steps(group: list[Sample], prompt: list[int], k: int, n: int, ahead: bool) -> list[tuple[int, int]]:
    """Per sample: (tokens sampled, verification steps) when each step drafts k tokens from the latest n-gram
    (siblings first, then the prompt, then the row's own text) and keeps what exact verification keeps."""
    indexes, bounds = [Index(s.tokens, n) for s in group], [written(s) for s in group]
    prompt_index = Index(prompt, n)
    out = []
    for i, row in enumerate(group):
        positions = [p for p, s in enumerate(row.sampled) if s]
        j, steps = 0, 0
        while j < len(positions):
            p = positions[j]
            context = prompt + row.tokens[:p]
            draft = []
            if len(context) >= n:
                gram = tuple(context[-n:])
                for other, index in enumerate(indexes):
                    if other != i:
                        bound = len(group[other].tokens) if ahead else bounds[other][min(j, len(bounds[other]) - 1)]
                        draft = index.draft(gram, k, bound)
                        if draft:
                            break
                draft = draft or prompt_index.draft(gram, k, len(prompt)) or indexes[i].draft(gram, k, p)
            def sampled_in_turn(q: int) -> bool:  # position q is the model's, in the turn of position p
                return q < len(row.tokens) and row.sampled[q] and row.turn[q] == row.turn[p]

            kept = 0  # drafted tokens for positions p, p + 1, ... that equal what was sampled there
            while kept < len(draft) and sampled_in_turn(p + kept) and row.tokens[p + kept] == draft[kept]:
                kept += 1
            # and the step's own token after them, unless the turn ended with the last one kept
            j += kept + (1 if kept == 0 or sampled_in_turn(p + kept) else 0)
            steps += 1
        out.append((len(positions), steps))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("completions", nargs="+", type=Path)
    ap.add_argument("--tokenizer", required=True, help="a model folder with the run's tokenizer")
    ap.add_argument("--k", default="2,4,8", help="drafted tokens a step, comma-separated")
    ap.add_argument("--ngram", type=int, default=3, help="tokens a draft's match spans")
    ap.add_argument("--prefill", default="<reasoning>\n", help="the run's prefill, which ends each prompt")
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
    samples = {key: [sample_of(r, encode, tok.eos_token_id) for r in rows] for key, rows in groups.items()}
    prompts = {key: encode(key[2] + "\n" + args.prefill) for key in groups}
    print(f"{len(groups)} groups, {sum(len(v) for v in samples.values())} samples, "
          f"{sum(sum(s.sampled) for v in samples.values() for s in v)} sampled tokens")
    print("| k | siblings | sampled tokens a step (rows) | decode steps of a group's longest row (tokens / steps) |")
    print("| ---: | --- | ---: | ---: |")
    for k in (int(x) for x in args.k.split(",")):
        for ahead in (False, True):
            tokens = steps = longest = longest_steps = 0
            for key, group in samples.items():
                res = verify_steps(group, prompts[key], k, args.ngram, ahead)
                tokens += sum(t for t, _ in res)
                steps += sum(s for _, s in res)
                longest += max(t for t, _ in res)
                longest_steps += max(s for _, s in res)
            print(f"| {k} | {'ahead' if ahead else 'lockstep'} | {tokens / steps:.2f} | {longest / longest_steps:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
