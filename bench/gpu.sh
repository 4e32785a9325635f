#!/usr/bin/env bash
# The GPU check, one script in parts, and `lease`, what a lent GPU must measure in one command
# (below, before `set -u`). The parts: `step`, twinstep's bf16 train step of each net at
# 224² on one device (img/s, MFU; bench/gpu/step.py); `hlo`, whether XLA kept the bf16
# convolutions bf16 (bench/gpu/bf16_hlo.py); `train`, `twinstep train` end to end on generated
# JPEGs and their packed copy through Pillow (img/s, data vs step; bench/gpu/train.py);
# `feed`, the device loader (`--loader device`): its host's and its GPU's shares alone
# (bench/gpu/feed.py), then ResNet-50 trained through it and through Pillow with RandAugment m9
# (bench/gpu/train.py); `profile`, where each net's step spends its time at batch 512 (kernel
# time by category, the top 40 kernels, bandwidth, useful MFU; bench/gpu/kernel_profile.py, each net
# in a process of its own). XLA's autotuning results are kept in bench/autotune/, which starts
# from the newest bench/leases/*/autotune.tgz, and written to $OUT/autotune.tgz for the next
# lease. Needs no network.
#
#   OUT=/tmp/lease bash bench/gpu.sh lease      # everything, in at most LEASE_DEADLINE=540 s
#   bash bench/gpu.sh [step] [hlo] [train]      # default: these three; from the repository root
#   NETS=mnv4 bash bench/gpu.sh step hlo        # any nets of twinstep.nets.NETS (default: resnet50 mnv4)
#   bash bench/gpu.sh feed                      # about 8 minutes on its own
#   bash bench/gpu.sh profile                   # at most 9 minutes (150+270+100 s)
#   STEP_ARGS=--recipe-res bash bench/gpu.sh step   # also each net at its recipe's resolution
#
# Each part has a time limit (step 360 s, hlo 150 s, train 300 s, feed 200 + 300 s). Seen on one H200 (2026-12-04,
# bench/RESULTS.md#gpu): step, ResNet-50 86 s, MobileNetV4 over 190 s (cut there; its autotuned
# compile at batch 256 alone took 81 s); hlo, ResNet-50 about 35 s, MobileNetV4 over 25 s (cut);
# train, 33 s writing the JPEGs, then ResNet-50's two Pillow paths in about 150 s. All of it
# does not fit one session's 15 minutes of device time: pick parts and NETS.
#
# JAX with CUDA: the python3 on PATH (or $PY) is used as it is when its JAX sees a GPU; else the
# [cuda] extra is installed, from wheels in ./.wheels when that folder exists (no network needed:
# `pip download 'jax[cuda12]>=0.10.2,<0.11' -d .wheels` on a machine that has one), else from the
# package index. twinstep itself runs from this checkout (PYTHONPATH), not installed, as does
# the `bench` package the scripts import their neighbours from (bench/gpu/). When the
# machine's JAX sees a GPU but twinstep's other dependencies are missing (an offline machine
# with its own JAX), the wheels in ./.wheels other than JAX's are unpacked into a private folder
# put on PYTHONPATH, the machine's JAX left as it is; on 2026-12-04 an H200 machine needed
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform \
#     manylinux_2_28_x86_64 -d .wheels grain==0.2.18 array_record==0.8.6 portpicker \
#     tensorboardX==2.6.5 optax==0.2.8 orbax-checkpoint==0.12.8
# nvImageCodec (feed): the machine's, else its wheel and nvJPEG's in ./.wheels (25 + 4 MB,
# unpacked side by side so nvImageCodec finds libnvjpeg.so.13 by its RPATH, ../../cu13/lib):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform \
#     manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .wheels \
#     'nvidia-nvimgcodec-cu13>=0.9,<0.10' 'nvidia-nvjpeg>=13,<14'
# The loader processes decode on the GPU, each with a CUDA context of its own: the feed part
# leaves them 40 % of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 for JAX).
# Its CPU twin: `python bench/gpu/feed.py --res 64 --batch 32 --images 64 --workers 2` here.
# Results: bench/gpu_step.json, bench/gpu_train.json (and the optimized HLO in bench/hlo/), or
# under $OUT/ when $OUT
# is set; their numbers (img/s and MFU per net, the bf16 check's verdict) belong under the
# heading "## GPU" of bench/RESULTS.md, written there by hand: this script writes JSON only.
# Exit: 0 ran, 1 a bf16 check failed, 2 no GPU, 3 environment error or a part failed.
#
# `lease` runs alone: what a lent GPU must measure, in one command under a deadline
# (bench/gpu/lease.py): the device feed, ResNet-50's `twinstep train` against its bare step,
# ResNet-50's step A/B of every candidate, then each net's step, each part under its own limit,
# the whole within LEASE_DEADLINE seconds (default 540) of this script's start, installing
# included; one summary table printed last, every file under $OUT (or bench/lease/). Exit: 0
# every part ran, 1 a check failed, 2 no GPU or bad usage, 3 a part failed or the environment,
# 4 a part was cut or skipped. LEASE_PARTS="ab nets" runs only those (a rerun: the rest of a
# session's time); LEASE_TWIN=1 runs its CPU twin with $PY, no GPU (tiny shapes).
# Its files, with $OUT/autotune.tgz, are committed as bench/leases/<date>-<card>/ (its first line
# names the folder), and its candidates adopted or removed by the rule in bench/README.md.
set -u
parts=" ${*:-step hlo train} "
for part in $parts; do
    case $part in step | hlo | train | feed | profile | lease) ;;
        *) echo "gpu.sh: no part '$part' (step, hlo, train, feed, profile, lease)" >&2
            exit 2 ;; esac
