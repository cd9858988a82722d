#!/usr/bin/env bash
# Emulated two-level interconnect for benchmarks/step_bench.py --netns --mesh 2,2: 4 ranks, each in
# its own network namespace (mfb-r<k>, veth "NIC" mfb0 at 10.77.0.(10+k)/24, the same names as
# setup.sh so step_bench's --netns finds them), on two "nodes":
#
#   node A: bridge mfbna, ranks 0 and 1      node B: bridge mfbnb, ranks 2 and 3
#   mfbna <-- veth pair mfbla|mfblb, tbf RATE on both ends --> mfbnb     (the slow inter-node link)
#
# Veths within a node are NOT shaped (they run at what the CPU moves, ~10 Gbit/s on 2 cores). The
# inter-node veth pair is one full-duplex link of RATE each way, SHARED by all traffic between the
# nodes (under HSDP at (2,2) both replicate groups {0,2} and {1,3} cross it at the same time).
# One L2 segment (one /24): the bridges forward to each other through the link.
#
#   sudo benchmarks/netns/setup_two_level.sh [RATE] [BURST]   e.g. setup_two_level.sh 1gbit
#   sudo benchmarks/netns/teardown.sh                          removes everything named mfb*
#
# RATE "none" leaves the link unshaped. Needs root, iproute2, CONFIG_VETH/BRIDGE/NET_SCH_TBF; no
# latency emulation (netem is not in the dev kernel). Rank k = r*2 + s of the (dp_replicate,
# dp_shard) mesh: shard groups {0,1} and {2,3} are the nodes, replicate groups cross the link.
set -euo pipefail
RATE=${1:-1gbit}
BURST=${2:-512kb}
PREFIX=mfb
SUBNET=10.77.0
W=4

if [[ $EUID -ne 0 ]]; then echo "setup_two_level.sh: needs root" >&2; exit 1; fi
"$(dirname "$0")/teardown.sh" >/dev/null 2>&1 || true

for node in a b; do
  ip link add "${PREFIX}n$node" type bridge
  ip link set "${PREFIX}n$node" up
done
ip addr add "$SUBNET.1/24" dev "${PREFIX}na"      # the root namespace can reach the ranks (debugging)
# the inter-node link
ip link add "${PREFIX}la" type veth peer name "${PREFIX}lb"
ip link set "${PREFIX}la" master "${PREFIX}na"
ip link set "${PREFIX}lb" master "${PREFIX}nb"
ip link set "${PREFIX}la" up
ip link set "${PREFIX}lb" up
if [[ "$RATE" != none ]]; then
  # egress of each end: node A -> node B on mfbla, node B -> node A on mfblb
  tc qdisc add dev "${PREFIX}la" root tbf rate "$RATE" burst "$BURST" latency 100ms
  tc qdisc add dev "${PREFIX}lb" root tbf rate "$RATE" burst "$BURST" latency 100ms
fi
for ((k = 0; k < W; k++)); do
  ns="$PREFIX-r$k"; host="${PREFIX}h$k"
  if ((k < 2)); then br="${PREFIX}na"; else br="${PREFIX}nb"; fi
  ip netns add "$ns"
  ip link add "$host" type veth peer name "${PREFIX}0" netns "$ns"
  ip link set "$host" master "$br"
  ip link set "$host" up
  ip -n "$ns" addr add "$SUBNET.$((10 + k))/24" dev "${PREFIX}0"
  ip -n "$ns" link set "${PREFIX}0" up
  ip -n "$ns" link set lo up
done
echo "two-level netns ready: ranks 0,1 on mfbna, ranks 2,3 on mfbnb, inter-node link rate=$RATE burst=$BURST;" \
     "rank k runs as: ip netns exec $PREFIX-rk ... with GLOO_SOCKET_IFNAME=${PREFIX}0, address $SUBNET.(10+k)"
