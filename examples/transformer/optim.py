"""The optimiser: optax's `chain(clip_by_global_norm, adamw)`, not annotated.

optax maps over the parameters' tree, so each moment of its state is a
`Transformer` carrying the model's own field annotations: `jts.sharded_init`
creates every moment in its parameter's shards, `jts.abstract` lays out an
Orbax restore target the same way, and the step's boundary checks them by key
path. The step counts and other scalars are replicated.
"""

import optax


LEARNING_RATE, B1, B2, EPS, WEIGHT_DECAY, CLIP = 1e-2, 0.9, 0.99, 1e-8, 1e-4, 1.0

optimizer = optax.chain(
    optax.clip_by_global_norm(CLIP),
    optax.adamw(LEARNING_RATE, B1, B2, EPS, weight_decay=WEIGHT_DECAY),
)
