#!/bin/sh
# Container entrypoint: run the main job against the store, resuming from its latest complete
# checkpoint (`--resume auto`), and tell the scheduler whether the run is finished.
#
# Environment:
#   OPD_STORE_URL         required: s3://bucket/prefix, gs://bucket/prefix, or a path
#   OPD_UPDATES           required: successful updates to reach (part of the run's config)
#   OPD_CHECKPOINT_EVERY  save every K successful updates (default 50)
#   OPD_KEEP_LAST         optional: keep only the N newest complete checkpoints (default: keep all)
#   OPD_S3_ENDPOINT_URL   optional: an S3-compatible endpoint (MinIO, R2, moto in docker-compose)
# Extra arguments are passed on to `opd-store train` (see `opd-store train --help`).
#
# Exit status: opd-store's own (0 finished, 2 usage/unreachable store, 5 resume mismatch, ...),
# except after a SIGTERM/SIGINT (a spot preemption notice, a node drain): then it is 143 even when
# the job committed its checkpoint and exited 0, so Kubernetes, SkyPilot or a shell loop starts
# the job again instead of recording an unfinished run as done.
set -u
: "${OPD_STORE_URL:?set OPD_STORE_URL to the store URL, e.g. s3://my-bucket/runs/run-1}"
: "${OPD_UPDATES:?set OPD_UPDATES to the number of successful updates to reach}"

set -- --store "$OPD_STORE_URL" --updates "$OPD_UPDATES" \
    --checkpoint-every "${OPD_CHECKPOINT_EVERY:-50}" --resume auto "$@"
if [ -n "${OPD_KEEP_LAST:-}" ]; then
    set -- "$@" --keep-last "$OPD_KEEP_LAST"
fi
if [ -n "${OPD_S3_ENDPOINT_URL:-}" ]; then
    set -- "$@" --s3-endpoint-url "$OPD_S3_ENDPOINT_URL"
fi

preempted=0
child=
on_signal() {
    preempted=1
    if [ -n "$child" ]; then
        kill -TERM "$child" 2>/dev/null
    fi
}
trap on_signal TERM INT

opd-store train "$@" &
child=$!
# `wait` returns early (status > 128) when a trapped signal arrives: wait again for the job.
while :; do
    wait "$child"
    rc=$?
    if kill -0 "$child" 2>/dev/null; then
        continue
    fi
    break
done

if [ "$preempted" = 1 ]; then
    echo "entrypoint: stopped by a signal (job exit status $rc); exiting 143 so the run is started again" >&2
    exit 143
fi
exit "$rc"
