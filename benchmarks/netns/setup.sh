#!/usr/bin/env bash
# Emulated interconnect for benchmarks/step_bench.py --netns: one network namespace per rank,
# each with a veth "NIC" (mfb0, 10.77.0.(10+k)/24) plugged into a Linux bridge in the root
# namespace, and a token-bucket (tbf) rate limit on BOTH ends of every veth, so each rank's
# egress and ingress are capped at RATE (a per-rank full-duplex link through a non-blocking switch).
#
#   sudo benchmarks/netns/setup.sh W [RATE] [BURST]      e.g. setup.sh 4 4gbit
#   sudo benchmarks/netns/teardown.sh                    removes everything named mfb-*
#
# RATE "none" skips tc. Needs root (CAP_NET_ADMIN), iproute2, CONFIG_VETH/BRIDGE/NET_SCH_TBF.
# Measured on the dev VM (kernel 6.18): netns, veth, bridge, tbf, htb work; netem does NOT
# (CONFIG_NET_SCH_NETEM is not set: "Specified qdisc kind is unknown"), so no latency/loss
# emulation, only bandwidth. Note veth throughput is itself CPU-bound (~10 Gbit/s unshaped on 2 cores).
set -euo pipefail
W=${1:?usage: setup.sh W [RATE] [BURST]}
RATE=${2:-4gbit}
BURST=${3:-512kb}
PREFIX=mfb
BR=${PREFIX}br
SUBNET=10.77.0

if [[ $EUID -ne 0 ]]; then echo "setup.sh: needs root" >&2; exit 1; fi
"$(dirname "$0")/teardown.sh" >/dev/null 2>&1 || true

ip link add "$BR" type bridge
ip addr add "$SUBNET.1/24" dev "$BR"
ip link set "$BR" up
for ((k = 0; k < W; k++)); do
  ns="$PREFIX-r$k"; host="${PREFIX}h$k"
  ip netns add "$ns"
  ip link add "$host" type veth peer name "${PREFIX}0" netns "$ns"
  ip link set "$host" master "$BR"
  ip link set "$host" up
  ip -n "$ns" addr add "$SUBNET.$((10 + k))/24" dev "${PREFIX}0"
  ip -n "$ns" link set "${PREFIX}0" up
  ip -n "$ns" link set lo up
  if [[ "$RATE" != none ]]; then
    # egress of the rank (upload) and egress of the bridge port toward the rank (download)
    ip netns exec "$ns" tc qdisc add dev "${PREFIX}0" root tbf rate "$RATE" burst "$BURST" latency 100ms
    tc qdisc add dev "$host" root tbf rate "$RATE" burst "$BURST" latency 100ms
  fi
done
echo "netns ready: W=$W rate=$RATE; rank k runs as: ip netns exec $PREFIX-rk ... with GLOO_SOCKET_IFNAME=${PREFIX}0, address $SUBNET.(10+k)"
