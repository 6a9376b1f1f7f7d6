"""bench/detokenizer.py runs and prints both rows for each length (its figures are not checked: timings)."""

from __future__ import annotations

import sys

from bench import detokenizer


def test_detokenizer_bench_prints_both_rows(smollm2_gguf, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["detokenizer", "--model", smollm2_gguf, "--streams", "2",
                                      "--lengths", "8,40", "--steps", "2"])
    detokenizer.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["8", "40"]
    for label, line in zip(("windowed", "whole"), lines[2:4]):
        assert line.startswith(label) and len(line.split()) >= 4, line
        assert all(float(x) >= 0 for x in line.split()[-2:])
