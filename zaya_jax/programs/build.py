"""The run builder: from a config and a layout, the jitted programs of a run (state init, the train
step with all of its inputs, held-out evaluation), their shardings and their abstract inputs.

Training (``zaya_jax.train``), compile-only planning (``zaya train --compile-only``), evaluation of
a run (``zaya eval``), the bench scripts, the test workers and the notebooks all take their programs
from :func:`build_programs`, so the program a memory plan describes is the one training runs:
:func:`fingerprint` of the lowered train step is recorded in a run's ``events.jsonl`` (``compiled``)
and in the plan's report (``train_step_fingerprint``). MaxText's pattern
(``utils/maxtext_utils.py`` builds the step and its shardings once, for training and for AOT
compilation).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zaya_jax.config import Config, MeshConfig
from zaya_jax.data import BATCH_FIELDS, eval_batches
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.loss import Objective, ObjectiveFor, make_eval_step, sequence_logps, token_nll, under_axis_rules
from zaya_jax.loss.policy import sampling_distribution
from zaya_jax.model import Zaya, abstract_variables
from zaya_jax.optim import LeafGroup, build_optimizer, model_param_groups, set_lr_scale
from zaya_jax.parallel import Layout, local_rows, make_layout, put_batch
from zaya_jax.programs.moe import MoeChoice, resolve_moe_impl
from zaya_jax.programs.step import TrainState, init_train_state, make_train_step


def fingerprint(lowered: jax.stages.Lowered) -> str:
    """A short hash of a lowered program's text: equal fingerprints, the same program."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Programs:
    """The programs of one run on one layout. Everything is built on first use, so evaluation does
    not trace the optimizer and planning allocates nothing.

    - ``init``: ``key -> TrainState``, step 0 created directly in its shardings (no device ever
      holds the whole model);
    - ``train_step``: ``(state, batch, lr_scale, loss_limit) -> (state, metrics)``, the state
      donated; ``loss_limit`` (``inf`` for none) makes the step keep the old state on a bad step;
    - ``eval_step``: ``(params, balancing, batch) -> {"weight", **sums}``, the objective's summed
      held-out metrics (:func:`zaya_jax.loss.make_eval_step`).

    ``objective`` binds the run's loss (its spec's, :mod:`zaya_jax.objectives`): the programs
    know no objective by name.
    """

    cfg: Config
    layout: Layout
    objective: ObjectiveFor
    groups: dict[str, LeafGroup] | None = None  # Muon/AdamW grouping (default: the model's)
    moe: MoeChoice | None = None  # how model.moe_impl was resolved (auto: measured or cached)

    @functools.cached_property
    def _stages(self) -> dict[Any, Programs]:
        return {self.cfg.model: self}

    @functools.cached_property
    def _stage_index(self) -> dict[int, Programs]:
        return {}

    def at_stage(self, stage: int) -> Programs:
        """These programs with the model of curriculum ``stage`` (its RoPE, ``train.stages[i].rope``):
        the same state, layout and objective. Stages with the same model share one object; each
        stage's is looked up by its index after the first call (the trainer asks every step)."""
        hit = self._stage_index.get(stage)
        if hit is None:
            model = self.cfg.stage_model(stage)
            if model not in self._stages:
                self._stages[model] = dataclasses.replace(
                    self, cfg=dataclasses.replace(self.cfg, model=model)
                )
            hit = self._stage_index[stage] = self._stages[model]
        return hit

    @functools.cached_property
    def bound(self) -> Objective:
        """The objective with the run's settings bound (what the train step minimises)."""
        return self.objective(self.cfg)

    @functools.cached_property
    def tx(self) -> optax.GradientTransformation:
        shardings = self.layout.update if self.layout.update is not None else self.layout.variables["params"]
        parameters, optim = self.layout.parameters, self.cfg.optim
        shardings = parameters.split(shardings)[0]
        groups = parameters.optimizer_groups(
            shardings,
            lambda: (
                self.groups or model_param_groups(self.cfg.model, optim.router_group, optim.matrix_optimizer)
            ),
        )
        return build_optimizer(
            self.cfg.optim,
            groups,
            self.cfg.train.steps,
            shardings=shardings,
            newton_schulz=self.layout.kernels.newton_schulz,
        )

    def _init(self, key: jax.Array) -> TrainState:
        """Step 0 from the parameter plan's fresh variables (with a frozen base, fresh adapters on it)."""
        parameters = self.layout.parameters
        return init_train_state(parameters.fresh_variables(self.cfg.model, key), self.tx, parameters)

    @functools.cached_property
    def _shapes(self) -> TrainState:
        """The train state's shapes and dtypes: the model's variables' shapes (traced once per model
        config, :func:`~zaya_jax.model.abstract_variables`) through the optimizer's init."""
        if self.layout.parameters.frozen_base:  # the adapters' shapes: from their initialisation
            return jax.eval_shape(self._init, jax.random.key(0))
        variables = abstract_variables(self.cfg.model)
        return jax.eval_shape(lambda v: init_train_state(v, self.tx), variables)

    @functools.cached_property
    def shardings(self) -> TrainState:
        """The train state's shardings (parameters by the rules, optimizer state like them)."""
        return self.layout.state_shardings(self._shapes)

    @functools.cached_property
    def abstract_state(self) -> TrainState:
        """The train state as shapes and dtypes carrying their shardings (nothing allocated)."""
        shapes = self._shapes
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
            shapes,
            self.shardings,
        )

    @functools.cached_property
    def init(self) -> jax.stages.Wrapped:
        return jax.jit(self._init, out_shardings=self.shardings)

    def init_state(self) -> TrainState:
        """Step 0 from ``train.seed``."""
        return self.init(jax.random.key(self.cfg.train.seed))

    @functools.cached_property
    def train_step(self) -> jax.stages.Wrapped:
        layout = self.layout
        return jax.jit(
            make_train_step(
                self.cfg,
                self.tx,
                set_lr_scale,
                update_shardings=layout.update,
                parameters=layout.parameters,
                objective=self.bound,
                **layout.step_hooks,
            ),
            in_shardings=(self.shardings, layout.batch, layout.replicated, layout.replicated),
            out_shardings=(self.shardings, layout.replicated),
            donate_argnums=0,
        )

    @functools.cached_property
    def eval_step(self) -> jax.stages.Wrapped:
        layout = self.layout
        return jax.jit(
            make_eval_step(self.cfg, self.objective, **layout.step_hooks),
            in_shardings=(layout.variables["params"], layout.variables["balancing"], layout.batch),
            out_shardings=layout.replicated,
        )

    def _forward_program(self, forward: Callable[..., jax.Array]) -> jax.stages.Wrapped:
        """``(params, balancing, batch) -> forward(model, params, balancing, batch, loss_chunk)``
        jitted on the layout, its result replicated (forward-only passes outside the train step)."""
        layout = self.layout
        model = Zaya(self.cfg.model, layout.step_hooks["hooks"])
        chunk = self.cfg.train.loss_chunk

        def run(params: dict[str, Any], balancing: dict[str, Any], batch: dict[str, Any]) -> jax.Array:
            return forward(model, params, balancing, batch, chunk)

        return jax.jit(
            under_axis_rules(run, layout.step_hooks["axis_rules"]),
            in_shardings=(layout.variables["params"], layout.variables["balancing"], layout.batch),
            out_shardings=layout.replicated,
        )

    @functools.cached_property
    def sequence_logps_step(self) -> jax.stages.Wrapped:
        """``(params, balancing, batch) -> (batch, seq + 2)`` log-probabilities of each row's
        segments over their trained targets (column s: segment s), replicated: the preference
        objectives' reference pass (:mod:`zaya_jax.objectives.reference`)."""
        return self._forward_program(lambda *args: sequence_logps(*args)[0])

    @functools.cached_property
    def token_logprobs_step(self) -> jax.stages.Wrapped:
        """``(params, balancing, batch) -> (batch, seq)`` log-probability of every target under the
        distribution the run's rollouts are sampled from (``rl.temperature``, ``rl.top_k``,
        ``rl.top_p``, the batch's ``vocab_limit``), replicated: GRPO's reference scores (``rl.kl > 0``)."""
        distribution = sampling_distribution(self.cfg)
        return self._forward_program(lambda *args: -token_nll(*args, distribution=distribution)[0])

    def abstract_batch(self, rows: int | None = None, seq: int | None = None) -> dict[str, Any]:
        """A batch of ``rows`` x ``seq`` tokens (default: the run's final batch) as abstract arrays."""
        rows, seq = rows or self.cfg.train.batch_size, seq or self.cfg.train.seq_len
        fields = {**{k: (v, ()) for k, v in BATCH_FIELDS.items()}, **self.bound.fields}
        return {
            key: jax.ShapeDtypeStruct((rows, seq, *trailing), dtype, sharding=self.layout.batch)
            for key, (dtype, trailing) in fields.items()
        }

    def step_arguments(
        self, state: TrainState, batch: dict[str, Any], lr_scale: float = 1.0, loss_limit: float = np.inf
    ) -> tuple[TrainState, dict[str, Any], jax.Array, jax.Array]:
        """The train step's arguments, the scalars as float32 arrays (as training passes them)."""
        return (state, batch, jnp.asarray(lr_scale, jnp.float32), jnp.asarray(loss_limit, jnp.float32))

    def lower_train_step(self, rows: int | None = None, seq: int | None = None) -> jax.stages.Lowered:
        """The train step lowered from abstract inputs: the program training compiles for batches
        of ``rows`` x ``seq`` tokens."""
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.layout.replicated)
        return self.train_step.lower(self.abstract_state, self.abstract_batch(rows, seq), scalar, scalar)

    def held_out_batches(
        self, tokenizer: Tokenizer, references: Mapping[str, np.ndarray] | None = None
    ) -> list[dict[str, jax.Array]]:
        """The run's held-out batches (``eval.batches`` of ``train.batch_size`` x
        ``train.seq_len``, seed ``train.seed``), this process's rows placed on the mesh.
        ``references``: the preference run's reference log-probabilities (dpo, ipo)."""
        batches = held_out_host_batches(self.cfg, tokenizer, references)
        return [put_batch(local_rows(b), self.layout.batch) for b in batches]


