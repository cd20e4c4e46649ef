#!/usr/bin/env bash
# A private Slurm on this one host, for tests: its own slurm.conf, munge key and socket, state
# and spool folders, and free ports, all under DIR; one or two nodes (two slurmd on this host,
# n1 and n2, both at 127.0.0.1 on ports of their own). Needs root and Debian's packages:
#   apt-get install --no-install-recommends slurmctld slurmd slurm-client munge
#
#   ci/slurm.sh start DIR [--nodes 1|2] [--cpus N]   bring it up; prints `export SLURM_CONF=...`
#   ci/slurm.sh status DIR                            its daemons and nodes
#   ci/slurm.sh stop DIR                              cancel its jobs, stop exactly its daemons
#
# Jobs get SLURM_CONF=DIR/slurm.conf; `srun`, `sbatch` and `scontrol` need it in their
# environment. A fresh DIR is a fresh cluster (job ids start at 1: name checkpoint folders by
# something else than the job id).
set -euo pipefail

usage() {
  echo "usage: ci/slurm.sh start DIR [--nodes 1|2] [--cpus N] | status DIR | stop DIR" >&2
  exit 2
}

[ $# -ge 2 ] || usage
action=$1 dir=$2
shift 2
nodes=1 cpus=2
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=${2:-}; shift 2 ;;
    --cpus) cpus=${2:-}; shift 2 ;;
    *) usage ;;
  esac
done
case $nodes in 1|2) ;; *) echo "ci/slurm.sh: --nodes $nodes: use 1 or 2" >&2; exit 2 ;; esac
case $cpus in ''|*[!0-9]*|0) echo "ci/slurm.sh: --cpus $cpus: use a whole number >= 1" >&2; exit 2 ;; esac

# Ports that nothing listens on (a second cluster on a first one's ports answers from the first)
free_ports() {
  python3 - "$1" <<'EOF'
import random, socket, sys
want, found = int(sys.argv[1]), []
while len(found) < want:
    base = random.randrange(20000, 60000)
    found = []
    for port in range(base, base + want):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                break
        found.append(port)
print(" ".join(map(str, found)))
EOF
}

pids() {  # the pid files of the daemons DIR started, munged last
  ls "$dir"/run/slurmd-*.pid "$dir"/run/slurmctld.pid "$dir"/run/munged.pid 2>/dev/null || true
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_gone() {  # up to 10 s for the process of pid file $1 to end; then SIGKILL
  local pid i
  pid=$(cat "$1" 2>/dev/null) || return 0
  for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

start() {
  if [ "$(id -u)" != 0 ]; then echo "ci/slurm.sh: needs root (slurmd runs jobs as their users)" >&2; exit 1; fi
  for tool in munged slurmctld slurmd srun sbatch scontrol; do
    command -v "$tool" >/dev/null || { echo "ci/slurm.sh: $tool not found: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge" >&2; exit 1; }
  done
  for f in $(pids); do
    if alive "$f"; then echo "ci/slurm.sh: $dir already runs a cluster (stop it first)" >&2; exit 1; fi
  done
  mkdir -p "$dir"/{run,log,state,spool,munge}
  dir=$(cd "$dir" && pwd)
  chmod 755 "$dir" "$dir/munge"  # munged and slurmstepd look up paths inside
  local host ports
  host=$(hostname -s)
  read -r -a ports <<<"$(free_ports $((nodes + 1)))"

  # munge: a key of this cluster's own, its socket under DIR
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munge.seed"

  local node_lines="" names=""
  for n in $(seq "$nodes"); do
    node_lines+="NodeName=n$n NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[$n]} CPUs=$cpus State=UNKNOWN"$'\n'
    names+="${names:+,}n$n"
  done
  cat >"$dir/slurm.conf" <<EOF
# written by ci/slurm.sh: a private cluster on one host
ClusterName=xpnnci
# job ids of their own: two such clusters on one host (test runs side by side) must not both
# run a job 1, which names files and sockets of the job's on the host
FirstJobId=$(( (RANDOM << 8 | RANDOM % 256) % 9000000 + 1000 ))
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire=5: a requeued job starts again in seconds, not the default 120 s
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
# no binding: two nodes on one host share its cores, and task/affinity would put the first
# rank of each on core 0; ranks take their CPU count from the allocation
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=bf_interval=2,sched_interval=2
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait=5
$node_lines
PartitionName=ci Nodes=$names Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -c
  for n in $(seq "$nodes"); do slurmd -N "n$n"; done

  # ready: every node idle
  local i
  for i in $(seq 150); do
    if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$nodes" ]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.1
  done
  echo "ci/slurm.sh: the nodes did not come up in 15 s; logs in $dir/log:" >&2
  sinfo -N >&2 || true
  tail -n 5 "$dir"/log/*.log >&2 || true
  stop
  exit 1
}

stop() {
  [ -f "$dir/slurm.conf" ] || { echo "ci/slurm.sh: no cluster in $dir" >&2; return 0; }
  export SLURM_CONF="$dir/slurm.conf"
  # jobs first: daemons stopped under a running job leave its slurmstepd behind
  if alive "$dir/run/slurmctld.pid"; then
    scancel --full --quiet --partition=ci 2>/dev/null || true
    local i
    for i in $(seq 100); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  local f daemons
  daemons=$(ls "$dir"/run/slurmd-*.pid "$dir"/run/slurmctld.pid 2>/dev/null || true)
  for f in $daemons; do  # Slurm's daemons together, then munge, which they talk to
    alive "$f" && kill -TERM "$(cat "$f")" 2>/dev/null
  done
  for f in $daemons "$dir/run/munged.pid"; do
    [ "$f" = "$dir/run/munged.pid" ] && alive "$f" && kill -TERM "$(cat "$f")" 2>/dev/null
    wait_gone "$f"
    rm -f "$f"
  done
}

status() {
  [ -f "$dir/slurm.conf" ] || { echo "no cluster in $dir"; exit 1; }
  local f up=0
  for f in $(pids); do
    if alive "$f"; then echo "$(basename "$f" .pid): running (pid $(cat "$f"))"; up=1; else echo "$(basename "$f" .pid): stopped"; fi
  done
  [ $up = 1 ] || exit 1
  SLURM_CONF="$dir/slurm.conf" sinfo -N
}

case $action in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
