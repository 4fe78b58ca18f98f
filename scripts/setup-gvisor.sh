#!/usr/bin/env bash
# Install gVisor (Debian package runsc) and register it with the running Docker engine as runtime "runsc".
#
# Idempotent; needs root. Existing keys of /etc/docker/daemon.json are kept; only runtimes.runsc is set (and
# runtimes.crun with --crun), and "experimental": true, which `docker checkpoint` needs (durable sessions keep a
# gVisor sandbox's memory through it: nbexec/sandbox/docker/checkpoint.py). The engine is reloaded with SIGHUP, which
# keeps running containers running; but a reload does not add the checkpoint routes (`docker info` then says
# ExperimentalBuild: true while the route answers 501): that takes an engine restart, which this script does only
# with --restart (CI, which owns its engine); otherwise it says so, and hibernated sessions replay instead. Afterwards `nbexec doctor --runtimes` starts a test container with each runtime.
#
#   sudo scripts/setup-gvisor.sh             # runsc only
#   sudo scripts/setup-gvisor.sh --crun      # also install crun and register it (it may still refuse some hosts)
#   sudo scripts/setup-gvisor.sh --restart   # restart the engine when it cannot checkpoint yet
set -euo pipefail

DAEMON_JSON=${DAEMON_JSON:-/etc/docker/daemon.json}
WITH_CRUN=0
RESTART=0
for arg in "$@"; do
    case "$arg" in
        --crun) WITH_CRUN=1 ;;
        --restart) RESTART=1 ;;
        *) echo "usage: $0 [--crun] [--restart]" >&2; exit 2 ;;
    esac
done
if [ "$(id -u)" -ne 0 ]; then
    echo "setup-gvisor.sh: run as root (it installs a package and edits $DAEMON_JSON)" >&2
    exit 1
fi

packages=()
command -v runsc >/dev/null 2>&1 || packages+=(runsc)
if [ "$WITH_CRUN" = 1 ] && ! command -v crun >/dev/null 2>&1; then packages+=(crun); fi
if [ "${#packages[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}"
fi

# runsc's own flags: --network=none, because without it this runsc refuses nbexec's containers here ("cannot run
# with network enabled in root network namespace"); so under runsc a sandbox never has a network, even with
# NBEXEC_NETWORK=1;
# --host-uds=create, so the sockets the kernel binds in the bind-mounted /run/nbexec are real host sockets nbexec
# connects to from outside, while code in the sandbox still cannot connect to a host socket it sees through a
# mount (--host-uds=all would allow that too).
WANTED=$(RUNSC=$(command -v runsc) CRUN=$(command -v crun || true) WITH_CRUN=$WITH_CRUN python3 -c '
import json, os
wanted = {"runsc": {"path": os.environ["RUNSC"], "runtimeArgs": ["--network=none", "--host-uds=create"]}}
if os.environ["WITH_CRUN"] == "1":
    wanted["crun"] = {"path": os.environ["CRUN"]}
print(json.dumps(wanted))')
export WANTED

DAEMON_JSON=$DAEMON_JSON python3 - <<'PY'
import json, os, sys

path = os.environ["DAEMON_JSON"]
wanted = json.loads(os.environ["WANTED"])
try:
    with open(path) as f:
        config = json.load(f)
except FileNotFoundError:
    config = {}
if not isinstance(config, dict) or not isinstance(config.get("runtimes", {}), dict):
    sys.exit(f"{path} is not a JSON object with a \"runtimes\" object; fix it by hand")
runtimes = config.setdefault("runtimes", {})
if all(runtimes.get(name) == entry for name, entry in wanted.items()) and config.get("experimental") is True:
    print(f"{path} already registers {', '.join(wanted)}")
    sys.exit(0)
runtimes.update(wanted)
config["experimental"] = True  # docker checkpoint (gVisor memory of hibernated sessions); read at engine start only
os.makedirs(os.path.dirname(path), exist_ok=True)
tmp = path + ".nbexec-tmp"
with open(tmp, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
os.chmod(tmp, 0o644)
os.replace(tmp, path)
print(f"{path}: registered {', '.join(wanted)}")
PY

# Whether the running engine has every wanted entry exactly (a changed entry needs a reload too).
engine_matches() {
    docker info --format '{{json .Runtimes}}' 2>/dev/null | python3 -c '
import json, os, sys
engine, wanted = json.load(sys.stdin), json.loads(os.environ["WANTED"])
sys.exit(0 if all(engine.get(name) == entry for name, entry in wanted.items()) else 1)'
}
if ! engine_matches; then
    pid=$(pidof dockerd || true)
    if [ -z "$pid" ]; then
        echo "setup-gvisor.sh: dockerd is not running; start it and it will read $DAEMON_JSON" >&2
        exit 1
    fi
    kill -HUP $pid  # reload the configuration; running containers keep running
    for _ in $(seq 1 60); do
        engine_matches && break
        sleep 0.5
    done
    if ! engine_matches; then
        echo "setup-gvisor.sh: Docker did not take the runtimes in $DAEMON_JSON after a reload; see \`docker info\`" \
             "and the engine's log" >&2
        exit 1
    fi
fi
# Whether the running engine serves `docker checkpoint`, asked of the route itself. Never judged from `docker info`:
# after a reload its ExperimentalBuild says true, but the engine adds the checkpoint routes only when it starts, and
# answers 501 until a restart. 404 (no such container) means the route is there.
engine_checkpoints() {
    python3 - <<'PY'
import http.client, os, socket, sys

host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


class Unix(http.client.HTTPConnection):
    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(host[len("unix://"):])


if host.startswith("unix://"):
    conn = Unix("localhost", timeout=10)
elif host.startswith("tcp://"):
    conn = http.client.HTTPConnection(host[len("tcp://"):], timeout=10)
else:
    sys.exit(2)
try:
    conn.request("GET", "/containers/nbexec-checkpoint-route-probe/checkpoints")
    status = conn.getresponse().status
except OSError:
    sys.exit(2)
sys.exit(0 if status in (200, 404) else 1)
PY
}
if ! engine_checkpoints; then
    if [ "$RESTART" = 1 ]; then
        if ! { systemctl restart docker 2>/dev/null || service docker restart 2>/dev/null; }; then
            # No init system (a container, or scripts/setup.sh started dockerd by hand): stop it, start it again.
            pid=$(pidof dockerd || true)
            [ -n "$pid" ] && kill $pid
            for _ in $(seq 1 60); do pidof dockerd >/dev/null || break; sleep 0.5; done
            nohup setsid dockerd >>/var/log/nbexec-dockerd.log 2>&1 &
        fi
        for _ in $(seq 1 120); do
            engine_checkpoints && break
            sleep 0.5
        done
        engine_checkpoints || {
            echo "setup-gvisor.sh: the engine came back without its checkpoint routes (\"experimental\": true in" \
                 "$DAEMON_JSON); see its log" >&2; exit 1; }
    else
        echo "setup-gvisor.sh: the running engine cannot checkpoint (its checkpoint route answers 501: $DAEMON_JSON" \
             "sets \"experimental\": true, which the engine reads only when it starts): restart it (systemctl restart" \
             "docker, or run this script with --restart) so hibernated gVisor sessions keep their memory (until then" \
             "they replay)" >&2
    fi
fi
echo "Docker runtimes: $(docker info --format '{{range $name, $_ := .Runtimes}}{{$name}} {{end}}')"
