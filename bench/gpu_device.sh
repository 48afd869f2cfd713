#!/usr/bin/env bash
# Run bench.gpu on a GPU machine that has torch with CUDA (and Lightning, transformers) but none of ckptd's
# other dependencies (pydantic, fastapi, uvicorn, zstandard, blosc2, ...) and no network: install those
# from carried wheels, make the checkout importable, run the benchmark, leave the result and logs in $OUT.
#
# On the device machine, from the repository root ($OUT is set there; elsewhere a temporary folder):
#     bash bench/gpu_device.sh                       # bench.gpu --gib 4 --repeat 3 --out $OUT/gpu.json
#     GIB=0.01 REPEAT=1 bash bench/gpu_device.sh    # a quick check first
#     bash bench/gpu_device.sh --reshard-repeat 1    # further arguments go to bench.gpu
# Budget: the 4 GiB run is 4 save rounds, 3 x 3 loads and 10 reshard cases x 3; an estimate, not a
# measurement, is 6 to 9 minutes on one H200 with 16 cores. Pass --reshard-repeat 1 to shorten it.
#
# The wheel folder ($WHEELS, default .whl) is built HERE, where pip reaches PyPI, for the device's Python
# (3.12 on the H200 machines: /work/.library/device/KINDS.md), and travels with the run (name it in
# `carry`). Torch is not in it: the device keeps its own CUDA build. Neither is what the device already
# has (numpy, httpx, fsspec, rich, safetensors, xxhash, prometheus-client, uvloop, anyio, click, h11,
# msgpack, threadpoolctl, annotated-doc). Build it with:
#     echo /.whl/ >> .git/info/exclude
#     bash bench/gpu_device.sh --download            # pip download --no-deps of $DEPS, at this venv's versions
# (DEVICE_PYTHON=3.11 for another Python; LOCAL_PY names the venv whose versions are taken.)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
WHEELS=${WHEELS:-.whl}
PY=${PY:-python3}
# ckptd's dependencies (and theirs) minus torch and what the device has: --no-deps takes exactly these.
DEPS="pydantic pydantic-core annotated-types typing-inspection typing-extensions zstandard blosc2 ndindex
      fastapi starlette opentelemetry-api uvicorn httptools pydantic-settings python-dotenv fastapi-offline"

if [[ "${1:-}" == "--download" ]]; then
    LOCAL_PY=${LOCAL_PY:-.venv/bin/python}
    specs=()
    for d in $DEPS; do
        v=$("$LOCAL_PY" -m pip show "$d" 2>/dev/null | awk '/^Version:/ {print $2}')
        [[ -n "$v" ]] || { echo "$d is not installed in $LOCAL_PY: install ckptd[server] there first" >&2; exit 1; }
        specs+=("$d==$v")
    done
    platforms=()
    for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
             manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
        platforms+=(--platform "${p}_x86_64")
    done
    mkdir -p "$WHEELS"
    "$LOCAL_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
        --implementation cp "${platforms[@]}" -d "$WHEELS" "${specs[@]}"
    du -sh "$WHEELS"
    exit 0
fi

OUT=${OUT:-$(mktemp -d /tmp/ckptd-gpu-out-XXXXXX)}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/ckptd-site}
exec > >(tee -a "$OUT/device.log") 2>&1
echo "== $(date -u +%FT%TZ) on $(hostname); results in $OUT"

# 1. ckptd's dependencies from the carried wheels, into a folder of their own (the system's stay untouched).
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
else
    echo "no wheels in $WHEELS: using what $PY already has"
    mkdir -p "$SITE"
fi
# 2. the checkout itself: its packages by their installed names (client/ is ckptd_client, schemas/ is
#    ckptd_schemas; pyproject's package-dir), linked, so nothing is built.
ln -sfn "$REPO/ckptd" "$SITE/ckptd"
ln -sfn "$REPO/client" "$SITE/ckptd_client"
ln -sfn "$REPO/schemas" "$SITE/ckptd_schemas"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# 3. what the run stands on, for the record; stop here if an import fails.
{
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("pydantic", "fastapi", "uvicorn", "zstandard", "blosc2", "httpx", "xxhash", "ckptd_client",
          "ckptd.service.app", "ckptd.cli.main"):
    importlib.import_module(m)
print("imports ok")
EOF
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    nproc; free -g | head -2; df -h "${TMPDIR:-/tmp}" | tail -1
} | tee "$OUT/env.txt"

# 4. the benchmark; its work folder is kept so that its logs can be copied to $OUT, then removed.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ckptd-gpu-work-XXXXXX")
rc=0
"$PY" -m bench.gpu --gib "${GIB:-4}" --repeat "${REPEAT:-3}" --out "$OUT/gpu.json" --workdir "$WORK" --keep "$@" \
    || rc=$?
for f in "$WORK"/*/*.log; do
    [[ -e "$f" ]] && cp "$f" "$OUT/"
done
rm -rf "$WORK"
echo "== bench.gpu exited $rc; $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
