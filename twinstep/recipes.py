"""Recipes: a training configuration as a value with a name (docs/recipes.md).

A `Recipe` is a frozen dataclass; `parse` reads a grammar name (`GRAMMAR`, e.g.
``resnet50in160_lambaccdp4x128wxclipbcebf16``) or a preset's name (``rsb-a1``) into one, and
`Recipe.name` writes it back. A recipe has exactly one name: `parse` accepts only the canonical
spelling and names the token to change otherwise, so name -> recipe -> name round-trips.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from decimal import Decimal
from typing import NamedTuple

from twinstep.defaults import EMA_DECAY, EMA_WARMUPS, LABEL_SMOOTHING, SCHEDULES
from twinstep.errors import UsageError
from twinstep.nets import NETS
from twinstep.optimizers import OPTIMIZERS
from twinstep.presets import PRESETS as PRESET_FIELDS
from twinstep.presets import REPLICAS as PRESET_REPLICAS

# the <data> token: "in" names ImageNet-1k (the seeds' spelling, the presets'), none your own
# images, whose classes come from --data's folder
DATASETS = {"in": "ImageNet-1k", "": "your own images: --data's classes"}
DEFAULT_BATCH = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """One training configuration; checks itself on construction (UsageError). The fields up
    to `bf16` are the name's; `Recipe.name` is lossy for the rest (a preset's name parses back
    to a recipe with the default lr, epochs, ...). `lr` None takes the optimizer's and
    `drop_path_rate` None the net's (`twinstep.nets.Net.DROP_PATH_RATE`): both are floats after
    construction (pass None to `dataclasses.replace` to re-derive them). The schedule defaults
    to a smoke run's, 10 warmup steps of 100 and a cosine; the presets set the real one, and
    ``schedule="step"`` is timm's step decay (docs/recipes.md#learning-rate-schedule)."""

    net: str
    dataset: str = "in"
    res: int | None = None  # None: the net's default train resolution, omitted from the name
    optimizer: str  # a key of OPTIMIZERS
    accum: int = 1  # k micro-steps per optimizer step
    dp: bool = False  # data-parallel with sync-BN
    batch: int = DEFAULT_BATCH  # N per replica
    wx: bool = False  # no weight decay on 1-D tensors
    clip: bool = False  # global-norm clip at 1.0 of the averaged gradient
    drop: bool = False  # stochastic depth
    dropout: bool = False  # classifier dropout
    bce: bool = False
    label_smoothing: float | None = None  # None: CE 0.1, BCE 0
    weight_decay: float | None = None  # None: the optimizer's default
    bf16: bool = False
    ema: bool = False
    # --- not in the name
    lr: float | None = None
    drop_path_rate: float | None = None  # used only with drop
    dropout_rate: float = 0.2  # used only with dropout
    bce_threshold: float | None = None  # used only with bce
    ema_decay: float = EMA_DECAY
    ema_warmup: str = "none"  # none | timm | tf (docs/recipes.md)
    warmup_steps: int = 10
    total_steps: int = 100
    warmup_lr: float = 0.0  # lr(0); `twinstep train` uses timm's --warmup-lr (defaults.WARMUP_LR)
    schedule: str = "cosine"  # after the warmup: cosine | step (timm's --sched)
    # step only: the lr times decay_rate every decay_steps optimizer steps, counted from step 0
    # (timm's decay_t: --decay-epochs x updates per epoch, so it may be fractional)
    decay_steps: float | None = None
    decay_rate: float | None = None
    epochs: int | None = None
    eval_res: int | None = None  # the published evaluation's resolution; None: the train res
    # augmentation (`twinstep train --data DIR`; the embedded digits are not augmented)
    randaugment: int | None = None  # M of timm's rand-m{M}-mstd0.5-inc1; None: off
    mixup: float = 0.0  # mixup's Beta alpha; 0: off
    cutmix: float = 0.0  # CutMix's Beta alpha; 0: off (both on: one of them per batch, p 0.5)
    repeated_aug: int = 1  # timm's repeated-augmentation count: recorded, not applied

    def __post_init__(self):
        def fail(msg):
            raise UsageError(f"bad recipe: {msg}")

        def put(field, value):
            object.__setattr__(self, field, value)

        if self.net not in NETS:
            fail(f"net {self.net!r}; expected one of: {', '.join(NETS)}")
        if self.dataset not in DATASETS:
            fail(f"dataset {self.dataset!r}; expected one of: {', '.join(map(repr, DATASETS))}")
        if not self.dataset and self.res is not None:  # its name could not say it
            fail(f"res {self.res} needs the dataset 'in' (your own images: train --res)")
        if self.optimizer not in OPTIMIZERS:
            fail(f"optimizer {self.optimizer!r}; expected one of: {', '.join(OPTIMIZERS)}")
        if self.ema_warmup not in EMA_WARMUPS:
            fail(f"ema_warmup {self.ema_warmup!r}; expected one of: {', '.join(EMA_WARMUPS)}")
        if self.schedule not in SCHEDULES:
            fail(f"schedule {self.schedule!r}; expected one of: {', '.join(SCHEDULES)}")
        step = self.schedule == "step"
        for field in ("decay_steps", "decay_rate"):  # the step schedule's, and only its
            if (getattr(self, field) is None) == step:
                fail(f"schedule {self.schedule!r} {'needs' if step else 'takes no'} {field}")
        if self.lr is None:
            put("lr", OPTIMIZERS[self.optimizer].lr)
        if self.drop_path_rate is None:
            put("drop_path_rate", NETS[self.net].DROP_PATH_RATE)
        for field in ("label_smoothing", "weight_decay", "lr", "drop_path_rate", "dropout_rate",
                      "bce_threshold", "ema_decay", "warmup_lr", "mixup", "cutmix",
                      "decay_steps", "decay_rate"):
            value = getattr(self, field)
            if value is not None:
                put(field, float(value) + 0.0)  # ints to floats, -0.0 to 0.0
        for field, low in (("res", 1), ("accum", 1), ("batch", 1), ("warmup_steps", 0),
                           ("total_steps", 1), ("epochs", 1), ("randaugment", 0),
                           ("repeated_aug", 1)):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                fail(f"{field} = {value!r}; expected an int >= {low}")
        for field, low, high in (("label_smoothing", 0, 1), ("weight_decay", 0, 10),
                                 ("drop_path_rate", 0, 1), ("dropout_rate", 0, 1),
                                 ("bce_threshold", 0, 1), ("ema_decay", 0, 1),
                                 ("mixup", 0, 100), ("cutmix", 0, 100)):
            value = getattr(self, field)
            if value is not None and not low <= value < high:
                fail(f"{field} = {value!r}; expected {low} <= {field} < {high}")
        if not self.lr > 0:
            fail(f"lr = {self.lr!r}; expected > 0")
        if step and not (0 < self.decay_steps < float("inf") and 0 < self.decay_rate <= 1):
            fail(f"decay_steps = {self.decay_steps!r}, decay_rate = {self.decay_rate!r}; "
                 "expected decay_steps > 0 and 0 < decay_rate <= 1")
        if not 0 <= self.warmup_lr <= self.lr:
            fail(f"warmup_lr = {self.warmup_lr!r}; expected 0 <= warmup_lr <= lr")
        if self.warmup_steps > self.total_steps:
            fail(f"warmup_steps {self.warmup_steps} > total_steps {self.total_steps}")

    @property
    def name(self) -> str:
        """The canonical grammar name (lossy for the fields not in the name)."""
        k = self.accum
        parts = [self.net, self.dataset, "" if self.res is None else str(self.res), "_",
                 "ema" if self.ema else "",
                 "" if self.optimizer == "adamw" and k > 1 else OPTIMIZERS[self.optimizer].token,
                 "acc" if k > 1 else "", "dp" if self.dp else "", f"{k}x" if k > 1 else "",
                 "" if self.batch == DEFAULT_BATCH else str(self.batch),
                 "wx" if self.wx else "", "clip" if self.clip else "",
                 "drop" if self.drop else "", "do" if self.dropout else "",
                 "bce" if self.bce else ""]
        if self.label_smoothing is not None:
            parts.append("ls" + _decimal_digits(self.label_smoothing))
        if self.weight_decay is not None:
            parts.append("wd" + _decimal_digits(self.weight_decay))
        parts.append("bf16" if self.bf16 else "")
        return "".join(parts)

    @property
    def train_res(self) -> int:
        return NETS[self.net].TRAIN_RES if self.res is None else self.res

    @property
    def test_res(self) -> int:
        """The resolution the recipe's accuracy is measured at (centre crop 0.95 of the
        resized short side, `twinstep.data.transforms.CROP_PCT`)."""
        return self.train_res if self.eval_res is None else self.eval_res

    @property
    def loss(self) -> str:
        return "bce" if self.bce else "ce"

    @property
    def effective_weight_decay(self) -> float:
        """The name's wd, else the optimizer's default (`Optimizer.weight_decay`: LAMB's as RSB
        A2/A3, AdamW's as timm's default, SGD's as the classic ResNet recipe)."""
        wd = self.weight_decay
        return OPTIMIZERS[self.optimizer].weight_decay if wd is None else wd

    @property
    def effective_label_smoothing(self) -> float:
        """The name's α, else 0.1 for CE and 0 for BCE (docs/sync-sites.md)."""
        if self.label_smoothing is not None:
            return self.label_smoothing
        return 0.0 if self.bce else LABEL_SMOOTHING

    def effective_batch(self, replicas: int) -> int:
        """Examples per optimizer step: R·N·k."""
        return replicas * self.batch * self.accum


