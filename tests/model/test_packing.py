"""Packed sequences: no information crosses a document boundary (attention, both convolutions and
the delayed value restart at each document), so a document's logits are the same packed or alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.random_model import random_variables, tiny_config
from zaya_jax.model import Zaya, positions_in_document


def test_positions_restart_in_every_document():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3], [5, 5, 5, 5, 5, 5]])
    assert positions_in_document(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize(("k0", "k1"), [(2, 2), (3, 2), (2, 4)])
def test_document_logits_identical_packed_and_alone(k0, k1):
    cfg = tiny_config(cca_time0=k0, cca_time1=k1, moe_impl="dense")
    variables = random_variables(cfg, seed=k0 * 10 + k1)
    rng = np.random.default_rng(0)
    doc_a, doc_b, doc_c = (rng.integers(3, cfg.vocab_size, size=n) for n in (7, 9, 4))
    packed = np.concatenate([doc_a, doc_b, doc_c])[None]
    segments = np.repeat([1, 2, 3], [7, 9, 4])[None]
    model = jax.jit(Zaya(cfg).apply)

    logits_packed, _ = model(variables, jnp.asarray(packed), segment_ids=jnp.asarray(segments))
    logits_packed = np.asarray(logits_packed)[0]
    # Each document alone, right-padded to the packed length (causality: padding after a token
    # cannot change its logits), so one compiled shape serves every call.
    start = 0
    for doc in (doc_a, doc_b, doc_c):
        alone = np.concatenate([doc, np.full(packed.shape[1] - len(doc), 3)])[None]
        logits_alone, _ = model(variables, jnp.asarray(alone))
        np.testing.assert_allclose(
            logits_packed[start : start + len(doc)],
            np.asarray(logits_alone)[0, : len(doc)],
            atol=2e-6,
            rtol=0,
        )
        start += len(doc)

    # Without segment ids the second document sees the first: the check above is not vacuous.
    leaky, _ = model(variables, jnp.asarray(packed))
    assert np.abs(np.asarray(leaky)[0, 7:16] - logits_packed[7:16]).max() > 1e-2


def test_packing_isolates_the_first_token_of_a_document():
    """The t=0 position of a document is exactly where conv halos and the delayed value could leak."""
    cfg = tiny_config(cca_time0=3, cca_time1=3, moe_impl="dense")
    variables = random_variables(cfg, seed=7)
    model = jax.jit(Zaya(cfg).apply)
    doc = [5, 9, 11]
    seg = jnp.asarray([[0, 0, 1, 1, 1]])
    alone, _ = model(variables, jnp.asarray([[*doc, 3, 3]]), segment_ids=jnp.asarray([[1, 1, 1, 2, 2]]))
    for prefix in ([3, 4], [40, 50]):
        out, _ = model(variables, jnp.asarray([[*prefix, *doc]]), segment_ids=seg)
        np.testing.assert_allclose(np.asarray(out)[0, 2:], np.asarray(alone)[0, :3], atol=2e-6, rtol=0)
