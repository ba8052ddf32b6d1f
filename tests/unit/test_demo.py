"""Tests for deadpool/demo.py's verdict: the demo exits 1 unless the run with a failure ends bit for bit as the
reference (the whole demo runs from an installed wheel in tests/integration/test_install.py)."""

from deadpool.demo import compared

FAULTY = {"final_state_sha256": "ab", "losses": {"0": [2.5, 2.25]}, "final_loss": 2.25, "swaps": 1}


def test_equal_states_and_losses_are_bitwise_equal_and_keep_the_runs_summary():
    summary = compared(FAULTY, {**FAULTY, "swaps": 0})
    assert summary == {**FAULTY, "reference_final_loss": 2.25, "reference_state_sha256": "ab",
                       "loss_sequence_equal": True, "bitwise_equal": True}


def test_another_final_state_is_not_bitwise_equal_even_with_the_same_losses():
    summary = compared(FAULTY, {**FAULTY, "final_state_sha256": "cd"})
    assert (summary["loss_sequence_equal"], summary["bitwise_equal"]) == (True, False)


def test_one_loss_apart_in_its_last_bit_is_not_bitwise_equal():
    reference = {**FAULTY, "losses": {"0": [2.5, 2.2500000000000004]}}
    summary = compared(FAULTY, reference)
    assert (summary["loss_sequence_equal"], summary["bitwise_equal"]) == (False, False)
