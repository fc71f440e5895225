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


def test_a_bad_flag_under_torchrun_is_said_by_rank_0_alone(monkeypatch, capsys):
    """Every rank parses the same command line: rank 0 prints the usage error, the others exit
    with the same status in silence (review of issue 27, R3)."""
    import pytest

    from offload.cli import main

    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exc:
            main(["finetune", "--preset", "tiny", "--bogus-flag"])
        assert exc.value.code == 2
        assert ("unrecognized arguments: --bogus-flag" in capsys.readouterr().err) is says
