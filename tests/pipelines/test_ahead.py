"""The trainer's fetches ahead (``hpsray.actors.ahead``): a batch's inputs are handed over as
soon as they are fetched, before the next batch's keys are, and a fetch nobody took is dropped
when a later batch takes its own; a batch's rows reach the thread that returns them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpsray.actors.ahead import Ahead, Handover


def test_the_inputs_are_handed_over_before_the_next_batchs_keys_arrive():
    ahead = Ahead()
    fetch = ahead.start(7)
    keys_read = threading.Event()
    thread = threading.Thread(target=fetch.run, args=(lambda: "inputs of 7", lambda: keys_read.wait(5) and "keys of 8"))
    thread.start()
    taken = ahead.take(7)
    assert taken is fetch and taken.inputs() == "inputs of 7"  # while the keys' fetch still waits
    assert thread.is_alive()
    keys_read.set()
    assert taken.upcoming() == "keys of 8"
    thread.join()


def test_an_error_is_kept_for_the_training_thread():
    fetch = Ahead().start(1)
    fetch.run(lambda: 1 / 0, lambda: "keys")  # never raises itself
    with pytest.raises(ZeroDivisionError):
        fetch.inputs()
    assert fetch.upcoming() == "keys"


def test_a_batch_takes_its_own_fetch_and_drops_older_ones():
    ahead = Ahead()
    for b in (3, 4, 5):
        ahead.start(b)
    assert ahead.take(9) is None  # never started: train fetches its inputs itself, nothing dropped
    four = ahead.take(4)
    assert four is not None
    assert ahead.take(3) is None  # dropped: its batch will not train
    assert ahead.take(5) is not None and ahead.take(5) is None
    ahead.start(6)
    ahead.clear()
    assert ahead.take(6) is None


def test_a_batchs_rows_reach_the_returning_thread_whichever_side_comes_first():
    """``Trainer.returned`` may start before or after its ``train`` ends: it gets that batch's
    rows either way, or the error that ended the batch (so no write-back stores them)."""
    handover = Handover()
    got: list = []
    waiting = threading.Thread(target=lambda: got.append(handover.take(2)))
    waiting.start()  # returned(2) before train(2) ends
    handover.give(1, "rows of 1")
    assert handover.take(1) == "rows of 1"  # train(1) ended before returned(1)
    assert waiting.is_alive()
    handover.give(2, "rows of 2")
    waiting.join(5)
    assert got == ["rows of 2"]
    handover.give(3, error=ZeroDivisionError("batch 3 failed"))
    with pytest.raises(ZeroDivisionError, match="batch 3 failed"):
        handover.take(3)


def test_a_reset_forgets_the_rows_nobody_took():
    handover = Handover()
    for b in range(3):  # returned() never called for them (a failure between the calls)
        handover.give(b, np.zeros(1000))
    waiting = threading.Thread(target=handover.take, args=(5,))
    waiting.start()  # returned(5) waits for train(5)
    for _ in range(500):
        if len(handover) == 4:
            break
        time.sleep(0.01)
    handover.clear()
    assert len(handover) == 1  # the rows nobody took are gone, the wait for batch 5 is not
    handover.give(5, "rows of 5")
    waiting.join(5)
    assert not waiting.is_alive() and len(handover) == 0
