"""tritonserver's flags may be shortened as getopt_long allows (server
src/command_line_parser.cc): to any prefix that names one flag."""

from __future__ import annotations

import pytest

from trionserve.cli.options import parse_options


def test_a_flag_shortened_to_a_prefix_of_one_flag_is_that_flag(tmp_path):
    # qa/L0_logging: --log-warn="false" is --log-warning=false.
    options, _ = parse_options([f"--model-repository={tmp_path}", "--log-warn=false"])
    assert options.log_warning is False
    options, _ = parse_options([f"--model-repo={tmp_path}", "--log-verb=2"])
    assert options.model_repositories == [tmp_path] and options.log_verbose == 2


@pytest.mark.parametrize("value, level", [("true", 1), ("FALSE", 0), ("3", 3)])
def test_log_verbose_takes_an_integer_or_a_boolean(tmp_path, value, level):
    # Triton's ParseIntBoolOption; docker/sagemaker/serve passes --log-verbose=true.
    options, _ = parse_options([f"--model-repository={tmp_path}", f"--log-verbose={value}"])
    assert options.log_verbose == level


def test_a_prefix_of_several_flags_is_refused_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse_options([f"--model-repository={tmp_path}", "--log-"])
    assert info.value.code == 1
    assert "ambiguous option: --log-" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1024"])
def test_http_max_input_size_not_above_zero_is_refused_in_tritons_words(tmp_path, capsys, value):
    # tritonserver's ParseException text alone (command_line_parser.cc:1411-1417,
    # main.cc:475-480); qa/L0_http counts exactly one such line in the log.
    with pytest.raises(SystemExit) as info:
        parse_options([f"--model-repository={tmp_path}", f"--http-max-input-size={value}"])
    assert info.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Error: --http-max-input-size must be greater than 0."
    assert sum("must be greater than 0" in line for line in lines) == 1
