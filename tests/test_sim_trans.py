"""The model of the trans kernel's barrier protocol (benchmarks/sim_trans_protocol.py): clean on random block
histories, and each deliberate break of the protocol is caught (a model that never fails would prove nothing)."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_trans_protocol.py"
_spec = importlib.util.spec_from_file_location("sim_trans_protocol", _PATH)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def test_protocol_is_clean():
    assert sim.sweep(1500) is None


@pytest.mark.parametrize(
    "mutation, kind",
    [
        ("no_p_empty_wait", sim.Hazard),
        ("no_stats_full_wait", sim.Hazard),
        ("no_full_wait_ahead", sim.Hazard),
        ("producer_parity", sim.Deadlock),
        ("value1_no_release", sim.Deadlock),
    ],
)
def test_each_mutation_is_caught(mutation, kind):
    failure = sim.sweep(3000, mutation)
    assert isinstance(failure, kind), (mutation, failure)


def test_unknown_mutation_is_refused():
    with pytest.raises(AssertionError):
        sim.run(0, "no_such_rule")
