"""The four data-parallel facts (docs/tie.md), per op kind, under jax.shard_map on R = 1..4 virtual
CPU devices with deliberately shifted shards — and the negative controls that must break them."""

import jax
import jax.numpy as jnp
import pytest

from twinstep import dp, oracle

REPLICAS = [1, 2, 3, 4]
N = 2  # per replica


def op_cases(rng, count):
    n = count * N
    return [oracle.conv_case(rng, n, 5, 3, 4, 3, 2), oracle.conv_case(rng, n, 6, 3, 4, 1, 2),
            oracle.conv_case(rng, n, 5, 3, 4, 7, 2, False, "conv"),
            oracle.conv_case(rng, n, 5, 3, 3, 5, 2, True, "shift"),
            oracle.conv_case(rng, n, 5, 3, 3, 3, 1, True, "grouped"),
            oracle.bn_train_case(rng, n, 3, 4), oracle.relu_case(rng, n, 4, 3),
            oracle.maxpool_case(rng, n, 5, 3), oracle.gap_case(rng, n, 4, 3),
            oracle.dense_case(rng, n, 6, 5), oracle.add_case(rng, n, 3, 2),
            oracle.mask_case(rng, n, 3, 2, True), oracle.mask_case(rng, n, 3, 2, False)]


@pytest.mark.parametrize("count", REPLICAS)
def test_sharding_collectives_homogeneity(count, rng):
    for case in op_cases(rng, count):
        for check in oracle.check_dp_facts(case, count, rng, shift=1.0):
            assert check.ok, check


@pytest.mark.parametrize("count", REPLICAS)
@pytest.mark.parametrize("kind", ["ce", "bce"])
def test_divisor(count, kind, rng):
    assert oracle.check_divisor(kind, count, rng).ok


@pytest.mark.parametrize("count", [2, 3, 4])
def test_bn_controls_fail(count, rng):
    """Per-replica statistics break sharding; shard-statistics gamma breaks the gamma collective
    (and nothing else); a sum where a mean belongs breaks both."""
    case = oracle.bn_train_case(rng, count * N, 3, 4)

    def verdict(control):
        return {c.check: c.ok for c in oracle.check_dp_facts(case, count, rng, control=control)}

    assert verdict("none") == {"sharding": True, "homogeneity": True, "collectives": True}
    assert verdict("unsynced")["sharding"] is False
    assert verdict("shard-gamma") == {"sharding": True, "homogeneity": True, "collectives": False}
    sums = verdict("sum")
    assert sums["sharding"] is False and sums["collectives"] is False


@pytest.mark.parametrize("count", [2, 4])
def test_gradient_sum_control_fails(count, rng):
    """Summing weight gradients where the mean belongs gives R x the node: the collective fact
    fails."""
    case = oracle.conv_case(rng, count * N, 4, 2, 3, 3, 1)
    checks = {c.check: c.ok for c in oracle.check_dp_facts(case, count, rng, control="sum")}
    assert checks["collectives"] is False


@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("kind", ["ce", "bce"])
def test_wrong_divisor_control_fails(count, kind, rng):
    assert not oracle.check_divisor(kind, count, rng, control="wrong-divisor").ok


@pytest.mark.parametrize("count", [2, 4])
def test_unshifted_shards_also_tie(count, rng):
    """The shift makes Chan's correction term O(1); the sync check passes with or without it."""
    case = oracle.bn_train_case(rng, count * N, 3, 4)
    assert all(c.ok for c in oracle.check_dp_facts(case, count, rng, shift=0.0))


@pytest.mark.parametrize("count", [2, 3, 4])
def test_naive_variance_exchange_loses_precision(count, rng):
    """f32 shards sharing an offset of 1e4: Chan's form stays at the f32 resolution of the data
    (ulp(1e4) ~ 1e-3 against unit variance); E[x^2] - E[x]^2 loses every digit."""
    chan, naive = oracle.variance_exchange_errors(count, rng, offset=1e4)
    assert chan < 1e-3
    assert naive > 0.1
    assert naive > 100 * chan


def test_a_replicated_tree_can_be_donated_without_freeing_the_original():
    """dp.replicate copies: a program that donates the replicated tree leaves the original
    readable (device_put with may_alias=False alone handed device 0 the original buffer)."""
    original = {"a": jnp.arange(4.0)}
    replicated = dp.replicate(original, 2)
    jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t), donate_argnums=0)(replicated)
    assert replicated["a"].is_deleted() and not original["a"].is_deleted()
    assert float(original["a"].sum()) == 6.0
