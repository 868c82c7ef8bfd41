"""Where the pure train step used to live; it is :mod:`zaya_jax.programs.step` now, jitted with its
shardings by :func:`zaya_jax.programs.build_programs`. These names keep old imports working."""

from zaya_jax.programs.step import TrainState, init_train_state, make_train_step

__all__ = ["TrainState", "init_train_state", "make_train_step"]