def _decimal_digits(x: float) -> str:
    """0.05 -> '005', 0.1 -> '01', 1.0 -> '1', 0.0 -> '0': the digits of x with the point after
    the first one dropped (x < 10). Exact: repr round-trips, and so does its decimal expansion."""
    whole, _, frac = format(Decimal(repr(x)), "f").partition(".")
    assert len(whole) == 1, x
    return whole + frac.rstrip("0")


def _read_decimal(digits: str) -> float:
    return float(digits[0] + "." + digits[1:])


class StepToken(NamedTuple):
    """One token after '_': its label in the grammar and its pattern (group 1: any digits)."""

    label: str
    pattern: re.Pattern
    optional: bool = True  # bracketed in GRAMMAR


# The step tokens after '_', in grammar order: a new token is one row, and GRAMMAR follows. A
# name is read by a loop that takes at each position the longest token that matches; it must
# come later in this list than the one before it.
STEP_TOKENS = (
    StepToken("ema", re.compile("ema")),
    # required but for one exception, 'acc' alone for AdamW (checked in _parse_grammar)
    StepToken("<opt>", re.compile("|".join(re.escape(o.token) for o in OPTIMIZERS.values())),
              optional=False),
    StepToken("acc", re.compile("acc")),
    StepToken("dp", re.compile("dp")),
    StepToken("<k>x", re.compile(r"(\d+)x")),
    StepToken("<N>", re.compile(r"(\d+)")),
    StepToken("wx", re.compile("wx")),
    StepToken("clip", re.compile("clip")),
    StepToken("drop", re.compile("drop")),
    StepToken("do", re.compile("do")),
    StepToken("bce", re.compile("bce")),
    StepToken("ls<a>", re.compile(r"ls(\d*)")),
    StepToken("wd<d>", re.compile(r"wd(\d*)")),
    StepToken("bf16", re.compile("bf16")),
)
_TOKENS = ", ".join(o.token for o in OPTIMIZERS.values())
HEAD = "<net>[<data>[<res>]]"  # before the '_'
GRAMMAR = HEAD + "_" + "".join(f"[{t.label}]" if t.optional else t.label for t in STEP_TOKENS)


