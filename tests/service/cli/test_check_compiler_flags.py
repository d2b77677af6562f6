"""`optdrift check` on a tree whose optdrift.toml carries a compiler flag off the allow-list
(issue 43): exit 2 (bad input) with one line naming the field and the flag, before any build."""

from pathlib import Path

from typer.testing import CliRunner

from service.cli import app

runner = CliRunner()


def test_check_refuses_a_wrapper_flag_with_exit_2_naming_it(tmp_path: Path) -> None:
    (tmp_path / "optdrift.toml").write_text('[build]\nkind = "torch-extension"\n'
                                            'cflags = ["-march=native", "-wrapper", "sh,src/wrap.h"]\n')
    (tmp_path / "ops.cpp").write_text("// kernels\n")
    result = runner.invoke(app, ["check", "--source", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "build.cflags[1] '-wrapper' is not an allowed compiler flag" in result.output
    assert "remove it" in result.output
