#!/usr/bin/env bash
# A real Slurm cluster for the tests: munge, MariaDB + slurmdbd (sacct, which the Snakemake
# Slurm executor polls), slurmctld, and three compute nodes:
#   $(hostname -s)   this machine, two fake GPUs declared by gres (partition debug, default)
#   ddpn1, ddpn2     two more hosts, each a network namespace with its own address on a
#                    private bridge (10.77.0.0/24), its own hostname and its own slurmd
#                    (partition pair): multi-node jobs meet across a real network hop
#   bash tests/setup/slurm.sh          (idempotent; root)
# The fake GPUs are character devices (/dev/null's numbers) so that Slurm schedules them and
# hands each job its own CUDA_VISIBLE_DEVICES; without CUDA the jobs train on the CPU.
set -euo pipefail
state=${DDPFLOW_SLURM_STATE:-/var/tmp/ddpflow-slurm}
host=$(hostname -s)
net=10.77.0
pair=(ddpn1 ddpn2)
mkdir -p "$state"

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmdbd >/dev/null 2>&1 \
   || ! command -v mariadbd >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge slurmdbd mariadb-server >/dev/null
fi

if [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = 3 ] \
   && sacctmgr -n show user root 2>/dev/null | grep -q root; then
  echo "slurm: cluster already up"
  exit 0
fi

# --- the two namespaced hosts: a bridge on this machine, a veth pair and an address each
if ! ip link show ddpfbr0 >/dev/null 2>&1; then
  ip link add ddpfbr0 type bridge
  ip addr add "$net.1/24" dev ddpfbr0
fi
ip link set ddpfbr0 up
for i in 1 2; do
  ns=${pair[$((i - 1))]}
  if ! ip netns list | grep -qw "$ns"; then
    ip netns add "$ns"
    ip link add "ddpfv$i" type veth peer name eth0 netns "$ns"
    ip link set "ddpfv$i" master ddpfbr0 up
    ip -n "$ns" addr add "$net.1$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" route add default via "$net.1"
  fi
  grep -qE "^$net.1$i[[:space:]]" /etc/hosts || echo "$net.1$i $ns" >>/etc/hosts
done

# --- munge
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n >/dev/null 2>&1; then
  runuser -u munge -- munged
  for _ in $(seq 1 20); do munge -n >/dev/null 2>&1 && break; sleep 0.25; done
fi
munge -n >/dev/null

# --- MariaDB for slurmdbd (data under $state)
mkdir -p /run/mysqld
if [ ! -d "$state/mysql/mysql" ]; then
  mariadb-install-db --user=root --datadir="$state/mysql" >"$state/mysql-install.log" 2>&1
fi
if ! mariadb-admin --socket=/run/mysqld/mysqld.sock ping >/dev/null 2>&1; then
  nohup mariadbd --user=root --datadir="$state/mysql" --socket=/run/mysqld/mysqld.sock \
    --skip-networking=0 --bind-address=127.0.0.1 >"$state/mysqld.log" 2>&1 &
  for _ in $(seq 1 60); do
    mariadb-admin --socket=/run/mysqld/mysqld.sock ping >/dev/null 2>&1 && break; sleep 0.5
  done
fi

# --- fake GPUs
mkdir -p "$state/gpu"
for i in 0 1; do
  [ -c "$state/gpu/nvidia$i" ] || mknod -m666 "$state/gpu/nvidia$i" c 1 3
done

# --- configuration (must be /etc/slurm: the executor's job step drops SLURM_CONF)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurmd
cat >/etc/slurm/slurm.conf <<CONF
ClusterName=ddpflow
SlurmctldHost=$host($net.1)
SlurmdPidFile=/run/slurmd/slurmd.pid
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MinJobAge=600
ReturnToService=2
GresTypes=gpu
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageEnforce=associations
AccountingStorageTRES=gres/gpu
JobRequeue=1
KillWait=30
NodeName=$host CPUs=$(nproc) RealMemory=$mem Gres=gpu:2 State=UNKNOWN
NodeName=${pair[0]} NodeAddr=$net.11 CPUs=$(nproc) RealMemory=$((mem / 4)) State=UNKNOWN
NodeName=${pair[1]} NodeAddr=$net.12 CPUs=$(nproc) RealMemory=$((mem / 4)) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=pair Nodes=${pair[0]},${pair[1]} MaxTime=INFINITE State=UP
CONF
cat >/etc/slurm/gres.conf <<CONF
AutoDetect=off
NodeName=$host Name=gpu File=$state/gpu/nvidia[0-1]
CONF
cat >/etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
CONF
chmod 600 /etc/slurm/slurmdbd.conf

# --- daemons
if ! sacctmgr -n show cluster >/dev/null 2>&1; then
  slurmdbd
  for _ in $(seq 1 40); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.5; done
fi
sacctmgr -i add cluster ddpflow >/dev/null 2>&1 || true
sacctmgr -i add account ddpflow Description=tests Organization=ddpflow >/dev/null 2>&1 || true
sacctmgr -i add user root Account=ddpflow >/dev/null 2>&1 || true
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
pgrep -x slurmctld >/dev/null || slurmctld
running /run/slurmd/slurmd.pid || slurmd
# each namespaced host's slurmd: its network namespace, its own hostname (UTS namespace) and
# its own spool, pid and log folders (bind-mounted in a mount namespace of its own)
for ns in "${pair[@]}"; do
  d=$state/$ns
  mkdir -p "$d/spool" "$d/run" "$d/log"
  # no name server is reachable from the bridge: the hosts resolve each other from
  # /etc/hosts, and a DNS query (the AAAA record of ddpn1, a reverse lookup) must fail at
  # once instead of waiting 10 s for a server that never answers
  printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"$d/resolv.conf"
  running "$d/run/slurmd.pid" && continue
  # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs /sys/fs/cgroup
  nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c "hostname $ns \
    && mount --bind $d/spool /var/spool/slurmd && mount --bind $d/run /run/slurmd \
    && mount --bind $d/log /var/log/slurm \
    && { mount --bind $d/resolv.conf /etc/resolv.conf || true; } && exec slurmd"
done
up() { [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = 3 ]; }
for _ in $(seq 1 60); do
  up && break; sleep 0.5
done
if ! up; then
  scontrol update NodeName="$host,${pair[0]},${pair[1]}" State=RESUME >/dev/null 2>&1 || true
  sleep 2
fi
sinfo -N
up || { tail -20 /var/log/slurm/slurmctld.log; tail -5 "$state"/ddpn*/log/slurmd.log; exit 1; }
echo "slurm: cluster up (node $host with 2 fake GPUs; nodes ${pair[*]} on $net.0/24)"
