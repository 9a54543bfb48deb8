#!/usr/bin/env bash
# Real hosts on one machine: one network namespace per worker, each with its
# own address, the workers of a datacenter on one bridge, the datacenters
# joined through a router, every worker's traffic to other datacenters
# rate-limited in the kernel with `tc ... tbf`. `xdmoe launch --netns` runs a
# job inside them.
#
#   scripts/netns-cluster.sh up --dcs N --workers-per-dc M --inter-dc-rate R [--inter-dc-delay D]
#   scripts/netns-cluster.sh throttle --inter-dc-rate R      change the tbf rate of a running cluster
#   scripts/netns-cluster.sh status                          namespaces, addresses, tbf counters
#   scripts/netns-cluster.sh down                            remove everything it made (safe twice)
#
# Layout (N DCs of M workers):
#   namespace xd-d<d>w<i>   worker i of DC d: eth0 10.77.<d>.<i+1>/24, default via 10.77.<d>.254.
#                           eth0's egress: an htb qdisc whose class 1:2 holds a tbf of rate R
#                           (handle 20:; the htb classes themselves do not limit); u32
#                           filters send packets to other DCs' addresses there, packets
#                           inside the DC and to the coordinator to 1:1. So each worker has
#                           its own inter-DC link of rate R, as the job's link classes (and
#                           the planner) describe it.
#   namespace xd-r          the router: bridge br<d> (10.77.<d>.254) per DC; up0
#                           (10.77.255.2) leads to this machine.
#   this machine            xd-root 10.77.255.1: where the coordinator listens; a route to
#                           10.77.0.0/16 through the router.
# Rates are tc's: 100mbit, 1gbit, 500kbit. The kernel's netem is missing on
# these machines, so --inter-dc-delay is not applied by the kernel: it is
# recorded in the state file, and the workers add the job's configured latency
# of the inter-DC link class in the process.
# State: /run/xdmoe-netns/cluster.json (read by xdmoe launch --netns and by the
# coordinator's throttle). Needs root.
set -euo pipefail

state_dir=${XDMOE_NETNS_STATE:-/run/xdmoe-netns}
state=$state_dir/cluster.json
router=xd-r

usage() { sed -n '2,26p' "$0"; }
die() { echo "netns-cluster: $*" >&2; exit 2; }
need_root() {
  [ "$(id -u)" -eq 0 ] || { echo "netns-cluster: $1 needs root (network namespaces, veth pairs and tc); run it with sudo" >&2; exit 3; }
  command -v ip >/dev/null && command -v tc >/dev/null || { echo "netns-cluster: ip and tc are missing (apt-get install iproute2)" >&2; exit 3; }
}

# "100mbit" -> bits per second
rate_bits() {
  local r=$1 n unit
  n=$(echo "$r" | sed -E 's/^([0-9]+(\.[0-9]+)?).*/\1/')
  unit=$(echo "$r" | sed -E 's/^[0-9]+(\.[0-9]+)?//' | tr 'A-Z' 'a-z')
  [ -n "$n" ] && [ "$n" != "$r" -o -z "$unit" ] || die "bad rate '$r' (e.g. 100mbit)"
  case "$unit" in
    bit|"") awk -v n="$n" 'BEGIN{printf "%.0f", n}' ;;
    kbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e3}' ;;
    mbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e6}' ;;
    gbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e9}' ;;
    *) die "bad rate unit in '$r' (bit, kbit, mbit, gbit)" ;;
  esac
}

# tbf's bucket: a 4 ms burst at the rate, at least 64 KB (one GSO segment).
tbf_args() {
  local bits=$1 burst
  burst=$(awk -v b="$bits" 'BEGIN{x=b/8*0.004; if (x < 65536) x = 65536; printf "%.0f", x}')
  echo "rate ${bits}bit burst $burst latency 100ms"
}

down() {
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^xd-(r|d[0-9]+w[0-9]+)$' || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del xd-root 2>/dev/null || true
  ip route del 10.77.0.0/16 2>/dev/null || true
  # The state, the throttles' tc logs beside it, and its folder once empty.
  rm -f "$state" "$state".tc*.log
  rmdir "$state_dir" 2>/dev/null || true
}

cmd=${1:-}
[ $# -gt 0 ] && shift
dcs=2 per_dc=2 rate=100mbit delay=0ms
while [ $# -gt 0 ]; do
  case "$1" in
    --dcs) dcs=$2; shift 2 ;;
    --workers-per-dc) per_dc=$2; shift 2 ;;
    --inter-dc-rate) rate=$2; shift 2 ;;
    --inter-dc-delay) delay=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

