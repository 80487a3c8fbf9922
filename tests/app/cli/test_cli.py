"""The command line: engine flags come from EngineConfig, the database path is resolved one way
for every command, and `batchscope --help` loads no MLX."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from app.cli import build_parser, main
from app.cli.engine_flags import FLAGS, SWITCHES, engine_config
from engine.config import EngineConfig


def test_engine_flags_default_to_engine_config_and_cover_it():
    args = build_parser().parse_args(["generate", "hello"])
    assert engine_config(args) == EngineConfig()
    settable = {f.name for f in dataclasses.fields(EngineConfig)} - {"step_history"}
    assert set(FLAGS) | set(SWITCHES) == settable


def test_engine_flags_reach_the_config():
    args = build_parser().parse_args(
        ["serve", "--weights", "q4", "--max-num-seqs", "3", "--no-prefix-caching",
         "--batch-invariant", "--kernel-policy", "auto", "--kernel-threshold", "0"])
    config = engine_config(args)
    assert (config.weights, config.max_num_seqs, config.enable_prefix_caching,
            config.batch_invariant, config.kernel_policy, config.kernel_threshold) == (
        "q4", 3, False, True, "auto", 0)


def test_no_async_scheduling_flag():
    assert engine_config(build_parser().parse_args(["serve"])).async_scheduling
    args = build_parser().parse_args(["serve", "--no-async-scheduling"])
    assert not engine_config(args).async_scheduling


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_a_launched_rank_without_tensor_parallel_size_is_refused(tmp_path, monkeypatch, capsys,
                                                                  command):
    """mlx.launch sets MLX_RANK and MLX_HOSTFILE on every rank: serving alone there would
    leave the other ranks waiting for a ring that never forms."""
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "started by a launcher as rank 1" in err and "--tensor-parallel-size" in err


def test_row_kernels_flag_and_its_old_name(capsys):
    args = build_parser().parse_args(["generate", "--row-kernels", "mlx", "hello"])
    assert engine_config(args).row_kernels == "mlx"
    assert capsys.readouterr().err == ""
    # --decode-matmul, the setting's old name: still works, hidden from --help, warned about.
    args = build_parser().parse_args(["serve", "--decode-matmul", "native"])
    assert engine_config(args).row_kernels == "native"
    err = capsys.readouterr().err
    assert err == "batchscope serve: warning: --decode-matmul is deprecated; use --row-kernels\n"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = capsys.readouterr().out
    assert "--row-kernels" in help_text and "--decode-matmul" not in help_text
    with pytest.raises(SystemExit):  # its values are checked as the new flag's
        build_parser().parse_args(["serve", "--decode-matmul", "fast"])


def test_help_loads_no_mlx_nor_the_web_stack():
    code = ("import sys; from app.cli import build_parser; build_parser().format_help(); "
            "heavy = {'mlx', 'mlx_lm', 'starlette', 'sqlalchemy', 'transformers'}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_db_upgrade_uses_batchscope_db(tmp_path, monkeypatch, capsys):
    target = tmp_path / "from-env.db"
    monkeypatch.setenv("BATCHSCOPE_DB", str(target))
    monkeypatch.chdir(tmp_path)
    assert main(["db", "upgrade"]) == 0
    assert target.is_file() and not (tmp_path / "batchscope.db").exists()
    assert str(target) in capsys.readouterr().out
    flagged = tmp_path / "flag.db"
    assert main(["db", "upgrade", "--db", str(flagged)]) == 0  # the flag wins
    assert flagged.is_file()
