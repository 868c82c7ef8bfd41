"""TensorBoard's writer thread dying on a failed write (a full disk) stops the run with the storage
error at the next log, where tensorboardX's own queue used to block it for good."""

from __future__ import annotations

import errno
import threading

import pytest

from zaya_jax.train.trackers import TensorBoardTracker


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death
def test_a_failed_tensorboard_write_is_an_error_at_the_next_log_not_a_hang(tmp_path):
    tracker = TensorBoardTracker(tmp_path / "tb")
    writer = tracker._tb.file_writer.event_writer
    failed = threading.Event()

    def write_event(event):
        failed.set()
        raise OSError(errno.EIO, "the write failed")

    writer._ev_writer.write_event = write_event
    tracker.log(1, {"loss": 1.0})
    assert failed.wait(30)  # the writer thread took the event and died on it
    writer._worker.join(30)
    assert not writer._worker.is_alive()
    with pytest.raises(OSError, match="event writer stopped after a failed write"):
        for step in range(2, 40):  # 38 logs: more than tensorboardX's default queue of 10 held
            tracker.log(step, {"loss": 1.0, "lr": 0.1})
