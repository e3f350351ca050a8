"""bench/learning_report.py's paired comparison, against references written from the formulas: the exact McNemar
test (the binomial outcomes at least as far from an even split as the one observed), the pairing of two
evaluations of the same questions, and the published figures of the calculator chains recomputed from their
records' per-question files."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("learning_report", ROOT / "bench" / "learning_report.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def mcnemar_reference(b: int, c: int) -> float:
    """P(X as far or farther from (b + c) / 2 than b) for X ~ Binomial(b + c, 1/2), capped at 1."""
    n = b + c
    far = abs(b - n / 2)
    return min(1.0, sum(math.comb(n, i) / 2 ** n for i in range(n + 1) if abs(i - n / 2) >= far))


@pytest.mark.parametrize("b,c", [(0, 0), (1, 0), (0, 5), (3, 3), (7, 2), (78, 34), (84, 30), (162, 64), (56, 50)])
def test_mcnemar_is_the_binomial_tail_of_the_discordant_pairs(report, b, c):
    assert report.mcnemar(b, c) == pytest.approx(mcnemar_reference(b, c), rel=1e-12, abs=1e-300)
    assert report.mcnemar(b, c) == report.mcnemar(c, b)


def test_p_values_are_written_as_the_docs_write_them(report):
    assert [report.p_text(p) for p in (1.0, 0.39, 0.0799, 0.004, 0.0012, 0.00097, 4.25e-7, 5.52e-11, 3.9e-5)] == \
        ["1", "0.39", "0.08", "0.004", "0.0012", "0.00097", "4e-7", "6e-11", "4e-5"]
    assert report.p_text(report.mcnemar(3000, 0)) == "< 1e-300"  # the tail underflows a float


def test_pairs_are_the_same_questions_in_order(report):
    before = [{"prompt": p, "correct": c} for p, c in (("a", 1), ("b", 0), ("c", 0), ("d", 1))]
    after = [{"q": hashlib.sha1(p.encode()).hexdigest()[:12], "correct": c}
             for p, c in (("a", 0), ("b", 1), ("c", 1), ("d", 1))]  # a record's .csv keys its questions by q
    assert report.paired(before, after) == (4, 2, 3, 2, 1)
    with pytest.raises(ValueError, match="seed 3: not the same questions in the same order"):
        report.paired(before, after[::-1], "seed 3")


def test_runs_pool_per_recipe_over_the_same_questions(report, tmp_path, capsys):
    """Seeds of one recipe pool; another recipe, or a run on other questions, does not join its pool."""
    def write(name, correct, prompts="abcd"):
        (tmp_path / name).write_text("".join(f'{{"prompt": "{p}", "correct": {c}, "lenient": {c}, "formatted": 1}}\n'
                                             for p, c in zip(prompts, correct)))

    write("math-s1-sft.jsonl", [0, 0, 1, 0])
    write("math-s1-trained.jsonl", [1, 1, 1, 0])
    write("math-s2-sft.jsonl", [0, 1, 0, 0])
    write("math-s2-trained.jsonl", [1, 1, 0, 1])
    write("code-s1-base.jsonl", [0, 0, 0, 0])
    write("code-s1-trained.jsonl", [1, 1, 1, 1])
    write("math-s3-sft.jsonl", [0, 0, 0, 0], "wxyz")
    write("math-s3-trained.jsonl", [1, 0, 0, 0], "wxyz")
    report.main([tmp_path, tmp_path / "."])  # the same folder twice counts once
    out = capsys.readouterr().out
    assert out.count("| math-s1 | sft |") == 1
    assert "| code-s1, base -> trained | 0/4 = 0.0% [0.0, 49.0] -> 4/4 = 100.0% [51.0, 100.0] | +100.0 | 4 / 0," in out
    assert "pooled" not in out  # math's seed 3 has other questions: no pool of math, none of code with math
    (tmp_path / "math-s3-sft.jsonl").unlink()
    (tmp_path / "math-s3-trained.jsonl").unlink()
    report.main([tmp_path])
    out = capsys.readouterr().out
    assert "| math pooled over 2, sft -> trained | 2/8 = 25.0%" in out and "-> 6/8 = 75.0%" in out
    assert "| +50.0 | 4 / 0, p = 0.12 |" in out and "code pooled" not in out  # 2 / 0 and 2 / 0: 2 * 2^-4


def test_the_published_calculator_chains_come_out_of_their_records():
    """docs/learning.md's seed-42, seed-7 and seed-1234 rows as shipped and their pooled row, from the records' .csv
    files."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learning_report.py"),
                          "bench/records/h200-session38-20261129/chain", "bench/records/h200-session41-20261129/chain",
                          "bench/records/h200-session42-20261129/chain"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=True).stdout
    assert "| +3.3 | 78 / 34, p = 4e-5 |" in out and "| +4.1 | 84 / 30, p = 4e-7 |" in out
    assert "| +3.6 | 84 / 36, p = 1e-5 |" in out
    pooled = ("| gsm8k_tools pooled over 3, sft -> trained | 249/3957 = 6.3% [5.6, 7.1] -> 395/3957 = 10.0% "
              "[9.1, 11.0] | +3.7 | 246 / 100, p = 2e-15 |")
    assert pooled in out


def test_tools_report_rows_match_its_header(tmp_path):
    """bench/tools_report.py: each evaluation's row has the header's five columns, its last the share of answers
    that called the calculator with its interval (in place of accuracy_row's bare share), read from the file once."""
    import json

    rows = [{"prompt": f"q{i}", "correct": i % 2, "lenient": i % 2, "formatted": 1, "tool_calls": i % 3}
            for i in range(10)]
    for preset, run in (("arith", "arith"), ("arith_tools", "arith-tools")):
        for stage in ("base", "trained"):
            (tmp_path / f"{preset}-{stage}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"time_step_s": 1.0, "reward_mean": 0.5, "tool_call_rate": 0.3, "completion_length_mean": 40})
            for _ in range(6)))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tools_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("\n\n")[0].splitlines()
    assert len(table) == 6 and {line.count("|") for line in table} == {6}
    assert table[2] == ("| arith base | 5/10 = 50.0% [23.7, 76.3] | 5/10 = 50.0% [23.7, 76.3] | "
                        "10/10 = 100.0% [72.2, 100.0] | 6/10 = 60.0% [31.3, 83.2] |")
