"""timm / PyTorch state dicts in and out, without torch at run time.

- ``.safetensors``: through the ``safetensors`` package's numpy API.
- ``.pth`` / ``.pt`` (PyTorch's zip format): read with a restricted unpickler that rebuilds
  tensors as numpy arrays (it resolves only the few globals a state dict needs, so an untrusted
  file cannot run code), and written as the same format — the pickle is emitted opcode by opcode
  so that ``torch.load(..., weights_only=True)`` reads it back.

A state dict here is {timm name: numpy array}; checkpoints that wrap it (``{"state_dict": …}``,
``{"model": …}``) are unwrapped, and ``num_batches_tracked`` counters are dropped on load.

What a training run reads through them: `initial_state` (timm's initialisation, or
``--init-from``'s weights); what ``twinstep weights RUN_DIR`` writes: `twinstep.training.export`.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save as save_safetensors

from twinstep.errors import UsageError
from twinstep.nets import init, layers
from twinstep.ops.precision import get_precision
from twinstep.processes import disk

_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
             "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64,
             "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
             "ByteStorage": np.uint8, "BoolStorage": np.bool_}
_STORAGE_OF = {np.dtype(v): k for k, v in _STORAGES.items()}
_WRAPPERS = ("state_dict", "model", "module")


def load(path) -> dict:
    """{name: np.ndarray} from a .safetensors or PyTorch .pth/.pt file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        sd = load_file(str(path))
    else:
        sd = _load_pth(path)
    for key in _WRAPPERS:
        if isinstance(sd.get(key), dict):
            sd = sd[key]
    return {k: np.asarray(v) for k, v in sd.items() if not k.endswith("num_batches_tracked")}


def save(path, state: dict) -> None:
    """Write {name: array} as .safetensors or PyTorch .pth (by the suffix), whole or not at all
    (`twinstep.processes.disk.publish`)."""
    disk.publish({str(path): encoded(path, state)})


def encoded(path, state: dict) -> bytes:
    """{name: array} as the bytes of a .safetensors or PyTorch .pth file (by ``path``'s
    suffix)."""
    path = Path(path)
    arrays = {k: np.require(np.asarray(v), requirements="C") for k, v in state.items()}
    if path.suffix == ".safetensors":
        return save_safetensors(arrays)
    if path.suffix in (".pth", ".pt"):
        return _pth_bytes(path.stem, arrays)
    raise ValueError(f"{path}: use a .safetensors, .pth or .pt file name")


# ----------------------------------------------------------------------------- PyTorch reader


class _Storage:
    def __init__(self, dtype):
        self.dtype = dtype


def _rebuild_tensor(storage, offset, size, stride, *_):
    itemsize = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