def _expected(start: int) -> str:
    labels = [t.label for t in STEP_TOKENS[start:]]
    return ", ".join(_TOKENS if x == "<opt>" else x for x in labels)


def _longest(s: str, pos: int):
    """(index into STEP_TOKENS, match) of the longest token at pos, or None."""
    best = None
    for j, token in enumerate(STEP_TOKENS):
        m = token.pattern.match(s, pos)
        if m and (best is None or m.end() > best[1].end()):
            best = (j, m)
    return best


def _tokenize(name: str, tail: str, after: str) -> dict[str, re.Match]:
    """The step tokens of `tail` by label, checking order, repetition and unknown text."""

    def fail(msg):
        raise UsageError(f"bad recipe name {name!r}: {msg}")

    found: dict[str, re.Match] = {}
    pos, nxt = 0, 0  # nxt: the first STEP_TOKENS index still allowed
    while pos < len(tail):
        hit = _longest(tail, pos)
        if hit is None:
            end = pos + 1
            while end < len(tail) and _longest(tail, end) is None:
                end += 1
            fail(f"unknown token {tail[pos:end]!r} after {after!r}; expected one of: "
                 f"{_expected(nxt)}")
        j, m = hit
        label = STEP_TOKENS[j].label
        if j < nxt:
            why = "repeated" if label in found else f"out of order (it goes before {after!r})"
            fail(f"token {m.group()!r} {why}; grammar: {GRAMMAR}")
        found[label] = m
        pos, nxt, after = m.end(), j + 1, m.group()
    return found


MAX_NAME = 1024  # characters in a recipe name (ls and wd spell a float's decimal digits)
MAX_DIGITS = 5  # integers in a name (res, k, N) below 100000


def _read_int(name: str, token: str, digits: str) -> int:
    if len(digits) > MAX_DIGITS:
        raise UsageError(f"bad recipe name {name!r}: token {token!r} is too large "
                          f"(at most {MAX_DIGITS} digits)")
    if str(int(digits)) != digits:
        raise UsageError(f"bad recipe name {name!r}: token {token!r} has a leading zero")
    return int(digits)


def _net_of(head: str, nets: Iterable[str]) -> str | None:
    """The net a name's head starts with: the longest of `nets` that prefixes it, whatever their
    order (a net's name may prefix another's, as mnv4's does mnv4s'); None if none does."""
    return max((n for n in nets if head.startswith(n)), key=len, default=None)


