"""Parity against timm (the external oracle): the same network, the same random weights, in
PyTorch — logits in train and eval mode, every parameter gradient against torch autograd, and
the running buffers after one step. Needs the ``[oracle]`` extra (torch, timm); the product
never imports this module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import program
from twinstep.checking.bounds import grad_err, rel
from twinstep.nets import init
from twinstep.ops import loss as losses
from twinstep.ops.precision import get_precision

# Bounds: logits relative to max |logit|; gradients and buffers norm-relative per tensor.
# In f32 only the logits are judged: two f32 implementations that sum in different orders
# differ in gradients by what BN's few-row statistics amplify (seen: 4e-2 at 64², batch 4),
# which says nothing about the network; the f64 run is the gradient check.
# f32 logits have no fixed bound: timm's own f32 logits differ from its f64 logits by an amount
# that changes with torch's thread count (8.1e-5 on one thread, 5.2e-5 on two, ResNet-50 at
# 64², batch 4, train mode), and twinstep's differ from timm's by about 1.4 times that. The
# bound is F32_ORACLE_FACTOR times timm's own f32 error, measured in the same run.
LOGITS_BOUND = {"f64": 1e-9, "f32": None}
F32_ORACLE_FACTOR = 3
GRAD_BOUND = {"f64": 1e-8, "f32": None}
BUFFER_BOUND = {"f64": 1e-9, "f32": None}


class OracleMissing(RuntimeError):
    pass


def _torch():
    try:  # lazy: the [oracle] extra, maybe absent (OracleMissing, one line)
        import timm
        import torch
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise OracleMissing(
            "parity needs the [oracle] extra (torch, timm): pip install -e '.[oracle]' "
            "(or run `make test`, which installs it)") from e
    return torch, timm


def to_timm(net, params: dict, buffers: dict, num_classes: int, dtype="float64", **timm_kwargs):
    """timm's model of ``net`` with our parameters and running statistics loaded (strict)."""
    torch, timm = _torch()
    model = timm.create_model(net.TIMM_NAME, pretrained=False, num_classes=num_classes,
                              **timm_kwargs)
    model = model.to(getattr(torch, dtype))
    state = model.state_dict()
    ours = {**params, **buffers}
    for name in state:
        if name.endswith("num_batches_tracked"):
            continue
        if name not in ours:
            raise KeyError(f"timm's {net.TIMM_NAME} has {name}, twinstep's {net.NAME} does not")
        state[name] = torch.tensor(np.asarray(ours[name]), dtype=state[name].dtype)
    extra = set(ours) - set(state)
    if extra:
        raise KeyError(f"twinstep's {net.NAME} has tensors timm's lacks: {sorted(extra)[:5]}")
    model.load_state_dict(state)
    return model


@dataclasses.dataclass
class ParityReport:
    net: str
    precision: str
    loss: str
    logits_train_err: float
    logits_eval_err: float
    grad_errs: dict  # name -> norm-relative error, timm order
    buffer_err: float
    logits_bounds: tuple = (None, None)  # (train, eval): LOGITS_BOUND's, or f32's derived ones

    @property
    def worst_grad(self) -> tuple[str, float]:
        name = max(self.grad_errs, key=self.grad_errs.get)
        return name, self.grad_errs[name]

    @property
    def ok(self) -> bool:
        p = self.precision

        def within(err, bound):
            return bound is None or err <= bound

        return (within(self.logits_train_err, self.logits_bounds[0])
                and within(self.logits_eval_err, self.logits_bounds[1])
                and within(self.worst_grad[1], GRAD_BOUND[p])
                and within(self.buffer_err, BUFFER_BOUND[p]))


def loss_and_targets(kind: str, labels, num_classes: int):
    """(our targets [N, K] as `step.grad_step` takes them, timm's criterion, torch targets) for
    integer labels."""
    torch, _ = _torch()
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy  # lazy: [oracle]

    onehot = np.eye(num_classes)[labels]
    if kind == "ce":
        return (onehot, LabelSmoothingCrossEntropy(losses.LABEL_SMOOTHING),
                torch.tensor(labels))
    # timm's BinaryCrossEntropy default smoothing, its targets transformed as the step expects
    return (losses.bce_targets(onehot, 0.1), BinaryCrossEntropy(smoothing=0.1),
            torch.tensor(labels))