def _rebuild_parameter(tensor, *_):
    return tensor


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, archive: zipfile.ZipFile, prefix: str):
        super().__init__(f)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        allowed = {("collections", "OrderedDict"): collections.OrderedDict,
                   ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                   ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and name in _STORAGES:
            return _Storage(np.dtype(_STORAGES[name]))
        raise pickle.UnpicklingError(f"a state dict does not contain {module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        raw = self.archive.read(f"{self.prefix}/data/{key}")
        return np.frombuffer(raw, dtype=storage_type.dtype)


def _load_pth(path: Path) -> dict:
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a PyTorch zip checkpoint (legacy pickle files are not "
                         "supported; re-save it with torch.save or as .safetensors)")
    with zipfile.ZipFile(path) as archive:
        pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        prefix = pkl[:-len("/data.pkl")]
        return _Unpickler(io.BytesIO(archive.read(pkl)), archive, prefix).load()


# ----------------------------------------------------------------------------- PyTorch writer


def _str(s: str) -> bytes:
    b = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def _int(i: int) -> bytes:
    return pickle.BININT + struct.pack("<i", i)


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _tuple(items: list[bytes]) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def _tensor_pickle(key: str, a: np.ndarray) -> bytes:
    storage = _tuple([_str("storage"), _global("torch", _STORAGE_OF[a.dtype]), _str(key),
                      _str("cpu"), _int(a.size)]) + pickle.BINPERSID
    strides = [s // a.itemsize for s in a.strides] if a.ndim else []
    args = [storage, _int(0), _tuple([_int(d) for d in a.shape]),
            _tuple([_int(s) for s in strides]), pickle.NEWFALSE,
            _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE]
    return _global("torch._utils", "_rebuild_tensor_v2") + _tuple(args) + pickle.REDUCE


def _pth_bytes(prefix: str, arrays: dict) -> bytes:
    for name, a in arrays.items():
        if a.dtype not in _STORAGE_OF:
            raise TypeError(f"{name}: dtype {a.dtype} has no PyTorch storage type")
    body = [_global("collections", "OrderedDict"), pickle.EMPTY_TUPLE, pickle.REDUCE,
            pickle.MARK]
    for i, (name, a) in enumerate(arrays.items()):
        body += [_str(name), _tensor_pickle(str(i), a)]
    data = pickle.PROTO + b"\x02" + b"".join(body) + pickle.SETITEMS + pickle.STOP
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", data)
        z.writestr(f"{prefix}/byteorder", "little")
        for i, a in enumerate(arrays.values()):
            z.writestr(f"{prefix}/data/{i}", a.astype(a.dtype.newbyteorder("<")).tobytes())
        z.writestr(f"{prefix}/version", "3\n")
    return out.getvalue()


# ------------------------------------------------------------------------------- into a net


def to_net(net, state: dict, dtype=np.float32) -> tuple[dict, dict, int]:
    """Split a timm state dict into (params, buffers, K) for ``net``, checking every name and
    shape against the net's (K is read off the classifier)."""
    classifier = list(net.param_shapes(1))[-2]
    if classifier not in state:
        raise KeyError(f"not a {net.NAME} state dict: no {classifier}")
    k = state[classifier].shape[0]
    shapes = net.param_shapes(k)
    buffer_shapes = layers.buffer_shapes(shapes)
    expected = {**shapes, **buffer_shapes}
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    wrong = [f"{n}: {tuple(state[n].shape)} != {expected[n]}" for n in expected
             if n in state and tuple(state[n].shape) != tuple(expected[n])]
    if missing or unexpected or wrong:
        raise ValueError(f"state dict does not match {net.NAME} (K = {k}): missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}")
    params = {n: np.asarray(state[n], dtype) for n in shapes}
    buffers = {n: np.asarray(state[n], dtype) for n in buffer_shapes}
    return params, buffers, k


def initial_state(cfg, net, prog, classes: int):
    """``prog``'s state at step 0 for the run ``cfg`` (a `TrainConfig`): timm's initialisation
    (zero-init last BN gammas), or --init-from's weights — all of them but a classifier of
    another width, which keeps its initialisation (fine-tuning to K classes, as timm resets
    it)."""
    prec = get_precision(cfg.precision)
    shapes = net.param_shapes(classes)
    params = init.init_params(jax.random.key(cfg.seed), shapes, net.zero_init_bns(), prec.dtype,
                               linear=net.LINEAR_INIT)
    buffers = init.init_buffers(shapes, prec.dtype)
    if cfg.init_from is not None:
        try:
            loaded, loaded_buffers, k = to_net(net, load(cfg.init_from), prec.dtype)
        except (KeyError, ValueError, OSError) as e:
            raise UsageError(f"--init-from {cfg.init_from}: {str(e).splitlines()[0]}") from None
        head = list(shapes)[-2:] if k != classes else []
        params = {n: params[n] if n in head else jnp.asarray(loaded[n]) for n in shapes}
        buffers = {n: jnp.asarray(v) for n, v in loaded_buffers.items()}
    return prog.init(params, buffers)

