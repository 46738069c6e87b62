"""The quantization options kimi-quantize and kimi-convert --policy share, as one frozen object, and the reading of
what they name (the policy, its --tensor-type rules, the imatrix) before any heavy work."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import KimiError

if TYPE_CHECKING:
    from .imatrix import Imatrix
    from .plan import PlanOptions
    from .policy import Policy
    from .target.choose import TargetOptions


def quiet(_: object) -> None:
    """A job's `note` or `reading` when nobody listens."""
    return None


@dataclass(frozen=True)
class PolicyOptions:
    """--policy and the options that shape a quantized file. `policy`: a TOML file, a preset or one of
    llama-quantize's file types; None with a `target` (--target-size / --target-bpw) is a budget with no BASE."""
    policy: str | None = None
    imatrix: Path | None = None
    tensor_type: tuple[str, ...] = ()
    tensor_type_file: tuple[Path, ...] = ()
    allow_requantize: bool = False
    strict: bool = False
    target: "TargetOptions | None" = None

    @property
    def plan(self) -> "PlanOptions":
        """How the policy is applied (quant.plan.PlanOptions): what every plan of the run is made with."""
        from .plan import PlanOptions
        return PlanOptions(self.allow_requantize, self.strict)

    @property
    def quantizes(self) -> bool:
        return self.policy is not None or self.target is not None

    def check_given(self) -> None:
        """Without --policy or a budget, the options that apply to quantization are a mistake (kimi-convert)."""
        if self.quantizes:
            return
        given = [flag for flag, value in (("--imatrix", self.imatrix), ("--tensor-type", self.tensor_type),
                                          ("--tensor-type-file", self.tensor_type_file),
                                          ("--allow-requantize", self.allow_requantize), ("--strict", self.strict))
                 if value]
        if given:
            raise KimiError(f"{given[0]} applies to quantization: give --policy POLICY too")

    def load(self, *, plan_only: bool, note: Callable[[str], None] = quiet,
             reading: Callable[[object], None] = quiet) -> "tuple[Policy, Imatrix | None]":
        """(policy, imatrix or None), with the policy's requirements checked (`plan_only`: a --dry-run or
        --explain, which only notes what a write would refuse). `reading(path)` is told each file as it is read."""
        from .imatrix import load_imatrix
        from .policy import load_policy, tensor_type_rules
        if self.policy is None:
            if self.target is None:
                raise KimiError("give --policy POLICY (a file or preset: --list-presets), or a budget: "
                                "--target-size SIZE / --target-bpw BPW")
            from .target.choose import no_base
            pol = no_base()
        else:
            reading(self.policy)         # and its --tensor-type rules
            pol = load_policy(self.policy)
        pol = pol.with_tensor_types(tensor_type_rules(list(self.tensor_type), list(self.tensor_type_file)),
                                    list(self.tensor_type_file))
        for line in pol.check_requirements(imatrix=self.imatrix is not None, allow_requantize=self.allow_requantize,
                                           plan_only=plan_only):
            note(line)
        if self.imatrix is None:
            return pol, None
        reading(self.imatrix)
        return pol, load_imatrix(self.imatrix)
