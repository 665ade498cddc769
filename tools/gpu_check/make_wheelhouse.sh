#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12, CUDA torch, numpy, pandas, scipy, opencv, tensorboard,
# aiohttp, grpcio, rich, psutil and PyYAML but no package index (the workplace's `device` machine):
# Ray 2.60.0 without its Java jars (33 MB, unused), and what RLlib, gymnasium, ALE and pydantic add.
# Writes .whl/ (about 53 MB) in the repository root; `tools/gpu_check/run.sh` unpacks and uses it.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
platforms=(--platform any)
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d "$tmp" \
    "ray[rllib]==2.60.0" "gymnasium[classic-control]" ale-py "pydantic>=2.6"
mkdir -p .whl
for name in ale_py annotated_types dm_tree farama_notifications gymnasium jsonschema-4 jsonschema_specifications lz4 \
            ormsgpack pydantic-2 pydantic_core referencing rpds_py tensorboardx typing_inspection; do
    cp "$tmp/$name"*.whl .whl/
done
python3 - "$tmp"/ray-2.60.0-*.whl <<'PY'
import sys, zipfile
src = zipfile.ZipFile(sys.argv[1])
with zipfile.ZipFile(".whl/ray-2.60.0-stripped.zip", "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if not (info.filename.startswith("ray/jars/") or info.filename.endswith(".js.map")):
            out.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
PY
rm -rf "$tmp"
du -sh .whl
