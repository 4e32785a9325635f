"""The trainer's image-folder data (twinstep.data.folder, .sources, .loader): torchvision's
ImageFolder listing, refusals, the sources behind one protocol, undecodable images replaced and
counted, and batches that are a function of (seed, step) whatever the number of loader
workers."""

import os
import shutil

import numpy as np
import pytest
from PIL import Image

from twinstep.data import folder, loader, mix, sources, transforms
from twinstep.errors import UsageError


def write_folder(root, per_class: int = 3, classes=("cat", "Dog", "ant", "zebra")):
    """An ImageFolder tree of small real images (sklearn's digits, coloured, varied sizes and
    modes), with a nested folder and files that are not images."""
    from sklearn.datasets import load_digits

    d = load_digits()
    for split in folder.SPLITS:
        for k, name in enumerate(classes):
            where = os.path.join(root, split, name)
            os.makedirs(os.path.join(where, "more"), exist_ok=True)
            for j in range(per_class):
                a = (d.images[k * 10 + j] * 16).astype(np.uint8)
                img = Image.fromarray(np.stack([a, a[::-1], 255 - a], -1)).resize(
                    (30 + 3 * j, 26 + 2 * k))
                sub = "more" if j == 2 else ""
                if j % 2:
                    img.save(os.path.join(where, sub, f"{j}.JPG"), quality=90)
                else:
                    img.convert("L").save(os.path.join(where, sub, f"{j}.png"))
            with open(os.path.join(where, "notes.txt"), "w") as f:
                f.write("not an image\n")
    return root


@pytest.fixture
def tree(tmp_path):
    return write_folder(str(tmp_path / "data"))


