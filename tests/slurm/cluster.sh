#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests that launch through srun (root only):
# munged as the munge user, then slurmctld and slurmd, the node in one partition. Idempotent: a
# daemon already running is left as it is. Exits 0 once the node is idle, 1 otherwise.
set -euo pipefail
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/log/munge /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
pgrep -x munged > /dev/null || runuser -u munge -- /usr/sbin/munged
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=zaya
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
pgrep -x slurmctld > /dev/null || /usr/sbin/slurmctld
pgrep -x slurmd > /dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then exit 0; fi
  sleep 1
done
echo "the Slurm node did not come up; see /var/log/slurm/" >&2
exit 1
