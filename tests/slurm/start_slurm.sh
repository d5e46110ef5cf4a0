#!/usr/bin/env bash
# Install, configure and start a one-node SLURM on localhost, so the test suite can submit the
# smoke workflow through profiles/slurm to a real SLURM (tests/test_slurm.py, .ci/run).
#
# Idempotent: with the same config and SLURM up it only checks that the node is idle; a changed
# config restarts the daemons. Needs root and Debian's packages (slurmctld slurmd slurm-client
# munge, installed from the Debian registry if missing); no systemd and no cgroups
# (containers): the daemons are started directly. No accounting database: job status comes
# from `squeue` (profiles/slurm sets slurm-status-command: squeue), and SLURM's own record of
# every finished job is the job-completion log at $SLURM_JOBCOMP_LOG (default
# /var/log/slurm/jobcomp.log), written by slurmctld through jobcomp/script: one line per job
# with its id, name, state, exit code, work dir and stdout path.
#
# Every wait is bounded; exits non-zero with a message saying what did not start.
set -euo pipefail

JOBCOMP_LOG=${SLURM_JOBCOMP_LOG:-/var/log/slurm/jobcomp.log}
WAIT_S=${SLURM_START_WAIT_S:-60}
CONF=/etc/slurm/slurm.conf
MARK="# written by cluster-ft tests/slurm/start_slurm.sh"

die() { echo "start_slurm.sh: $*" >&2; exit 1; }
log() { echo "start_slurm.sh: $*" >&2; }

[ "$(id -u)" = 0 ] || die "needs root (installs packages, starts slurmctld/slurmd/munged)"
# Never overwrite a SLURM configuration this script did not write (a real cluster's node).
if [ -s "$CONF" ] && ! grep -qs "$MARK" "$CONF" && [ "${SLURM_START_OVERWRITE:-0}" != 1 ]; then
  die "$CONF exists and was not written by this script: not touching it (SLURM_START_OVERWRITE=1 replaces it)"
fi

node_state() { timeout -s KILL 10 sinfo -h -N -o %t 2>/dev/null | head -n1 || true; }

# 1. Packages (apt does not start the services in containers).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "slurm is not installed and apt-get is missing"
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  timeout -s KILL 300 apt-get update -qq >/dev/null || die "apt-get update failed"
  timeout -s KILL 600 apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null || die "apt-get install of slurm/munge failed"
fi

# 2. The hostname must resolve, or slurmctld cannot find itself.
HOST=$(hostname -s)
if ! getent hosts "$HOST" >/dev/null; then
  echo "127.0.0.1 $HOST" >> /etc/hosts
fi

# 3. munge (refuses to run as root): a key, then munged as the munge user.
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null; then mungekey -c -f -k /etc/munge/munge.key
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! timeout -s KILL 5 munge -n </dev/null 2>/dev/null | timeout -s KILL 5 unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --force || die "munged did not start"
  for _ in $(seq 20); do
    timeout -s KILL 5 munge -n </dev/null 2>/dev/null | timeout -s KILL 5 unmunge >/dev/null 2>&1 && break
    sleep 0.5
  done
  timeout -s KILL 5 munge -n </dev/null | timeout -s KILL 5 unmunge >/dev/null \
    || die "munge does not work (munged not answering on /run/munge)"
fi

# 4. slurm.conf: one node (this host, its CPUs, its memory minus 1 GB), one partition `main`.
# (not OMP_NUM_THREADS's count: GNU nproc honours it, and a test run with it set to 1 would
# give the node one CPU, where the 2-rank jobs then pend forever as PartitionConfig)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
[ -n "$MEM" ] || die "slurmd -C did not report RealMemory"
MEM=$((MEM > 2048 ? MEM - 1024 : MEM))
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
chown -R slurm:slurm /var/lib/slurm /var/log/slurm
touch "$JOBCOMP_LOG" && chown slurm:slurm "$JOBCOMP_LOG"
# jobcomp/filetxt (Slurm 22.05) records the job name but neither the stdout path nor the
# comment, and the snakemake plugin names every job of a run by the run's id: the rule is only
# in the job's stdout path (.snakemake/slurm_logs/rule_<rule>/...). This script records both.
JOBCOMP_SCRIPT=/etc/slurm/jobcomp.sh
{
  echo '#!/bin/sh'
  echo '# slurmctld (jobcomp/script) runs this at the end of every job: one line per job.'
  echo 'echo "JobId=$JOBID Name=$JOBNAME JobState=$JOBSTATE ExitCode=$EXITCODE' \
       'Partition=$PARTITION Procs=$PROCS Start=$START End=$END WorkDir=$WORK_DIR' \
       "StdOut=\$STDOUT\" >> $JOBCOMP_LOG"
} > "$JOBCOMP_SCRIPT.new"
chmod 755 "$JOBCOMP_SCRIPT.new" && mv "$JOBCOMP_SCRIPT.new" "$JOBCOMP_SCRIPT"
cat > "$CONF.new" <<EOF
$MARK
ClusterName=localcluster
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# finished jobs stay visible to squeue for 5 min (the snakemake plugin polls squeue)
MinJobAge=300
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# SLURM's own record of every finished job (no accounting database needed): slurmctld runs
# this script at each job's end; it appends the job's id, name, state and stdout path
JobCompType=jobcomp/script
JobCompLoc=$JOBCOMP_SCRIPT
DefMemPerCPU=1000
KillWait=5
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=main Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
CHANGED=1
if [ -f "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then CHANGED=0; fi
mv "$CONF.new" "$CONF"
chmod 644 "$CONF"

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [ "$CHANGED" = 1 ]; then
  # a new config: restart the daemons we may have started before
  for pidf in /run/slurmd.pid /run/slurmctld.pid; do
    if running "$pidf"; then
      pid=$(cat "$pidf"); kill "$pid" || true
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && die "old daemon $pid ($pidf) did not stop"
    fi
  done
fi

# 5. Start the daemons (they daemonise).
if ! running /run/slurmctld.pid; then
  slurmctld || die "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
fi
for _ in $(seq "$WAIT_S"); do
  timeout -s KILL 5 scontrol ping 2>/dev/null | grep -q UP && break
  sleep 1
done
timeout -s KILL 5 scontrol ping 2>/dev/null | grep -q UP \
  || die "slurmctld is not answering after ${WAIT_S}s (see /var/log/slurm/slurmctld.log)"
if ! running /run/slurmd.pid; then
  slurmd || die "slurmd did not start (see /var/log/slurm/slurmd.log)"
fi

# 6. Wait (bounded) until the node is idle; resume it if it came up drained/down.
for i in $(seq "$WAIT_S"); do
  state=$(node_state)
  case "$state" in
    idle|mix|alloc) log "SLURM up: node $HOST $state, $CPUS CPUs, ${MEM} MB; job log $JOBCOMP_LOG"; exit 0 ;;
    drain*|down*) [ "$i" -gt 3 ] && timeout -s KILL 5 scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
die "node $HOST not idle after ${WAIT_S}s (state '$(node_state)'; $(timeout -s KILL 5 sinfo -h -N -o %E 2>/dev/null | head -n1)); see /var/log/slurm/slurmd.log"
