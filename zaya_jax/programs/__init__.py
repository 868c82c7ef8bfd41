"""The jitted programs of a run, built once (:func:`build_programs`) for training, planning,
evaluation, the benchmarks and the notebooks; the pure train step they jit (:mod:`.step`)."""

from zaya_jax.programs.build import (
    Programs,
    build_programs,
    fingerprint,
    held_out_host_batches,
    single_device_programs,
)
from zaya_jax.programs.step import TrainState, init_train_state, make_train_step

__all__ = [
    "Programs",
    "TrainState",
    "build_programs",
    "fingerprint",
    "held_out_host_batches",
    "init_train_state",
    "make_train_step",
    "single_device_programs",
]