def _parse_grammar(name: str) -> Recipe:
    def fail(msg):
        raise UsageError(f"bad recipe name {name!r}: {msg}")

    if not name:
        fail(f"empty; expected {GRAMMAR}")
    if len(name) > MAX_NAME or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        fail(f"a name is at most {MAX_NAME} ASCII letters, digits, '_', '-' and '.'")
    head, sep, tail = name.partition("_")
    datasets = ", ".join(d for d in DATASETS if d) + " or none"
    unknown_net = (f"unknown net in {head!r}; expected {HEAD} with <net> one of: "
                   f"{', '.join(NETS)} and <data> {datasets}")
    net = _net_of(head, NETS)
    if net is None:
        fail(unknown_net)
    if not sep:
        fail(f"missing '_' after {HEAD}; expected {GRAMMAR}")
    m = re.compile(r"\D*").match(head, len(net))  # <data>: up to <res>'s digits
    dataset, res_digits = m.group(), head[m.end():]
    if not dataset and res_digits:  # 'resnet18224' would read as another net's name
        fail(f"a <res> needs its <data> before it: {net}in{res_digits}_... (ImageNet-1k), or "
             f"no <res> and train --res {res_digits}")
    if dataset not in DATASETS:
        # a known net's name is the start of one we do not know: 'mnv4xin' is no net of ours,
        # not mnv4 on a dataset 'xin'
        fail(unknown_net)
    if res_digits and not res_digits.isdigit():
        fail(f"unknown token {res_digits!r} after {net + dataset!r}; expected <res> digits")
    res = _read_int(name, res_digits, res_digits) if res_digits else None
    if res == 0:
        fail(f"resolution {res_digits!r} must be >= 1")
    tok = _tokenize(name, tail, head + "_")

    opt, acc, kx = tok.get("<opt>"), tok.get("acc"), tok.get("<k>x")
    if opt is None and acc is None:
        fail(f"no optimizer after {head + '_'!r}; expected one of: {_TOKENS}, "
             "or 'acc' alone for AdamW with accumulation")
    if opt is not None and opt.group() == "adam" and acc is not None:
        fail("token 'adam' before 'acc': AdamW with accumulation is written 'acc' alone")
    if acc is not None and kx is None:
        fail("token 'acc' needs '<k>x' (k >= 2 micro-steps) after it")
    if kx is not None and acc is None:
        fail(f"token {kx.group()!r} needs 'acc' before it")
    accum = 1
    if kx is not None:
        accum = _read_int(name, kx.group(), kx.group(1))
        if accum < 2:
            fail(f"token {kx.group()!r}: accumulation needs k >= 2")
    batch = DEFAULT_BATCH
    if (n := tok.get("<N>")) is not None:
        batch = _read_int(name, n.group(), n.group())
        if batch == DEFAULT_BATCH:
            fail(f"token {n.group()!r} is the default N; omit it")
        if batch < 1:
            fail(f"token {n.group()!r}: N must be >= 1")
    decimals = {}
    for label, field, high in (("ls<a>", "label_smoothing", 1), ("wd<d>", "weight_decay", 10)):
        if (m := tok.get(label)) is None:
            continue
        text, digits = m.group(), m.group(1)
        if not digits:
            fail(f"token {text!r} needs digits, e.g. {text}005 = 0.05")
        value = _read_decimal(digits)
        if value >= high:
            fail(f"token {text!r} = {value} is out of range (< {high})")
        if _decimal_digits(value) != digits:
            fail(f"token {text!r} is not canonical; write {text[:2] + _decimal_digits(value)!r}")
        decimals[field] = value
    optimizer = "adamw" if opt is None else {o.token: k for k, o in OPTIMIZERS.items()}[opt.group()]
    return Recipe(net=net, dataset=dataset, res=res, optimizer=optimizer, accum=accum,
                  dp="dp" in tok, batch=batch, wx="wx" in tok, clip="clip" in tok,
                  drop="drop" in tok, dropout="do" in tok, bce="bce" in tok,
                  bf16="bf16" in tok, ema="ema" in tok, **decimals)


def parse(name: str) -> Recipe:
    """The recipe a grammar name (or a preset's name) stands for; UsageError names the token
    that is wrong."""
    if name in PRESETS:
        return PRESETS[name]
    return _parse_grammar(name)


def lr_batch(name: str, recipe: Recipe) -> int | None:
    """The global batch the lr of recipe ``name`` (``recipe``, with a run's overrides) was
    published for: a preset's (timm's, at R = 8), the optimizer's for its default lr; None
    where neither gives it."""
    if name in PRESETS:
        return PRESET_REPLICAS * PRESETS[name].batch * PRESETS[name].accum
    row = OPTIMIZERS[recipe.optimizer]
    return row.lr_batch if recipe.lr == row.lr else None


PRESETS = {name: Recipe(**fields) for name, fields in PRESET_FIELDS.items()}  # by name
