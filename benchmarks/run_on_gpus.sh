#!/usr/bin/env bash
# Runs bench and tune parts on every GPU of one host at once, each GPU's parts one after another:
#
#   benchmarks/run_on_gpus.sh PARTS SECONDS
#
# PARTS: lines "GPU|command" (benchmarks/split_parts.py deals a tuning run or a grid out so),
# each run from the checkout with that GPU alone visible ("KIND" in a command becomes h100,
# h200 or "other", by the first GPU's name; in PARTS's own path too, so one call can carry a
# file per kind when the machine that comes may be either); parts for a GPU the host lacks are
# left out, with a line saying so. SECONDS: the whole run's limit, each part given what is
# left. Parts saved with --json and --resume go on where a run
# cut short stopped. Builds the CUDA kernels first (into $JAXFUSE_CACHE, default build/jfcache),
# from build/jfcache.tgz where the call carries one: a call whose build added kernels leaves
# this tree's kernels in $OUT/jfcache.tgz, to be carried as build/jfcache.tgz by the next call.
# Logs: build/logs/gpuN.log. With OUT set (a directory), the new results and the logs are
# archived into $OUT/results.tgz as they come, so a run killed at its limit keeps what it timed.
set -u
start=$(date +%s)
parts=$1 limit=$2
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXFUSE_CACHE=${JAXFUSE_CACHE:-build/jfcache}
mkdir -p build/logs
touch build/logs/started
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in *H200*) kind=h200 ;; *H100*) kind=h100 ;; *) kind=other ;; esac
gpus=$(nvidia-smi -L | wc -l)
parts=${parts//KIND/$kind}
echo "$gpus GPUs, $name: KIND=$kind, parts from $parts"
if [ -f build/jfcache.tgz ]; then
  mkdir -p "$JAXFUSE_CACHE" && tar xzf build/jfcache.tgz -C "$JAXFUSE_CACHE"
fi
timeout 300 python -m jaxfuse build > build/logs/build.log 2>&1
echo "build rc $? at $(( $(date +%s) - start )) s"

save_cache() {
  # The kernels the build reports (this source tree's keys), when it built any: older keys are
  # not carried on.
  [ -n "${OUT:-}" ] || return 0
  [ -n "$(find "$JAXFUSE_CACHE" -name '*.so' -newer build/logs/started 2>/dev/null)" ] || return 0
  sed -n 's|^[^ ]* for [a-z_0-9]*: \(.*\.so\)$|\1|p' build/logs/build.log \
    | tar czf "$OUT/jfcache.tgz.part" --transform 's|^.*/|cuda/|' -T - \
    && mv "$OUT/jfcache.tgz.part" "$OUT/jfcache.tgz"
}
save_cache

archive() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/results.tgz.part" build/logs \
    $(find benchmarks/results -newer build/logs/started -type f) 2>/dev/null
  mv "$OUT/results.tgz.part" "$OUT/results.tgz"
}

for gpu in $(cut -d'|' -f1 "$parts" | sort -u); do
  [ "$gpu" -lt "$gpus" ] || { echo "no GPU $gpu here: its parts are left out"; continue; }
  (
    grep "^$gpu|" "$parts" | cut -d'|' -f2- | sed "s/KIND/$kind/g" | while read -r command; do
      left=$((limit - ($(date +%s) - start)))
      [ "$left" -lt 40 ] && break
      echo "== $(date +%T) ${left}s left: $command" >> "build/logs/gpu$gpu.log"
      CUDA_VISIBLE_DEVICES=$gpu timeout "$left" bash -c "$command" \
        >> "build/logs/gpu$gpu.log" 2>&1 < /dev/null
      echo "== rc $? at $(date +%T)" >> "build/logs/gpu$gpu.log"
    done
  ) &
done
while [ -n "$(jobs -r)" ]; do sleep 20; archive; done
wait
archive
for log in build/logs/gpu*.log; do
  echo "### $log"
  # "resuming" shows a part that went on with a saved run (one already whole times nothing).
  grep -E "^==|FAILED|geometric mean .* points$|saved|^resuming|^no run at" "$log" | tail -24
done
echo "$(( $(date +%s) - start )) s"
