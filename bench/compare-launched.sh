#!/usr/bin/env bash
# Serial requests through `pdkv launch` of bench/tiny-cluster.toml, an old build against this one:
# both clusters run side by side and `pdkv load --concurrency 1` (this build's client for both)
# alternates between them, so a slow moment of a shared machine falls on both. Prints each round
# and each build's median p50 and requests per second, and the ratio new/old.
#
# Usage: bench/compare-launched.sh OLD_REV [ROUNDS] [SECONDS]
#   e.g. bench/compare-launched.sh HEAD~1 8 5
set -euo pipefail
old_rev=${1:?usage: bench/compare-launched.sh OLD_REV [ROUNDS] [SECONDS]}
rounds=${2:-8}
seconds=${3:-5}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
old_commit=$(git -C "$repo" rev-parse --verify "$old_rev^{commit}")
old_tree=${TMPDIR:-/tmp}/pdkv-old-${old_commit:0:12}
if [ ! -d "$old_tree" ]; then
  git -C "$repo" worktree add --detach "$old_tree" "$old_commit" >/dev/null
fi
echo "building $old_commit (old) and the working tree (new)" >&2
(cd "$old_tree" && CARGO_TARGET_DIR="$old_tree/target" cargo build --release -q --bin pdkv)
(cd "$repo" && cargo build --release -q --bin pdkv)
new_pdkv=$repo/target/release/pdkv
work=$(mktemp -d)
launches=()
stop() {
  for pid in "${launches[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${launches[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap stop EXIT
cp "$repo/bench/tiny-cluster.toml" "$work/cluster.toml"
declare -A router
for build in old new; do
  if [ "$build" = old ]; then binary=$old_tree/target/release/pdkv; else binary=$new_pdkv; fi
  "$binary" launch --config "$work/cluster.toml" --run-dir "$work/run-$build" >"$work/$build.out" 2>&1 &
  launches+=($!)
  for _ in $(seq 300); do
    url=$(sed -n 's/^READY router=\([^ ]*\).*/\1/p' "$work/$build.out")
    [ -n "$url" ] && break
    sleep 0.1
  done
  [ -n "$url" ] || { cat "$work/$build.out" >&2; echo "the $build cluster did not come up" >&2; exit 1; }
  router[$build]=$url
done
figures=$work/figures
for i in $(seq "$rounds"); do
  for build in old new; do
    "$new_pdkv" load --router "${router[$build]}" --config "$work/cluster.toml" --concurrency 1 \
      --lengths 32 --max-tokens 2 --duration "$seconds" --seed "$i" --json |
      python3 -c '
import json, sys
report = json.load(sys.stdin)
print(sys.argv[1], report["latency_ms"]["p50"] * 1e3, report["requests_per_s"], report["errors"])
' "$build" | tee -a "$figures"
  done
done
python3 - "$figures" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
median = {}
for build in ("old", "new"):
    mine = [row for row in rows if row[0] == build]
    p50 = statistics.median(float(row[1]) for row in mine)
    rps = statistics.median(float(row[2]) for row in mine)
    errors = sum(int(row[3]) for row in mine)
    median[build] = (p50, rps)
    print(f"{build}: median p50 {p50:.1f} us, median {rps:.0f} req/s, {errors} errors over {len(mine)} rounds")
print(f"new/old: p50 {median['new'][0] / median['old'][0]:.3f}x, req/s {median['new'][1] / median['old'][1]:.3f}x")
EOF
