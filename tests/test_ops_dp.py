"""The four data-parallel facts (docs/tie.md), per op kind, under jax.shard_map on R = 1..4 virtual
CPU devices with deliberately shifted shards — and the negative controls that must break them."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from twinstep import dp, program, recipes
from twinstep.checking import cases, oracle
from twinstep.nets import get_net

REPLICAS = [1, 2, 3, 4]
N = 2  # per replica


def op_cases(rng, count):
    n = count * N
    return [cases.conv_case(rng, n, 5, c_in=3, c_out=4, k=3, stride=2),
            cases.conv_case(rng, n, 6, c_in=3, c_out=4, k=1, stride=2),
            cases.conv_case(rng, n, 5, c_in=3, c_out=4, k=7, stride=2, path="conv"),
            cases.conv_case(rng, n, 5, c_in=3, c_out=3, k=5, stride=2, depthwise=True,
                            path="shift"),
            cases.conv_case(rng, n, 5, c_in=3, c_out=3, k=3, stride=1, depthwise=True,
                            path="grouped"),
            cases.bn_train_case(rng, n, 3, 4), cases.relu_case(rng, n, 4, 3),
            cases.maxpool_case(rng, n, 5, 3), cases.gap_case(rng, n, 4, 3),
            cases.dense_case(rng, n, 6, 5), cases.add_case(rng, n, 3, 2),
            cases.mask_case(rng, n, 3, 2, per_example=True),
            cases.mask_case(rng, n, 3, 2, per_example=False), cases.relu6_case(rng, n, 4, 3),
            cases.silu_case(rng, n, 4, 3), cases.sigmoid_case(rng, n, 5),
            cases.gate_case(rng, n, 3, 4), cases.bias_case(rng, n, 3, 4)]


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
    case = cases.bn_train_case(rng, count * N, 3, 4)

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
    case = cases.conv_case(rng, count * N, 4, c_in=2, c_out=3, k=3, stride=1)
    checks = {c.check: c.ok for c in oracle.check_dp_facts(case, count, rng, control="sum")}
    assert checks["collectives"] is False


@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("kind", ["ce", "bce"])
def test_wrong_divisor_control_fails(count, kind, rng):
    assert not oracle.check_divisor(kind, count, rng, control="wrong-divisor").ok


@pytest.mark.parametrize("count", [2, 4])
def test_unshifted_shards_also_tie(count, rng):
    """The shift makes Chan's correction term O(1); the sync check passes with or without it."""
    case = cases.bn_train_case(rng, count * N, 3, 4)
    assert all(c.ok for c in oracle.check_dp_facts(case, count, rng, shift=0.0))


@pytest.mark.parametrize("count", [2, 3, 4])
def test_naive_variance_exchange_loses_precision(count, rng):
    """f32 shards sharing an offset of 1e4: Chan's form stays within the worst case that
    rounding its means can leave (`oracle.chan_bound`: 0.067 to 0.11 for 64 rows a shard at
    R = 2..4, where dropping the (mu_r - mu)^2 term errs by 0.2 to 0.56, more than the bound);
    E[x^2] - E[x]^2 loses every digit, 100 times Chan's error and more."""
    chan, naive, bound = oracle.variance_exchange_errors(count, rng, offset=1e4)
    assert chan <= bound
    dropped = count**2 - 1  # the share of the variance that the (mu_r - mu)^2 term holds
    assert bound < dropped / (12 + dropped)
    assert naive > 0.1
    assert naive > 100 * chan


@pytest.mark.parametrize("env, want", [({}, 3), ({"JAX_NUM_CPU_DEVICES": "5"}, 5)])
def test_ensure_devices_asks_for_exactly_the_replicas(env, want):
    """No more virtual devices than asked for (each one slows the others' programs), unless
    more were already asked for; in a fresh process, since the count is fixed at JAX's start."""
    code = ("from twinstep import dp; dp.ensure_devices(3); dp.ensure_devices(2); import jax; "
            "print(jax.device_count())")
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"} | env
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert int(out.stdout.split()[-1]) == want


