"""The budget: `--target-size 600G` (bytes of tensor data, as --dry-run counts them; the size grammar of every
size option, kimi_convert.sizes: K/M/G/T powers of 1000, a trailing B alike, KiB/MiB/GiB/TiB powers of 1024)
or `--target-bpw 2.5` (bits per weight: the same budget divided by the model's weight count). Checked before any
tensor is read: a bad value, or a budget below the floor / above the ceiling of what the candidate types make,
is one line and exit 1."""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from ...errors import KimiError
from ...sizes import parse_size



class BudgetError(KimiError):
    """A budget that is not a size, or that no choice of candidate types can meet."""


@dataclass(frozen=True)
class Budget:
    """What the user asked for: exactly one of `size` (bytes) and `bpw`, and the option spelled as given."""
    size: int | None
    bpw: Decimal | None
    spelled: str                # "--target-size 600G", for messages

    def nbytes(self, n_weights: int) -> int:
        """The budget in bytes of tensor data, for a model of `n_weights` elements (bpw: rounded down)."""
        if self.size is not None:
            return self.size
        return int(self.bpw * n_weights / 8)


def parse_budget(target_size: str | None, target_bpw: str | None) -> Budget | None:
    """The Budget the options give, None if neither is given; BudgetError (one line) for a bad value."""
    if target_size is not None and target_bpw is not None:
        raise BudgetError("--target-size and --target-bpw exclude each other: give one budget")
    if target_size is not None:
        return Budget(parse_target_size(target_size), None, f"--target-size {target_size}")
    if target_bpw is not None:
        return Budget(None, parse_target_bpw(target_bpw), f"--target-bpw {target_bpw}")
    return None


def parse_target_size(text: str) -> int:
    n = parse_size(text, "--target-size", BudgetError)
    if n <= 0:
        raise BudgetError(f"--target-size {text!r}: must be more than 0 bytes")
    return n


def parse_target_bpw(text: str) -> Decimal:
    try:
        bpw = Decimal(text.strip())
    except InvalidOperation:
        bpw = None
    if bpw is None or not bpw.is_finite():
        raise BudgetError(f"--target-bpw {text!r}: not a number of bits per weight, e.g. 2.5")
    if bpw <= 0:
        raise BudgetError(f"--target-bpw {text!r}: must be more than 0 bits per weight")
    return bpw


def decimal_size(n: int) -> str:
    """Bytes as the budget is spelled (powers of 1000), with enough digits to tell floor from budget."""
    for unit, scale in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if n >= scale:
            return f"{n / scale:.4g} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def check_feasible(budget: Budget, budget_bytes: int, floor: int, ceiling: int, n_weights: int,
                   what: str = "file") -> None:
    """Refuse a budget outside [floor, ceiling]: the smallest file the candidate types make, and the file with
    every free tensor kept at its least-error candidate (more bytes than that buy nothing)."""
    def bpw(n: int) -> str:
        return f"{8 * n / max(n_weights, 1):.4g} bpw"
    if budget_bytes < floor:
        raise BudgetError(f"{budget.spelled}: {decimal_size(budget_bytes)} is below the smallest {what} these "
                          f"types make, {decimal_size(floor)} ({bpw(floor)}); the largest worth making is "
                          f"{decimal_size(ceiling)} ({bpw(ceiling)})")
    if budget_bytes > ceiling:
        raise BudgetError(f"{budget.spelled}: {decimal_size(budget_bytes)} is above the largest {what} worth "
                          f"making, {decimal_size(ceiling)} ({bpw(ceiling)}: every free tensor at its least-error "
                          f"type); the smallest these types make is {decimal_size(floor)} ({bpw(floor)})")


