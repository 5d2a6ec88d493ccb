#!/usr/bin/env bash
# A real `ray up` of pdserve on two loopback "machines", end to end, with a pass/fail line:
#
#   sudo apt-get install -y openssh-server rsync     # once; needs root for what follows
#   bash scripts/ray_up_local.sh                     # from the repository root, after `make test`
#
# Each node is a "machine" of its own: an sshd listening on 127.0.0.2 (head) or 127.0.0.3
# (worker) inside its own PID and mount namespace (`unshare`), with a private /tmp and a
# private home. So `ray up` / `ray down` run exactly as on real machines (SSH, rsync of the
# file mounts, token auth, `ray stop` on the head), and Ray's `ray stop` there only sees that
# node's processes: nothing else running on this machine is touched.
#
# Steps (every wait bounded): `ray up` of a manifest made like manifests/local.yaml (the
# token file-mounted, RAY_AUTH_MODE=token, HAProxy, the v1 autoscaler, the deploy step that
# fails loudly) -> one chat request through P/D on the real default model (the answer must
# name Paris) -> `pdserve scale` to 2 prefill + 2 decode, until replicas of both roles run on
# both nodes -> 8 concurrent chat requests, all answered -> `ray down` -> every Ray process of
# both nodes gone within 30 s (the worker's by itself: the manifests set
# RAY_gcs_rpc_server_reconnect_timeout_s so a worker whose head is gone exits in seconds).
#
# Unlike manifests/local.yaml, the nodes reuse this checkout's venv (PDSERVE_VENV, default
# .venv) instead of creating one and pip-installing pdserve with torch on each "machine".
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${PDSERVE_VENV:-$REPO/.venv}
HEAD_IP=127.0.0.2
WORKER_IP=127.0.0.3
T0=$(date +%s)

say() { echo "[ray_up_local $(($(date +%s) - T0))s] $*"; }
fail() { say "FAIL: $*"; RESULT=fail; exit 1; }

[ "$(id -u)" = 0 ] || { echo "FAIL: needs root (PID/mount namespaces, sshd)"; exit 1; }
for tool in /usr/sbin/sshd rsync ssh ssh-keygen unshare curl; do
    command -v "$tool" >/dev/null || { echo "FAIL: $tool missing (apt-get install -y openssh-server rsync curl)"; exit 1; }
done
[ -x "$VENV/bin/ray" ] || { echo "FAIL: no Ray in $VENV (run make test first, or set PDSERVE_VENV)"; exit 1; }

