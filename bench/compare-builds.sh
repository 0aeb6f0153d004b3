#!/usr/bin/env bash
# Runs bench/src/bin/in_flight.rs (and the bench/tiny-cluster.toml it includes) against an old build and this one, alternating, and prints
# each build's median requests per second and the ratio new/old, per thread placement and way of
# counting (batches of 16, a closed loop of 16). The same source file is built in both trees, so
# only the runtime differs.
#
# Usage: bench/compare-builds.sh OLD_REV [ALTERNATIONS] [REQUESTS]
#   e.g. bench/compare-builds.sh a4d2999^ 4 3000   (the build before core::node)
set -euo pipefail
old_rev=${1:?usage: bench/compare-builds.sh OLD_REV [ALTERNATIONS] [REQUESTS]}
alternations=${2:-4}
requests=${3:-3000}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
old_commit=$(git -C "$repo" rev-parse --verify "$old_rev^{commit}")
old_tree=${TMPDIR:-/tmp}/pdkv-old-${old_commit:0:12}
if [ ! -d "$old_tree" ]; then
  git -C "$repo" worktree add --detach "$old_tree" "$old_commit" >/dev/null
fi
cp "$repo/bench/src/bin/in_flight.rs" "$old_tree/bench/src/bin/in_flight.rs"
cp "$repo/bench/tiny-cluster.toml" "$old_tree/bench/tiny-cluster.toml"
grep -q '^futures-util' "$old_tree/bench/Cargo.toml" ||
  sed -i 's/^\[dependencies\]$/[dependencies]\nfutures-util.workspace = true/' "$old_tree/bench/Cargo.toml"
echo "building $old_commit (old) and the working tree (new)" >&2
(cd "$old_tree" && CARGO_TARGET_DIR="$old_tree/target" cargo build --release -q -p pdkv-bench --bin in_flight)
(cd "$repo" && cargo build --release -q -p pdkv-bench --bin in_flight)
figures=$(mktemp)
for i in $(seq "$alternations"); do
  for build in old new; do
    if [ "$build" = old ]; then binary=$old_tree/target/release/in_flight; else binary=$repo/target/release/in_flight; fi
    "$binary" "$requests" 1 | sed "s/^in_flight /$build /" >>"$figures"
  done
done
# Lines: <build> "<threads>" <how> round N: <req/s> req/s
awk -F'"' '
  { split($3, rest, " "); key = $2 "|" rest[1]; build = $1; gsub(/ /, "", build)
    n = split($3, words, " "); value = words[n - 1]
    values[build, key] = values[build, key] " " value; keys[key] = 1 }
  function median(list,   items, count, i, j, t) {
    count = split(list, items, " ")
    for (i = 1; i <= count; i++) for (j = i + 1; j <= count; j++) if (items[j] + 0 < items[i] + 0) { t = items[i]; items[i] = items[j]; items[j] = t }
    return count % 2 ? items[(count + 1) / 2] : (items[count / 2] + items[count / 2 + 1]) / 2
  }
  END {
    for (key in keys) {
      split(key, parts, "|"); old = median(values["old", key]); new = median(values["new", key])
      printf "%-18s %-12s old %6.0f req/s (%s )  new %6.0f req/s (%s )  new/old %.2fx\n", parts[1], parts[2], old, values["old", key], new, values["new", key], new / old
    }
  }' "$figures" | sort
rm -f "$figures"