def test_a_replicated_tree_can_be_donated_without_freeing_the_original():
    """dp.replicate copies: a program that donates the replicated tree leaves the original
    readable (device_put with may_alias=False alone handed device 0 the original buffer)."""
    original = {"a": jnp.arange(4.0)}
    replicated = dp.replicate(original, 2)
    jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t), donate_argnums=0)(replicated)
    assert replicated["a"].is_deleted() and not original["a"].is_deleted()
    assert float(original["a"].sum()) == 6.0


@pytest.mark.parametrize("count", [1, 2])
def test_a_program_fed_its_placed_state_then_its_outputs_compiles_once(count, caplog):
    """dp.replicate puts a tree where the program's outputs live — at one replica too, committed
    to the first device: a step mapped as the train step is, called with its placed state and
    then with its own new state, compiles once (counted in JAX's compile log). The control, an
    uncommitted tree, as dp.place returned at one replica until 2026-12-04, compiles twice: it
    made `twinstep train` at R = 1 compile its train step a second time."""
    def compiles(tree) -> int:
        def total(x):  # the whole batch's sum, on every replica
            return x.sum() if count == 1 else jax.lax.psum(x.sum(), dp.AXIS)

        step = dp.replica_map(lambda t, x: jax.tree.map(lambda a: a + total(x), t), count,
                              ({"a": dp.REPLICATED}, dp.BATCH), {"a": dp.REPLICATED})
        batch = jax.device_put(np.ones(2 * count),  # placed as the loop places its batches
                               jax.devices()[0] if count == 1 else
                               jax.sharding.NamedSharding(dp.mesh(count), dp.BATCH))
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level("WARNING"):
            step(step(tree, batch), batch)
        return sum("Finished XLA compilation" in r.getMessage() for r in caplog.records)

    assert compiles(dp.replicate({"a": np.arange(4.0)}, count)) == 1
    if count == 1:
        assert compiles({"a": jnp.arange(4.0)}) == 2


@pytest.mark.parametrize("count", [1, 2])
def test_a_program_compiled_ahead_from_placed_shapes_takes_what_place_puts(count):
    """`dp.placed_shapes` says where `dp.place` puts each leaf (sliced, or whole): a program
    compiled from them alone, as the trainer compiles its step, takes the placed tree and then
    its own outputs. The control, a leaf placed otherwise (replicated where it is sliced; at one
    replica, on the second device), is refused: jit would have compiled the program again."""
    tree = {"moment": jnp.arange(8.0), "weight": jnp.arange(3.0)}
    specs = {"moment": dp.slice_spec((8,), count), "weight": dp.REPLICATED}
    shapes = dp.placed_shapes(tree, specs, count)
    step = jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t),
                   out_shardings=jax.tree.map(lambda a: a.sharding, shapes))
    compiled = step.lower(shapes).compile()
    once = compiled(dp.place(tree, specs, count))
    assert float(compiled(once)["moment"].sum()) == 28.0 + 16
    wrong = dp.place(tree, dp.REPLICATED, count) if count > 1 else jax.device_put(
        tree, jax.devices()[1])
    with pytest.raises(ValueError, match="shardings"):
        compiled(wrong)


def test_a_donated_weight_read_after_its_update_is_not_copied():
    """The backward reads a weight its own update does not wait for; XLA:CPU's default copy
    insertion then copies the donated weight every step, `dp.jit`'s options do not (the default
    options are the control: they must copy, or this check could not tell the two apart)."""
    def step(w, x):
        y = jnp.tanh(x @ w)
        return w - 0.1 * (x.T @ y), y @ w.T  # the new weight, and dx: a read of the old one

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    lowered = dp.jit(step, donate=(0,)).lower(w, x)
    assert lowered.compile().as_text().count("copy(") == 0
    off = {k: False for k in dp.CPU_OPTIONS}
    assert lowered.compile(off).as_text().count("copy(") == 1


# Four 5x5 depthwise convolutions of one input and their gradients in float64, which XLA:CPU runs
# as dense convolutions over C x C kernels it builds first (docs/platform.md#scheduling-on-cpu).
GROUPED_F64 = """
import jax, jax.numpy as jnp
from jax import lax
from twinstep import dp
dp.ensure_devices(1)
jax.config.update("jax_enable_x64", True)
def f(x, ws):
    return sum(lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=128,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")).sum()
               for w in ws)
x, w = (jax.ShapeDtypeStruct(s, jnp.float64) for s in ((1, 8, 8, 128), (5, 5, 1, 128)))
compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, [w] * 4).compile()
print(compiled.memory_analysis().temp_size_in_bytes)
"""