done
deadline=${LEASE_DEADLINE:-540}
if [[ $parts == *" lease "* ]]; then
    [ "$parts" = " lease " ] || { echo "gpu.sh: 'lease' runs alone (it holds the others)" >&2
        exit 2; }
    [[ $deadline =~ ^[0-9]+$ ]] && [ "$deadline" -gt 0 ] ||
        { echo "gpu.sh: LEASE_DEADLINE must be seconds, not '$deadline'" >&2; exit 2; }
fi
# shellcheck disable=SC2206 # the nets are words
nets=(${NETS:-resnet50 mnv4})
cd "$(dirname "$0")/.." || exit 3
PY=${PY:-python3}
out=${OUT:-bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${LEASE_TWIN:-}" = 1 ] && [ "$parts" = " lease " ]; then
    # the lease's CPU twin: this machine's JAX as it is, nothing installed, no GPU
    "$PY" -c 'import jax, twinstep.api' 2> /dev/null || {
        echo "gpu.sh: $PY does not import JAX and twinstep (the twin: PY=.venv/bin/python)" >&2
        exit 3; }
    # shellcheck disable=SC2086 # the parts are words
    exec "$PY" bench/gpu/lease.py --twin --out "${OUT:-bench/lease}" \
        --deadline "$((deadline - SECONDS))" ${LEASE_PARTS:+--parts $LEASE_PARTS}
fi
# XLA's GPU flags: autotuned cuDNN convolutions (the default level), and the collective and
# latency-hiding scheduler left as they are: one device has no collectives.
export XLA_FLAGS=${XLA_FLAGS:---xla_gpu_autotune_level=4}
# XLA's autotuning results, per fusion, kept from lease to lease: every part reads and adds to
# bench/autotune/, which starts from the newest lease's copy in bench/leases/ (a results file
# keyed by the GPU and XLA's version, so another card or XLA only misses)
if [ ! -d bench/autotune ]; then
    saved=$(find bench/leases -name autotune.tgz 2> /dev/null | sort | tail -1)
    mkdir -p bench/autotune
    [ -n "$saved" ] && tar -xzf "$saved" -C bench
fi
export XLA_FLAGS="$XLA_FLAGS --xla_gpu_per_fusion_autotune_cache_dir=$PWD/bench/autotune"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

has_gpu() { "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; }
# no NVIDIA GPU: stop before installing anything
nvidia-smi -L > /dev/null 2>&1 || { echo "gpu.sh: no NVIDIA GPU on this machine" >&2; exit 2; }
if ! has_gpu; then
    echo "gpu.sh: $PY's JAX sees no GPU; installing the [cuda] extra" >&2
    if [ -d .wheels ]; then
        "$PY" -m pip install -q --no-index --find-links .wheels -e '.[cuda]' || exit 3
    else
        "$PY" -m pip install -q -e '.[cuda]' || exit 3
    fi
    has_gpu || { echo "gpu.sh: no GPU for JAX on this machine" >&2; exit 2; }
fi
# what the parts import beyond the machine's usual packages
deps='import twinstep.api, grain, array_record, portpicker, orbax.checkpoint, optax, tensorboardX'
if ! "$PY" -c "$deps" 2>/dev/null && [ -d .wheels ]; then
    site=$(mktemp -d)
    wheels=$(find .wheels -name '*.whl' ! -name 'jax-*' ! -name 'jaxlib-*' ! -name 'jax_*')
    # shellcheck disable=SC2086 # the wheels are words
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" $wheels || exit 3
    export PYTHONPATH=$PYTHONPATH:$site
fi
"$PY" -c "$deps" || { echo "gpu.sh: twinstep's dependencies do not import here" >&2; exit 3; }
"$PY" -c 'import jax; d = jax.devices()[0]; print(f"jax {jax.__version__} on {d.device_kind}")'
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
    2>/dev/null || true

step=0 bf16=0 train=0
if [[ $parts == *" step "* ]]; then
    # shellcheck disable=SC2086 # the arguments are words
    timeout 360 "$PY" bench/gpu/step.py --nets "${nets[@]}" --json "$out/gpu_step.json" \
        ${STEP_ARGS:-}
    step=$?
fi
if [[ $parts == *" hlo "* ]]; then
    timeout 150 "$PY" bench/gpu/bf16_hlo.py --nets "${nets[@]}" --hlo-dir "$out/hlo"
    bf16=$?
fi
if [[ $parts == *" train "* ]]; then
    timeout 300 "$PY" bench/gpu/train.py --nets "${nets[@]}" --json "$out/gpu_train.json" \
        --paths pillow pillow-packed
    train=$?
fi
# nvImageCodec and nvJPEG from ./.wheels where the machine has none (feed, lease)
nvimgcodec() {
    if ! "$PY" -c 'import nvidia.nvimgcodec' 2>/dev/null && [ -d .wheels ]; then
        site=${site:-$(mktemp -d)}
        # shellcheck disable=SC2046 # the wheels are words
        "$PY" -m pip install -q --no-index --no-deps --target "$site" \
            $(find .wheels -name 'nvidia_nvimgcodec*.whl' -o -name 'nvidia_nvjpeg-*.whl') &&
            export PYTHONPATH=$PYTHONPATH:$site
    fi
    "$PY" -c 'import nvidia.nvimgcodec' 2>/dev/null
}
if [ "$parts" = " lease " ]; then
    nvimgcodec || echo "gpu.sh: nvImageCodec does not import here: no device feed" >&2
    # what is left of the deadline after the install (at least 1 s: then every part is
    # skipped, and said so); the autotuning results are copied after
    left=$((deadline - SECONDS))
    # shellcheck disable=SC2086 # the parts are words
    "$PY" bench/gpu/lease.py --out "${OUT:-bench/lease}" --deadline "$((left > 0 ? left : 1))" \
        ${LEASE_PARTS:+--parts $LEASE_PARTS}
    lease=$?
    [ -n "${OUT:-}" ] && tar -czf "$OUT/autotune.tgz" -C bench autotune 2> /dev/null
    exit "$lease"
fi
feed=0
if [[ $parts == *" feed "* ]]; then
    if nvimgcodec; then
        export XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
        timeout 200 "$PY" bench/gpu/feed.py --json "$out/gpu_feed.json"
        feed=$?
        timeout 300 "$PY" bench/gpu/train.py --nets resnet50 --paths device pillow \
            --randaugment 9 --json "$out/gpu_train_feed.json" || feed=3
    else
        echo "gpu.sh: nvImageCodec does not import here: no feed timing" >&2
        feed=3
    fi
fi
profile=0
if [[ $parts == *" profile "* ]]; then
    # each net at 224² with its A/B and optimized HLO, then MobileNetV4 at its recipe's 256²
    # alone; ResNet-50 first, with the least time: its compiles are the shortest
    for run in "resnet50 224 150 --ab --hlo" "mnv4 224 270 --ab --hlo" "mnv4 256 100"; do
        read -r net res limit extra <<< "$run"
        [[ " ${nets[*]} " == *" $net "* ]] || continue
        # shellcheck disable=SC2086 # the extra arguments are words
        timeout $((limit + 20)) "$PY" bench/gpu/kernel_profile.py --nets "$net" --res "$res" \
            --out "$out/profile" --limit "$limit" $extra || profile=3
    done
fi
# the autotuning results, to be committed as bench/leases/<date>-<card>/autotune.tgz
[ -n "${OUT:-}" ] && tar -czf "$OUT/autotune.tgz" -C bench autotune 2> /dev/null
echo "gpu.sh:${parts}: step exit $step, hlo exit $bf16, train exit $train," \
    "feed exit $feed, profile exit $profile"
[ "$step" -eq 0 ] && [ "$bf16" -eq 0 ] && [ "$train" -eq 0 ] && [ "$feed" -eq 0 ] &&
    [ "$profile" -eq 0 ] && exit 0
[ "$bf16" -eq 1 ] && exit 1
exit 3
