#!/usr/bin/env bash
# Remove every namespace and link setup.sh or setup_two_level.sh created (namespaces mfb-r*, and
# every root-namespace link named mfb*: veths mfbh*, bridges mfbbr / mfbna / mfbnb, the inter-node
# link mfbla|mfblb). Idempotent.
set -u
if [[ $EUID -ne 0 ]]; then echo "teardown.sh: needs root" >&2; exit 1; fi
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^mfb-r' || true); do
  ip netns del "$ns"
done
# veth ends first (usually gone with their namespace peer), bridges last
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^mfb(h[0-9]+|l[ab])$' || true); do
  ip link del "$l" 2>/dev/null || true
done
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^mfb(br|n[ab])$' || true); do
  ip link del "$l" 2>/dev/null || true
done
echo "netns removed"