def test_on_a_folder_the_defaults_are_the_recipes_and_on_the_digits_small(tree):
    """rsb-a3 on an image folder trains at 160², evaluates at 224² and runs its 100 epochs with
    its 5-epoch warmup share; at another --res it evaluates there; a grammar name takes its
    net's resolution and the smoke length; the digits keep 32² and 200 steps. The summary line
    says which value came from where."""
    from twinstep.training.config import TrainConfig

    a3 = TrainConfig("rsb-a3", "/tmp/unused", data=tree)
    images = sources.train_size(tree)
    assert (a3.res, a3.eval_res, a3.epochs, a3.batch) == (160, 224, 100, 256)
    assert a3.steps == -(-100 * images // 256)
    assert a3.parsed_recipe().warmup_steps == a3.steps * 5 // 100
    assert a3.summary() == (f"rsb-a3 on {tree} ({images} train, 12 val images): train 160² "
                            f"(the recipe's), eval 224² (the "
                            f"recipe's), 100 epochs = {a3.steps} steps (the recipe's), N = 256 "
                            f"x R = 1, f32 (the default); note: lr 0.008 was published for a "
                            f"global batch of 2,048, this run's is 256 (timm's linear rule "
                            f"would give 0.001)")
    at_timms = TrainConfig("rsb-a3", "/tmp/unused", data=tree, replicas=8)  # the control
    assert "note" not in at_timms.summary() and "N = 256 x R = 8" in at_timms.summary()
    small = TrainConfig("rsb-a3", "/tmp/unused", data=tree, res=128, steps=7, batch=4)
    assert (small.res, small.eval_res, small.steps) == (128, 128, 7)
    assert "train 128² (given), eval 128² (the train res), 7 steps (given)" in small.summary()
    named = TrainConfig("mnv4in_adamdp8", "/tmp/unused", data=tree)
    assert (named.res, named.eval_res, named.steps, named.epochs) == (256, 256, 200, None)
    assert named.parsed_recipe().warmup_steps == 20  # a grammar name's tenth
    digits = TrainConfig("rsb-a3", "/tmp/unused", batch=4)
    assert (digits.res, digits.eval_res, digits.steps) == (32, 32, 200)
    assert "train 32² (the digits' default), eval 32² (the train res), 200 steps (the " \
           "default)" in digits.summary()
    # the precision: the recipe's bf16 token, else f32; a given one wins
    assert "x R = 1, bf16 (the recipe's); note" in TrainConfig("mnv4in_adamdp2bf16",
                                                                 "/tmp/unused").summary()
    assert "x R = 1, f64 (given); note" in TrainConfig("mnv4in_adamdp2bf16", "/tmp/unused",
                                                       precision="f64").summary()
    with pytest.raises(UsageError, match="--eval-res must be a multiple of 32"):
        TrainConfig("rsb-a3", "/tmp/unused", data=tree, eval_res=100)


@pytest.mark.oracle
def test_the_listing_is_torchvisions_imagefolder(tree):
    from torchvision.datasets import ImageFolder

    for split in folder.SPLITS:
        ours = folder.scan(tree, split)
        theirs = ImageFolder(os.path.join(tree, split))
        assert list(ours.classes) == theirs.classes == ["Dog", "ant", "cat", "zebra"]
        assert list(zip(ours.paths, ours.labels.tolist(), strict=True)) == theirs.samples
    # negative control: the listing is order-sensitive, a shuffled one is not theirs
    assert list(reversed(ours.paths)) != [p for p, _ in theirs.samples]


def test_bad_folders_are_refused_in_one_line(tree, tmp_path):
    def refused(root, text):
        with pytest.raises(UsageError, match=text) as e:
            folder.scan_both(root)
        assert "\n" not in str(e.value)

    refused(str(tmp_path / "nowhere"), "no such directory")
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    refused(str(empty), "no val/ folder")
    (empty / "val").mkdir()
    refused(str(empty), "has no class folders")
    shutil.rmtree(os.path.join(tree, "val", "zebra"))
    refused(tree, "same classes")
    for name in os.listdir(os.path.join(tree, "train", "ant")):
        path = os.path.join(tree, "train", "ant", name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    refused(tree, "class 'ant' of train/ has no images")


def test_an_image_that_does_not_decode_is_replaced_by_the_next_and_counted(tree):
    split = folder.scan(tree, "train")
    with open(split.paths[0], "wb") as f:
        f.write(b"not a png at all")
    data = open(split.paths[1], "rb").read()
    with open(split.paths[1], "wb") as f:
        f.write(data[:len(data) // 2])  # a truncated JPEG
    src = sources.get_source(tree, 16)
    x, labels, skipped, _ = src.train_rows(np.array([0, 5]), 0, 0, np.arange(2), sources.Augment())
    assert skipped.tolist() == [2, 0] and x.shape == (2, 16, 16, 3)
    assert labels.tolist() == [split.labels[2], split.labels[5]]  # image 2 stood in for 0
    for path in split.paths:
        with open(path, "wb") as f:
            f.write(b"")
    with pytest.raises(UsageError, match="decodes"):
        src.train_rows(np.array([3]), 0, 0, np.arange(1), sources.Augment())


def test_images_that_do_not_read_are_left_out_before_the_first_step_and_named(tree, tmp_path):
    """The screen (--check-images): a file whose header does not read is left out by 'headers',
    one cut short after its header only by 'decode' — then the epoch counts what `twinstep pack`
    keeps —, nothing by 'none' (the control: the images are there without the screen). A
    RUN_DIR's skipped.txt is read back as written, and a run continued from it leaves out what
    it says, not what a new screen would find."""
    from twinstep.data import packed, screen
    from twinstep.training.config import TrainConfig

    train = folder.scan(tree, "train")
    header, cut = train.paths[1], train.paths[4]  # ant/1.JPG, Dog/1.JPG
    with open(header, "wb") as f:
        f.write(b"\xff\xd8 truncated")
    whole = open(cut, "rb").read()
    with open(cut, "wb") as f:
        f.write(whole[:len(whole) - 60])
    assert folder.problem(header, decode=False) and not folder.problem(cut, decode=False)
    assert "truncated" in folder.problem(cut) and not folder.problem(train.paths[0])
    found = {}
    for check in screen.CHECKS:
        cfg = TrainConfig("resnet18in_adamdp4", str(tmp_path / check), data=tree,
                          check_images=check)
        found[check] = (cfg.train_images, [b.name for b in cfg.left_out])
    assert found == {"headers": (11, [header]), "decode": (10, [header, cut]),
                     "none": (12, [])}, found
    kept = packed.pack(tree, str(tmp_path / "packed"))["splits"]["train"]["count"]
    assert kept == found["decode"][0]
    listed = [screen.Bad("train", screen.LEFT_OUT, "a\treason", header),
              screen.Bad("val", screen.REPLACED, "another", cut)]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / screen.FILE).write_text(screen.text(listed, header=True))
    assert screen.read(str(run_dir)) == [listed[0]._replace(reason="a reason"), listed[1]]
    (run_dir / "config.json").write_text("{}")  # a run to continue: its list, not a screen
    (run_dir / screen.FILE).write_text(screen.text(listed[1:], header=True))
    again = TrainConfig("resnet18in_adamdp4", str(run_dir), data=tree, check_images="decode")
    assert (again.train_images, again.left_out) == (12, ())


def test_a_folder_with_train_only_holds_out_a_val_split_by_path_hash(tree, tmp_path):
    """--val-split F: the images whose path below train/ hashes under F, the same whatever else
    the folder holds; refused with a val/ folder, on the digits, or where a split is empty; a
    folder without val/ and without --val-split is refused with the way forward."""
    from twinstep.training.config import TrainConfig

    shutil.rmtree(os.path.join(tree, "val"))
    with pytest.raises(UsageError, match="--val-split"):
        folder.scan_both(tree)
    train, val = folder.scan_both(tree, 0.5)
    assert len(train) + len(val) == 12 and len(val) > 0 and train.classes == val.classes
    base = os.path.join(tree, "train")
    assert all(folder.held_out(os.path.relpath(p, base), 0.5) for p in val.paths)
    assert not any(folder.held_out(os.path.relpath(p, base), 0.5) for p in train.paths)
    extra = os.path.join(tree, "train", "cat", "extra.png")
    Image.new("RGB", (20, 20)).save(extra)
    train2, val2 = folder.scan_both(tree, 0.5)
    assert set(val.paths) <= set(val2.paths) and set(train.paths) <= set(train2.paths)
    cfg = TrainConfig("resnet18in_adamdp4", str(tmp_path / "run"), data=tree, val_split=0.5)
    assert len(cfg.splits[1]) == len(val2) and "--val-split 0.5" in cfg.summary()
    for given, why in ((0.0, "fraction"), (1.5, "fraction"), (1e-9, "leaves both")):
        with pytest.raises(UsageError, match=why):
            TrainConfig("resnet18in_adamdp4", str(tmp_path / "run"), data=tree, val_split=given)
    with pytest.raises(UsageError, match="have their val split"):
        TrainConfig("resnet18in_adamdp4", str(tmp_path / "run"), val_split=0.1)
    os.makedirs(os.path.join(tree, "val"))
    with pytest.raises(UsageError, match="has a val/ folder"):
        folder.scan_both(tree, 0.5)


def test_a_step_is_a_function_of_seed_and_step_whatever_the_workers(tree):
    src = sources.get_source(tree, 16)
    augment = sources.Augment(randaugment=9, mix=mix.MixParams(0.2, 1.0))
    rows = 4

    def steps(workers, start=0):
        return list(loader.train_stream(src, augment, seed=7, start=start, stop=4, micro=2,
                                        rows=rows, workers=workers))

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

    alone, pooled = steps(0), steps(2)
    for a, b in zip(alone, pooled, strict=True):
        assert a.xs.shape == (2, rows, 16, 16, 3) and a.xs.dtype == np.uint8
        assert a.labels.shape == (2, rows) and a.mix.shape == (2, 2) and a.box.shape == (2, 4)
        assert same(a, b)
    assert same(steps(0, start=2)[0], alone[2])  # a resumed stream
    # controls: another step, another seed draw other batches; the recipe's mix was drawn
    assert not np.array_equal(alone[0].xs, alone[1].xs)
    other = loader.train_batch(src, augment, seed=8, step=0, micro=2, rows=rows)
    assert not np.array_equal(other.xs, alone[0].xs)
    assert any(m[1] > 0 for b in alone for m in b.mix)
    # a process loads only its rows (the mix pairs them with other processes' rows on the
    # devices): each of its rows is the row of the whole batch, bit for bit, the mix the same
    whole = loader.train_batch(src, augment, seed=7, step=1, micro=2, rows=rows)
    for part in (slice(0, 2), slice(2, 4), slice(1, 2)):
        b = loader.train_batch(src, augment, seed=7, step=1, micro=2, rows=rows, part=part)
        assert np.array_equal(b.xs, whole.xs[:, part]) and np.array_equal(b.labels,
                                                                          whole.labels[:, part])
        assert np.array_equal(b.mix, whole.mix) and np.array_equal(b.box, whole.box)


def test_every_source_is_the_protocol_and_chosen_by_one_table(tree, tmp_path):
    """The digits, a folder and its packed copy (Pillow) each hold `sources.Source` whole; the
    format and loader tables choose them; a source missing one method is not a Source (the
    control: the check sees an attribute gone); a path that is no format is refused."""
    from twinstep.data import packed, pillow

    out = str(tmp_path / "packed")
    packed.pack(tree, out)
    found = {data: sources.get_source(data, 16) for data in ("digits", tree, out)}
    assert all(isinstance(src, sources.Source) for src in found.values())
    assert isinstance(found[out].train, packed.Split) and isinstance(found[tree].train,
                                                                     folder.Split)
    assert found[tree].val_kind() == found[out].val_kind() != found["digits"].val_kind()
    assert [s.augments for s in found.values()] == [False, True, True]

    class NoValKind(pillow.Pillow):
        val_kind = None

    assert not isinstance(NoValKind(folder.scan_both(tree), 16), sources.Source)
    with pytest.raises(UsageError, match="no such directory"):
        sources.get_source(str(tmp_path / "absent"), 16)


def test_every_val_image_is_evaluated_once(tree):
    src = sources.get_source(tree, 16)
    n = len(src.val_labels)
    got = list(loader.val_stream(src, 5, 0))
    assert len(got) == -(-n // 5) == loader.val_batch_count(src, 5)
    valid = np.concatenate([v for _, _, v, _ in got])
    labels = np.concatenate([y for _, y, _, _ in got])
    assert valid.sum() == n and np.array_equal(labels[valid], src.val_labels)


def _item(i):
    """A loader item of arrays and a plain value (module level: workers import it)."""
    if i == 3:
        raise UsageError("item 3 is refused")
    if i == 5:
        raise ValueError("item 5 breaks")
    return np.full((2, 3), i, np.uint8), np.arange(i, dtype=np.float32), i


def _shm_blocks() -> set:
    """The shared memory blocks of this process's loader workers now in /dev/shm."""
    from twinstep.data import workers

    return {n for n in os.listdir("/dev/shm")
            if n.startswith(f"{workers.BLOCK_PREFIX}{os.getpid()}_")}


def test_loader_workers_deliver_in_order_refuse_as_the_parent_and_leave_nothing():
    """twinstep.data.workers: items in order, each array through shared memory; a worker's
    UsageError is the parent's UsageError, any other error one line; nothing is left in
    /dev/shm after a stream ends, fails or is closed early."""
    from twinstep.data import workers

    before = _shm_blocks()
    got = list(workers.stream(_item, 0, 3, 2, 2))
    assert [int(z) for _, _, z in got] == [0, 1, 2]
    assert all(np.array_equal(x, np.full((2, 3), i, np.uint8)) and x.dtype == np.uint8
               and np.array_equal(y, np.arange(i, dtype=np.float32)) for x, y, i in got)
    with pytest.raises(UsageError, match="item 3 is refused"):
        list(workers.stream(_item, 2, 6, 2, 2))
    with pytest.raises(workers.WorkerError, match=r"^loader worker, item 5: ValueError: item 5 "
                                                  r"breaks$"):
        list(workers.stream(_item, 4, 7, 1, 2))
    early = workers.stream(_item, 6, 40, 2, 3)
    next(early)
    early.close()  # six items in flight, built and never taken: their blocks are freed
    assert _shm_blocks() == before


def _zeros_item(i):
    """A loader item built in shared memory (`twinstep.data.workers.shared_zeros`), its first
    1 + i % 7 rows i + 1, and one copied there."""
    from twinstep.data import workers

    x = workers.shared_zeros((64, 4096), np.uint8)
    x[:1 + i % 7] = i + 1
    return x, np.full(8, i, np.int64)


def _holds(x, marks, i) -> bool:
    """Whether `_zeros_item` i is (x, marks)."""
    return (x[:1 + i % 7] == i + 1).all() and not x[1 + i % 7:].any() and (marks == i).all()


def _held_to_the_end() -> tuple[list, int]:
    """`_zeros_item` 0..39 taken one at a time from 2 workers 2 items ahead each, each dropped
    before the next is asked for, but every fifth, held to the end: (whether each held item
    still holds its values then, the number of blocks the stream made)."""
    from twinstep.data import workers

    before, names, held = _shm_blocks(), set(), []
    items = workers.stream(_zeros_item, 0, 40, 2, 2)
    for i in range(40):
        x, marks = next(items)
        names |= _shm_blocks() - before
        assert _holds(x, marks, i)
        if i % 5 == 0:
            held.append((i, x, marks))
        del x, marks
    assert next(items, None) is None  # the end: the stream's blocks are removed
    assert _shm_blocks() == before
    return [_holds(x, m, i) for i, x, m in held], len(names)


def test_loader_workers_reuse_a_block_only_once_no_array_is_over_it(monkeypatch):
    """twinstep.data.workers reuses a shared memory block once the parent holds no array over
    it: every fifth of 40 items is held to the end and still holds its values, where a block
    handed back while an array is over it is overwritten (the control: a parent that hands each
    block back as soon as it maps it); every block handed back goes with the next task, so the
    40 items of 2 arrays make 2 x (8 held + 4 in flight) blocks, not 80, however the processes
    are scheduled; a reused block reads as zeros where nothing was written."""
    from twinstep.data import workers

    kept, blocks = _held_to_the_end()
    assert len(kept) == 8 and all(kept)
    assert blocks == 2 * (len(kept) + 2 * 2), blocks
    take = workers._take

    def early(part, returns):
        gone = workers._Returns()
        gone.free = None  # the array's going hands nothing back...
        array = take(part, gone)
        if isinstance(part, tuple) and part[:1] == ("shm",):
            workers._give_back(returns, part[1])  # ...as it was handed back already
        return array

    monkeypatch.setattr(workers, "_take", early)
    kept, _ = _held_to_the_end()
    assert not any(kept)  # each held item's blocks went with the task sent next


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_a_packed_folder_trains_as_its_folder_does(tmp_path, capsys):
    """`twinstep pack`: an undecodable image is reported and left out, the rest keep their
    order and classes; a packed split's batches are a function of (seed, step) whatever the
    workers; an image read back is its original within the re-encode (eval crops' PSNR over
    30 dB at q90, and a q10 pack is the control that falls below it); a packed folder cut short
    is refused, as is packing into a folder that holds something."""
    from twinstep import api, cli
    from twinstep.data import packed

    tree = write_folder(str(tmp_path / "tree"))
    original = folder.scan(tree, "train")
    with open(original.paths[1], "wb") as f:
        f.write(b"\xff\xd8 truncated")
    out = str(tmp_path / "packed")
    assert cli.main(["pack", tree, "--out", out, "--max-side", "24"]) == 0
    said = capsys.readouterr()
    assert said.err.count("does not read (") == 1 and original.paths[1] in said.err
    assert "in 1 shard," in said.out and "1 shards" not in said.out
    assert "1 left out" in said.out
    train, val = packed.open_splits(out, verify=True)
    kept = [i for i in range(len(original)) if i != 1]
    assert np.array_equal(train.labels, original.labels[kept]) and len(val) == 12
    assert min(train.image(0).size) == 24  # 30 x 26 brought down to a short side of 24
    src = sources.get_source(out, 16)
    assert isinstance(src.train, packed.Split) and sources.train_size(out) == 11
    with pytest.raises(UsageError, match="is packed, with its val split"):
        sources.open_splits(out, val_split=0.1)
    augment = sources.Augment(randaugment=9, mix=mix.MixParams(0.2, 1.0))
    alone = list(loader.train_stream(src, augment, seed=7, start=0, stop=3, micro=2, rows=4,
                                     workers=0))
    pooled = list(loader.train_stream(src, augment, seed=7, start=0, stop=3, micro=2, rows=4,
                                      workers=2))
    assert all(np.array_equal(a, b) for x, y in zip(alone, pooled, strict=True)
               for a, b in zip(x, y, strict=True))
    # the re-encode: eval crops of the packed images against the originals' (no resize here)
    fine = str(tmp_path / "fine")
    coarse = str(tmp_path / "coarse")
    api.pack(tree, fine, max_side=64)
    api.pack(tree, coarse, max_side=64, quality=10)
    vals = folder.scan(tree, "val")
    for where, floor in ((fine, 30.0), (coarse, None)):
        split = packed.open_splits(where)[1]
        psnr = [_psnr(transforms.eval_transform(split.image(i), 16),
                      transforms.eval_transform(vals.image(i), 16))
                for i in range(len(vals))]
        if floor is not None:
            assert min(psnr) > floor, psnr
        else:
            assert min(psnr) < 30.0, psnr  # control: a coarse re-encode is seen
    # refusals, one line each: a non-empty --out; a packed folder missing a shard
    assert cli.main(["pack", tree, "--out", out]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    os.remove(os.path.join(out, "val-00000.array_record"))
    with pytest.raises(UsageError, match="shards cannot be read|images"):
        sources.get_source(out, 16)