# Not under /tmp: the nodes get a private /tmp of their own.
WORK=$(mktemp -d /var/tmp/pdserve-rayup.XXXXXX)
NAME="pdserve-loopback-$$"
free_port() { "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GCS_PORT=$(free_port); DASH_PORT=$(free_port); HTTP_PORT=$(free_port)
# HTTP on the head's 127.0.0.1: HAProxy reaches a replica on its own node at 127.0.0.1 whatever
# the node's address (Ray's haproxy.py), so a replica bound to 127.0.0.2 would be unreachable.
# The ingress replica lands on the head: the deploy runs before the autoscaler adds the worker.
URL="http://127.0.0.1:$HTTP_PORT"
declare -A SSHD_PID INIT_PID

ns_of() { readlink "/proc/$1/ns/pid" 2>/dev/null; }
# PIDs (host view) of the processes in node $1's namespace, sshd and its session helpers excepted.
node_procs() {
    local ns pid
    ns=$(ns_of "${SSHD_PID[$1]}") || return 0
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [ "$(ns_of "$pid")" = "$ns" ] || continue
        case "$(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline")" in
            ""|*sshd*|unshare*|*"$WORK/node-init"*) ;;
            *) echo "$pid" ;;
        esac
    done
}
count_titles() { local n=0 pid; for pid in $(node_procs "$1"); do
    tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" | grep -q "$2" && n=$((n + 1)); done; echo $n; }

cleanup() {
    local node pid
    if [ "${RESULT:-}" != pass ] && [ -f "$WORK/cluster.yaml" ] && [ -z "${DOWN_DONE:-}" ]; then
        timeout 120 "$VENV/bin/ray" down -y "$WORK/cluster.yaml" >"$WORK/ray-down-cleanup.log" 2>&1
    fi
    for node in head worker; do
        [ -n "${INIT_PID[$node]:-}" ] || continue
        # unshare --kill-child: its death kills the namespace's init, and with it every
        # process left in that namespace.
        kill -KILL "${INIT_PID[$node]}" 2>/dev/null
    done
    rm -f "/tmp/cluster-$NAME.state" "/tmp/cluster-$NAME.lock"
    [ -n "${KEEP:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT

# ---- two "machines" ---------------------------------------------------------------------
ssh-keygen -q -t ed25519 -N "" -f "$WORK/key"
ssh-keygen -q -t ed25519 -N "" -f "$WORK/hostkey"
mkdir -p "$HOME/.ray"
[ -s "$HOME/.ray/auth_token" ] || "$VENV/bin/python" -c "import secrets; print(secrets.token_hex(32))" > "$HOME/.ray/auth_token"
PYTHON_IN_HOME=""
case "$(readlink -f "$VENV/bin/python")" in
    "$HOME"/*) PYTHON_IN_HOME=$(readlink -f "$VENV/bin/python"); PYTHON_IN_HOME=${PYTHON_IN_HOME#"$HOME"/}; PYTHON_IN_HOME=${PYTHON_IN_HOME%%/*} ;;
esac
cat > "$WORK/node-init" <<EOF
#!/usr/bin/env bash
# PID 1 of a node's namespace: private /tmp and home, then sshd on the node's address.
set -e
mount -t tmpfs tmpfs /tmp
mkdir -p $WORK/hostroot.\$1
mount --bind "$HOME" $WORK/hostroot.\$1
mount -t tmpfs tmpfs "$HOME"
# The venv's interpreter may live in the home directory (pyenv, uv): keep that part visible.
if [ -n "$PYTHON_IN_HOME" ]; then
    mkdir -p "$HOME/$PYTHON_IN_HOME"
    mount --bind "$WORK/hostroot.\$1/$PYTHON_IN_HOME" "$HOME/$PYTHON_IN_HOME"
fi
mkdir -p -m 700 "$HOME/.ssh"
cp "$WORK/key.pub" "$HOME/.ssh/authorized_keys"
ln -s "$VENV" "$HOME/pdserve-venv"
/usr/sbin/sshd -D -e -o ListenAddress=\$1 -o HostKey=$WORK/hostkey -o PidFile=none \\
    -o PermitRootLogin=prohibit-password -o PasswordAuthentication=no -o UsePAM=no \\
    -o StrictModes=no -o MaxStartups=50 &
wait
EOF
chmod +x "$WORK/node-init"
mkdir -p /run/sshd
for node in head worker; do
    ip=$HEAD_IP; [ $node = worker ] && ip=$WORKER_IP
    setsid unshare --pid --fork --kill-child --mount-proc --mount "$WORK/node-init" "$ip" >"$WORK/sshd-$node.log" 2>&1 &
    INIT_PID[$node]=$!
    disown  # its end (killed at clean-up) is expected: no job-control report
done
for node in head worker; do
    ip=$HEAD_IP; [ $node = worker ] && ip=$WORKER_IP
    for _ in $(seq 100); do  # sshd listening: at most 10 s
        ssh -q -i "$WORK/key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=2 \
            "root@$ip" true 2>/dev/null && break
        sleep 0.1
    done
    # The node's sshd: the child of the namespace's init (the child of unshare).
    init=$(pgrep -P "${INIT_PID[$node]}" | head -1)
    SSHD_PID[$node]=$( [ -n "$init" ] && pgrep -P "$init" -f "ListenAddress=$ip" | head -1)
    [ -n "${SSHD_PID[$node]}" ] || fail "sshd for $node ($ip) did not start: $(cat "$WORK/sshd-$node.log")"
done
say "nodes up: head $HEAD_IP, worker $WORKER_IP (sshd in their own namespaces)"

# ---- the cluster: manifests/local.yaml with this machine's addresses and ports ------------
STARTENV="export RAY_AUTH_MODE=token RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=5 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=134217728 RAY_gcs_rpc_server_reconnect_timeout_s=10"
sed -e "s/^      model: null.*/      model: null/" \
    -e "s/^  host: 0.0.0.0/  host: 127.0.0.1/" -e "s/^  port: 8000/  port: $HTTP_PORT/" \
    -e "s/^      replica_num_gpus: 1 .*/      replica_num_gpus: 0/" \
    -e "s/^      replica_num_cpus: 1/      replica_num_cpus: 0.5/" \
    -e "s/^      dtype: auto .*/      dtype: float32/" \
    -e "s/^      max_num_seqs: 256/      max_num_seqs: 16/" \
    "$REPO/manifests/serve.yaml" > "$WORK/serve.yaml"
cat > "$WORK/cluster.yaml" <<EOF
cluster_name: $NAME
provider: {type: local, head_ip: $HEAD_IP, worker_ips: [$WORKER_IP]}
auth: {ssh_user: root, ssh_private_key: $WORK/key}
file_mounts:
  ~/pdserve: $REPO
  ~/.ray/auth_token: ~/.ray/auth_token
  ~/serve.yaml: $WORK/serve.yaml
rsync_exclude: [.venv, .git, "**/__pycache__"]
setup_commands:
  - ~/pdserve-venv/bin/python -c 'import cluster, engine, ray'
  - grep -q pdserve-venv ~/.bashrc 2>/dev/null || echo "export PATH=~/pdserve-venv/bin:\\\$PATH" >> ~/.bashrc
head_start_ray_commands:
  - $STARTENV; ulimit -n 65536; ~/pdserve-venv/bin/ray start --head --node-ip-address=$HEAD_IP --port=$GCS_PORT --dashboard-host=$HEAD_IP --dashboard-port=$DASH_PORT --num-cpus=3 --autoscaling-config=~/ray_bootstrap_config.yaml
  - $STARTENV RAY_DASHBOARD_ADDRESS=http://$HEAD_IP:$DASH_PORT PATH=~/pdserve-venv/bin:\$PATH; bash ~/pdserve/manifests/deploy_serve.sh ~/serve.yaml
worker_start_ray_commands:
  - $STARTENV; ulimit -n 65536; ~/pdserve-venv/bin/ray start --address=$HEAD_IP:$GCS_PORT --node-ip-address=$WORKER_IP --num-cpus=3
  - setsid nohup bash -c 'while pgrep -f "[r]aylet/raylet" >/dev/null; do sleep 5; done; ~/pdserve-venv/bin/ray stop --force' >/dev/null 2>&1 &
EOF
say "ray up (log $WORK/ray-up.log) ..."
export RAY_UP_enable_autoscaler_v2=0
timeout 600 "$VENV/bin/ray" up -y "$WORK/cluster.yaml" --no-config-cache >"$WORK/ray-up.log" 2>&1 \
    || { tail -30 "$WORK/ray-up.log"; fail "ray up exited non-zero"; }
say "ray up exited 0"

# The worker node is started by the head's autoscaler (v1): wait for its raylet.
for _ in $(seq 240); do [ "$(count_titles worker raylet)" -ge 1 ] && break; sleep 0.5; done
[ "$(count_titles worker raylet)" -ge 1 ] || fail "the worker node never started Ray (see $WORK/ray-up.log)"

chat() {  # chat QUESTION -> the answer's text (or nothing)
    curl -s -m 120 "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d "{\"model\": \"SmolLM2-135M-Instruct\",
        \"max_tokens\": 24, \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"$1\"}]}" \
        | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])' 2>/dev/null
}
for _ in $(seq 300); do curl -sf -m 2 "$URL/v1/models" >/dev/null && break; sleep 1; done
answer=$(chat "What is the capital of France?")
say "chat over P/D: $answer"
case "$answer" in *Paris*) ;; *) fail "the P/D answer does not name Paris: '$answer'";; esac

