"""The device loader's decoding (`--loader device`): a JPEG's bytes to uint8 pixels by
nvImageCodec, only a crop box where asked, a batch's boxes in one call — on the CPU through
libjpeg-turbo (bit for bit Pillow's decode, cropped), or through nvJPEG on the GPU when the
trainer's JAX has one (the crops copied back to the host). What nvImageCodec does not decode
(another format or mode, a truncated JPEG) Pillow does, as the Pillow path decodes it; what
neither does is `Undecodable`, and replaced by the next image of its split.

Holds the `Decoder` (opened lazily, once per process: it pickles without nvImageCodec's
objects, for the loader processes), the header read (`header`), the replacement of an image
that does not read or decode (`first_with_header`, `first_decoded`) and why nvImageCodec is
not here (`unavailable`). What is drawn and planned for a row, and the loader itself, are
`twinstep.data.device`'s.
"""

from __future__ import annotations

import io

import jax
import numpy as np
from PIL import Image

from twinstep.data import folder, transforms
from twinstep.errors import BackendError, UsageError

EOI = b"\xff\xd9"  # a JPEG's end-of-image marker


class Undecodable(Exception):
    """An image neither nvImageCodec nor Pillow decodes: replaced by the next of its split."""


def unavailable() -> str | None:
    """None when nvImageCodec imports, else why not (one line)."""
    try:
        from nvidia import nvimgcodec  # noqa: F401 - lazy: the [nvimgcodec] extra, maybe absent
    except ImportError as e:
        return (f"--loader device needs nvImageCodec: pip install -e '.[nvimgcodec]' in "
                f"twinstep's clone ({e})")
    return None


def _jax_has_gpu() -> bool:
    return jax.default_backend() == "gpu"


class Decoder:
    """nvImageCodec's decoder, where the trainer computes: nvJPEG when ``gpu`` (None: when
    JAX has a GPU), else libjpeg-turbo on one core of this process; Pillow for the rest."""

    def __init__(self, gpu: bool | None = None):
        self.gpu = _jax_has_gpu() if gpu is None else gpu
        self._decoder = self._params = None

    def __getstate__(self):
        return {**self.__dict__, "_decoder": None, "_params": None}

    def decode(self, data: bytes, stream, box: tuple[int, int, int, int] | None = None
               ) -> np.ndarray:
        """uint8 [h, w, 3] of the image ``data``, only ``box`` (top, left, h, w) when given: a
        whole 3-channel JPEG (``stream``, its nvImageCodec code stream) by nvImageCodec, any
        other image (``stream`` None), or one nvImageCodec refuses, by Pillow as the Pillow
        path decodes it. `Undecodable` when Pillow refuses it too."""
        if stream is not None:
            image = self.batch([stream], [box])[0]
            if image is not None:
                return image
        try:
            with Image.open(io.BytesIO(data)) as img:
                rgb = np.asarray(transforms.to_rgb(img), np.uint8)
        except folder.UNDECODABLE as e:
            raise Undecodable from e
        if box is None:
            return rgb
        top, left, h, w = box
        return rgb[top:top + h, left:left + w]

    def batch(self, streams: list, boxes: list) -> list[np.ndarray | None]:
        """uint8 [h, w, 3] of each code stream (only its ``box`` (top, left, h, w) when one is
        given), None where nvImageCodec does not decode it: in one batch, on the GPU (nvJPEG)
        when ``gpu``, else by libjpeg-turbo on one core of this process."""
        from nvidia import nvimgcodec  # lazy: the [nvimgcodec] extra (`unavailable` says why)

        if self._decoder is None:
            where = {"device_id": 0} if self.gpu else {
                "device_id": nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                "backends": [nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)]}
            try:  # nvJPEG upsamples chroma as libjpeg-turbo (and so Pillow) does
                self._decoder = nvimgcodec.Decoder(max_num_cpu_threads=1,
                                                   options=":fancy_upsampling=1", **where)
            except RuntimeError as e:
                raise BackendError(f"nvImageCodec opened no {'GPU' if self.gpu else 'CPU'}"
                                   f" decoder ({e}); on a GPU it needs nvJPEG: pip install "
                                   f"'nvidia-nvjpeg>=13'") from None
            # the pixels as stored, as Pillow and timm read them: no EXIF rotation
            self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False)
        regions = []
        for stream, box in zip(streams, boxes, strict=True):
            if box is not None:
                top, left, h, w = box
                stream = stream.get_sub_code_stream(
                    region=nvimgcodec.Region(start=(top, left), end=(top + h, left + w)))
            regions.append(stream)
        images = self._decoder.decode(regions, params=self._params) if regions else []
        return [None if image is None else np.asarray(image.cpu()) for image in images]


def header(data: bytes):
    """((width, height), its nvImageCodec code stream when nvImageCodec decodes it — a
    3-channel JPEG whose data ends at its end-of-image marker —, else None), None when no
    header reads. A truncated JPEG goes to Pillow, which refuses it whole where a region
    decode above the cut would succeed."""
    from nvidia import nvimgcodec  # lazy: the [nvimgcodec] extra (`unavailable` says why)

    try:
        stream = nvimgcodec.CodeStream(data)
        if (stream.codec_name == "jpeg" and stream.num_channels == 3 and stream.width > 0
                and data.endswith(EOI)):
            return (stream.width, stream.height), stream
    except (RuntimeError, ValueError):
        pass
    try:  # another format or mode: Pillow's, as the Pillow path reads it
        with Image.open(io.BytesIO(data)) as img:
            return img.size, None
    except folder.UNDECODABLE:
        return None


def first_with_header(split, i: int):
    """(index used, skipped, bytes, size, code stream or None): the first image of ``split``
    from i on whose header reads."""
    for tried in range(len(split)):
        j = (i + tried) % len(split)
        data = split.encoded(j)
        if (read := header(data)) is not None:
            return j, tried, data, *read
    raise UsageError(f"no image of {len(split)} in this split decodes")


def first_decoded(split, i: int, make):
    """(make(bytes, size, code stream or None), index used, skipped): the first image of
    ``split`` from i on that decodes — ``make`` raises `Undecodable` where it does not —, as
    the Pillow path replaces one that does not."""
    tried = 0
    while tried < len(split):
        j, skipped, data, size, stream = first_with_header(split, i + tried)
        tried += skipped
        try:
            return make(data, size, stream), j, tried
        except Undecodable:
            tried += 1
    raise UsageError(f"no image of {len(split)} in this split decodes")
