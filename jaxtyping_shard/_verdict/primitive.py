"""`jts_check_sharding`: the compile-time check (Auto mesh axes) as a primitive.

A primitive of our own, rather than `jax.debug.inspect_array_sharding`, because the
check must follow JAX's transformations:

- `vmap`: the batching rule records which dims of the batched value are batch
  dims, and the verdict compares the annotation with the sharding XLA chose minus
  those dims (as the Explicit path does, from the per-example type);
- `jvp` / `grad` / `linear_transpose`: the value is checked as a primal; a check
  applied to a tangent has a transpose (it adds no cotangent);
- no effect: a compiled function keeps JAX's C++ dispatch fast path, so
  `jaxtyping_shard.jit` compiles once. A DCE rule keeps the check in the program
  although it has no outputs;
- its lowering (`custom_call`) hands the raw HLO sharding to the verdict, so a
  layout that cannot be written on the mesh (a maximal sharding, a tiling out of
  line with it) is a clean mismatch rather than an internal error, and keys the
  check by what the program is, so that JAX's persistent compilation cache hits.

The check object travels as a parameter (`check`, compared by identity) along with
`batch_dims`, the positions of the batch dims in the value the primitive sees.
"""

from typing import Any

from jax import lax  # noqa: F401  (registers the control-flow DCE rules wrapped below)

# JAX-private names, each used in one function below that says why.
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, partial_eval as pe


try:
    from jax._src.lax.control_flow.loops import while_p  # has no DCE rule
except ImportError:  # pragma: no cover - a JAX that moved it
    while_p = None


check_sharding_p = Primitive("jts_check_sharding")
check_sharding_p.multiple_results = True


def bind(value: Any, check: Any) -> None:
    """Adds `check` on `value`'s sharding to the function being traced."""
    check_sharding_p.bind(value, check=check, batch_dims=())


def _impl(value: Any, *, check: Any, batch_dims: tuple[int, ...]) -> list:
    # Evaluated on a concrete array (a jaxpr interpreted eagerly): the sharding is
    # known now.
    check.on_concrete(value.sharding, batch_dims)
    return []


def _abstract_eval(aval: Any, **_: Any) -> list:
    return []


def _batch(args, dims, *, check, batch_dims):
    (value,), (dim,) = args, dims
    if dim is not None:  # JAX marks an unbatched operand with `None`
        # Positions after the new batch dim move one to the right.
        batch_dims = tuple(sorted((*(b + (b >= dim) for b in batch_dims), dim)))
    check_sharding_p.bind(value, check=check, batch_dims=batch_dims)
    return [], []


def _jvp(primals, tangents, **params):
    return check_sharding_p.bind(*primals, **params), []


def _transpose(cotangents, value, **params):
    # Applied to a tangent (a custom_jvp rule passing it through an annotated
    # helper, `jax.linear_transpose`): the check has no outputs, so it adds nothing
    # to the input's cotangent.
    return [None]


def _dce(used_outputs, *rest):
    # No outputs and no effect, but the check must stay. JAX 0.12 passes
    # `(used_outputs, live_ins, eqn)`, earlier releases `(used_outputs, eqn)`.
    return [True], rest[-1]


check_sharding_p.def_impl(_impl)
check_sharding_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[check_sharding_p] = _batch
ad.primitive_jvps[check_sharding_p] = _jvp
ad.primitive_transposes[check_sharding_p] = _transpose
pe.dce_rules[check_sharding_p] = _dce


def _require_devices_when_lowering(primitive: Any) -> None:
    """Asks JAX to give the lowering its device assignment (it otherwise may not).

    JAX does so only for primitives in a private set, which its own
    `inspect_sharding` joins the same way; without it the lowering cannot name
    the devices the partitioner's HLO sharding refers to.
    """
    dispatch.prim_requires_devices_during_lowering.add(primitive)


_require_devices_when_lowering(check_sharding_p)


def _contains_check(params: dict, depth: int = 0) -> bool:
    """Whether a higher-order primitive's sub-jaxprs hold a sharding check."""
    stack = list(params.values())
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
            continue
        jaxpr = getattr(item, "jaxpr", item)  # a ClosedJaxpr, or a Jaxpr
        eqns = getattr(jaxpr, "eqns", None)
        if eqns is None:
            continue
        for eqn in eqns:
            if eqn.primitive is check_sharding_p:
                return True
            if depth < 16 and _contains_check(eqn.params, depth + 1):
                return True
    return False


def _keep_checks_alive() -> None:
    """Keeps `cond`, `scan`, `while`, inner `jit`s, ... that hold a check.

    The check has no effect (an effect would cost compiled functions JAX's C++
    dispatch fast path), so JAX's dead-code elimination would drop a control-flow
    or call equation whose outputs are all unused (an annotated identity in a
    `cond` branch, say: its output is forwarded out of the `cond`), and the check
    with it. This wraps the DCE rules of JAX's higher-order primitives (a public
    registry, `jax.interpreters.partial_eval.dce_rules`) so that such an equation
    is kept, whole, when it holds a check; every other equation is untouched.
    """
    primitives = {p for p in pe.dce_rules if p is not check_sharding_p}
    if while_p is not None:
        primitives.add(while_p)
    for primitive in primitives:
        rule = pe.dce_rules.get(primitive)
        pe.dce_rules[primitive] = _keeping(rule)


def _keeping(rule: Any) -> Any:
    def dce(used_outputs, *rest):
        # `rest` is `(eqn,)`, or `(live_ins, eqn)` from JAX 0.12 on.
        eqn = rest[-1]
        if rule is not None:
            used_inputs, new_eqn = rule(used_outputs, *rest)
        elif any(used_outputs) or eqn.effects:
            used_inputs, new_eqn = [True] * len(eqn.invars), eqn
        else:
            used_inputs, new_eqn = [False] * len(eqn.invars), None
        if new_eqn is None and _contains_check(eqn.params):
            return [True] * len(eqn.invars), eqn
        return used_inputs, new_eqn

    dce._jts_wrapped = rule  # type: ignore[attr-defined]
    return dce


_keep_checks_alive()
