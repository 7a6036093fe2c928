#!/usr/bin/env bash
# Bring up a real single-node Slurm cluster on this (Debian, root, no service manager) machine.
# Idempotent: packages, munge key, slurm.conf and daemons are only created / started when missing.
#
#   .ci/slurm_up.sh            # then: sinfo; sbatch --wait ...
#
# Facts this relies on (see issue 6): munged refuses to run as root, so /run/munge is created and
# munged runs as the munge user; nothing starts daemons here, so slurmctld and slurmd are started
# directly; no cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none) and no
# accounting; EnforcePartLimits=ALL turns an impossible request into a submit error instead of a
# job pending forever.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "slurm_up: must run as root (installs packages, starts munged/slurmctld/slurmd)" >&2
  exit 3
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
   || ! command -v sbatch >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

HOST=$(hostname -s)
CPUS=$(nproc --all)
MEM_MB=$(awk '/MemTotal/ {print int($2/1024) - 512}' /proc/meminfo)
CONF_DIR=/etc/slurm
SPOOL=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
LOG_DIR=/var/log/slurm
mkdir -p "$CONF_DIR" "$SPOOL" "$SLURMD_SPOOL" "$LOG_DIR" /run/slurm

# --- munge -----------------------------------------------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  su -s /bin/sh munge -c "/usr/sbin/munged --force" || runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# --- slurm.conf ------------------------------------------------------------------------------
CONF="$CONF_DIR/slurm.conf"
NEW_CONF=$(cat <<CONFEOF
# Written by .ci/slurm_up.sh: one node ($HOST, $CPUS CPUs), no cgroups, no accounting.
ClusterName=draftheads-ci
SlurmctldHost=$HOST
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$SPOOL
SlurmdSpoolDir=$SLURMD_SPOOL
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
Waittime=0
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONFEOF
)
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ]; then
  printf '%s\n' "$NEW_CONF" > "$CONF"
  CONF_CHANGED=1
else
  CONF_CHANGED=0
fi

# --- daemons ---------------------------------------------------------------------------------
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$CONF_CHANGED" = 1 ]; then
  # node definitions (CPUs, memory) only take effect on a restart; `scontrol reconfigure` refuses them
  for pidfile in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid; do
    if running "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 100); do running "$pidfile" || break; sleep 0.1; done
    fi
  done
fi
running /run/slurm/slurmctld.pid || /usr/sbin/slurmctld
running /run/slurm/slurmd.pid || /usr/sbin/slurmd

for _ in $(seq 100); do
  state=$(sinfo -h -n "$HOST" -o '%T' 2>/dev/null | head -n1 || true)
  case "$state" in
    idle*|mixed*|allocated*) break ;;
    down*|drain*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 0.2
done
state=$(sinfo -h -n "$HOST" -o '%T' 2>/dev/null | head -n1 || true)
case "$state" in
  idle*|mixed*|allocated*) echo "slurm_up: node $HOST is $state ($CPUS CPUs)" ;;
  *) echo "slurm_up: node $HOST is '${state:-unknown}'; see $LOG_DIR/slurmctld.log and slurmd.log" >&2; exit 1 ;;
esac
