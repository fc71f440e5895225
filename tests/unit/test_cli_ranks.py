"""``offload ...`` under torchrun (issue 26 review): an error a rank other than 0 prints says
which rank it is, as ``scripts/finetune_100b.py`` does; without torchrun's variables (or on
rank 0) the line is unchanged."""

from __future__ import annotations

import pytest

from offload.cli import main


@pytest.mark.parametrize("rank, world, tag", [("1", "2", " (rank 1)"), ("0", "2", ""), (None, None, "")])
def test_an_error_line_names_a_rank_other_than_0(tmp_path, monkeypatch, capsys, rank, world, tag):
    for name, value in (("RANK", rank), ("WORLD_SIZE", world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert main(["checkpoint", "verify", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"offload: error{tag}: "), err
