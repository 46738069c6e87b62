#!/usr/bin/env bash
# kimi-verify end to end, as a user runs it: a 12-layer K3 and K3.1 checkpoint is generated,
# sliced to 8 layers with `kimi-verify slice`, converted by `kimi-convert` (F32 and BF16), and
# each file is checked against its checkpoint and alone. Any failed part fails the script.
set -euo pipefail
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for arch in k3 k31; do
  python -m kimi_convert.fixtures.make_checkpoint "$work/$arch-full" --arch "$arch" --layers 12 --seed 1 >/dev/null
  kimi-verify slice "$work/$arch-full" "$work/$arch" --layers 8
  for outtype in f32 bf16; do
    kimi-convert "$work/$arch" "$work/$arch-$outtype.gguf" --outtype "$outtype"
    kimi-verify check "$work/$arch" "$work/$arch-$outtype.gguf" --json "$work/$arch-$outtype.json"
  done
  kimi-verify check "$work/$arch-f32.gguf"
done
echo "verify_fixtures: all checks passed"