def held_out_host_batches(
    cfg: Config, tokenizer: Tokenizer, references: Mapping[str, np.ndarray] | None = None
) -> list[dict[str, np.ndarray]]:
    """The run's held-out evaluation data as global host batches (the same on every call)."""
    train = cfg.train
    return eval_batches(
        cfg.data,
        tokenizer,
        seq_len=train.seq_len,
        batch_size=train.batch_size,
        num_batches=cfg.eval.batches,
        seed=train.seed,
        references=references,
    )


def build_programs(
    cfg: Config,
    layout: Layout | None = None,
    *,
    objective: ObjectiveFor,
    devices: Sequence[jax.Device] | None = None,
    groups: dict[str, LeafGroup] | None = None,
) -> Programs:
    """The programs of ``cfg`` on ``layout`` (default: ``cfg.mesh`` over ``devices``, all devices
    when None), training ``objective`` (``zaya_jax.objectives.build_programs(cfg)`` passes the
    spec's of ``train.objective``). ``groups`` replaces the model's Muon/AdamW grouping (the benchmarks' all-AdamW).
    ``model.moe_impl: auto`` (:mod:`zaya_jax.programs.moe`) is resolved here and the kernels by the
    layout (``layout.kernels``), so every user of a run's programs runs the same paths;
    ``Programs.cfg`` holds the resolved ``moe_impl``."""
    layout = layout if layout is not None else make_layout(cfg, devices)
    resolved, moe = resolve_moe_impl(cfg, layout)
    return Programs(resolved, layout, objective, groups, moe)


def single_device_programs(
    cfg: Config, objective: ObjectiveFor, device: jax.Device | None = None
) -> Programs:
    """``cfg``'s programs of ``objective`` on one device, whatever mesh the run trained on
    (evaluating a saved model)."""
    one = dataclasses.replace(cfg, mesh=MeshConfig(data=1, rules=cfg.mesh.rules))
    device = device if device is not None else jax.devices()[0]
    return build_programs(one, objective=objective, devices=[device])
