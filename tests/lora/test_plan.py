"""The parameter plan (``zaya_jax.lora.plan``): one record says what a run trains, and nothing
outside ``config/`` and ``lora/`` names the ``lora`` settings; what each plan does with a tree."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures import MINI
from zaya_jax.config import ConfigError, load_config
from zaya_jax.lora.plan import EVERY_PARAMETER, parameter_plan
from zaya_jax.model.lowrank import has_adapters

PACKAGE = Path(__file__).resolve().parents[2] / "zaya_jax"
# Where the lora settings may be named: the section itself and the package that owns adapters (the
# parameter plan included).
OWNERS = ("config", "lora")
SMALL = [o for o in MINI if o.startswith("model.")]  # the miniature model alone
# A LoRA run needs its base (train.init_from; only named here) and no balancing of a frozen router.
ADAPTED = [*SMALL, "train.init_from=BASE", "balancing.enabled=false"]


def _lora_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every identifier in ``source`` that names LoRA: a variable, attribute
    (``cfg.lora``, ``.lora.enabled``), argument, keyword, function, class or imported name. The
    module path of an import (``from zaya_jax.lora.plan import ParameterPlan``) is how the plan is
    reached and is not counted; strings and comments are not code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword):
            names = [node.arg or ""]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [node.asname or node.name]
        else:
            continue
        found += [(node.lineno, name) for name in names if "lora" in name.lower()]
    return found


def test_lora_names_stay_in_config_and_lora():
    """The driver, checkpointing, the programs, the layout and the objectives read the parameter
    plan; none reads ``cfg.lora`` or tests ``lora.enabled`` itself."""
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in OWNERS
        for line, name in _lora_names(path.read_text())
    ]
    assert not offenders, "read the parameter plan (zaya_jax.lora.plan) instead:\n" + "\n".join(offenders)


def test_the_confinement_check_sees_each_kind_of_name():
    source = (
        "import zaya_jax.lora as lora_package\n"
        "from zaya_jax.config import LoraConfig\n"
        "def f(cfg, lora_rank=0):\n"
        "    if cfg.lora.enabled:\n"
        "        return make(lora=1)\n"
        "from zaya_jax.lora.plan import parameter_plan\n"
        "text = 'lora'  # lora in a comment\n"
    )
    names = {name for _, name in _lora_names(source)}
    assert names == {"lora_package", "LoraConfig", "lora_rank", "lora"}


def _variables(plan, model):
    return plan.fresh_variables(model, jax.random.key(0))


def test_a_plan_that_trains_every_parameter_freezes_nothing():
    cfg = load_config("tiny", SMALL)
    plan = parameter_plan(cfg)
    assert plan is EVERY_PARAMETER and not plan.frozen_base and not plan.guards_inert_adapters
    params = _variables(plan, cfg.model)["params"]
    trained, frozen = plan.split(params)
    assert frozen == {} and jax.tree.structure(trained) == jax.tree.structure(params)
    assert plan.saved(params).keys() == params.keys() and plan.reference(params) is None
    assert plan.base_record() is None and plan.frozen(params) is None and plan.describe(cfg.model, 1) == ""
    assert plan.optimizer_groups(trained, lambda: "the model's") == "the model's"
    with pytest.raises(ValueError, match="no adapters to export"):
        plan.save_adapter("unused", cfg.model, params)


def test_a_frozen_base_plan_trains_saves_and_references_the_adapters_alone():
    cfg = load_config(
        "tiny",
        [
            *SMALL,
            "lora.rank=4",
            "lora.base_dtype=bfloat16",
            "train.init_from=BASE",
            "balancing.enabled=false",
        ],
    )
    plan = parameter_plan(cfg)
    assert plan.frozen_base and plan.guards_inert_adapters
    params = _variables(plan, cfg.model)["params"]
    assert has_adapters(params)
    trained, frozen = plan.split(params)
    # what trains is the factors (float32); the frozen base holds its matrices in the base dtype
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(trained))
    assert jnp.dtype(jnp.bfloat16) in {leaf.dtype for leaf in jax.tree.leaves(frozen)}
    assert plan.trained_count(cfg.model) == sum(leaf.size for leaf in jax.tree.leaves(trained))
    joined = plan.join(trained, frozen)
    assert jax.tree.structure(joined) == jax.tree.structure(params)
    # a checkpoint holds the adapters, and the restore puts the base held now under them
    saved = plan.saved(params)
    saved_trained, saved_rest = plan.split(saved)
    assert jax.tree.structure(saved_trained) == jax.tree.structure(trained)
    assert all(np.ndim(x) <= 1 for x in jax.tree.leaves(saved_rest))  # the adapters' scales: no base matrix
    restored = plan.restored(saved, params)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True)
    )
    assert plan.base_record() == {"init_from": "BASE", "dtype": "bfloat16"}
    # every factor trains with AdamW, without weight decay
    groups = plan.optimizer_groups(trained, lambda: pytest.fail("the model's grouping is not asked"))
    assert {(g.group, g.decay) for g in jax.tree.leaves(groups, is_leaf=lambda g: hasattr(g, "group"))} == {
        ("adamw", False)
    }
    # the reference is the same base with every B zero: the base's function
    reference = plan.reference(params)
    b = [x for path, x in jax.tree_util.tree_leaves_with_path(reference) if path[-1].key == "b"]
    assert b and all(not np.any(np.asarray(x)) for x in b)
    assert "LoRA rank 4" in plan.describe(cfg.model, 10**6)


def test_the_inert_adapter_guard_names_what_would_never_train():
    cfg = load_config("tiny", [*ADAPTED, "lora.rank=2", "lora.targets=[experts,attention]"])
    plan = parameter_plan(cfg)
    names = 2 + 5  # the experts' wi, wo and CCA's five projections
    assert plan.refuse_inert(np.zeros(names), 1) is False  # no gradient at all yet: not checked
    assert plan.refuse_inert(np.ones(names), 1) is True
    norms = np.ones(names)
    norms[0] = 0.0
    with pytest.raises(ConfigError, match=r"received no gradient at step 3.*lora\.targets"):
        plan.refuse_inert(norms, 3)