# ---- scale onto both nodes ----------------------------------------------------------------
"$VENV/bin/pdserve" scale --url "$URL" --prefill 2 --decode 2 >"$WORK/scale.log" 2>&1 || fail "pdserve scale: $(cat "$WORK/scale.log")"
# With direct streaming (the default) the decode replicas are the Ingress replicas.
ENGINES='ServeReplica:pdserve:\(Prefill\|Ingress\)'
placed() { for node in head worker; do echo -n "$node: $(count_titles $node 'ServeReplica:pdserve:Prefill') prefill $(count_titles $node 'ServeReplica:pdserve:Ingress') decode; "; done; }
for _ in $(seq 240); do
    p=$(( $(count_titles head 'ServeReplica:pdserve:Prefill') + $(count_titles worker 'ServeReplica:pdserve:Prefill') ))
    d=$(( $(count_titles head 'ServeReplica:pdserve:Ingress') + $(count_titles worker 'ServeReplica:pdserve:Ingress') ))
    [ "$p" -ge 2 ] && [ "$d" -ge 2 ] && [ "$(count_titles worker "$ENGINES")" -ge 1 ] \
        && [ "$(count_titles head "$ENGINES")" -ge 1 ] \
        && curl -sf -m 5 "$URL/status" | grep -q '"scaling": *false' && break
    sleep 0.5
done
say "replicas after scale: $(placed)"
[ "$p" -ge 2 ] && [ "$d" -ge 2 ] || fail "scaled to 2 prefill + 2 decode, but $p prefill and $d decode replicas run"
[ "$(count_titles worker "$ENGINES")" -ge 1 ] || fail "no engine replica on the worker node"
pids=(); for i in $(seq 8); do (chat "Name one city in France. ($i)" > "$WORK/answer-$i") & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
ok=0; for i in $(seq 8); do [ -s "$WORK/answer-$i" ] && ok=$((ok + 1)); done
say "8 concurrent chats after scale: $ok answered"
[ "$ok" = 8 ] || fail "$((8 - ok)) of 8 concurrent requests got no answer"

# ---- ray down: nothing left on either node ------------------------------------------------
timeout 300 "$VENV/bin/ray" down -y "$WORK/cluster.yaml" >"$WORK/ray-down.log" 2>&1 || fail "ray down exited non-zero"
DOWN_DONE=1
down_t=$(date +%s)
deadline=$((SECONDS + 30))
while [ $SECONDS -lt $deadline ] && [ -n "$(node_procs head)$(node_procs worker)" ]; do sleep 0.5; done
left=$(for n in head worker; do for pid in $(node_procs $n); do echo "$n: $(tr '\0' ' ' 2>/dev/null < /proc/$pid/cmdline | cut -c1-80)"; done; done)
[ -z "$left" ] || fail "still running $(($(date +%s) - down_t)) s after ray down: $left"
say "ray down: every process of both nodes gone after $(($(date +%s) - down_t)) s"
RESULT=pass
say "PASS: ray up -> P/D chat (Paris) -> scale 2+2 over both nodes -> 8/8 answered -> ray down, nothing left ($(($(date +%s) - T0)) s)"
