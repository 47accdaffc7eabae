"""The plan command's answer to a bad model folder: one line and exit status 2, no traceback; by either name."""

import pytest

from hf_lowzero.trainer.plan_cli import main as plan_main


def test_a_config_json_that_is_not_json_gets_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exited:
        plan_main(["--model", str(tmp_path), "--device-memory", "1GiB"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"the config file at '{tmp_path / 'config.json'}' is not a valid JSON file" in err
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # nothing written beside it
    assert (tmp_path / "config.json").read_text() == "{not json"  # nor into it


@pytest.mark.slow  # a plan in a subprocess (10 s); the first name is an 11-line runpy entry
def test_the_commands_first_name_runs_the_same_command(tmp_path):
    """``python -m hf_lowzero.plan``, the name scripts were written with, runs the command that moved to
    ``trainer/``: the same one line and exit status for the same bad folder."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "hf_lowzero.plan", "--model", str(tmp_path), "--device-memory",
                           "1GiB"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"the config file at '{tmp_path / 'config.json'}' is not a valid JSON file" in done.stderr.splitlines()[-1]
