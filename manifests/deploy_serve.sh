#!/usr/bin/env bash
# Deploy manifests/serve.yaml onto the running cluster from its head node; exit non-zero (and
# say why) if it never succeeds, so `ray up` fails loudly instead of reporting "up-to-date".
# Serve's REST API comes up with the dashboard a few seconds after `ray start`: retry until
# then, bounded (PDSERVE_DEPLOY_TRIES x PDSERVE_DEPLOY_WAIT_S, default 30 x 2 s).
set -u
config="${1:-$HOME/pdserve/manifests/serve.yaml}"
tries="${PDSERVE_DEPLOY_TRIES:-30}"
wait_s="${PDSERVE_DEPLOY_WAIT_S:-2}"
for ((i = 1; i <= tries; i++)); do
    if out=$(serve deploy "$config" 2>&1); then
        echo "$out"
        echo "pdserve: deployed $config (try $i)"
        exit 0
    fi
    last="$out"
    sleep "$wait_s"  # retry backoff while the dashboard starts
done
echo "$last" >&2
echo "pdserve: serve deploy of $config failed $tries times; last error above" >&2
exit 1
