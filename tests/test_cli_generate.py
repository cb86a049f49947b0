"""`anneal generate`: a prompt through the engine in one process; bad input is one line on stderr
and exit status 2 (as `anneal serve`), never a traceback."""

from __future__ import annotations

import pytest

from anneal.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_generate_prints_the_prompt_and_its_continuation(capsys):
    assert main(["generate", "--model", "random:tiny", "--device", "cpu", "--prompt", "Hello", "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and "4 tokens" in err


def test_generate_split_across_two_processes_prints_the_same_text(capsys):
    """--tensor-parallel-size 2: a worker process holds half of each layer (gloo on the CPU); the
    greedy continuation is the one process's."""
    args = ["generate", "--model", "random:tiny", "--device", "cpu", "--prompt", "Hello", "--max-tokens", "6",
            "--temperature", "0"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == whole


@pytest.mark.parametrize("args, needle", [
    (["--tensor-parallel-size", "3"], "do not split 3 ways"),
    (["--plan", "/no/such/plan.json"], "No such file"),
    (["--model", "random:no-such-preset"], "unknown random preset"),
    (["--plan", "{bad}"], "no_such_op"),
    (["--max-tokens", "-3"], "--max-tokens: Input should be greater than or equal to 1 (got -3)"),
    (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0 (got -1.0)"),
])
def test_bad_input_is_one_line_and_status_2(args, needle, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ops": {"no_such_op": {"impl": "x"}}}')
    args = [a.format(bad=bad) for a in args]
    assert main(["generate", "--device", "cpu", "--max-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anneal generate: ") and needle in err and "Traceback" not in err