def run_parity(net, *, res: int = 64, batch: int = 2, precision: str = "f64", loss: str = "ce",
               num_classes: int = 10, seed: int = 0, params=None, buffers=None,
               tamper=None, fast_compile: bool = False) -> ParityReport:
    """One train step and one eval forward of ``net`` in twinstep and in timm, same weights.

    ``tamper(params) -> params`` changes twinstep's copy only: a negative control.
    ``fast_compile``: XLA compiles twinstep's two programs as `dp.FAST_COMPILE`.

    At 32² and batch 2, ResNet-50's layer4 runs at 1x1 with 2 rows per BN: each such BN maps its
    two values to +-1 up to eps, amplifying the relative error of their difference; nine in a
    row turn 1e-16 into ~1e-7 in both implementations. Parity is checked where the nets are
    well conditioned (64², or batch >= 4)."""
    torch, _ = _torch()
    prec = get_precision(precision)
    if prec.name not in LOGITS_BOUND:
        raise ValueError(f"parity runs in f64 or f32, not {prec.name}")
    if prec.name == "f64" and not jax.config.jax_enable_x64:
        raise RuntimeError("f64 parity needs jax_enable_x64")
    key = jax.random.key(seed)
    shapes = net.param_shapes(num_classes)
    if params is None:
        params = init.init_params(key, shapes, dtype=prec.dtype, linear=net.LINEAR_INIT)
        buffers = init.init_buffers(shapes, prec.dtype)
        params, buffers = init.randomize_bn(jax.random.fold_in(key, 1), params, buffers)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, res, res, 3))
    labels = rng.integers(0, num_classes, batch)
    targets, criterion, tlabels = loss_and_targets(loss, labels, num_classes)

    ours = tamper(params) if tamper else params
    xj = jnp.asarray(x, prec.dtype)
    setup = program.Setup(precision=prec)
    out = program.grad_program(net, setup, loss=loss, fast_compile=fast_compile)(
        ours, buffers, xj, jnp.asarray(targets, prec.dtype))
    logits, grads, new_buffers = out.logits, out.grads, out.buffers
    eval_logits = program.eval_program(net, setup, fast_compile=fast_compile)(ours, buffers, xj)

    tdtype = "float64" if prec.name == "f64" else "float32"
    model = to_timm(net, params, buffers, num_classes, tdtype)
    tx = torch.tensor(x.transpose(0, 3, 1, 2), dtype=getattr(torch, tdtype))
    model.eval()  # first: the train step below moves the running statistics
    with torch.no_grad():
        teval = model(tx).numpy()
    model.train()
    tlogits = model(tx)
    criterion(tlogits, tlabels).backward()
    tgrads = {k: v.grad.numpy() for k, v in model.named_parameters()}
    tbuf = {k: v.numpy() for k, v in model.state_dict().items() if "running" in k}

    def logit_err(a, b):
        return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))

    tlogits = tlogits.detach().numpy()
    bounds = (LOGITS_BOUND[prec.name],) * 2
    if prec.name == "f32":  # timm's own f32 error against timm in f64, same inputs and weights
        truth = to_timm(net, params, buffers, num_classes, "float64")
        t64 = torch.tensor(tx.numpy().astype(np.float64))
        with torch.no_grad():
            truth.eval()
            eval64 = truth(t64).numpy()
            truth.train()
            train64 = truth(t64).numpy()
        bounds = (F32_ORACLE_FACTOR * logit_err(tlogits, train64),
                  F32_ORACLE_FACTOR * logit_err(teval, eval64))
    return ParityReport(
        net.NAME, prec.name, loss,
        logit_err(logits, tlogits), logit_err(eval_logits, teval),
        {k: grad_err(k, grads, tgrads) for k in tgrads},
        max(rel(new_buffers[k], tbuf[k]) for k in tbuf), bounds)
