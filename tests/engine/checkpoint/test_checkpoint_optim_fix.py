"""engine.checkpoint.optim_fix: megatron's distributed optimizer on the torch Adam fallback must still need it.

The patched path is covered by test_checkpoint_megatron (exact resume with the distributed optimizer).
Here the same resume runs with one or more of the fix's patches left out, i.e. with megatron-core as
shipped for that fault: each case passes while the fault is there and fails, telling the maintainer to
narrow ``optim_fix.AFFECTED`` (or drop that patch), once upstream resumes exactly without it.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.resume_drill import (
    MODEL,
    assert_exact_resume,
    assert_same_tensors,
    differing_tensors,
    run_pair,
)

ALL = ["state_dict", "_set_main_param_and_optimizer_states", "load_state_dict"]

# (patches left out, how megatron-core 0.16.1 then fails; None: it loads but does not resume exactly)
CASES = {
    "fault1-fresh-optimizer-assert": (ALL, "assert len(steps) == 1"),
    "fault2-missing-step-key": (ALL[1:], "KeyError: 'step'"),
    "fault3-shared-step-tensor": (ALL[2:], None),  # loads, then Adam's step drifts
}


@pytest.mark.parametrize("case", list(CASES))
def test_unpatched_megatron_still_breaks_the_resume(tmp_path: Path, case: str) -> None:
    unpatched, failure = CASES[case]
    par = {"global_batch_size": 8, "micro_batch_size": 4, "distributed_optimizer": True}
    try:
        a, b, a_dump, b_dump = run_pair(
            tmp_path, 1, {"model": MODEL, "parallel": par, "unpatched": unpatched}
        )
    except RuntimeError as e:
        assert failure is not None and failure in str(e), f"{case}: the resume failed differently:\n{e}"
        return
    assert failure is None, f"{case}: expected the resume to fail with {failure!r}, it ran"
    assert_same_tensors(a_dump / "save2.rank0.pt", b_dump / "loaded.rank0.pt")
    wrong = differing_tensors(a_dump / "save4.rank0.pt", b_dump / "save4.rank0.pt")
    if any(name.endswith(".step") for name in wrong):
        return  # loads right, then Adam's steps drift: one tensor shared by all parameters
    assert_exact_resume(a, b, a_dump, b_dump, world=1)  # anything else wrong: a different fault
    pytest.fail(
        f"{case}: megatron-core {version('megatron-core')} resumes the torch-Adam distributed optimizer "
        f"exactly without optim_fix's {unpatched} patches: upstream fixed it; exclude this version from "
        "optim_fix.AFFECTED (drop the fix when no supported version needs it)"
    )


def test_fix_is_gated_to_affected_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.checkpoint import optim_fix

    assert optim_fix.needed(), "megatron-core here falls back to torch Adam and is in AFFECTED"
    monkeypatch.setattr(optim_fix, "AFFECTED", ((0, 0), (0, 1)))
    assert not optim_fix.needed()
    assert not optim_fix.apply() and not optim_fix.applied()