def test_xla_cpu_orders_a_program_for_memory():
    """twinstep asks XLA:CPU for its memory-minimising order (`settings.OWN_XLA_FLAGS`, set by
    `dp.ensure_devices` before XLA starts): four float64 depthwise convolutions, whose dense
    3 MiB kernels XLA's concurrency-optimised order builds all before it runs any, need at most
    half its temporaries (6.3 against 15.8 MiB measured). The control, that order asked for in
    XLA_FLAGS, must take at least twice ours, or this check could not tell them apart; and a
    flag the user set is theirs to keep."""
    def temporaries(**env) -> int:
        base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        done = subprocess.run([sys.executable, "-c", GROUPED_F64], env={**base, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    ours = temporaries()
    control = temporaries(XLA_FLAGS="--xla_cpu_enable_concurrency_optimized_scheduler=true")
    assert 2 * ours <= control, (ours, control)
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in os.environ["XLA_FLAGS"]


def test_the_optimizer_state_is_laid_out_in_slices_and_placed_so():
    """Each replica holds 1/R of every optimizer-state tensor (its first dimension R divides), the
    rest of the state whole; `place` puts each leaf so, copying (the step donates the state)."""
    assert dp.slice_spec((6, 4), 2) == P(dp.AXIS)
    assert dp.slice_spec((3, 4), 2) == P(None, dp.AXIS)
    assert dp.slice_spec((3, 5), 2) == dp.slice_spec((), 2) == dp.REPLICATED
    made = program.train_program(get_net("mnv4"), recipes.parse("mnv4in_adamdp2"),
                                 program.Setup(replicas=2), classes=10)
    specs = made.in_specs[0]
    mu = specs.opt_state[0].mu
    assert set(mu) == set(made.state.params) and mu["conv_stem.weight"] != dp.REPLICATED
    assert all(sp == dp.slice_spec(made.state.params[k].shape, 2) for k, sp in mu.items())
    assert {sp for sp in jax.tree.leaves((specs.params, specs.buffers, specs.step),
                                         is_leaf=lambda x: isinstance(x, P))} == {dp.REPLICATED}
    original = {"m": jnp.arange(8.0).reshape(4, 2), "count": jnp.zeros(())}
    placed = dp.place(original, {"m": P(dp.AXIS), "count": P()}, 2)
    assert [s.data.shape for s in placed["m"].addressable_shards] == [(2, 2), (2, 2)]
    assert placed["count"].sharding.is_fully_replicated
    jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t), donate_argnums=0)(placed)
    assert placed["m"].is_deleted() and float(original["m"].sum()) == 28.0


@pytest.mark.parametrize("count,packed", [(2, True), (4, True), (4, False)])
def test_the_gradient_mean_in_slices_is_the_whole_means_slices(count, packed, rng):
    """With slice dimensions each replica gets block r of the mean along each tensor's
    dimension (reduce-scatter), a tensor with none the whole mean — in buckets or tensor by
    tensor; the `sum` control breaks it."""
    shapes = {"a": (4, 3), "b": (3, 4), "c": (3, 5)}
    grads = {k: jnp.asarray(rng.standard_normal((count, *s)), jnp.float32)
             for k, s in shapes.items()}  # replica r's gradients are grads[k][r]
    dims = {k: dp.slice_dim(s, count) for k, s in shapes.items()}
    assert dims == {"a": 0, "b": 1, "c": None}

    def reduced(control):
        rep = dp.replicas(count, control)
        return jax.jit(dp.per_replica(
            lambda g: rep.grad_mean({k: v[0] for k, v in g.items()}, dims, packed),
            dp.mesh(count),
            (dp.BATCH,), {k: dp.slice_spec(s, count) for k, s in shapes.items()}))

    # a and b share one bucket, or go one reduce-scatter each
    text = reduced("none").lower(grads).as_text()
    assert text.count("stablehlo.reduce_scatter") == (1 if packed else 2)
    out, summed = reduced("none")(grads), reduced("sum")(grads)
    for k, g in grads.items():
        np.testing.assert_allclose(out[k], g.mean(0), rtol=1e-6, atol=1e-7)
        assert not np.allclose(summed[k], g.mean(0), rtol=1e-3)
