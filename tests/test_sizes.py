"""One size grammar for every size option (kimi_convert.sizes): --target-size, --gpu-budget, --split-max-size and
kimi-imatrix's --state-ram read the same spellings, with the same units, and refuse the same non-sizes."""
from __future__ import annotations

from pathlib import Path

import pytest

from kimi_convert.cli.common import parse_size as cli_parse_size
from kimi_convert.errors import KimiError
from kimi_convert.quant.target.budget import BudgetError, parse_target_size
from kimi_convert.sizes import MAX_FILE_SIZE, parse_size

ACCEPTED = [
    ("600000000000", 600 * 10**9), ("600G", 600 * 10**9), ("600GB", 600 * 10**9), ("600 gb", 600 * 10**9),
    ("600g", 600 * 10**9), ("1.1G", 1_100_000_000), ("0.5M", 500_000), (".5K", 500), ("5.", 5), ("5B", 5),
    ("80GiB", 80 * 2**30), ("1.5 TiB", 3 * 2**39), ("64kib", 65536), ("2MB", 2_000_000), ("1T", 10**12),
    ("1TB", 10**12), ("3MiB", 3 * 2**20),
]
REFUSED = ["", "G", "GB", "five", "5Gi", "5GBB", "5 G B", "1e9", "1e400G", "infG", "nanG", "inf", "--5G", "5X",
           "5KG", "0x10", "5,000"]


@pytest.mark.parametrize("text, n", ACCEPTED)
def test_every_size_option_reads_the_same_bytes(text, n):
    from kimi_convert.cli.policy_options import target_options
    assert parse_size(text, "--x") == n
    assert cli_parse_size(text, "--split-max-size") == n         # --split-max-size, --state-ram
    assert parse_target_size(text) == n
    t = target_options(text, None, text, None, Path("im.gguf"), None)
    assert t.budget.size == n and t.gpu_budget == n


@pytest.mark.parametrize("text", REFUSED)
def test_every_size_option_refuses_the_same_non_sizes(text):
    from kimi_convert.cli.policy_options import target_options
    for option, call, error in [
            ("--split-max-size", lambda: cli_parse_size(text, "--split-max-size"), KimiError),
            ("--target-size", lambda: parse_target_size(text), BudgetError),
            ("--gpu-budget", lambda: target_options("2M", None, text, None, Path("im.gguf"), None), BudgetError)]:
        with pytest.raises(error) as e:
            call()
        assert f"{option} {text!r}: not a size" in str(e.value) and "\n" not in str(e.value)
        assert "GiB" in str(e.value) and "powers of 1000" in str(e.value)      # the grammar, named


def test_signs_and_bounds_are_each_options_own():
    assert parse_size("-5G", "--x") == -5 * 10**9      # read, so that the option names its bound
    with pytest.raises(BudgetError, match="must be more than 0 bytes"):
        parse_target_size("-5G")
    with pytest.raises(KimiError, match="more than any file can hold"):
        parse_size("99999999999999999999T", "--x")
    assert parse_size(str(MAX_FILE_SIZE), "--x") == MAX_FILE_SIZE