case "$cmd" in
  up)
    need_root up
    [[ "$dcs" =~ ^[0-9]+$ && "$dcs" -ge 1 && "$dcs" -le 250 ]] || die "--dcs must be 1..250"
    [[ "$per_dc" =~ ^[0-9]+$ && "$per_dc" -ge 1 && "$per_dc" -le 250 ]] || die "--workers-per-dc must be 1..250"
    bits=$(rate_bits "$rate")
    down
    ip netns add $router || { echo "netns-cluster: cannot create network namespaces here (ip netns add failed)" >&2; exit 3; }
    # Any later step that fails (no veth, no bridge, no tbf in this kernel)
    # means the cluster cannot be built here: undo what was made and say which.
    trap 'echo "netns-cluster: cannot build the cluster here: \"$BASH_COMMAND\" failed" >&2; trap - ERR; down; exit 3' ERR
    ip -n $router link set lo up
    ip netns exec $router sysctl -q -w net.ipv4.ip_forward=1
    ip link add xd-root type veth peer name up0 netns $router
    ip addr add 10.77.255.1/30 dev xd-root
    ip link set xd-root up
    ip -n $router addr add 10.77.255.2/30 dev up0
    ip -n $router link set up0 up
    ip route add 10.77.0.0/16 via 10.77.255.2
    workers_json=""
    for d in $(seq 0 $((dcs - 1))); do
      ip -n $router link add br$d type bridge
      ip -n $router addr add 10.77.$d.254/24 dev br$d
      ip -n $router link set br$d up
    done
    for d in $(seq 0 $((dcs - 1))); do
      for i in $(seq 0 $((per_dc - 1))); do
        ns=xd-d${d}w$i
        ip netns add $ns
        ip -n $ns link set lo up
        ip link add v${d}w$i netns $router type veth peer name eth0 netns $ns
        ip -n $router link set v${d}w$i master br$d up
        ip -n $ns addr add 10.77.$d.$((i + 1))/24 dev eth0
        ip -n $ns link set eth0 up
        ip -n $ns route add default via 10.77.$d.254
        # Inter-DC egress through the tbf; the DC's own subnet and the coordinator's bypass it.
        ip netns exec $ns tc qdisc add dev eth0 root handle 1: htb default 1
        ip netns exec $ns tc class add dev eth0 parent 1: classid 1:1 htb rate 100gbit quantum 65536
        ip netns exec $ns tc class add dev eth0 parent 1: classid 1:2 htb rate 100gbit quantum 65536
        ip netns exec $ns tc qdisc add dev eth0 parent 1:2 handle 20: tbf $(tbf_args "$bits")
        ip netns exec $ns tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.77.$d.0/24 flowid 1:1
        ip netns exec $ns tc filter add dev eth0 parent 1: protocol ip prio 2 u32 match ip dst 10.77.255.0/24 flowid 1:1
        ip netns exec $ns tc filter add dev eth0 parent 1: protocol ip prio 3 u32 match ip dst 10.77.0.0/16 flowid 1:2
        workers_json="$workers_json${workers_json:+,}{\"ns\": \"$ns\", \"address\": \"10.77.$d.$((i + 1))\", \"dc\": $d}"
      done
    done
    mkdir -p "$state_dir"
    cat > "$state.tmp" <<JSON
{"dcs": $dcs, "workers_per_dc": $per_dc, "inter_dc_rate": "$rate", "inter_dc_rate_bits_per_s": $bits,
 "inter_dc_delay": "$delay", "router": "$router", "tbf": {"dev": "eth0", "parent": "1:2", "handle": "20:"},
 "coordinator_address": "10.77.255.1", "workers": [$workers_json]}
JSON
    mv "$state.tmp" "$state"
    echo "netns-cluster: up: $dcs DCs x $per_dc workers, inter-DC tbf $rate (10.77.<dc>.<worker+1>; coordinator side 10.77.255.1)"
    if [ "$delay" != "0ms" ] && [ "$delay" != "0" ]; then
      echo "netns-cluster: note: netem is missing here, so the $delay inter-DC delay is added in the process, not the kernel"
    fi
    ;;
  throttle)
    need_root throttle
    [ -f "$state" ] || die "no cluster is up ($state missing)"
    bits=$(rate_bits "$rate")
    for ns in $(ip netns list | awk '{print $1}' | grep -E '^xd-d[0-9]+w[0-9]+$'); do
      ip netns exec "$ns" tc qdisc change dev eth0 parent 1:2 handle 20: tbf $(tbf_args "$bits")
    done
    python3 - "$state" "$rate" "$bits" <<'PY'
import json, os, sys
path, rate, bits = sys.argv[1:]
state = json.load(open(path))
state["inter_dc_rate"], state["inter_dc_rate_bits_per_s"] = rate, int(bits)
with open(path + ".tmp", "w") as f:
    json.dump(state, f, indent=1)
os.replace(path + ".tmp", path)
PY
    echo "netns-cluster: inter-DC tbf now $rate"
    ;;
  status)
    if [ ! -f "$state" ]; then echo "netns-cluster: down"; exit 1; fi
    cat "$state"
    for ns in $(ip netns list | awk '{print $1}' | grep -E '^xd-d[0-9]+w[0-9]+$' | sort); do
      echo "--- $ns: inter-DC tbf"
      ip netns exec "$ns" tc -s qdisc show dev eth0 parent 1:2
    done
    ;;
  down)
    need_root down
    down
    echo "netns-cluster: down"
    ;;
  *)
    usage
    exit 2
    ;;
esac
