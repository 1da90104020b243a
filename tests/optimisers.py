"""The optax optimisers the optimiser-state tests run over, and a small module."""

import equinox as eqx
import jax
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import Float


optax = pytest.importorskip("optax")


class Dense(eqx.Module):
    w: Float[Array, "a b", P("data", "model")]
    b: Float[Array, "b", P("model")]  # noqa: F821


OPTIMISERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "chain_clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=4),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=1e-3
    ),
}


def _masks(p):
    return jax.tree.map(lambda x: x.ndim == 2, p)


def _labels(p):
    return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", p)


# Every optax transformation here keeps per-parameter state that optax's own
# `tree_map_params` (the oracle of tests/test_like_every_path.py) can read; all
# exist at the supported floor (optax 0.2.5) too.
TRANSFORMS = {
    **OPTIMISERS,
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adamax": lambda: optax.adamax(1e-3),
    "adamaxw": lambda: optax.adamaxw(1e-3),
    "nadam": lambda: optax.nadam(1e-3),
    "nadamw": lambda: optax.nadamw(1e-3),
    "radam": lambda: optax.radam(1e-3),
    "amsgrad": lambda: optax.amsgrad(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3),
    "adagrad": lambda: optax.adagrad(1e-3),
    "adadelta": lambda: optax.adadelta(1e-3),
    "rmsprop_centered": lambda: optax.rmsprop(1e-3, centered=True),
    "lamb": lambda: optax.lamb(1e-3),
    "lars": lambda: optax.lars(1e-3),
    "novograd": lambda: optax.novograd(1e-3),
    "yogi": lambda: optax.yogi(1e-3),
    "adan": lambda: optax.adan(1e-3),
    "rprop": lambda: optax.rprop(1e-3),
    "optimistic_gd": lambda: optax.optimistic_gradient_descent(1e-3),
    "ema": lambda: optax.ema(0.9),
    "apply_every": lambda: optax.apply_every(2),
    "trust_ratio": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_trust_ratio()
    ),
    "masked": lambda: optax.masked(optax.adam(1e-3), _masks),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(1e-3), "vector": optax.sgd(0.1, momentum=0.9)},
        _labels,
    ),
    "contrib_muon": lambda: optax.contrib.muon(1e-3),
    "contrib_prodigy": lambda: optax.contrib.prodigy(),
    "contrib_dadapt_adamw": lambda: optax.contrib.dadapt_adamw(),
    "contrib_schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-3),
    "contrib_ademamix": lambda: optax.contrib.ademamix(1e-3),
    "contrib_sophia": lambda: optax.contrib.sophia(1e-3),
    "contrib_cocob": lambda: optax.contrib.cocob(),
    "contrib_mechanize": lambda: optax.contrib.mechanize(optax.adam(1e-3)),
    "contrib_momo_adam": lambda: optax.contrib.momo_adam(),
    "contrib_acprop": lambda: optax.contrib.acprop(1e-3),
    "contrib_reduce_on_plateau": lambda: optax.chain(
        optax.adam(1e-3), optax.contrib.reduce_on_plateau()
    ),
}

# States with no parameter-shaped part: every leaf replicated, by the same rule.
NO_MOMENTS = {
    "sgd_schedule": lambda: optax.sgd(optax.linear_schedule(0.1, 0.0, 10)),
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=0),
}

# Left out: `tree_map_params` cannot read their state (the oracle fails on it).
OUTSIDE_THE_ORACLE = {
    "sm3": lambda: optax.sm3(1e-3),  # a moment per dim, not per parameter
    "lbfgs": lambda: optax.lbfgs(),  # a memory of parameters, stacked
}
