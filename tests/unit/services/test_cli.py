"""The `shuttle` command (services/cli.py): --version, and `serve MODEL`, vLLM's positional
form of --model."""

from __future__ import annotations

import pytest

from services.cli import main, version


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == version() != ""


def test_serve_takes_the_model_as_its_first_argument(capsys: pytest.CaptureFixture[str]) -> None:
    # the folder is checked before anything starts: the error names the positional model
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/nonexistent/model-folder", "--port", "0"])
    assert exit_.value.code == 2
    assert "--model /nonexistent/model-folder: no config.json there" in capsys.readouterr().err


def test_serve_refuses_two_different_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "/a", "--model", "/b"])
    assert "the model is given twice" in capsys.readouterr().err
